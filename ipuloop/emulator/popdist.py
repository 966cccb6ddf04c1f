"""PopDist's Python API (``import popdist``, ``popdist.poptorch.Options``) as PopDist 3.4 answers
it, read from the environment poprun gives each instance.

poprun starts its instances through mpirun with, besides mpirun's ``OMPI_COMM_WORLD_*``:

    POPDIST_NUM_TOTAL_REPLICAS     replicas of the whole run (--num-replicas)
    POPDIST_NUM_LOCAL_REPLICAS     replicas of this instance (total / instances)
    POPDIST_NUM_IPUS_PER_REPLICA   --ipus-per-replica
    POPDIST_REPLICA_INDEX_OFFSET   this instance's first global replica (index x local)
    POPDIST_LOCAL_INSTANCE_INDEX   this instance's index on its host
    POPDIST_UNIFORM_REPLICAS_PER_INSTANCE  1

Unset, every function answers for one process alone (1 replica, instance 0 of 1). With
uniform replicas per instance, as poprun gives them, the instance index is the replica offset
over the local replicas and the instance count the total over the local replicas; under a
plain mpirun (no POPDIST_*), mpirun's rank and size.

``init()`` joins the instances' ``torch.distributed`` group (gloo, created from the launcher's
environment; ``distributed.join_group``), which the host-side collectives (``horovod.py``) and
the gradient reduction of a training model share. ``execute_on_instances`` runs a function on
the instances named; collectives inside it reach only those instances when they are one.

``Options(ipus_per_replica=None)`` is ``poptorch.Options`` with the local replicas
(``replicationFactor``), the process id and count (``Distributed.configureProcessId``) and,
under poprun, the device id of this instance's IPUs (``useIpuId(getDeviceId(...))``) set.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

from .device import distributed
from .options import Options as _Options

__all__ = [
    "Options",
    "checkNumIpusPerReplica",
    "execute_on_instances",
    "finalizeBackend",
    "getDeviceId",
    "getInstanceIndex",
    "getLocalInstanceIndex",
    "getNumInstances",
    "getNumIpusPerReplica",
    "getNumLocalReplicas",
    "getNumTotalReplicas",
    "getReplicaIndexOffset",
    "init",
    "isInitialised",
    "isPopdistEnvSet",
    "isUniformReplicasPerInstance",
    "only_instances",
]

TOTAL = "POPDIST_NUM_TOTAL_REPLICAS"
LOCAL = "POPDIST_NUM_LOCAL_REPLICAS"
IPUS_PER_REPLICA = "POPDIST_NUM_IPUS_PER_REPLICA"
OFFSET = "POPDIST_REPLICA_INDEX_OFFSET"
LOCAL_INDEX = "POPDIST_LOCAL_INSTANCE_INDEX"
UNIFORM = "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE"
DEFAULT_IPUS = 16  # the emulated system's IPUs where IPULOOP_EMULATOR_IPUS is unset

_initialised = False
_only: frozenset[int] | None = None  # the instances execute_on_instances runs on, inside it


def _int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{name}={value!r}: poprun's environment must hold an integer there."
        ) from None


def isPopdistEnvSet() -> bool:
    """Whether poprun started this process (its POPDIST_* environment is set)."""
    return _int(TOTAL) is not None


def getNumTotalReplicas() -> int:
    """The replicas of the whole run (all instances); 1 when poprun did not start us."""
    return _int(TOTAL, 1) or 1


def getNumLocalReplicas() -> int:
    """This instance's replicas; 1 when poprun did not start us."""
    return _int(LOCAL, 1) or 1


def getNumIpusPerReplica() -> int:
    """The IPUs of one replica (poprun's --ipus-per-replica); 1 when unset."""
    return _int(IPUS_PER_REPLICA, 1) or 1


def checkNumIpusPerReplica(ipus: int) -> bool:
    """Whether ``ipus`` is poprun's IPUs per replica (True where poprun gave none)."""
    given = _int(IPUS_PER_REPLICA)
    return given is None or given == ipus


def getReplicaIndexOffset() -> int:
    """The global index of this instance's first replica; 0 when unset."""
    return _int(OFFSET, 0) or 0


def isUniformReplicasPerInstance() -> bool:
    """Whether every instance has as many replicas (poprun's are)."""
    return bool(_int(UNIFORM, 1))


def getNumInstances() -> int:
    """The instances of the run: total replicas over local ones (mpirun's size without
    POPDIST_*, 1 alone)."""
    if isPopdistEnvSet():
        return max(getNumTotalReplicas() // getNumLocalReplicas(), 1)
    return _int("OMPI_COMM_WORLD_SIZE", 1) or 1


def getInstanceIndex() -> int:
    """This instance's index in [0, getNumInstances()): its replica offset over its local
    replicas (mpirun's rank without POPDIST_*, 0 alone)."""
    if isPopdistEnvSet():
        return getReplicaIndexOffset() // getNumLocalReplicas()
    return _int("OMPI_COMM_WORLD_RANK", 0) or 0


def getLocalInstanceIndex() -> int:
    """This instance's index among those of its host; 0 when unset."""
    value = _int(LOCAL_INDEX)
    if value is None:
        value = _int("OMPI_COMM_WORLD_LOCAL_RANK", 0)
    return value or 0


def _system_ipus() -> int:
    return _int("IPULOOP_EMULATOR_IPUS", DEFAULT_IPUS) or DEFAULT_IPUS


def getDeviceId(ipusPerReplica: int = 0) -> int:
    """The id of the device holding this instance's IPUs: local replicas x ``ipusPerReplica``
    (0: ``getNumIpusPerReplica()``) IPUs, rounded up to a power of two, the
    ``getLocalInstanceIndex()``-th such device of the emulated system, numbered as a Pod
    numbers its devices (the single IPUs 0..S-1 first, then the pairs, the fours, ...)."""
    per_replica = ipusPerReplica or getNumIpusPerReplica()
    needed = max(getNumLocalReplicas() * per_replica, 1)
    size = 1
    while size < needed:
        size *= 2
    system = max(_system_ipus(), size)
    first = sum(system // s for s in (1 << k for k in range(size.bit_length() - 1)))
    return first + getLocalInstanceIndex() % max(system // size, 1)


def init() -> None:
    """Ready this instance for the run: join the instances' process group (several
    instances), once."""
    global _initialised
    distributed.join_group(getInstanceIndex(), getNumInstances())
    _initialised = True


def isInitialised() -> bool:
    return _initialised


def finalizeBackend() -> None:
    """Nothing to do: the process group is left at exit."""


def only_instances() -> frozenset[int] | None:
    """The instances that run the function ``execute_on_instances`` is running, or None."""
    return _only


@contextlib.contextmanager
def _restricted(instances: frozenset[int]) -> Iterator[None]:
    global _only
    previous, _only = _only, instances
    try:
        yield
    finally:
        _only = previous


def execute_on_instances(
    instances: Any, func: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``func(*args, **kwargs)`` on the instances in ``instances`` only (its result; None on
    the others). Host-side collectives inside it see those instances alone."""
    chosen = frozenset(int(i) for i in instances)
    if getInstanceIndex() not in chosen:
        return None
    with _restricted(chosen):
        return func(*args, **kwargs)


class Options(_Options):
    """``poptorch.Options`` for an instance that poprun started: its local replicas, process
    id and count, and (under poprun) its IPUs' device id, read from poprun's environment."""

    def __init__(self, ipus_per_replica: int | None = None) -> None:
        super().__init__()
        self.replicationFactor(getNumLocalReplicas())
        self.Distributed.configureProcessId(getInstanceIndex(), getNumInstances())
        if isPopdistEnvSet():
            self.useIpuId(getDeviceId(ipus_per_replica or getNumIpusPerReplica()))
