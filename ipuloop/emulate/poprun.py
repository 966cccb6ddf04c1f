"""``python -m ipuloop.emulate.poprun [POPRUN OPTIONS] COMMAND [ARGS...]``: poprun's command line
on one host, each instance of COMMAND running on the emulator (as ``python -m ipuloop.emulate``
runs a program) with the environment poprun gives it, all joining one ``torch.distributed`` group.

    python -m ipuloop.emulate.poprun --num-instances 2 --num-replicas 4 python train.py --epochs 1

Options used: ``--num-instances`` (default 1), ``--num-replicas`` (default: the instances; a
multiple of them), ``--ipus-per-replica`` (default 1), ``--only-output-from-instance I``,
``--executable-cache-path`` (``POPTORCH_CACHE_DIR``), ``--print-topology``, and in
``--mpi-global-args``/``--mpi-local-args`` mpirun's ``-x NAME[=VALUE]`` (the others there are
network settings, ignored). Taken and ignored, as they only place a run on a Pod: the V-IPU
options (``--vipu-*``, ``--reset-partition``, ``--update-partition``, ``--remove-partition``),
``--sync-type``, ``--numa-aware``, ``--num-ilds 1``, ``--host`` naming this host,
``-v``/``--vv``. Refused by name: other hosts, several ILDs, ``--offline-mode``, any other.

Instance i of N, with R replicas of P IPUs, gets (L = R / N its replicas):
``POPDIST_NUM_TOTAL_REPLICAS=R``, ``POPDIST_NUM_LOCAL_REPLICAS=L``,
``POPDIST_NUM_IPUS_PER_REPLICA=P``, ``POPDIST_REPLICA_INDEX_OFFSET=i*L``,
``POPDIST_LOCAL_INSTANCE_INDEX=i``, ``POPDIST_UNIFORM_REPLICAS_PER_INSTANCE=1``, mpirun's
``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``, and for the process group torchrun's
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (127.0.0.1)
and ``MASTER_PORT`` (a free port, unless set), where the launcher serves the group's store
as torchrun's agent does. The emulated system has
``IPULOOP_EMULATOR_IPUS`` IPUs (16 unless set), at least R*P.

A COMMAND starting with ``python`` runs this interpreter with ``-m ipuloop.emulate``; another
runs as it is, with the emulator bound in the Python processes it starts. Each output line is
tagged ``[1,i]<stdout>:`` (or ``<stderr>``), as poprun's mpirun tags it. When an instance
fails, the others are ended (SIGTERM, then SIGKILL after ``KILL_AFTER_S``) and the launcher
exits with the failing instance's status, naming it: the one that left the run's first
failure in the store (``rules.tell_launcher``: a ``Loop``, or any program ``emulate`` runs),
else the first to exit with an error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

from ..rules import LAUNCHER_FAILURE_KEY
from . import BINDING

__all__ = ["Topology", "instance_env", "main", "parse"]

# the folder that holds the ipuloop package (this file is ipuloop/emulate/poprun.py)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRACE_S = 1.0  # after an instance fails, the others' time to end by themselves
KILL_AFTER_S = 5.0  # then SIGTERM, and this long before SIGKILL
DEFAULT_IPUS = 16

# poprun options that take a value and place a run on a Pod: taken, not used here
_IGNORED = {
    "--vipu-server-host",
    "--vipu-server-port",
    "--vipu-server-timeout",
    "--vipu-partition",
    "--vipu-allocation",
    "--vipu-cluster",
    "--reset-partition",
    "--update-partition",
    "--remove-partition",
    "--sync-type",
    "--numa-aware",
    "--host-subnet",
    "--network-interface",
}
_FLAGS = {"-v", "-vv", "--vv", "--verbose"}
_YES_NO = {"yes", "no", "true", "false", "on", "off", "1", "0"}
_USED = {
    "--num-instances",
    "--num-replicas",
    "--ipus-per-replica",
    "--num-ilds",
    "--host",
    "-H",
    "--only-output-from-instance",
    "--executable-cache-path",
    "--print-topology",
    "--mpi-global-args",
    "--mpi-local-args",
}
_REFUSED = {
    "--offline-mode": "compiles for IPUs without using them; the emulator has none to compile for",
    "--process-placement": "places instances on the hosts of a Pod; here they all run on this one",
}


class UsageError(Exception):
    """A command line this launcher cannot run, and why."""


@dataclass
class Topology:
    """What the command line asks for."""

    instances: int = 1
    replicas: int = 0  # 0: as many as the instances
    ipus_per_replica: int = 1
    only_output_from: int | None = None
    print_topology: bool = False
    exports: dict[str, str] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)

    @property
    def local_replicas(self) -> int:
        return self.replicas // self.instances


def _positive(option: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise UsageError(f"{option} takes a positive integer; got {value!r}")
    return number


def _this_host(host: str) -> bool:
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    return host.split(":")[0] in names


def _mpi_args(option: str, text: str, exports: dict[str, str]) -> None:
    """mpirun's ``-x NAME[=VALUE]`` exported; its network settings (``--mca``, ``--bind-to``,
    ``--tag-output``, ...) ignored."""
    words = text.split()
    i = 0
    while i < len(words):
        word = words[i]
        if word == "-x" and i + 1 < len(words):
            name, eq, value = words[i + 1].partition("=")
            exports[name] = value if eq else os.environ.get(name, "")
            i += 2
        elif word == "--mca" and i + 2 < len(words):
            i += 3
        elif word.startswith("-"):  # an mpirun setting, with its value if it has one
            i += 2 if i + 1 < len(words) and not words[i + 1].startswith("-") else 1
        else:
            raise UsageError(
                f"{option} {text!r}: {word!r} is no mpirun option this launcher reads "
                "(it takes -x NAME[=VALUE], and ignores the network settings)"
            )


def parse(argv: list[str]) -> Topology:
    """poprun's command line: its options, then the command."""
    top = Topology()
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        option, eq, value = argv[i].partition("=")
        i += 1
        if option in _FLAGS:
            continue
        if option in _REFUSED:
            raise UsageError(f"poprun's {option} is not supported: it {_REFUSED[option]}.")
        if option not in _USED and option not in _IGNORED:
            raise UsageError(
                f"poprun's {option} is not supported by ipuloop's poprun, which runs every "
                "instance on this host on the emulator (python -m ipuloop.emulate.poprun --help)."
            )
        if not eq:
            if option in ("--print-topology", "--numa-aware") and (
                i >= len(argv) or argv[i].lower() not in _YES_NO
            ):
                value = "yes"  # given bare
            elif i < len(argv):
                value = argv[i]
                i += 1
            else:
                raise UsageError(f"{option} needs a value")
        if option == "--num-instances":
            top.instances = _positive(option, value)
        elif option == "--num-replicas":
            top.replicas = _positive(option, value)
        elif option == "--ipus-per-replica":
            top.ipus_per_replica = _positive(option, value)
        elif option == "--num-ilds" and _positive(option, value) > 1:
            raise UsageError(
                f"--num-ilds {value}: several IPU-Link domains are several Pods' hosts; "
                "ipuloop's poprun runs the instances on this host only (use --num-ilds 1)."
            )
        elif option in ("--host", "-H"):
            others = [h for h in value.split(",") if h and not _this_host(h)]
            if others:
                raise UsageError(
                    f"{option} {value}: ipuloop's poprun runs every instance on this host, "
                    f"not on {', '.join(others)}."
                )
        elif option == "--only-output-from-instance":
            top.only_output_from = int(value)
        elif option == "--executable-cache-path":
            top.exports["POPTORCH_CACHE_DIR"] = value
        elif option == "--print-topology":
            top.print_topology = value.lower() in ("yes", "true", "on", "1")
        elif option in ("--mpi-global-args", "--mpi-local-args"):
            _mpi_args(option, value, top.exports)
    top.command = argv[i:]
    if not top.command:
        raise UsageError("no command to run (poprun [OPTIONS] COMMAND [ARGS...])")
    if not top.replicas:
        top.replicas = top.instances
    if top.replicas % top.instances:
        raise UsageError(
            f"--num-replicas {top.replicas} is not a multiple of --num-instances "
            f"{top.instances}: poprun gives every instance as many replicas."
        )
    if top.only_output_from is not None and not 0 <= top.only_output_from < top.instances:
        raise UsageError(
            f"--only-output-from-instance {top.only_output_from}: the instances are "
            f"0..{top.instances - 1}"
        )
    return top


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_ipus(top: Topology, env: dict[str, str]) -> int:
    """The emulated system's IPUs: ``IPULOOP_EMULATOR_IPUS`` (16 unless set), at least
    replicas x IPUs per replica."""
    given = env.get("IPULOOP_EMULATOR_IPUS", "")
    ipus = int(given) if given.isdigit() else DEFAULT_IPUS
    return max(ipus, top.replicas * top.ipus_per_replica)


def instance_env(top: Topology, index: int, base: dict[str, str], port: int) -> dict[str, str]:
    """Instance ``index``'s environment: ``base`` with poprun's, mpirun's and the process
    group's variables."""
    n, local = top.instances, top.local_replicas
    env = dict(base)
    env.update(top.exports)
    env.update(
        POPDIST_NUM_TOTAL_REPLICAS=str(top.replicas),
        POPDIST_NUM_LOCAL_REPLICAS=str(local),
        POPDIST_NUM_IPUS_PER_REPLICA=str(top.ipus_per_replica),
        POPDIST_REPLICA_INDEX_OFFSET=str(index * local),
        POPDIST_LOCAL_INSTANCE_INDEX=str(index),
        POPDIST_UNIFORM_REPLICAS_PER_INSTANCE="1",
        OMPI_COMM_WORLD_RANK=str(index),
        OMPI_COMM_WORLD_SIZE=str(n),
        OMPI_COMM_WORLD_LOCAL_RANK=str(index),
        OMPI_COMM_WORLD_LOCAL_SIZE=str(n),
        RANK=str(index),
        WORLD_SIZE=str(n),
        LOCAL_RANK=str(index),
        LOCAL_WORLD_SIZE=str(n),
        MASTER_ADDR=base.get("MASTER_ADDR") or "127.0.0.1",
        MASTER_PORT=str(port),
        IPULOOP_EMULATOR_IPUS=str(system_ipus(top, base)),
        IPULOOP_BACKEND="emulator",
    )
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [BINDING, *[p for p in paths if p != BINDING]]
    if ROOT not in paths:
        paths.append(ROOT)  # ipuloop itself, where it is not installed
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")


def command_line(top: Topology) -> list[str]:
    """The command each instance runs: ``python [FLAGS] SCRIPT|-m MODULE ...`` as this
    interpreter running it on the emulator; any other command as it is."""
    cmd = list(top.command)
    if not _PYTHON.match(os.path.basename(cmd[0])):
        return cmd
    flags, rest = [], cmd[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        if rest[0] == "-c":
            raise UsageError(
                "python -c is not run on the emulator: put the code in a script, or run "
                "python -m ipuloop.emulate yourself as the command"
            )
        flags.append(rest.pop(0))
    return [sys.executable, *flags, "-m", "ipuloop.emulate", *rest]


class _Instance:
    """One started instance, its output copied line by line with poprun's tag."""

    def __init__(self, index: int, cmd: list[str], env: dict[str, str], *, shown: bool) -> None:
        self.index = index
        self.shown = shown
        self.tail: deque[str] = deque(maxlen=20)  # its last lines of stderr, when not shown
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: loader workers end with it
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.readers = [
            threading.Thread(target=self._copy, args=(self.proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._copy, args=(self.proc.stderr, "stderr"), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _copy(self, pipe: IO[bytes], name: str) -> None:
        out = sys.stdout if name == "stdout" else sys.stderr
        tag = f"[1,{self.index}]<{name}>:"
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if self.shown:
                out.write(f"{tag}{line}\n")
                out.flush()
            elif name == "stderr":
                self.tail.append(f"{tag}{line}")
        pipe.close()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _print_topology(top: Topology) -> None:
    for i in range(top.instances):
        first = i * top.local_replicas
        print(
            f"poprun: instance {i}: replicas {first}..{first + top.local_replicas - 1}, "
            f"{top.ipus_per_replica} IPU(s) each, on this host",
            file=sys.stderr,
        )


def _host_store(port: int, instances: int) -> Any:
    """The process group's key-value store, served by the launcher at 127.0.0.1:``port`` as
    torchrun's agent serves it: it outlives every instance, so none loses it while leaving
    the group at exit (instance 0 serving it, the others could). None without
    torch.distributed, or with the port taken (instance 0 then serves one)."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return None
        return dist.TCPStore(
            "127.0.0.1",
            port,
            instances,
            is_master=True,
            timeout=datetime.timedelta(seconds=3600),
            wait_for_workers=False,
        )
    except Exception:  # noqa: BLE001 (the instances then make their own)
        return None


def first_failure(store: Any) -> tuple[int, str] | None:
    """(instance, its error) that an instance left in ``store`` as the run's first failure
    (``rules.tell_launcher``), or None."""
    if store is None:
        return None
    try:
        store.wait([LAUNCHER_FAILURE_KEY], datetime.timedelta(milliseconds=100))
        told = json.loads(store.get(LAUNCHER_FAILURE_KEY))
        return int(told["instance"]), str(told.get("error") or "")
    except Exception:  # noqa: BLE001 (none there: the exits decide)
        return None


def run(top: Topology, env: dict[str, str] | None = None) -> int:
    """Start the instances and wait for them: 0 when all succeed, else the failing
    instance's status (the first to fail, as it left in the store, else the first to exit
    with an error), the others ended."""
    base = dict(os.environ if env is None else env)
    port = int(base["MASTER_PORT"]) if base.get("MASTER_PORT", "").isdigit() else _free_port()
    store = None
    if top.instances > 1 and base.get("MASTER_ADDR", "127.0.0.1") == "127.0.0.1":
        store = _host_store(port, top.instances)
    if store is not None:  # the instances' env:// rendezvous uses it, as under torchrun
        base.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    cmd = command_line(top)
    if top.print_topology:
        _print_topology(top)
    instances: list[_Instance] = []
    received: list[int] = []

    def forward(sig: int, frame: FrameType | None) -> None:
        received.append(sig)
        for inst in instances:
            inst.signal(sig)

    def announce(observed: _Instance) -> _Instance:
        """Say which instance failed (the store's first failure, else ``observed``)."""
        told = first_failure(store)
        failed = instances[told[0]] if told and 0 <= told[0] < len(instances) else observed
        code = failed.proc.poll()
        what = _status(code) if code is not None else "is ending"
        error = f" with {told[1][:300]}" if told else ""
        for line in failed.tail:
            print(line, file=sys.stderr)
        print(
            f"poprun: instance {failed.index} of {top.instances} (PID {failed.proc.pid}) "
            f"failed{error} and {what}: ending the other instances.",
            file=sys.stderr,
            flush=True,
        )
        return failed

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    observed: _Instance | None = None  # the first seen to exit with an error
    failed: _Instance | None = None  # the one announced as failing
    try:
        for i in range(top.instances):
            shown = top.only_output_from is None or top.only_output_from == i
            instances.append(_Instance(i, cmd, instance_env(top, i, base, port), shown=shown))
        ending_at: float | None = None
        killed = False
        while any(inst.proc.poll() is None for inst in instances):
            if observed is None and not received:  # (a signal passed on ends them all)
                observed = next((i for i in instances if i.proc.poll() not in (None, 0)), None)
                if observed is not None:  # the others' time to end, the failing one to tell
                    ending_at = time.monotonic() + GRACE_S
            now = time.monotonic()
            if ending_at is not None and now >= ending_at:
                if failed is None and observed is not None:
                    failed = announce(observed)
                for inst in instances:
                    if inst.proc.poll() is None:
                        inst.signal(signal.SIGKILL if killed else signal.SIGTERM)
                ending_at, killed = (now + KILL_AFTER_S, True) if not killed else (None, True)
            time.sleep(0.05)
        if observed is None and not received:
            observed = next((i for i in instances if i.proc.returncode != 0), None)
        if failed is None and observed is not None:
            failed = announce(observed)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for inst in instances:
            if inst.proc.poll() is None:
                inst.signal(signal.SIGKILL)
                inst.proc.wait()
            for reader in inst.readers:
                reader.join(timeout=5)
    store = None  # served until every instance had ended
    if failed is None:
        return 128 + received[0] if received else 0
    code = failed.proc.returncode or (observed.proc.returncode if observed else 1) or 1
    return 128 - code if code < 0 else code


PROG = "python -m ipuloop.emulate.poprun"


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=78, break_on_hyphens=False, break_long_words=False)


def parser() -> argparse.ArgumentParser:
    """The command line as ``--help`` shows it (``parse`` reads it: poprun's options, up to
    COMMAND, whose arguments are its own)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [-h] [OPTIONS] COMMAND [ARGS ...]",
        description=_wrap(
            "poprun's command line on this host: COMMAND runs as --num-instances instances, "
            "each on ipuloop's emulator with the environment poprun gives it (POPDIST_*, "
            "mpirun's OMPI_COMM_WORLD_*, torchrun's RANK/WORLD_SIZE/MASTER_*), all in one "
            "torch.distributed group. Each output line is tagged [1,i]<stdout>: as poprun's "
            "mpirun tags it; when an instance fails, the others are ended and the launcher "
            "exits with its status, naming it."
        ),
        epilog=f"example: {PROG} --num-instances 2 --num-replicas 4 python train.py --epochs 1\n\n"
        + _wrap(
            "Taken and ignored (they place a run on a Pod): --vipu-*, --reset-partition, "
            "--update-partition, --remove-partition, --sync-type, --numa-aware, "
            "--host-subnet, --network-interface, -v/--vv. Refused by name: other hosts, "
            "several ILDs, --offline-mode, --process-placement."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--num-instances", metavar="N", help="instances of COMMAND (default: 1)")
    p.add_argument(
        "--num-replicas",
        metavar="R",
        help="replicas of all instances together, a multiple of N (default: N, one each)",
    )
    p.add_argument("--ipus-per-replica", metavar="P", help="IPUs each replica uses (default: 1)")
    p.add_argument(
        "--only-output-from-instance",
        metavar="I",
        help="show only instance I's output; the others' last error lines are shown when "
        "they fail (default: every instance's)",
    )
    p.add_argument(
        "--executable-cache-path",
        metavar="DIR",
        help="PopTorch's executable cache, POPTORCH_CACHE_DIR (default: none)",
    )
    p.add_argument(
        "--print-topology",
        metavar="yes|no",
        nargs="?",
        help="print each instance's replicas and IPUs first (default: no; bare: yes)",
    )
    p.add_argument(
        "--mpi-global-args",
        metavar="ARGS",
        help="mpirun's arguments: -x NAME[=VALUE] exports NAME to the instances, the network "
        "settings are ignored (default: none)",
    )
    p.add_argument("--mpi-local-args", metavar="ARGS", help="as --mpi-global-args (default: none)")
    p.add_argument("--num-ilds", metavar="1", help="IPU-Link domains: 1, this host's (default: 1)")
    p.add_argument(
        "--host",
        "-H",
        metavar="HOSTS",
        help="the hosts, which must name this one (default: this host)",
    )
    p.add_argument(
        "command",
        metavar="COMMAND",
        help="the program: one starting with python runs on the emulator as "
        "`python -m ipuloop.emulate` runs it; another runs as it is, with the emulator bound "
        "in the Python processes it starts",
    )
    p.add_argument(
        "args", metavar="ARGS", nargs="*", help="COMMAND's arguments, passed to it untouched"
    )
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        parser().print_help()
        raise SystemExit(0)
    try:
        top = parse(argv)
    except UsageError as e:
        parser().error(str(e))  # the usage line and "PROG: error: ..." on stderr, status 2
    raise SystemExit(run(top))


if __name__ == "__main__":
    main()
