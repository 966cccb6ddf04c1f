"""Every Python snippet of README.md, the documentation pages in docs/ and examples/README.md
runs as written, and the hook order they show is the loop's.

A snippet that uses names it does not define (the model, the options, the loaders of the
surrounding prose) runs with small stand-ins for exactly those names, listed in ``STAND_INS``
by a line that identifies the snippet; every other snippet runs in an empty namespace. Each
runs in a temporary working folder (the callbacks snippet writes checkpoints, a CSV log and
a profile there), and where it computes something to check, a function of ``CHECKS`` (keyed
the same way) checks it. docs/from-lightning.md is one program read top to bottom:
tests/docs/test_docs_lightning.py runs its blocks in order, in one namespace.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import ipuloop.callbacks.base as base
from ipuloop import Loop, WithLoss, poptorch
from ipuloop.checkpoint_io import load_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = ROOT / "docs"
ONE_PROGRAM = PAGES / "from-lightning.md"  # run by tests/docs/test_docs_lightning.py
DOCS = (
    README,
    ROOT / "examples" / "README.md",
    *sorted(p for p in PAGES.rglob("*.md") if p != ONE_PROGRAM),
)


def blocks(lang: str, path: pathlib.Path = README) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), re.S | re.M)


def page(name: str) -> str:
    """A documentation page's text, its lines joined (prose wraps anywhere)."""
    return _flat((PAGES / name).read_text())


def _data(n: int, batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 20, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=batch_size)


def _model_with_loss() -> nn.Module:
    torch.manual_seed(0)
    return WithLoss(
        nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 2)), nn.CrossEntropyLoss()
    )


def _top_of_readme() -> dict:
    """What the docs' snippets use without defining it: ``model_with_loss``, its ``model``,
    ``opts`` and two loaders."""
    model_with_loss = _model_with_loss()
    return {
        "Loop": Loop,
        "poptorch": poptorch,
        "model_with_loss": model_with_loss,
        "model": model_with_loss.model,
        "opts": poptorch.Options().deviceIterations(2),
        "train_loader": _data(64, 4),
        "val_loader": _data(16, 4),
    }


def _callbacks() -> dict:
    """The callbacks snippet: a model-with-loss, options and loaders of 600 steps an epoch,
    so a step save (every_n_steps=500) comes before the first validation."""
    return {
        "model": _model_with_loss(),
        "opts": poptorch.Options().deviceIterations(2),
        "loader": _data(2400, 2),
        "val": _data(32, 2),
        "epochs": 2,
    }


# A line of the snippet -> the stand-ins for the names it uses without defining them.
STAND_INS = {
    "sched = torch.optim.lr_scheduler.OneCycleLR(": _callbacks,
    "WandbLogger(project=": _top_of_readme,
}

SNIPPETS = [
    pytest.param(path, i, code, id=f"{path.relative_to(README.parent)}[{i}]")
    for path in DOCS
    for i, code in enumerate(blocks("python", path))
]


def test_the_snippets_are_found():
    """Every Python block is one the runner finds: no fence it would miss (```Python,
    ```python3, an indented fence), and every page of docs/ is run here or as one program."""
    for path in (*DOCS, ONE_PROGRAM):
        fences = re.findall(r"^\s*```(\S*)$", path.read_text(), re.M)
        openings = fences[0::2]  # each block opens and closes with a fence
        assert len(fences) % 2 == 0, path
        allowed = {"python", "bash", "text", ""} | ({"py"} if path == ONE_PROGRAM else set())
        assert set(openings) <= allowed, (path, openings)
        assert openings.count("python") == len(blocks("python", path)), path
    assert len([s for s in SNIPPETS if s.values[0] == README]) == 1  # the loop in one example
    for marker in STAND_INS:  # each stand-in serves a snippet that still exists
        assert sum(marker in s.values[2] for s in SNIPPETS) == 1, marker
    for marker in CHECKS:  # and so does each check
        assert sum(marker in s.values[2] for s in SNIPPETS) >= 1, marker


@pytest.fixture
def one_thread():
    """One torch thread: these tiny models run many times slower when threads outnumber the
    idle cores of a busy host (the README's advice for a small CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("path, index, code", SNIPPETS)
def test_every_python_snippet_runs_as_written(
    path, index, code, tmp_path, monkeypatch, capsys, one_thread
):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for marker, stand_ins in STAND_INS.items():
        if marker in code:
            namespace.update(stand_ins())
    exec(compile(code, f"{path.relative_to(ROOT)} python block {index}", "exec"), namespace)
    check = CHECKS.get(next((m for m in CHECKS if m in code), None))
    if check is not None:
        check(namespace, capsys.readouterr().out, tmp_path, capsys)


def _check_one_example(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    loss, acc = out.split()[-2:]
    assert 0 < float(loss) < 0.7 and float(acc) > 0.8
    assert ns["predictions"].shape == (1024, 2)


def _check_print_lr(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    model = _model_with_loss()
    loop = Loop(
        model,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.05),
        callbacks=[ns["PrintLR"]()],
        progress=False,
    )
    loop.fit(_data(400, 2), epochs=1)  # 200 steps: PrintLR prints at steps 100 and 200
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [(int(s), float(lr)) for s, lr, _ in lines] == [(100, 0.05), (200, 0.05)]


def _check_loggers(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    from mlflow import MlflowClient

    wandb_logger, mlflow_logger = ns["loop"].callbacks[:2]
    assert wandb_logger.run is None and wandb_logger.run_id  # the offline run, finished
    client = MlflowClient(tracking_uri="sqlite:///mlflow.db")
    run = client.get_run(mlflow_logger.run_id)
    assert run.info.status == "FINISHED" and run.data.params["optimizer.lr"] == "0.1"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 2 * 8  # 8 steps an epoch


def _check_callbacks(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    loop, sched, opt = ns["loop"], ns["sched"], ns["opt"]
    assert loop.state.epoch == 2 and loop.state.update == ns["updates"] == 2 * 600 * 2
    assert sched.last_epoch == sched.total_steps  # the whole cycle, no step past its end
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.95)  # cycled back to the max
    assert (tmp_path / "logs.csv").exists() and (tmp_path / "profile").is_dir()
    assert list((tmp_path / "ckpt" / "steps").iterdir())
    best = ns["best"].best_path  # epoch-end saves only: a step save is never the best
    assert best.parent == pathlib.Path("ckpt", "best")
    assert best.name in ("epoch1-step600", "epoch2-step1200")
    weights = load_checkpoint(best)["model"]
    assert all(torch.equal(v, weights[k]) for k, v in loop.model.state_dict().items())


def _check_dict_batches(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    assert ns["logits"].shape == (10, 2)
    assert ns["history"][-1]["val_loss"] < ns["history"][0]["train_loss"]


def _check_logged_values(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    step_acc, train_acc, val_acc = map(float, out.split()[-3:])
    h = ns["history"][-1]
    assert 0.5 < val_acc <= 1 and 0.5 < train_acc <= 1 and 0 <= step_acc <= 1
    assert "estimated" not in h  # Sum: every micro-batch's value, no estimate


def _check_val_every_n_steps(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    best, loop = ns["best"], ns["loop"]
    steps = [int(p.name.split("step")[1]) for p in best.best_k]
    assert steps and all(s % 20 == 0 for s in steps)  # ranked: saves at validation steps
    assert out.split()[-2] == best.best_path.name
    rows = (tmp_path / "log.csv").read_text().splitlines()[1:]
    mid = [r for r in rows if int(r.split(",")[1]) % 20 == 0]  # a row at each step validation
    assert len(mid) == loop.state.step // 20


def _check_batch_sampler(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    assert ns["loop"].state.steps_per_epoch == 15 and out.split()[-1] == "15"
    assert ns["loop"].state.step == 30  # 2 epochs of 15 host calls of 8 sampler batches


def _check_precision(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    half = ns["half"]
    assert (
        half.dtype == torch.float16
        and half.shape == (512, 2)
        and out.split()[-1] == "torch.float16"
    )
    first, last = ns["history"][0]["train_loss"], ns["history"][-1]["train_loss"]
    assert last < first < 0.8  # float16 inputs with a static loss scale: it learns


def _check_promoted(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    warning, dtype = out.strip().splitlines()[-2:]
    assert "3 of the model's 4 matmuls" in warning and "'cat'" in warning
    assert "'cls_token'" in warning and dtype == "torch.float32"


def _check_ipu_config(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    from ipuloop import IPUConfig

    lines = out.strip().splitlines()
    assert lines[0] == "[0, 0, 0, 0, 1, 1, 1, 1, 1]"  # the remainder on the last IPU
    assert lines[-1].split() == ["16", "4"]
    assert IPUConfig.load(tmp_path / "ipu_config") == ns["config"]
    assert ns["config"].seed == 0 and ns["config"].device_iterations == 4


def _check_emulated_program(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    assert out.split()[-1] == "4" and ns["out"].shape == (8, 2) and ns["loss"].shape == ()
    assert not ns["training"].isAttachedToDevice()
    x, y = ns["data"].tensors
    assert (ns["model"].net(x).argmax(-1) == y).float().mean() > 0.8  # trained on the host's


def _check_summary(ns: dict, out: str, tmp_path: pathlib.Path, capsys) -> None:
    lines = out.splitlines()
    assert "  batch: micro 8 x DI 2 x GA 4 x RF 1 = 64 samples a host call" in lines
    assert "  epoch: 4 steps, 8 optimizer updates; output mode Sum" in lines
    assert "  ipu 0: 0 Sequential; 544 params" in lines and "  ipu 1: 1 Linear; 66 params" in lines
    assert ns["loop"].train_model is None  # a summary compiles and runs nothing


CHECKS = {
    "print(loop.summary(": _check_summary,
    "class Tokens(Dataset):": _check_dict_batches,
    "class WithAccuracy(nn.Module):": _check_logged_values,
    "val_every_n_steps=20)": _check_val_every_n_steps,
    "predictions = loop.predict(": _check_one_example,
    "class PrintLR(Callback):": _check_print_lr,
    "sched = torch.optim.lr_scheduler.OneCycleLR(": _check_callbacks,
    "WandbLogger(project=": _check_loggers,
    "class SimilarFirst:": _check_batch_sampler,
    "self.cls_token = nn.Parameter(": _check_promoted,  # (before the next key: it has both)
    'precision="16-mixed"': _check_precision,
    "place_layers(layers, config)": _check_ipu_config,
    "training = poptorch.trainingModel(": _check_emulated_program,
}


def test_the_hook_order_in_the_docs_is_the_module_docstring():
    block = re.search(r"::\n\n((?:    .*\n)+)", base.__doc__).group(1)  # the indented pseudocode
    doc_lines = [line[4:] for line in block.splitlines()]
    assert "docs/callbacks.md#the-order-of-the-hooks" in README.read_text()  # shown once
    for path in (PAGES / "callbacks.md",):
        shown = (
            re.search(
                r"```(?:text)?\n(\[first fit only: on_configure\].*?)```", path.read_text(), re.S
            )
            .group(1)
            .splitlines()
        )
        assert shown[-1].startswith("on_exception"), path
        assert shown[:-1] == doc_lines, path  # the same pseudocode, line for line


def test_readme_commands_are_the_ci_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = README.read_text()
    # the extras CI installs editable (several in one pip call: -e ".[test,lint,docs]")
    extras = {e for group in re.findall(r'-e "\.\[([a-z,-]+)\]"', ci) for e in group.split(",")}
    assert "test" in extras
    # the README's command is the quick suite: pyproject's addopts leave the slow tests out;
    # CI runs every test (-m "" lifts that selection), as the README and the guide say
    assert 'pip install -e ".[test]" && python -m pytest -q\n' in readme
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^addopts = \"-m 'not slow'\"$", pyproject, re.M)
    # each suite runs `python -m pytest -q -m SELECTION`; each environment runs two passes,
    # the tests marked threads apart from the rest, which is every test (the two environments
    # share them out: tests/support/ci_share.py)
    assert re.search(r'^ *python -m pytest -q -m "\$2" ', ci, re.M)
    calls = re.findall(r'suite "\$1[^"]*" "([^"]*)"', ci)
    assert sorted(calls) == ["not threads", "threads"], calls
    environments = re.findall(r'passes "(Python [0-9.]+)[^"]*"', ci)
    assert sorted(environments) == ["Python 3.11", "Python 3.8"], environments
    assert 'python -m pytest -q -m ""' in page("contributing.md")
    assert '-e ".[test,model-garden]" && python -m pytest -q -m ""' in page("getting-started.md")
    # the quickstart, online and offline: offline, a folder of the user's whose MNIST/raw
    # holds the files (the layout tests/programs/test_examples.py gives --data-dir), the folder the
    # guide's commands use, never one of the repository's or this machine's
    assert "pip install -e . && python -m ipuloop.examples.mnist\n" in readme
    (folder,) = re.findall(r"&& python -m ipuloop\.examples\.mnist --data-dir (\S+)\n", readme)
    assert "whose `MNIST/raw`" in _flat(readme)
    assert folder.startswith("~/"), folder
    guide = page("getting-started.md")
    assert f"python -m ipuloop.examples.mnist --data-dir {folder} " in guide
    assert f"that folder is `{folder}`" in guide
    # CI builds the documentation strictly, with the documented command
    assert "docs" in extras and "mkdocs build --strict" in ci
    assert 'pip install -e ".[docs]" && mkdocs build --strict' in page("getting-started.md")
    # the house rules: the documented command is what CI runs
    rules = (
        'pip install -e ".[lint]" && ruff format --check ipuloop tests benchmarks examples'
        " && ruff check ipuloop && mypy"
    )
    assert rules in page("contributing.md") and rules in page("getting-started.md")
    assert "lint" in extras
    for command in (
        "ruff format --check ipuloop tests benchmarks examples",
        "ruff check ipuloop",
        "mypy",
    ):
        assert f"python -m {command}" in ci, command


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_docs_say_what_cancel_step_skips_and_it_does():
    assert (
        "`CancelStep` from `on_train_step_start` skips the training step itself: its host "
        "batch is read but never runs on the device (no update, no loss; counted only in "
        "`epoch_step`, the batches the epoch has read, so a resume does not read it "
        "again)"
    ) in page("callbacks.md")
    from ipuloop import Callback, CancelStep

    class Skip(Callback):
        def on_train_step_start(self, loop):
            raise CancelStep

    model = _model_with_loss()
    before = [p.detach().clone() for p in model.parameters()]
    loop = Loop(
        model,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.5),
        callbacks=[Skip()],
        progress=False,
    )
    loop.fit(_data(16, 2), epochs=1)
    assert (loop.state.step, loop.state.update, loop.state.samples) == (0, 0, 0)
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


def test_the_docs_say_the_dtype_predict_returns_under_16_mixed_and_it_does(monkeypatch):
    assert (
        'float16 under `"16-true"`, and under `"16-mixed"` when the activations stay '
        "float16 up to the output; float32 when a float32 tensor promoted them"
    ) in _flat(page("precision.md"))
    monkeypatch.delenv("IPULOOP_EMULATOR_DEVICE", raising=False)
    loop = Loop(_model_with_loss(), precision="16-mixed", progress=False)
    x = torch.randn(8, 20)
    assert loop.predict(DataLoader(TensorDataset(x), batch_size=4)).dtype == torch.float16


def test_the_docs_say_metrics_are_estimates_under_final_and_they_are():
    assert (
        "Under `OutputMode.Final` or `EveryN` the device returns only some micro-batches' "
        "outputs, so every training value is computed over those micro-batches only: an "
        "estimate. That is the step's `loss`, `train_loss`, the train metrics"
    ) in page("loop.md")
    import torchmetrics

    class Rows(torchmetrics.Metric):  # counts the samples a metric is updated with
        def __init__(self):
            super().__init__()
            self.add_state("n", torch.tensor(0), dist_reduce_fx="sum")

        def update(self, preds, target):
            self.n += preds.shape[0]

        def compute(self):
            return self.n

    rows, estimated = {}, {}
    for mode in ("All", "Final"):
        opts = poptorch.Options().deviceIterations(2).outputMode(getattr(poptorch.OutputMode, mode))
        opts.Training.gradientAccumulation(2)
        loop = Loop(_model_with_loss(), opts, metrics={"rows": Rows()}, progress=False)
        row = loop.fit(_data(64, 2), epochs=1)[-1]
        rows[mode], estimated[mode] = row["train_rows"], row.get("estimated")
    assert rows == {"All": 64, "Final": 8 * 2}  # 8 steps; Final: the last micro-batch of 2
    assert estimated == {"All": None, "Final": "loss train_loss train_rows"}  # and says so


def test_install_names_torch_s_cpu_build_and_every_timing_its_host_and_load():
    """A machine without a GPU would pull torch's CUDA wheels (about 5 GB): the install says
    how to take the CPU-only build; and a time a user reads says what it was measured on."""
    from test_docs_shape import paragraphs

    command = "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"
    guide = (PAGES / "getting-started.md").read_text()
    for text in (README.read_text(), guide):
        assert command in text and "5 GB" in text
        for start, lines in paragraphs(text):
            prose = " ".join(lines)
            if re.search(r"\b\d+(\.\d+)? ?(s|min|minutes)\b", prose):
                assert "host" in prose and ("load" in prose or "idle" in prose), (start, prose)


def test_the_docs_say_how_many_threads_on_a_small_cpu_and_the_example_picks_them(monkeypatch):
    text = page("getting-started.md")
    assert "set `OMP_NUM_THREADS=1` or call `torch.set_num_threads(1)`" in text
    assert "`--threads N`" in text
    from ipuloop.examples import mnist

    monkeypatch.setattr(mnist.os, "getloadavg", lambda: (7.0, 7.0, 7.0))
    assert mnist._default_threads() == 1  # a busy host: one thread
    monkeypatch.setattr(mnist.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert mnist._default_threads() == min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
