"""WandbLogger and MLFlowLogger: the values read back from W&B's offline run file and MLflow's
sqlite store, against TensorBoardLogger's event file; their settings; resume; instance 0 only.

Nothing reaches a network: W&B runs offline (no login), MLflow logs to a sqlite file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torchmetrics
from launch import clean_env, command
from torch.utils.data import DataLoader, TensorDataset
import warm

from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks import LRScheduler, ModelCheckpoint
from ipuloop.integrations.mlflow_logger import MLFlowLogger
from ipuloop.integrations.tensorboard import TensorBoardLogger
from ipuloop.integrations.wandb_logger import WandbLogger

wandb = pytest.importorskip("wandb", reason="the test extra installs wandb")
pytest.importorskip("mlflow", reason="the test extra installs mlflow-skinny")
pytest.importorskip("sqlalchemy", reason="MLflow's sqlite store needs SQLAlchemy (test extra)")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
from google.protobuf.message import DecodeError  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = [2, 4, 6, 8, 10, 12, 14, 16]  # updates after each step: 2 epochs of 4 steps, DI=2


# -- backends, offline -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wandb_offline(tmp_path_factory):
    """W&B offline for these tests (it reads its settings once), no API key, its own files in
    a temporary folder; its service process ends with them."""
    d = tmp_path_factory.mktemp("wandb_home")
    wandb.teardown()  # settings an earlier test's run left in this process are read again
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_API_KEY", raising=False)
        for var, value in dict(
            WANDB_MODE="offline",
            WANDB_DIR=d,
            WANDB_CONFIG_DIR=d / "config",
            WANDB_CACHE_DIR=d / "cache",
            WANDB_DATA_DIR=d / "data",
            WANDB_ARTIFACT_DIR=d / "artifacts",
            WANDB_CONSOLE="off",
            WANDB_SILENT="true",
            WANDB_ERROR_REPORTING="false",
            XDG_CACHE_HOME=d / "xdg_cache",
        ).items():  # W&B's service logs
            mp.setenv(var, str(value))
        yield
        wandb.teardown()


@pytest.fixture
def wandb_dir(tmp_path, wandb_offline):
    """The folder a test's runs write to (``save_dir``)."""
    return tmp_path / "wandb_runs"


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    """An empty MLflow sqlite store, made once: creating its tables takes seconds."""
    db = tmp_path_factory.mktemp("mlflow") / "template.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def mlflow_uri(tmp_path, mlflow_template):
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template, db)
    return f"sqlite:///{db}"


def wandb_records(path: Path, timeout: float = 60.0) -> list:
    """The records of a finished W&B run file, once W&B's service has written its last (exit)
    record: ``finish()`` can return before the service has written the file."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = _read_records(path.read_bytes())
            if records and records[-1].WhichOneof("record_type") == "exit":
                return records
        except DecodeError:  # a record being written
            pass
        assert time.monotonic() < deadline, f"{path} got no exit record in {timeout} s"
        time.sleep(0.05)


def _read_records(data: bytes) -> list:
    """W&B's protobuf records in LevelDB's log format: after a 7-byte file header, blocks of
    32 KiB, each record or fragment behind a 7-byte header (crc, length, type)."""
    if len(data) < 7:
        return []
    assert data[:4] == b":W&B", "not a W&B run file"
    out, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += room
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_runs(root: Path, run_id: str) -> list[tuple[dict, dict]]:
    """Per offline folder of the run, oldest first: its rows {step: {key: value}} and config."""
    out = []
    for run_file in root.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"):
        rows, config, start = {}, {}, None
        for r in wandb_records(run_file):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                items = {_key(i): json.loads(i.value_json) for i in r.history.item}
                step = items.pop("_step")
                assert step not in rows, f"W&B step {step} written twice"
                rows[step] = {k: v for k, v in items.items() if not k.startswith("_")}
            elif kind in ("run", "config"):
                if kind == "run":
                    start = r.run.start_time.ToNanoseconds()
                update = r.run.config.update if kind == "run" else r.config.update
                config.update({_key(i): json.loads(i.value_json) for i in update})
        out.append((start, rows, config))
    return [(rows, config) for _, rows, config in sorted(out, key=lambda t: t[0])]


def series(rows: dict) -> dict[str, list[tuple[int, float]]]:
    """W&B rows as per-key (step, value) lists, as the other backends give them."""
    out: dict[str, list] = {}
    for step in sorted(rows):
        for k, v in rows[step].items():
            out.setdefault(k, []).append((step, v))
    return out


def mlflow_series(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    c = MlflowClient(tracking_uri=uri)
    return {
        k: [(m.step, m.value) for m in c.get_metric_history(run_id, k)]
        for k in c.get_run(run_id).data.metrics
    }


def tensorboard_series(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


# -- the training ------------------------------------------------------------------------------
class Crash(Callback):
    """Raises at the end of a step, after the loggers and checkpoints saw it."""

    order = 100

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, loop) -> None:
        if loop.state.step == self.step:
            raise RuntimeError("crash")


def fit(callbacks, *, groups: int = 1, adam: bool = False, epochs: int = 2, resume_from=None):
    """4 steps of 2 updates per epoch; StepLR halves the LR every 4 updates."""
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    params = list(model.parameters())
    if groups > 1:
        params = [{"params": params[:2]}, {"params": params[2:], "lr": 0.5}]
    opt = torch.optim.Adam(params, lr=0.1) if adam else torch.optim.SGD(params, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=opt,
        progress=False,
        seed=0,
        metrics={"acc": torchmetrics.Accuracy(task="multiclass", num_classes=2)},
        callbacks=[LRScheduler(sched), *callbacks],
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    loop.fit(loader, epochs=epochs, val_loader=loader, resume_from=resume_from)
    return loop


CKPT = dict(
    every_n_steps=3, every_n_epochs=None, save_top_k=-1, save_on_exception=False
)  # as when the process is killed


def crash_then_resume(tmp_path: Path, first: Callback, second: Callback | None) -> None:
    """A fit that checkpoints every 3 steps dies at the end of step 5 (update 10); then a new
    loop with ``second`` resumes from step 3 (update 6): steps 4-5, and the epoch end at
    update 8, run again."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="crash"):
        fit([first, ModelCheckpoint(ckpt, **CKPT), Crash(5)])
    if second is not None:
        fit([second, ModelCheckpoint(ckpt, **CKPT)], resume_from="last")


def same(a: dict, b: dict) -> None:
    """The same keys with the same points; samples_per_second at the same steps only."""
    assert sorted(a) == sorted(b)
    for key in a:
        if key == "samples_per_second":
            assert [s for s, _ in a[key]] == [s for s, _ in b[key]]
        else:
            assert a[key] == [(s, pytest.approx(v, rel=1e-6)) for s, v in b[key]], key


# -- what they log -----------------------------------------------------------------------------
def test_wandb_and_mlflow_log_what_tensorboard_logs(tmp_path, wandb_dir, mlflow_uri):
    wb = WandbLogger(project="ipuloop-tests", name="a", save_dir=wandb_dir)
    ml = MLFlowLogger(
        "tests", run_name="a", tracking_uri=mlflow_uri, tags={"kind": "test"}, synchronous=True
    )
    loop = fit([TensorBoardLogger(tmp_path / "tb"), wb, ml])
    tb = tensorboard_series(tmp_path / "tb")
    assert set(tb) == {
        "loss",
        "lr",
        "samples_per_second",
        "train_loss",
        "train_acc",
        "val_loss",
        "val_acc",
    }
    assert [s for s, _ in tb["loss"]] == STEPS and tb["lr"][0] == (0, pytest.approx(0.1))
    ((rows, _),) = wandb_runs(wandb_dir, wb.run_id)  # one offline folder, finished
    same(series(rows), tb)
    same(mlflow_series(mlflow_uri, ml.run_id), tb)
    assert series(rows)["val_acc"][-1] == (16, loop.state.logs["val_acc"])  # float64 kept
    run = MlflowClient(tracking_uri=mlflow_uri).get_run(ml.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "a"
    assert run.data.tags["kind"] == "test" and wb.run is None  # finished


def test_settings_and_parameter_groups(wandb_dir, mlflow_uri):
    run_id = MlflowClient(tracking_uri=mlflow_uri).create_run("0").info.run_id
    wb = WandbLogger(config={"data": "toy"}, save_dir=wandb_dir)
    ml = MLFlowLogger(tracking_uri=mlflow_uri, run_id=run_id)  # a run of your own
    fit([wb, ml], groups=2, adam=True, epochs=1)
    ((rows, config),) = wandb_runs(wandb_dir, wb.run_id)
    expected = {
        "device_iterations": 2,
        "gradient_accumulation": 1,
        "replicas": 1,
        "instances": 1,
        "optimizer": "Adam",
        "optimizer.lr": 0.1,
        "optimizer.betas": [0.9, 0.999],
        "optimizer.amsgrad": False,
    }
    assert config["data"] == "toy"
    assert {k: config[k] for k in expected} == expected
    params = MlflowClient(tracking_uri=mlflow_uri).get_run(run_id).data.params
    assert {k: params[k] for k in expected} == {k: str(v) for k, v in expected.items()}
    for got in (series(rows), mlflow_series(mlflow_uri, run_id)):
        assert "lr" not in got
        assert got["lr/group0"][:2] == [(0, 0.1), (2, 0.1)] and got["lr/group1"][0] == (0, 0.5)
    # MLflow never changes a parameter: a later fit in the run adds new ones, warns of changes
    with pytest.warns(
        UserWarning,
        match=r"keeps its parameters optimizer=Adam \(MLflow never "
        r"changes a parameter\); this fit runs optimizer=SGD",
    ):
        fit([MLFlowLogger(tracking_uri=mlflow_uri, run_id=run_id)], epochs=1, groups=2)
    params = MlflowClient(tracking_uri=mlflow_uri).get_run(run_id).data.params
    assert params["optimizer"] == "Adam" and params["optimizer.momentum"] == "0"


# -- resume ------------------------------------------------------------------------------------
def test_mlflow_resume_continues_the_run_and_sends_no_point_twice(
    tmp_path, mlflow_uri, monkeypatch
):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # nothing may reach MLflow's default store (./mlflow.db); a
    # sqlite store's default artifact root is ./mlruns (MLflow 2), which is MLflow's own
    ref = MLFlowLogger("reference", tracking_uri=mlflow_uri)
    fit([ref])
    want = mlflow_series(mlflow_uri, ref.run_id)
    assert not (cwd / "mlflow.db").exists()
    first = MLFlowLogger("resumed", tracking_uri=mlflow_uri)  # queued points: flushed at the end
    crash_then_resume(tmp_path, first, None)
    c = MlflowClient(tracking_uri=mlflow_uri)
    assert c.get_run(first.run_id).info.status == "FAILED"
    assert [s for s, _ in mlflow_series(mlflow_uri, first.run_id)["loss"]] == [2, 4, 6, 8, 10]
    second = MLFlowLogger("resumed", tracking_uri=mlflow_uri)
    fit([second, ModelCheckpoint(tmp_path / "ckpt", **CKPT)], resume_from="last")
    assert second.run_id == first.run_id  # from the checkpoint
    assert len(c.search_runs([c.get_experiment_by_name("resumed").experiment_id])) == 1
    assert c.get_run(first.run_id).info.status == "FINISHED"
    got = mlflow_series(mlflow_uri, first.run_id)
    same(got, want)  # each update once, with the values of the uninterrupted fit
    assert got["loss"] == want["loss"] and got["train_loss"] == want["train_loss"]  # exact


def without_throughput(rows: dict) -> dict:
    return {s: {k: v for k, v in r.items() if k != "samples_per_second"} for s, r in rows.items()}


def test_wandb_resume_continues_the_run_id_offline(tmp_path, wandb_dir):
    ref = WandbLogger(project="p", save_dir=wandb_dir)
    fit([ref])
    ((want, _),) = wandb_runs(wandb_dir, ref.run_id)
    first = WandbLogger(project="p", save_dir=wandb_dir)
    second = WandbLogger(project="p", save_dir=wandb_dir)
    crash_then_resume(tmp_path, first, second)
    assert second.run_id == first.run_id  # from the checkpoint
    (crashed, _), (resumed, _) = wandb_runs(wandb_dir, first.run_id)
    assert sorted(crashed) == [0, 2, 4, 6, 8, 10]
    # the resumed folder starts at the step W&B reported (the run's step 10 where it resumes
    # offline runs), or at the checkpoint's update 6 (where it ignores resume offline)
    start = min(resumed)
    assert start in (6, 10)
    joined = {
        s: {**crashed.get(s, {}), **resumed.get(s, {})}
        for s in {*crashed, *resumed}
        if s >= start or s not in resumed
    }
    assert {s: r.keys() for s, r in joined.items()} == {s: r.keys() for s, r in want.items()}
    assert without_throughput(joined) == without_throughput(want)


def test_wandb_resume_into_a_run_skips_the_steps_it_has(tmp_path, wandb_dir):
    ref = WandbLogger(project="p", save_dir=wandb_dir)
    fit([ref])
    ((want, _),) = wandb_runs(wandb_dir, ref.run_id)
    run = wandb.init(project="p", dir=wandb_dir)
    sent = []
    log = run.log

    def recording_log(data, step=None, **kw):  # the steps the logger sends
        sent.append(step)
        return log(data, step=step, **kw)

    run.log = recording_log
    # neither logger finishes your run: the resumed fit logs on into it
    crash_then_resume(tmp_path, WandbLogger(experiment=run), WandbLogger(experiment=run))
    assert run.step == 16
    run.finish()
    # the resumed fit sent nothing below the step the run was at (10): W&B would drop it
    assert sent == sorted(sent) and sent[-1] == 16
    ((rows, _),) = wandb_runs(wandb_dir, run.id)
    assert {s: r.keys() for s, r in rows.items()} == {s: r.keys() for s, r in want.items()}
    assert without_throughput(rows) == without_throughput(want)


# -- instance 0 only, installation ----------------------------------------------------------------
TWO_PROCESSES = r"""
import sys
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from ipuloop import Loop, poptorch
from ipuloop.integrations.mlflow_logger import MLFlowLogger
from ipuloop.integrations.wandb_logger import WandbLogger

save_dir, uri = sys.argv[1:]
torch.manual_seed(0)
x = torch.randn(32, 4)
model = nn.Linear(4, 2)
loop = Loop(model, poptorch.Options(), loss_fn=nn.CrossEntropyLoss(), progress=False,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            callbacks=[WandbLogger(save_dir=save_dir), MLFlowLogger(tracking_uri=uri)])
loop.fit(DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4), epochs=1)
"""


@pytest.mark.slow
def test_only_instance_0_logs(tmp_path, wandb_dir, mlflow_uri):
    script = tmp_path / "train.py"
    script.write_text(TWO_PROCESSES)
    proc = warm.run(
        command(script, str(wandb_dir), mlflow_uri, processes=2),
        env=clean_env(IPULOOP_DIST_TIMEOUT="60", PYTHONWARNINGS="ignore"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_file,) = wandb_dir.glob("wandb/offline-run-*/*.wandb")  # one run
    rows = series(wandb_runs(wandb_dir, run_file.stem[len("run-") :])[0][0])
    assert [s for s, _ in rows["loss"]] == [1, 2, 3, 4]  # 32 samples / (4 per step x 2 processes)
    c = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = c.search_runs([c.get_experiment_by_name("ipuloop").experiment_id])
    assert [m.step for m in c.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert run.data.params["instances"] == "2" and rows["lr"][0] == (0, 0.1)


@pytest.mark.parametrize(
    "cls,module,extra", [(WandbLogger, "wandb", "wandb"), (MLFlowLogger, "mlflow", "mlflow")]
)
def test_a_missing_package_names_the_extra(cls, module, extra, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # its import raises ImportError
    with pytest.raises(ImportError, match=rf'pip install "ipuloop\[{extra}\]"'):
        cls()


def test_importing_the_loggers_imports_neither_package():
    code = (
        "import sys; from ipuloop.integrations.mlflow_logger import MLFlowLogger; "
        "from ipuloop.integrations.wandb_logger import WandbLogger; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'wandb', 'mlflow'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "[]"
