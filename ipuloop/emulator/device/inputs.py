"""A host call's inputs as the device receives them: the batch dimension checked against the
host-call factor, and each tensor detached, float32 where the IPU has no such type, contiguous
and on the emulated device (``prepare``); with a shortcut for inputs that need none of it
(``as_ready``).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _logging

__all__ = [
    "SENT_AS_FLOAT32",
    "check_batch",
    "prepare",
    "ready_shapes",
    "as_ready",
    "write_back",
    "warn_at_compile",
]

logger = _logging.logger

SENT_AS_FLOAT32 = frozenset({torch.float64, torch.bfloat16})  # inputs the IPU gets as float32
_warned: set[str] = set()  # each per-call warning once a process


def check_batch(leaves: list[Any], di: int, ga: int, rf: int, g: int) -> None:
    """Assert (PopTorch's assertion) that each tensor's batch dimension splits into the
    DI * (RF / g) * GA micro-batches of a host call."""
    prod = di * max(rf // g, 1) * ga
    for x in leaves:
        if isinstance(x, torch.Tensor):
            n = x.shape[0] if x.dim() else 1
            assert n % prod == 0, (
                f"Invalid batch dimension: In the input {x.shape}, the batch dimension "
                f"({n}) must be a multiple of Options.deviceIterations({di}) * "
                f"(Options.replicationFactor({rf}) / "
                f"Options.inputReplicaGrouping.input_group_size({g})) * "
                f"Options.Training.gradientAccumulation({ga}) = {prod} because it is used to "
                "calculate the batch size which will be executed on the device in any given "
                "iteration. For a full explanation see the batching semantics page of the "
                "documentation."
            )


def warn_at_compile(leaves: list[Any]) -> None:
    """What PopTorch says of the inputs when it compiles: each input tensor with
    requires_grad=True is detached (``_preprocessGraph``)."""
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            logger.warning(
                "Input tensor has requires_grad=True set. This tensor will be "
                "detached because backward pass via inputs is not supported."
            )


def prepare(x: Any, device: torch.device, on_cpu: bool) -> Any:
    """Input ``x`` as the device gets it (non-tensors as they are)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.requires_grad:
        x = x.detach()  # said at compile (``warn_at_compile``)
    if x.dtype in SENT_AS_FLOAT32:
        x = x.float()  # sent to the IPU as float32
    if not x.is_contiguous():
        if "contig" not in _warned:
            _warned.add("contig")
            logger.warning(
                "At least one input tensor is not contiguous: non-contiguous "
                "tensors will be converted."
            )
        x = x.contiguous()
    if x.is_cpu if on_cpu else x.device == device:
        return x
    return x.to(device, non_blocking=True)


def ready_shapes(fast: list | None, on_cpu: bool) -> list | None:
    """The (shape, dtype) of each positional tensor for ``as_ready``, from the signature's
    ``fast`` list; None when no call can take the shortcut (inputs ``prepare`` converts, or
    a device other than the CPU)."""
    if fast is None or not on_cpu or any(dtype in SENT_AS_FLOAT32 for _, dtype in fast):
        return None
    return fast


def as_ready(args: tuple, ready: list) -> list | None:
    """``args`` as they are, when they are what the model compiled for and ``prepare`` would
    leave them as they are: plain tensors of the compiled shapes and dtypes (``ready``, none it
    converts), contiguous, not requiring grad, on the CPU. Else None: the general path
    (``Signature.check``, then ``prepare``) checks, converts and raises."""
    if len(args) != len(ready):
        return None
    for x, (shape, dtype) in zip(args, ready):
        if not (
            type(x) is torch.Tensor
            and x.dtype == dtype
            and x.shape == shape
            and x.is_cpu
            and not x.requires_grad
            and x.is_contiguous()
        ):
            return None
    return list(args)


def write_back(edited: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """Copy the device's in-place edits of converted inputs (given, converted, version before
    the run) back into the user's tensors."""
    with torch.no_grad():
        for x, y, version in edited:
            if y._version != version:
                x.copy_(y)
