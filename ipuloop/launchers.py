"""A run's launcher, read from its environment: which instance this process is, of how many.

torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_*``, mpirun's ``OMPI_COMM_WORLD_RANK``/
``OMPI_COMM_WORLD_SIZE`` and poprun's ``POPDIST_*`` (``detect``); the instance index and
count a program or a callback asks for. ``processes.py`` settles the options against them,
joins the process group and holds what the instances then do together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .rules import DEFAULT_DIST_TIMEOUT, DIST_TIMEOUT_ENV, dist_timeout

__all__ = [
    "Launch",
    "detect",
    "process_index",
    "num_processes",
    "is_main_process",
    "timeout_seconds",
    "TIMEOUT_ENV",
    "DEFAULT_TIMEOUT",
]

TIMEOUT_ENV = DIST_TIMEOUT_ENV
DEFAULT_TIMEOUT = DEFAULT_DIST_TIMEOUT


@dataclass(frozen=True)
class Launch:
    """What the launcher says about this process."""

    rank: int  # instance index, 0 .. size - 1
    size: int  # instances
    local_rank: int  # index on this host
    launcher: str  # "torchrun", "mpirun" or "poprun"
    local_replicas: int | None = None  # poprun: replicas per instance


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{name}={value!r}: the launcher's environment must hold an integer there."
        ) from None


def detect(env: Mapping[str, str] | None = None) -> Launch | None:
    """The launcher's view of this process, or None when it runs alone."""
    env = os.environ if env is None else env
    launch = None
    if "POPDIST_NUM_TOTAL_REPLICAS" in env or "POPDIST_NUM_INSTANCES" in env:
        launch = _popdist(env)
    elif "RANK" in env and "WORLD_SIZE" in env:
        launch = Launch(
            rank=_int(env, "RANK"),
            size=_int(env, "WORLD_SIZE"),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            launcher="torchrun",
        )
    elif "OMPI_COMM_WORLD_SIZE" in env and "OMPI_COMM_WORLD_RANK" in env:
        launch = Launch(
            rank=_int(env, "OMPI_COMM_WORLD_RANK"),
            size=_int(env, "OMPI_COMM_WORLD_SIZE"),
            local_rank=int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
            launcher="mpirun",
        )
    if launch is None or launch.size <= 1:
        return None
    if not 0 <= launch.rank < launch.size:
        raise ValueError(
            f"The {launch.launcher} environment gives instance index {launch.rank} "
            f"of {launch.size} instances: the index must be in [0, {launch.size})."
        )
    return launch


def _popdist(env: Mapping[str, str]) -> Launch:
    try:  # on an IPU system: PopDist's own reading of poprun's environment
        import popdist

        if popdist.isPopdistEnvSet():
            return Launch(
                rank=int(popdist.getInstanceIndex()),
                size=int(popdist.getNumInstances()),
                local_rank=int(popdist.getLocalInstanceIndex()),
                launcher="poprun",
                local_replicas=int(popdist.getNumLocalReplicas()),
            )
    except ImportError:
        pass
    local = int(env.get("POPDIST_NUM_LOCAL_REPLICAS", "1"))
    if "POPDIST_NUM_INSTANCES" in env:
        size = _int(env, "POPDIST_NUM_INSTANCES")
    else:
        size = _int(env, "POPDIST_NUM_TOTAL_REPLICAS") // max(local, 1)
    if "POPDIST_INSTANCE_INDEX" in env:
        rank = _int(env, "POPDIST_INSTANCE_INDEX")
    else:
        rank = int(env.get("POPDIST_REPLICA_INDEX_OFFSET", "0")) // max(local, 1)
    return Launch(
        rank=rank,
        size=size,
        local_rank=int(env.get("POPDIST_LOCAL_INSTANCE_INDEX", "0")),
        launcher="poprun",
        local_replicas=local,
    )


def timeout_seconds(env: Mapping[str, str] | None = None) -> float:
    """``IPULOOP_DIST_TIMEOUT``: seconds a collective waits for the other instances."""
    return dist_timeout(env)


def _group_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def process_index() -> int:
    """This instance's index (0 when the process runs alone)."""
    if _group_ready():
        import torch.distributed as dist

        return dist.get_rank()
    launch = detect()
    return launch.rank if launch else 0


def num_processes() -> int:
    """The number of instances (1 when the process runs alone)."""
    if _group_ready():
        import torch.distributed as dist

        return dist.get_world_size()
    launch = detect()
    return launch.size if launch else 1


def is_main_process() -> bool:
    """True on instance 0: the one that prints, logs and writes checkpoints."""
    return process_index() == 0
