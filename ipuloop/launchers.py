"""A run's launcher, read from its environment: which instance this process is, of how many.

torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_*``, mpirun's ``OMPI_COMM_WORLD_RANK``/
``OMPI_COMM_WORLD_SIZE`` and poprun's ``POPDIST_*`` (``detect``); the options' process id and
count, and poprun's replicas per instance, settled against them (``instance_of``); the
torch.distributed process group joined (``init_group``). ``processes.py`` holds what the
instances then do together.
"""

from __future__ import annotations

import atexit
import datetime
import os
import warnings
from dataclasses import dataclass
from typing import Mapping

from .group_teardown import leave_process_group
from .poptorch_types import Options
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
    "instance_of",
    "init_group",
    "configured",
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


def init_group(rank: int, size: int) -> None:
    """Join the default process group, creating it (gloo) when nobody has."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(
            "Several processes need torch.distributed, which this torch build lacks."
        )
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, size):
            raise ValueError(
                f"The torch.distributed process group has rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the options say process {rank} of {size}: "
                "initialise the group with the launcher's rank and world size."
            )
        return
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT", "29500")
    # env:// where the launcher set MASTER_*: under torchrun it joins the launcher's own store
    launched = "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
    method = "env://" if launched else f"tcp://{addr}:{port}"
    seconds = timeout_seconds()
    try:
        dist.init_process_group(
            "gloo",
            init_method=method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=seconds),
        )
    except Exception as e:
        raise RuntimeError(
            f"Instance {rank} of {size} could not join the other instances at "
            f"{addr}:{port} within {seconds:g} s ({type(e).__name__}: {e}). Set MASTER_ADDR and "
            f"MASTER_PORT to the same address on every instance (torchrun does), and "
            f"{TIMEOUT_ENV} to wait longer."
        ) from e
    atexit.register(leave_process_group)


def instance_of(
    opts: Options, inference_opts: Options | None, *, replicas_given: bool
) -> tuple[int, int, str] | None:
    """This process's instance index, the instance count and who started them, or None when it
    runs alone; the options (and the ``inference_opts`` given, if any) then hold the process id
    and count, and the process group is joined."""
    launch = detect()
    procs = opts.Distributed.numProcesses
    if procs > 1:  # set by the program (configureProcessId) or read by Options (mpirun)
        rank = opts.Distributed.processId
        size = procs
        launcher = launch.launcher if launch else "the options"
        if launch is not None and (launch.rank, launch.size) != (rank, size):
            raise ValueError(
                f"The options say process {rank} of {size}, but {launch.launcher} started "
                f"instance {launch.rank} of {launch.size}. Leave opts.Distributed unset: the "
                "loop reads the launcher's environment."
            )
    elif launch is None:
        return None
    else:
        rank = launch.rank
        size = launch.size
        launcher = launch.launcher
        opts.Distributed.configureProcessId(rank, size)
    if launch is not None and launch.local_replicas is not None:  # poprun: replicas per instance
        if opts.replication_factor == 1 and not replicas_given:
            opts.replicationFactor(launch.local_replicas)
        elif opts.replication_factor != launch.local_replicas:
            raise ValueError(
                f"poprun gives each instance {launch.local_replicas} replica(s), but the loop "
                f"has replicationFactor {opts.replication_factor}. Leave replicas= unset under "
                "poprun (its --num-replicas / --num-instances decide), or pass the same number."
            )
    if launch is not None and launch.launcher == "poprun":
        check_popdist_options(opts)
    if inference_opts is not None and inference_opts.Distributed.numProcesses == 1:
        inference_opts.Distributed.configureProcessId(rank, size)
    init_group(rank, size)
    return rank, size, launcher


def check_popdist_options(opts: Options) -> None:
    """On an IPU system, PopDist's options also pick the instance's IPUs: say so when the
    program built plain ones (the loop has set their process id and replicas)."""
    try:
        import popdist.poptorch
    except ImportError:  # no Poplar SDK: nothing but the environment to go by
        return
    popdist_options = getattr(popdist.poptorch, "Options", None)
    if isinstance(popdist_options, type) and not isinstance(opts, popdist_options):
        warnings.warn(
            "Running under poprun with options that are not popdist.poptorch.Options: "
            "the loop set their process id and local replicas from PopDist, but "
            "PopDist's own options also select this instance's IPUs. Build them with "
            "popdist.poptorch.Options(ipus_per_replica=...) and pass those to Loop.",
            stacklevel=4,
        )


def configured(opts: Options) -> Options:
    """``opts`` with the launcher's process id and count, when a launcher started us."""
    launch = detect()
    if launch is None or opts.Distributed.numProcesses > 1:
        return opts
    opts = opts.clone()
    opts.Distributed.configureProcessId(launch.rank, launch.size)
    return opts
