"""The emulated IPU system: ``IPULOOP_EMULATOR_IPUS`` IPUs (none unless set; 16 under
``python -m ipuloop.emulate``, ``--ipus N``), and what a program asks of it: whether hardware
is available, its version, whether a model is compiled (``_executable``), and a model that
needs more IPUs than the system has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import warm

from ipuloop import emulator as poptorch

REPO = Path(__file__).resolve().parents[2]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)

    def forward(self, x, y):
        out = self.fc(x)
        return out, torch.nn.functional.mse_loss(out, y)


def batch(n=1):
    return torch.ones(n, 2), torch.zeros(n, 1)


def test_without_an_emulated_system_the_answers_are_poptorchs_without_ipus(monkeypatch):
    monkeypatch.delenv("IPULOOP_EMULATOR_IPUS", raising=False)
    assert poptorch.ipuHardwareIsAvailable() is False
    with pytest.raises(AssertionError, match="No IPU hardware available on this system"):
        poptorch.ipuHardwareVersion()
    monkeypatch.setenv("IPULOOP_EMULATOR_IPUS", "0")
    assert poptorch.ipuHardwareIsAvailable(1) is False


def test_an_emulated_system_of_n_ipus(monkeypatch):
    monkeypatch.setenv("IPULOOP_EMULATOR_IPUS", "4")
    assert poptorch.ipuHardwareIsAvailable() is True
    assert poptorch.ipuHardwareIsAvailable(4) is True
    assert poptorch.ipuHardwareIsAvailable(8) is False
    assert poptorch.ipuHardwareVersion() == 2


@pytest.mark.parametrize("value", ["-1", "four", "1.5"])
def test_a_bad_system_size_is_named(monkeypatch, value):
    monkeypatch.setenv("IPULOOP_EMULATOR_IPUS", value)
    with pytest.raises(ValueError, match=f"IPULOOP_EMULATOR_IPUS={value!r}"):
        poptorch.ipuHardwareIsAvailable()


def test_a_model_needing_more_ipus_than_the_system_is_refused_at_compile(monkeypatch):
    monkeypatch.setenv("IPULOOP_EMULATOR_IPUS", "2")
    opts = poptorch.Options().replicationFactor(4)
    model = poptorch.trainingModel(Net(), opts, torch.optim.SGD(Net().parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match=r"needs 4 IPUs .* IPULOOP_EMULATOR_IPUS=2"):
        model(*batch(4))
    assert not model.isCompiled()
    # the IPU Model and an offline target reserve no IPUs of the system
    opts = poptorch.Options().replicationFactor(4).useIpuModel(True)
    assert poptorch.inferenceModel(Net(), opts)(*batch(4))[0].shape == (4, 1)
    monkeypatch.setenv("IPULOOP_EMULATOR_IPUS", "4")
    opts = poptorch.Options().replicationFactor(4)
    assert poptorch.inferenceModel(Net(), opts)(*batch(4))[0].shape == (4, 1)


def test_executable_is_none_until_compiled_and_after_destroy():
    net = Net()
    model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    assert model._executable is None
    model.compile(*batch())
    assert model._executable is not None and model.isCompiled()
    assert model._executable == model._executable
    model(*batch())
    model.detachFromDevice()
    assert model._executable is not None  # detaching keeps the executable
    model.destroy()
    assert model._executable is None and not model.isCompiled()
    inference = poptorch.inferenceModel(Net())
    assert inference._executable is None
    inference(*batch())
    assert inference._executable is not None


PROGRAM = textwrap.dedent("""
    import json, sys
    import poptorch
    out = {"argv": sys.argv[1:], "available": poptorch.ipuHardwareIsAvailable(),
           "sixteen": poptorch.ipuHardwareIsAvailable(16)}
    try:
        out["version"] = poptorch.ipuHardwareVersion()
    except AssertionError as e:
        out["version"] = str(e)
    print(json.dumps(out))
""")


def test_emulate_presents_a_system_of_16_ipus_settable_with_ipus(tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if k != "IPULOOP_EMULATOR_IPUS"}
    env["PYTHONPATH"] = str(REPO)
    runs = {
        "default": ["prog.py", "a"],
        "none": ["--ipus", "0", "prog.py"],
        "four": ["--ipus=4", "-m", "prog", "b", "--x"],  # a module, as python -m runs it
    }
    procs = {
        name: warm.Popen(
            [sys.executable, "-m", "ipuloop.emulate", *args],
            cwd=str(tmp_path),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in runs.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    assert out["default"] == {"argv": ["a"], "available": True, "sixteen": True, "version": 2}
    assert out["none"] == {
        "argv": [],
        "available": False,
        "sixteen": False,
        "version": "No IPU hardware available on this system",
    }
    assert out["four"] == {"argv": ["b", "--x"], "available": True, "sixteen": False, "version": 2}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ipus", "x", "p.py"], "--ipus takes the number of IPUs"),
        (["--ipus", "2"], "the following arguments are required: SCRIPT (or -m MODULE)"),
        (["-m"], "argument -m: expected MODULE"),
    ],
)
def test_emulate_usage_errors_exit_2(args, message, capsys, monkeypatch):
    from ipuloop import emulate

    monkeypatch.delenv("IPULOOP_EMULATOR_IPUS", raising=False)
    with pytest.raises(SystemExit) as e:
        emulate.main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert "IPULOOP_EMULATOR_IPUS" not in os.environ
