"""Graphcore's applications (graphcore/examples at the Poplar SDK 3.4 tag, vendored unmodified
under tests/fixtures/model_garden) run on the emulator as their READMEs run them, at tiny sizes on
their own generated data:

- the CNN application: training with one instance, training with two through
  ``python -m ipuloop.emulate.poprun`` (popdist, horovod.torch's collectives, PopTorch's
  DataLoader shared out between the instances), and the inference benchmark, which reads
  ``getLatency()``;
- ViT pretraining (pipelined over two IPUs, Adam, mixup), with one and two instances.

They need timm, PyTurboJPEG, PyYAML, attrdict, randaugment and transformers (the ``model-garden``
extra); without them the module is skipped, unless ``IPULOOP_REQUIRE_ECOSYSTEM=1`` asks for it
(CI)."""

from __future__ import annotations

import importlib
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch import clean_env, free_port
import warm

NEEDS = ("timm", "turbojpeg", "yaml", "attrdict", "randaugment", "transformers")
if os.environ.get("IPULOOP_REQUIRE_ECOSYSTEM") == "1":
    for name in NEEDS:  # required: a missing install fails
        importlib.import_module(name)
else:
    for name in NEEDS:
        pytest.importorskip(name)

pytestmark = [pytest.mark.slow, pytest.mark.threads]  # the application's programs, in processes

GARDEN = Path(__file__).resolve().parents[1] / "fixtures" / "model_garden"
CNNS = GARDEN / "vision" / "cnns" / "pytorch"
VIT = GARDEN / "vision" / "vit" / "pytorch"
# The README's training line at its smallest: ResNet-18, two micro-batches of 2 per instance.
TRAIN = [
    "train.py",
    "--data",
    "generated",
    "--model",
    "resnet18",
    "--epoch",
    "1",
    "--micro-batch-size",
    "2",
    "--iterations",
    "2",
    "--dataloader-worker",
    "1",
    "--validation-mode",
    "none",
]


@pytest.fixture(scope="module")
def garden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the applications to run: they write their logs and checkpoints beside
    themselves."""
    copy = tmp_path_factory.mktemp("garden") / "model_garden"
    return Path(shutil.copytree(GARDEN, copy, ignore=shutil.ignore_patterns("__pycache__")))


@pytest.fixture(scope="module")
def app(garden: Path) -> Path:
    return garden / CNNS.relative_to(GARDEN)


def run(cmd: list[str], cwd: Path) -> str:
    """The command's output (stdout and stderr); fails the test, showing its end, unless it
    exits 0."""
    done = warm.run(
        cmd,
        cwd=cwd,
        env=clean_env(MASTER_PORT=str(free_port())),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-4000:]}"
    return done.stdout


def losses(out: str) -> list[float]:
    """The epoch losses the application logs (``[INFO] loss: 7.0043,``)."""
    return [float(v) for v in re.findall(r"\[INFO\] loss: ([-+0-9.eEnaif]+),", out)]


def test_the_vendored_files_are_the_release_s():
    """Each file listed in SOURCE.md has the git blob id it has at the SDK 3.4 tag, and no
    other file is there: the programs below are the applications as published."""
    listed = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{40})` \|$", _source(), re.M))
    present = {p.relative_to(GARDEN).as_posix() for p in (GARDEN / "vision").rglob("*")}
    present = {p for p in present if (GARDEN / p).is_file() and "__pycache__" not in p}
    assert present == set(listed)
    for name, blob in listed.items():
        data = (GARDEN / name).read_bytes()
        got = subprocess.run(
            ["git", "hash-object", "--stdin"], input=data, capture_output=True, check=True
        ).stdout.decode()
        assert got.strip() == blob, name


def _source() -> str:
    return (GARDEN / "SOURCE.md").read_text()


def test_training_one_instance(app):
    out = run([sys.executable, "-m", "ipuloop.emulate", *TRAIN], app / "train")
    assert "Finished training" in out
    (loss,) = losses(out)
    assert math.isfinite(loss) and loss > 0


def test_training_two_instances_through_the_launcher(app):
    """The README's poprun line with the launcher's name changed: both instances train, each on
    its share of the generated data (the launcher exits 0 only when both do); instance 0 logs
    the loss averaged across them (horovod)."""
    out = run(
        [
            sys.executable,
            "-m",
            "ipuloop.emulate.poprun",
            "--num-instances=2",
            "--num-replicas=2",
            sys.executable,
            *TRAIN,
        ],
        app / "train",
    )
    assert "[1,0]<" in out and "[1,1]<" in out  # the launcher tags each instance's lines
    assert "Finished training" in out
    found = losses(out)
    assert found and all(math.isfinite(v) and v > 0 for v in found)
    assert "[INFO] Total replicas: 2" in out


def test_inference_benchmark_reports_latency(app):
    """run_benchmark.py times each call with ``getLatency()``: a positive latency and a
    throughput, in its own words."""
    out = run(
        [
            sys.executable,
            "-m",
            "ipuloop.emulate",
            "run_benchmark.py",
            "--data",
            "generated",
            "--model",
            "resnet18",
            "--random-weights",
            "--micro-batch-size",
            "2",
            "--iterations",
            "3",  # the first is the warm-up it leaves out of its figures
            "--dataloader-worker",
            "1",
        ],
        app / "inference",
    )
    latency = re.search(r"latency avg: ([0-9.]+) ms", out)
    throughput = re.search(r"throughput: ([0-9.]+) samples/sec", out)
    assert latency and throughput, out[-4000:]
    assert float(latency.group(1)) > 0 and float(throughput.group(1)) > 0


# ViT pretraining at its smallest: 2 layers of width 32 pipelined over 2 IPUs (embeddings and
# a layer, a layer and the head), gradient accumulation 6 (at least its 3 stages' pipeline
# depth), one epoch of the generated dataset, which ``--iterations`` sizes in steps of one
# instance's (two for two instances: PopTorch's DataLoader gives each its share).
VIT_PRETRAIN = [
    "pretrain.py",
    "--config",
    "b16_in1k_pretrain",
    "--dataset",
    "generated",
    "--hidden-size",
    "32",
    "--representation-size",
    "32",
    "--num-hidden-layers",
    "2",
    "--num-attention-heads",
    "2",
    "--mlp-dim",
    "64",
    "--layers-per-ipu",
    "1",
    "1",
    "--matmul-proportion",
    "0.3",
    "--ipus-per-replica",
    "2",
    "--micro-batch-size",
    "2",
    "--gradient-accumulation",
    "6",
    "--rebatched-worker-size",
    "4",
    "--epochs",
    "1",
    "--dataloader-workers",
    "1",
]


def vit_losses(out: str) -> list[float]:
    """The step losses ViT's pretraining logs (``... loss: 7.047 accuracy: ...``)."""
    return [float(v) for v in re.findall(r" loss: ([-+0-9.eEnaif]+) accuracy", out)]


@pytest.mark.parametrize("instances", [1, 2])
def test_vit_pretraining(garden, tmp_path, instances):
    vit = garden / VIT.relative_to(GARDEN)
    args = [*VIT_PRETRAIN, "--iterations", str(instances)]
    args += ["--checkpoint-output-dir", str(tmp_path / "ckpt")]
    if instances == 1:
        cmd = [sys.executable, "-m", "ipuloop.emulate", *args]
    else:
        cmd = [sys.executable, "-m", "ipuloop.emulate.poprun", "--num-instances=2"]
        cmd += ["--num-replicas=2", sys.executable, *args]
    out = run(cmd, vit)
    found = vit_losses(out)
    assert found and all(math.isfinite(v) and v > 0 for v in found), out[-4000:]
    assert out.count("Training time:") == instances
