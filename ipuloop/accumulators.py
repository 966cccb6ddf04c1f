"""One accumulator per phase, side by side: the training epoch, a validation, a predict.

``TrainEpoch`` holds the running epoch's loss (``EpochLoss``), the sums of the values the model
logs and the train metrics; ``Validation`` a validation's val_loss, metrics and logged values;
``Predictions`` a predict's outputs. Each reduces what a host call returns over the step
(``outputs.Layout``) and over the run's instances (``processes.Processes.sum``: one instance,
its input), and gives the phase's logs. How a loss is reduced lives here and in ``outputs``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from .exceptions import NonFiniteLossError
from .outputs import Layout, Returns, StepLoss, check_logged, map_tensors
from .processes import Processes
from .state import ESTIMATED, State

__all__ = [
    "Metric",
    "EpochLoss",
    "TrainEpoch",
    "Validation",
    "Predictions",
    "SetMetrics",
    "metric_logs",
    "metric_state",
    "concat",
    "ESTIMATED",
    "mark_estimates",
    "upgrade_logs",
]


def mark_estimates(logs: dict[str, Any], logged: Container[str] = ()) -> None:
    """Name in ``logs[ESTIMATED]`` every training value ``logs`` holds: ``loss``, the values
    the model logs (``logged``: their names) and the ``train_`` values. For a fit whose output
    mode returns only some micro-batches (``Layout.exact`` False)."""
    logs[ESTIMATED] = " ".join(
        k for k in logs if k != ESTIMATED and (k == "loss" or k in logged or k.startswith("train_"))
    )


def upgrade_logs(logs: dict[str, Any]) -> dict[str, Any]:
    """Logs as a checkpoint written before ``ESTIMATED`` held them (a history row, the last
    logs): their flag ``train_loss_exact`` (1.0, or 0.0 for estimates) becomes the names of the
    estimated values."""
    logs = dict(logs)
    exact = logs.pop("train_loss_exact", None)
    if exact is not None and not exact and ESTIMATED not in logs:
        mark_estimates(logs)
    return logs


class Metric(Protocol):
    """What the loop uses of a metric (a torchmetrics ``Metric``, or any object with these)."""

    def update(self, output: object, labels: object) -> None: ...  # (torchmetrics': *args)

    def compute(self) -> Any: ...  # a tensor, or several (per class, a dict)

    def reset(self) -> None: ...

    def clone(self) -> Metric: ...  # a copy with its own state (TrainEpoch's train metrics)


class Measured(Protocol):
    """What ``Validation`` reads of the loader it runs (a ``plan.Plan``): the host call's
    shape, the micro-batch size and the samples a call combines."""

    @property
    def layout(self) -> Layout: ...

    @property
    def micro(self) -> int: ...

    @property
    def combined(self) -> int: ...


def metric_logs(prefix: str, metrics: dict[str, Metric]) -> dict[str, float]:
    """Each metric's ``compute()`` as log entries: ``<prefix><name>``, and for a metric that
    returns several values (per class, a dict) ``<prefix><name>_<index or key>``."""
    logs: dict[str, float] = {}

    def put(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{key}_{k}", v)
        elif isinstance(value, (tuple, list)) or (
            isinstance(value, torch.Tensor) and value.numel() != 1
        ):
            for i, v in enumerate(value.reshape(-1) if isinstance(value, torch.Tensor) else value):
                put(f"{key}_{i}", v)
        else:
            logs[key] = float(value)

    for name, m in metrics.items():
        put(prefix + name, m.compute())
    return logs


def metric_state(metric: Any) -> dict[str, Any]:
    """A torchmetrics metric's state by name (``metric_state``, which torchmetrics 1.0 lacks)."""
    return {name: getattr(metric, name) for name in metric._defaults}


@dataclass
class EpochLoss:
    """The running training epoch's loss."""

    total: float = 0.0  # the sum of the micro-batch losses of its steps
    count: int = 0  # how many micro-batch losses ``total`` sums
    exact: bool = True  # whether every micro-batch's loss was returned (not under Final, or
    # EveryN > 1, which return some)

    def to_list(self) -> list[Any]:
        """As a checkpoint holds it: ``[total, count, exact]``."""
        return [self.total, self.count, self.exact]

    @classmethod
    def from_list(cls, saved: list[Any]) -> EpochLoss:
        total, count, exact = saved
        return cls(total, count, exact)


class TrainEpoch:
    """The running training epoch's numbers: its ``EpochLoss``, the sums of the values the
    model logs, and the train metrics (clones of the loop's, updated with what each step's
    output mode returns); each step's reduced over the step (the fit's ``Layout``, passed with
    it) and over the run's instances (``processes``)."""

    def __init__(
        self,
        *,
        metrics: dict[str, Metric],
        metric_output: Callable[[object], object] | None,
        returns: Returns,
        processes: Processes,
        state: State,
    ) -> None:
        self.metrics = {k: m.clone() for k, m in metrics.items()}
        self.metric_output = metric_output
        self.returns = returns
        self.processes = processes
        self.state = state  # the loop's State: the step an error names
        self.loss = EpochLoss()
        self.logged: dict[str, list] = {}  # name -> [sum of micro-batch values, how many]

    def reset(self) -> None:
        """A new epoch starts: nothing summed yet."""
        self.loss = EpochLoss()
        self.logged = {}
        for m in self.metrics.values():
            m.reset()

    def step_loss(self, loss: torch.Tensor, layout: Layout, *, check_finite: bool) -> StepLoss:
        """The step's loss over the run: what the executor returned (a host tensor) reduced
        over the step (``layout``, the fit's), then summed over the instances; with
        ``check_finite``, a non-finite one on another instance (this one's finite) stops this
        instance too."""
        mine = layout.step_loss(loss)
        if self.processes.size == 1:  # one instance: the run's loss is its own
            return StepLoss(*mine)
        total, count = self.processes.sum([mine.total, mine.count], "summing the step's loss")
        if check_finite and not math.isfinite(total) and math.isfinite(mine.total):
            st = self.state
            raise NonFiniteLossError(
                f"Non-finite loss {total} at epoch {st.epoch}, step {st.step} "
                "(0-based host call) on another instance (this one's was finite): that "
                "instance names the micro-batch. Lower the learning rate, check the data, or "
                "pass check_finite=False."
            )
        return StepLoss(total, int(count), mine.exact)

    def add(self, step: StepLoss) -> float:
        """Add a step's loss (``step_loss``) to the epoch's; returns the step's mean."""
        loss = self.loss
        loss.total += step.total
        loss.count += step.count
        loss.exact = loss.exact and step.exact
        return step.total / step.count

    def add_logs(self, logs: Mapping, layout: Layout) -> dict[str, float]:
        """The values the model logged in a step (``Returns.split``), reduced over the step
        (``layout``) as the loss is and added to the epoch's sums; returns their step means, by
        name."""
        names, sums = self.returns.step_logs(logs, layout, self.metrics)
        sums = self.processes.sum(sums, "summing the step's logged values")
        means = {}
        for i, name in enumerate(names):
            total = sums[2 * i]
            count = sums[2 * i + 1]
            means[name] = total / count
            acc = self.logged.setdefault(name, [0.0, 0])
            acc[0] += total
            acc[1] += count
        return means

    def update_metrics(self, output: object, labels: torch.Tensor, layout: Layout) -> None:
        """Update the train metrics with a step's output and the labels aligned to it
        (``layout``, the fit's)."""
        aligned = layout.align(labels)
        if self.metric_output is not None:
            output = self.metric_output(output)
        for m in self.metrics.values():
            m.update(output, aligned)

    def logs(self) -> dict[str, float]:
        """The epoch's logs: ``train_loss``, ``train_<metric>`` and ``train_<logged name>``;
        none when no step ran (a cancelled epoch). Whether they are estimates is the fit's
        output mode's (``mark_estimates``)."""
        loss = self.loss
        if not loss.count:
            return {}
        logs = {"train_loss": loss.total / loss.count}
        logs.update(metric_logs("train_", self.metrics))  # host-side: no sync
        logs.update({"train_" + k: t / n for k, (t, n) in self.logged.items() if n})
        return logs

    def state_dict(self) -> dict[str, Any]:
        """The running epoch's sums and train metrics, as a checkpoint holds them."""
        return {
            "epoch_loss": self.loss.to_list(),
            "epoch_logs": {k: list(v) for k, v in self.logged.items()},
            "metrics": {
                k: {
                    **{
                        n: v.clone() if isinstance(v, torch.Tensor) else v
                        for n, v in metric_state(m).items()
                    },
                    # how many updates made the state: a resumed metric computes without
                    # torchmetrics' warning of a compute before any update
                    "_update_count": getattr(m, "_update_count", 1),
                }
                for k, m in self.metrics.items()
            },
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Put back what ``state_dict`` took (the metrics a checkpoint names)."""
        self.loss = EpochLoss.from_list(sd["epoch_loss"])
        self.logged = {k: list(v) for k, v in sd.get("epoch_logs", {}).items()}
        for k, m in self.metrics.items():
            for n, v in sd.get("metrics", {}).get(k, {}).items():
                setattr(m, n, v)


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


class Validation:
    """One validation run's numbers: val_loss (the mean loss per sample), the metrics and
    ``val_<name>`` of each value the model logs (``Returns``).

    The loader is padded to whole host calls with copies of the last sample (a stream's as
    it ends): only the samples count. The device's loss covers the micro-batches without
    padding; the samples of the one with padding get ``loss_fn`` on the host (their outputs
    are here) when there is one, and are left out of val_loss otherwise (with a warning).
    A logged value is the mean over the micro-batches without padding (one value each, as in
    training). ``warned`` holds the one-time warnings already given by this loop.
    """

    def __init__(
        self,
        plan: Measured,
        *,
        metrics: dict[str, Metric],
        metric_output: Callable[[object], object] | None,
        loss_fn: Callable | None,
        warned: set,
        returns: Returns,
    ) -> None:
        self.layout = plan.layout
        self.micro = plan.micro
        self.combined = plan.combined
        self.metrics = metrics
        self.metric_output = metric_output
        self.loss_fn = loss_fn
        self.warned = warned
        self.returns = returns
        self.total = 0.0  # the loss summed over the samples it covers
        self.count = 0  # those samples
        self.uncovered = 0  # samples left out of val_loss (padding in their micro-batch)
        self.logged: dict[str, list] = {}  # name -> [sum, micro-batches] of a logged value
        self.unlogged = 0  # samples in micro-batches with padding: no logged value covers them
        for m in metrics.values():
            m.reset()

    def add(self, result: object, labels: object, valid: int) -> None:
        """One inference call's result (its loss and logs where ``returns`` finds them), of
        which the first ``valid`` samples are samples and the rest padding."""
        layout = self.layout
        micro = self.micro
        combined = self.combined
        output, loss, logs = self.returns.split(result)
        if not (
            isinstance(loss, torch.Tensor)
            and loss.numel() == layout.micro_batches
            and loss.is_floating_point()
        ):  # not a loss per micro-batch: all output
            output = result
            loss = None
            logs = None
        whole = valid // micro * micro  # samples in micro-batches without padding
        if loss is not None:
            loss = layout.input_rows(loss.reshape(-1))  # one per micro-batch of samples
            if valid < combined:  # the padded call: its whole micro-batches of samples
                loss = loss[: valid // micro]
            self.total += float(loss.double().sum()) * micro  # host tensor: no device sync
            self.count += whole
            if valid > whole and self.loss_fn is not None:  # the rest: exactly, on the host
                part = map_tensors(
                    output,
                    lambda t: t if t.dim() == 0 else _float32(layout.input_rows(t)[whole:valid]),
                )
                with torch.no_grad():
                    rest = self.loss_fn(part, map_tensors(labels, lambda t: t[whole:valid]))
                self.total += float(rest) * (valid - whole)
                self.count += valid - whole
            else:
                self.uncovered += valid - whole
        elif "no_val_loss" not in self.warned:
            # e.g. ``if self.training: return x, loss`` / ``return x``: no loss in eval mode
            self.warned.add("no_val_loss")
            warnings.warn(
                "In eval mode the model returns its output without a loss, so "
                "validation logs no val_loss (metrics are still computed). "
                "Return (output, loss) whenever labels are given to get one.",
                stacklevel=3,
            )
        if logs is not None:
            if logs.keys() != self.logged.keys():
                check_logged(logs, self.metrics, "validation: ")
                self.returns.logged.update(logs)
            for name, value in logs.items():
                rows = layout.input_rows(value.reshape(-1))[: valid // micro]  # host tensor
                acc = self.logged.setdefault(name, [0.0, 0])
                acc[0] += float(rows.double().sum())
                acc[1] += rows.numel()
            self.unlogged += valid - whole
        if self.metrics and valid:  # All mode, [DI, RF, B]: the host batch's order, per input
            # group (several processes: a call may be all padding)
            output = map_tensors(
                output, lambda t: t if t.dim() == 0 else layout.input_rows(t)[:valid]
            )
            if valid < combined:
                labels = map_tensors(labels, lambda t: t[:valid])
            if self.metric_output is not None:
                output = self.metric_output(output)
            for m in self.metrics.values():
                m.update(output, labels)

    def logs(self, processes: Processes, suffix: str = "") -> dict[str, float]:
        """val_loss (when any sample has a loss), ``val_<metric>`` and ``val_<logged name>``,
        each summed over the instances of ``processes`` that validated; with ``suffix`` (one
        of several validation sets), each as ``<name>/<suffix>``."""
        names = sorted(self.logged)  # (the same on every instance)
        values = [
            self.total,
            self.count,
            self.uncovered,
            self.unlogged,
            *(x for n in names for x in self.logged[n]),
        ]
        values = processes.sum(values, "summing val logs")
        total = values[0]
        count = int(values[1])
        uncovered = int(values[2])
        unlogged = int(values[3])
        if uncovered and "partial_val_loss" not in self.warned:
            self.warned.add("partial_val_loss")
            warnings.warn(
                f"val_loss covers {count} of the {count + uncovered} validation samples: the "
                f"last {uncovered} share a micro-batch of {self.micro} with padding, whose loss "
                "the device computes over both. Pass loss_fn= to Loop (then the loop computes "
                "the loss of those samples on the host), or use a micro-batch size that divides "
                "the sample count.",
                stacklevel=4,
            )
        if unlogged and names and "partial_val_logs" not in self.warned:
            self.warned.add("partial_val_logs")
            warnings.warn(
                f"{', '.join('val_' + n for n in names)}: the mean over the micro-batches "
                f"without padding; the last {unlogged} samples share a micro-batch of "
                f"{self.micro} with padding, whose value the device computes over both, and "
                "are left out. Use a micro-batch size that divides the sample count to count "
                "them.",
                stacklevel=4,
            )
        logs = {"val_loss": total / count} if count else {}
        logs.update(metric_logs("val_", self.metrics))
        for i, name in enumerate(names):
            logged, samples = values[4 + 2 * i], values[5 + 2 * i]
            if samples:
                logs["val_" + name] = logged / samples
        return {f"{k}/{suffix}": v for k, v in logs.items()} if suffix else logs


class Predictions:
    """A predict run's outputs: each call's collected, then joined in sample order without
    the padding (which only the last call holds: ``Plan.counted``)."""

    def __init__(self, layout: Layout, dataset: object) -> None:
        self.layout = layout
        self.dataset = dataset
        self.outputs: list[Any] = []
        self.samples = 0

    def add(self, output: object, samples: int) -> None:
        """One call's outputs, of which the first ``samples`` are samples' (the rest padding)."""
        self.outputs.append(output)
        self.samples += samples

    def result(self) -> Any:
        if not self.outputs:
            raise ValueError(
                f"loader yielded no samples: {type(self.dataset).__name__} "
                "was empty. predict needs at least one sample."
            )
        return concat(self.outputs, slice(None, self.samples), self.layout.input_rows)


def concat(parts: list, keep: Any, rows: Any) -> Any:
    """Per-call outputs (tensors, or tuples, lists, namedtuples and dicts of them) joined
    along the samples, each call's rows put in host-batch order by ``rows``, then indexed
    by ``keep`` (a slice, or a boolean mask over the rows)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([rows(p).reshape(-1) if p.dim() == 0 else rows(p) for p in parts])[keep]
    if isinstance(first, dict):
        return type(first)((k, concat([p[k] for p in parts], keep, rows)) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # a namedtuple
        return type(first)(*(concat(list(col), keep, rows) for col in zip(*parts)))
    if isinstance(first, (tuple, list)):
        return type(first)(concat(list(col), keep, rows) for col in zip(*parts))
    return parts  # not a tensor: one value per call, as returned


class SetMetrics:
    """The validation metrics of each validation set: the loop's own for one loader, else
    clones of them kept per set (each set has its own states); a validation of a hook inside
    a fit (``nested``) has states of its own too (the fit's may be running)."""

    def __init__(self, metrics: dict[str, Any]) -> None:
        self.metrics = metrics
        self.sets: dict[str, dict[str, Any]] = {}

    def of(self, suffix: str, *, nested: bool = False) -> dict[str, Any]:
        """The metrics of the set ``suffix`` ("" for one loader)."""
        if not suffix and not nested:
            return self.metrics
        key = f"(nested){suffix}" if nested else suffix
        if key not in self.sets:
            self.sets[key] = {k: m.clone() for k, m in self.metrics.items()}
        return self.sets[key]
