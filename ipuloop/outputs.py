"""What a host call returns under each ``OutputMode``, turned into losses and metric inputs.

A training call over a host batch laid out ``[DI, GA, RF/g, B]`` returns (poptorch-semantics
§2.2): All: every micro-batch, ``[DI, GA, RF]``; EveryN(N): iterations d with (d+1) % N == 0;
Final: the last micro-batch of each replica; Sum: per replica, the sum over DI*GA.
A scalar loss becomes ``[n]`` only when that count n is > 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, NamedTuple

import torch

from .errors import NonFiniteLossError
from .rules import ALL, DEFAULT, EVERY_N, FINAL, SUM, returned_iterations, returned_rows

__all__ = ["Layout", "StepLoss", "MODE_NAMES", "map_tensors", "non_finite_error", "FLOAT16_MAX"]

MODE_NAMES = {FINAL: "Final", EVERY_N: "EveryN", ALL: "All", SUM: "Sum", DEFAULT: "Default"}


def map_tensors(x: Any, fn: Callable) -> Any:
    """``fn`` applied to every tensor of ``x`` (a tensor, or tuples, lists, dicts of them)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return type(x)((k, map_tensors(v, fn)) for k, v in x.items())
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(map_tensors(v, fn) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(map_tensors(v, fn) for v in x)
    return x


class StepLoss(NamedTuple):  # a tuple: made once per training step, at a tuple's cost
    total: float  # sum of the micro-batch losses this step's output stands for
    count: int  # how many micro-batch losses ``total`` sums
    exact: bool  # False when the mode returns only some micro-batches (Final, EveryN>1)

    @property
    def mean(self) -> float:
        return self.total / self.count


@dataclass(frozen=True)
class Layout:
    """The shape of one host call: factors, the resolved output mode and its period."""

    di: int
    ga: int
    rf: int
    mode: int
    period: int = 1
    group: int = 1  # input replica group size g: replicas r read input group r // g
    orthogonal: bool = False  # CommGroupType.Orthogonal: replica r reads group r % (RF/g)

    @property
    def input_groups(self) -> int:
        return max(self.rf // self.group, 1)

    @property
    def micro_batches(self) -> int:
        """Micro-batches one call runs, all replicas together."""
        return self.di * self.ga * self.rf

    def returned_iterations(self) -> list[int]:
        return returned_iterations(self.mode, self.di, self.period)

    def step_loss(self, loss: torch.Tensor) -> StepLoss:
        """Reduce the returned loss tensor (already on the host) to a step loss."""
        # Host tensor: no device sync; needed for the log. Summed in float64 (exact for a
        # single value, which float() reads without creating tensors).
        total = float(loss) if loss.numel() == 1 else float(loss.sum(dtype=torch.float64))
        return StepLoss(total, *self._loss_count)

    @cached_property  # fields are frozen: computed once, not every step
    def rows(self) -> list[list[int]]:
        """The micro-batches behind each returned row (``rules.returned_rows``)."""
        return returned_rows(self.mode, self.di, self.ga, self.rf, self.period)

    @cached_property
    def _loss_count(self) -> tuple[int, bool]:
        """How many micro-batch losses a returned loss sums, and whether that is all of them."""
        n = sum(map(len, self.rows))
        return n, n == self.micro_batches

    def micro_batch_index(self, returned_index: int) -> int:
        """Index (in ``[DI, GA, RF]`` order) of the micro-batch behind a returned loss; under
        Sum, the replica whose sum it is."""
        if self.mode == SUM:
            return returned_index  # a replica's sum: name the replica
        return self.rows[returned_index][0]

    def input_rows(self, output: torch.Tensor) -> torch.Tensor:
        """An All-mode per-sample output in the host batch's order: one copy per input group.

        Replicas of an input group read the same samples, so their rows are dropped but one.
        """
        groups = self.input_groups
        if groups == self.rf or output.dim() == 0:
            return output
        b = output.shape[0] // (self.di * self.ga * self.rf)
        x = output.reshape(self.di, self.ga, self.rf, b, *output.shape[1:])
        first = [r if self.orthogonal else r * self.group for r in range(groups)]
        return x[:, :, first].reshape(-1, *output.shape[1:])

    def align(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels of the micro-batches whose per-sample outputs the call returned."""
        if self.mode == SUM:
            raise ValueError("OutputMode.Sum returns per-replica sums of the outputs, not "
                             "per-sample outputs, so per-sample metrics cannot be computed. "
                             "Use OutputMode.All (exact) or Final, or drop the metrics.")
        groups = self.input_groups
        slots = self.di * self.ga * groups
        if (self.rf == groups and labels.dim() and labels.shape[0] % slots == 0
                and (self.mode == ALL or self.mode == EVERY_N and self.period == 1)):
            return labels  # every micro-batch in host-batch order: the labels as they are
        b = labels.shape[0] // slots
        x = labels.reshape(self.di, self.ga, groups, b, *labels.shape[1:])
        if self.rf != groups:  # replicas of a group read the same inputs
            idx = [(r % groups) if self.orthogonal else (r // self.group) for r in range(self.rf)]
            x = x[:, :, idx]
        if self.mode == FINAL:
            x = x[-1:, -1:]
        elif self.mode == EVERY_N and self.period > 1:
            x = x[self.period - 1::self.period]
        return x.reshape(-1, *labels.shape[1:])


FLOAT16_MAX = 65504.0  # the largest finite float16


def _data_finding(batch: Any, half: bool) -> str | None:
    """What in the host ``batch`` (inputs..., labels) explains a non-finite loss: non-finite
    values, or (``half``: sent as float16) values beyond float16's range; None if nothing."""
    parts = list(batch) if isinstance(batch, (tuple, list)) else [batch]
    for i, x in enumerate(parts):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()):
            continue
        labels = i == len(parts) - 1 and len(parts) > 1
        what = f"{'the labels' if labels else f'input {i}'} of this step's host batch " \
            + ("have" if labels else "has")
        if not bool(torch.isfinite(x).all()):
            return (f"{what} NaN or infinite values: clean the data (or leave such samples "
                    "out in the dataset)")
        biggest = float(x.abs().max())
        if half and biggest > FLOAT16_MAX:
            return (f"{what} values up to {biggest:.6g}, beyond "
                    f"float16's range (largest {FLOAT16_MAX:g}): sent as float16 they became "
                    "infinite. Scale them into range (normalise the data), or train with "
                    'precision="32"')
    return None


def _float16_cause(precision: str, loss_scaling: float | None, last_loss: float | None) -> str:
    """Why a 16-bit step whose data is in range gives a non-finite loss, as exactly as known."""
    text = (f"The step runs in float16 (precision={precision!r}), whose largest value is "
            f"{FLOAT16_MAX:g}, and its host batch is within that range: ")
    if loss_scaling is not None and loss_scaling > 1:
        scaled = None if last_loss is None else abs(last_loss) * loss_scaling
        if scaled is not None and math.isfinite(scaled) and scaled > FLOAT16_MAX:
            return text + (
                f"the last finite step loss, {last_loss:.6g}, times the optimizer's "
                f"loss_scaling={loss_scaling:g} is {scaled:.6g}, beyond it, so the gradients "
                "overflowed and the update wrote inf or NaN into the weights. Lower "
                f"loss_scaling (below {FLOAT16_MAX / abs(last_loss):.4g} for that loss).")
        return text + (
            f"the loss is multiplied by the optimizer's loss_scaling={loss_scaling:g} before "
            f"the backward pass, so a gradient above {FLOAT16_MAX / loss_scaling:.4g} "
            "overflows and the update writes inf or NaN into the weights; or an activation "
            "overflowed. Lower loss_scaling (or the learning rate).")
    return text + ("an activation, the loss or a gradient overflowed it, or an update made "
                   "the weights non-finite. Scale the inputs or the loss down, lower the "
                   'learning rate, or train with precision="32".')


def non_finite_error(loss: torch.Tensor, layout: Layout, epoch: int, step: int, *,
                     batch: Any = None, precision: str = "32",
                     loss_scaling: float | None = None,
                     last_loss: float | None = None) -> NonFiniteLossError:
    """The error for a returned ``loss`` with a NaN or infinity, naming where it came from
    and, as exactly as the step's host ``batch`` tells, why: non-finite data; under a 16-bit
    ``precision``, data beyond float16's range, or a gradient overflow that the optimizer's
    ``loss_scaling`` explains (``last_loss``: the last finite step loss)."""
    flat = loss.reshape(-1)
    i = int(torch.nonzero(~torch.isfinite(flat))[0])
    m = layout.micro_batch_index(i)
    d, rest = divmod(m, layout.ga * layout.rf)
    a, r = divmod(rest, layout.rf)
    what = "replica" if layout.mode == SUM else "micro-batch"
    where = (f"Non-finite loss {float(flat[i])} at epoch {epoch}, step {step} (0-based host "
             f"call), {what} {m} of the step "
             + (f"(device iteration {d}, accumulation step {a}, replica {r})."
                if layout.mode != SUM else "(a replica's sum over the step; OutputMode.All "
                "names the micro-batch)."))
    half = precision != "32"
    finding = None if batch is None else _data_finding(batch, half)
    if finding is not None:
        why = f" The data explains it: {finding}."
    elif half:
        why = " " + _float16_cause(precision, loss_scaling, last_loss)
    else:
        why = " Lower the learning rate, or check the data."
    return NonFiniteLossError(where + why + " (Or pass check_finite=False.)")
