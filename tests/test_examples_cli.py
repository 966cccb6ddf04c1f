"""``python -m ipuloop.examples.mnist``: its flags, and ``--ipu-config`` driving a run."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from ipuloop.config import IPUConfig
from ipuloop.examples import mnist
from tests.test_examples import HAVE_MNIST, MNIST_RAW, NO_MNIST

# Every flag the example promises (the tutorial's, then the loop's own).
FLAGS = {"--batch-size": "40", "--device-iterations": "10", "--gradient-accumulation": "10",
         "--test-batch-size": "8", "--epochs": "3", "--learning-rate": "0.001",
         "--profile": None, "--profile-dir": "./profile", "--strategy": "pipelined",
         "--offload-optimiser": None, "--debug": None, "--data-dir": None,
         "--checkpoint-dir": None, "--resume": None, "--replicas": "1", "--max-steps": None,
         "--ipu-config": None, "--ipu-config-overrides": None}


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


@pytest.mark.parametrize("argv, message", [
    (["--ipu-config-overrides", "device_iterations=2"],
     "--ipu-config-overrides changes an --ipu-config FILE: pass both"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--gradient-accumulation", "0"], "--gradient-accumulation must be >= 1"),
    (["--strategy", "staged"], "invalid choice: 'staged'"),
])
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
    IPUConfig(device_iterations=5, gradient_accumulation_steps=3, output_mode="all",
              inference_device_iterations=50).save(tmp_path)
    rc = mnist.main(["--data-dir", str(mnist_root), "--ipu-config", str(tmp_path),
                     "--ipu-config-overrides", "device_iterations=2,gradient_accumulation_steps=2",
                     "--strategy", "sharded", "--max-steps", "1", "--epochs", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    # The overrides, not the file or the flags' defaults (10 x 10), set the factors.
    assert "strategy: sharded; micro-batch 40 x 2 device iterations x 2 accumulation x " \
           "1 replica(s)" in out, out
    assert re.search(r"^trained 1 steps \(2 updates, 160 samples\)", out, re.M), out
    assert re.search(r"^Accuracy on test set: \d+\.\d\d%$", out, re.M), out


@pytest.mark.parametrize("content, message", [
    ('{"gradient_accumulation_steps": 0}', "gradient_accumulation_steps must be >= 1"),
    ('{"layer_per_ipu": [1]}', "IPUConfig received unknown arguments: layer_per_ipu=[1]"),
    ("device_iterations: 2", "is not a JSON IPUConfig"),
])
def test_a_bad_ipu_config_is_one_message(tmp_path, capsys, content, message):
    (tmp_path / "ipu_config.json").write_text(content)
    # Checked before the data is read: the data folder does not even exist.
    rc = mnist.main(["--data-dir", str(tmp_path / "no-data"), "--ipu-config", str(tmp_path),
                     "--max-steps", "1"])
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
