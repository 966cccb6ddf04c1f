"""PopTorch's device ops whose behaviour is more than torch's math: dynamic slices, on-device
control flow (``cond``, ``for_loop``) and ``ipu_print_tensor``.

Each runs its host (CPU) semantics outside a wrapped model, as PopTorch's CPU kernels do, and
the device's semantics (and the compiler's checks) while the emulated device runs it
(``isRunningOnIpu()``).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from .blocks import Block
from .device import checks as _checks
from .device.device_state import emulator_device, rng_state, swap_rng
from .device.print_format import PrintFormat, format_tensor
from .errors import Error
from .executor import isRunningOnIpu

__all__ = ["cond", "dynamic_slice", "dynamic_update", "for_loop", "ipu_print_tensor"]

# The IPU has no 64-bit types: a device tensor's dtype as PopTorch names it in its errors.
_ON_DEVICE = {torch.int64: torch.int32, torch.float64: torch.float32}


def _check_tensor(x: Any, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise Error(f"{what} must take a torch.tensor argument. {type(x)} is not supported.")


# -- ipu_print_tensor --------------------------------------------------------------------------


def ipu_print_tensor(
    tensor: torch.Tensor,
    title: str = "",
    print_gradient: bool = True,
    summarise_threshold: int = 1000,
    edge_items: int = 3,
    max_line_width: int = 80,
    digits: int = 4,
    float_format: str = "auto",
    separator: str = ", ",
    open_bracket: str = "(",
    close_bracket: str = ")",
) -> torch.Tensor:
    """Identity that prints ``tensor`` to stderr each time the device runs it, as
    ``<title>: <tensor>`` in Poplar's print format (``print_format``), and its gradient
    (titled ``<title>_gradient``) in the backward pass unless ``print_gradient`` is False.
    Use the returned tensor."""
    _check_tensor(tensor, "ipu print tensor")
    fmt = PrintFormat(
        summarise_threshold,
        edge_items,
        max_line_width,
        digits,
        float_format,
        separator,
        open_bracket,
        close_bracket,
    )
    if not isRunningOnIpu() or Block._trace is not None:
        return tensor  # host (CPU) execution, or the compile-time trace: nothing runs on device
    name = title or "tensor"
    _print(name, tensor, fmt)
    out = tensor.view_as(tensor)  # its own autograd node: the hook sees this op's gradient only
    if print_gradient and out.requires_grad:
        out.register_hook(lambda g: _print(f"{name}_gradient", g, fmt))
    return out


def _print(title: str, t: torch.Tensor, fmt: PrintFormat) -> None:
    print(f"{title}: {format_tensor(t, fmt)}", file=sys.stderr, flush=True)


# -- dynamic slices ----------------------------------------------------------------------------


def _start_value(start: torch.Tensor) -> int:
    """The first element of ``start`` (PopTorch's CPU kernels read it from an integer
    tensor)."""
    if start.dtype not in (torch.int64, torch.int32, torch.int16):
        raise Error("Expected integer typed start tensor")
    return int(start.reshape(-1)[0].item())


def _check_size(size: int) -> None:
    """PopTorch's compiler: a dynamic slice has a positive constant size."""
    if size == 0:
        raise Error("The start and end of a slice must be different.")
    if size < 0:
        raise Error("Taking a slice of a tensor with the end less than the start is not supported.")


def _device_indices(start: torch.Tensor, size: int, length: int, step: int = 1) -> torch.Tensor:
    """The indices a device slice of ``size`` (every ``step``-th kept) reads or writes from
    ``start`` along a dimension of ``length``: the start is an unsigned 32-bit offset (PopTorch
    casts it to UINT32), one beyond the dimension reads from 0, and the slice wraps round the
    dimension's end (PopLibs' dynamic slice)."""
    first = start.reshape(-1).narrow(0, 0, 1).long()
    first = torch.where((first >= 0) & (first < length), first, torch.zeros_like(first))
    return (first + torch.arange(0, size, step, device=start.device)) % length


def dynamic_slice(
    tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int, step: int
) -> torch.Tensor:
    """``size`` elements of ``tensor`` along ``dim`` from ``start`` (a tensor, read when the
    device runs), every ``step``-th kept. On the device ``size`` must be a positive factor of
    the dimension and ``step`` at least 1, and an out-of-range start is read as PopLibs reads
    it (``_device_indices``); on the host it is ``tensor[start:start + size:step]``."""
    if not isinstance(tensor, torch.Tensor):
        raise Error(
            f"dynamic_slice must take a torch.tensor input. {type(tensor)} is not supported."
        )
    if not isinstance(dim, int):
        raise Error("Dimension must be an integer.")
    if not isinstance(start, torch.Tensor):
        raise Error(
            "Slice start argument to dynamic_slice must be a torch.tensor. "
            f"{type(start)} is not supported."
        )
    if not isinstance(size, int):
        raise Error("Size must be an integer.")
    if not isinstance(step, int):
        raise Error("Step must be an integer.")
    if not isRunningOnIpu():
        first = _start_value(start)
        index = [slice(None)] * tensor.dim()
        index[dim] = slice(first, first + size, step)
        return tensor[tuple(index)]
    _check_size(size)
    if step < 1:
        raise Error("Slicing step must be at least 1")
    dim = dim + tensor.dim() if dim < 0 else dim
    length = tensor.shape[dim]
    if length % size:
        raise Error(
            f"The size of the slice ({size}) must be a factor of the slicing dimension ({length})."
        )
    index = _device_indices(start.to(tensor.device), size, length, step)
    return tensor.index_select(dim, index)


def dynamic_update(
    input: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor, size: int
) -> torch.Tensor:
    """A copy of ``input`` with ``src`` written along ``dim`` at ``start`` (a tensor, read when
    the device runs) over ``size`` elements. On the device ``size`` must be positive and
    ``src`` that long along ``dim``, and an out-of-range start is read as PopLibs reads it
    (``_device_indices``); on the host it is ``torch.slice_scatter``."""
    if not isinstance(input, torch.Tensor):
        raise Error(
            f"dynamic_update must take a torch.tensor input. {type(input)} is not supported."
        )
    if not isinstance(dim, int):
        raise Error("Dimension must be an integer.")
    if not isinstance(start, torch.Tensor):
        raise Error(
            "Slice start argument to dynamic_update must be a torch.tensor. "
            f"{type(start)} is not supported."
        )
    if not isinstance(src, torch.Tensor):
        raise Error(
            f"Src argument to dynamic_update must be a torch.tensor. {type(src)} is not supported."
        )
    if not isinstance(size, int):
        raise Error("Size must be an integer.")
    if input.dim() != src.dim():
        raise Error(
            f"input and src tensors must have same dimensionality. ({input.dim()}) vs ({src.dim()})"
        )
    on_device = isRunningOnIpu()
    in_dtype, src_dtype = input.dtype, src.dtype
    if on_device:
        in_dtype, src_dtype = (
            _ON_DEVICE.get(in_dtype, in_dtype),
            _ON_DEVICE.get(src_dtype, src_dtype),
        )
    if in_dtype != src_dtype:
        raise Error(f"input and src tensor must have same dtype. ({in_dtype} vs {src_dtype})")
    if not on_device:
        first = _start_value(start)
        return torch.slice_scatter(input, src, dim, first, first + size, 1)
    _check_size(size)
    dim = dim + input.dim() if dim < 0 else dim
    if src.shape[dim] != size:
        raise Error(
            f"dynamic_update writes size={size} elements along dim {dim}, but src has "
            f"{src.shape[dim]} there (src shape {list(src.shape)}): pass a src whose "
            "dimension dim is size long."
        )
    index = _device_indices(start.to(input.device), size, input.shape[dim])
    return input.index_copy(dim, index, src)


# -- on-device control flow --------------------------------------------------------------------


def for_loop(
    count: int, body: Callable[..., Any], inputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Run ``body`` ``count`` times, each iteration's outputs being the next one's inputs
    (inference models only, as in PopTorch)."""
    _checks.note_inference_only(
        "poptorch.for_loop()",
        "Use it in a model wrapped by poptorch.inferenceModel, or unroll "
        "the loop in Python for a trainingModel.",
    )
    if not isinstance(inputs, list):
        raise ValueError(
            "poptorch.for_loop expects input tensors (inputs) to be a list of "
            f"tensors. (Object is not list) Received: {type(inputs).__name__}."
        )
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                "poptorch.for_loop expects input tensors (inputs) to be a list of "
                f"tensors. (Object contained in list at index {i} is not "
                "torch.tensor)"
            )
    outputs = [t.clone() for t in inputs]  # the body gets its inputs by value
    for _ in range(count):
        outputs = _as_list(body(*outputs))
    return outputs


def _as_list(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def cond(
    condition: torch.Tensor,
    then_body: Callable[..., Any],
    then_inps: list[torch.Tensor],
    else_body: Callable[..., Any],
    else_inps: list[torch.Tensor],
) -> list[torch.Tensor]:
    """``then_body(*then_inps)`` if ``condition`` else ``else_body(*else_inps)``, as a list of
    tensors. On the device (inference models only) the condition is a one-element tensor read
    when the device runs, both branches are part of the graph (both run; the random draws are
    the taken branch's), take their inputs by value, and must return as many tensors, of the
    same dtypes, with the else branch's shapes (a then output of another shape but as many
    elements is reshaped to it); PopTorch refuses a 0-dimensional else output."""
    if not isinstance(then_inps, list) or not isinstance(else_inps, list):
        raise ValueError(
            "poptorch.cond expects then_inps and else_inps tensors to be a list of "
            "tensors. (Object is not list) Received: "
            f"then_inps={type(then_inps).__name__}, "
            f"else_inps={type(else_inps).__name__}."
        )
    if not isRunningOnIpu():  # host execution: Python's own if
        return _as_list(then_body(*then_inps) if condition else else_body(*else_inps))
    _checks.note_inference_only(
        "poptorch.cond()",
        "Use it in a model wrapped by poptorch.inferenceModel, or branch in "
        "Python (on values known when the model is traced) for a trainingModel.",
    )
    if not isinstance(condition, torch.Tensor) or condition.numel() != 1:
        got = (
            f"a tensor of shape {list(condition.shape)}"
            if isinstance(condition, torch.Tensor)
            else f"{type(condition).__name__} {condition!r}"
        )
        raise Error(
            "poptorch.cond's condition must be a one-element torch.Tensor (a bool tensor "
            f"computed on the device, e.g. torch.tensor([True])). Received: {got}."
        )
    take = bool(condition.reshape(()).item())
    device = emulator_device()
    before = rng_state(device)
    then_out = _as_list(then_body(*[t.clone() for t in then_inps]))
    after_then = swap_rng(before, device)  # the else branch draws as if it ran alone
    else_out = _as_list(else_body(*[t.clone() for t in else_inps]))
    if take:
        swap_rng(after_then, device)
    return _merge_branches(then_out, else_out, take)


def _merge_branches(then_out: list[Any], else_out: list[Any], take: bool) -> list[torch.Tensor]:
    """The outputs of the taken branch, checked against the other's as PopTorch's compiler
    checks them (``AddSubgraphConnectionNodes``: the then outputs take the else shapes)."""
    if len(then_out) != len(else_out):
        raise Error(
            f"poptorch.cond: then_body returns {len(then_out)} output(s) and else_body "
            f"{len(else_out)}: both branches must return the same number of tensors."
        )
    merged = []
    for i, (a, b) in enumerate(zip(then_out, else_out)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            raise Error(
                f"poptorch.cond: output {i} of each branch must be a torch.Tensor. "
                f"Received: {type(a).__name__} and {type(b).__name__}."
            )
        if b.dim() == 0:
            raise Error(
                "`else` branch output has an empty shape, so adding a reshape op to the "
                "`then` branch to achieve shapes identity is not possible!"
            )
        if a.dtype != b.dtype:
            raise Error(
                f"poptorch.cond: output {i} is {a.dtype} in then_body and {b.dtype} in "
                "else_body: each output must have one dtype in both branches."
            )
        if a.shape != b.shape and a.numel() != b.numel():
            raise Error(
                f"poptorch.cond: output {i} has shape {list(a.shape)} in then_body and "
                f"{list(b.shape)} in else_body: the then output is reshaped to the else "
                "shape, which needs as many elements."
            )
        merged.append(a.reshape(b.shape) if take else b)
    return merged
