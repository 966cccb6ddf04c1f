"""ModelCheckpoint and exact resume: docs/reliability.md §2 items 1, 4, 5, 6, 7, 9 and 16.

A tiny MLP with dropout, shuffled data, AdamW (optimizer state), CPU emulator, one thread.
"Same" means ``==`` on every loss and ``torch.equal`` on every tensor of the loop's state.
"""

from __future__ import annotations

from dataclasses import replace

import functools
import json
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import helpers_train as H
import pytest
import torch
from torch.utils.data import DataLoader
import warm

import ipuloop
from ipuloop import Callback, NonFiniteLossError, backend_name
from ipuloop import checkpoint_io as ck
from ipuloop.callbacks.checkpoint import (
    CheckpointError,
    ModelCheckpoint,
    load_checkpoint,
    read_manifest,
)
from ipuloop.sources import Order

pytestmark = pytest.mark.filterwarnings("ignore:.*samples are dropped each epoch")

KILL_REPEATS = int(os.environ.get("IPULOOP_KILL_REPEATS", "20"))  # docs/reliability.md §2.1: 20
HELPER = Path(__file__).resolve().parents[1] / "support" / "helpers_train.py"
EPOCHS = 2
N_STEPS = EPOCHS * H.STEPS_PER_EPOCH
STOPS = {
    "first_step": 1,
    "mid_epoch": 2,
    "epoch_last_step": H.STEPS_PER_EPOCH,
    "one_before_end": N_STEPS - 1,
}
GRID = [(di, ga, w) for di in (1, 4) for ga in (1, 2) for w in (0, 2)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # same kernels here and in the child processes, and fast on 2 cores
    yield
    torch.set_num_threads(n)


def assert_same(a, b, where: str = "state") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (
            f"{where}: tensors differ"
        )
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def compare(got_losses, got_state, ref) -> None:
    ref_losses, ref_state = ref
    assert got_losses == ref_losses  # ==, not allclose
    assert_same(got_state, ref_state)


@functools.lru_cache(maxsize=None)
def reference(di: int, ga: int, workers: int):
    """An uninterrupted run: per-step losses and the final state (no checkpoint callback)."""
    rec = H.Recorder()
    loop, loader, _ = H.make_loop(di, ga, workers, callbacks=[rec])
    loop.fit(loader, EPOCHS)
    return rec.losses, H.comparable(loop.state_dict())


class _StepSaves(ModelCheckpoint):
    """Step saves only: keeps the save at an epoch's last step, which the epoch-end save
    (same step) replaces in a ModelCheckpoint that saves at both."""


def interrupted(dirpath: Path, di: int, ga: int, workers: int, stop: int) -> list[float]:
    """Run B to ``stop`` with a checkpoint at every step, then stop; returns its losses."""
    rec = H.Recorder()
    ckpt = ModelCheckpoint(dirpath, every_n_steps=1, save_top_k=-1)
    steps = _StepSaves(dirpath / "steps", every_n_steps=1, every_n_epochs=None, save_top_k=-1)
    loop, loader, _ = H.make_loop(di, ga, workers, callbacks=[rec, ckpt, steps, H.StopAt(stop)])
    loop.fit(loader, EPOCHS)
    assert loop.state.step == stop
    return rec.losses


def resume(source, di: int, ga: int, workers: int, *, tamper=None):
    """A fresh loop (other init weights and seed) resumed from ``source``."""
    rec = H.Recorder()
    loop, loader, _ = H.make_loop(di, ga, workers, callbacks=[rec], init_seed=123, seed=99)
    if tamper is None:
        loop.fit(loader, EPOCHS, resume_from=str(source))
    else:
        loop.load_state_dict(tamper(load_checkpoint(source)))
        loop.fit(loader, EPOCHS)
    return rec.losses, H.comparable(loop.state_dict())


def sources(dirpath: Path, stop: int) -> list[Path]:
    """The newest checkpoint at ``stop``; at an epoch's last step also the one taken before
    the epoch ended (epoch_step == steps per epoch)."""
    newest = ModelCheckpoint(dirpath).latest()
    assert read_manifest(newest)["step"] == stop
    step_end = dirpath / "steps" / f"epoch{(stop - 1) // H.STEPS_PER_EPOCH}-step{stop}"
    return [newest] + ([step_end] if step_end.name != newest.name else [])


# -- §2.6 exact-resume parity ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def resumed_elsewhere(tmp_path_factory):
    """Run B of every grid cell to each stop, here; every resume in one new child process."""
    root = tmp_path_factory.mktemp("newproc")
    jobs, prefixes, dirs = [], {}, {}
    for di, ga, w in GRID:
        for name, stop in STOPS.items():
            d = dirs[(di, ga, w, name)] = root / f"{di}-{ga}-{w}-{name}"
            prefixes[(di, ga, w, name)] = interrupted(d, di, ga, w, stop)
            for i, src in enumerate(sources(d, stop)):
                jobs.append(
                    {
                        "di": di,
                        "ga": ga,
                        "workers": w,
                        "epochs": EPOCHS,
                        "path": str(src),
                        "out": str(d / f"result{i}.pt"),
                        "key": [di, ga, w, name],
                    }
                )
    (root / "jobs.json").write_text(json.dumps(jobs))
    proc = warm.run(
        [sys.executable, str(HELPER), "resume", str(root / "jobs.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results: dict[tuple, list] = {}
    for job in jobs:
        out = torch.load(job["out"], weights_only=True)
        results.setdefault(tuple(job["key"]), []).append((out["losses"], out["state"]))
    return prefixes, results, dirs


def _forget_rng(sd):
    from ipuloop.random_state import rng_state as _rng_state

    sd.pop("device_rng")
    sd["rng"] = _rng_state()
    sd["epoch_rng"] = {**_rng_state(), "sampler": None}
    return sd


@pytest.mark.parametrize("di,ga,workers", GRID, ids=[f"di{d}-ga{g}-w{w}" for d, g, w in GRID])
def test_resume_parity(resumed_elsewhere, monkeypatch, di, ga, workers):
    """Run A uninterrupted; run B stopped at k and saved here, resumed in a new process: the
    same per-step losses (==) and the same final state (torch.equal). Negative control: the
    same comparison fails for a resume without the RNG states or without the loader position."""
    prefixes, results, dirs = resumed_elsewhere
    ref = reference(di, ga, workers)
    assert len(ref[0]) == N_STEPS
    for name, stop in STOPS.items():
        before = prefixes[(di, ga, workers, name)]
        assert before == ref[0][:stop]  # saving at every step changed nothing
        assert len(results[(di, ga, workers, name)]) == len(
            sources(dirs[(di, ga, workers, name)], stop)
        )
        for losses, state in results[(di, ga, workers, name)]:
            compare(before + losses, state, ref)
    before = prefixes[(di, ga, workers, "mid_epoch")]
    src = ModelCheckpoint(dirs[(di, ga, workers, "mid_epoch")]).latest()
    losses, state = resume(src, di, ga, workers)  # in this process: as exact
    compare(before + losses, state, ref)
    losses, state = resume(src, di, ga, workers, tamper=_forget_rng)
    with pytest.raises(AssertionError):
        compare(before + losses, state, ref)
    order_iter = Order.__iter__  # an order that skips nothing: the epoch read from its start

    def from_the_start(self):
        self.selection = replace(self.selection, skip=0)
        return order_iter(self)

    monkeypatch.setattr(Order, "__iter__", from_the_start)
    losses, state = resume(src, di, ga, workers)  # re-reads the epoch from its start
    with pytest.raises(AssertionError):
        compare(before + losses, state, ref)


# -- §2.7 data order and coverage -----------------------------------------------------------------
@pytest.mark.parametrize("generator", [False, True], ids=["global-rng", "loader-generator"])
def test_data_order_and_coverage(tmp_path, generator):
    di, ga, epochs = 1, 2, 3
    combined = H.MICRO * di * ga
    steps = epochs * H.STEPS_PER_EPOCH
    rec = H.Recorder()
    loop, loader, ds = H.make_loop(di, ga, callbacks=[rec], generator=generator)
    rec.dataset = ds
    loop.fit(loader, epochs)
    full = ds.log
    per_epoch = len(ds)  # each epoch read whole, as torch reads it: its remainder too
    trained = H.STEPS_PER_EPOCH * combined
    assert len(full) == epochs * per_epoch
    dropped = []
    for e in range(epochs):
        seen = full[e * per_epoch : (e + 1) * per_epoch]
        assert sorted(seen) == list(range(len(ds)))  # each sample once an epoch
        dropped.append(set(seen[trained:]))  # read, and dropped: no whole host call
        assert len(dropped[-1]) == combined - 1
    for point in random.Random(generator).sample(range(1, steps), 10):
        d = tmp_path / f"{point}"
        rec1 = H.Recorder()
        ckpt = ModelCheckpoint(d, every_n_steps=point)  # at an epoch end: resumes from there
        loop, loader, ds1 = H.make_loop(
            di, ga, callbacks=[rec1, ckpt, H.StopAt(point)], generator=generator
        )
        rec1.dataset = ds1
        loop.fit(loader, epochs)
        rec2 = H.Recorder()
        loop, loader, ds2 = H.make_loop(
            di, ga, callbacks=[rec2, ModelCheckpoint(d)], generator=generator, init_seed=5, seed=6
        )
        rec2.dataset = ds2
        loop.fit(loader, epochs, resume_from="last")
        assert ds1.log + ds2.log == full, f"resumed at step {point}"  # none read twice
        for e in range(epochs):  # same dropped remainder
            seen = (ds1.log + ds2.log)[e * per_epoch : (e + 1) * per_epoch]
            assert set(seen[trained:]) == dropped[e]


class _ShuffledBatches(torch.utils.data.Sampler):
    """A custom batch sampler (not torch's BatchSampler): shuffled pairs, from the global RNG."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.batch_size = n, size

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        return iter(
            [
                order[i : i + self.batch_size]
                for i in range(0, self.n - self.batch_size + 1, self.batch_size)
            ]
        )

    def __len__(self) -> int:
        return self.n // self.batch_size


def test_custom_batch_sampler_resumes_without_reading_the_seen_samples(tmp_path):
    di, ga, epochs = 2, 1, 2
    combined = H.MICRO * di * ga
    steps = epochs * H.STEPS_PER_EPOCH

    def run(callbacks, **kw):
        rec = H.Recorder()
        loop, _, ds = H.make_loop(di, ga, callbacks=[rec, *callbacks], **kw)
        rec.dataset = ds
        loader = DataLoader(ds, batch_sampler=_ShuffledBatches(len(ds), H.MICRO))
        return rec, loop, loader, ds

    rec, loop, loader, ds = run([])
    loop.fit(loader, epochs)
    full, ref = ds.log, (rec.losses, H.comparable(loop.state_dict()))
    # each epoch reads its 9 pairs: 4 host calls of 2 pairs, the last pair read and dropped
    assert len(full) == epochs * (len(ds) // H.MICRO) * H.MICRO and len(rec.losses) == steps
    for point in (1, 3, H.STEPS_PER_EPOCH + 2):  # mid-epoch (3, 6) and after the first step
        d = tmp_path / f"{point}"
        rec1, loop, loader, ds1 = run([ModelCheckpoint(d, every_n_steps=point), H.StopAt(point)])
        loop.fit(loader, epochs)
        rec2, loop, loader, ds2 = run([ModelCheckpoint(d)], init_seed=5, seed=6)
        loop.fit(loader, epochs, resume_from="last")
        per_epoch = len(full) // epochs
        epoch, step = divmod(point, H.STEPS_PER_EPOCH)
        assert len(ds1.log) == epoch * per_epoch + step * combined
        assert ds1.log + ds2.log == full, f"resumed at step {point}"  # none read twice
        compare(rec1.losses + rec2.losses, H.comparable(loop.state_dict()), ref)


# -- §2.1 SIGKILL during a save -------------------------------------------------------------------
def _kill_during_save(root: Path, seed: int) -> dict:
    rng = random.Random(seed)
    cfg = {
        "dirpath": str(root / "ckpt"),
        "di": 1,
        "ga": 1,
        "epochs": EPOCHS,
        "chunk": 2048,
        "delay": 0.02,
        "commit_delay": 0.15,
    }  # 41 kB: a save takes ~0.6 s
    for sub in ("cwd", "tmp"):
        (root / sub).mkdir()
    (root / "cfg.json").write_text(json.dumps(cfg))
    env = {
        **os.environ,
        "TMPDIR": str(root / "tmp"),
        "PYTHONDONTWRITEBYTECODE": "1",
        # torch's own cache folder, which it makes in TMPDIR unless told (AdamW imports it)
        "TORCHINDUCTOR_CACHE_DIR": str(root.parent / "torchinductor"),
    }
    with open(root / "stderr.txt", "w") as err:  # written by this process, not the child
        child = warm.Popen(
            [sys.executable, str(HELPER), "kill", str(root / "cfg.json")],
            cwd=root / "cwd",
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    target = rng.choice([2, 3])  # the save to interrupt
    starts: dict[int, float] = {}
    watchdog = threading.Timer(120, child.kill)  # never hang the suite
    watchdog.start()
    try:
        while True:
            line = child.stdout.readline()
            assert line, f"child ended early: {(root / 'stderr.txt').read_text()[-3000:]}"
            kind, step, t = line.split()
            if kind == "save-start":
                starts[int(step)] = float(t)
                if int(step) == target:
                    break
            elif kind == "save-end" and int(step) == 1:
                duration = float(t) - starts[1]  # the measured save time, replace included
        time.sleep(rng.uniform(0, duration))
        child.send_signal(signal.SIGKILL)
    finally:
        watchdog.cancel()
        child.kill()
        child.wait()
        child.stdout.close()
    return {"target": target, "duration": duration}


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """All the kill runs at once (each child sleeps through its throttled saves)."""
    from concurrent.futures import ThreadPoolExecutor

    roots = [tmp_path_factory.mktemp(f"kill{seed}") for seed in range(KILL_REPEATS)]
    with ThreadPoolExecutor(min(KILL_REPEATS, 5)) as pool:  # 5 children at a time
        infos = list(pool.map(_kill_during_save, roots, range(KILL_REPEATS)))
    return dict(enumerate(zip(roots, infos)))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(KILL_REPEATS))
def test_sigkill_during_save(killed_runs, seed):
    tmp_path, info = killed_runs[seed]
    dirpath = tmp_path / "ckpt"
    assert list((tmp_path / "cwd").iterdir()) == [] and list((tmp_path / "tmp").iterdir()) == []
    assert {p.name for p in tmp_path.iterdir()} == {"ckpt", "cwd", "tmp", "cfg.json", "stderr.txt"}
    # docs/reliability.md §2.1: a save of >= 0.5 s (21 throttled chunks + the manifest: >= 0.57 s),
    # so the kill, at a uniform moment within it, lands inside the save
    assert info["duration"] >= 0.5, info
    latest = ModelCheckpoint(dirpath).latest()
    m = read_manifest(latest)  # verifies the manifest and the SHA-256 of state.pt
    assert m["step"] in (info["target"] - 1, info["target"])
    load_checkpoint(latest)
    # the next start removes stale temporary files (planted ones too) and interrupted saves
    (dirpath / f"{ck.TMP_PREFIX}stale").write_bytes(b"x")
    (latest / f"{ck.TMP_PREFIX}stale").write_bytes(b"x")
    rec = H.Recorder()
    ckpt = ModelCheckpoint(dirpath, every_n_steps=1, every_n_epochs=None, save_top_k=2)
    loop, loader, _ = H.make_loop(1, 1, callbacks=[rec, ckpt], init_seed=8, seed=8)
    loop.fit(loader, EPOCHS, resume_from="last")
    ref_losses, ref_state = reference(1, 1, 0)
    assert rec.losses == ref_losses[m["step"] :]
    assert_same(H.comparable(loop.state_dict()), ref_state)
    assert not list(dirpath.rglob(f"{ck.TMP_PREFIX}*"))
    assert all((p / ck.MANIFEST).is_file() for p in dirpath.iterdir())


# -- §2.4 corruption ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("two")
    loop, loader, _ = H.make_loop(
        callbacks=[ModelCheckpoint(d, every_n_steps=1, save_top_k=2), H.StopAt(2)]
    )
    loop.fit(loader, EPOCHS)
    return d / "epoch0-step1", d / "epoch0-step2"


def _corrupt_copies(src: Path, root: Path, file: str, seed: int):
    data = (src / file).read_bytes()
    rng = random.Random(seed)
    cuts = rng.sample(range(len(data)), 10)
    flips = [0, 1, 30, len(data) - 1] + rng.sample(range(len(data)), 10)  # headers and data
    variants = [("cut", o, data[:o]) for o in cuts]
    variants += [
        ("flip", o, data[:o] + bytes([data[o] ^ rng.randrange(1, 256)]) + data[o + 1 :])
        for o in flips
    ]
    for i, (kind, offset, new) in enumerate(variants):
        dst = root / f"{file}-{kind}-{i}"
        shutil.copytree(src, dst)
        (dst / file).write_bytes(new)
        yield kind, offset, dst


@pytest.mark.parametrize("file", [ck.STATE, ck.MANIFEST])
def test_corruption_is_detected(tmp_path, two_checkpoints, file, monkeypatch):
    good = two_checkpoints[1]
    load_checkpoint(good)
    calls = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(1) or pytest.fail("loaded"))
    for kind, offset, dst in _corrupt_copies(good, tmp_path, file, seed=len(file)):
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(dst)
        assert e.value.path == str(dst / file), (kind, offset, e.value)
    assert calls == []  # nothing corrupt reached torch.load, so no tensors came back


def test_latest_falls_back_to_previous_valid(tmp_path, two_checkpoints):
    d = tmp_path / "ckpt"
    for src in two_checkpoints:
        shutil.copytree(src, d / src.name)
    newest = d / two_checkpoints[1].name
    data = bytearray((newest / ck.STATE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / ck.STATE).write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="epoch0-step2.*epoch0-step1"):
        assert ModelCheckpoint(d).latest() == d / "epoch0-step1"
    loop, loader, _ = H.make_loop(callbacks=[ModelCheckpoint(d, every_n_epochs=None)])
    with pytest.warns(UserWarning, match="epoch0-step2.*epoch0-step1"):
        loop.fit(loader, 1, resume_from="last", max_steps=2)
    assert loop.state.step == 2
    (newest / ck.MANIFEST).write_bytes(b'{"trunc')  # an unreadable manifest is suspect too
    with pytest.warns(UserWarning, match="epoch0-step2.*not an ipuloop manifest"):
        assert ModelCheckpoint(d).latest() == d / "epoch0-step1"


def _write_checkpoint(folder: Path, state_bytes: bytes, **fields) -> None:
    """A checkpoint whose manifest is valid for ``state_bytes`` (as an attacker could write)."""
    folder.mkdir(parents=True)
    (folder / ck.STATE).write_bytes(state_bytes)
    m = {
        "format": "ipuloop-checkpoint",
        "format_version": ck.FORMAT_VERSION,
        "step": 0,
        "epoch": 0,
        "tainted": False,
        "files": {ck.STATE: {"bytes": len(state_bytes), "sha256": ck.sha256(state_bytes)}},
        **fields,
    }
    m["manifest_sha256"] = ck.sha256(ck.dump(m))
    (folder / ck.MANIFEST).write_bytes(ck.dump(m))


def test_foreign_and_newer_checkpoints_are_rejected(tmp_path, two_checkpoints):
    plain = tmp_path / "plain"
    plain.mkdir()
    torch.save({"w": torch.ones(2)}, plain / "state.pt")
    with pytest.raises(CheckpointError, match="manifest.json: missing"):
        load_checkpoint(plain / "state.pt")
    (tmp_path / "model.pt").write_bytes(buf := (plain / "state.pt").read_bytes())
    with pytest.raises(CheckpointError, match="model.pt: is a file"):
        load_checkpoint(tmp_path / "model.pt")
    (plain / ck.MANIFEST).write_text('{"hello": 1}')
    with pytest.raises(CheckpointError, match="not an ipuloop manifest"):
        load_checkpoint(plain)
    _write_checkpoint(tmp_path / "tensors", buf)
    with pytest.raises(CheckpointError, match="not an ipuloop loop state") as e:
        load_checkpoint(tmp_path / "tensors")
    assert e.value.path == str(tmp_path / "tensors" / ck.STATE)
    _write_checkpoint(
        tmp_path / "future", (two_checkpoints[0] / ck.STATE).read_bytes(), format_version="2.0"
    )
    with pytest.raises(CheckpointError, match=r"format version 2\.0 .*\(1\.1\)"):
        load_checkpoint(tmp_path / "future")
    _write_checkpoint(
        tmp_path / "escape",
        buf,
        files={ck.STATE: {"bytes": len(buf), "sha256": ck.sha256(buf)}, "../x": {"bytes": 1}},
    )
    with pytest.raises(CheckpointError, match="outside its folder"):
        load_checkpoint(tmp_path / "escape")


# -- §2.5 malicious checkpoint --------------------------------------------------------------------
class _Evil:
    def __init__(self, marker: Path, command: bool) -> None:
        self.marker, self.command = str(marker), command

    def __reduce__(self):  # unpickling would create the marker file
        if self.command:
            return (os.system, (f"touch {shlex.quote(self.marker)}",))  # a shell command
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("command", [False, True], ids=["open", "os.system"])
@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "nested-in-state"])
def test_malicious_pickle_runs_no_code(tmp_path, two_checkpoints, monkeypatch, nested, command):
    marker = tmp_path / "pwned"
    payload = _Evil(marker, command)
    if nested:  # a real loop state with the payload deep inside, next to real storages
        sd = load_checkpoint(two_checkpoints[0])
        sd["model"]["evil"] = [torch.ones(3), {"x": payload}]
        payload = sd
    import io

    buf = io.BytesIO()
    torch.save(payload, buf)
    _write_checkpoint(tmp_path / "evil", buf.getvalue())  # a manifest that verifies
    with pytest.raises(CheckpointError, match="weights_only") as e:
        load_checkpoint(tmp_path / "evil")
    assert e.value.path == str(tmp_path / "evil" / ck.STATE)
    assert not marker.exists()
    torch.load(tmp_path / "evil" / ck.STATE, weights_only=False)  # the payload is live:
    assert marker.exists()  # plain unpickling would have run it


def test_every_torch_load_uses_weights_only(tmp_path, two_checkpoints, monkeypatch):
    real, calls = torch.load, []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    if hasattr(torch.serialization, "get_safe_globals"):  # (torch 2.0 has no allowlist)
        allowed = torch.serialization.get_safe_globals()  # torch's defaults, nothing of ours
        assert not [g for g in allowed if "ipuloop" in getattr(g, "__module__", "")]
    d = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints[1], d / two_checkpoints[1].name)
    loop, loader, _ = H.make_loop(callbacks=[ModelCheckpoint(d)])
    loop.fit(loader, 1, resume_from="last")
    load_checkpoint(two_checkpoints[0])
    assert len(calls) == 2 and all(k.get("weights_only") is True for k in calls), calls


# -- §2.9 non-finite loss -------------------------------------------------------------------------
class _Snapshot(Callback):
    """Bytes of the newest checkpoint just before host call ``step`` runs."""

    def __init__(self, dirpath: Path, step: int) -> None:
        self.dirpath, self.step, self.files = dirpath, step, None

    def on_train_step_start(self, loop) -> None:
        if loop.state.step == self.step:
            folder = ModelCheckpoint(self.dirpath).latest()
            self.files = {p: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_loss(tmp_path, value):
    h, m, di = 2, 1, 4  # host call h (0-based), micro-batch m of that call
    snap = _Snapshot(tmp_path, h)
    ckpt = ModelCheckpoint(tmp_path, every_n_steps=1, save_top_k=1)
    loop, loader, ds = H.make_loop(di, 1, callbacks=[snap, ckpt], shuffle=False, all_outputs=True)
    ds.scale[h * H.MICRO * di + m * H.MICRO] = value  # that micro-batch's loss is NaN or inf
    with pytest.raises(NonFiniteLossError) as e:
        loop.fit(loader, EPOCHS)
    msg = str(e.value)
    assert f"epoch 0, step {h} " in msg and f"micro-batch {m} " in msg and str(value) in msg
    assert {p: p.read_bytes() for p in snap.files} == snap.files  # byte-identical afterwards
    good = next(iter(snap.files)).parent
    bad = tmp_path / f"epoch0-step{h}-exception"
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name, bad.name]
    assert read_manifest(bad)["tainted"] and read_manifest(bad)["exception"] == "NonFiniteLossError"
    assert not read_manifest(good)["tainted"]
    assert ModelCheckpoint(tmp_path).latest() == good
    assert ModelCheckpoint(tmp_path).latest(include_tainted=True) == bad


class _MicroLosses(Callback):
    """The loss of each micro-batch of the running host call, as the device computed it."""

    def __init__(self, monkeypatch) -> None:
        self.losses: list[float] = []
        forward = H.TinyMLP.forward

        def recording(model, x, y=None):
            out = forward(model, x, y)
            if y is not None:
                self.losses.append(float(out[1].detach()))
            return out

        monkeypatch.setattr(H.TinyMLP, "forward", recording)  # the device's copy runs it too

    def on_train_step_start(self, loop) -> None:
        self.losses.clear()


class _EveryStepSnapshot(_Snapshot):
    def on_train_step_start(self, loop) -> None:
        folder = ModelCheckpoint(self.dirpath).latest()
        self.files = folder and {p: p.read_bytes() for p in folder.iterdir()}


class _SetLR(Callback):
    def __init__(self, step: int, lr: float) -> None:
        self.step, self.lr = step, lr

    def on_train_step_end(self, loop) -> None:
        if loop.state.step == self.step:
            loop.optimizer.param_groups[0]["lr"] = self.lr  # setOptimizer before the next step


def test_non_finite_loss_from_real_divergence(tmp_path, monkeypatch):
    """lr=1e9 from host call 2 on (AdamW): the weights blow up within a few updates; the check
    catches the first non-finite micro-batch loss, in the host call that returned it."""
    di = 4
    micro = _MicroLosses(monkeypatch)
    snap = _EveryStepSnapshot(tmp_path, None)
    ckpt = ModelCheckpoint(tmp_path, every_n_steps=1, save_top_k=1)
    loop, loader, _ = H.make_loop(
        di, 1, callbacks=[micro, snap, _SetLR(2, 1e9), ckpt], all_outputs=True
    )
    with pytest.raises(NonFiniteLossError) as e:
        loop.fit(loader, EPOCHS)
    h = loop.state.step  # the failed host call did not count
    m = next(i for i, v in enumerate(micro.losses) if not math.isfinite(v))
    assert len(micro.losses) == di and h >= 2, (h, micro.losses)
    msg = str(e.value)
    assert f"epoch {loop.state.epoch}, step {h} " in msg and f"micro-batch {m} " in msg
    assert str(micro.losses[m]) in msg
    assert {p: p.read_bytes() for p in snap.files} == snap.files  # the good one, untouched
    bad = tmp_path / f"epoch{loop.state.epoch}-step{h}-exception"
    assert (
        read_manifest(bad)["tainted"]
        and not read_manifest(next(iter(snap.files)).parent)["tainted"]
    )
    assert ModelCheckpoint(tmp_path).latest() == next(iter(snap.files)).parent


def test_loss_scale_overflow_step_does_not_raise(monkeypatch):
    """Inf gradients from loss * loss_scaling overflowing, with a finite loss: the check is on
    the returned loss, so that step passes; the NaN weights it leaves fail the next loss."""
    di, h, m = 4, 1, 3  # the last micro-batch of host call 1 overflows
    micro = _MicroLosses(monkeypatch)
    pt = ipuloop.poptorch
    loop, loader, ds = H.make_loop(
        di,
        1,
        callbacks=[micro],
        shuffle=False,
        all_outputs=True,
        optimizer=lambda p: pt.optim.SGD(p, lr=0.01, loss_scaling=1e10),
    )
    ds.scale[(h * di + m) * H.MICRO : (h * di + m + 1) * H.MICRO] = 1e30  # loss ~1e30: finite;
    loop.fit(loader, EPOCHS, max_steps=h + 1)  # times 1e10 it overflows float32: inf grads
    assert loop.state.step == h + 1 and math.isfinite(loop.state.logs["loss"])
    assert all(math.isfinite(v) for v in micro.losses) and micro.losses[m] > 1e29
    assert not all(torch.isfinite(p).all() for p in loop.model.parameters())  # it overflowed
    with pytest.raises(NonFiniteLossError, match=f"step {h + 1} .*micro-batch 0 "):
        loop.fit(loader, EPOCHS)


# -- §2.16 device/host weight sync ----------------------------------------------------------------
class _DeviceView(Callback):
    """At step ``n``: the weights on the device (emulator: its tensor per weight)."""

    order = 95  # after the checkpoint is written

    def __init__(self, n: int) -> None:
        self.n, self.weights, self.first_lr = n, None, None

    def on_train_step_end(self, loop) -> None:
        if loop.state.step == self.n:
            device = loop.train_model._device_weights()
            self.weights = {k: v.detach().clone() for k, v in device.items()}
        if self.first_lr is None:  # the LR of the first step this fit ran on the device
            self.first_lr = loop.train_model._device_optimizer.param_groups[0]["lr"]


class _LowerLR(Callback):
    def on_train_step_end(self, loop) -> None:
        if loop.state.step == 2:
            loop.optimizer.param_groups[0]["lr"] = 0.005  # reaches the device via setOptimizer


@pytest.mark.skipif(backend_name() != "emulator", reason="reads the emulated device's copy")
def test_saved_weights_are_the_devices_and_lr_is_restored(tmp_path):
    n = 3
    view = _DeviceView(n)
    ckpt = ModelCheckpoint(tmp_path, every_n_steps=n, every_n_epochs=None)
    loop, loader, _ = H.make_loop(callbacks=[_LowerLR(), ckpt, view, H.StopAt(n)])
    initial = {k: v.clone() for k, v in loop.model.state_dict().items()}
    loop.fit(loader, EPOCHS)
    saved = load_checkpoint(tmp_path / f"epoch0-step{n}")
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.005
    for k, v in view.weights.items():
        assert torch.equal(saved["model"][k], v), k
        if k.endswith("weight"):
            assert not torch.equal(v, initial[k]), k
    resumed = _DeviceView(0)
    loop, loader, _ = H.make_loop(callbacks=[_LowerLR(), resumed], init_seed=4)
    assert loop.optimizer.param_groups[0]["lr"] == 0.02
    loop.fit(loader, EPOCHS, resume_from=tmp_path / f"epoch0-step{n}")
    assert resumed.first_lr == 0.005 == loop.optimizer.param_groups[0]["lr"]
    ref = H.make_loop(callbacks=[_LowerLR()])
    ref[0].fit(ref[1], EPOCHS)
    assert_same(
        H.comparable(loop.state_dict())["model"], H.comparable(ref[0].state_dict())["model"]
    )


class _DeviceLossScale(Callback):
    """The loss scaling the device ran each host step with (emulator: its executor's)."""

    def __init__(self, set_at: int | None = None, value: float = 0.0) -> None:
        self.set_at, self.value, self.used = set_at, value, []

    def on_train_step_end(self, loop) -> None:
        self.used.append(loop.train_model._loss_scaling)
        if loop.state.step == self.set_at:
            loop.optimizer.loss_scaling = self.value  # variable: pushed before the next step


@pytest.mark.skipif(backend_name() != "emulator", reason="reads the emulated device's value")
def test_resume_restores_the_loss_scale(tmp_path):
    """docs/reliability.md §2.16: after a resume the device's loss scale is the saved one."""
    pt = ipuloop.poptorch
    make = lambda p: pt.optim.AdamW(p, lr=0.02, loss_scaling=128.0)  # noqa: E731
    first = _DeviceLossScale(set_at=2, value=64.0)
    ckpt = ModelCheckpoint(tmp_path, every_n_steps=3, every_n_epochs=None)
    loop, loader, _ = H.make_loop(callbacks=[first, ckpt, H.StopAt(3)], optimizer=make)
    loop.fit(loader, EPOCHS)
    assert first.used == [128.0, 128.0, 64.0]
    resumed = _DeviceLossScale()
    loop, loader, _ = H.make_loop(callbacks=[resumed], optimizer=make, init_seed=4)
    loop.fit(loader, EPOCHS, resume_from=tmp_path / "epoch0-step3")
    assert resumed.used[0] == 64.0 and loop.optimizer.loss_scaling == 64.0


# -- rotation, monitor, stale files, resumed-from protection --------------------------------------
class _Logs(Callback):
    order = 50

    def __init__(self, values: list[float]) -> None:
        self.values = values

    def on_train_step_end(self, loop) -> None:
        loop.state.logs["score"] = self.values[loop.state.step - 1]


@pytest.mark.parametrize(
    "mode,best",
    [("min", {"epoch0-step2", "epoch0-step4"}), ("max", {"epoch0-step1", "epoch0-step3"})],
)
def test_top_k_by_monitor_plus_last(tmp_path, mode, best):
    ckpt = ModelCheckpoint(
        tmp_path, every_n_steps=1, every_n_epochs=None, monitor="score", mode=mode, save_top_k=2
    )
    loop, loader, _ = H.make_loop(callbacks=[_Logs([5.0, 1.0, 4.0, 2.0, 3.0]), ckpt, H.StopAt(5)])
    loop.fit(loader, EPOCHS)
    names = {p.name for p in tmp_path.iterdir()}
    assert names == best | {"epoch1-step5"}  # top 2 + the last
    assert {e["name"] for e in ckpt.state_dict()["kept"]} == names


def test_save_last_false_keeps_only_the_best(tmp_path):
    ckpt = ModelCheckpoint(
        tmp_path,
        every_n_steps=1,
        every_n_epochs=None,
        monitor="score",
        save_top_k=1,
        save_last=False,
    )
    loop, loader, _ = H.make_loop(callbacks=[_Logs([5.0, 1.0, 4.0, 2.0, 3.0]), ckpt, H.StopAt(5)])
    loop.fit(loader, EPOCHS)
    assert [p.name for p in tmp_path.iterdir()] == ["epoch0-step2"]
    assert ckpt.save(loop) is None  # step 5 again: neither the best nor kept as the last


def test_every_n_epochs(tmp_path):
    ckpt = ModelCheckpoint(tmp_path, every_n_epochs=2, save_top_k=-1)
    loop, loader, _ = H.make_loop(callbacks=[ckpt])
    loop.fit(loader, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"epoch{e}-step{e * H.STEPS_PER_EPOCH}" for e in (2, 4)
    ]


def test_write_order_fsync_replace_then_rotate(tmp_path, monkeypatch):
    """docs/reliability.md §1.1, §1.4: each file goes to a temporary file next to it, fsync,
    os.replace, fsync of its folder; the manifest last (the commit); then the rotation."""
    calls: list[tuple] = []
    fsync, replace, remove = os.fsync, os.replace, ck.remove

    def spy_fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def spy_replace(src, dst):
        calls.append(("replace", str(src), str(dst)))
        return replace(src, dst)

    class Record(Callback):
        order = 80  # before ModelCheckpoint's save at step 2

        def on_train_step_end(self, loop) -> None:
            if loop.state.step == 2:
                monkeypatch.setattr(os, "fsync", spy_fsync)
                monkeypatch.setattr(os, "replace", spy_replace)
                monkeypatch.setattr(
                    ck, "remove", lambda p: calls.append(("remove", str(p))) or remove(p)
                )

    ckpt = ModelCheckpoint(tmp_path, every_n_steps=1, every_n_epochs=None, save_top_k=1)
    loop, loader, _ = H.make_loop(callbacks=[Record(), ckpt, H.StopAt(2)])
    loop.fit(loader, EPOCHS)
    new, old = tmp_path / "epoch0-step2", tmp_path / "epoch0-step1"
    expected = []
    for name in (ck.STATE, ck.MANIFEST):
        tmp = calls[len(expected)][1]
        assert Path(tmp).parent == new and Path(tmp).name.startswith(ck.TMP_PREFIX), calls
        expected += [("fsync", tmp), ("replace", tmp, str(new / name)), ("fsync", str(new))]
    # the rotation un-commits the old checkpoint (its manifest) before deleting the rest
    expected += [("fsync", str(tmp_path)), ("remove", str(old)), ("remove", str(old / ck.MANIFEST))]
    assert calls == expected
    assert [p.name for p in tmp_path.iterdir()] == [new.name]


def test_missing_monitor_lists_the_logs(tmp_path):
    # Step saves before the first epoch end go unranked; the epoch-end save needs the log.
    # (A validation log without val_loader is refused when the fit starts: test_loaders_paths.)
    ckpt = ModelCheckpoint(tmp_path, every_n_steps=1, monitor="train_acc")
    loop, loader, _ = H.make_loop(callbacks=[ckpt])
    with pytest.warns(UserWarning, match="no such log yet at step 1"), pytest.raises(
        ValueError,
        match=r"train_acc.*epoch 1, step 4.*Available: "
        r"\['loss', 'train_loss'\]",
    ):
        loop.fit(loader, EPOCHS)


def test_stale_files_removed_in_dirpath_only_and_resumed_from_kept(tmp_path):
    d = tmp_path / "ckpt"
    loop, loader, _ = H.make_loop(callbacks=[ModelCheckpoint(d, every_n_steps=1), H.StopAt(2)])
    loop.fit(loader, EPOCHS)
    assert [p.name for p in d.iterdir()] == ["epoch0-step2"]  # save_top_k=1: rotated
    outside = tmp_path / f"{ck.TMP_PREFIX}keep"
    outside.write_bytes(b"not ours")
    (d / f"{ck.TMP_PREFIX}junk").write_bytes(b"x")
    (d / "epoch0-step9").mkdir()
    (d / "epoch0-step9" / ck.STATE).write_bytes(b"half")  # an interrupted save
    (d / "notes").mkdir()
    (d / "notes" / "readme.txt").write_text("user data")
    ckpt = ModelCheckpoint(d, every_n_steps=1)
    loop, loader, _ = H.make_loop(callbacks=[ckpt, H.StopAt(4)])
    loop.fit(loader, EPOCHS, resume_from="last")
    assert outside.exists() and (d / "notes" / "readme.txt").exists()
    # step 3 rotated out epoch0-step2, which was kept while protected and removed at fit end
    assert sorted(p.name for p in d.iterdir()) == ["epoch1-step4", "notes"]
    assert not (d / "epoch0-step9").exists() and not (d / f"{ck.TMP_PREFIX}junk").exists()


def test_resumed_from_survives_a_failing_fit(tmp_path):
    loop, loader, _ = H.make_loop(
        callbacks=[ModelCheckpoint(tmp_path, every_n_steps=1), H.StopAt(2)]
    )
    loop.fit(loader, EPOCHS)

    class Boom(Callback):
        def on_train_step_end(self, loop) -> None:
            if loop.state.step == 4:
                raise RuntimeError("boom")

    ckpt = ModelCheckpoint(tmp_path, every_n_steps=1)
    loop, loader, _ = H.make_loop(callbacks=[Boom(), ckpt])
    with pytest.raises(RuntimeError, match="boom"):
        loop.fit(loader, EPOCHS, resume_from="last")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["epoch0-step2", "epoch0-step3", "epoch0-step4-exception"]
    assert not read_manifest(tmp_path / "epoch0-step4-exception")["tainted"]


def test_failed_write_leaves_no_temp_file_and_keeps_the_previous(tmp_path, monkeypatch):
    """A write error (disk full) mid-save: a CheckpointError naming the file, nothing else."""
    ckpt = ModelCheckpoint(tmp_path, every_n_steps=1, save_on_exception=False)
    loop, loader, _ = H.make_loop(callbacks=[ckpt, H.StopAt(1)])
    loop.fit(loader, EPOCHS)
    before = {p: p.read_bytes() for p in (tmp_path / "epoch0-step1").iterdir()}

    def full(path, offset):
        if path.name == ck.STATE and offset >= 4096:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "CHUNK", 4096)
    monkeypatch.setattr(ck, "write_hook", full)
    loop, loader, _ = H.make_loop(callbacks=[ckpt])
    with pytest.raises(CheckpointError, match=r"epoch0-step2/state.pt: cannot be written"):
        loop.fit(loader, EPOCHS, resume_from="last")
    assert not list(tmp_path.rglob(f"{ck.TMP_PREFIX}*"))
    assert {p: p.read_bytes() for p in (tmp_path / "epoch0-step1").iterdir()} == before
    assert [e["name"] for e in ckpt.kept] == ["epoch0-step1"]  # rotation deleted nothing


def test_sigterm_checkpoint_resumes_exactly(tmp_path):
    """SIGTERM: the step finishes, ``on_preempt`` saves, exit 143; the resume is exact."""

    class Term(Callback):
        def on_train_step_start(self, loop) -> None:
            if loop.state.step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler sets a flag

    rec1 = H.Recorder()
    loop, loader, _ = H.make_loop(callbacks=[rec1, Term(), ModelCheckpoint(tmp_path)])
    with pytest.raises(SystemExit) as e:
        loop.fit(loader, EPOCHS)
    assert e.value.code == 143 and read_manifest(ModelCheckpoint(tmp_path).latest())["step"] == 6
    rec2 = H.Recorder()
    loop, loader, _ = H.make_loop(callbacks=[rec2, ModelCheckpoint(tmp_path)], init_seed=3)
    loop.fit(loader, EPOCHS, resume_from="last")
    compare(rec1.losses + rec2.losses, H.comparable(loop.state_dict()), reference(1, 1, 0))
