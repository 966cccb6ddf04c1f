"""Host-side numbers: metrics and their logs, validation loss, and the host probe before compiling.

The probe runs one micro-batch through the model on the host, so that wrong labels, a loss
that is not a scalar or a metric that rejects the output fail before anything compiles.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch

from .outputs import Returns, check_logged, map_tensors

__all__ = ["resolve_metrics", "metric_logs", "metric_state", "shape", "probe", "Validation"]


def resolve_metrics(metrics: Any, metric_output: Any = None) -> dict[str, Any]:
    """``Loop``'s ``metrics`` as a dict, checked with its ``metric_output``."""
    if metric_output is not None and not callable(metric_output):
        raise TypeError(f"metric_output must be a function of the model's output. "
                        f"Received: metric_output={metric_output!r}.")
    if metrics is None:
        return {}
    if not hasattr(metrics, "items"):
        raise TypeError("metrics must be a dict of torchmetrics metrics or a "
                        f"MetricCollection. Received: {type(metrics).__name__}.")
    out = dict(metrics.items())
    for name, m in out.items():
        if not (hasattr(m, "update") and hasattr(m, "compute") and hasattr(m, "reset")):
            raise TypeError(f"metrics[{name!r}] must be a torchmetrics Metric. Received: "
                            f"{type(m).__name__}.")
    return out


def metric_logs(prefix: str, metrics: dict[str, Any]) -> dict[str, float]:
    """Each metric's ``compute()`` as log entries: ``<prefix><name>``, and for a metric that
    returns several values (per class, a dict) ``<prefix><name>_<index or key>``."""
    logs: dict[str, float] = {}

    def put(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{key}_{k}", v)
        elif isinstance(value, (tuple, list)) or (isinstance(value, torch.Tensor)
                                                  and value.numel() != 1):
            for i, v in enumerate(value.reshape(-1) if isinstance(value, torch.Tensor)
                                  else value):
                put(f"{key}_{i}", v)
        else:
            logs[key] = float(value)

    for name, m in metrics.items():
        put(prefix + name, m.compute())
    return logs


def metric_state(metric: Any) -> dict[str, Any]:
    """A torchmetrics metric's state by name (``metric_state``, which torchmetrics 1.0 lacks)."""
    return {name: getattr(metric, name) for name in metric._defaults}


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
    return (f"input{'s' if len(inputs) != 1 else ''} ({', '.join(shape(x) for x in inputs)}) "
            f"and labels {shape(labels)}")


def probe(model: torch.nn.Module, args: tuple, kwargs: dict, labels: Any, name: str, *,
          copy_float: bool, metrics: dict[str, Any], metric_output: Callable | None,
          returns: Returns, loop_loss: bool = False) -> None:
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
            raise ValueError(f"{name}: input {i!r} has batch size {x.shape[0]} but "
                             f"{'the labels have' if labels is not None else 'the others'} "
                             f"{n}. Every tensor in a batch must have the samples on "
                             "dimension 0.")
    if copy_float:  # a float32 copy: the host may have no float16 kernels
        model = copy.deepcopy(model).float()  # (torch 2.0.1's CPU has no float16 matmul)
    saved = [b.clone() for b in model.buffers()]
    was_training = model.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.train()
            out = model(*args, **kwargs)
    except Exception as e:  # name what the model was given: usually the labels are wrong
        hint = ""
        if kwargs and isinstance(e, TypeError) and "keyword argument" in str(e):
            hint = (" A dict batch is fed as keyword arguments, so each of its keys must be "
                    "a parameter of forward: leave the others out in the dataset (a Hugging "
                    "Face dataset: remove_columns) or the collate_fn.")
        raise ValueError(
            f"{name}: the model failed on the first micro-batch, run on the host before "
            f"compilation, with {_describe(args, kwargs, labels)}: {type(e).__name__}: "
            f"{e}.{hint}") from e
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
            "model with loss_fn=.")
    if loss.numel() != 1:
        hint = ""
        if returns.key == "loss" and isinstance(out, (tuple, list)) and \
                isinstance(output, torch.Tensor) and output.numel() == 1:
            hint = (" The first element is a scalar: a model returning (loss, logits), as "
                    "Transformers models do with return_dict=False, needs Loop(loss_key=0).")
        raise ValueError(f"The loss must be a scalar per micro-batch. Received a loss of "
                         f"shape {list(loss.shape)}: reduce it (mean or sum).{hint}")
    if logs is not None:
        check_logged(logs, metrics, f"{name}: ")
        for k, v in logs.items():
            if v.numel() != 1:
                raise ValueError(f"{name}: the logged value {k!r} has shape {list(v.shape)}: "
                                 "a logged value must be a scalar per micro-batch (reduce it, "
                                 "e.g. .mean()), which the loop reduces over the step as it "
                                 "reduces the loss.")
    if (loop_loss and isinstance(output, torch.Tensor) and isinstance(labels, torch.Tensor)
            and labels.is_floating_point() and output.dim() == labels.dim() + 1
            and output.shape[-1] == 1 and output.shape[:-1] == labels.shape):
        raise ValueError(
            f"{name}: outputs of shape {list(output.shape)} and labels of shape "
            f"{list(labels.shape)} would broadcast to {list(output.shape[:-1]) * 2} in the "
            "loss. Give the labels shape [N, 1] (e.g. y.unsqueeze(-1)) or squeeze the "
            "output.")
    for w in caught:  # torch's losses only warn when the labels broadcast: that is an error
        if "different to the input size" in str(w.message):
            raise ValueError(
                f"{name}: the loss would broadcast the labels against the output "
                f"({w.message}), with {_describe(args, kwargs, labels)} and an output of shape "
                f"{shape(output)}. Give the labels the output's shape.")
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    _probe_metrics(output, labels, metrics, metric_output)


def _probe_metrics(output: Any, labels: Any, metrics: dict[str, Any],
                   metric_output: Callable | None) -> None:
    """Update a copy of each metric with the probe's output, so a metric that rejects it
    (another task, shape or class count; a tuple output) fails before compiling."""
    given_output = output if metric_output is None else metric_output(output)
    for name, metric in metrics.items():
        try:
            copy.deepcopy(metric).update(given_output, labels)
        except Exception as e:
            given = (shape(output) if metric_output is None
                     else f"{shape(output)}, given as {shape(given_output)} by metric_output")
            raise ValueError(
                f"metrics[{name!r}] ({type(metric).__name__}) rejects the model's output: "
                f"update(output, labels) with output {given} and labels {shape(labels)} "
                f"raised {type(e).__name__} ({e}). Metrics receive the output the model "
                "returns with its loss; pass metric_output= (e.g. lambda out: out[0]) to "
                "give them another, or build the metric for this output.") from e


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

    def __init__(self, plan: Any, metrics: dict[str, Any], metric_output: Callable | None,
                 loss_fn: Callable | None, warned: set, returns: Returns) -> None:
        self.layout, self.micro, self.combined = plan.layout, plan.micro, plan.combined
        self.metrics, self.metric_output, self.loss_fn = metrics, metric_output, loss_fn
        self.warned, self.returns = warned, returns
        self.total, self.count, self.uncovered = 0.0, 0, 0
        self.logged: dict[str, list] = {}  # name -> [sum, micro-batches] of a logged value
        self.unlogged = 0  # samples in micro-batches with padding: no logged value covers them
        for m in metrics.values():
            m.reset()

    def add(self, result: Any, labels: Any, valid: int) -> None:
        """One inference call's result (its loss and logs where ``returns`` finds them), of
        which the first ``valid`` samples are samples and the rest padding."""
        layout, micro, combined = self.layout, self.micro, self.combined
        output, loss, logs = self.returns.split(result)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == layout.micro_batches
                and loss.is_floating_point()):  # not a loss per micro-batch: all output
            output, loss, logs = result, None, None
        whole = valid // micro * micro  # samples in micro-batches without padding
        if loss is not None:
            loss = layout.input_rows(loss.reshape(-1))  # one per micro-batch of samples
            if valid < combined:  # the padded call: its whole micro-batches of samples
                loss = loss[:valid // micro]
            self.total += float(loss.double().sum()) * micro  # host tensor: no device sync
            self.count += whole
            if valid > whole and self.loss_fn is not None:  # the rest: exactly, on the host
                part = map_tensors(output, lambda t: t if t.dim() == 0 else
                                   _float32(layout.input_rows(t)[whole:valid]))
                with torch.no_grad():
                    rest = self.loss_fn(part, map_tensors(labels, lambda t: t[whole:valid]))
                self.total += float(rest) * (valid - whole)
                self.count += valid - whole
            else:
                self.uncovered += valid - whole
        elif "no_val_loss" not in self.warned:
            # e.g. ``if self.training: return x, loss`` / ``return x``: no loss in eval mode
            self.warned.add("no_val_loss")
            warnings.warn("In eval mode the model returns its output without a loss, so "
                          "validation logs no val_loss (metrics are still computed). "
                          "Return (output, loss) whenever labels are given to get one.",
                          stacklevel=3)
        if logs is not None:
            if logs.keys() != self.logged.keys():
                check_logged(logs, self.metrics, "validation: ")
                self.returns.logged.update(logs)
            for name, value in logs.items():
                rows = layout.input_rows(value.reshape(-1))[:valid // micro]  # host tensor
                acc = self.logged.setdefault(name, [0.0, 0])
                acc[0] += float(rows.double().sum())
                acc[1] += rows.numel()
            self.unlogged += valid - whole
        if self.metrics and valid:  # All mode, [DI, RF, B]: the host batch's order, per input
            # group (several processes: a call may be all padding)
            output = map_tensors(output, lambda t: t if t.dim() == 0
                                 else layout.input_rows(t)[:valid])
            if valid < combined:
                labels = map_tensors(labels, lambda t: t[:valid])
            if self.metric_output is not None:
                output = self.metric_output(output)
            for m in self.metrics.values():
                m.update(output, labels)

    def logs(self, sums: Callable | None = None) -> dict[str, float]:
        """val_loss (when any sample has a loss), ``val_<metric>`` and ``val_<logged name>``;
        ``sums`` adds up a list of numbers over the instances of a multi-process run."""
        names = sorted(self.logged)  # (the same on every instance)
        values = [self.total, self.count, self.uncovered, self.unlogged,
                  *(x for n in names for x in self.logged[n])]
        if sums is not None:
            values = sums(values)
        total, count, uncovered, unlogged = values[0], int(values[1]), int(values[2]), \
            int(values[3])
        if uncovered and "partial_val_loss" not in self.warned:
            self.warned.add("partial_val_loss")
            warnings.warn(
                f"val_loss covers {count} of the {count + uncovered} validation samples: the "
                f"last {uncovered} share a micro-batch of {self.micro} with padding, whose loss "
                "the device computes over both. Pass loss_fn= to Loop (then the loop computes "
                "the loss of those samples on the host), or use a micro-batch size that divides "
                "the sample count.", stacklevel=4)
        if unlogged and names and "partial_val_logs" not in self.warned:
            self.warned.add("partial_val_logs")
            warnings.warn(
                f"{', '.join('val_' + n for n in names)}: the mean over the micro-batches "
                f"without padding; the last {unlogged} samples share a micro-batch of "
                f"{self.micro} with padding, whose value the device computes over both, and "
                "are left out. Use a micro-batch size that divides the sample count to count "
                "them.", stacklevel=4)
        logs = {"val_loss": total / count} if count else {}
        logs.update(metric_logs("val_", self.metrics))
        for i, name in enumerate(names):
            total, count = values[4 + 2 * i], values[5 + 2 * i]
            if count:
                logs["val_" + name] = total / count
        return logs
