"""Multi-process (PopDist-style) emulation: N processes at replicationFactor(R) train as one
process at replicationFactor(N*R); options must agree; a dead instance is an error, not a hang.

The multi-process tests start two real processes on gloo (torchrun, or two plain processes given
torchrun's environment), each running a script written to tmp_path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import clean_env, free_port
import warm

import ipuloop.emulator as poptorch

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="this torch build has no torch.distributed (gloo)",
)

LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
MPIRUN_ENV = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
POPRUN_ENV = ("POPDIST_NUM_TOTAL_REPLICAS", "POPDIST_REPLICA_INDEX_OFFSET")

COMMON = """
import os, sys
import torch
import torch.nn.functional as F
import ipuloop.emulator as poptorch


class WithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.BatchNorm1d(8),
                                       torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def forward(self, x, y):
        out = self.net(x)
        return out, F.mse_loss(out, y)


def options(rf, ga=1, di=1, mean=True, procs=True):
    opts = poptorch.Options().replicationFactor(rf).deviceIterations(di)
    opts.Training.gradientAccumulation(ga)
    opts.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.Mean if mean else poptorch.ReductionType.Sum)
    opts.outputMode(poptorch.OutputMode.All)
    if procs:
        opts.Distributed.setEnvVarNames("WORLD_SIZE", "RANK")
    else:
        opts.Distributed.disable()
    return opts


def finish():
    # the script ends as programs do: the emulator's group is destroyed at exit
    sys.stdout.flush()
"""

EQUIVALENCE = (
    COMMON
    + """
STEPS, B = 3, 2
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
CONFIGS = [  # R, GA, DI, Mean, optimizer, tolerance (Adam magnifies float rounding), dtype
    (1, 1, 1, True, lambda p: poptorch.optim.SGD(p, lr=0.1), 1e-6, torch.float32),
    (2, 2, 2, False, lambda p: poptorch.optim.SGD(p, lr=0.02, momentum=0.9, loss_scaling=8.0,
                                                  max_grad_norm=0.05), 1e-6, torch.float32),
    (2, 2, 2, True, lambda p: poptorch.optim.Adam(p, lr=0.01, max_grad_norm=0.1), 2e-5,
     torch.float32),
]
if sys.argv[1:] == ["half"]:  # float16 weights and gradients (reduced as float32)
    CONFIGS.append((2, 2, 1, True, lambda p: poptorch.optim.SGD(p, lr=0.1, loss_scaling=64.0),
                    2e-3, torch.float16))
for R, GA, DI, mean, make_opt, tol, dtype in CONFIGS:
    g = torch.Generator().manual_seed(1)
    X = torch.randn(STEPS, DI, GA, n * R, B, 4, generator=g).to(dtype)
    Y = torch.randn(STEPS, DI, GA, n * R, B, 2, generator=g).to(dtype)

    m = WithLoss().to(dtype)
    tm = poptorch.trainingModel(m, options(R, GA, DI, mean), make_opt(m.parameters()))
    losses = []
    for s in range(STEPS):  # this process's replicas' micro-batches: [DI, GA, N, R, B][:, :, p]
        x = X[s][:, :, rank * R:(rank + 1) * R].reshape(-1, 4)
        y = Y[s][:, :, rank * R:(rank + 1) * R].reshape(-1, 2)
        losses.append(tm(x, y)[1])
    assert tm._opt.reducer.collectives == STEPS * DI, tm._opt.reducer.collectives  # one per update
    got = {k: v.clone() for k, v in m.state_dict().items()}

    ref = WithLoss().to(dtype)
    rm = poptorch.trainingModel(ref, options(n * R, GA, DI, mean, procs=False),
                                make_opt(ref.parameters()))
    ref_losses = [rm(X[s].reshape(-1, 4), Y[s].reshape(-1, 2))[1] for s in range(STEPS)]
    want = ref.state_dict()
    moved = False
    for k, v in want.items():
        if "running" in k or "num_batches" in k:
            if rank != 0:
                continue  # BatchNorm statistics: each replica's own; rank 0 holds replica 0's
        torch.testing.assert_close(got[k], v, rtol=10 * tol, atol=tol, msg=lambda s: f"{k}: {s}")
        moved = moved or not torch.equal(v, WithLoss().to(dtype).state_dict()[k])
    assert moved
    for s in range(STEPS):  # outputs: the local replicas' own
        local = ref_losses[s].view(DI, GA, n, R)[:, :, rank].reshape(-1)
        torch.testing.assert_close(losses[s].reshape(-1), local, rtol=10 * tol, atol=tol)
    print(f"rank {rank} R={R} GA={GA} DI={DI} mean={mean} {dtype}: equal", flush=True)
finish()
"""
)

MISMATCH = (
    COMMON
    + """
rank = int(os.environ["RANK"])
x, y = torch.randn(4, 4), torch.randn(4, 2)

opts = options(1)
opts.Distributed.configureProcessId(1 - rank, 2)  # the wrong way round
m = WithLoss()
try:
    poptorch.trainingModel(m, opts, poptorch.optim.SGD(m.parameters(), lr=0.1))(x, y)
    raise SystemExit("no error for a process id that is not the group's rank")
except poptorch.Error as e:
    assert f"rank {rank} of 2" in str(e), e
    print("RANK-ERROR", e, flush=True)

m = WithLoss()
tm = poptorch.trainingModel(m, options(1, ga=1 + rank),
                            poptorch.optim.SGD(m.parameters(), lr=0.1))
try:
    tm(x, y)
    raise SystemExit("no error for differing options")
except poptorch.Error as e:
    assert "instance 1" in str(e) and "Training.gradientAccumulation = 2" in str(e), e
    print("MISMATCH-ERROR", e, flush=True)

m = WithLoss()
tm = poptorch.trainingModel(m, options(1), poptorch.optim.SGD(m.parameters(), lr=0.1 + rank))
try:
    tm(x, y)
    raise SystemExit("no error for differing optimizers")
except poptorch.Error as e:
    assert "instance 1" in str(e) and "'lr'" in str(e) and "1.1" in str(e), e
    print("OPTIMIZER-ERROR", e, flush=True)

import warnings
m = WithLoss()
with torch.no_grad():
    m.net[0].weight.add_(rank)  # instance 1 starts elsewhere: a warning, not an error
tm = poptorch.trainingModel(m, options(1), poptorch.optim.SGD(m.parameters(), lr=0.1))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tm(x, y)
if rank == 0:
    assert any("initial weights differ" in str(w.message) for w in caught), caught
    print("WEIGHTS-WARNING", flush=True)
finish()
"""
)

DEAD = (
    COMMON
    + """
import datetime
import torch.distributed as dist
rank, mode = int(os.environ["RANK"]), sys.argv[1]
if mode == "after-join":  # the program creates the group; the emulator joins it
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
if rank == 1:
    os._exit(0)  # dies before the first collective
m = WithLoss()
tm = poptorch.trainingModel(m, options(1), poptorch.optim.SGD(m.parameters(), lr=0.1))
try:
    tm(torch.randn(4, 4), torch.randn(4, 2))
except poptorch.Error as e:
    print("CAUGHT", e, flush=True)
    os._exit(3)
os._exit(0)
"""
)


def _torchrun(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        *args,
    ]
    return warm.run(
        cmd,
        cwd=tmp_path,
        env=clean_env(IPULOOP_DIST_TIMEOUT="60"),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_two_processes_train_as_one_with_twice_the_replicas(tmp_path):
    # 2 x RF 1 == 1 x RF 2 (SGD, Mean); 2 x RF 2 with GA 2, DI 2 == 1 x RF 4 with Sum, momentum,
    # loss scaling and global-norm clipping, and with Adam and Mean.
    # With torch >= 2.1 (CPU float16 backward kernels) also 2 x RF 2 in float16 == 1 x RF 4.
    half = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 1)
    run = _torchrun(tmp_path, EQUIVALENCE, *(["half"] if half else []))
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank} R=1 GA=1 DI=1 mean=True torch.float32: equal" in out
        assert f"rank {rank} R=2 GA=2 DI=2 mean=False torch.float32: equal" in out
        assert f"rank {rank} R=2 GA=2 DI=2 mean=True torch.float32: equal" in out
        assert (f"rank {rank} R=2 GA=2 DI=1 mean=True torch.float16: equal" in out) == half


@pytest.mark.slow
def test_instances_must_agree_on_options_and_rank(tmp_path):
    run = _torchrun(tmp_path, MISMATCH)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert out.count("RANK-ERROR") == 2 and out.count("MISMATCH-ERROR") == 2, out
    assert out.count("OPTIMIZER-ERROR") == 2, out
    assert out.count("WEIGHTS-WARNING") == 1, out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["before-join", "after-join"])
def test_a_dead_instance_fails_the_others_within_the_timeout(tmp_path, mode):
    script = tmp_path / "dead.py"
    script.write_text(textwrap.dedent(DEAD))
    port = str(free_port())
    procs = [
        warm.Popen(
            [sys.executable, str(script), mode],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=clean_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(r),
                WORLD_SIZE="2",
                IPULOOP_DIST_TIMEOUT="4",
            ),
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert procs[1].returncode == 0, outs[1]
    assert procs[0].returncode == 3, outs[0]
    assert "CAUGHT instance 0 of 2" in outs[0], outs[0]
    if mode == "before-join":
        assert "could not join the other instances within 4 s" in outs[0], outs[0]
        assert "IPULOOP_DIST_TIMEOUT" in outs[0]
    else:
        assert "comparing options across instances failed" in outs[0], outs[0]


def _model_and_batch() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    return model, torch.randn(2, 4), torch.randn(2, 2)


class _WithLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(x)
        return out, torch.nn.functional.mse_loss(out, y)


def test_several_processes_without_a_launcher_are_a_clear_error(monkeypatch):
    for name in LAUNCHER_ENV + MPIRUN_ENV + POPRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    model, x, y = _model_and_batch()
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    tm = poptorch.trainingModel(_WithLoss(model), opts)
    with pytest.raises(
        poptorch.Error,
        match=r"torchrun's RANK and WORLD_SIZE, mpirun's OMPI_COMM_WORLD_RANK and "
        r"OMPI_COMM_WORLD_SIZE, or poprun's POPDIST_\*.*torch\.distributed\.run --nproc-per-node 2",
    ):
        tm(x, y)
    assert not tm.isCompiled()
    # An inference model reduces nothing and joins nothing.
    inf = poptorch.inferenceModel(model, opts)
    assert inf(x).shape == (2, 2)
    assert not dist.is_initialized()


def test_process_id_out_of_range_and_bad_timeout(monkeypatch):
    model, x, y = _model_and_batch()
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(2, 2)
    with pytest.raises(poptorch.Error, match=r"processId is 2 but numProcesses is 2"):
        poptorch.trainingModel(_WithLoss(model), opts)(x, y)
    monkeypatch.setenv("IPULOOP_DIST_TIMEOUT", "soon")
    for name in LAUNCHER_ENV:
        monkeypatch.setenv(name, "0" if name != "MASTER_ADDR" else "127.0.0.1")
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    model, x, y = _model_and_batch()
    with pytest.raises(poptorch.Error, match=r"IPULOOP_DIST_TIMEOUT='soon'"):
        poptorch.trainingModel(_WithLoss(model), opts)(x, y)
    assert not dist.is_initialized()


def test_the_launchers_whose_environment_creates_the_group():
    from ipuloop.emulator.device.distributed import launched, launcher_rank

    assert not launched({})
    assert launched({"RANK": "0", "WORLD_SIZE": "2"})  # torchrun
    assert launched({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})  # mpirun
    poprun = {"POPDIST_REPLICA_INDEX_OFFSET": "2", "POPDIST_NUM_TOTAL_REPLICAS": "4"}
    assert launched(poprun)
    assert not launched({"RANK": "0"}) and not launched({"OMPI_COMM_WORLD_SIZE": "2"})
    # the rank the group is created with: the launcher's (the options are checked against it)
    assert launcher_rank({"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}) == (1, 2)
    assert launcher_rank({**poprun, "POPDIST_NUM_LOCAL_REPLICAS": "2"}) == (1, 2)
    assert launcher_rank({}) is None


MPIRUN = """
import os
import torch
import torch.distributed as dist
import ipuloop.emulator as poptorch

torch.manual_seed(0)
net = torch.nn.Linear(4, 2)
opts = poptorch.Options()  # numProcesses and processId: mpirun's OMPI_COMM_WORLD_*, by default
rank = opts.Distributed.processId
g = torch.Generator().manual_seed(rank)  # each instance its own data
x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)


class WithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        out = self.net(x)
        return out, torch.nn.functional.mse_loss(out, y)


tm = poptorch.trainingModel(WithLoss(), opts, torch.optim.SGD(net.parameters(), lr=0.1))
tm(x, y)
tm.copyWeightsToHost()
print("RANK", rank, "OF", dist.get_world_size(), "WEIGHT", net.weight.sum().item(), flush=True)
"""


@pytest.mark.threads
def test_under_mpirun_s_environment_alone_the_instances_join_one_group(tmp_path):
    """OMPI_COMM_WORLD_* and no MASTER_ADDR (mpirun sets none): the group is created at
    127.0.0.1 and MASTER_PORT, and the two instances apply the same averaged update."""
    script = tmp_path / "mpirun.py"
    script.write_text(MPIRUN)
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = clean_env(
            OMPI_COMM_WORLD_RANK=str(rank),
            OMPI_COMM_WORLD_SIZE="2",
            MASTER_PORT=port,
            IPULOOP_DIST_TIMEOUT="60",
        )
        for name in POPRUN_ENV:
            env.pop(name, None)
        procs.append(
            warm.Popen(
                [sys.executable, str(script)],
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    lines = [next(s for s in out.splitlines() if s.startswith("RANK")) for out in outs]
    assert [line.split()[1:4] for line in lines] == [["0", "OF", "2"], ["1", "OF", "2"]]
    assert lines[0].split()[-1] == lines[1].split()[-1]  # one update, of both instances' data
