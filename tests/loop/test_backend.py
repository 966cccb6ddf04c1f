"""Backend resolution (``IPULOOP_BACKEND``, ``ipuloop.backend_name()``, ``ipuloop.poptorch``).

Resolution is cached once per process, so every scenario runs in its own process, a Python
child started warm (tests/support/warm.py: torch is imported already, ipuloop is not). They are
started together (one module fixture).
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

pytestmark = pytest.mark.slow  # one interpreter per scenario: about 40 s
REPO = Path(__file__).resolve().parents[2]

# Prints one JSON line: the backend name, the module's name, and whether it is ipuloop.emulator.
# "package" probes go through ``import ipuloop`` (which imports torch: slow on a small machine);
# "alone" probes load ipuloop/backend.py by itself, for the scenarios that never reach the
# emulator (the resolution logic is the same file).
PROBE = textwrap.dedent("""
    import json, os, sys
    if sys.argv[1] == "package":
        import ipuloop
        from ipuloop import backend
        lazy = backend._resolved is None and "poptorch" not in sys.modules
        resolve, current = ipuloop.backend_name, lambda: ipuloop.poptorch
    else:
        import importlib.util
        spec = importlib.util.spec_from_file_location("ipuloop.backend_alone", "ipuloop/backend.py")
        backend = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(backend)
        lazy = True
        resolve, current = backend.backend_name, backend.poptorch_module
    try:
        name = resolve()
    except backend.BackendError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e),
                          "is_import_error": isinstance(e, ImportError)}))
        sys.exit(0)
    module = current()
    out = {"name": name, "module": module.__name__,
           "is_emulator": module is sys.modules.get("ipuloop.emulator"), "lazy": lazy}
    # the resolution is cached: changing the variable now changes nothing in this process
    os.environ["IPULOOP_BACKEND"] = "bogus"
    out["cached"] = resolve() == name and current() is module
    print(json.dumps(out))
""")

FAKE_POPTORCH = "__version__ = '3.4.0-fake'\nFAKE = True\n"
BROKEN_POPTORCH = "raise ImportError('libpoplar.so: cannot open shared object file')\n"

# scenario -> (probe kind, IPULOOP_BACKEND or None for unset, fake poptorch source or None)
SCENARIOS = {
    "unset": ("package", None, None),
    "emulator": ("package", "emulator", FAKE_POPTORCH),
    "auto_broken_poptorch": ("package", "auto", BROKEN_POPTORCH),
    "poptorch_missing": ("alone", "poptorch", None),
    "bogus": ("alone", "bogus", None),
    "auto_with_poptorch": ("alone", "auto", FAKE_POPTORCH),
    "poptorch_with_poptorch": ("alone", " PopTorch ", FAKE_POPTORCH),
    "poptorch_broken_poptorch": ("alone", "poptorch", BROKEN_POPTORCH),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    procs = {}
    for name, (kind, value, fake) in SCENARIOS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("IPULOOP_BACKEND", "PYTHONPATH")}
        paths = [str(REPO)]
        if fake is not None:
            d = tmp_path_factory.mktemp(name)
            (d / "poptorch.py").write_text(fake)
            paths.insert(0, str(d))
        env["PYTHONPATH"] = os.pathsep.join(paths)
        if value is not None:
            env["IPULOOP_BACKEND"] = value
        procs[name] = warm.Popen(
            [sys.executable, "-c", PROBE, kind],
            env=env,
            cwd=str(REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"{name}: rc={p.returncode}\n{stderr}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_poptorch_is_not_installed_here():
    # the scenarios below assume that; if poptorch ever appears, they need a fake "missing" one
    import importlib.util

    assert importlib.util.find_spec("poptorch") is None


def test_unset_means_auto_and_picks_the_emulator_without_poptorch(results):
    r = results["unset"]
    assert r == {
        "name": "emulator",
        "module": "ipuloop.emulator",
        "is_emulator": True,
        "lazy": True,
        "cached": True,
    }, r


def test_emulator_choice_wins_over_an_importable_poptorch(results):
    r = results["emulator"]
    assert r == {
        "name": "emulator",
        "module": "ipuloop.emulator",
        "is_emulator": True,
        "lazy": True,
        "cached": True,
    }, r


def test_explicit_poptorch_missing_raises_with_sdk_hint(results):
    r = results["poptorch_missing"]
    assert r["error"] == "BackendError" and r["is_import_error"], r
    assert "Poplar SDK" in r["message"]
    assert "IPULOOP_BACKEND=poptorch" in r["message"]
    assert "IPULOOP_BACKEND=emulator" in r["message"]  # the fix is named


def test_unknown_backend_raises(results):
    r = results["bogus"]
    assert r["error"] == "BackendError", r
    assert "IPULOOP_BACKEND must be one of auto, poptorch, emulator" in r["message"]
    assert "'bogus'" in r["message"]


@pytest.mark.parametrize("scenario", ["auto_with_poptorch", "poptorch_with_poptorch"])
def test_real_poptorch_used_when_importable(results, scenario):
    r = results[scenario]
    assert r == {
        "name": "poptorch",
        "module": "poptorch",
        "is_emulator": False,
        "lazy": True,
        "cached": True,
    }, r


def test_auto_falls_back_when_poptorch_fails_to_import(results):
    r = results["auto_broken_poptorch"]
    assert r["name"] == "emulator" and r["is_emulator"], r


def test_explicit_poptorch_broken_reports_the_import_failure(results):
    r = results["poptorch_broken_poptorch"]
    assert r["error"] == "BackendError", r
    assert "libpoplar.so" in r["message"] and "Poplar SDK" in r["message"]
