"""Starting a test's script as several processes under torchrun, or as one, in an environment
free of the launcher variables of the process that runs the tests."""

from __future__ import annotations

import os
import random
import socket
import sys
from pathlib import Path

__all__ = ["LAUNCHER_VARS", "ROOT", "clean_env", "command", "free_port"]

ROOT = Path(__file__).resolve().parents[2]
# What torchrun and mpirun set (poprun's POPDIST_* too): a test's processes get their own.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
)


def free_port() -> int:
    """A TCP port free on this host now, for a process group's store: one the system picks,
    or with ``IPULOOP_TEST_PORTS="LO-HI"`` one drawn from that range, so that test runs side
    by side (CI's two suites) never pick the same port between its check and its use."""
    span = os.environ.get("IPULOOP_TEST_PORTS")
    if not span:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low, high = map(int, span.split("-"))
    draw = random.Random()  # seeded from the system: runs side by side draw differently
    for _ in range(100):
        port = draw.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: draw again
                continue
        return port
    raise RuntimeError(f"no free port in IPULOOP_TEST_PORTS={span!r} after 100 draws")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, with this checkout's ipuloop
    first on the path, one torch thread and the emulator; ``extra`` on top."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith("POPDIST_")
    }
    path = [str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", IPULOOP_BACKEND="emulator")
    env.update(extra)
    return env


def command(script: str | Path, *args: str, processes: int = 2) -> list[str]:
    """``python script args``; with more than one process, under torchrun on this host."""
    cmd = [sys.executable, str(script), *args]
    if processes > 1:
        cmd[1:1] = [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={processes}",
            f"--master_port={free_port()}",
            "--monitor_interval=0.5",
        ]
    return cmd
