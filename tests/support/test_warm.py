"""tests/support/warm.py: a test's Python child forked from a warm server behaves as a fresh
interpreter running the same command would, as far as the tests that use it look."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm
from launch import clean_env, command

# Not marked ``threads``: the children are forked by the server, which never ran an op, not by
# this process (tests/conftest.py)

PROGRAM = r"""
import atexit, json, os, sys
mode = sys.argv[1] if len(sys.argv) > 1 else ""
before = sorted(m for m in ("torch", "torchmetrics") if m in sys.modules)
atexit.register(lambda: print("atexit", flush=True))
import torch, torchmetrics
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "path": sys.path, "cwd": os.getcwd(), "name": __name__,
    "file": globals().get("__file__"),
    "env": dict(os.environ),
    "threads": torch.get_num_threads(), "main": sys.modules["__main__"].__dict__ is globals(),
    "session": os.getsid(0) == os.getpid(), "ppid": os.getppid(), "before": before,
    "pid": os.getpid(), "rank": os.environ.get("RANK"),
}), flush=True)
print("to stderr", file=sys.stderr)
if mode == "raise":
    raise ValueError("raised in the program")
if mode == "exit":
    sys.exit(7)
if mode == "os_exit":
    os._exit(3)
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "sleep":
    import time
    time.sleep(60)
"""

SPAWNING = r"""
import multiprocessing, os
__file__ = os.path.basename(__file__)  # as a runner gives it (runpy.run_path("spawning.py"))
def square(x):
    return x * x
if __name__ == "__main__":  # a function of __main__, pickled into a spawned interpreter
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print("spawned", pool.map(square, [3]), flush=True)
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("warm") / "program.py"
    path.write_text(PROGRAM)
    return path


def _view(stdout: str) -> dict:
    return json.loads(stdout.splitlines()[0])


def _both(cmd: list, cwd: Path, **env: str):
    """The command run warm and fresh, in the same folder and environment."""
    full = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    full.update(WARM_TEST="x", TMPDIR=str(cwd), **env)  # (the cache folder: made in TMPDIR)
    kw = {"capture_output": True, "text": True, "cwd": cwd, "env": full, "timeout": 120}
    return warm.run(cmd, **kw), subprocess.run(cmd, **kw)


@pytest.mark.slow  # (a fresh interpreter beside it)
def test_a_script_sees_what_a_fresh_interpreter_sees(program, tmp_path):
    path = os.pathsep.join([*os.environ.get("PYTHONPATH", "").split(os.pathsep), "rel", ""])
    w, f = _both([sys.executable, str(program), "raise", "a b"], tmp_path, PYTHONPATH=path)
    vw, vf = _view(w.stdout), _view(f.stdout)
    assert vw["ppid"] != os.getpid() and vf["ppid"] == os.getpid()  # warm: forked by the server
    assert vw["before"] == ["torch", "torchmetrics"] and vf["before"] == []
    for key in ("ppid", "before", "pid"):
        del vw[key], vf[key]
    assert vw == vf
    assert vw["argv"] == [str(program), "raise", "a b"] and vw["path0"] == str(program.parent)
    assert vw["env"]["WARM_TEST"] == "x"
    if "TORCHINDUCTOR_CACHE_DIR" in vf["env"]:  # torchvision's import in torch 2.x made it
        assert Path(vf["env"]["TORCHINDUCTOR_CACHE_DIR"]).parent == tmp_path
    # an uncaught exception: status 1, the program's traceback, then the atexit handlers
    assert w.returncode == f.returncode == 1
    line = PROGRAM.splitlines().index('    raise ValueError("raised in the program")') + 1
    tail = f'line {line}, in <module>\n    raise ValueError("raised in the program")\n'
    for stderr in (w.stderr, f.stderr):
        assert tail in stderr and stderr.endswith("ValueError: raised in the program\n")
        assert stderr.startswith("to stderr\nTraceback (most recent call last):\n")
    assert "warm.py" not in w.stderr
    assert w.stdout.splitlines()[1:] == f.stdout.splitlines()[1:] == ["atexit"]


def test_dash_c_and_dash_m_see_what_a_fresh_interpreter_sees(tmp_path):
    code = "import json, os, sys; print(json.dumps([sys.argv, sys.path[0], os.getcwd()]))"
    w, f = _both([sys.executable, "-c", code, "x"], tmp_path)
    assert w.stdout == f.stdout, (w.returncode, w.stderr[-2000:])
    assert json.loads(w.stdout)[:2] == [["-c", "x"], ""]
    (tmp_path / "mod_for_warm.py").write_text(code)
    w, f = _both([sys.executable, "-m", "mod_for_warm", "y"], tmp_path)
    assert w.returncode == f.returncode == 0, w.stderr + f.stderr
    assert w.stdout == f.stdout
    assert json.loads(w.stdout)[:2] == [[str(tmp_path / "mod_for_warm.py"), "y"], str(tmp_path)]


def test_a_sitecustomize_or_a_shadowing_module_on_the_path_is_started_afresh(program, tmp_path):
    (tmp_path / "sitecustomize.py").write_text("print('sitecustomize ran')\n")
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "json.py").write_text("")  # json: imported by torch
    (tmp_path / "shadow" / "ppid.py").write_text("import os; print(os.getppid())\n")
    ppid = [sys.executable, "-c", "import os; print(os.getppid())"]
    for cmd, env, out in (
        (ppid, {"PYTHONPATH": str(tmp_path)}, ["sitecustomize ran", str(os.getpid())]),
        ([sys.executable, str(tmp_path / "shadow" / "ppid.py")], {}, [str(os.getpid())]),
    ):  # a fresh interpreter: it runs the sitecustomize, or would import that json
        r = warm.run(cmd, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True)
        assert r.stdout.splitlines() == out, r.stderr
    r = warm.run(ppid, cwd=tmp_path, capture_output=True, text=True)  # (not run from there)
    assert r.stdout.splitlines() != [str(os.getpid())] and "sitecustomize" not in r.stdout


@pytest.mark.parametrize("mode, code", [("exit", 7), ("os_exit", 3), ("interrupt", -signal.SIGINT)])
def test_exit_statuses_are_a_fresh_interpreters(program, tmp_path, mode, code):
    r = warm.run([sys.executable, str(program), mode], capture_output=True, text=True)
    assert r.returncode == code, r.stderr
    assert ("atexit" in r.stdout) == (mode != "os_exit")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_reaches_the_child_itself_and_its_status_comes_back(program, sig):
    p = warm.Popen([sys.executable, str(program), "sleep"], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    view = json.loads(p.stdout.readline())
    assert p.poll() is None and view["ppid"] != os.getpid()
    p.send_signal(sig)
    assert p.wait(30) == -sig
    p.stdout.close()


def test_start_new_session_and_timeouts(program):
    p = warm.Popen(
        [sys.executable, str(program), "sleep"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert p.stdout is not None
    assert json.loads(p.stdout.readline())["session"] is True
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    os.killpg(p.pid, signal.SIGTERM)  # the group, as a terminal's Ctrl-C
    assert p.wait(30) == -signal.SIGTERM
    p.stdout.close()
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([sys.executable, str(program), "sleep"], capture_output=True, timeout=1)
    assert time.monotonic() - start < 30  # killed, not waited for


def test_a_function_of_main_reaches_a_spawned_interpreter(tmp_path):
    # (__main__'s file named relative to the child's folder: a spawn prepares it from there)
    (tmp_path / "spawning.py").write_text(SPAWNING)
    r = warm.run([sys.executable, "spawning.py"], cwd=tmp_path, capture_output=True, text=True,
                 timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "spawned [9]" in r.stdout


def test_another_thread_count_gets_a_server_of_its_own(program):
    """OpenMP reads OMP_NUM_THREADS when torch's library loads: another value, another server."""
    threads = 1 if os.environ.get("OMP_NUM_THREADS") != "1" else 2
    servers = set()
    for env in ({}, {"OMP_NUM_THREADS": str(threads)}):
        r = warm.run([sys.executable, str(program)], capture_output=True, text=True,
                     env={**os.environ, **env})  # fmt: skip
        servers.add(_view(r.stdout)["ppid"])
    assert len(servers) == 2 and os.getpid() not in servers
    assert _view(r.stdout)["threads"] == min(threads, os.cpu_count() or 1)  # (one per core)


def test_what_it_cannot_start_warm_starts_as_subprocess_would(tmp_path, monkeypatch):
    ppid = "import os, sys; print(os.getppid(), 'torch' in sys.modules)"
    for cmd in (
        [sys.executable, "-I", "-c", ppid],  # an option it does not take
        ["sh", "-c", "echo $PPID False"],  # another program
    ):
        r = warm.run(cmd, capture_output=True, text=True)
        assert r.stdout.split() == [str(os.getpid()), "False"], r.stderr
    monkeypatch.setenv("IPULOOP_WARM", "0")
    r = warm.run([sys.executable, "-c", ppid], capture_output=True, text=True)
    assert r.stdout.split() == [str(os.getpid()), "False"], r.stderr
    monkeypatch.delenv("IPULOOP_WARM")
    with pytest.raises(FileNotFoundError, match="missing"):  # as subprocess does
        warm.run([sys.executable, "-c", ppid], cwd=tmp_path / "missing")


@pytest.mark.slow  # (several processes)
def test_torchrun_s_workers_start_warm_and_their_status_comes_back(program, tmp_path):
    """Started warm, torchrun's own subprocess.Popen forks its workers from the server too."""
    r = warm.run(command(program, "plain", processes=2), env=clean_env(), capture_output=True,
                 text=True, cwd=tmp_path, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    views = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert sorted(v["rank"] for v in views) == ["0", "1"]
    assert all(v["before"] == ["torch", "torchmetrics"] for v in views)
    assert all(v["argv"] == [str(program), "plain"] for v in views)
    torchrun = {v["pid"]: warm.parents()[v["pid"]] for v in views}
    assert len(set(torchrun.values())) == 1 and r.args[1:3] == ["-m", "torch.distributed.run"]
    (launcher,) = set(torchrun.values())
    assert warm.parents()[launcher] == os.getpid()
    assert warm.command_lines()[views[0]["pid"]][-2:] == [str(program), "plain"]
    r = warm.run(command(program, "exit", processes=2), env=clean_env(), capture_output=True,
                 text=True, cwd=tmp_path, timeout=120)  # fmt: skip
    assert r.returncode != 0 and "exitcode  : 7" in r.stderr, r.stderr[-3000:]
