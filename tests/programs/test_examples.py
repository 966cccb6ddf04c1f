"""The user-facing examples run: ``examples/*.py`` and ``python -m ipuloop.examples.mnist``.

Every example runs as a subprocess, all started together (each interpreter imports torch),
on the emulator and with the network unreachable (proxies pointing at a closed port), so a
missing file can never turn into a download. The MNIST runs read a copy of the real MNIST
files; they are skipped where that folder is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import warm

pytestmark = pytest.mark.slow  # every example in a subprocess, about a minute
REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
MNIST_RAW = Path(os.environ.get("IPULOOP_TEST_MNIST_RAW", "/work/shared/data/mnist/MNIST/raw"))
HAVE_MNIST = (MNIST_RAW / "train-images-idx3-ubyte.gz").exists() or (
    MNIST_RAW / "train-images-idx3-ubyte"
).exists()
NO_MNIST = (
    f"the MNIST files are not in {MNIST_RAW} (set IPULOOP_TEST_MNIST_RAW to a folder "
    "holding train-images-idx3-ubyte.gz, ...)"
)
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, a download fails at once


@dataclass
class Run:
    args: list[str]
    rc: int
    stdout: str
    stderr: str


def _mnist_copy(root: Path) -> Path:
    """A writable torchvision root holding a copy of the real MNIST files in MNIST/raw."""
    shutil.copytree(MNIST_RAW, root / "MNIST" / "raw")
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("examples")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "no_proxy", "NO_PROXY", "IPULOOP_DATA_DIR")
    }
    env.update(
        IPULOOP_BACKEND="emulator",
        PYTHONPATH=str(REPO),
        # the models are tiny: one thread each, so the concurrent runs do not oversubscribe
        OMP_NUM_THREADS="1",
        http_proxy=DEAD_PROXY,
        https_proxy=DEAD_PROXY,
        HTTP_PROXY=DEAD_PROXY,
        HTTPS_PROXY=DEAD_PROXY,
    )
    empty = tmp / "empty"
    empty.mkdir()
    commands = {
        "custom_callback": [
            str(EXAMPLES / "custom_callback.py"),
            "--epochs",
            "3",
            "--patience",
            "5",
        ],
        "plain_model": [str(EXAMPLES / "plain_model_loss_fn.py"), "--epochs", "2"],
        "mnist_missing": [
            "-m",
            "ipuloop.examples.mnist",
            "--max-steps",
            "2",
            "--epochs",
            "1",
            "--data-dir",
            str(empty),
        ],
    }
    if HAVE_MNIST:
        commands["poptorch_pipeline"] = [
            "-m",
            "ipuloop.emulate",
            str(EXAMPLES / "poptorch_mnist_pipeline.py"),
            "--max-steps",
            "2",
            "--epochs",
            "1",
            "--workers",
            "1",
            "--data-dir",
            str(_mnist_copy(tmp / "pipeline")),
        ]
        commands["mnist"] = [
            "-m",
            "ipuloop.examples.mnist",
            "--max-steps",
            "2",
            "--epochs",
            "1",
            "--data-dir",
            str(_mnist_copy(tmp / "packaged")),
        ]
    procs = {
        name: warm.Popen(
            [sys.executable, *args],
            env=env,
            cwd=str(tmp),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    out = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=300)
            out[name] = Run(commands[name], p.returncode, stdout, stderr)
    finally:
        for p in procs.values():  # a run that timed out must not outlive the tests
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def _ok(runs, name: str) -> str:
    run = runs[name]
    assert run.rc == 0, f"{name} exited {run.rc}\n{run.stdout}\n{run.stderr}"
    return run.stdout


def test_custom_callback_records_and_stops(runs):
    out = _ok(runs, "custom_callback")
    assert re.search(r"^ step update +lr +loss +average$", out, re.M), out
    assert "Stopped at step" in out, out


def test_plain_model_trains_validates_and_predicts(runs):
    out = _ok(runs, "plain_model")
    assert re.search(r"^epoch 2: train_loss .* val_loss .* val_acc ", out, re.M), out
    assert re.search(r"^predict: \(1000, 3\) logits; test accuracy \d+\.\d\d%$", out, re.M), out
    diff = float(re.search(r"max \|difference\| = (\S+)", out).group(1))
    assert diff < 1e-5, out  # the host module holds the trained weights


@pytest.mark.skipif(not HAVE_MNIST, reason=NO_MNIST)
def test_poptorch_program_runs_unmodified_under_the_emulator(runs):
    out = _ok(runs, "poptorch_pipeline")
    assert "Epoch 1/1: loss " in out, out
    assert re.search(r"^Accuracy on test set: \d+\.\d\d%$", out, re.M), out


@pytest.mark.skipif(not HAVE_MNIST, reason=NO_MNIST)
def test_packaged_mnist_smoke_run(runs):
    out = _ok(runs, "mnist")
    assert "trained 2 steps" in out, out
    assert re.search(r"^Accuracy on test set: \d+\.\d\d%$", out, re.M), out


def test_packaged_mnist_missing_data_is_one_clear_message(runs):
    run = runs["mnist_missing"]
    text = run.stdout + run.stderr
    assert run.rc != 0, text
    assert "Traceback" not in text, text
    folder = os.path.join(run.args[run.args.index("--data-dir") + 1], "MNIST", "raw")
    assert folder in run.stderr and "--data-dir" in run.stderr, run.stderr
    # how to point it at local files: every file it needs, and where they go
    for name in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        assert name in run.stderr, run.stderr
    assert "DIR/MNIST/raw" in run.stderr and "IPULOOP_DATA_DIR" in run.stderr, run.stderr
