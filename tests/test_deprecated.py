"""``ipuloop.deprecated``: each of the first layout's names still gives what it gave, warns with a
``DeprecationWarning`` naming its new import and the release that removes it, and is gone by that
release (the test of the version fails once the package reaches it)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import ipuloop
from ipuloop import deprecated
from ipuloop.deprecated import MOVED, REMOVED_IN

REPO = Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_the_first_layout_s_names_are_removed_at_their_version():
    """At ``REMOVED_IN``, delete ``ipuloop/deprecated.py``, ``config.py``, ``plot.py``, the
    lines of ``__init__.py`` and ``callbacks/__init__.py`` that name them, and this file."""
    assert _version(ipuloop.__version__) < _version(REMOVED_IN), (
        f"ipuloop {ipuloop.__version__} removes the first layout's names: {sorted(MOVED)}"
    )


def test_the_removal_is_the_next_minor_release():
    major, minor, _ = _version(ipuloop.__version__)
    assert _version(REMOVED_IN) == (major, minor + 1, 0)


def _resolve(dotted: str):
    """The module, or the module's attribute, ``dotted`` names, imported without warnings."""
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _old(dotted: str):
    """What the old name ``dotted`` gives, read as a program reads it."""
    if dotted in sys.modules and not dotted.startswith(("ipuloop.config", "ipuloop.plot")):
        return sys.modules[dotted]  # ``distributed``, ``errors``: their names warn when read
    sys.modules.pop(dotted, None)  # a file module warns when it is imported
    return _resolve(dotted)


@pytest.mark.parametrize("old", [n for n in MOVED if not n.startswith("python -m")])
def test_each_old_name_warns_and_gives_the_same_thing(old):
    new = _resolve(MOVED[old])
    with pytest.warns(DeprecationWarning) as caught:
        got = _old(old)
        names = getattr(new, "__all__", None)
        if names is None:  # a class
            assert got is new
        else:  # a module: each of its public names
            assert names and all(getattr(got, n) is getattr(new, n) for n in names)
    assert {str(w.message) for w in caught} == {deprecated.message(old)}
    assert caught[0].filename == __file__  # at the program's line, not ipuloop's


def test_the_messages_name_the_new_import():
    assert deprecated.message("ipuloop.callbacks.WandbLogger") == (
        "`ipuloop.callbacks.WandbLogger` is deprecated and will be removed in ipuloop "
        f"{REMOVED_IN}: use `from ipuloop.integrations.wandb_logger import WandbLogger` instead"
    )
    assert deprecated.message("ipuloop.config").endswith(
        "import `ipuloop.integrations.ipu_config` instead"
    )
    assert deprecated.message("python -m ipuloop.plot").endswith(
        "run `python -m ipuloop.integrations.plotting` instead"
    )


def test_the_new_names_do_not_warn():
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import ipuloop, ipuloop.callbacks as cb, ipuloop.processes, ipuloop.exceptions\n"
        "from ipuloop import IPUConfig\n"
        "from ipuloop.integrations import ipu_config, plotting, tensorboard, wandb_logger\n"
        "from ipuloop.integrations import mlflow_logger, scalars\n"
        "from ipuloop.callbacks import *\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO)


def test_the_old_names_warn_at_the_program_s_line_by_default(tmp_path):
    """Python shows the DeprecationWarnings a script's own lines cause: each points there."""
    script = tmp_path / "old.py"
    script.write_text(
        "import ipuloop.config\n"
        "from ipuloop.callbacks import TensorBoardLogger\n"
        "from ipuloop.distributed import is_main_process\n"
        "from ipuloop.errors import InstanceFailedError\n"
        "from ipuloop.plot import main\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONWARNINGS", None)
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    shown = [line for line in run.stderr.splitlines() if "DeprecationWarning" in line]
    olds = ["config", "callbacks.TensorBoardLogger", "distributed", "errors", "plot"]
    assert [line.split(": ")[0] for line in shown] == [f"{script}:{i}" for i in range(1, 6)]
    assert all(f"`ipuloop.{o}` is deprecated" in line for o, line in zip(olds, shown))


def test_python_m_ipuloop_plot_warns_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "logs.csv"
    log.write_text("epoch,step,update,loss\n0,1,1,0.9\n0,2,2,0.7\n1,3,3,0.6\n")
    out = tmp_path / "c.png"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONWARNINGS", None)
    run = subprocess.run(
        [sys.executable, "-m", "ipuloop.plot", str(log), "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert deprecated.message("python -m ipuloop.plot") in run.stderr
    assert run.stdout.startswith(f"wrote {out}: loss") and out.stat().st_size > 1000


def test_the_callbacks_hold_no_integration():
    """The loggers' old names come from ``ipuloop.deprecated``, which the callbacks never
    import: what they hand out is registered from above."""
    import ipuloop.callbacks as cb

    assert set(cb.MOVED) == {
        n.rpartition(".")[2] for n in MOVED if n.startswith("ipuloop.callbacks.")
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from ipuloop.integrations.scalars import ScalarLogger

        assert cb.ScalarLogger is ScalarLogger
    with pytest.raises(AttributeError, match="no attribute 'NoSuchLogger'"):
        cb.NoSuchLogger  # noqa: B018 (the attribute read is the test)
