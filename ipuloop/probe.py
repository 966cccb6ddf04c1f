"""The host probe: one micro-batch through the model on the host, before anything compiles.

So that wrong labels, a loss that is not a scalar, a logged value that is not one, or a metric
that rejects the output fail before the first step, naming the shapes and dtypes received.
Each check is a function of its own (``_check_...``), run in order by ``probe``. Under
``precision="16-mixed"``, ``probe_plan`` then hands the micro-batch as sent to the 16-mixed
advice (``mixed_advice.check_mixed``).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Protocol, cast

import torch
from torch.overrides import TorchFunctionMode

from .accumulators import Metric
from .feed import Feed
from .mixed_advice import check_mixed
from .modes import kept_weights
from .outputs import Returns, WithLoss, check_logged
from .rules import NO_HALF_KERNEL, in_float32_as_float16

__all__ = ["shape", "probe", "probe_plan", "MicroBatch", "Probed"]


def shape(x: object) -> str:
    """A value's dtype and shape for messages, e.g. "float32 [4, 6]"."""
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')} {list(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} ({', '.join(shape(v) for v in x)})"
    if isinstance(x, dict):
        return f"{type(x).__name__} {{{', '.join(f'{k!r}: {shape(v)}' for k, v in x.items())}}}"
    return type(x).__name__


class Probed(Protocol):
    """What the probe reads of a loader as the loop runs it (a ``plan.Plan``)."""

    @property
    def name(self) -> str: ...  # the loader's name in messages ("train_loader")

    def first_micro_batches(self) -> list[Any]: ...  # none when the dataset cannot be indexed

    def check_shapes(self, batches: list[Any]) -> None: ...  # all of the first one's shapes


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the probe runs it: the model's call ``(*args, **kwargs)``, its
    labels, the loader's ``name`` for messages and ``label_key``, the key of a dict batch's
    labels (fed as that keyword)."""

    args: tuple
    kwargs: dict[str, object]
    labels: object
    name: str
    label_key: str = "labels"

    def describe(self) -> str:
        """The batch as the model sees it, e.g. "inputs (float32 [4, 6]) and labels int64 [4]"
        (keyword inputs: "keyword inputs {'input_ids': int64 [4, 8], ...}", labels among them)."""
        if self.kwargs:
            return f"keyword inputs {shape(self.kwargs)}"
        inputs = self.args[:-1]
        return (
            f"input{'s' if len(inputs) != 1 else ''} ({', '.join(shape(x) for x in inputs)}) "
            f"and labels {shape(self.labels)}"
        )


def probe_plan(
    model: torch.nn.Module,
    plan: Probed,
    feed: Feed,
    *,
    copy_float: bool,
    metrics: dict[str, Metric],
    metric_output: Callable[[object], object] | None,
    returns: Returns,
    mixed: bool = False,
) -> None:
    """``probe`` the first micro-batch of ``plan``, made the model's call by ``feed`` in float32;
    a dataset that cannot be indexed is not probed. ``mixed``: under "16-mixed", then the
    16-mixed advice (``mixed_advice.check_mixed``) with the float inputs as sent."""
    first = _first_micro_batch(plan, feed, mixed=mixed)
    if first is None:
        return
    micro, sent = first
    probe(
        model,
        micro,
        copy_float=copy_float,
        metrics=metrics,
        metric_output=metric_output,
        returns=returns,
        loop_loss=issubclass(type(model), WithLoss),
    )
    if sent is not None:
        check_mixed(model, *sent)


def _first_micro_batch(
    plan: Probed, feed: Feed, *, mixed: bool
) -> tuple[MicroBatch, tuple[tuple, dict[str, object]] | None] | None:
    """The first micro-batch of ``plan`` as the probe runs it (float32) and, ``mixed``, its
    inputs as sent (float16), once the first few have been checked to have one shape; None when
    the dataset cannot be indexed."""
    batches = plan.first_micro_batches()
    if not batches:
        return None
    plan.check_shapes(batches)
    batch = batches[0]
    args, kwargs, labels = feed.split(batch, plan.name, cast=False)  # float32
    sent = feed.split(batch, plan.name)[:2] if mixed else None  # float16, as sent
    micro = MicroBatch(
        args=args, kwargs=kwargs, labels=labels, name=plan.name, label_key=feed.label_key
    )
    return micro, sent


def probe(
    model: torch.nn.Module,
    micro: MicroBatch,
    *,
    copy_float: bool,
    metrics: dict[str, Metric],
    metric_output: Callable[[object], object] | None,
    returns: Returns,
    loop_loss: bool = False,
) -> None:
    """Check one micro-batch on the host before anything is compiled (float32; buffers and
    the host RNG as they were): the model must return a scalar loss where ``returns`` looks
    for it, and the values it logs must be named and sized as logs. ``copy_float``: run a
    float32 copy (16-bit weights). ``loop_loss``: the loop computes the loss (``loss_fn=``)."""
    _check_batch_sizes(micro)
    if copy_float:  # a float32 copy: the host may have no float16 kernels
        model = copy.deepcopy(model).float()  # (torch 2.0.1's CPU has no float16 matmul)
    out, caught = _run(model, micro)
    output, loss, logs = returns.split(out)
    _check_loss_returned(model, micro, out, loss, returns)
    _check_loss_scalar(out, output, loss, returns)
    _check_logs(logs, metrics, micro.name)
    if loop_loss:
        _check_loop_loss_shapes(output, micro)
    _check_warnings(caught, micro, output)
    _probe_metrics(output, micro.labels, metrics, metric_output)


def _check_batch_sizes(micro: MicroBatch) -> None:
    """Every input tensor has the labels' batch size (keyword inputs without labels: the
    first input's) on dimension 0."""
    labels = micro.labels
    n = labels.shape[0] if isinstance(labels, torch.Tensor) and labels.dim() else None
    named = list(micro.kwargs.items()) if micro.kwargs else list(enumerate(micro.args[:-1]))
    for i, x in named:
        if not (isinstance(x, torch.Tensor) and x.dim()):
            continue
        if n is None:  # keyword inputs without labels: the first input's samples
            n = x.shape[0]
        elif x.shape[0] != n:
            raise ValueError(
                f"{micro.name}: input {i!r} has batch size {x.shape[0]} but "
                f"{'the labels have' if labels is not None else 'the others'} "
                f"{n}. Every tensor in a batch must have the samples on "
                "dimension 0."
            )


def _run(model: torch.nn.Module, micro: MicroBatch) -> tuple[object, list[warnings.WarningMessage]]:
    """The model's return value for ``micro`` and the warnings it gave, run without gradients,
    its weights, buffers and the host RNG put back; a failure is raised naming what it was
    given."""
    try:
        with kept_weights(model) as put_back, torch.no_grad(), torch.random.fork_rng(devices=[]):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = _forward(model, micro, put_back, caught)
    except Exception as e:  # name what the model was given: usually the labels are wrong
        raise _model_error(e, micro) from e
    return out, caught


def _forward(
    model: torch.nn.Module,
    micro: MicroBatch,
    put_back: Callable[[], None],
    caught: list[warnings.WarningMessage],
) -> object:
    """``model(*args, **kwargs)`` in the modes it trains in (each module's as the user set it);
    where the host has no float16 kernel for an op (torch 2.0's CPU: matmul, convolution),
    again from the weights as they were (``put_back``), as the device computes such an op."""
    try:
        return model(*micro.args, **micro.kwargs)
    except RuntimeError as e:
        if NO_HALF_KERNEL not in str(e):
            raise
    put_back()
    del caught[:]
    with _HostFloat16():
        return model(*micro.args, **micro.kwargs)


def _model_error(e: Exception, micro: MicroBatch) -> ValueError:
    """The error for a model that failed on the probe's micro-batch, with what it was given."""
    return ValueError(
        f"{micro.name}: the model failed on the first micro-batch, run on the host before "
        f"compilation, with {micro.describe()}: {type(e).__name__}: {e}.{_feed_hint(e, micro)}"
    )


def _feed_hint(e: Exception, micro: MicroBatch) -> str:
    """How to feed a dict batch that ``forward`` refused (``e``) a keyword of; "" otherwise."""
    key = micro.label_key
    if not (micro.kwargs and isinstance(e, TypeError)):
        return ""
    if f"argument '{key}'" in str(e):
        return (
            f" The batch's labels are under label_key={key!r}, fed as "
            f"{key}=, which forward does not take, so it received no labels= (a "
            "Transformers model computes its loss only from labels=). Name the key as "
            "forward's parameter, labels: rename it in the dataset (a Hugging Face "
            f"dataset: dataset.rename_column({key!r}, 'labels')) or in the "
            "collate_fn, and leave Loop(label_key=) at its default 'labels'."
        )
    if "keyword argument" in str(e):
        return (
            " A dict batch is fed as keyword arguments, so each of its keys must be "
            "a parameter of forward: leave the others out in the dataset (a Hugging "
            "Face dataset: remove_columns) or the collate_fn."
        )
    return ""


def _check_loss_returned(
    model: torch.nn.Module, micro: MicroBatch, out: object, loss: object, returns: Returns
) -> None:
    """The model returned a loss where ``returns`` looks for it."""
    if isinstance(loss, torch.Tensor):
        return
    key = micro.label_key
    if _labels_swallowed(model, micro.kwargs, key):
        raise ValueError(
            f"{micro.name}: the model returned no loss ({shape(out)}), and its forward received "
            f"no labels=: the batch's labels are under label_key={key!r}, so forward was "
            f"called with {key}=, which its **kwargs took in. A Transformers model "
            "computes its loss only from labels=. Name the key labels: rename it in the "
            f"dataset (a Hugging Face dataset: dataset.rename_column({key!r}, "
            "'labels')) or in the collate_fn, and leave Loop(label_key=) at its default "
            "'labels'."
        )
    given = "with labels" if micro.labels is not None else "in training"
    raise ValueError(
        f"{given.capitalize()}, the model must return "
        f"{returns.describe()}. Received: {shape(out)}. Write forward(self, *inputs, "
        "labels=None) returning (output, loss) when labels are given, or pass a plain "
        "model with loss_fn=."
    )


def _check_loss_scalar(out: object, output: object, loss: torch.Tensor, returns: Returns) -> None:
    """The loss is a scalar per micro-batch (a (loss, logits) return is named as such)."""
    if loss.numel() == 1:
        return
    hint = ""
    if (
        returns.key == "loss"
        and isinstance(out, (tuple, list))
        and isinstance(output, torch.Tensor)
        and output.numel() == 1
    ):
        hint = (
            " The first element is a scalar: a model returning (loss, logits), as "
            "Transformers models do with return_dict=False, needs Loop(loss_key=0)."
        )
    raise ValueError(
        f"The loss must be a scalar per micro-batch. Received a loss of "
        f"shape {list(loss.shape)}: reduce it (mean or sum).{hint}"
    )


def _check_logs(logs: object, metrics: dict[str, Metric], name: str) -> None:
    """The values the model logs are named as logs and scalars per micro-batch."""
    if logs is None:
        return
    check_logged(logs, metrics, f"{name}: ")
    for k, v in cast("dict[str, torch.Tensor]", logs).items():
        if v.numel() != 1:
            raise ValueError(
                f"{name}: the logged value {k!r} has shape {list(v.shape)}: "
                "a logged value must be a scalar per micro-batch (reduce it, "
                "e.g. .mean()), which the loop reduces over the step as it "
                "reduces the loss."
            )


def _check_loop_loss_shapes(output: object, micro: MicroBatch) -> None:
    """Where the loop computes the loss (``loss_fn=``), float labels ``[N]`` against an output
    ``[N, 1]`` are refused: they would broadcast to ``[N, N]`` in it. (A model-with-loss
    computes its own and may reshape them, ``out.squeeze(-1)``: only a loss that torch reports
    as broadcasting is refused there, ``_check_warnings``.)"""
    labels = micro.labels
    if (
        isinstance(output, torch.Tensor)
        and isinstance(labels, torch.Tensor)
        and labels.is_floating_point()
        and output.dim() == labels.dim() + 1
        and output.shape[-1] == 1
        and output.shape[:-1] == labels.shape
    ):
        raise ValueError(
            f"{micro.name}: outputs of shape {list(output.shape)} and labels of shape "
            f"{list(labels.shape)} would broadcast to {list(output.shape[:-1]) * 2} in the "
            "loss. Give the labels shape [N, 1] (e.g. y.unsqueeze(-1)) or squeeze the "
            "output."
        )


def _check_warnings(
    caught: list[warnings.WarningMessage], micro: MicroBatch, output: object
) -> None:
    """Warn again what the model's run warned, but a loss that broadcasts the labels: torch's
    losses only warn of it, and it is an error."""
    for w in caught:
        if "different to the input size" in str(w.message):
            raise ValueError(
                f"{micro.name}: the loss would broadcast the labels against the output "
                f"({w.message}), with {micro.describe()} and an output of shape "
                f"{shape(output)}. Give the labels the output's shape."
            )
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


class _HostFloat16(TorchFunctionMode):
    """Runs an op that the host has no float16 kernel for (torch 2.0's CPU has no float16
    matmul or convolution) in float32, its result rounded to float16, as a float16 op on the
    device returns it; every other op as it is. The probe runs a float16 model in it when
    the host cannot run it alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if NO_HALF_KERNEL not in str(e):
                raise
        return in_float32_as_float16(func, args, kwargs)


def _labels_swallowed(model: torch.nn.Module, kwargs: dict[str, object], label_key: str) -> bool:
    """Whether a dict batch's labels went to ``forward`` under another name than the
    ``labels=`` it takes (a Transformers model's), into its ``**kwargs``."""
    if not kwargs or label_key == "labels" or label_key not in kwargs:
        return False
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # (no signature to read)
        return False
    return label_key not in params and any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )


def _probe_metrics(
    output: object,
    labels: object,
    metrics: dict[str, Metric],
    metric_output: Callable[[object], object] | None,
) -> None:
    """Update a copy of each metric with the probe's output, so a metric that rejects it
    (another task, shape or class count; a tuple output) fails before compiling."""
    given_output = output if metric_output is None else metric_output(output)
    for name, metric in metrics.items():
        try:
            copy.deepcopy(metric).update(given_output, labels)
        except Exception as e:
            given = (
                shape(output)
                if metric_output is None
                else f"{shape(output)}, given as {shape(given_output)} by metric_output"
            )
            raise ValueError(
                f"metrics[{name!r}] ({type(metric).__name__}) rejects the model's output: "
                f"update(output, labels) with output {given} and labels {shape(labels)} "
                f"raised {type(e).__name__} ({e}). Metrics receive the output the model "
                "returns with its loss; pass metric_output= (e.g. lambda out: out[0]) to "
                "give them another, or build the metric for this output."
            ) from e
