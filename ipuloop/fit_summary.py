"""What a fit is about to run, in a few lines: ``Loop.summary`` and the progress display's.

The backend and its device; the factors and the combined batch; steps and optimizer updates
per epoch and the output mode; each IPU (or block) with the layers its ``BeginBlock`` starts and
their parameters; the precision and optimizer; torch's threads against the host's idle cores,
with the fix where they outnumber them; and for a resumed fit, where it continues.

Placement is read from the model as PopTorch annotates it: ``poptorch.BeginBlock(module,
user_id, ipu_id)`` registers a forward pre-hook on the module holding ``_user_id`` and
``_ipu_id`` (PopTorch's ``ops.py`` and the emulator's ``blocks.py`` alike). A layer belongs to the
block begun last before it, in the order the modules are registered (the order a
``Sequential`` runs them). Blocks opened inside ``forward`` (``with poptorch.Block(...)``,
``BlockFunction``) are not visible before the model runs: the summary then lists the stages
the options' execution strategy names (``PipelinedExecution(Stage("B1").ipu(0), ...)``: its
``stage``s, as PopTorch and the emulator keep them), and the model's parameters in all.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator

import torch

from .poptorch_types import Options
from .rules import ALL, EVERY_N, FINAL, SUM, input_groups, uses_ipu_model
from .state import State

__all__ = ["describe", "placement", "strategy_stages", "thread_advice", "host_cores", "host_load"]

_MODES = {FINAL: "Final", EVERY_N: "EveryN", ALL: "All", SUM: "Sum"}
_SHOWN = 4  # layer names listed per IPU before "+N more"


def host_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def host_load() -> float | None:
    """The host's 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def thread_advice(threads: int, cores: int, load: float | None) -> tuple[str, str | None]:
    """The threads line, and the fix when torch's ``threads`` outnumber the idle cores (the
    cores less the load, at least 1): on a busy host a small model then runs many times
    slower than with one thread per idle core."""
    idle = max(1, cores - round(load)) if load is not None else cores
    where = f"{cores} core(s)" + (f", load {load:.1f}" if load is not None else "")
    line = f"threads: torch {threads}, host {where}"
    if threads <= idle:
        return line, None
    return line, (
        f"  {threads} torch threads > {idle} idle core(s), which slows small models: set "
        f"OMP_NUM_THREADS={idle} (before Python starts) or torch.set_num_threads({idle})"
    )


def _children(m: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``m``'s children, read through ``__dict__``: reading a trained model's attributes
    copies PopTorch's device weights to the host, and the summary needs none of their values."""
    return [(n, c) for n, c in m.__dict__["_modules"].items() if c is not None]


def _modules(m: torch.nn.Module) -> Iterator[torch.nn.Module]:
    yield m
    for _, c in _children(m):
        yield from _modules(c)


def _params(m: torch.nn.Module, *, recurse: bool) -> Iterator[torch.Tensor]:
    for module in _modules(m) if recurse else (m,):
        yield from (p for p in module.__dict__["_parameters"].values() if p is not None)


def _block_of(module: torch.nn.Module) -> tuple[Any, Any] | None:
    """``(user_id, ipu_id)`` of the ``BeginBlock`` on ``module``, if it has one."""
    for hook in module.__dict__["_forward_pre_hooks"].values():
        if type(hook).__name__ == "_BlockHook" and hasattr(hook, "_ipu_id"):
            return getattr(hook, "_user_id", None), hook._ipu_id
    return None


def placement(model: torch.nn.Module) -> list[tuple[str, list[str], int]]:
    """Each IPU (or block without one) the model's ``BeginBlock`` annotations name, in order
    of first use: ``(label, layer names, parameters)``. Empty when there is none."""
    if not any(_block_of(m) is not None for m in _modules(model)):
        return []
    groups: dict[str, tuple[list[tuple[str, str]], list[int]]] = {}
    seen: set[int] = set()
    auto = [0]
    current = ["ipu 0"]  # PopTorch: what runs before the first block runs on IPU 0

    def params(m: torch.nn.Module, *, recurse: bool) -> int:
        n = 0
        for p in _params(m, recurse=recurse):
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    def begin(m: torch.nn.Module) -> None:
        block = _block_of(m)
        if block is None:
            return
        user_id, ipu_id = block
        if ipu_id is not None:
            current[0] = f"ipu {ipu_id}"
        elif user_id is not None:
            current[0] = f"block {user_id}"
        else:
            current[0] = f"block {auto[0]}"
            auto[0] += 1

    def add(name: str | None, n: int, kind: str = "") -> None:
        names, count = groups.setdefault(current[0], ([], [0]))
        if name:
            names.append((name, kind))
        count[0] += n

    def walk(m: torch.nn.Module, prefix: str) -> None:
        for name, child in _children(m):
            begin(child)
            deeper = any(_block_of(x) is not None for x in _modules(child) if x is not child)
            if deeper:  # its own parameters here, its children each where they begin
                own = params(child, recurse=False)
                if own:
                    add(prefix + name, own)
                walk(child, f"{prefix}{name}.")
            else:
                add(prefix + name, params(child, recurse=True), type(child).__name__)

    begin(model)
    add(None, params(model, recurse=False))
    walk(model, "")
    return [(label, list(_runs(names)), count[0]) for label, (names, count) in groups.items()]


def _runs(names: list[tuple[str, str]]) -> Iterator[str]:
    """Layer names (with their class), runs of consecutive indices of one class joined:
    ``layers.0``..``layers.3`` as ``layers.0-3``; a ``Sequential``'s bare index with its
    layers' class (``0-3 Linear``), which says more than the index alone."""
    i = 0
    while i < len(names):
        name, kind = names[i]
        m = re.fullmatch(r"(.*?)(\d+)", name)
        j = i
        if m is not None:
            prefix, first = m.group(1), int(m.group(2))
            while j + 1 < len(names) and names[j + 1] == (f"{prefix}{first + j + 1 - i}", kind):
                j += 1
            if j > i:
                name = f"{name}-{first + j - i}"
        yield f"{name} {kind}" if m is not None and not m.group(1) and kind else name
        i = j + 1


def _layers(shown: list[str]) -> str:
    """Up to ``_SHOWN`` names, then how many more."""
    more = len(shown) - _SHOWN
    text = ", ".join(shown[:_SHOWN]) + (f" +{more} more" if more > 0 else "")
    return text or "(no layer of its own)"


def strategy_stages(opts: Options) -> list[str]:
    """The stages the options' execution strategy names, each as its blocks and IPU
    (``B1 on ipu 0``); empty when it names none (automatic stages)."""
    strategy = getattr(opts, "_execution_strategy", None)  # PopTorch's attribute, and ours
    block_map = getattr(strategy, "_block_map", None) or {}
    out: list[str] = []
    seen: set[int] = set()
    for stage in block_map.values():
        if id(stage) in seen:
            continue
        seen.add(id(stage))
        ipu = getattr(stage, "_ipu", None)
        out.append("+".join(map(str, stage.blocks)) + (f" on ipu {ipu}" if ipu is not None else ""))
    return out


def _device(pt: Any, backend: str, opts: Options) -> str:
    version = getattr(pt, "__version__", "")
    if backend == "poptorch":
        return "PopTorch " + version + (" on the IPU Model" if uses_ipu_model(opts) else " on IPUs")
    device = os.environ.get("IPULOOP_EMULATOR_DEVICE", "cpu") or "cpu"
    return f"the emulator (PopTorch {version} API) on {device}"


def _optimizer(pt: Any, opt: torch.optim.Optimizer, twin: torch.optim.Optimizer | None) -> str:
    cls = type(opt)
    if isinstance(opt, pt.optim.Optimizer):
        where = "poptorch.optim"
    elif cls.__module__.startswith("torch.optim"):
        where = "torch.optim"
    else:
        where = cls.__module__
    lr = opt.param_groups[0].get("lr") if opt.param_groups else None
    text = f"{where}.{cls.__name__}" + (f" (lr {float(lr):g})" if lr is not None else "")
    if twin is not None:
        text += f", run as poptorch.optim.{type(twin).__name__}"
    return text


def describe(
    *,
    pt: Any,
    backend: str,
    opts: Options,
    micro: int,
    combined: int,
    steps: int | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    twin: torch.optim.Optimizer | None,
    precision: str,
    instances: int = 1,
    resumed: str | None = None,
) -> str:
    """The summary's lines, joined (no trailing newline)."""
    di = opts.device_iterations
    ga = opts.Training.gradient_accumulation
    rf = opts.replication_factor
    groups = input_groups(opts)
    rf_text = f"RF {rf}" if groups == rf else f"RF {rf} / input groups of {rf // groups}"
    batch = f"  batch: micro {micro} x DI {di} x GA {ga} x {rf_text} = {combined} samples"
    batch += " a host call"
    if instances > 1:
        batch += f", on each of {instances} instances"
    mode = _MODES.get(int(opts.output_mode), str(opts.output_mode))
    if int(opts.output_mode) == EVERY_N:
        mode += f"({opts.output_return_period})"
    epoch = (
        f"  epoch: {steps} steps, {steps * di} optimizer updates"
        if steps is not None
        else "  epoch: a stream of unknown length, DI optimizer updates a step"
    )
    lines = [f"fit: {_device(pt, backend, opts)}", batch, f"{epoch}; output mode {mode}"]
    placed = placement(model)
    if placed:
        lines += [f"  {label}: {_layers(names)}; {n:,} params" for label, names, n in placed]
    else:
        total = sum(p.numel() for p in set(_params(model, recurse=True)))
        stages = strategy_stages(opts)
        if stages:  # blocks opened inside forward: their layers are known once it runs
            lines.append(f"  stages: {', '.join(stages)} (poptorch.Block in forward)")
        lines.append(f"  model: {type(model).__name__}, {total:,} params (no BeginBlock)")
    lines.append(f"  precision {precision}; optimizer {_optimizer(pt, optimizer, twin)}")
    threads, advice = thread_advice(torch.get_num_threads(), host_cores(), host_load())
    lines.append("  " + threads)
    if advice:
        lines.append(advice)
    if resumed:
        lines.append("  " + resumed)
    return "\n".join(lines)


def resumed_at(path: str, st: State, steps: int | None) -> str:
    """Where a fit resumed from ``path`` continues (an epoch of ``steps`` host calls), as the
    summary says it."""
    where = (
        f"at its step {st.epoch_step + 1}" + (f" of {steps}" if steps else "")
        if st.epoch_step
        else "at its start"
    )
    return (
        f"resumed from {path}: epoch {st.epoch + 1} {where} "
        f"(after step {st.step}, update {st.update})"
    )
