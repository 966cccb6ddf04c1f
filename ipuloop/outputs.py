"""What a model returns and what a host call returns: its loss, its output and the values it logs.

``WithLoss`` gives a model and a loss function the ``(output, loss)`` return of a
model-with-loss; ``Returns`` says where a model's return value holds its loss, its output and
the scalars it logs. A training call over a host batch laid out ``[DI, GA, RF/g, B]`` returns
(docs/poptorch-semantics.md §2.2): All: every micro-batch, ``[DI, GA, RF]``; EveryN(N): iterations d
with (d+1) % N == 0; Final: the last micro-batch of each replica; Sum: per replica, the sum
over DI*GA. A scalar loss becomes ``[n]`` only when that count n is > 1.

``Layout`` is that shape of a host call, built from the options (``Layout.of``);
``Layout.step_loss`` reduces the loss, and each logged scalar the same way, over a step.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, NamedTuple

import torch

from .backend import poptorch_module
from .exceptions import NonFiniteLossError
from .rules import ALL, DEFAULT, EVERY_N, FINAL, SUM, returned_iterations, returned_rows
from .state import COUNTERS, ESTIMATED

__all__ = [
    "WithLoss",
    "MarkLoss",
    "Layout",
    "StepLoss",
    "MODE_NAMES",
    "map_tensors",
    "non_finite_error",
    "FLOAT16_MAX",
    "Returns",
    "check_logged",
    "RESERVED_LOGS",
    "loss_fn_state",
    "weights_for",
]

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


class WithLoss(torch.nn.Module):
    """``model`` plus ``loss_fn`` as a model-with-loss: ``forward(*inputs[, labels])``.

    Called with ``num_inputs`` inputs it returns ``output``; with one more argument, the
    labels, it returns ``(output, loss_fn(output, labels))``. Called with keyword inputs (a
    dict batch), the labels are the ``label_key`` one, if given: the model gets the others.
    The loss runs after the model's
    last layer, so it joins the block started last (``BeginBlock``/``Stage`` placement; after a
    ``with poptorch.Block(...)`` has ended no op may run, so such a model computes its loss
    itself, inside its last block). On the device the loss is marked
    with ``identity_loss`` (reduction "none": the value unchanged), so that PopTorch finds it
    whether ``loss_fn`` is a torch loss function or hand-written arithmetic.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Callable,
        num_inputs: int = 1,
        label_key: str = "labels",
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs
        self.label_key = label_key

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            if self.label_key not in kwargs:
                return self.model(*args, **kwargs)
            labels = kwargs.pop(self.label_key)  # (a dict of this call's own)
            output = self.model(*args, **kwargs)
        elif len(args) == self.num_inputs:
            return self.model(*args)
        elif len(args) != self.num_inputs + 1:
            raise TypeError(
                f"expected {self.num_inputs} input(s) and optionally the labels. "
                f"Received {len(args)} arguments."
            )
        else:
            labels = args[-1]
            output = self.model(*args[:-1])
        loss = self.loss_fn(output, labels)
        pt = poptorch_module()
        if pt.isRunningOnIpu():  # in the device graph, a loss PopTorch finds whatever loss_fn does
            loss = pt.identity_loss(loss, reduction="none")
        return output, loss


class MarkLoss:
    """A forward hook that makes the loss a model-with-loss returns the loss that trains.

    PopTorch trains the graph's final loss: a torch loss function's output or an
    ``identity_loss``, not arithmetic done after it, so a model returning ``0.25 * ce`` or
    ``ce + 0.01 * l2`` would train ``ce`` alone (docs/poptorch-semantics.md, the loss). While
    the device runs the model (``isRunningOnIpu()``, as PopTorch traces it, and each call on
    the emulator), the hook marks the returned loss with ``identity_loss(loss, "none")``, which
    folds the losses it is made of into it: the value the loop logs is the value that trains.
    On the host (the probe, plain torch) it changes nothing. A class, so a model holding it
    pickles; the loop holds it only while a fit runs (``Executors.marking_loss``)."""

    def __init__(self, returns: Returns) -> None:
        self.returns = returns
        self.active = True  # False while inference models run (validation, predict)
        self.handle: Any = None  # its registration: removed once no mark is needed

    def __call__(self, module: torch.nn.Module, args: Any, out: Any) -> Any:
        if not self.active:
            return None
        pt = poptorch_module()
        if not pt.isRunningOnIpu():
            return None
        _, loss, _ = self.returns.split(out)
        if not isinstance(loss, torch.Tensor) or is_a_loss(loss):
            # none where the loop looks for one, or the graph's loss already: the model
            # returns the same on each call, so the hook leaves (a module with a forward hook
            # takes torch's slower call path, once per micro-batch on the emulator)
            if self.handle is not None:
                self.handle.remove()
            return None
        return self.returns.with_loss(out, pt.identity_loss(loss, reduction="none"))


def is_a_loss(t: torch.Tensor) -> bool:
    """Whether ``t`` is made by a loss op (a torch loss function, ``identity_loss``), read from
    its autograd node: nothing was computed after the graph's loss, so it needs no mark (a
    model whose ``with poptorch.Block`` has ended may run no op after it)."""
    name = type(t.grad_fn).__name__ if t.grad_fn is not None else ""
    return "Loss" in name or name.startswith("BinaryCrossEntropy")


def loss_fn_state(network: torch.nn.Module) -> dict[str, Any]:
    """The state of the loss function a ``WithLoss`` holds (a module's buffers or parameters,
    e.g. ``CrossEntropyLoss(weight=)``); empty for anything else."""
    loss_fn = getattr(network, "loss_fn", None) if isinstance(network, WithLoss) else None
    return dict(loss_fn.state_dict()) if isinstance(loss_fn, torch.nn.Module) else {}


def weights_for(
    network: torch.nn.Module,
    model: torch.nn.Module,
    weights: Mapping[str, Any],
    loss_state: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``weights`` keyed for ``network``, what runs: ``model`` itself, or the ``WithLoss`` the
    loop wrapped it in. ``weights`` is a ``state_dict`` of ``model`` (what a checkpoint holds;
    the loss function's state is ``loss_state``, else its own), or one of ``network`` (a
    checkpoint written when checkpoints held the wrapper's ``model.``-prefixed keys), taken
    as it is."""
    if network is model or not set(weights) <= set(model.state_dict()):
        return dict(weights)
    loss = loss_fn_state(network) if loss_state is None else loss_state
    return {
        **{f"model.{k}": v for k, v in weights.items()},
        **{f"loss_fn.{k}": v for k, v in loss.items()},
    }


# Names a logged value may not take: the loss and the counters (the logs' other keys in
# CSVLogger rows and ModelCheckpoint filenames)
RESERVED_LOGS = frozenset({"loss", ESTIMATED, *COUNTERS})


class Returns:
    """Where a model's return value holds its loss, its output and the scalars it logs.

    With ``loss_key`` a str (default "loss"): ipuloop's ``(output, loss)`` and
    ``(output, loss, logs)`` tuples (``logs`` a dict of scalars), and a dict-like output (a
    dict, a Transformers ``ModelOutput``) with the loss under ``loss_key`` and the logs, if
    any, under "logs". With ``loss_key`` an int: a tuple whose element ``loss_key`` is the loss
    (0 for Transformers' ``(loss, logits, ...)``). The output is what remains: one value
    alone, several as a tuple (a dict for a dict-like output), as Transformers' ``Trainer``
    gives its predictions. Nothing is inferred from shapes.
    """

    def __init__(self, loss_key: str | int = "loss") -> None:
        if not (isinstance(loss_key, str) and loss_key) and (
            not isinstance(loss_key, int) or isinstance(loss_key, bool)
        ):
            raise TypeError(
                f"loss_key must be a str (the loss's key in a dict-like output) or "
                f"an int (its index in a tuple output, e.g. 0 for (loss, logits)). "
                f"Received: loss_key={loss_key!r}."
            )
        self.key = loss_key
        self._pairs = isinstance(loss_key, str)  # (output, loss) tuples are ipuloop's
        self.logged: set[str] = set()  # the names of the values the model has logged
        self._names: list[str] = []  # those of the last training step

    def split(self, out: Any) -> tuple[Any, Any, Any]:
        """``(output, loss, logs)`` of a model's return value; ``loss`` is None when ``out``
        holds none by these conventions (then ``output`` is ``out``), ``logs`` when it logs
        nothing."""
        if self._pairs and type(out) is tuple and len(out) == 2:  # the common case, first
            return out[0], out[1], None
        key: Any = self.key  # an int (an index) unless a str (a key): ``_pairs``
        if not self._pairs:
            if isinstance(out, (tuple, list)) and -len(out) <= key < len(out):
                rest = [v for i, v in enumerate(out) if i != key % len(out)]
                return (rest[0] if len(rest) == 1 else tuple(rest)), out[key], None
            return out, None, None
        if isinstance(out, (tuple, list)):
            if len(out) == 2:
                return out[0], out[1], None
            if len(out) == 3 and isinstance(out[2], Mapping):
                return out[0], out[1], out[2]
            return out, None, None
        if isinstance(out, Mapping) and out.get(key) is not None:
            kept = {k: v for k, v in out.items() if k != key and k != "logs"}
            output = next(iter(kept.values())) if len(kept) == 1 else kept
            return output, out[key], out.get("logs")
        return out, None, None

    def with_loss(self, out: Any, loss: torch.Tensor) -> Any:
        """``out`` with ``loss`` in the place ``split`` found its loss (the same structure)."""
        if isinstance(out, Mapping):
            marked = dict(out)
            marked[self.key] = loss  # (a str key: ``split`` found it there)
            kind: Any = type(out)
            if kind is not dict:  # a Transformers ModelOutput, an OrderedDict: rebuilt
                try:
                    return kind(**marked)
                except TypeError:
                    return kind(marked)
            return marked
        key: Any = self.key if not self._pairs else 1  # (an int: the tuple's index)
        items = list(out)
        items[key] = loss
        if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple
            return type(out)(*items)
        return type(out)(items)

    def step_logs(self, logs: Mapping, layout: Layout, metrics: Any) -> tuple[list, list]:
        """A step's logged values (checked when their names change), each reduced as
        ``layout`` reduces the loss: their names, in one order on every instance, and the
        ``[sum, count]`` of each, one flat list."""
        names = sorted(logs)
        if names != self._names:
            check_logged(logs, metrics)
            self._names = names
            self.logged.update(names)
        return names, [x for n in names for x in layout.step_loss(logs[n], repr(n))[:2]]

    def describe(self) -> str:
        """The conventions, for messages."""
        if not self._pairs:
            return f"a tuple whose element {self.key} is the loss (loss_key={self.key})"
        return (
            f"(output, loss), (output, loss, logs) or a dict-like output with the loss "
            f"under {self.key!r}"
        )


def check_logged(logs: object, metrics: Container[str] = (), where: str = "") -> None:
    """Raise ``ValueError`` unless ``logs`` (what a model returns to be logged) is a dict of
    names to tensors, each name a plain identifier that no other log of the loop uses."""
    if not isinstance(logs, Mapping):
        raise ValueError(
            f"{where}the values a model logs must be a dict of names to scalar "
            f"tensors, e.g. (output, loss, {{'acc': acc}}). Received: "
            f"{type(logs).__name__}."
        )
    for name, value in logs.items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(
                f"{where}a logged value's name must be an identifier (it becomes "
                f"the log <name>, train_<name> and val_<name>). Received: {name!r}."
            )
        clash = (
            "the loop's own logs or counters"
            if name in RESERVED_LOGS
            else "the train_/val_ prefixes of epoch logs"
            if name.startswith(("train_", "val_"))
            else "a metric's name"
            if name in metrics
            else None
        )
        if clash is not None:
            raise ValueError(
                f"{where}the logged value {name!r} would clash with {clash}. Give it another name."
            )
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{where}the logged value {name!r} must be a tensor (computed on "
                f"the device). Received: {type(value).__name__}."
            )


class StepLoss(NamedTuple):  # a tuple: made once per training step, at a tuple's cost
    total: float  # sum of the micro-batch losses this step's output stands for
    count: int  # type: ignore[assignment]  # how many micro-batch losses ``total`` sums
    # (a field of that name hides tuple.count, which a step loss has no use for)
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

    @classmethod
    def of(cls, opts: Any, training: bool) -> Layout:  # noqa: FBT001 (plan.py calls it so)
        """The shape of one host call under ``opts`` (``poptorch.Options``)."""
        return cls(
            di=opts.device_iterations,
            ga=opts.Training.gradient_accumulation if training else 1,
            rf=opts.replication_factor,
            mode=opts.output_mode,
            period=max(opts.output_return_period, 1),
            group=opts.input_group_size,
            orthogonal=int(opts.input_cgt) == 2,
        )

    @property
    def input_groups(self) -> int:
        return max(self.rf // self.group, 1)

    @property
    def micro_batches(self) -> int:
        """Micro-batches one call runs, all replicas together."""
        return self.di * self.ga * self.rf

    def returned_iterations(self) -> list[int]:
        return returned_iterations(self.mode, self.di, self.period)

    def step_loss(self, loss: torch.Tensor, what: str = "loss") -> StepLoss:
        """Reduce the returned loss tensor (already on the host) to a step loss (``what``: a
        logged value's name, reduced the same way)."""
        try:
            n = loss.numel()
        except AttributeError:  # e.g. None: the return value holds no loss where it looks
            raise ValueError(
                f"The model returned no {what} where the loop looks for it "
                "(Loop(loss_key=...)): received "
                f"{type(loss).__name__}."
            ) from None
        if n != self._returned:  # a value per micro-batch comes back as one per row
            raise ValueError(
                f"The model's {what} came back from the step as {n} value(s), where a scalar "
                f"per micro-batch gives {self._returned} under this output mode: it is "
                "not a scalar per micro-batch"
                + (". Check where Loop(loss_key=...) looks for the loss" if what == "loss" else "")
                + f" (shape {list(loss.shape)})."
            )
        # Host tensor: no device sync; needed for the log. Summed in float64 (exact for a
        # single value, which float() reads without creating tensors).
        total = float(loss) if n == 1 else float(loss.sum(dtype=torch.float64))
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

    @property
    def exact(self) -> bool:
        """Whether a call returns every micro-batch's loss (All, Sum; Final and EveryN only
        when they return each one): else the logs computed from it are estimates."""
        return self._loss_count[1]

    @cached_property
    def _returned(self) -> int:
        """How many values a returned loss holds: one per row."""
        return len(self.rows)

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
            raise ValueError(
                "OutputMode.Sum returns per-replica sums of the outputs, not "
                "per-sample outputs, so per-sample metrics cannot be computed. "
                "Use OutputMode.All (exact) or Final, or drop the metrics."
            )
        groups = self.input_groups
        slots = self.di * self.ga * groups
        if (
            self.rf == groups
            and labels.dim()
            and labels.shape[0] % slots == 0
            and (self.mode == ALL or (self.mode == EVERY_N and self.period == 1))
        ):
            return labels  # every micro-batch in host-batch order: the labels as they are
        b = labels.shape[0] // slots
        x = labels.reshape(self.di, self.ga, groups, b, *labels.shape[1:])
        if self.rf != groups:  # replicas of a group read the same inputs
            idx = [(r % groups) if self.orthogonal else (r // self.group) for r in range(self.rf)]
            x = x[:, :, idx]
        if self.mode == FINAL:
            x = x[-1:, -1:]
        elif self.mode == EVERY_N and self.period > 1:
            x = x[self.period - 1 :: self.period]
        return x.reshape(-1, *labels.shape[1:])


FLOAT16_MAX = 65504.0  # the largest finite float16


def _data_finding(batch: Any, *, half: bool) -> str | None:
    """What in the host ``batch`` ((inputs..., labels), or a dict) explains a non-finite loss:
    non-finite values, or (``half``: sent as float16) values beyond float16's range; None if
    nothing."""
    if isinstance(batch, Mapping):  # keyword inputs, the labels among them
        parts = [(f"input {k!r}", x) for k, x in batch.items()]
    else:
        parts = list(batch) if isinstance(batch, (tuple, list)) else [batch]
        parts = [
            ("the labels" if i == len(parts) - 1 and len(parts) > 1 else f"input {i}", x)
            for i, x in enumerate(parts)
        ]
    for name, x in parts:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()):
            continue
        what = f"{name} of this step's host batch " + ("have" if name == "the labels" else "has")
        if not bool(torch.isfinite(x).all()):
            return (
                f"{what} NaN or infinite values: clean the data (or leave such samples "
                "out in the dataset)"
            )
        biggest = float(x.abs().max())
        if half and biggest > FLOAT16_MAX:
            return (
                f"{what} values up to {biggest:.6g}, beyond "
                f"float16's range (largest {FLOAT16_MAX:g}): sent as float16 they became "
                "infinite. Scale them into range (normalise the data), or train with "
                'precision="32"'
            )
    return None


def _float16_cause(precision: str, loss_scaling: float | None, last_loss: float | None) -> str:
    """Why a 16-bit step whose data is in range gives a non-finite loss, as exactly as known."""
    text = (
        f"The step runs in float16 (precision={precision!r}), whose largest value is "
        f"{FLOAT16_MAX:g}, and its host batch is within that range: "
    )
    if loss_scaling is not None and loss_scaling > 1:
        scaled = math.inf if last_loss is None else abs(last_loss) * loss_scaling
        if last_loss is not None and math.isfinite(scaled) and scaled > FLOAT16_MAX:
            return text + (
                f"the last finite step loss, {last_loss:.6g}, times the optimizer's "
                f"loss_scaling={loss_scaling:g} is {scaled:.6g}, beyond it, so the gradients "
                "overflowed and the update wrote inf or NaN into the weights. Lower "
                f"loss_scaling (below {FLOAT16_MAX / abs(last_loss):.4g} for that loss)."
            )
        return text + (
            f"the loss is multiplied by the optimizer's loss_scaling={loss_scaling:g} before "
            f"the backward pass, so a gradient above {FLOAT16_MAX / loss_scaling:.4g} "
            "overflows and the update writes inf or NaN into the weights; or an activation "
            "overflowed. Lower loss_scaling (or the learning rate)."
        )
    return text + (
        "an activation, the loss or a gradient overflowed it, or an update made "
        "the weights non-finite. Scale the inputs or the loss down, lower the "
        'learning rate, or train with precision="32".'
    )


def non_finite_error(
    loss: torch.Tensor,
    layout: Layout,
    epoch: int,
    step: int,
    *,
    batch: Any = None,
    precision: str = "32",
    loss_scaling: float | None = None,
    last_loss: float | None = None,
) -> NonFiniteLossError:
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
    where = (
        f"Non-finite loss {float(flat[i])} at epoch {epoch}, step {step} (0-based host "
        f"call), {what} {m} of the step "
        + (
            f"(device iteration {d}, accumulation step {a}, replica {r})."
            if layout.mode != SUM
            else "(a replica's sum over the step; OutputMode.All names the micro-batch)."
        )
    )
    half = precision != "32"
    finding = None if batch is None else _data_finding(batch, half=half)
    if finding is not None:
        why = f" The data explains it: {finding}."
    elif half:
        why = " " + _float16_cause(precision, loss_scaling, last_loss)
    else:
        why = " Lower the learning rate, or check the data."
    return NonFiniteLossError(where + why + " (Or pass check_finite=False.)")
