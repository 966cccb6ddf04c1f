#!/usr/bin/env python
"""Loop overhead and scaling: ipuloop against a hand-written torch loop and Lightning.

Run from the repository root; ``docs/performance.md`` lists the commands behind every number.

    python benchmarks/overhead.py            # everything: results.json, the tables beside it
                                             # (results.md), the plot

Variants, timed in ONE process, interleaved (the order rotates every repeat), medians:

    hand            a hand-written torch loop doing the emulator's math: host batch split into
                    micro-batches in [DI, GA, RF, B] order, loss * 1/(GA*RF) before backward,
                    one optimizer step per device iteration (torch.optim)
    raw             ipuloop.poptorch.trainingModel called over a poptorch.DataLoader (the
                    PopTorch tutorial's loop; default output mode Final)
    loop            Loop.fit(progress=False), no callbacks, no metrics (output mode Sum)
    loop_callbacks  Loop.fit with the usual callbacks: the progress display writing to a
                    non-terminal stream, a torchmetrics accuracy (output mode All), and
                    ModelCheckpoint once per epoch
    pl_barebones    lightning Trainer(barebones=True) (when lightning is installed)
    pl_defaults     lightning Trainer defaults (progress bar, logger, checkpoint per epoch),
                    self.log(loss, prog_bar=True) every step and a torchmetrics accuracy

How a step is timed. Every variant reads the SAME dataset object through a torch DataLoader
(or the poptorch.DataLoader built on it) with the same collate function, which records
time.perf_counter() when it collates a host batch (one clock read, the same in every
variant). The time per step of a fit is the time from the first collate after the warm-up
steps to the last collate, divided by the steps between them: compile, model and Trainer
construction are outside it; per-epoch work (checkpoint, epoch logs, the next epoch's order)
is inside it, because each fit runs two epochs and the window crosses the boundary. Each
repeat runs every variant once, in a rotated order; a variant's time is the median over
repeats, and a ratio is the ratio of the medians. Before timing, every variant trains the
same initial weights on the same data and must end with the hand-written loop's weights
(max |difference| <= 1e-5): the ratios compare loops doing the same math.

The DI x GA sweep runs each (configuration, variant) in its own subprocess, for peak memory
(see ``_peak_child``), repeats them interleaved, and reports medians.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import io
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a file from a checkout without installing
    sys.path.insert(0, str(ROOT))

VARIANTS = ("hand", "raw", "loop", "loop_callbacks", "pl_barebones", "pl_defaults")
SWEEP_VARIANTS = ("hand", "loop_sum", "loop_final", "loop_all")
TOL = 1e-5  # max |weight difference| for "computes the same thing"
README_BEGIN, README_END = "<!-- overhead:begin -->", "<!-- overhead:end -->"


# ---------------------------------------------------------------------------------------------
# Workloads


class MLPWithLoss(nn.Module):
    """The host-bound workload: Linear(32, 32), ReLU, Linear(32, 10) and cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        out = self.net(x)
        return out if labels is None else (out, self.loss(out, labels))


@dataclass
class Workload:
    name: str
    micro: int  # B
    di: int
    ga: int
    dataset: TensorDataset
    make_net: Callable[[], nn.Module]  # a model-with-loss: (output, loss) with labels
    init_state: dict
    torch_opt: Callable[[Any], torch.optim.Optimizer]  # hand-written and Lightning
    poptorch_opt: Callable[[Any], torch.optim.Optimizer]  # raw PopTorch and the Loop
    options: Callable[[], Any]  # fresh poptorch.Options
    description: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def combined(self) -> int:  # samples per host call (RF = 1)
        return self.micro * self.di * self.ga

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.combined

    def fresh(self) -> nn.Module:
        net = self.make_net()
        net.load_state_dict(copy.deepcopy(self.init_state))
        return net.train()

    def subset(self, steps: int) -> Workload:
        """The same workload on the first ``steps`` host batches of the data."""
        n = steps * self.combined
        ds = type(self.dataset)(*(t[:n] for t in self.dataset.tensors))
        return Workload(**{**self.__dict__, "dataset": ds})


class _Rows(tuple):
    """A host batch already gathered by ``BatchedTensorDataset.__getitems__``."""


class BatchedTensorDataset(TensorDataset):
    """A TensorDataset that a DataLoader reads one host batch at a time.

    torch's fetcher calls ``__getitems__`` with the batch's indices when a dataset has it: one
    gather per tensor instead of one (x, y) pair of tensor views per sample. Per-sample reads
    create three Python objects per sample, and at host batches of thousands of samples the
    cyclic garbage collector they trigger costs more than the reads (2.6 -> 6.5 us/sample from
    320 to 3200 samples per batch here): the DI sweep uses this dataset so that it measures how
    the loop scales with DI, not the collector. Use ``collate`` below with it.
    """

    def __getitems__(self, indices: list[int]) -> _Rows:
        idx = torch.as_tensor(indices)
        return _Rows(t[idx] for t in self.tensors)


def collate(batch: Any) -> Any:
    """default_collate, passing a batch gathered by ``BatchedTensorDataset`` through."""
    return list(batch) if isinstance(batch, _Rows) else default_collate(batch)


def _data(
    kind: str, n: int, mnist_dir: str | None, seed: int = 0, batched: bool = False
) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    cls = BatchedTensorDataset if batched else TensorDataset
    if kind == "mlp":
        return cls(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    if mnist_dir:
        from ipuloop.examples.mnist import load_mnist

        full = load_mnist(mnist_dir, train=True)
        x, y = full.tensors
        reps = -(-n // len(x))
        return cls(x.repeat(reps, 1, 1, 1)[:n].clone(), y.repeat(reps)[:n].clone())
    # MNIST-shaped synthetic data, normalised like the example's (mean 0, std 1).
    return cls(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def make_workload(
    kind: str,
    di: int,
    ga: int,
    steps: int,
    mnist_dir: str | None = None,
    micro: int | None = None,
    batched: bool = False,
) -> Workload:
    from ipuloop import poptorch

    torch.manual_seed(0)
    if kind == "mlp":
        b = micro or 32
        net = MLPWithLoss()

        def opts() -> Any:
            o = poptorch.Options().deviceIterations(di)
            o.Training.gradientAccumulation(ga)
            return o

        return Workload(
            "mlp",
            b,
            di,
            ga,
            _data("mlp", steps * b * di * ga, None, batched=batched),
            MLPWithLoss,
            copy.deepcopy(net.state_dict()),
            lambda p: torch.optim.SGD(p, lr=0.01),
            lambda p: poptorch.optim.SGD(p, lr=0.01),
            opts,
            f"tiny MLP 32-32-10, cross-entropy, SGD lr 0.01, B={b}, DI={di}, GA={ga}",
        )
    if kind == "cnn":
        from ipuloop.examples.mnist import (
            Network,
            TrainingModelWithLoss,
            build_options,
            strategy_for,
        )

        b = micro or 40
        net = TrainingModelWithLoss(Network())

        # The example's options: 4 stages, pipelined where GA allows it, so smaller GAs (the
        # DI x GA sweep) run the stages sharded: the same computation on the emulator.
        strategy = strategy_for(ga)

        def opts() -> Any:
            args = argparse.Namespace(
                device_iterations=di,
                gradient_accumulation=ga,
                replicas=1,
                strategy=strategy,
                offload_optimiser=False,
                inference_iterations=100,
            )
            return build_options(args)[0]

        data = "real MNIST (" + mnist_dir + ")" if mnist_dir else "synthetic MNIST-shaped data"
        return Workload(
            "cnn",
            b,
            di,
            ga,
            _data("cnn", steps * b * di * ga, mnist_dir, batched=batched),
            lambda: TrainingModelWithLoss(Network()),
            copy.deepcopy(net.state_dict()),
            lambda p: torch.optim.AdamW(p, lr=1e-3),
            lambda p: poptorch.optim.AdamW(p, lr=1e-3),
            opts,
            f"MNIST CNN of ipuloop.examples.mnist (4 {strategy} blocks), AdamW lr 1e-3, "
            f"B={b}, DI={di}, GA={ga}, {data}",
        )
    raise ValueError(f"unknown workload {kind!r}")


# ---------------------------------------------------------------------------------------------
# The clock: a collate function that stamps each host batch


class Stamps:
    """``collate_fn`` recording when each batch is collated; one clock read per batch."""

    def __init__(self) -> None:
        self.t: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, samples: list) -> Any:
        self.t.append(time.perf_counter())
        self.cpu.append(time.process_time())
        return collate(samples)


# ---------------------------------------------------------------------------------------------
# Variants: each trains ``epochs`` epochs from the workload's initial weights and returns the
# trained model-with-loss (weights readable on the host) and how many collates make one step.


def run_hand(wl: Workload, epochs: int, collate: Stamps) -> tuple[nn.Module, int]:
    net = wl.fresh()
    opt = wl.torch_opt(net.parameters())
    loader = DataLoader(
        wl.dataset, batch_size=wl.combined, shuffle=False, drop_last=True, collate_fn=collate
    )
    b, di, ga = wl.micro, wl.di, wl.ga
    scale = 1.0 / ga  # Mean reduction over GA * RF micro-batches (RF = 1)
    for _ in range(epochs):
        for x, y in loader:
            # [DI, GA, RF, B] order; one micro-batch per call needs no split
            xs, ys = (x.split(b), y.split(b)) if di * ga > 1 else ((x,), (y,))
            total = 0.0
            for d in range(di):
                for a in range(ga):
                    _, loss = net(xs[d * ga + a], ys[d * ga + a])
                    (loss * scale if scale != 1.0 else loss).backward()
                    total += loss.detach()
                opt.step()
                opt.zero_grad(set_to_none=True)
            step_loss = float(total)  # the step's loss on the host, as every loop logs it
    del step_loss
    return net, 1


def run_raw(wl: Workload, epochs: int, collate: Stamps) -> tuple[nn.Module, int]:
    from ipuloop import poptorch

    net = wl.fresh()
    opts = wl.options()
    model = poptorch.trainingModel(net, opts, optimizer=wl.poptorch_opt(net.parameters()))
    loader = poptorch.DataLoader(opts, wl.dataset, batch_size=wl.micro, collate_fn=collate)
    for _ in range(epochs):
        for x, y in loader:
            _, loss = model(x, y)
            step_loss = float(loss.sum())
    del step_loss
    return net, 1  # reading ``net`` copies the device weights back


def _loop_fit(
    wl: Workload,
    epochs: int,
    collate: Stamps,
    *,
    callbacks: list,
    metrics: Any,
    mode: str | None = None,
) -> nn.Module:
    from ipuloop import Loop, poptorch

    net = wl.fresh()
    opts = wl.options()
    if mode is not None:
        opts.outputMode(getattr(poptorch.OutputMode, mode))
    loop = Loop(
        net,
        opts,
        optimizer=wl.poptorch_opt(net.parameters()),
        progress=False,
        callbacks=callbacks,
        metrics=metrics,
    )
    loop.fit(
        DataLoader(wl.dataset, batch_size=wl.micro, shuffle=False, collate_fn=collate),
        epochs=epochs,
    )
    return loop.model


def run_loop(wl: Workload, epochs: int, collate: Stamps) -> tuple[nn.Module, int]:
    return _loop_fit(wl, epochs, collate, callbacks=[], metrics=None), 1


_CHECKPOINT: dict[str, Any] = {}


def checkpoint_class() -> Any:
    """``ipuloop.callbacks.checkpoint.ModelCheckpoint``, or None (recorded in the results)."""
    if "cls" not in _CHECKPOINT:
        try:
            from ipuloop.callbacks.checkpoint import ModelCheckpoint

            _CHECKPOINT.update(cls=ModelCheckpoint, status="ModelCheckpoint every epoch")
        except ImportError as e:
            _CHECKPOINT.update(cls=None, status=f"skipped: cannot import ModelCheckpoint ({e})")
            print(
                f"note: loop_callbacks runs WITHOUT a checkpoint: {_CHECKPOINT['status']}",
                flush=True,
            )
    return _CHECKPOINT["cls"]


def run_loop_callbacks(wl: Workload, epochs: int, collate: Stamps) -> tuple[nn.Module, int]:
    import torchmetrics

    from ipuloop import ProgressBar

    callbacks: list = [ProgressBar(stream=io.StringIO())]  # a non-terminal stream: plain lines
    cls = checkpoint_class()
    with tempfile.TemporaryDirectory(prefix="ipuloop-bench-") as tmp:
        if cls is not None:
            callbacks.append(cls(tmp))
        metrics = {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=10)}
        return _loop_fit(wl, epochs, collate, callbacks=callbacks, metrics=metrics), 1


def lightning_available() -> str | None:
    try:
        import lightning

        return lightning.__version__
    except ImportError:
        return None


def _run_lightning(
    wl: Workload, epochs: int, collate: Stamps, barebones: bool
) -> tuple[nn.Module, int]:
    import lightning.pytorch as pl
    import torchmetrics

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    class Module(pl.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net
            self.acc = (
                None if barebones else torchmetrics.Accuracy(task="multiclass", num_classes=10)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            out, loss = self.net(x, y)
            if self.acc is not None:
                self.acc.update(out.detach(), y)
                self.log("loss", loss, prog_bar=True)
                self.log("train_acc", self.acc, on_step=False, on_epoch=True)
            return loss

        def configure_optimizers(self) -> Any:
            return wl.torch_opt(self.net.parameters())

    net = wl.fresh()
    module = Module(net)
    loader = DataLoader(wl.dataset, batch_size=wl.micro, shuffle=False, collate_fn=collate)
    with tempfile.TemporaryDirectory(
        prefix="ipuloop-bench-pl-"
    ) as tmp, warnings.catch_warnings(), contextlib.redirect_stderr(
        io.StringIO()
    ), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        kw: dict[str, Any] = dict(
            max_epochs=epochs,
            accelerator="cpu",
            devices=1,
            accumulate_grad_batches=wl.ga,
            default_root_dir=tmp,
        )
        trainer = pl.Trainer(barebones=True, **kw) if barebones else pl.Trainer(**kw)
        trainer.fit(module, loader)  # the bar writes to the redirected (non-terminal) stderr
    return net, wl.di * wl.ga  # Lightning reads micro-batches: DI*GA collates per step


def run_pl_barebones(wl: Workload, epochs: int, collate: Stamps) -> tuple[nn.Module, int]:
    return _run_lightning(wl, epochs, collate, barebones=True)


def run_pl_defaults(wl: Workload, epochs: int, collate: Stamps) -> tuple[nn.Module, int]:
    return _run_lightning(wl, epochs, collate, barebones=False)


def _sweep_loop(mode: str) -> Callable:
    def run(wl: Workload, epochs: int, collate: Stamps) -> tuple[nn.Module, int]:
        return _loop_fit(wl, epochs, collate, callbacks=[], metrics=None, mode=mode), 1

    return run


RUNNERS: dict[str, Callable] = {
    "hand": run_hand,
    "raw": run_raw,
    "loop": run_loop,
    "loop_callbacks": run_loop_callbacks,
    "pl_barebones": run_pl_barebones,
    "pl_defaults": run_pl_defaults,
    "loop_sum": _sweep_loop("Sum"),
    "loop_final": _sweep_loop("Final"),
    "loop_all": _sweep_loop("All"),
}


# ---------------------------------------------------------------------------------------------
# Measurement


def timed_fit(variant: str, wl: Workload, epochs: int, warmup: int) -> dict[str, float]:
    """One fit; the time per step over the steps after ``warmup`` (see the module doc)."""
    collate = Stamps()
    gc.collect()
    start = time.perf_counter()
    _, per_step = RUNNERS[variant](wl, epochs, collate)
    total = time.perf_counter() - start
    steps = wl.steps_per_epoch * epochs
    stamps = collate.t[-steps * per_step :: per_step]  # the last ones: skips the Loop's probe
    cpu = collate.cpu[-steps * per_step :: per_step]
    if len(stamps) != steps:
        raise RuntimeError(f"{variant}: expected {steps} host batches, saw {len(stamps)}")
    window, cpu = stamps[warmup:], cpu[warmup:]
    if len(window) < 2:
        raise ValueError(f"{variant}: {steps} steps leave no window after {warmup} warm-up steps")
    gaps = [b - a for a, b in zip(window, window[1:])]
    return {
        "step_s": (window[-1] - window[0]) / len(gaps),
        "median_gap_s": statistics.median(gaps),
        "cpu_step_s": (cpu[-1] - cpu[0]) / len(gaps),
        "fit_s": total,
    }


def max_weight_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)


def check_equivalence(wl: Workload, variants: list[str], steps: int) -> dict[str, float]:
    """Train every variant for 2 epochs of ``steps`` steps; max |w - w_hand| per variant."""
    small = wl.subset(steps)
    ref, _ = run_hand(small, 2, Stamps())
    out = {}
    for v in variants:
        if v == "hand":
            continue
        net, _ = RUNNERS[v](small, 2, Stamps())
        out[v] = max_weight_diff(ref, net)
    return out


def measure_workload(kind: str, args: argparse.Namespace, variants: list[str]) -> dict[str, Any]:
    if kind == "mlp":
        wl = make_workload("mlp", 1, 1, args.mlp_steps)
        epochs, warmup, reps = 2, args.mlp_warmup, args.repeats
    else:
        wl = make_workload("cnn", 10, 10, args.cnn_steps, args.mnist_dir)
        epochs, warmup, reps = 2, args.cnn_warmup, args.cnn_repeats
    print(
        f"\n== {kind}: {wl.description}; {wl.steps_per_epoch} steps/epoch x {epochs} epochs, "
        f"warm-up {warmup} steps, {reps} repeats",
        flush=True,
    )
    eq = check_equivalence(wl, variants, args.check_steps if kind == "mlp" else 2)
    for v, d in eq.items():
        print(
            f"   same math: {v:15s} max |w - w_hand| = {d:.2e}"
            + ("" if d <= TOL else "   <-- DIFFERS"),
            flush=True,
        )
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(reps):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]  # rotate
        for v in order:
            runs[v].append(timed_fit(v, wl, epochs, warmup))
        print(
            f"   repeat {r + 1}/{reps}: "
            + "  ".join(
                f"{v} {runs[v][-1]['step_s'] * 1e3:.3f}/{runs[v][-1]['cpu_step_s'] * 1e3:.3f}"
                for v in variants
            )
            + "  (ms/step wall/cpu)",
            flush=True,
        )
    res: dict[str, Any] = {
        "description": wl.description,
        "micro_batch": wl.micro,
        "device_iterations": wl.di,
        "gradient_accumulation": wl.ga,
        "samples_per_step": wl.combined,
        "steps_per_epoch": wl.steps_per_epoch,
        "epochs": epochs,
        "warmup_steps": warmup,
        "repeats": reps,
        "equivalence_max_abs_diff": eq,
        "equivalent": all(d <= TOL for d in eq.values()),
        "variants": {},
    }
    for v in variants:
        steps = [x["step_s"] for x in runs[v]]
        res["variants"][v] = {
            "step_s": statistics.median(steps),
            "step_s_repeats": steps,
            "median_gap_s": statistics.median(x["median_gap_s"] for x in runs[v]),
            "cpu_step_s": statistics.median(x["cpu_step_s"] for x in runs[v]),
            "fit_s": statistics.median(x["fit_s"] for x in runs[v]),
            "time_per_sample_us": statistics.median(steps) / wl.combined * 1e6,
        }
    med = {v: res["variants"][v]["step_s"] for v in variants}
    ratios: dict[str, float] = {}
    for v in variants:
        if v != "hand":
            ratios[f"{v}/hand"] = med[v] / med["hand"]
            ratios[f"{v}/hand_paired"] = statistics.median(
                a["step_s"] / b["step_s"] for a, b in zip(runs[v], runs["hand"])
            )
            ratios[f"{v}/hand_cpu"] = (
                res["variants"][v]["cpu_step_s"] / res["variants"]["hand"]["cpu_step_s"]
            )
    for base in ("pl_barebones", "pl_defaults"):
        if base in med:
            for v in ("loop", "loop_callbacks"):
                if v in med:
                    ratios[f"{v}/{base}"] = med[v] / med[base]
                    ratios[f"{v}/{base}_cpu"] = (
                        res["variants"][v]["cpu_step_s"] / res["variants"][base]["cpu_step_s"]
                    )
    res["ratios"] = ratios
    res["overhead_us_per_step"] = {v: (med[v] - med["hand"]) * 1e6 for v in variants if v != "hand"}
    return res


# ---------------------------------------------------------------------------------------------
# Sweep: one subprocess per (configuration, variant), for its peak memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    try:  # Linux >= 4.0: "5" resets the peak resident set size (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One sweep configuration and variant, in a process of its own.

    Peak memory is the peak resident set size during the fit minus the resident size just
    before it (the data set, model and imports). Why RSS and not tracemalloc: tensor storage
    comes from torch's C++ allocator, which tracemalloc does not see, so tracemalloc would miss
    exactly what could grow with DI (host batches, kept outputs, autograd graphs). Why a
    process per configuration: the peak is a process-wide high-water mark, and memory an
    earlier configuration freed stays in the allocator's arenas and would hide later growth.
    The high-water mark is reset just before the fit (/proc/self/clear_refs) where Linux
    allows it, else the process's lifetime peak (getrusage ru_maxrss) is used.
    """
    torch.set_num_threads(spec["threads"])
    wl = make_workload(
        spec["workload"],
        spec["di"],
        spec["ga"],
        spec["steps"],
        spec.get("mnist_dir"),
        batched=spec["batched"],
    )
    # A first short fit pays for imports and lazy initialisation outside the measured one.
    RUNNERS[spec["variant"]](wl.subset(1), 1, Stamps())
    gc.collect()
    base = _rss()
    reset = _reset_peak()
    t = timed_fit(spec["variant"], wl, 1, spec["warmup"])
    peak = _peak()
    sample_bytes = sum(x[0].numel() * x.element_size() for x in wl.dataset.tensors)
    return {
        "step_s": t["step_s"],
        "time_per_sample_us": t["step_s"] / wl.combined * 1e6,
        "cpu_per_sample_us": t["cpu_step_s"] / wl.combined * 1e6,
        "peak_delta_mb": max(peak - base, 0) / 2**20,
        "base_rss_mb": base / 2**20,
        "host_batch_mb": sample_bytes * wl.combined / 2**20,
        "peak_reset": reset,
        "samples_per_step": wl.combined,
    }


def sweep(args: argparse.Namespace, kinds: list[str]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for kind in kinds:
        micro = 32 if kind == "mlp" else 40
        target = args.sweep_samples_mlp if kind == "mlp" else args.sweep_samples_cnn
        configs = [(di, ga) for ga in args.sweep_ga for di in args.sweep_di]
        jobs = []
        for di, ga in configs:
            combined = micro * di * ga
            steps = max(args.sweep_min_steps, -(-target // combined))
            warmup = max(1, steps // 10)
            for v in args.sweep_variants:
                jobs.append(
                    dict(
                        workload=kind,
                        di=di,
                        ga=ga,
                        variant=v,
                        steps=steps,
                        warmup=warmup,
                        threads=args.threads,
                        mnist_dir=args.mnist_dir,
                        batched=args.sweep_data == "batched",
                    )
                )
        reps = args.sweep_repeats if kind == "mlp" else args.sweep_repeats_cnn
        print(
            f"\n== sweep {kind}: DI {args.sweep_di} x GA {args.sweep_ga}, variants "
            f"{list(args.sweep_variants)}, {reps} repeat(s), one process each",
            flush=True,
        )
        results: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(jobs))}
        # glibc raises its mmap threshold (up to 32 MB) each time a large block is freed, after
        # which freed multi-MB host batches stay in the heap: resident memory then depends on
        # allocation history (a 12 MB spread between repeats of one configuration). A fixed
        # threshold returns every block >= 1 MB to the system when freed, so peaks are stable.
        env = {
            **os.environ,
            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "1048576"),
        }
        for r in range(reps):
            order = list(range(len(jobs)))
            shift = (r * 7) % len(jobs)
            for i in order[shift:] + order[:shift]:
                proc = subprocess.run(
                    [sys.executable, __file__, "--_child", json.dumps(jobs[i])],
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                    env=env,
                )
                if proc.returncode:  # recorded and reported; the other configurations go on
                    err = (proc.stderr.strip().splitlines() or ["?"])[-1]
                    print(f"   FAILED {jobs[i]}: {err}", flush=True)
                    results[i].append({"error": err})
                    continue
                results[i].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"   repeat {r + 1}/{reps} done", flush=True)
        rows: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        for i, job in enumerate(jobs):
            row = {k: job[k] for k in ("di", "ga", "variant", "steps", "warmup")}
            rs = [x for x in results[i] if "error" not in x]
            if not rs:
                row["error"] = results[i][0]["error"]
                failed.append(row)
                continue
            for k in ("time_per_sample_us", "cpu_per_sample_us", "step_s", "peak_delta_mb"):
                row[k] = statistics.median(x[k] for x in rs)
            row["time_per_sample_us_repeats"] = [x["time_per_sample_us"] for x in rs]
            row["cpu_per_sample_us_repeats"] = [x["cpu_per_sample_us"] for x in rs]
            row["peak_delta_mb_repeats"] = [x["peak_delta_mb"] for x in rs]
            row["host_batch_mb"] = rs[0]["host_batch_mb"]
            row["samples_per_step"] = rs[0]["samples_per_step"]
            row["peak_reset"] = all(x["peak_reset"] for x in rs)
            rows.append(row)
            print(
                f"   DI {job['di']:3d} GA {job['ga']:2d} {job['variant']:10s} "
                f"{row['time_per_sample_us']:8.2f} us/sample  peak +{row['peak_delta_mb']:7.1f} MB"
                f"  (host batch {row['host_batch_mb']:.1f} MB)",
                flush=True,
            )
        hand = {(r["di"], r["ga"]): r for r in rows if r["variant"] == "hand"}
        for row in rows:
            h = hand.get((row["di"], row["ga"]))
            if h is not None:
                row["peak_over_hand_mb"] = row["peak_delta_mb"] - h["peak_delta_mb"]
        out[kind] = rows
        if failed:
            out[kind + "_failed"] = failed
    return out


# ---------------------------------------------------------------------------------------------
# Targets, JSON, README, plot


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    t: list[dict[str, Any]] = []
    w = results["workloads"]

    def ratio(kind: str, key: str, limit: float, what: str) -> None:
        if kind in w and key in w[kind]["ratios"]:
            v = w[kind]["ratios"][key]
            cpu = w[kind]["ratios"].get(
                key.replace("/hand", "/hand_cpu") if key.endswith("/hand") else key + "_cpu"
            )
            t.append(
                {
                    "target": what,
                    "value": round(v, 4),
                    "limit": limit,
                    "met": v <= limit,
                    "value_cpu": None if cpu is None else round(cpu, 4),
                }
            )

    ratio("cnn", "loop/hand", 1.05, "Loop.fit (no callbacks) / hand-written, MNIST CNN")
    ratio("mlp", "loop/hand", 1.05, "Loop.fit (no callbacks) / hand-written, tiny MLP")
    ratio(
        "cnn", "loop_callbacks/hand", 1.10, "Loop.fit (usual callbacks) / hand-written, MNIST CNN"
    )
    ratio("mlp", "loop/pl_barebones", 0.6, "Loop.fit / Lightning barebones, tiny MLP")
    ratio("mlp", "raw/hand", 1.05, "emulator step (raw trainingModel) / hand-written, tiny MLP")
    ratio("cnn", "raw/hand", 1.05, "emulator step (raw trainingModel) / hand-written, MNIST CNN")
    for kind, rows in results.get("sweep", {}).items():
        if kind.endswith("_failed"):
            t.append(
                {
                    "target": f"sweep configurations that failed ({kind})",
                    "value": len(rows),
                    "limit": 0,
                    "met": False,
                    "value_cpu": None,
                }
            )
            continue
        for v in [x for x in SWEEP_VARIANTS if x != "hand"]:
            for ga in sorted({r["ga"] for r in rows}):
                line = sorted(
                    (r for r in rows if r["variant"] == v and r["ga"] == ga), key=lambda r: r["di"]
                )
                if len(line) < 2:
                    continue
                # "Grows with DI": the time per sample at the largest DI over the smallest.
                # Judged on CPU time (one thread, one process per run): on a shared host, wall
                # time adds whatever other processes took, which scatters single runs by 10-20%.
                first, last = line[0], line[-1]
                span = f"DI={first['di']} to DI={last['di']}"
                growth = last["cpu_per_sample_us"] / first["cpu_per_sample_us"]
                wall = last["time_per_sample_us"] / first["time_per_sample_us"]
                t.append(
                    {
                        "target": f"CPU time per sample does not grow with DI ({kind}, {v}, "
                        f"GA={ga}): {span}",
                        "value": round(growth, 4),
                        "limit": 1.10,
                        "met": growth <= 1.10,
                        "value_wall": round(wall, 4),
                        "value_cpu": None,
                    }
                )
                hand = {r["di"]: r for r in rows if r["variant"] == "hand" and r["ga"] == ga}
                if first["di"] in hand and last["di"] in hand:
                    rel = growth / (
                        hand[last["di"]]["cpu_per_sample_us"]
                        / hand[first["di"]]["cpu_per_sample_us"]
                    )
                    rel_wall = wall / (
                        hand[last["di"]]["time_per_sample_us"]
                        / hand[first["di"]]["time_per_sample_us"]
                    )
                    t.append(
                        {
                            "target": f"... and relative to the hand-written loop at the same "
                            f"DI ({kind}, {v}, GA={ga})",
                            "value": round(rel, 4),
                            "limit": 1.10,
                            "met": rel <= 1.10,
                            "value_wall": round(rel_wall, 4),
                            "value_cpu": None,
                        }
                    )
                if v in ("loop_sum", "loop_final"):
                    # Host batches grow with DI by definition (DI*GA*B samples per call); what
                    # must not grow is the Loop's memory beyond the hand-written loop's.
                    extra = [r["peak_over_hand_mb"] for r in line]
                    growth_mb = extra[-1] - extra[0]
                    allow = 8.0 + 0.25 * line[-1]["host_batch_mb"]
                    t.append(
                        {
                            "target": f"peak memory over the hand-written loop does not grow "
                            f"with DI ({kind}, {v}, GA={ga}): MB added from DI="
                            f"{line[0]['di']} to DI={line[-1]['di']}",
                            "value": round(growth_mb, 2),
                            "limit": round(allow, 2),
                            "met": growth_mb <= allow,
                            "value_cpu": None,
                        }
                    )
    return t


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def readme_section(results: dict[str, Any]) -> str:
    m = results["meta"]
    lines = [
        README_BEGIN,
        "",
        f"Measured {m['date']} on {m['machine']} ({m['cpus']} CPUs, torch threads "
        f"{m['threads']}, load average at start {m['loadavg']}), Python {m['python']}, "
        f"torch {m['torch']}, lightning {m['lightning'] or 'not installed'}. "
        f"Command: `{m['command']}`.",
        "",
    ]
    lines += ["### Time per training step (median over interleaved repeats)", ""]
    names = {
        "hand": "(a) hand-written torch loop",
        "raw": "(b) raw poptorch.trainingModel loop",
        "loop": "(c) Loop.fit, no callbacks",
        "loop_callbacks": "(d) Loop.fit, usual callbacks",
        "pl_barebones": "(e) Lightning Trainer(barebones=True)",
        "pl_defaults": "(e) Lightning Trainer defaults",
    }
    for kind, res in results["workloads"].items():
        lines += [
            f"**{kind}**: {res['description']}; {res['samples_per_step']} samples per step, "
            f"{res['steps_per_epoch']} steps per epoch x {res['epochs']} epochs, first "
            f"{res['warmup_steps']} step(s) dropped, {res['repeats']} repeats. Same weights "
            f"as (a) after training: "
            + ("yes" if res["equivalent"] else "**NO**")
            + " (max |w - w_hand| "
            + ", ".join(f"{v} {d:.1e}" for v, d in res["equivalence_max_abs_diff"].items())
            + ").",
            "",
        ]
        lines += [
            "| variant | ms / step | us / sample | / hand-written | overhead us / step "
            "| CPU ms / step | CPU / hand-written |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for v, r in res["variants"].items():
            ratio = "1" if v == "hand" else f"{res['ratios'][f'{v}/hand']:.3f}"
            cpu = "1" if v == "hand" else f"{res['ratios'][f'{v}/hand_cpu']:.3f}"
            over = "" if v == "hand" else f"{res['overhead_us_per_step'][v]:+.0f}"
            lines.append(
                f"| {names.get(v, v)} | {_fmt_ms(r['step_s'])} | "
                f"{r['time_per_sample_us']:.2f} | {ratio} | {over} | "
                f"{_fmt_ms(r['cpu_step_s'])} | {cpu} |"
            )
        extra = {k: v for k, v in res["ratios"].items() if "/pl_" in k and "_cpu" not in k}
        if extra:
            lines += [
                "",
                "Against Lightning: " + ", ".join(f"{k} = {v:.3f}" for k, v in extra.items()) + ".",
            ]
        lines.append("")
    if results.get("checkpoint"):
        lines += [f"(d) checkpoint: {results['checkpoint']}.", ""]
    if results.get("sweep"):
        lines += [
            "### DI x GA sweep (one process per configuration; medians)",
            "",
            "Peak = peak resident memory during the fit minus the resident memory "
            "before it; host batch = the bytes of one host call's input (DI x GA x B "
            "samples), which any loop holds.",
            "",
        ]
        for kind, rows in results["sweep"].items():
            if kind.endswith("_failed"):
                lines += [
                    f"Failed ({kind}): "
                    + "; ".join(
                        f"DI {r['di']} GA {r['ga']} {r['variant']}: {r['error']}" for r in rows
                    ),
                    "",
                ]
                continue
            lines += [
                f"**{kind}**",
                "",
                "| DI | GA | variant | us / sample | CPU us / sample | peak MB "
                "| peak over hand-written MB | host batch MB |",
                "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            for r in sorted(rows, key=lambda r: (r["ga"], r["variant"], r["di"])):
                lines.append(
                    f"| {r['di']} | {r['ga']} | {r['variant']} | "
                    f"{r['time_per_sample_us']:.2f} | "
                    f"{r.get('cpu_per_sample_us', float('nan')):.2f} | "
                    f"{r['peak_delta_mb']:.1f} | "
                    f"{r.get('peak_over_hand_mb', 0):+.1f} | {r['host_batch_mb']:.2f} |"
                )
            lines.append("")
        if results.get("plot"):
            lines += [f"![time per sample against DI]({results['plot']})", ""]
    if results.get("targets"):
        lines += [
            "### Targets",
            "",
            "The step ratios are judged on wall time (CPU time beside "
            "them); the DI sweep on CPU time (wall time beside it).",
            "",
            "| target | measured | limit | met | other clock |",
            "| --- | ---: | ---: | :---: | ---: |",
        ]
        for t in results["targets"]:
            other = t.get("value_wall", t.get("value_cpu"))
            lines.append(
                f"| {t['target']} | {t['value']} | {t['limit']} | "
                f"{'yes' if t['met'] else '**no**'} | "
                f"{'' if other is None else other} |"
            )
        lines.append("")
    lines.append(README_END)
    return "\n".join(lines)


def write_readme(path: Path, section: str) -> None:
    text = (
        path.read_text()
        if path.exists()
        else "# Benchmarks\n\n" + README_BEGIN + "\n" + README_END + "\n"
    )
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        tail = rest.split(README_END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", flush=True)
        return False
    sw = {k: v for k, v in results["sweep"].items() if not k.endswith("_failed")}
    fig, axes = plt.subplots(1, len(sw), figsize=(6.2 * len(sw), 5.0), squeeze=False)
    styles = {
        "hand": ("black", "o", "hand-written torch"),
        "loop_sum": ("C0", "s", "Loop (Sum)"),
        "loop_final": ("C2", "^", "Loop (Final)"),
        "loop_all": ("C3", "v", "Loop (All)"),
    }
    for ax, (kind, rows) in zip(axes[0], sw.items()):
        for ga, dash in zip(sorted({r["ga"] for r in rows}), ("-", "--", ":")):
            for v in [x for x in styles if any(r["variant"] == x for r in rows)]:
                line = sorted(
                    (r for r in rows if r["variant"] == v and r["ga"] == ga), key=lambda r: r["di"]
                )
                color, marker, label = styles[v]
                ax.plot(
                    [r["di"] for r in line],
                    [r["time_per_sample_us"] for r in line],
                    linestyle=dash,
                    color=color,
                    marker=marker,
                    label=f"{label}, GA={ga}",
                )
        ax.set_xscale("log")
        ax.set_xticks(sorted({r["di"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylim(bottom=0)
        ax.set_xlabel("device iterations (DI)")
        ax.set_ylabel("time per sample (µs)")
        title = {"mlp": "tiny MLP, B=32 (host-bound)", "cnn": "MNIST CNN, B=40"}.get(kind, kind)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(
        "Time per training sample against device iterations (lower is better; "
        "solid GA=1, dashed GA=10)"
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="mlp,cnn", help="comma list of mlp, cnn")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma list of " + ",".join(VARIANTS)
    )
    p.add_argument("--no-lightning", action="store_true", help="skip the Lightning variants")
    p.add_argument("--repeats", type=int, default=15, help="interleaved repeats (MLP)")
    p.add_argument("--cnn-repeats", type=int, default=5)
    p.add_argument("--mlp-steps", type=int, default=500, help="MLP steps per epoch (2 epochs)")
    p.add_argument("--mlp-warmup", type=int, default=50)
    p.add_argument("--cnn-steps", type=int, default=3, help="CNN steps per epoch (2 epochs)")
    p.add_argument("--cnn-warmup", type=int, default=1)
    p.add_argument(
        "--check-steps",
        type=int,
        default=20,
        help="MLP steps per epoch of the same-math check (CNN: 2)",
    )
    p.add_argument(
        "--mnist-dir",
        default=None,
        help="real MNIST (DIR/MNIST/raw) for the CNN instead of synthetic MNIST-shaped tensors",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: "
        "a small shared host; ratios are what this measures)",
    )
    p.add_argument("--sweep-workloads", default="mlp", help="comma list; empty: no sweep")
    p.add_argument("--sweep-di", type=_ints, default=[1, 10, 100])
    p.add_argument("--sweep-ga", type=_ints, default=[1, 10])
    p.add_argument("--sweep-variants", default=",".join(SWEEP_VARIANTS))
    p.add_argument("--sweep-repeats", type=int, default=3)
    p.add_argument("--sweep-repeats-cnn", type=int, default=5)
    p.add_argument(
        "--sweep-data",
        choices=("batched", "per-sample"),
        default="batched",
        help="how the sweep reads its TensorDataset (see BatchedTensorDataset)",
    )
    p.add_argument(
        "--sweep-samples-mlp",
        type=int,
        default=128000,
        help="samples per sweep run (at least --sweep-min-steps steps)",
    )
    p.add_argument("--sweep-samples-cnn", type=int, default=8000)
    p.add_argument("--sweep-min-steps", type=int, default=4)
    p.add_argument("--out", default=str(HERE / "results.json"))
    p.add_argument(
        "--readme",
        default=str(HERE / "results.md"),
        help="the page to write the tables into (beside results.json); '' to leave it alone",
    )
    p.add_argument(
        "--plot", default=str(ROOT / "docs" / "time_per_sample.png"), help="'' for no plot"
    )
    p.add_argument(
        "--replot",
        default=None,
        metavar="RESULTS_JSON",
        help="only redraw --plot from an earlier results file",
    )
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sweep_variants = [v for v in args.sweep_variants.split(",") if v]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("poptorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*samples are dropped.*")
    if args._child:
        print(json.dumps(_peak_child(json.loads(args._child))))
        return 0
    if args.replot:
        return 0 if plot(json.loads(Path(args.replot).read_text()), Path(args.plot)) else 1
    torch.set_num_threads(args.threads)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    if "hand" not in variants:
        variants.insert(0, "hand")
    pl_version = None if args.no_lightning else lightning_available()
    if pl_version is None:
        dropped = [v for v in variants if v.startswith("pl_")]
        variants = [v for v in variants if not v.startswith("pl_")]
        if dropped and not args.no_lightning:
            print(
                "lightning is not installed: Lightning variants skipped "
                "(pip install -e '.[bench]')",
                flush=True,
            )
    if "loop_callbacks" in variants:
        checkpoint_class()
    results: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": pl_version,
            "machine": platform.machine() + " " + platform.system(),
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "command": "python benchmarks/overhead.py "
            + " ".join(a for a in (argv if argv is not None else sys.argv[1:])),
        },
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "workloads": {},
    }
    if "loop_callbacks" in variants:
        results["checkpoint"] = _CHECKPOINT["status"]
    partial = Path(args.out).with_suffix(".partial.json")  # kept only if a later phase fails
    for kind in [k for k in args.workloads.split(",") if k]:
        results["workloads"][kind] = measure_workload(kind, args, variants)
        partial.write_text(json.dumps(results, indent=1) + "\n")
    kinds = [k for k in args.sweep_workloads.split(",") if k]
    if kinds:
        results["sweep"] = sweep(args, kinds)
        if args.plot and plot(results, Path(args.plot)):
            results["plot"] = os.path.relpath(
                args.plot, Path(args.readme).parent if args.readme else HERE
            )
    results["targets"] = targets(results)
    print("\n== targets")
    for t in results["targets"]:
        print(
            f"   {'met ' if t['met'] else 'MISS'}  {t['target']}: {t['value']} (limit {t['limit']})"
        )
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    partial.unlink(missing_ok=True)
    print(f"\nwrote {args.out}", flush=True)
    if args.readme:
        write_readme(Path(args.readme), readme_section(results))
        print(f"wrote the table into {args.readme}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
