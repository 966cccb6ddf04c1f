"""The host probe: one micro-batch through the model on the host, before anything compiles.

So that wrong labels, a loss that is not a scalar, a logged value that is not one, or a metric
that rejects the output fail before the first step, naming the shapes and dtypes received.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch

from .outputs import Returns, WithLoss, check_logged

__all__ = ["shape", "probe", "probe_plan"]


def shape(x: Any) -> str:
    """A value's dtype and shape for messages, e.g. "float32 [4, 6]"."""
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')} {list(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} ({', '.join(shape(v) for v in x)})"
    if isinstance(x, dict):
        return f"{type(x).__name__} {{{', '.join(f'{k!r}: {shape(v)}' for k, v in x.items())}}}"
    return type(x).__name__


def _describe(args: tuple, kwargs: dict, labels: Any) -> str:
    """The batch as the model sees it, e.g. "inputs (float32 [4, 6]) and labels int64 [4]"
    (keyword inputs: "keyword inputs {'input_ids': int64 [4, 8], ...}", the labels among them)."""
    if kwargs:
        return f"keyword inputs {shape(kwargs)}"
    inputs = args[:-1]
    return (
        f"input{'s' if len(inputs) != 1 else ''} ({', '.join(shape(x) for x in inputs)}) "
        f"and labels {shape(labels)}"
    )


def probe_plan(
    model: torch.nn.Module,
    plan: Any,
    feed: Any,
    *,
    copy_float: bool,
    metrics: dict[str, Any],
    metric_output: Callable | None,
    returns: Returns,
) -> None:
    """``probe`` the first micro-batch of ``plan`` (a ``plan.Plan``), made the model's call by
    ``feed`` (``plan.Feed``) in float32; a dataset that cannot be indexed is not probed."""
    batch = plan.first_micro_batch()
    if batch is None:
        return
    args, kwargs, labels = feed.split(batch, plan.name, cast=False)  # float32
    probe(
        model,
        args,
        kwargs,
        labels,
        plan.name,
        copy_float=copy_float,
        metrics=metrics,
        metric_output=metric_output,
        returns=returns,
        loop_loss=issubclass(type(model), WithLoss),
    )


def probe(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    labels: Any,
    name: str,
    *,
    copy_float: bool,
    metrics: dict[str, Any],
    metric_output: Callable | None,
    returns: Returns,
    loop_loss: bool = False,
) -> None:
    """Check one micro-batch on the host before anything is compiled (float32; buffers and
    the host RNG as they were): ``model(*args, **kwargs)`` must return a scalar loss where
    ``returns`` looks for it, and the values it logs must be named and sized as logs.
    ``copy_float``: run a float32 copy (16-bit weights).

    ``loop_loss``: the loop computes the loss (``loss_fn=``), so float labels ``[N]`` against
    an output ``[N, 1]`` are refused: they would broadcast to ``[N, N]`` in it. A
    model-with-loss computes its own and may reshape them (``out.squeeze(-1)``): only a loss
    that torch reports as broadcasting is refused there."""
    n = labels.shape[0] if isinstance(labels, torch.Tensor) and labels.dim() else None
    named = list(kwargs.items()) if kwargs else list(enumerate(args[:-1]))
    for i, x in named:
        if not (isinstance(x, torch.Tensor) and x.dim()):
            continue
        if n is None:  # keyword inputs without labels: the first input's samples
            n = x.shape[0]
        elif x.shape[0] != n:
            raise ValueError(
                f"{name}: input {i!r} has batch size {x.shape[0]} but "
                f"{'the labels have' if labels is not None else 'the others'} "
                f"{n}. Every tensor in a batch must have the samples on "
                "dimension 0."
            )
    if copy_float:  # a float32 copy: the host may have no float16 kernels
        model = copy.deepcopy(model).float()  # (torch 2.0.1's CPU has no float16 matmul)
    saved = [b.clone() for b in model.buffers()]
    was_training = model.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.train()
                out = model(*args, **kwargs)
    except Exception as e:  # name what the model was given: usually the labels are wrong
        hint = ""
        if kwargs and isinstance(e, TypeError) and "keyword argument" in str(e):
            hint = (
                " A dict batch is fed as keyword arguments, so each of its keys must be "
                "a parameter of forward: leave the others out in the dataset (a Hugging "
                "Face dataset: remove_columns) or the collate_fn."
            )
        raise ValueError(
            f"{name}: the model failed on the first micro-batch, run on the host before "
            f"compilation, with {_describe(args, kwargs, labels)}: {type(e).__name__}: "
            f"{e}.{hint}"
        ) from e
    finally:
        with torch.no_grad():
            for b, s in zip(model.buffers(), saved):
                b.copy_(s)
        model.train(was_training)
    output, loss, logs = returns.split(out)
    if not isinstance(loss, torch.Tensor):
        given = "with labels" if labels is not None else "in training"
        raise ValueError(
            f"{given.capitalize()}, the model must return "
            f"{returns.describe()}. Received: {shape(out)}. Write forward(self, *inputs, "
            "labels=None) returning (output, loss) when labels are given, or pass a plain "
            "model with loss_fn=."
        )
    if loss.numel() != 1:
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
    if logs is not None:
        check_logged(logs, metrics, f"{name}: ")
        for k, v in logs.items():
            if v.numel() != 1:
                raise ValueError(
                    f"{name}: the logged value {k!r} has shape {list(v.shape)}: "
                    "a logged value must be a scalar per micro-batch (reduce it, "
                    "e.g. .mean()), which the loop reduces over the step as it "
                    "reduces the loss."
                )
    if (
        loop_loss
        and isinstance(output, torch.Tensor)
        and isinstance(labels, torch.Tensor)
        and labels.is_floating_point()
        and output.dim() == labels.dim() + 1
        and output.shape[-1] == 1
        and output.shape[:-1] == labels.shape
    ):
        raise ValueError(
            f"{name}: outputs of shape {list(output.shape)} and labels of shape "
            f"{list(labels.shape)} would broadcast to {list(output.shape[:-1]) * 2} in the "
            "loss. Give the labels shape [N, 1] (e.g. y.unsqueeze(-1)) or squeeze the "
            "output."
        )
    for w in caught:  # torch's losses only warn when the labels broadcast: that is an error
        if "different to the input size" in str(w.message):
            raise ValueError(
                f"{name}: the loss would broadcast the labels against the output "
                f"({w.message}), with {_describe(args, kwargs, labels)} and an output of shape "
                f"{shape(output)}. Give the labels the output's shape."
            )
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    _probe_metrics(output, labels, metrics, metric_output)


def _probe_metrics(
    output: Any, labels: Any, metrics: dict[str, Any], metric_output: Callable | None
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
