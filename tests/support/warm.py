"""A test's Python children, started warm: forked from a server that has already imported
torch, torchvision and torchmetrics, instead of a fresh interpreter that imports them again
(about 3 to 6 s of CPU each on a CI host of 2 cores).

``warm.Popen`` and ``warm.run`` take what ``subprocess.Popen`` and ``subprocess.run`` take. A
command ``[sys.executable, SCRIPT | -m MODULE | -c CODE, *args]`` (``-u``, ``-B`` and
``-X faulthandler`` before it allowed) runs in a child forked from a server; anything else
(another program, ``preexec_fn``, ``pass_fds``, another option) starts as ``subprocess.Popen``
would. The returned object is a ``subprocess.Popen``: pipes, ``communicate``, timeouts,
``send_signal`` and ``returncode`` (negative for a signal) work on the child itself, whose
``pid`` is its own. Inside a warm child, ``subprocess.Popen`` does the same for the Python
children it starts (torchrun's workers, ``ipuloop.emulate.poprun``'s instances, a benchmark's
runs).

What the child gets, as a fresh interpreter would: its ``argv``, environment, working folder,
standard streams, ``sys.path`` (its first entry and PYTHONPATH's), a fresh ``__main__``,
default signal handlers, a new session on ``start_new_session``, the exit status of
``sys.exit`` or of an uncaught exception (1, or SIGINT's for ``KeyboardInterrupt``), its
``atexit`` handlers run, numpy's global seed drawn afresh.

What differs: the modules above are imported already, as if the program had imported them
first. What their import wrote to stderr is written again at the child's start, and what it
set in the environment is set again (torch's inductor cache folder, made in the child's
TMPDIR). The server never ran an op, so no thread pool runs when it forks; the native thread
that torch's library starts when it loads is not in the child (as in a DataLoader worker forked
after ``import torch``). The child's parent is the server: ``parents()`` and
``command_lines()`` give, for each warm child, the process that started it and its command.
So a test about interpreter start or about an import (a binding made at import, a log level
read at import, what a fresh ``import ipuloop`` loads) uses ``subprocess``.

The server forks a child only where a fresh start would import the same modules. The
environment's ``PYTHON*``, thread-count, locale, loader and torch/CUDA variables must equal
its own (another key starts another server, at most ``MAX_SERVERS``, then ``subprocess``).
No folder the child puts first on ``sys.path`` may hold a module the server imported, nor
PYTHONPATH a sitecustomize (else ``subprocess``). ``IPULOOP_WARM=0`` turns it all off. The
servers end with the process that started them.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import inspect
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from multiprocessing import reduction
from typing import Any

__all__ = ["Popen", "command_lines", "enabled", "parents", "run"]

PRELOAD = ("torch", "torchvision", "torchmetrics")
MAX_SERVERS = 4
# Environment variables read when an interpreter or the preloaded modules start
_START_PREFIXES = (
    "PYTHON",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "NPY_",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NVIDIA",
    "LD_",
    "MALLOC",
    "LC_",
    "LANG",
)
# torchrun's variables for its workers; PYTHONPATH, which the server looks into instead; the
# inductor cache folder, which the child makes again (_become)
_NOT_AT_START = ("TORCHELASTIC_", "TORCH_NCCL_", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR")
_CACHE_DIR = "torch._inductor.runtime.cache_dir_utils"  # its module, in torch 2.x
_SUPPORTED_FLAGS = {"-u", "-B"}


def enabled() -> bool:
    """Whether children start warm (``IPULOOP_WARM`` is not ``0``, on Linux)."""
    return os.environ.get("IPULOOP_WARM", "1") != "0" and sys.platform.startswith("linux")


def _key(env: dict[str, str]) -> tuple:
    """What of ``env`` an interpreter and the preloaded modules read when they start, but
    PYTHONPATH (``_Serving.shadowed``) and torchrun's variables for its workers."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if k.startswith(_START_PREFIXES) and not k.startswith(_NOT_AT_START)
        )
    )


def _pythonpath(env: dict[str, str], cwd: str) -> list[str]:
    """The folders ``PYTHONPATH`` puts on ``sys.path``, as Python does (an empty entry: the
    working folder)."""
    value = env.get("PYTHONPATH", "")
    return [os.path.abspath(os.path.join(cwd, p)) for p in value.split(os.pathsep)] if value else []


def _once(paths: list[str]) -> list[str]:
    """``paths`` with each folder once, as ``site`` leaves ``sys.path``."""
    return list(dict.fromkeys(paths))


def _first_path(request: dict) -> str:
    """``sys.path[0]`` of ``python`` running ``request``."""
    if request["kind"] == "script":
        return os.path.dirname(os.path.realpath(os.path.join(request["cwd"], request["target"])))
    return request["cwd"] if request["kind"] == "-m" else ""


def _parse(args: list[str]) -> dict | None:
    """The program a ``python`` command line runs, or None where it is not one this runs."""
    if not args or os.path.abspath(os.fspath(args[0])) != os.path.abspath(sys.executable):
        return None
    flags: list[str] = []
    rest = [str(a) for a in args[1:]]
    while rest and rest[0].startswith("-"):
        opt = rest.pop(0)
        if opt in _SUPPORTED_FLAGS:
            flags.append(opt)
        elif opt == "-X" and rest and rest[0] == "faulthandler":
            flags.append("-Xfaulthandler")
            rest.pop(0)
        elif opt in ("-m", "-c") and rest:
            return {"flags": flags, "kind": opt, "target": rest[0], "args": rest[1:]}
        else:
            return None
    if not rest:
        return None  # an interactive interpreter
    return {"flags": flags, "kind": "script", "target": rest[0], "args": rest[1:]}


# -- the test's side ------------------------------------------------------------------------------
class _Server:
    """A server process and the socket it forks children on; ``env`` None: the server that
    forked this process, at ``address``."""

    def __init__(self, env: dict[str, str] | None, address: str = "") -> None:
        self.proc: subprocess.Popen | None = None
        if env is None:
            self.folder, self.address = os.path.dirname(address), address
            return
        self.folder = tempfile.mkdtemp(prefix="warm-")
        self.address = os.path.join(self.folder, "socket")
        log = open(os.path.join(self.folder, "server.log"), "wb")  # noqa: SIM115
        self.proc = _ORIGINAL_POPEN(
            [sys.executable, __file__, "serve", self.address, *PRELOAD],
            env={k: v for k, v in env.items() if k != "PYTHONPATH"},  # (each child has its own)
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,  # a Ctrl-C at the terminal is for the tests, not for it
        )
        log.close()
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        while line not in (b"ready\n", b""):  # (what its imports printed comes first)
            line = self.proc.stdout.readline()
        self.proc.stdout.close()
        if line != b"ready\n":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the warm server did not start; its log: {self.folder}")

    def start(self, request: dict, fds: list[int]) -> tuple[socket.socket, int] | None:
        """The connection to the child started and its pid; None where the server would not
        start it (other start-time settings) or has ended."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.address)
            reduction.sendfds(conn, fds)
            payload = json.dumps(request).encode()
            conn.sendall(len(payload).to_bytes(8, "big") + payload)
            kind, _, value = _read_line(conn).partition(" ")
        except OSError:
            kind = "ended"
        if kind != "pid":
            conn.close()
            return None
        return conn, int(value)

    def children(self) -> list[dict]:
        """The children it forked: pid, the process that asked, command line."""
        try:
            with open(os.path.join(self.folder, "children")) as f:
                return [json.loads(line) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)


_servers: dict[tuple, _Server | None] = {}
_servers_lock = threading.Lock()
_parent_server: _Server | None = None  # in a warm child: the server that forked it


def _server_for(env: dict[str, str]) -> _Server | None:
    if _parent_server is not None:
        return _parent_server  # it says whether it starts the child
    key = (sys.executable, _key(env))
    with _servers_lock:
        if key not in _servers:
            if sum(s is not None for s in _servers.values()) >= MAX_SERVERS:
                return None
            _servers[key] = _Server(env)
        return _servers[key]


def _children() -> list[dict]:
    with _servers_lock:
        return [c for s in _servers.values() if s is not None for c in s.children()]


def parents() -> dict[int, int]:
    """For each warm child of this process's servers, the pid of the process that started it
    (this one, or a warm child that started its own): for a test that walks a process tree."""
    return {c["pid"]: c["parent"] for c in _children()}


def command_lines() -> dict[int, list[str]]:
    """For each warm child of this process's servers, the command it was started with."""
    return {c["pid"]: c["argv"] for c in _children()}


@atexit.register
def _stop_servers() -> None:
    with _servers_lock:
        for server in _servers.values():
            if server is not None:
                server.stop()
        _servers.clear()


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = conn.recv(size - len(data))
        if not part:
            raise OSError("the connection closed early")
        data += part
    return data


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        part = conn.recv(1)
        if not part:
            raise OSError("the warm server closed the connection")
        data += part
    return data.decode().strip()


_ORIGINAL_POPEN = subprocess.Popen
_ORIGINAL = {
    name: getattr(subprocess.Popen, name)
    for name in ("_execute_child", "_try_wait", "_internal_poll")
}
# subprocess.Popen._execute_child's parameters, self aside (they vary by Python version)
_CHILD_PARAMETERS = list(inspect.signature(subprocess.Popen._execute_child).parameters)[1:]


def _execute_child(self: Any, *given: Any) -> None:
    """``subprocess.Popen._execute_child``: a Python command forked from a warm server."""
    o = dict(zip(_CHILD_PARAMETERS, given))
    program = None
    if (
        enabled()
        and not o["shell"]
        and o["executable"] is None
        and o["preexec_fn"] is None
        and not o["pass_fds"]
        and isinstance(o["args"], (list, tuple))
        and o.get("process_group", -1) in (None, -1)
        and all(o.get(k) is None for k in ("gid", "gids", "uid"))
        and o.get("umask", -1) == -1
    ):
        program = _parse(list(o["args"]))
    env = dict(os.environ if o["env"] is None else o["env"])
    server = _server_for(env) if program is not None else None
    if server is None:
        _ORIGINAL["_execute_child"](self, *given)
        return
    cwd = os.path.abspath(os.fspath(o["cwd"]) if o["cwd"] is not None else os.getcwd())
    pipes = [o[k] for k in ("p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread", "errwrite")]
    if not os.path.isdir(cwd):  # as subprocess would
        self._close_pipe_fds(*pipes)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cwd)
    request = {
        **program,
        "argv": [os.fspath(a) for a in o["args"]],
        "cwd": cwd,
        "env": env,
        "new_session": bool(o["start_new_session"]),
    }
    ends = (o["p2cread"], o["c2pwrite"], o["errwrite"])  # the child's ends, -1: inherited
    started = server.start(request, [fd if fd != -1 else std for fd, std in zip(ends, (0, 1, 2))])
    if started is None:
        _ORIGINAL["_execute_child"](self, *given)
        return
    self._warm_conn, self.pid = started
    self._child_created = True
    self._close_pipe_fds(*pipes)


def _try_wait(self: Any, wait_flags: int) -> tuple[int, int]:
    """``subprocess.Popen._try_wait``: a warm child's status comes from its server."""
    conn = getattr(self, "_warm_conn", None)
    if conn is None:
        return _ORIGINAL["_try_wait"](self, wait_flags)
    if wait_flags & os.WNOHANG and not select.select([conn], [], [], 0)[0]:
        return 0, 0
    try:
        status = int(_read_line(conn).split()[1])
    except OSError:  # the server ended first: the child was not waited for
        status = 255 << 8
    conn.close()
    return self.pid, status


def _internal_poll(self: Any, _deadstate: Any = None, **kw: Any) -> int | None:
    """``subprocess.Popen._internal_poll`` (which ``poll()`` calls)."""
    conn = getattr(self, "_warm_conn", None)
    if conn is None:
        return _ORIGINAL["_internal_poll"](self, _deadstate, **kw)
    if self.returncode is None and self._waitpid_lock.acquire(False):
        try:
            if self.returncode is None and conn.fileno() != -1:
                pid, status = _try_wait(self, os.WNOHANG)
                if pid == self.pid:
                    self._handle_exitstatus(status)
        finally:
            self._waitpid_lock.release()
    return self.returncode


class Popen(subprocess.Popen):
    """``subprocess.Popen``, with a Python command forked from a warm server."""

    _execute_child = _execute_child
    _try_wait = _try_wait
    _internal_poll = _internal_poll


def run(*popenargs: Any, input: Any = None, capture_output: bool = False,
        timeout: float | None = None, check: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess:  # fmt: skip
    """``subprocess.run`` with ``warm.Popen``."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(*popenargs, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        code = process.poll()
    assert code is not None
    if check and code:
        raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, code, stdout, stderr)


# -- the server's side ----------------------------------------------------------------------------
def _preload(modules: list[str]) -> bytes:
    """Import ``modules``; what the imports wrote to stdout and stderr."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            for name in modules:
                with contextlib.suppress(ImportError):
                    __import__(name)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        return out.read()


class _Serving:
    """The server's state: the socket it listens on, and its children still running, each with
    the connection its exit status goes back on."""

    def __init__(self, address: str, key: tuple, set_at_import: dict[str, str]) -> None:
        self.address = address
        self.key = key
        self.set_at_import = set_at_import
        # what the preloaded modules imported (and the interpreter's start), by top-level name
        self.imported = {name.partition(".")[0] for name in sys.modules}
        self.registry = os.path.join(os.path.dirname(address), "children")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(address)
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.running: dict[int, socket.socket] = {}

    def reap(self) -> None:
        while self.running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.running.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"exit {status}\n".encode())
                conn.close()

    def shadowed(self, request: dict) -> bool:
        """Whether a folder the child puts before the preloaded modules on ``sys.path`` (its
        ``sys.path[0]``, its PYTHONPATH) holds a module they imported, or PYTHONPATH a
        sitecustomize: imported afresh, the child would get another, or run it."""
        pythonpath = set(_pythonpath(request["env"], request["cwd"]))
        for folder in pythonpath | {_first_path(request) or request["cwd"]}:
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                stem = name.partition(".")[0]
                if stem in self.imported or (
                    folder in pythonpath and stem in ("sitecustomize", "usercustomize")
                ):
                    return True
        return False

    def fork(self, conn: socket.socket) -> dict | None:
        """Fork the child ``conn`` asks for; in the child, its request."""
        fds = reduction.recvfds(conn, 3)
        request = json.loads(_read_exactly(conn, int.from_bytes(_read_exactly(conn, 8), "big")))
        env = {k: v for k, v in request["env"].items() if k not in self.set_at_import}
        if _key(env) != self.key or self.shadowed(request):  # the caller starts it itself
            conn.sendall(b"fallback\n")
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        asker = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            conn.close()
            for other in self.running.values():
                other.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd, target in zip(fds, (0, 1, 2)):
                os.dup2(fd, target)
            for fd in set(fds):
                if fd > 2:
                    os.close(fd)
            if request["new_session"]:
                os.setsid()
            request["server"] = self.address
            request["set_at_import"] = self.set_at_import
            return request
        for fd in fds:
            os.close(fd)
        with open(self.registry, "a") as f:  # one line, written whole before the pid goes back
            f.write(json.dumps({"pid": pid, "parent": asker, "argv": request["argv"]}) + "\n")
        conn.sendall(f"pid {pid}\n".encode())
        self.running[pid] = conn
        return None


def _serve(address: str, modules: list[str]) -> dict:
    """Fork a child per request until the process that started this one ends; in a child,
    return its request."""
    before = dict(os.environ)
    assert "PYTHONPATH" not in before  # (_Server starts it without: each child has its own)
    del sys.path[0]  # this file's folder: nothing is imported from there
    said = _preload(modules)
    set_at_import = {k: v for k, v in os.environ.items() if before.get(k) != v}
    parent = os.getppid()
    state = _Serving(address, _key(before), set_at_import)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    while True:
        readable = select.select([state.listener, state.wake_r], [], [], 1.0)[0]
        if os.getppid() != parent:
            sys.exit(0)
        if state.wake_r in readable:
            os.read(state.wake_r, 512)
        state.reap()
        if state.listener in readable:
            conn, _ = state.listener.accept()
            request = state.fork(conn)
            if request is not None:
                if said:
                    os.write(2, said)
                return request


def _main_module(file: str | None) -> dict:
    """A fresh ``__main__`` module in ``sys.modules``; its namespace."""
    import builtins
    import types

    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    if file is not None:
        module.__file__ = file
        module.__dict__["__cached__"] = None
    sys.modules["__main__"] = module
    return module.__dict__


def _become(request: dict) -> None:
    """Set this forked server up as the interpreter ``request`` describes, and run it."""
    import runpy

    os.chdir(request["cwd"])
    if "multiprocessing.process" in sys.modules:  # what it read when imported
        process = sys.modules["multiprocessing.process"]
        process.ORIGINAL_DIR = os.path.abspath(request["cwd"])  # (a spawn finds __main__ there)
        process.current_process().authkey = os.urandom(32)
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR is read again
    global _parent_server
    _parent_server = _Server(None, request["server"])  # its own Python children: warm too
    for name in _ORIGINAL:
        setattr(subprocess.Popen, name, globals()[name])
    for name, value in request["set_at_import"].items():  # as the imports would have
        os.environ.setdefault(name, value)
    if _CACHE_DIR in sys.modules:  # torchvision's import made it, in TMPDIR unless told
        if "TORCHINDUCTOR_CACHE_DIR" not in request["env"]:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        sys.modules[_CACHE_DIR].cache_dir()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "-u" in request["flags"]:
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
    if "-B" in request["flags"]:
        sys.dont_write_bytecode = True
    if "-Xfaulthandler" in request["flags"]:
        import faulthandler

        faulthandler.enable()
    kind, target, args = request["kind"], request["target"], request["args"]
    first = [] if os.environ.get("PYTHONSAFEPATH") else [_first_path(request)]
    sys.path[:] = [*first, *_once([*_pythonpath(request["env"], request["cwd"]), *sys.path])]
    if kind == "-m":
        sys.argv = ["-m", *args]  # runpy puts the module's file first
        _main_module(None)
        runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
    elif kind == "-c":
        sys.argv = ["-c", *args]
        namespace = _main_module(None)
        exec(compile(target, "<string>", "exec"), namespace)
    else:
        sys.argv = [target, *args]
        file = os.path.abspath(target) if sys.version_info >= (3, 9) else target
        namespace = _main_module(file)
        with open(target, "rb") as f:
            code = compile(f.read(), file, "exec")
        exec(code, namespace)


def _child_main(request: dict) -> None:
    """Run the child's program; exit as ``python`` would."""
    import traceback

    if hasattr(sys, "orig_argv"):
        sys.orig_argv = [sys.executable, *request["flags"], request["target"], *request["args"]]
    try:
        _become(request)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        atexit._run_exitfuncs()
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        kind, value, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # the program's frames, not this file's
        assert kind is not None and value is not None
        sys.excepthook(kind, value.with_traceback(tb), tb)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _child_main(_serve(sys.argv[2], sys.argv[3:]))
