"""``python -m ipuloop.examples.mnist``: its flags, and ``--ipu-config`` driving a run."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from ipuloop.integrations.ipu_config import IPUConfig
from ipuloop.examples import mnist
from test_examples import HAVE_MNIST, MNIST_RAW, NO_MNIST

# Every flag the example promises (the tutorial's, then the loop's own).
FLAGS = {
    "--batch-size": "40",
    "--device-iterations": "10",
    "--gradient-accumulation": "10",
    "--test-batch-size": "8",
    "--epochs": "3",
    "--learning-rate": "0.001",
    "--profile": None,
    "--profile-dir": "./profile",
    "--strategy": "pipelined",
    "--offload-optimiser": None,
    "--debug": None,
    "--data-dir": None,
    "--checkpoint-dir": None,
    "--resume": None,
    "--replicas": "1",
    "--max-steps": None,
    "--ipu-config": None,
    "--ipu-config-overrides": None,
    "--threads": None,
}


def test_every_flag_is_listed_with_the_tutorial_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        mnist.parse_args(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in FLAGS:
        assert re.search(rf"^  {re.escape(flag)}\b", text, re.M), flag
    args = mnist.parse_args([])
    for flag, default in FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if default is not None:
            assert str(value) == default, (flag, value)
    assert (args.profile, args.offload_optimiser, args.debug, args.resume) == (False,) * 4
    assert mnist.parse_args(["--strategy", "sharded", "--offload-optimiser"]).strategy == "sharded"


def test_every_option_has_a_help_text_and_shows_its_default(capsys):
    with pytest.raises(SystemExit):
        mnist.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text  # the description as text
    # argparse titles the section "options:" from Python 3.10, "optional arguments:" before
    options = re.split(r"\n  (?=-)", re.split(r"\n(?:options|optional arguments):\n", text, 1)[1])
    assert {e.split()[0] for e in options} >= {*FLAGS, "--inference-iterations", "--csv"}
    for entry in options:
        if "-h, --help" not in entry:
            assert "(default: " in " ".join(entry.split()), entry
    assert (
        "--batch-size BATCH_SIZE\n                        micro-batch size for training (default: 40)"
        in text
    )
    assert "--offload-optimiser   keep the optimizer state off-chip (default: off)" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--ipu-config-overrides", "device_iterations=2"],
            "--ipu-config-overrides changes an --ipu-config FILE: pass both",
        ),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--gradient-accumulation", "0"], "--gradient-accumulation must be >= 1"),
        (["--strategy", "staged"], "invalid choice: 'staged'"),
    ],
)
def test_bad_flag_combinations_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        mnist.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def mnist_root(tmp_path_factory):
    if not HAVE_MNIST:
        pytest.skip(NO_MNIST)
    root = tmp_path_factory.mktemp("mnist")
    shutil.copytree(MNIST_RAW, root / "MNIST" / "raw")
    return root


def test_ipu_config_file_and_overrides_drive_the_run(mnist_root, tmp_path, capsys):
    IPUConfig(
        device_iterations=5,
        gradient_accumulation_steps=3,
        output_mode="all",
        inference_device_iterations=50,
    ).save(tmp_path)
    rc = mnist.main(
        [
            "--data-dir",
            str(mnist_root),
            "--ipu-config",
            str(tmp_path),
            "--ipu-config-overrides",
            "device_iterations=2,gradient_accumulation_steps=2",
            "--strategy",
            "sharded",
            "--max-steps",
            "1",
            "--epochs",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    # The overrides, not the file or the flags' defaults (10 x 10), set the factors.
    assert (
        "strategy: sharded; micro-batch 40 x 2 device iterations x 2 accumulation x "
        "1 replica(s)" in out
    ), out
    # on the emulator a compilation is a trace: no compile time that reads as 0.0s
    assert re.search(r"^trained 1 steps \(2 updates, 160 samples\) in \d+\.\ds$", out, re.M), out
    assert re.search(r"^Accuracy on test set: \d+\.\d\d%$", out, re.M), out


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"gradient_accumulation_steps": 0}', "gradient_accumulation_steps must be >= 1"),
        ('{"layer_per_ipu": [1]}', "IPUConfig received unknown arguments: layer_per_ipu=[1]"),
        ("device_iterations: 2", "is not a JSON IPUConfig"),
    ],
)
def test_a_bad_ipu_config_is_one_message(tmp_path, capsys, content, message):
    (tmp_path / "ipu_config.json").write_text(content)
    # Checked before the data is read: the data folder does not even exist.
    rc = mnist.main(
        ["--data-dir", str(tmp_path / "no-data"), "--ipu-config", str(tmp_path), "--max-steps", "1"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"error: --ipu-config {tmp_path}: ") and message in err, err
    assert "Traceback" not in err


def test_a_missing_ipu_config_file_is_one_message(tmp_path, capsys):
    rc = mnist.main(["--ipu-config", str(tmp_path / "none.json"), "--max-steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "none.json" in err and "Traceback" not in err, err


def test_data_dir_defaults_to_the_environment_then_the_torchvision_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("IPULOOP_DATA_DIR", str(tmp_path))
    assert mnist._data_dir(None) == str(tmp_path)
    assert mnist._data_dir("~/mine") == str(Path.home() / "mine")  # the flag wins
    monkeypatch.delenv("IPULOOP_DATA_DIR")
    assert mnist._data_dir(None) == str(Path.home() / ".cache" / "torchvision")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-steps", "0"], "--max-steps must be >= 1. Received: 0"),
        (["--max-steps", "-1"], "--max-steps must be >= 1. Received: -1"),
        (["--workers", "-1"], "--workers must be >= 0"),
        (["--learning-rate", "nan"], "--learning-rate must be a finite number > 0. Received: nan"),
        (["--learning-rate", "inf"], "--learning-rate must be a finite number > 0. Received: inf"),
        (["--threads", "0"], "--threads must be >= 1"),
    ],
)
def test_bad_flag_values_are_one_line_before_any_data(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        mnist.main(["--data-dir", str(tmp_path / "no-data"), *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--replicas", "3"],
            "--replicas 3: 3 replica(s) of 4 IPUs is 12 IPUs, but PopTorch "
            "reserves a power of 2 of IPUs, at most 64. Use --replicas 1, 2, 4",
        ),
        (
            ["--replicas", "32", "--strategy", "sharded"],
            "--replicas 32: 32 replica(s) of 4 IPUs is 128 IPUs",
        ),
        (
            ["--gradient-accumulation", "6"],
            "--gradient-accumulation 6 is too small for --strategy "
            "pipelined: training 4 pipeline stages needs at least 7",
        ),
        (
            ["--inference-iterations", "3"],
            "--inference-iterations 3 is too small for --strategy pipelined",
        ),
    ],
)
def test_factors_the_ipus_or_the_pipeline_reject_fail_before_any_data(
    tmp_path, capsys, argv, message
):
    rc = mnist.main(["--data-dir", str(tmp_path / "no-data"), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    # Sharded training has no pipeline to fill: a small accumulation is fine there.
    mnist.check_factors(
        *mnist.build_options(
            mnist.parse_args(
                [
                    "--strategy",
                    "sharded",
                    "--gradient-accumulation",
                    "1",
                    "--inference-iterations",
                    "1",
                ]
            )
        ),
        "sharded",
        inference_pipelined=False,
        names={},
    )


def _idx(path: Path, data: bytes, magic: int, dims: tuple[int, ...]) -> None:
    import gzip
    import struct

    with gzip.open(path, "wb") as f:
        f.write(struct.pack(f">{1 + len(dims)}i", magic, *dims) + data)


def _fake_mnist(raw: Path, train: int, test: int) -> None:
    """The four MNIST files, gzipped, in the idx format: ``train``/``test`` random images."""
    import torch

    g = torch.Generator().manual_seed(0)
    raw.mkdir(parents=True)
    for prefix, n in (("train", train), ("t10k", test)):
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
        _idx(raw / f"{prefix}-images-idx3-ubyte.gz", images.numpy().tobytes(), 2051, (n, 28, 28))
        _idx(raw / f"{prefix}-labels-idx1-ubyte.gz", labels.numpy().tobytes(), 2049, (n,))


def test_a_read_only_gz_data_dir_is_unpacked_into_a_cache_never_beside(
    tmp_path, monkeypatch, capsys
):
    data = tmp_path / "data"
    raw = data / "MNIST" / "raw"
    _fake_mnist(raw, train=28, test=8)
    before = {p.name: p.stat().st_mtime_ns for p in raw.iterdir()}
    for p in (raw, raw.parent, data):  # read-only (root ignores the bits: checked below too)
        p.chmod(0o555)
    for p in raw.iterdir():
        p.chmod(0o444)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        argv = [
            "--data-dir",
            str(data),
            "--batch-size",
            "2",
            "--device-iterations",
            "1",
            "--gradient-accumulation",
            "7",
            "--test-batch-size",
            "1",
            "--inference-iterations",
            "4",
            "--epochs",
            "1",
            "--threads",
            "1",
        ]
        assert mnist.main(argv) == 0
        assert mnist.main(argv) == 0  # the second run reads the cache as it is
        out = capsys.readouterr().out
        assert re.search(r"^trained 2 steps \(2 updates, 28 samples\)", out, re.M), out
        assert "1 torch thread(s)" in out
        after = {p.name: p.stat().st_mtime_ns for p in raw.iterdir()}
        assert after == before  # nothing written, nothing touched
        assert sorted(p.name for p in data.rglob("*")) == sorted(["MNIST", "raw", *before])
        unpacked = list((tmp_path / "cache" / "ipuloop" / "mnist").glob("*/MNIST/raw/*"))
        assert sorted(p.name for p in unpacked if "idx" in p.name) == sorted(n[:-3] for n in before)
    finally:
        for p in (data, raw.parent, raw):
            p.chmod(0o755)
