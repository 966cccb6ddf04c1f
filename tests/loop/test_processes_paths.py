"""Several processes off the main path: resuming in another process layout, a user's
DistributedSampler, validate() on one instance, and an error on one instance.

Each launched script runs its jobs one after the other in the same processes (2 under torchrun,
gloo, or 1 plain process), with a stack dump and exit if it hangs, and writes what each job
read and trained to ``out``; the tests compare those files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import clean_env, command, free_port
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import warm

from ipuloop import Callback, Loop, poptorch

ROOT = Path(__file__).resolve().parents[2]

COMMON = r'''
import faulthandler, json, os, signal, sys, time, warnings
faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where, then ends
faulthandler.register(signal.SIGUSR1, all_threads=True)  # and the test's timeout asks where
import torch, torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks import ModelCheckpoint

cfg = json.loads(sys.argv[1])
out = cfg["out"]
rank = int(os.environ.get("RANK", "0"))
READ = []  # dataset indices read since the last step


class Recorded(Dataset):
    """128 samples of a linear rule; records each index read."""

    def __init__(self, n=128, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 5, generator=g)
        self.y = (self.x[:, 0] + 0.3 * self.x[:, 1] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        READ.append(int(i))
        return self.x[i], self.y[i]


class Steps(Callback):
    """The indices each step read, by step number (the run's steps: 1, 2, ...)."""

    def __init__(self):
        self.steps = {}

    def on_epoch_start(self, loop):
        READ.clear()  # (the probe's reads before the epoch)

    def on_train_step_start(self, loop):
        self.steps[loop.state.step + 1] = list(READ)
        READ.clear()


def new_loop(replicas, callbacks=()):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    steps = Steps()
    loop = Loop(model, opts, loss_fn=nn.CrossEntropyLoss(), replicas=replicas, seed=1,
                optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                callbacks=[steps, *callbacks], progress=False)
    return loop, steps


def save(name, loop, steps, caught=(), **extra):
    torch.save({"weights": loop.model.state_dict(), "counters": loop.state.counters(),
                "steps": steps.steps, "warnings": [str(w.message) for w in caught], **extra},
               os.path.join(out, f"{name}{rank}.pt"))
'''

RESUME = (
    COMMON
    + r"""
# each job: a fit of 2 epochs (4 steps of 32 samples each with 2 replicas in all), maybe
# stopped (max_steps) with a checkpoint every step and epoch, maybe resumed from one
for job in cfg["jobs"]:
    cbs = [ModelCheckpoint(job["ckpt"], every_n_steps=1, save_top_k=-1)] if "ckpt" in job else []
    loop, steps = new_loop(job["replicas"], cbs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.fit(DataLoader(Recorded(), batch_size=4, shuffle=True), epochs=2,
                 max_steps=job.get("max_steps"), resume_from=job.get("resume"))
    save(job["name"], loop, steps, [w for w in caught if "factors" in str(w.message)
                                    or "instance" in str(w.message)])
"""
)


def _env(**extra: str) -> dict:
    return clean_env(**{"IPULOOP_DIST_TIMEOUT": "20", **extra})


def _launch(
    tmp: Path,
    script: str,
    cfg: dict,
    processes: int = 2,
    timeout: float = 150,
    torchrun: bool = True,
    **env: str,
) -> subprocess.CompletedProcess:
    """``script`` with ``cfg`` in ``processes`` processes (torchrun, or without it the
    processes started here with its environment: instance 0 then hosts the group's store),
    or 1 (plain python); the return code is the first non-zero one, the output each process's
    (stdout and stderr together, in ``tmp``). A run that has not ended after ``timeout``
    seconds fails the test with where each instance was (``_hung``)."""
    path = tmp / f"script{len(list(tmp.glob('script*')))}.py"
    path.write_text(script)
    cmd = command(path, json.dumps(cfg), processes=processes if torchrun else 1)
    if processes == 1 or torchrun:
        envs = [_env(**env)]
    else:
        port = str(free_port())
        envs = [
            _env(
                RANK=str(r),
                WORLD_SIZE=str(processes),
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                **env,
            )
            for r in range(processes)
        ]
    logs = [tmp / f"{path.stem}.{i}.log" for i in range(len(envs))]
    procs = []
    try:
        for e, log in zip(envs, logs):
            with open(log, "w") as f:
                procs.append(
                    warm.Popen(
                        cmd,
                        cwd=tmp,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env=e,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        for p in procs:
            if _ended(p, deadline - time.monotonic()):
                continue
            pytest.fail(_hung(procs, logs, path, timeout, cfg.get("out")), pytrace=False)
    finally:
        for p in procs:
            _kill_tree(p)
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(cmd, code, "".join(log.read_text() for log in logs), "")


def _ended(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=max(seconds, 1))
    except subprocess.TimeoutExpired:
        return False
    return True


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc; a warm child (tests/support/warm.py) counts as the child
    of the process that started it."""
    children: dict[int, list[int]] = {}
    started_by = warm.parents()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # (a process gone meanwhile)
            continue
        pid = int(stat.parent.name)
        children.setdefault(started_by.get(pid, ppid), []).append(pid)
    return children


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children, out = _children(), [pid]
    for p in out:
        out.extend(children.get(p, ()))
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """End a process started here and every process it started (torchrun's instances and
    their loader workers), and reap it."""
    if proc.poll() is None:
        for pid in _tree(proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # (its session: start_new_session)
    proc.wait()


def _hung(
    procs: list[subprocess.Popen], logs: list[Path], script: Path, timeout: float, out: Any
) -> str:
    """What a run that did not end was doing: each instance still running (a process whose
    program is ``script``) prints every thread's stack (``faulthandler`` on SIGUSR1, which
    the scripts register); the files it wrote in ``out`` and each process's output follow."""
    running = []
    started_with = warm.command_lines()
    for proc in procs:
        for pid in _tree(proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if pid in started_with:  # a warm child: the server's command line, not its own
                argv = [str(a).encode() for a in started_with[pid]]
            if str(script).encode() in argv and b"torch.distributed.run" not in argv:
                running.append(pid)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGUSR1)
    time.sleep(3)  # (the stacks printed)
    written = sorted(p.name for p in Path(out).iterdir()) if out and Path(out).is_dir() else []
    report = [
        f"{script.name} had not ended after {timeout:g} s: its instances' processes still "
        f"running: {running or 'none'} (their stacks below); written to its output folder: "
        f"{written}."
    ]
    for proc, log in zip(procs, logs):
        report.append(f"--- {' '.join(map(str, proc.args))[:300]} (pid {proc.pid}):")
        report.append(log.read_text()[-12000:])
    return "\n".join(report)


def _check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _load(out: Path, name: str, rank: int = 0) -> dict:
    return torch.load(out / f"{name}{rank}.pt", weights_only=False)


def _reads(out: Path, name: str, ranks: int) -> dict[int, list[int]]:
    """The indices each step of the run read, over every instance (sorted)."""
    steps: dict[int, list[int]] = {}
    for rank in range(ranks):
        for step, read in _load(out, name, rank)["steps"].items():
            steps.setdefault(step, []).extend(read)
    return {s: sorted(r) for s, r in steps.items()}


def _close(a: dict, b: dict) -> None:
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), (k, (a[k] - b[k]).abs().max())


# -- resuming in another process layout -------------------------------------------------------
@pytest.mark.slow
def test_a_checkpoint_resumes_across_process_layouts_at_the_same_sample(tmp_path):
    """2 processes x 1 replica and 1 process x 2 replicas are one layout (2 replicas, 32
    samples a step): a checkpoint of either, mid-epoch (epoch 1 after 2 of its 4 steps) or at
    the epoch boundary, resumes in the other at the same sample, with no warning, and ends as
    that layout's uninterrupted run (8 steps, each reading the same samples; weights within
    1e-6: the two layouts sum gradients in another order), as a checkpoint resumed in its own
    layout does (bitwise). In another layout (1 x 1, 16
    samples a step) it continues after the same 64 samples, with the factors' warning."""
    out = tmp_path / "out"
    out.mkdir()
    ck2, ck1 = tmp_path / "ck2x1", tmp_path / "ck1x2"
    two = _launch(
        tmp_path,
        RESUME,
        {
            "out": str(out),
            "jobs": [
                {"name": "whole2x1", "replicas": 1},
                {"name": "part2x1", "replicas": 1, "ckpt": str(ck2), "max_steps": 6},
            ],
        },
    )
    _check(two)
    assert sorted(p.name for p in ck2.iterdir()) == [
        "epoch0-step1",
        "epoch0-step2",
        "epoch0-step3",
        "epoch1-step4",
        "epoch1-step5",
        "epoch1-step6",
    ]
    one = _launch(
        tmp_path,
        RESUME,
        {
            "out": str(out),
            "jobs": [
                {"name": "whole1x2", "replicas": 2},
                {"name": "part1x2", "replicas": 2, "ckpt": str(ck1), "max_steps": 6},
                {"name": "mid2x1to1x2", "replicas": 2, "resume": str(ck2 / "epoch1-step6")},
                {"name": "start2x1to1x2", "replicas": 2, "resume": str(ck2 / "epoch1-step4")},
                {"name": "mid2x1to1x1", "replicas": 1, "resume": str(ck2 / "epoch1-step6")},
                {"name": "mid1x2to1x2", "replicas": 2, "resume": str(ck1 / "epoch1-step6")},
            ],
        },
        processes=1,
    )
    _check(one)
    back = _launch(
        tmp_path,
        RESUME,
        {
            "out": str(out),
            "jobs": [
                {"name": "mid1x2to2x1", "replicas": 1, "resume": str(ck1 / "epoch1-step6")},
                {"name": "start1x2to2x1", "replicas": 1, "resume": str(ck1 / "epoch1-step4")},
                {"name": "mid2x1to2x1", "replicas": 1, "resume": str(ck2 / "epoch1-step6")},
            ],
        },
    )
    _check(back)

    whole = {"2x1": _reads(out, "whole2x1", 2), "1x2": _reads(out, "whole1x2", 1)}
    assert list(whole["2x1"]) == list(range(1, 9))
    assert whole["2x1"] == whole["1x2"]  # the same samples in every step
    assert all(len(r) == 32 for r in whole["2x1"].values())
    _close(_load(out, "whole2x1")["weights"], _load(out, "whole1x2")["weights"])
    for name, layout, ranks, first in (
        ("mid2x1to1x2", "1x2", 1, 7),
        ("start2x1to1x2", "1x2", 1, 5),
        ("mid1x2to2x1", "2x1", 2, 7),
        ("start1x2to2x1", "2x1", 2, 5),
    ):
        r, w = _load(out, name), _load(out, f"whole{layout}")
        assert r["warnings"] == [], (name, r["warnings"])
        assert r["counters"] == w["counters"], name
        assert _reads(out, name, ranks) == {s: whole[layout][s] for s in range(first, 9)}, name
        _close(r["weights"], w["weights"])
    for layout, ranks in (("1x2", 1), ("2x1", 2)):  # the same layout: bitwise
        for rank in range(ranks):
            r, w = _load(out, f"mid{layout}to{layout}", rank), _load(out, f"whole{layout}", rank)
            assert r["warnings"] == [] and r["counters"] == w["counters"], layout
            for k, v in w["weights"].items():
                assert torch.equal(v, r["weights"][k]), (layout, rank, k)
    # another global layout: 64 samples read are 4 steps of 16; the rest of the epoch follows
    other = _load(out, "mid2x1to1x1")
    assert len(other["warnings"]) == 1
    assert (
        "replicationFactor 2 -> 1 (replicas of all instances together)" in other["warnings"][0]
        and "after its 64 samples already read" in other["warnings"][0]
    )
    assert other["counters"]["step"] == 6 + 4 and other["counters"]["samples"] == 8 * 32
    read = _reads(out, "mid2x1to1x1", 1)
    assert list(read) == [7, 8, 9, 10] and all(len(r) == 16 for r in read.values())
    assert sorted(i for r in read.values() for i in r) == sorted(whole["2x1"][7] + whole["2x1"][8])


def _fit(replicas: int, dataset, callbacks=(), **kwargs) -> Loop:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    loop = Loop(
        model,
        opts,
        loss_fn=torch.nn.CrossEntropyLoss(),
        replicas=replicas,
        seed=1,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        callbacks=callbacks,
        progress=False,
    )
    sd = kwargs.pop("state", None)
    if sd is not None:
        loop.load_state_dict(sd)
    shuffle = not isinstance(dataset, torch.utils.data.IterableDataset)
    loop.fit(DataLoader(dataset, batch_size=4, shuffle=shuffle), epochs=2, **kwargs)
    return loop


def _data(n: int = 128) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def test_a_checkpoint_of_one_instances_factors_is_read_as_the_whole_runs():
    """A checkpoint that recorded one instance's factors (2 instances x 1 replica: 16
    samples a step), as written before the whole run's were, resumes mid-epoch in one process
    with 2 replicas (32 a step) at the same sample, with no warning."""
    whole = _fit(2, _data())
    part = _fit(2, _data(), max_steps=6)
    sd = part.state_dict()
    one = {k: sd[k] for k in ("rng", "device_rng", "epoch_rng", "sampler_rng")}
    sd["processes"] = [one, one]
    sd["data"] = {
        "factors": dict(sd["data"]["factors"], replicationFactor=1),
        "samples_per_step": 16,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rest = _fit(2, _data(), state=sd)
    assert rest.state.counters() == whole.state.counters()
    for k, v in whole.model.state_dict().items():
        assert torch.equal(v, rest.model.state_dict()[k]), k


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(_data())


def test_a_stream_resumes_mid_epoch_only_with_the_saved_number_of_instances():
    """Each instance reads an IterableDataset on its own: a mid-epoch checkpoint of 2
    instances (the same 2 replicas in all) cannot continue in 1, refused before any step."""

    class Save(Callback):
        def on_train_step_end(self, loop):
            if loop.state.step == 2:
                self.sd = loop.state_dict()

    save = Save()
    _fit(2, _Stream(), [save], max_steps=2)
    sd = save.sd
    assert sd["counters"]["epoch_step"] == 2
    sd["data"] = dict(sd["data"], instances=2)
    with pytest.raises(
        ValueError,
        match=r"middle of epoch 0 with 1 instance\(s\): the "
        "checkpoint was written by 2",
    ):
        _fit(2, _Stream(), state=sd)


# -- a user's DistributedSampler -----------------------------------------------------------
SAMPLER = (
    COMMON
    + r"""
ds = Recorded()
for job in cfg["jobs"]:  # 3 epochs of 4 steps, maybe stopped after step 6, maybe resumed
    cbs = [ModelCheckpoint(job["ckpt"], every_n_steps=1, save_top_k=-1)] if "ckpt" in job else []
    loop, steps = new_loop(1, cbs)
    loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, seed=7))  # DDP's way
    loop.fit(loader, epochs=3, max_steps=job.get("max_steps"), resume_from=job.get("resume"))
    save(job["name"], loop, steps)
"""
)


def _epoch_orders(n: int, seed: int, epochs: int) -> list[list[int]]:
    """The whole dataset's order a DistributedSampler draws each epoch (its ranks' shares)."""
    orders = []
    for epoch in range(epochs):
        order = DistributedSampler(range(n), num_replicas=1, rank=0, seed=seed)
        order.set_epoch(epoch)
        orders.append(list(order))
    return orders


@pytest.mark.slow
def test_a_distributed_sampler_reads_the_whole_dataset_once_an_epoch_in_a_new_order(tmp_path):
    """``DataLoader(ds, sampler=DistributedSampler(ds, seed=7))`` under torchrun (2 processes):
    each epoch every sample is read once (4 steps of 32 over both instances), in the order of
    the sampler's permutation for that epoch (its seed + the epoch, as set_epoch gives it),
    a new one each epoch; a run stopped mid-epoch resumes to the same weights, bitwise."""
    out = tmp_path / "out"
    out.mkdir()
    ckpt = tmp_path / "ckpt"
    proc = _launch(
        tmp_path,
        SAMPLER,
        {
            "out": str(out),
            "jobs": [
                {"name": "whole"},
                {"name": "part", "ckpt": str(ckpt), "max_steps": 6},
                {"name": "rest", "resume": str(ckpt / "epoch1-step6")},
            ],
        },
    )
    _check(proc)
    reads = _reads(out, "whole", 2)
    assert list(reads) == list(range(1, 13))
    orders = _epoch_orders(128, 7, 3)
    assert orders[0] != orders[1] != orders[2]
    for epoch, order in enumerate(orders):
        for k in range(4):
            assert reads[4 * epoch + k + 1] == sorted(order[32 * k : 32 * (k + 1)])
    assert _reads(out, "rest", 2) == {s: reads[s] for s in range(7, 13)}
    for rank in (0, 1):
        w, r = _load(out, "whole", rank), _load(out, "rest", rank)
        assert r["counters"] == w["counters"] and w["counters"]["step"] == 12
        for k, v in w["weights"].items():
            assert torch.equal(v, r["weights"][k]), (rank, k)


class _Reads(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.read = torch.randn(n, 5, generator=g), []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.read.append(int(i))
        return self.x[i], (self.x[i, 0] > 0).long()


def _loop() -> Loop:
    torch.manual_seed(0)
    return Loop(
        torch.nn.Linear(5, 2),
        poptorch.Options().deviceIterations(2),
        loss_fn=torch.nn.CrossEntropyLoss(),
        seed=1,
        progress=False,
    )


def test_a_distributed_sampler_in_one_process_is_its_whole_order_with_the_epoch_set():
    """One process, ``DistributedSampler(ds, num_replicas=1, rank=0, seed=5)``: each epoch
    reads its permutation for that epoch (a new one each epoch, as set_epoch would give),
    the 4 samples that make no whole host call of 8 read and dropped."""
    ds = _Reads(36)
    loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 1, 0, seed=5))
    with pytest.warns(UserWarning, match="4 of 36 samples are dropped"):
        _loop().fit(loader, epochs=3)
    read = ds.read[-108:]  # (the host check reads some first; each epoch is read whole)
    orders = _epoch_orders(36, 5, 3)
    assert read == orders[0] + orders[1] + orders[2]
    assert orders[0] != orders[1]


@pytest.mark.parametrize(
    "sampler, message",
    [
        (
            lambda ds: DistributedSampler(ds, num_replicas=2, rank=0),
            r"sampler=DistributedSampler\(num_replicas=2\), but this run has 1 instance\(s\)",
        ),
        (
            lambda ds: type("Shard", (DistributedSampler,), {})(ds, num_replicas=1, rank=0),
            "a subclass of DistributedSampler",
        ),
    ],
)
def test_a_distributed_sampler_for_another_layout_is_refused_before_any_step(sampler, message):
    ds = _Reads(32)
    loop = _loop()
    with pytest.raises(ValueError, match=message):
        loop.fit(DataLoader(ds, batch_size=4, sampler=sampler(ds)))
    assert loop.train_model is None and loop.state.step == 0


# -- validate() on one instance ---------------------------------------------------------------
VALIDATE = r"""
import faulthandler, json, os, signal, sys, time
faulthandler.dump_traceback_later(100, exit=True)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's timeout asks where
import torch, torch.nn as nn, torchmetrics
from torch.utils.data import DataLoader, TensorDataset
from ipuloop import Callback, Loop, poptorch

cfg = json.loads(sys.argv[1])
rank = int(os.environ["RANK"])
g = torch.Generator().manual_seed(2)
vx, vy = torch.randn(37, 5, generator=g), (torch.randn(37, generator=g) > 0).long()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
with torch.no_grad():
    out = model(vx)
ref = {"val_loss": float(nn.functional.cross_entropy(out, vy)),
       "val_acc": float((out.argmax(-1) == vy).float().mean())}  # plain torch, all 37
loop = Loop(model, poptorch.Options().deviceIterations(2), loss_fn=nn.CrossEntropyLoss(),
            metrics={"acc": torchmetrics.Accuracy(task="multiclass", num_classes=2)},
            progress=False)
loader = DataLoader(TensorDataset(vx, vy), batch_size=3)
start = time.monotonic()
alone = loop.validate(loader) if rank == 0 else None  # instance 1 goes on without it
both = loop.validate(loader)
json.dump({"alone": alone, "both": both, "ref": ref, "seconds": time.monotonic() - start},
          open(os.path.join(cfg["out"], f"val{rank}.json"), "w"))
"""


@pytest.mark.slow
def test_validate_on_one_instance_runs_alone_over_every_sample(tmp_path):
    """Under torchrun (2 processes), ``validate()`` called on instance 0 only returns at once
    (no wait on instance 1) the values of plain torch over all 37 samples (micro-batch 3,
    padded), metrics included; called on both, each returns them too."""
    out = tmp_path / "out"
    out.mkdir()
    _check(_launch(tmp_path, VALIDATE, {"out": str(out)}))
    val = [json.loads((out / f"val{rank}.json").read_text()) for rank in (0, 1)]
    ref = val[0]["ref"]
    for got in (val[0]["alone"], val[0]["both"], val[1]["both"]):
        assert got["val_acc"] == ref["val_acc"]
        assert got["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-6)


# -- an error on one instance -----------------------------------------------------------------
FAIL = (
    COMMON
    + r"""
import atexit
from torch.utils.data import TensorDataset
place, failing = cfg["place"], cfg["rank"]
ends = {}


@atexit.register  # before the Loop's own exit handler: runs after it, as the process ends
def _ended():
    ends["end"] = time.time()
    json.dump(ends, open(os.path.join(out, f"end{rank}.json"), "w"))


def fail(what):
    ends["failed"] = time.time()
    raise ValueError(f"boom {what} on instance {rank}")


class Failing(Recorded):
    reads = 0

    def __getitem__(self, i):
        Failing.reads += 1
        if place == "data" and rank == failing and Failing.reads == 4 + 16 + 5:  # 2nd step
            fail("in the data")
        return super().__getitem__(i)


class Act(Callback):
    def on_train_step_end(self, loop):
        if place == "hook" and rank == failing and loop.state.step == 2:
            fail("in a hook")

    def on_validation_step_end(self, loop):
        if place == "validation" and rank == failing:
            fail("in validation")


loop, _ = new_loop(1, [Act()])
if place == "before" and rank == failing:  # e.g. a checkpoint on one machine only
    resume, ends["failed"] = os.path.join(out, "missing"), time.time()
else:
    resume = None
g = torch.Generator().manual_seed(2)
val = TensorDataset(torch.randn(37, 5, generator=g), torch.randint(0, 2, (37,), generator=g))
try:
    loop.fit(DataLoader(Failing(), batch_size=4, shuffle=True), epochs=2,
             val_loader=DataLoader(val, batch_size=3), resume_from=resume)
except Exception as e:
    ends.update(error=type(e).__name__, message=str(e), instance=getattr(e, "instance", None))
    raise
"""
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "place, failing, torchrun, cause",
    [
        (
            "hook",
            1,
            True,
            "ValueError: boom in a hook on instance 1 (raised in callback Act.on_train_step_end)",
        ),
        ("data", 1, False, "ValueError: boom in the data on instance 1"),
        (
            "validation",
            0,
            False,
            "ValueError: boom in validation on instance 0 (raised in "
            "callback Act.on_validation_step_end)",
        ),
        ("before", 1, False, "CheckpointError: "),
    ],
)
def test_an_error_on_one_instance_ends_every_instance_promptly_naming_it(
    tmp_path, place, failing, torchrun, cause
):
    """An exception on one instance (in a hook, the data loader, validation, or before the
    first step, e.g. a checkpoint missing on its machine) while the other waits in a
    collective: both end within seconds, not after IPULOOP_DIST_TIMEOUT (300 s here); the
    failing one raises its own error, the other an ``InstanceFailedError`` naming it. (Under
    torchrun the launcher keeps the group's store; without it, instance 0 does, and stays
    until the other has read its error.)"""
    out = tmp_path / "out"
    out.mkdir()
    proc = _launch(
        tmp_path,
        FAIL,
        {"out": str(out), "place": place, "rank": failing},
        timeout=90,
        torchrun=torchrun,
        IPULOOP_DIST_TIMEOUT="300",
    )
    assert proc.returncode != 0
    ends = [json.loads((out / f"end{rank}.json").read_text()) for rank in (0, 1)]
    mine, other = ends[failing], ends[1 - failing]
    assert f"{mine['error']}: {mine['message']}".startswith(cause.split(" (")[0])
    assert other["error"] == "InstanceFailedError" and other["instance"] == failing
    assert other["message"].startswith(f"Instance {failing} of 2 failed at step ")
    assert cause in other["message"], other["message"]
    assert f"Instance {1 - failing} stopped at step " in other["message"]
    fits, job = max(e["end"] for e in ends) - mine["failed"], time.time() - mine["failed"]
    print(f"{place}: every fit ended {fits:.2f} s after the error, the job {job:.1f} s after")
