"""Multi-process (PopDist-style) training: N processes, one torch.distributed group, gradients
all-reduced across every process's replicas before each optimizer update.

With ``opts.Distributed.numProcesses`` N > 1 a training model, at compile, joins the default
``torch.distributed`` process group, or creates it from the launcher's environment
(``python -m torch.distributed.run`` / torchrun: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE;
mpirun's OMPI_COMM_WORLD_RANK/SIZE and poprun's POPDIST_* too, MASTER_ADDR and MASTER_PORT
then defaulting to 127.0.0.1:29500; gloo on the CPU, NCCL when the emulator runs on CUDA:
give each process its own GPU, e.g. ``IPULOOP_EMULATOR_DEVICE=cuda:$LOCAL_RANK``). The
group's rank and size must be ``Distributed.processId`` and ``numProcesses``. Joining, and
every gloo collective on a group this module created, gives up after ``IPULOOP_DIST_TIMEOUT``
seconds (default 300): an instance that died or stopped calling makes the others raise
``poptorch.Error`` instead of hanging. A group this module created is destroyed at exit, the
instances meeting first (left to the interpreter, gloo's teardown can abort the process).
Inference models need no reduction and join nothing.

Replicas (as PopTorch sets PopART's ``globalReplicationFactor`` = N*R and
``globalReplicaOffset`` = processId*R): process p's local replica r is global replica
``p*R + r`` of N*R. The one-process emulator splits a host batch as [DI, GA, RF/g, B] (g the
input group size). So N processes at replicationFactor(R) train as one process at
replicationFactor(N*R) when process p is fed, for each call, the one-process host batch
viewed as [DI, GA, N, R/g, B, ...] and sliced [:, :, p] (then flattened back to dim 0): the
micro-batches of global replicas p*R .. p*R+R-1 of every device iteration and accumulation
step, in order. (Orthogonal input grouping groups within each process's replicas.) Note that
``poptorch.DataLoader`` with auto_distributed_partitioning instead gives each process a
contiguous slice of the dataset, as PopTorch does: that trains on the same samples per epoch,
not the same micro-batches per update.

What one update does with N > 1 (the device optimizer's ``step`` is wrapped, so it happens once
per update, i.e. DI times per training call, after the GA*R local micro-batches):

    local grads = sum over the GA*R local micro-batches of d(loss * loss_scaling * s)/dw,
                  s = 1/(GA*R) for Mean, 1 for Sum               (the executor)
    one all_reduce(SUM) per gradient dtype, of one flat buffer  (here; float16/bfloat16 go
                  over the wire as float32, rounded back once)
    Mean: divide by N  (so the mean is over GA*N*R micro-batches, as on PopTorch)
    unscale by loss_scaling, clip to max_grad_norm, update     (poptorch.optim's step)

so gradient clipping sees the global norm over all replicas of all processes, and every
process applies the same update. A parameter with no gradient on one process gets the others'
reduced gradient. Outputs are those of the local replicas, as on PopTorch. BatchNorm running
statistics are not reduced: each replica keeps its own (as PopTorch's replicas do), and a
process's host module reads its replica 0, i.e. global replica p*R. Random ops draw from each
process's own generator, so dropout masks differ from a one-process run's.

At compile every instance shares one small record (one all_gather_object): randomSeed,
deviceIterations, replicationFactor, gradientAccumulation, input grouping, output mode,
reduction type and strategy, the optimizer's type and hyper-parameters, and the model's
parameter names, shapes and dtypes. A difference is a ``poptorch.Error``, on every instance,
naming the first instance that differs from instance 0 and the two values. Differing initial
weights only warn: each instance's replicas then start from that instance's weights.

Refused with ``poptorch.Error``: sparse gradients; a group whose rank or size is not
processId / numProcesses; N > 1 with neither a process group nor a launcher's environment.
"""

from __future__ import annotations

import atexit
import datetime
import os
import warnings
from typing import Any

import torch

from ... import group_teardown, rules
from .. import _logging
from .. import optim as _optim
from ..enums import CommGroupType, MeanReductionStrategy, OutputMode, ReductionType
from ..errors import Error

__all__ = [
    "TIMEOUT_ENV",
    "DEFAULT_TIMEOUT_S",
    "GradientReducer",
    "join",
    "join_group",
    "launched",
    "launcher_rank",
    "timeout_seconds",
]

logger = _logging.logger

TIMEOUT_ENV, DEFAULT_TIMEOUT_S = rules.DIST_TIMEOUT_ENV, rules.DEFAULT_DIST_TIMEOUT
# A launcher's environment, any of: torchrun's, mpirun's, poprun's (POPDIST_*, with mpirun's)
_LAUNCHERS = (
    ("RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("POPDIST_REPLICA_INDEX_OFFSET", "POPDIST_NUM_TOTAL_REPLICAS"),
)
DEFAULT_ADDR, DEFAULT_PORT = "127.0.0.1", "29500"  # where the launcher sets no MASTER_*
_16BIT = (torch.float16, torch.bfloat16)


def timeout_seconds() -> float:
    """``IPULOOP_DIST_TIMEOUT`` (seconds, > 0), or 300."""
    return rules.dist_timeout(error=Error)


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available():
        raise Error(
            "Options.Distributed.numProcesses > 1 needs torch.distributed, which this "
            "torch build lacks: use a torch built with distributed support, or run one "
            "process (Options.Distributed.disable())."
        )
    return dist


def _where(pid: int, n: int) -> str:
    return f"instance {pid} of {n}"


def _group(pid: int, n: int, device: torch.device) -> Any:
    """``torch.distributed`` with its default process group joined, or created (and then
    destroyed at exit)."""
    dist = _dist()
    if not dist.is_initialized():
        if not launched():
            raise Error(
                f"Options.Distributed.numProcesses is {n} ({_where(pid, n)}) but no "
                "torch.distributed process group exists and the environment has no "
                "launcher's variables (torchrun's RANK and WORLD_SIZE, mpirun's "
                "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE, or poprun's POPDIST_*). Launch "
                f"every instance with `python -m torch.distributed.run --nproc-per-node {n} "
                "SCRIPT` (torchrun) or `python -m ipuloop.emulate.poprun --num-instances "
                f"{n} python SCRIPT`, or call torch.distributed.init_process_group() before the "
                "first call, or run one process (Options.Distributed.disable())."
            )
        _create(dist, pid, n, device)
    rank, size = dist.get_rank(), dist.get_world_size()
    if (rank, size) != (pid, n):
        raise Error(
            f"Options.Distributed says process {pid} of {n}, but the torch.distributed group "
            f"says rank {rank} of {size}. Set opts.Distributed.configureProcessId(rank, "
            "world_size) from the launcher (torchrun: "
            'opts.Distributed.setEnvVarNames("WORLD_SIZE", "RANK")).'
        )
    return dist


def launched(env: Any = None) -> bool:
    """Whether a launcher (torchrun, mpirun, poprun) started this process."""
    return launcher_rank(env) is not None


def launcher_rank(env: Any = None) -> tuple[int, int] | None:
    """(rank, size) as the launcher that started this process says: torchrun's, mpirun's,
    or poprun's (its replica offset and total over the local replicas); None without one."""
    env = os.environ if env is None else env
    for rank, size in _LAUNCHERS:
        if env.get(rank) and env.get(size):
            if rank.startswith("POPDIST_"):
                local = max(int(env.get("POPDIST_NUM_LOCAL_REPLICAS") or 1), 1)
                return int(env[rank]) // local, int(env[size]) // local
            return int(env[rank]), int(env[size])
    return None


def _create(dist: Any, pid: int, n: int, device: torch.device) -> None:
    """Create the default group as instance ``pid`` of ``n``: at the launcher's MASTER_ADDR and
    MASTER_PORT (127.0.0.1:29500 where it sets none, as mpirun does not), destroyed at exit."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timeout_seconds()
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    addr = os.environ.get("MASTER_ADDR") or DEFAULT_ADDR
    port = os.environ.get("MASTER_PORT") or DEFAULT_PORT
    # env:// where the launcher set MASTER_*: under torchrun it joins the launcher's own store
    given = os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")
    rank, size = launcher_rank() or (pid, n)  # the launcher's: the options are checked on it
    try:
        dist.init_process_group(
            backend,
            init_method="env://" if given else f"tcp://{addr}:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except Exception as e:  # a store timeout, a refused connection, ...
        raise Error(
            f"{_where(pid, n)} could not join the other instances within {timeout:g} s "
            f"({backend} at {addr}:{port}): an instance died or was never started. "
            f"{TIMEOUT_ENV} sets the timeout. Cause: {type(e).__name__}: {e}"
        ) from e
    atexit.register(group_teardown.leave_process_group)


def join_group(pid: int, n: int) -> Any:
    """``torch.distributed`` with the default group joined as instance ``pid`` of ``n`` (gloo,
    created from the launcher's environment if nobody has): what popdist's ``init`` and the
    host-side collectives (``hvd.init``) join; None for one instance."""
    if n <= 1:
        return None
    return _group(pid, n, torch.device("cpu"))


def _collective_error(pid: int, n: int, what: str, e: BaseException) -> Error:
    return Error(
        f"{_where(pid, n)}: {what} across instances failed: another instance died, stopped "
        f"calling the model, or ran a different program ({TIMEOUT_ENV}, default "
        f"{DEFAULT_TIMEOUT_S:g} s, bounds the wait on groups the emulator creates). "
        f"Cause: {type(e).__name__}: {e}"
    )


# ---------------------------------------------------------------------------------------------
# Agreement at compile


def _record(options: Any, optimizer: Any, model: torch.nn.Module) -> dict[str, Any]:
    o = options
    record: dict[str, Any] = {
        "randomSeed": o.random_seed if o.exists("random_seed") else None,
        "deviceIterations": o.device_iterations,
        "replicationFactor": o.replication_factor,
        "Training.gradientAccumulation": o.Training.gradient_accumulation,
        "inputReplicaGrouping": (o.input_group_size, CommGroupType(o.input_cgt).name),
        "outputMode": (OutputMode(o.output_mode).name, o.output_return_period),
        "Training.accumulationAndReplicationReductionType": ReductionType(
            o.Training.accumulation_and_replication_reduction_type
        ).name,
        "Training.meanAccumulationAndReplicationReductionStrategy": MeanReductionStrategy(
            o.Training.meanAccumulationAndReplicationReductionStrategy
        ).name,
        "optimizer type": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
    }
    hp = _optim.hyperparameters(optimizer)
    record["optimizer param_groups"] = len(hp["groups"])
    for i, group in enumerate(hp["groups"]):
        for k, v in sorted(group.items()):
            record[f"optimizer param_groups[{i}][{k!r}]"] = repr(v)
    for k, v in sorted(hp["global"].items()):
        record[f"optimizer.{k}"] = repr(v)
    record["model parameters (name, shape, dtype)"] = [
        (name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()
    ]
    return record


def _fingerprint(params: list[torch.Tensor]) -> list[float]:
    with torch.no_grad():
        return [float(v) for p in params for v in (p.double().sum(), p.double().abs().sum())]


def _check_agreement(
    dist: Any, pid: int, n: int, record: dict[str, Any], weights: list[float]
) -> None:
    records: list[Any] = [None] * n
    try:
        dist.all_gather_object(records, (record, weights))
    except Exception as e:
        raise _collective_error(pid, n, "comparing options", e) from e
    first, first_weights = records[0]
    for other in range(1, n):
        rec, _ = records[other]
        for key in sorted(set(first) | set(rec), key=lambda k: (k not in first, k)):
            if first.get(key) != rec.get(key):
                raise Error(
                    f"Options differ across instances: instance {other} has {key} = "
                    f"{rec.get(key)!r} where instance 0 has {first.get(key)!r}. Every instance of "
                    "a multi-process run must compile the same model with the same options and "
                    "optimizer (only Distributed.processId differs)."
                )
    if any(w != first_weights for _, w in records[1:]) and pid == 0:
        logger.warning(
            "The instances' initial weights differ: each replica starts from its own "
            "instance's weights. Seed torch identically (Options.randomSeed) or load "
            "the same checkpoint on every instance."
        )
        warnings.warn("initial weights differ across instances", stacklevel=3)


# ---------------------------------------------------------------------------------------------
# Gradient reduction


class GradientReducer:
    """All-reduces an optimizer's gradients across the N processes: one collective per dtype."""

    def __init__(self, dist: Any, pid: int, n: int, mean: bool, device: torch.device) -> None:
        self._dist = dist
        self._pid = pid
        self._n = n
        self._mean = mean
        # gloo on CUDA tensors: reduce a host copy
        self._via_host = device.type == "cuda" and dist.get_backend() != "nccl"
        self.collectives = 0  # how many all_reduce calls ran (one per dtype per update)

    def reduce(self, optimizer: torch.optim.Optimizer) -> None:
        """Sum (Mean: average over processes) the gradients of ``optimizer``'s parameters."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, params in by_dtype.items():
            self._reduce(dtype, params)

    def _reduce(self, dtype: torch.dtype, params: list[torch.Tensor]) -> None:
        wire = torch.float32 if dtype in _16BIT else dtype
        pieces = []
        present = []
        for p in params:
            g = p.grad
            if g is not None and g.is_sparse:
                raise Error(
                    "Sparse gradients (nn.Embedding(sparse=True)) cannot be reduced "
                    "across instances by the emulator: use dense gradients."
                )
            pieces.append(
                torch.zeros(p.numel(), dtype=wire, device=p.device)
                if g is None
                else g.reshape(-1).to(wire)
            )
            present.append(0.0 if g is None else 1.0)
        pieces.append(torch.tensor(present, dtype=wire, device=params[0].device))
        flat = torch.cat(pieces)
        sent = flat.cpu() if self._via_host else flat
        group_teardown.keep_until_left(f"ipuloop.emulator.gradients.{wire}", sent)  # (why: there)
        try:
            self._dist.all_reduce(sent)
        except Exception as e:
            raise _collective_error(self._pid, self._n, "the gradient all-reduce", e) from e
        self.collectives += 1
        if sent is not flat:
            flat.copy_(sent)
        total = flat.numel() - len(params)
        if self._mean:
            flat[:total].div_(self._n)
        flags = flat[total:].tolist()  # host read: which parameters have a gradient anywhere
        offset = 0
        for p, flag in zip(params, flags):
            k = p.numel()
            if flag > 0:
                value = flat[offset : offset + k].view(p.shape)
                if p.grad is None:
                    p.grad = value.to(dtype) if wire != dtype else value
                else:
                    p.grad.copy_(value)
            offset += k

    def wrap(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` reduce the gradients first (the device optimizer)."""
        inner = optimizer.__dict__.get("step")
        if getattr(inner, "_reduces_across_instances", False):
            return
        step = inner if inner is not None else type(optimizer).step.__get__(optimizer)

        def reducing_step(closure: Any = None) -> Any:
            self.reduce(optimizer)
            return step(closure)

        reducing_step._reduces_across_instances = True  # type: ignore[attr-defined]
        optimizer.step = reducing_step  # type: ignore[method-assign]


def join(
    options: Any,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None,
    model: torch.nn.Module,
    params: list[torch.Tensor],
) -> GradientReducer | None:
    """At a training model's compile: None for one process; else join the group, check that
    every instance agrees, and return the reducer whose ``wrap`` the device optimizer gets.
    ``optimizer`` is None for inference models, which join nothing."""
    n = options.Distributed.numProcesses
    pid = options.Distributed.processId
    if n <= 1 or optimizer is None:
        return None
    if not 0 <= pid < n:
        raise Error(
            f"Options.Distributed.processId is {pid} but numProcesses is {n}: the id "
            f"must be in 0..{n - 1}."
        )
    dist = _group(pid, n, device)
    _check_agreement(dist, pid, n, _record(options, optimizer, model), _fingerprint(params))
    mean = (
        ReductionType(options.Training.accumulation_and_replication_reduction_type)
        == ReductionType.Mean
    )
    return GradientReducer(dist, pid, n, mean, device)
