"""What a host call returns under each ``OutputMode``, turned into losses and metric inputs.

A training call over a host batch laid out ``[DI, GA, RF/g, B]`` returns (poptorch-semantics
§2.2): All: every micro-batch, ``[DI, GA, RF]``; EveryN(N): iterations d with (d+1) % N == 0;
Final: the last micro-batch of each replica; Sum: per replica, the sum over DI*GA.
A scalar loss becomes ``[n]`` only when that count n is > 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, NamedTuple

import torch

from .errors import NonFiniteLossError
from .rules import ALL, DEFAULT, EVERY_N, FINAL, SUM, returned_iterations, returned_rows

__all__ = ["Layout", "StepLoss", "MODE_NAMES", "map_tensors", "non_finite_error"]

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


def non_finite_error(loss: torch.Tensor, layout: Layout, epoch: int,
                     step: int) -> NonFiniteLossError:
    """The error for a returned ``loss`` with a NaN or infinity, naming where it came from."""
    flat = loss.reshape(-1)
    i = int(torch.nonzero(~torch.isfinite(flat))[0])
    m = layout.micro_batch_index(i)
    d, rest = divmod(m, layout.ga * layout.rf)
    a, r = divmod(rest, layout.rf)
    what = "replica" if layout.mode == SUM else "micro-batch"
    return NonFiniteLossError(
        f"Non-finite loss {float(flat[i])} at epoch {epoch}, step {step} (0-based host call), "
        f"{what} {m} of the step "
        + (f"(device iteration {d}, accumulation step {a}, replica {r})."
           if layout.mode != SUM else "(a replica's sum over the step; OutputMode.All "
           "names the micro-batch).")
        + " Lower the learning rate, check the data, or pass check_finite=False.")
