"""``python -m ipuloop.examples.fashion_mnist`` and its plain-torch counterpart run.

Subprocesses on the emulator with the network unreachable (proxies at a closed port). The runs
read a writable copy of the real Fashion-MNIST ``.gz`` files and decompress them into a
temporary ``XDG_CACHE_HOME``; they are skipped where the files are absent.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import warm

pytestmark = pytest.mark.slow  # the example programs in subprocesses
REPO = Path(__file__).resolve().parents[2]
RAW = Path(
    os.environ.get(
        "IPULOOP_TEST_FASHION_MNIST_RAW", "/work/shared/data/fashion-mnist/FashionMNIST/raw"
    )
)
HAVE_DATA = (RAW / "train-images-idx3-ubyte.gz").exists()
NO_DATA = (
    f"the Fashion-MNIST files are not in {RAW} (set IPULOOP_TEST_FASHION_MNIST_RAW to a "
    "folder holding train-images-idx3-ubyte.gz, ...)"
)
DEAD_PROXY = "http://127.0.0.1:9"


def run(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "no_proxy", "NO_PROXY", "IPULOOP_DATA_DIR")
    }
    env.update(
        IPULOOP_BACKEND="emulator",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        XDG_CACHE_HOME=str(tmp / "cache"),
        http_proxy=DEAD_PROXY,
        https_proxy=DEAD_PROXY,
        HTTP_PROXY=DEAD_PROXY,
        HTTPS_PROXY=DEAD_PROXY,
    )
    return warm.run(
        [sys.executable, *args], env=env, cwd=str(tmp), capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(not HAVE_DATA, reason=NO_DATA)
def test_smoke_run_decompresses_into_the_cache_and_logs(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(RAW, data / "FashionMNIST" / "raw")
    before = sorted(p.name for p in (data / "FashionMNIST" / "raw").iterdir())
    r = run(
        [
            "-m",
            "ipuloop.examples.fashion_mnist",
            "--data-dir",
            str(data),
            "--epochs",
            "1",
            "--max-steps",
            "3",
            "--csv",
            "logs.csv",
            "--tensorboard",
            "tb",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "trained 3 steps (30 updates, 480 samples)" in r.stdout, r.stdout
    assert re.search(r"^Accuracy on test set: \d+\.\d\d%$", r.stdout, re.M), r.stdout
    # nothing written beside the .gz files; the decompressed copy is in the cache
    assert sorted(p.name for p in (data / "FashionMNIST" / "raw").iterdir()) == before
    cached = tmp_path / "cache" / "ipuloop" / "fashion-mnist" / "FashionMNIST" / "raw"
    assert (cached / "train-images-idx3-ubyte").stat().st_size == 47040016
    with open(tmp_path / "logs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["update"] for r in rows] == ["10", "20", "30"]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_missing_data_is_one_clear_message(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run(
        ["-m", "ipuloop.examples.fashion_mnist", "--data-dir", str(empty), "--max-steps", "1"],
        tmp_path,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert str(empty / "FashionMNIST" / "raw") in r.stderr and "--data-dir" in r.stderr, r.stderr


@pytest.mark.skipif(not HAVE_DATA, reason=NO_DATA)
def test_plain_torch_version_runs(tmp_path):
    r = run(
        [
            str(REPO / "benchmarks" / "fashion_mnist_torch.py"),
            "--data-dir",
            str(RAW.parents[1]),
            "--epochs",
            "1",
            "--max-steps",
            "3",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "trained 3 updates (48 samples)" in r.stdout, r.stdout
    assert re.search(r"^Accuracy on test set: \d+\.\d\d%$", r.stdout, re.M), r.stdout
