"""What PopTorch prints and what programs reach besides the model API: ``poptorch.logger`` and
its levels, ``poptorch.poptorch_core``'s error classes, the log lines PopTorch's users and
tests match on, and the AsynchronousDataAccessor / Block details PopTorch's tests check.

Each test names the PopTorch 3.4 source (graphcore/poptorch) whose behaviour it pins.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import ipuloop.emulator as poptorch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _warn_level():
    """Each test starts at PopTorch's default level (WARN) and leaves it there."""
    poptorch.setLogLevel("WARN")
    yield
    poptorch.setLogLevel("WARN")


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                          capture_output=True, text=True, timeout=120)


# -- 4. poptorch.logger and poptorch.poptorch_core -----------------------------------------

def test_logger_is_poptorchs_console_logger(capfd):
    """python/_logging.py (``logger = logging.getLogger("poptorch::python")`` with a console
    handler and ``_PoptorchFormatter``: ``[time] [name] [level] message``, level in lower
    case) and python/__init__.py (``from ._logging import logger``)."""
    assert isinstance(poptorch.logger, logging.Logger)
    assert poptorch.logger.name == "poptorch::python"
    poptorch.logger.warning("from a user program %d", 7)
    poptorch.logger.info("not shown at WARN")
    err = capfd.readouterr().err
    assert "[poptorch::python] [warning] from a user program 7" in err
    assert "not shown at WARN" not in err


@pytest.mark.parametrize("level, shown", [
    ("OFF", []), ("ERR", ["error"]), ("WARN", ["error", "warning"]),
    ("INFO", ["error", "warning", "info"]), ("DEBUG", ["error", "warning", "info", "debug"]),
    ("TRACE", ["error", "warning", "info", "debug"]), (1, ["error", "warning", "info", "debug"]),
    (4, ["error"])])
def test_set_log_level_filters_the_logger(capfd, level, shown):
    """python/_logging.py ``setLogLevel``: each name (or legacy integer) maps to a Python
    level; TRACE is DEBUG on the Python side."""
    poptorch.setLogLevel(level)
    for name in ("error", "warning", "info", "debug"):
        getattr(poptorch.logger, name)(f"message at {name}")
    err = capfd.readouterr().err
    assert [n for n in ("error", "warning", "info", "debug") if f"message at {n}" in err] == shown


def test_poptorch_log_level_is_read_at_import():
    """python/_logging.py: ``setLogLevel(os.environ.get("POPTORCH_LOG_LEVEL", "WARN"))`` at
    import; an unknown value fails the import."""
    code = """
        import logging, poptorch
        print(logging.getLevelName(poptorch.logger.level))
        poptorch.logger.debug("debug line shown")
    """
    emulated = "import ipuloop.emulate; ipuloop.emulate.install()\n"
    r = _run_python(emulated + textwrap.dedent(code), POPTORCH_LOG_LEVEL="DEBUG")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["DEBUG"] and "debug line shown" in r.stderr
    r = _run_python(emulated + textwrap.dedent(code), POPTORCH_LOG_LEVEL="LOUD")
    assert r.returncode != 0
    assert "Unknown log level: LOUD" in r.stderr and "POPTORCH_LOG_LEVEL" in r.stderr


def test_poptorch_core_error_classes():
    """python/__init__.py: ``from poptorch.poptorch_core import Error, RecoverableError,
    UnrecoverableError``; python/poptorch.cpp ``initialiseExceptionHandling`` makes both
    subclasses of ``Error``."""
    core = poptorch.poptorch_core
    assert core.Error is poptorch.Error
    assert poptorch.RecoverableError is core.RecoverableError
    assert poptorch.UnrecoverableError is core.UnrecoverableError
    for cls in (core.RecoverableError, core.UnrecoverableError):
        assert issubclass(cls, poptorch.Error)
    with pytest.raises(poptorch.Error):
        raise core.RecoverableError("Reboot needed")


def test_poptorch_core_hooks_are_refused_clearly():
    """python/poptorch.cpp binds compiler hooks (``_validateOptions``, ``_throwTestError``,
    ...) that need the Poplar compiler: they raise ``poptorch.Error`` naming the hook, and
    ``hasattr`` sees them missing. ``TestErrorType`` (poptorch.cpp) exists so modules that
    parametrize over it import."""
    core = poptorch.poptorch_core
    with pytest.raises(poptorch.Error, match="poptorch_core._validateOptions belongs to "
                                             "PopTorch's compiled core"):
        core._validateOptions({})
    assert not hasattr(core, "getTracedGraph")
    assert [m.name for m in core.TestErrorType][-2:] == ["PoplarRecoverableFullReset",
                                                         "PoplarLinkError"]


def test_import_poptorch_submodules_under_emulate():
    """python/__init__.py imports ``poptorch.poptorch_core`` and ``poptorch._logging`` as
    submodules: under ``python -m ipuloop.emulate`` both import paths give the one module
    (one ``Error`` class, one logger)."""
    r = _run_python("""
        import ipuloop.emulate; ipuloop.emulate.install()
        import poptorch
        import poptorch.poptorch_core as core
        from poptorch import _logging
        assert core is poptorch.poptorch_core and core.Error is poptorch.Error
        assert _logging.logger is poptorch.logger
        poptorch._logging.setPopartLogLevel("INFO")
        try:
            poptorch._logging.setPopartLogLevel("LOUD")
        except ValueError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Level must be one of TRACE, DEBUG, INFO, WARN, ERR, OFF")
