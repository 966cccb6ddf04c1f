"""The host-side collectives PopTorch programs take from Horovod (``import horovod.torch as
hvd``), over the instances' ``torch.distributed`` group: what ``import horovod.torch`` gives
under ``python -m ipuloop.emulate`` where Horovod is not installed.

PopDist's applications reduce their logged values, broadcast the seed and the initial weights
from instance 0, and gather timings between the instances that poprun started; the gradients
are reduced on the device (``distributed.py``), never here. So this is Horovod's API for host
tensors and objects:

- ``init()`` joins the process group (the one ``popdist.init()`` and a training model join,
  created from the launcher's environment; one instance joins nothing); ``rank``, ``size``,
  ``local_rank``, ``local_size`` answer from it or from the launcher's environment;
- ``allreduce`` (``op=Average`` by default, as Horovod; ``average=`` as its older releases),
  ``grouped_allreduce``, ``allgather`` (along dimension 0, whose size may differ between the
  instances), ``broadcast``, their in-place forms (``allreduce_``, ``broadcast_``),
  ``broadcast_parameters``, ``broadcast_object``, ``allgather_object`` and ``barrier``: new
  tensors (or the same, in place) with Horovod's values; with one instance each returns its
  input's values;
- inside ``popdist.execute_on_instances({i}, ...)``, the instance runs them alone.

Horovod's training pieces (``DistributedOptimizer``, ``broadcast_optimizer_state``, Adasum,
process sets, compression) raise ``AttributeError`` or ``ValueError`` saying so: an IPU program
reduces its gradients on the device.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import group_teardown
from . import popdist
from .device import distributed

__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_parameters",
    "grouped_allreduce",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]

# Horovod's reduction ops (horovod.torch's module constants)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max"}
_OP_NAMES[Product] = "Product"
_initialized = False


def _launch() -> tuple[int, int]:
    """(rank, size) from the launcher's environment: poprun's or mpirun's, else torchrun's."""
    if popdist.isPopdistEnvSet() or os.environ.get("OMPI_COMM_WORLD_SIZE"):
        return popdist.getInstanceIndex(), popdist.getNumInstances()
    if os.environ.get("RANK") and os.environ.get("WORLD_SIZE"):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def _check_initialized() -> None:
    if not _initialized:
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def init(*args: Any, **kwargs: Any) -> None:
    """Join the instances' process group (none for one instance)."""
    global _initialized
    rank_, size_ = _launch()
    distributed.join_group(rank_, size_)
    _initialized = True


def is_initialized() -> bool:
    return _initialized


def shutdown() -> None:
    """Forget ``init()`` (the process group is left at exit)."""
    global _initialized
    _initialized = False


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    _check_initialized()
    dist = _dist()
    return dist.get_rank() if dist else _launch()[0]


def size() -> int:
    _check_initialized()
    dist = _dist()
    return dist.get_world_size() if dist else _launch()[1]


def local_rank() -> int:
    """This instance's index on its host."""
    _check_initialized()
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK", popdist.LOCAL_INDEX):
        if os.environ.get(name):
            return int(os.environ[name])
    return 0


def local_size() -> int:
    """The instances on this host."""
    _check_initialized()
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return size()


def _group() -> Any:
    """``torch.distributed`` when the collective spans several instances, else None (alone,
    or inside ``execute_on_instances`` on this instance only)."""
    _check_initialized()
    only = popdist.only_instances()
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        if _launch()[1] > 1:
            raise ValueError(
                "horovod: this instance is one of several but joined no process group; "
                "call hvd.init() (or popdist.init()) first."
            )
        return None
    if only is not None and len(only) < dist.get_world_size():
        if len(only) == 1:
            return None
        raise ValueError(
            f"horovod: a collective inside popdist.execute_on_instances({sorted(only)}) spans "
            "every instance, and the others never join it (on IPUs it would wait for ever): "
            "make it outside, or run the function on one instance or on all."
        )
    return dist


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy, 16-bit floats as float32 (what gloo reduces)."""
    t = tensor.detach().to("cpu", copy=True).contiguous()
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _resolve(average: bool | None, op: int | None) -> int:
    if average is not None and op is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Average if average is None or average else Sum
    if op not in _OP_NAMES:
        raise ValueError(f"horovod: unknown reduction op {op!r}")
    return op


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over the instances (the mean by default)."""
    op = _resolve(average, op)
    if op == Adasum:
        raise ValueError("horovod: Adasum is not emulated; use op=hvd.Average or hvd.Sum.")
    if process_set is not None:
        raise ValueError("horovod: process sets are not emulated; reduce over all instances.")
    t = _wire(tensor)
    if prescale_factor != 1.0:
        t = t * prescale_factor
    dist = _group()
    if dist is not None:
        reduce_op = {
            Average: dist.ReduceOp.SUM,
            Sum: dist.ReduceOp.SUM,
            Min: dist.ReduceOp.MIN,
            Max: dist.ReduceOp.MAX,
            Product: dist.ReduceOp.PRODUCT,
        }[op]
        try:
            dist.all_reduce(t, op=reduce_op)
        except Exception as e:
            raise _collective_error("allreduce", e) from e
        group_teardown.keep_until_left("ipuloop.emulator.horovod", t)  # (why: there)
        if op == Average:
            t = t / dist.get_world_size()
    if postscale_factor != 1.0:
        t = t * postscale_factor
    return t.to(device=tensor.device, dtype=tensor.dtype)


def allreduce_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``allreduce`` into ``tensor`` itself."""
    with torch.no_grad():
        return tensor.copy_(allreduce(tensor, *args, **kwargs))


def grouped_allreduce(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> list[Any]:
    """``allreduce`` of each tensor, in a list."""
    return [allreduce(t, *args, **kwargs) for t in tensors]


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> Any:
    """The instances' tensors concatenated along dimension 0, in rank order."""
    dist = _group()
    if dist is None:
        return tensor.detach().clone()
    gathered: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, tensor.detach().cpu())
    except Exception as e:
        raise _collective_error("allgather", e) from e
    return torch.cat([g.reshape(-1, *tensor.shape[1:]) for g in gathered]).to(tensor.device)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every instance's ``obj``, in rank order."""
    dist = _group()
    if dist is None:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, obj)
    except Exception as e:
        raise _collective_error("allgather_object", e) from e
    return gathered


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, **_: Any) -> Any:
    """A new tensor: ``root_rank``'s ``tensor`` on every instance."""
    t = _wire(tensor)
    dist = _group()
    if dist is not None:
        try:
            dist.broadcast(t, src=root_rank)
        except Exception as e:
            raise _collective_error("broadcast", e) from e
        group_teardown.keep_until_left("ipuloop.emulator.horovod", t)
    return t.to(device=tensor.device, dtype=tensor.dtype)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, **_: Any) -> Any:
    """``broadcast`` into ``tensor`` itself."""
    with torch.no_grad():
        return tensor.copy_(broadcast(tensor, root_rank))


def broadcast_parameters(params: Any, root_rank: int, **_: Any) -> None:
    """``root_rank``'s values into every instance's ``params`` (a ``state_dict()``, or
    ``(name, tensor)`` pairs such as ``named_parameters()``), in place."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list) or hasattr(params, "__iter__"):
        items = list(params)
        if not all(isinstance(i, tuple) and len(i) == 2 for i in items):
            raise ValueError("invalid params of type: list of (name, tensor) pairs expected")
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    for _name, p in items:
        if isinstance(p, torch.Tensor):
            broadcast_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, **_: Any) -> Any:
    """``root_rank``'s ``obj`` on every instance."""
    dist = _group()
    if dist is None:
        return obj
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=root_rank)
    except Exception as e:
        raise _collective_error("broadcast_object", e) from e
    return box[0]


def barrier(process_set: Any = None) -> None:
    """Wait for every instance."""
    dist = _group()
    if dist is not None:
        dist.barrier()


def _collective_error(what: str, e: BaseException) -> RuntimeError:
    return RuntimeError(
        f"horovod.{what} across instances failed: another instance died or stopped calling it "
        f"({distributed.TIMEOUT_ENV} bounds the wait). Cause: {type(e).__name__}: {e}"
    )


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"horovod.torch.{name} is not emulated: under ipuloop's emulator horovod.torch offers "
        "the host-side collectives PopTorch programs use between instances "
        f"({', '.join(__all__)}); gradients are reduced on the device by the training model."
    )
