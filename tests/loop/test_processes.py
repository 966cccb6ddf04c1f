"""Several processes: a Loop per process under torchrun (gloo on the CPU), as one run.

Each test starts ``python -m torch.distributed.run --nproc-per-node 2`` on a script written to
``tmp_path`` (or, for a dying instance, the two processes directly), and compares with one
process running ``replicas=2``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import clean_env, command, free_port
import warm

from ipuloop import processes

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import faulthandler, json, os, signal, sys, time
faulthandler.dump_traceback_later(140, exit=True)  # a hang shows where, then ends
import torch, torch.nn as nn, torchmetrics
from torch.utils.data import DataLoader, TensorDataset
from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks import CSVLogger, ModelCheckpoint, ProgressBar

cfg = json.loads(sys.argv[1])
out = cfg["out"]
rank = int(os.environ.get("RANK", "0"))
g = torch.Generator().manual_seed(1)
x = torch.randn(96, 5, generator=g)
y = (x[:, 0] + 0.3 * x[:, 1] > 0).long()
vx = torch.randn(37, 5, generator=g)
vy = (vx[:, 0] > 0).long()
torch.manual_seed(0)
layers = [nn.Linear(5, 16), nn.ReLU()]
if cfg.get("dropout"):
    layers.append(nn.Dropout(0.2))
model = nn.Sequential(*layers, nn.Linear(16, 2))
opts = poptorch.Options().deviceIterations(2)
opts.Training.gradientAccumulation(2)


class Act(Callback):
    """At a step, on one instance: SIGTERM, stop(), die or hang."""

    def on_train_step_end(self, loop):
        a = cfg.get("act")
        if a and loop.state.step == a["step"] and rank == a["rank"]:
            if a["what"] == "term":
                os.kill(os.getpid(), signal.SIGTERM)
            elif a["what"] == "stop":
                loop.stop()
            elif a["what"] == "die":
                os._exit(3)
            elif a["what"] == "hang":
                time.sleep(600)


cbs = [Act(), ProgressBar(every=1, stream=open(os.path.join(out, f"progress{rank}.txt"), "w")),
       CSVLogger(os.path.join(out, "log.csv"), every_n_steps=1)]
if cfg.get("ckpt"):
    cbs.append(ModelCheckpoint(cfg["ckpt"], every_n_epochs=None,
                               every_n_steps=cfg.get("every"), save_top_k=-1))
seed = cfg.get("seed", 1) + (cfg.get("seed_step", 0) * rank)
loop = Loop(model, opts, loss_fn=nn.CrossEntropyLoss(), replicas=cfg["replicas"], seed=seed,
            optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            metrics={"acc": torchmetrics.Accuracy(task="multiclass", num_classes=2)},
            callbacks=cbs, progress=False)
val = DataLoader(TensorDataset(vx, vy), batch_size=3)
if cfg.get("val_sets"):  # several validation sets, each shared out
    val = {"a": DataLoader(TensorDataset(vx[:20], vy[:20]), batch_size=3),
           "b": DataLoader(TensorDataset(vx[20:], vy[20:]), batch_size=2)}
try:
    hist = loop.fit(DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
                    epochs=cfg.get("epochs", 2), val_loader=val,
                    max_steps=cfg.get("max_steps"), resume_from=cfg.get("resume"))
except SystemExit as e:
    with open(os.path.join(out, f"exit{rank}"), "w") as f:
        f.write(str(e.code))
    raise
torch.save({"weights": model.state_dict(), "history": hist, "logs": dict(loop.state.logs),
            "counters": loop.state.counters()}, os.path.join(out, f"result{rank}.pt"))
'''


def _env(**extra: str) -> dict:
    return clean_env(**{"IPULOOP_DIST_TIMEOUT": "20", "PYTHONWARNINGS": "ignore", **extra})


def _run(tmp_path: Path, name: str, cfg: dict, processes: int = 2, **env: str):
    """Run the script in ``processes`` processes (torchrun), or 1 (plain python)."""
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cfg = dict(cfg, out=str(out))
    cmd = command(script, json.dumps(cfg), processes=processes)
    proc = warm.run(cmd, env=_env(**env), cwd=tmp_path, capture_output=True, text=True, timeout=170)
    return proc, out


def _check(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _result(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"result{rank}.pt", weights_only=False)


# -- the launcher's environment ---------------------------------------------------------------
def test_detect_reads_torchrun_mpirun_and_poprun():
    assert processes.detect({}) is None
    assert processes.detect({"RANK": "0", "WORLD_SIZE": "1"}) is None  # alone
    t = processes.detect({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (t.rank, t.size, t.local_rank, t.launcher) == (1, 4, 1, "torchrun")
    m = processes.detect({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"})
    assert (m.rank, m.size, m.launcher) == (2, 3, "mpirun")
    # poprun runs mpirun: its own variables win, and give the local replicas
    p = processes.detect(
        {
            "POPDIST_NUM_TOTAL_REPLICAS": "8",
            "POPDIST_NUM_LOCAL_REPLICAS": "2",
            "POPDIST_REPLICA_INDEX_OFFSET": "6",
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
        }
    )
    assert (p.rank, p.size, p.launcher, p.local_replicas) == (3, 4, "poprun", 2)
    with pytest.raises(ValueError, match="instance index 4 of 2"):
        processes.detect({"RANK": "4", "WORLD_SIZE": "2"})


def test_timeout_comes_from_the_environment():
    assert processes.timeout_seconds({}) == processes.DEFAULT_TIMEOUT
    assert processes.timeout_seconds({"IPULOOP_DIST_TIMEOUT": "2.5"}) == 2.5
    with pytest.raises(ValueError, match="IPULOOP_DIST_TIMEOUT='soon'"):
        processes.timeout_seconds({"IPULOOP_DIST_TIMEOUT": "soon"})


# -- two processes as one run -----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("val_sets", [False, True], ids=["one_val_set", "two_val_sets"])
def test_two_processes_train_as_one_process_with_twice_the_replicas(tmp_path, val_sets):
    """Weights, logged losses and metrics (train and validation, 37 validation samples shared
    out without loss; or two validation sets, each shared out) of 2 processes x 1 replica
    equal those of 1 process x 2 replicas; only instance 0 shows progress and writes the CSV
    log."""
    one, out1 = _run(tmp_path, "one", {"replicas": 2, "val_sets": val_sets}, processes=1)
    _check(one)
    two, out2 = _run(tmp_path, "two", {"replicas": 1, "val_sets": val_sets})
    _check(two)
    if val_sets:
        assert {"val_loss/a", "val_acc/b"} <= set(_result(out2)["history"][-1])
    a, b = _result(out1), _result(out2)
    for k in a["weights"]:
        assert torch.allclose(a["weights"][k], b["weights"][k], atol=1e-6), k
    assert torch.equal(_result(out2, 1)["weights"]["0.weight"], b["weights"]["0.weight"])
    assert a["counters"] == b["counters"]
    assert len(a["history"]) == len(b["history"]) == 2
    for ha, hb in zip(a["history"], b["history"]):
        assert set(ha) == set(hb)
        for k in ha:
            assert ha[k] == pytest.approx(hb[k], abs=1e-6), k
    assert (out2 / "progress0.txt").read_text() and not (out2 / "progress1.txt").read_text()
    rows = (out2 / "log.csv").read_text().splitlines()
    assert len(rows) == len((out1 / "log.csv").read_text().splitlines())


RESUMED = {"replicas": 1, "dropout": True, "epochs": 2}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """Two processes training RESUMED's 2 epochs (6 steps) without a stop."""
    tmp = tmp_path_factory.mktemp("whole")
    whole, out = _run(tmp, "whole", RESUMED)
    _check(whole)
    return out


@pytest.mark.slow
def test_an_interrupted_two_process_run_resumes_exactly(tmp_path, uninterrupted):
    """Stopped by max_steps mid-epoch with a checkpoint every 2 steps (written by instance 0),
    resumed by both instances from it: the weights equal an uninterrupted run's, bitwise."""
    cfg, out_w = RESUMED, uninterrupted
    ckpt = tmp_path / "ckpt"
    part, _ = _run(tmp_path, "part", dict(cfg, ckpt=str(ckpt), every=2, max_steps=4))
    _check(part)
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch0-step2", "epoch1-step4"]
    rest, out_r = _run(tmp_path, "rest", dict(cfg, ckpt=str(ckpt), every=2, resume="last"))
    _check(rest)
    w, r = _result(out_w), _result(out_r)
    assert r["counters"] == w["counters"]
    for rank in (0, 1):
        for k, v in _result(out_w, rank)["weights"].items():
            assert torch.equal(v, _result(out_r, rank)["weights"][k]), (rank, k)
    assert [h["train_loss"] for h in r["history"]] == [h["train_loss"] for h in w["history"]]
    assert [h["train_acc"] for h in r["history"]] == [h["train_acc"] for h in w["history"]]


@pytest.mark.slow
def test_sigterm_to_one_instance_stops_both_at_the_same_step(tmp_path, uninterrupted):
    """SIGTERM to instance 1 at step 3: both stop after step 3, instance 0 saves once, both
    exit 143; a resumed run ends as an uninterrupted one."""
    cfg = RESUMED
    ckpt = tmp_path / "ckpt"
    proc, out = _run(
        tmp_path, "term", dict(cfg, ckpt=str(ckpt), act={"step": 3, "rank": 1, "what": "term"})
    )
    assert proc.returncode != 0
    assert (out / "exit0").read_text() == (out / "exit1").read_text() == "143"
    assert [p.name for p in ckpt.iterdir()] == ["epoch0-step3"]
    rest, out_r = _run(tmp_path, "rest", dict(cfg, ckpt=str(ckpt), resume="last"))
    _check(rest)
    for rank in (0, 1):
        for k, v in _result(uninterrupted, rank)["weights"].items():
            assert torch.equal(v, _result(out_r, rank)["weights"][k]), (rank, k)


@pytest.mark.slow
def test_stop_on_one_instance_stops_both(tmp_path):
    proc, out = _run(
        tmp_path, "stop", {"replicas": 1, "act": {"step": 2, "rank": 1, "what": "stop"}}
    )
    _check(proc)
    assert _result(out, 0)["counters"]["step"] == _result(out, 1)["counters"]["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("what", ["die", "hang"])
def test_a_dead_or_hung_instance_fails_the_other_with_an_error(tmp_path, what):
    """Instance 1 exits (or stops answering) at step 2; instance 0 fails with an error, within
    IPULOOP_DIST_TIMEOUT (2 s) for a hung one, instead of waiting for ever."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    cfg = json.dumps({"replicas": 1, "out": str(out), "act": {"step": 2, "rank": 1, "what": what}})
    port = str(free_port())
    procs = [
        warm.Popen(
            [sys.executable, str(script), cfg],
            cwd=tmp_path,
            env=_env(
                RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                IPULOOP_DIST_TIMEOUT="2",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        _, err = procs[0].communicate(timeout=60)
        assert procs[0].returncode not in (0, None)
        assert "instance" in err.lower() and (
            "died" in err or "timed out" in err.lower() or "closed" in err.lower()
        ), err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


@pytest.mark.slow
def test_instances_with_different_seeds_are_an_error_naming_the_instance(tmp_path):
    proc, _ = _run(tmp_path, "seeds", {"replicas": 1, "seed_step": 1})
    assert proc.returncode != 0
    assert (
        "Instance 1 of 2 differs from instance 0: randomSeed 1 on instance 0 but 2 on "
        "instance 1" in proc.stderr
    ), proc.stderr[-3000:]


@pytest.mark.slow
def test_the_benchmark_writes_its_json(tmp_path):
    """A tiny run of benchmarks/distributed.py (random images): keys only, no timing."""
    out = tmp_path / "d.json"
    proc = warm.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "distributed.py"),
            "--samples",
            "512",
            "--micro",
            "4",
            "--di",
            "2",
            "--ga",
            "8",
            "--steps",
            "1",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=120,
    )
    _check(proc)
    res = json.loads(out.read_text())
    assert set(res["configs"]) == {"1x1", "1x2", "2x1"}
    assert res["configs"]["2x1"]["samples_per_step"] == res["configs"]["1x2"]["samples_per_step"]
    assert set(res["scaling"]["2"]) == {
        "speedup_over_1x1",
        "scaling_efficiency",
        "speedup_over_1x2",
    }
    assert set(res["meta"]) >= {"loadavg_start", "loadavg_end", "torch", "command"}
