"""A tiny training setup for the checkpoint tests, also run as a child-process script.

    python tests/support/helpers_train.py kill CONFIG.json    # trains, saves slowly, prints save markers
    python tests/support/helpers_train.py resume JOBS.json   # resumes each job, saves losses and state
    python tests/support/helpers_train.py signal CONFIG.json  # slow steps and saves, for SIGTERM/SIGINT

Markers are lines "KIND STEP MONOTONIC_TIME" on stdout.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ipuloop
from ipuloop import Callback, Loop
from ipuloop import checkpoint_io as ckpt_mod
from ipuloop.callbacks.checkpoint import ModelCheckpoint

MICRO, FEATURES, CLASSES, STEPS_PER_EPOCH = 2, 6, 3, 4


class IndexedData(Dataset):
    """Fixed random samples plus a loss-scale column (1, or NaN/inf to poison a sample).

    Logs the indices read while ``recording`` is set (single-process loading only).
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        self.scale = torch.ones(n, 1)
        self.log: list[int] = []
        self.recording = False

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recording:
            self.log.append(int(i))
        return torch.cat([self.x[i], self.scale[i]]), self.y[i]


class TinyMLP(nn.Module):
    """A model-with-loss with dropout; the last input column multiplies each sample's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, CLASSES)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        out = self.net(x[:, :-1])
        if y is None:
            return out
        per_sample = nn.functional.cross_entropy(out, y, reduction="none") * x[:, -1]
        return out, ipuloop.poptorch.identity_loss(per_sample, reduction="mean")


class SlowMLP(TinyMLP):
    """TinyMLP whose forward sleeps ``delay`` seconds: a host call that takes a while."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        time.sleep(self.delay)
        return super().forward(x, y)


class Recorder(Callback):
    """Per-step losses; turns the dataset's index log on for the fit (after the loop's probe)."""

    def __init__(self, dataset: IndexedData | None = None) -> None:
        self.dataset, self.losses = dataset, []

    def on_fit_start(self, loop: Loop) -> None:
        if self.dataset is not None:
            self.dataset.recording = True

    def on_train_step_end(self, loop: Loop) -> None:
        self.losses.append(loop.state.logs["loss"])

    def on_fit_end(self, loop: Loop) -> None:
        if self.dataset is not None:
            self.dataset.recording = False

    on_exception = on_fit_end


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, loop: Loop) -> None:
        if loop.state.step == self.step:
            loop.stop()


def samples_for(di: int, ga: int) -> int:
    combined = MICRO * di * ga
    return (STEPS_PER_EPOCH + 1) * combined - 1  # combined - 1 samples dropped every epoch


def make_loop(
    di: int = 1,
    ga: int = 1,
    workers: int = 0,
    *,
    callbacks: list = (),
    init_seed: int = 0,
    seed: int = 1,
    generator: bool = False,
    all_outputs: bool = False,
    shuffle: bool = True,
    n: int | None = None,
    step_delay: float = 0.0,
    optimizer: Any = None,
) -> tuple[Loop, DataLoader, IndexedData]:
    """The loop, its loader and dataset; ``optimizer``: a function of the parameters (default
    AdamW, lr 0.02)."""
    torch.manual_seed(init_seed)
    model = SlowMLP(step_delay) if step_delay else TinyMLP()  # same weights either way
    pt = ipuloop.poptorch
    opts = pt.Options().deviceIterations(di)
    opts.Training.gradientAccumulation(ga)
    if all_outputs:
        opts.outputMode(pt.OutputMode.All)
    optimizer = (optimizer or (lambda p: pt.optim.AdamW(p, lr=0.02)))(model.parameters())
    ds = IndexedData(n or samples_for(di, ga))
    loader = DataLoader(
        ds,
        batch_size=MICRO,
        shuffle=shuffle,
        num_workers=workers,
        persistent_workers=workers > 0,  # reused iterators: the harder case
        generator=torch.Generator().manual_seed(7) if generator else None,
    )
    loop = Loop(
        model, opts, optimizer=optimizer, callbacks=list(callbacks), seed=seed, progress=False
    )
    return loop, loader, ds


def comparable(sd: dict[str, Any]) -> dict[str, Any]:
    """A state dict without what legitimately differs between two runs (callback states)."""
    return {k: v for k, v in sd.items() if k != "callbacks"}


class _Markers(Callback):
    order = 95  # after ModelCheckpoint (90): "save-end" follows the save

    def on_save_checkpoint(self, loop: Loop) -> None:
        print(f"save-start {loop.state.step} {time.monotonic()}", flush=True)

    def on_train_step_end(self, loop: Loop) -> None:
        print(f"save-end {loop.state.step} {time.monotonic()}", flush=True)


def _kill_mode(cfg: dict[str, Any]) -> None:
    ckpt_mod.CHUNK = cfg["chunk"]

    def slow_disk(path: Path, offset: int) -> None:
        # A slow disk; the manifest (one chunk) slowly too, so that kills also land in the commit.
        if path.name == ckpt_mod.MANIFEST and cfg.get("commit_marker"):
            step = path.parent.name.rsplit("step", 1)[-1]
            print(f"commit-start {step} {time.monotonic()}", flush=True)
        time.sleep(cfg["delay"] if path.name == ckpt_mod.STATE else cfg["commit_delay"])

    ckpt_mod.write_hook = slow_disk
    cb = ModelCheckpoint(cfg["dirpath"], every_n_steps=1, every_n_epochs=None, save_top_k=2)
    loop, loader, _ = make_loop(cfg["di"], cfg["ga"], callbacks=[cb, _Markers()])
    loop.fit(loader, epochs=cfg["epochs"])
    print("done", flush=True)


class _SignalMarkers(Callback):
    """Markers for the signal tests; a slow ``on_exception`` if asked (cleanup that hangs)."""

    order = -100  # first at every event: "step-start" before the step's other hooks

    def __init__(self, exception_delay: float) -> None:
        self.exception_delay = exception_delay

    def on_fit_start(self, loop: Loop) -> None:
        print(f"ready 0 {time.monotonic()}", flush=True)

    def on_train_step_start(self, loop: Loop) -> None:
        print(f"step-start {loop.state.step} {time.monotonic()}", flush=True)

    def on_exception(self, loop: Loop) -> None:
        print(f"on-exception {loop.state.step} {time.monotonic()}", flush=True)
        time.sleep(self.exception_delay)


def _signal_mode(cfg: dict[str, Any]) -> None:
    """Trains with slow host calls and slow saves (one per step), a user SIGTERM handler."""
    # Ctrl-C must raise KeyboardInterrupt here, also when started with SIGINT ignored (nohup,
    # a background job): Python installs its handler only if SIGINT was not ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ckpt_mod.CHUNK = cfg["chunk"]
    ckpt_mod.write_hook = lambda path, offset: time.sleep(cfg["delay"])
    calls: list[int] = []

    def user_handler(signum: int, frame: Any) -> None:
        calls.append(signum)  # no printing here: a handler can interrupt a print

    signal.signal(signal.SIGTERM, user_handler)
    if cfg.get("stall_file"):  # once the file exists, loader workers hang on each sample
        get = IndexedData.__getitem__

        def stalling(self: IndexedData, i: int) -> Any:
            if Path(cfg["stall_file"]).exists():
                time.sleep(60)
            return get(self, i)

        IndexedData.__getitem__ = stalling  # before the workers fork
    cb = ModelCheckpoint(cfg["dirpath"], every_n_steps=1, save_top_k=cfg.get("top_k", 1))
    loop, loader, _ = make_loop(
        cfg["di"],
        cfg["ga"],
        cfg.get("workers", 0),
        callbacks=[_SignalMarkers(cfg.get("exception_delay", 0.0)), cb, _Markers()],
        step_delay=cfg["step_delay"],
    )
    try:
        loop.fit(loader, epochs=cfg["epochs"])
    except SystemExit as e:
        restored = (
            signal.getsignal(signal.SIGTERM) is user_handler
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        print(f"exit {e.code} {time.monotonic()}", flush=True)
        print(f"user-handler {len(calls)} 0", flush=True)
        print(f"restored {int(restored)} 0", flush=True)
        raise
    print(f"done {loop.state.step} {time.monotonic()}", flush=True)


def _resume_mode(jobs: list[dict[str, Any]]) -> None:
    for job in jobs:
        rec = Recorder()
        loop, loader, _ = make_loop(
            job["di"], job["ga"], job["workers"], callbacks=[rec], init_seed=123, seed=99
        )  # both overwritten by the resume
        loop.fit(loader, epochs=job["epochs"], resume_from=job["path"])
        torch.save({"losses": rec.losses, "state": comparable(loop.state_dict())}, job["out"])


if __name__ == "__main__":
    torch.set_num_threads(1)  # as the tests do: the same kernels, so bitwise-equal results
    mode, config = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    {"kill": _kill_mode, "resume": _resume_mode, "signal": _signal_mode}[mode](config)
