"""``python -m ipuloop.emulate SCRIPT [ARGS...]``: binds ``import poptorch`` to the emulator,
passes argv, runs SCRIPT as ``__main__`` and propagates its exit status.

The two end-to-end runs start together (each interpreter imports torch); the argument-handling
cases run ``main()`` in this process, where they exit before touching any global state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import warm

from ipuloop import emulate

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys
    import poptorch
    import poptorch.optim
    from poptorch.enums import OutputMode
    from poptorch.options import Options
    import torch
    import helper                      # lives next to the script
    import ipuloop

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 1)

        def forward(self, x, y):
            out = self.fc(x)
            return out, torch.nn.functional.mse_loss(out, y)

    opts = poptorch.Options().deviceIterations(2)
    net = Net()
    model = poptorch.trainingModel(net, opts, poptorch.optim.SGD(net.parameters(), lr=0.1))
    out, loss = model(torch.ones(4, 2), torch.zeros(4, 1))
    print(json.dumps({
        "argv": sys.argv, "name": __name__, "file": __file__,
        "poptorch": poptorch.__name__, "optim": poptorch.optim.__name__,
        "helper": helper.POPTORCH, "backend": ipuloop.backend_name(),
        "submodules": [OutputMode is poptorch.OutputMode, Options is poptorch.Options],
        "out_shape": list(out.shape), "loss_shape": list(loss.shape),
    }))
    if __name__ == "__main__":
        sys.exit(int(sys.argv[-1]))
""")

HELPER = "import poptorch\nPOPTORCH = poptorch.__name__\n"
FAILING = "import poptorch\nraise ValueError('boom from the script')\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("emulate")
    scripts = root / "scripts"
    scripts.mkdir()
    (scripts / "train.py").write_text(SCRIPT)
    (scripts / "helper.py").write_text(HELPER)
    (scripts / "failing.py").write_text(FAILING)
    fake = root / "fake"
    fake.mkdir()
    (fake / "poptorch.py").write_text("raise RuntimeError('the real poptorch was imported')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("IPULOOP_BACKEND", "PYTHONPATH")}
    # an importable "poptorch" on the path: the emulate runner must win over it
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(REPO)])
    env["IPULOOP_BACKEND"] = "auto"
    commands = {
        # run from another directory, with a relative script path and options-like arguments
        "train": ["scripts/train.py", "--epochs", "2", "-x", "3"],
        "failing": [str(scripts / "failing.py")],
    }
    procs = {
        name: warm.Popen(
            [sys.executable, "-m", "ipuloop.emulate", *args],
            env=env,
            cwd=str(root),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[name] = (p.returncode, stdout, stderr)
    return out


def _report(runs):
    rc, stdout, stderr = runs["train"]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert lines, f"rc={rc}\n{stdout}\n{stderr}"
    return rc, json.loads(lines[-1])


def test_script_exit_code_is_propagated(runs):
    rc, _ = _report(runs)
    assert rc == 3


def test_argv_and_main(runs):
    _, r = _report(runs)
    assert r["argv"] == ["scripts/train.py", "--epochs", "2", "-x", "3"]
    assert r["name"] == "__main__"
    assert r["file"].endswith("train.py")


def test_import_poptorch_is_the_emulator_everywhere(runs):
    _, r = _report(runs)
    assert r["poptorch"] == "ipuloop.emulator"
    assert r["optim"] == "ipuloop.emulator.optim"
    assert r["helper"] == "ipuloop.emulator"  # modules the script imports see it too
    assert r["backend"] == "emulator"  # ipuloop.poptorch agrees with the binding
    assert r["submodules"] == [True, True]  # `from poptorch.enums import ...` works too


def test_script_runs_poptorch_code(runs):
    _, r = _report(runs)
    assert r["out_shape"] == [2, 1] and r["loss_shape"] == []  # Final, DI=2, B=2


def test_uncaught_exception_exits_1_with_traceback(runs):
    rc, _, stderr = runs["failing"]
    assert rc == 1
    assert "ValueError: boom from the script" in stderr
    assert "Traceback" in stderr


USAGE = "usage: python -m ipuloop.emulate [-h] [--ipus N] (SCRIPT | -m MODULE) [ARGS ...]"


@pytest.mark.parametrize("argv", [[], ["--ipus", "4"]])
def test_no_script_prints_the_usage_and_exits_2_naming_script(capsys, argv):
    with pytest.raises(SystemExit) as e:
        emulate.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(USAGE + "\n")
    assert "error: the following arguments are required: SCRIPT (or -m MODULE)" in err


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--ipus", "4", "--help"]])
def test_help_is_argparse_style_and_exits_0(capsys, argv):
    with pytest.raises(SystemExit) as e:
        emulate.main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(USAGE + "\n")
    assert "``" not in out and ":class:" not in out  # no reStructuredText
    for option in ("--ipus N", "-m MODULE", "SCRIPT", "ARGS"):
        assert option in out
    assert "(default: $IPULOOP_EMULATOR_IPUS, else 16)" in out


def test_an_unknown_option_before_the_script_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        emulate.main(["--ipu", "4", "train.py"])
    assert e.value.code == 2
    assert "unrecognized option '--ipu' before SCRIPT" in capsys.readouterr().err


def test_missing_script_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope.py"
    before = sys.modules.get("poptorch"), os.environ.get("IPULOOP_BACKEND")
    with pytest.raises(SystemExit) as e:
        emulate.main([str(missing), "a"])
    assert e.value.code == 2
    assert "no such script" in capsys.readouterr().err
    # nothing was installed before the script was found
    assert (sys.modules.get("poptorch"), os.environ.get("IPULOOP_BACKEND")) == before


def test_main_in_process_runs_script_as_main(tmp_path, monkeypatch):
    # isolate what install() changes: sys.modules, the environment, sys.argv and sys.path
    monkeypatch.setitem(sys.modules, "poptorch", None)
    for name in emulate._SUBMODULES:
        monkeypatch.setitem(sys.modules, f"poptorch.{name}", None)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # install() adds a finder
    monkeypatch.setenv("IPULOOP_BACKEND", "auto")
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored after
    monkeypatch.setenv("IPULOOP_EMULATOR_IPUS", "16")  # main() sets it: unset again after
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "out.json"
    script = tmp_path / "s.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, os, sys, poptorch
        json.dump({{"name": __name__, "argv": sys.argv, "pt": poptorch.__name__,
                   "env": os.environ["IPULOOP_BACKEND"]}}, open({str(out)!r}, "w"))
    """)
    )
    assert emulate.main([str(script), "one", "two"]) is None  # normal end: exit status 0
    r = json.loads(out.read_text())
    assert r == {
        "name": "__main__",
        "argv": [str(script), "one", "two"],
        "pt": "ipuloop.emulator",
        "env": "emulator",
    }
    # what follows SCRIPT is the script's, --help and the launcher's own options included
    assert emulate.main(["--ipus", "2", str(script), "--help", "--ipus", "3", "-m"]) is None
    assert json.loads(out.read_text())["argv"] == [str(script), "--help", "--ipus", "3", "-m"]
