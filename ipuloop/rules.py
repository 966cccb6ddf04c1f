"""PopTorch rules that both the emulator and the loop need, each written down once.

Also the two rules of a multi-process run that both keep: how long a wait on the other
instances may last (``IPULOOP_DIST_TIMEOUT``), and where a failing instance tells a launcher
which it is. How a process group is left at exit is ``group_teardown.py``. And the one check of
an integer argument (``check_int``), which the loop's and the callbacks' arguments take.

A leaf: it imports only the standard library and torch, so the emulator (which imports nothing
else of ipuloop) and the loop read the same rule. ``opts`` is a ``poptorch.Options`` of either
backend (the real one or ``ipuloop.emulator``): only their documented attributes are read.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = [
    "check_int",
    "FINAL",
    "EVERY_N",
    "ALL",
    "SUM",
    "DEFAULT",
    "MAX_IPUS",
    "OPTIMIZER_GLOBALS",
    "uses_ipu_model",
    "NO_HALF_KERNEL",
    "in_float32_as_float16",
    "input_groups",
    "host_call_factor",
    "describe_factors",
    "reserved_ipus",
    "ipu_count_error",
    "return_periods",
    "check_return_period",
    "returned_iterations",
    "returned_rows",
    "plain_hyperparameter",
    "optimizer_hyperparameters",
    "DIST_TIMEOUT_ENV",
    "DEFAULT_DIST_TIMEOUT",
    "dist_timeout",
    "LAUNCHER_FAILURE_KEY",
    "tell_launcher",
]

# OutputMode values (PopTorch's enum values; the real poptorch's and the emulator's alike).
FINAL, EVERY_N, ALL, SUM, DEFAULT = 0, 1, 2, 3, 4
MAX_IPUS = 64  # the most IPUs one process can reserve


def _env_flag(name: str) -> bool:
    # PopTorch: std::stoi(getenv(name)) != 0, unset meaning 0 (a non-integer counts as 0 here)
    try:
        return int(os.environ.get(name, "0").strip() or 0) != 0
    except ValueError:
        return False


def uses_ipu_model(opts: Any) -> bool:
    """Whether ``opts`` run on the IPU Model: ``useIpuModel()`` if it was called, else the
    ``POPTORCH_IPU_MODEL`` or ``POPTORCH_SMALL_IPU_MODEL`` environment variable (the full or
    the small IPU Model), each read as PopTorch reads it: an integer != 0."""
    if opts.exists("use_model"):
        return bool(opts.use_model)
    return _env_flag("POPTORCH_IPU_MODEL") or _env_flag("POPTORCH_SMALL_IPU_MODEL")


# -- the host call ------------------------------------------------------------------------------


def input_groups(opts: Any) -> int:
    """How many distinct inputs one device iteration's replicas read: max(RF // g, 1) for the
    input replica group size g (``inputReplicaGrouping``); replicas of a group read the same."""
    return max(opts.replication_factor // opts.input_group_size, 1)


def host_call_factor(opts: Any, training: bool) -> int:  # noqa: FBT001 (plan.py calls it so)
    """Micro-batches in one host batch: DI * max(RF // input_group_size, 1) * (GA if training
    else 1). Replicas of one input group read the same samples, so they count once; an
    inference call runs no gradient accumulation."""
    ga = opts.Training.gradient_accumulation if training else 1
    return opts.device_iterations * input_groups(opts) * ga


def describe_factors(opts: Any, micro: int, training: bool) -> str:  # noqa: FBT001 (as above)
    """``host_call_factor`` spelled out for messages: "micro-batch 4 x deviceIterations 2 x
    replicationFactor 1 x gradientAccumulation 1 = 8 samples per host call" (with
    "/ input_group_size g" after the replication factor when g != 1)."""
    ga = opts.Training.gradient_accumulation if training else 1
    text = (
        f"micro-batch {micro} x deviceIterations {opts.device_iterations} x "
        f"replicationFactor {opts.replication_factor}"
    )
    if opts.input_group_size != 1:
        text += f" / input_group_size {opts.input_group_size}"
    text += f" x gradientAccumulation {ga}"
    return f"{text} = {micro * host_call_factor(opts, training)} samples per host call"


# -- IPUs a process reserves ---------------------------------------------------------------------


def reserved_ipus(opts: Any, n: int) -> int:
    """The IPUs PopTorch reserves for a model that needs ``n`` (``CompilerImpl.cpp``): ``n``
    itself on the IPU Model, when ``n`` is a power of 2, or when ``autoRoundNumIPUs`` is off
    (``ipu_count_error`` then refuses it); else ``n`` rounded up to the next power of 2."""
    if uses_ipu_model(opts) or not n & (n - 1) or not opts.auto_round_num_ipus:
        return n
    return 1 << (n - 1).bit_length()


def ipu_count_error(opts: Any, replicas: int, ipus_per_replica: int) -> str | None:
    """None when PopTorch can reserve IPUs for ``replicas`` x ``ipus_per_replica``; else why
    not, as a sentence to raise (callers prefix what asked for them). PopTorch reserves a power
    of 2 of IPUs (rounded up with ``autoRoundNumIPUs``), at most ``MAX_IPUS`` a process; the
    IPU Model (``uses_ipu_model``) has neither limit."""
    if uses_ipu_model(opts):
        return None
    n = replicas * ipus_per_replica
    if n & (n - 1) and not opts.auto_round_num_ipus:
        return (
            f"PopTorch reserves a power of 2 of IPUs, and {replicas} replica(s) x "
            f"{ipus_per_replica} IPU(s) = {n} is not one. Set "
            f"poptorch.Options().autoRoundNumIPUs(True) to reserve "
            f"{1 << (n - 1).bit_length()}."
        )
    if reserved_ipus(opts, n) > MAX_IPUS:
        return (
            f"{replicas} replica(s) x {ipus_per_replica} IPU(s) = {n} IPUs, but a process "
            f"can reserve at most {MAX_IPUS}."
        )
    return None


# -- what each output mode returns -------------------------------------------------------------


def return_periods(di: int) -> list[int]:
    """The periods ``OutputMode.EveryN`` accepts with ``di`` device iterations: its divisors."""
    return [d for d in range(1, di + 1) if di % d == 0]


def check_return_period(
    period: int, di: int, error: type = ValueError, subject: str | None = None
) -> None:
    """Raise ``error`` unless ``period`` divides ``di`` (PopART's rule for EveryN: the period
    must be a factor of the batches per step); the message names the valid periods.
    ``subject`` names what asked for the period (default ``OutputMode.EveryN(period)``)."""
    if isinstance(period, int) and period >= 1 and di % period == 0:
        return
    subject = subject or f"OutputMode.EveryN({period})"
    raise error(
        f"Return period must be a factor of the number of batches per step: {subject} "
        f"returns every {period}-th device iteration of a host call, so the period must "
        f"divide deviceIterations ({di}). Received: output_return_period={period}. Use "
        f"one of {return_periods(di)}."
    )


def returned_iterations(mode: int, di: int, period: int = 1) -> list[int]:
    """The device iterations d (0-based) whose micro-batches a call's outputs come from:
    every one for All and Sum, those with (d + 1) % period == 0 for EveryN, the last for
    Final. ``mode`` is an OutputMode value other than Default (resolve that first)."""
    if mode in (ALL, SUM):
        return list(range(di))
    if mode == EVERY_N:
        return [d for d in range(di) if (d + 1) % period == 0]
    return [di - 1]


def returned_rows(mode: int, di: int, ga: int, rf: int, period: int = 1) -> list[list[int]]:
    """What a call returns under ``mode``, row by row: row i is the sum of the micro-batches
    ``rows[i]`` (indices in ``[DI, GA, RF]`` order, one index for every mode but Sum).

    All: every micro-batch. EveryN: every micro-batch of the returned iterations. Final: the
    last micro-batch of each replica. Sum: per replica, the sum over its DI * GA micro-batches.
    Rows stack (scalar outputs) or concatenate into the returned tensor in this order.
    """
    n = di * ga * rf
    if mode == SUM:
        return [list(range(r, n, rf)) for r in range(rf)]
    if mode == FINAL:
        return [[j] for j in range(n - rf, n)]
    per_iteration = ga * rf
    return [
        [d * per_iteration + j]
        for d in returned_iterations(mode, di, period)
        for j in range(per_iteration)
    ]


# -- the optimizer's hyper-parameters ------------------------------------------------------------

# poptorch.optim attributes held on the optimizer, not per parameter group: PopTorch reads them
# with the groups when it (re)reads an optimizer (trainingModel, setOptimizer).
OPTIMIZER_GLOBALS = (
    "loss_scaling",
    "velocity_scaling",
    "max_grad_norm",
    "max_weight_norm",
    "use_combined_accum",
    "accum_type",
    "velocity_accum_type",
    "first_order_momentum_accum_type",
    "second_order_momentum_accum_type",
    "bias_correction",
    "use_tf_variant",
)
_ABSENT = object()


def plain_hyperparameter(value: Any) -> Any:
    """A hyper-parameter as ``optimizer_hyperparameters`` records it: a tensor (and each
    tensor in a tuple) read as its number, anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.item()  # a host-side hyper-parameter (an lr a scheduler updates in place)
    if isinstance(value, tuple):
        return tuple(plain_hyperparameter(v) for v in value)
    return value


def optimizer_hyperparameters(opt: torch.optim.Optimizer) -> dict:
    """The optimizer's hyper-parameters as PopTorch reads them, comparable with ``==`` to tell
    when they changed: ``{"groups": [{key: value} per param group, "params" left out],
    "global": {name: value for each of OPTIMIZER_GLOBALS the optimizer has}}``. Tensor values
    (and tensors in tuples) are read as numbers (host tensors: no device sync). A fresh
    snapshot each call: nothing in it aliases the optimizer's own mutable state."""
    groups = [
        {k: plain_hyperparameter(v) for k, v in g.items() if k != "params"}
        for g in opt.param_groups
    ]
    extras = {}
    for k in OPTIMIZER_GLOBALS:
        v = getattr(opt, k, _ABSENT)
        if v is not _ABSENT:
            extras[k] = v
    return {"groups": groups, "global": extras}


# -- several processes -------------------------------------------------------------------------
DIST_TIMEOUT_ENV = "IPULOOP_DIST_TIMEOUT"
DEFAULT_DIST_TIMEOUT = 300.0


def dist_timeout(env: Any = None, error: type = ValueError) -> float:
    """``IPULOOP_DIST_TIMEOUT``: the seconds any wait on the other instances may last (joining,
    a collective), 300 when unset; anything but a finite number > 0 is ``error``."""
    env = os.environ if env is None else env
    text = env.get(DIST_TIMEOUT_ENV)
    if text is None or text == "":
        return DEFAULT_DIST_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise error(f"{DIST_TIMEOUT_ENV}={text!r}: expected a number of seconds > 0.")
    return value


# Where an instance leaves the run's first failure for a launcher that serves the group's store
# (python -m ipuloop.emulate.poprun), in the store itself, under none of the prefixes groups
# add.
LAUNCHER_FAILURE_KEY = "ipuloop/launcher/failure"


def tell_launcher(store: Any, failure: dict[str, Any]) -> None:
    """Leave ``failure`` (``instance``, ``error``: the run's first) at ``LAUNCHER_FAILURE_KEY`` of
    the store under ``store``'s prefixes, unless an instance did before; never raises."""
    try:
        while hasattr(store, "underlying_store"):  # a PrefixStore: the store it prefixes
            store = store.underlying_store
        store.compare_set(LAUNCHER_FAILURE_KEY, "", json.dumps(failure))
    except Exception:  # noqa: BLE001 (no store, or gone: a launcher goes by the exits)
        pass


# -- float16 ops the host cannot compute --------------------------------------------------------
NO_HALF_KERNEL = "for 'Half'"  # torch's error for an op without a float16 kernel on a device


def _float32(t: Any) -> Any:
    return t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.float16 else t


def _float16(t: Any) -> Any:
    return t.half() if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t


def in_float32_as_float16(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` computed with its float16 operands in float32, its float32
    results rounded to float16: what an IPU's float16 op returns, where the host has no float16
    kernel for it (torch 2.0's CPU has no float16 matmul or convolution)."""
    args, kwargs = tree_map(_float32, (args, kwargs))
    return tree_map(_float16, func(*args, **kwargs))


def check_int(name: str, value: object, low: int = 1, *, optional: bool = False) -> None:
    """An integer argument: an int (a bool is not one) of at least ``low``, or None where
    ``optional``; else a ``ValueError`` naming it and what it received."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        also = " or None" if optional else ""
        raise ValueError(f"{name} must be an int >= {low}{also}. Received: {name}={value!r}.")
