"""The host probe: one micro-batch through the model on the host, before anything compiles.

So that wrong labels, a loss that is not a scalar, a logged value that is not one, or a metric
that rejects the output fail before the first step, naming the shapes and dtypes received.
Under ``precision="16-mixed"`` it also runs the micro-batch as the device gets it (float
inputs float16, weights float32), recording in which dtype each matmul and convolution
computes, and warns when most compute in float32 (``check_mixed``).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from .outputs import Returns, WithLoss, check_logged
from .rules import NO_HALF_KERNEL, in_float32_as_float16

__all__ = ["shape", "probe", "probe_plan", "check_mixed", "MixedDtypes"]


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
    mixed: bool = False,
) -> None:
    """``probe`` the first micro-batch of ``plan`` (a ``plan.Plan``), made the model's call by
    ``feed`` (``feed.Feed``) in float32; a dataset that cannot be indexed is not probed.
    ``mixed``: under "16-mixed", then ``check_mixed`` with the float inputs as sent."""
    batch = plan.first_micro_batch()
    if batch is None:
        return
    args, kwargs, labels = feed.split(batch, plan.name, cast=False)  # float32
    if mixed:
        sent_args, sent_kwargs, _ = feed.split(batch, plan.name)  # float16, as sent
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
        label_key=feed.label_key,
    )
    if mixed:
        check_mixed(model, sent_args, sent_kwargs)


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
    label_key: str = "labels",
) -> None:
    """Check one micro-batch on the host before anything is compiled (float32; buffers and
    the host RNG as they were): ``model(*args, **kwargs)`` must return a scalar loss where
    ``returns`` looks for it, and the values it logs must be named and sized as logs.
    ``copy_float``: run a float32 copy (16-bit weights). ``label_key``: the key of a dict
    batch's labels, fed as that keyword.

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
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:  # in the modes it trains in: each module's as the user set it
                    out = model(*args, **kwargs)
                except RuntimeError as e:
                    if NO_HALF_KERNEL not in str(e):
                        raise
                    # the host has no float16 kernel for an op (torch 2.0's CPU: matmul,
                    # convolution): run it again as the device computes such an op
                    _restore(model, saved)
                    del caught[:]
                    with _HostFloat16():
                        out = model(*args, **kwargs)
    except Exception as e:  # name what the model was given: usually the labels are wrong
        hint = ""
        if kwargs and isinstance(e, TypeError) and f"argument '{label_key}'" in str(e):
            hint = (
                f" The batch's labels are under label_key={label_key!r}, fed as "
                f"{label_key}=, which forward does not take, so it received no labels= (a "
                "Transformers model computes its loss only from labels=). Name the key as "
                "forward's parameter, labels: rename it in the dataset (a Hugging Face "
                f"dataset: dataset.rename_column({label_key!r}, 'labels')) or in the "
                "collate_fn, and leave Loop(label_key=) at its default 'labels'."
            )
        elif kwargs and isinstance(e, TypeError) and "keyword argument" in str(e):
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
        _restore(model, saved)
    output, loss, logs = returns.split(out)
    if not isinstance(loss, torch.Tensor) and _labels_swallowed(model, kwargs, label_key):
        raise ValueError(
            f"{name}: the model returned no loss ({shape(out)}), and its forward received no "
            f"labels=: the batch's labels are under label_key={label_key!r}, so forward was "
            f"called with {label_key}=, which its **kwargs took in. A Transformers model "
            "computes its loss only from labels=. Name the key labels: rename it in the "
            f"dataset (a Hugging Face dataset: dataset.rename_column({label_key!r}, "
            "'labels')) or in the collate_fn, and leave Loop(label_key=) at its default "
            "'labels'."
        )
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


def _restore(model: torch.nn.Module, saved: list[torch.Tensor]) -> None:
    """Put back the buffers ``saved`` before a host run (BatchNorm statistics)."""
    with torch.no_grad():
        for b, s in zip(model.buffers(), saved):
            b.copy_(s)


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


def _labels_swallowed(model: torch.nn.Module, kwargs: dict, label_key: str) -> bool:
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


# torch functions (by name) that multiply matrices or convolve: what 16-bit precision speeds up
_MATMULS = frozenset(
    {
        "linear",
        "bilinear",
        "matmul",
        "mm",
        "bmm",
        "mv",
        "addmm",
        "addbmm",
        "baddbmm",
        "addmv",
        "einsum",
        "scaled_dot_product_attention",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
    }
)


def _floats(tensors: list[Any]) -> list[torch.Tensor]:
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]


class MixedDtypes(TorchFunctionMode):
    """Runs ops as a 16-mixed device computes them and records their dtypes.

    Each op follows torch's type promotion: float16 and float32 tensors in one op (an add, a
    cat) give float32 (a 0-dimensional tensor does not promote). Where torch refuses to mix
    them (matmul, convolution, normalisation), the op takes its first floating operand's
    dtype, the activation's, as PopTorch computes it; where the host has no float16 kernel,
    it computes in float32 and rounds to float16. ``matmuls``: the dtype of each matmul and
    convolution, in order; ``promoted``: the first op whose float16 operand met a float32 one
    and gave float32, as ``(op, float32 operand)``; ``names``: parameters and buffers by
    storage, to name that operand."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names
        self.matmuls: list[tuple[str, torch.dtype]] = []
        self.promoted: tuple[str, str] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        floats = _floats(tree_flatten((args, kwargs))[0])
        try:
            out = func(*args, **kwargs)
        except RuntimeError:
            if not floats:
                raise
            target = floats[0].dtype  # PopTorch: the first floating operand's dtype

            def up(t: Any) -> Any:
                return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

            def down(t: Any) -> Any:
                return t.to(target) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

            out = tree_map(down, func(*tree_map(up, args), **tree_map(up, kwargs)))
        name = getattr(func, "__name__", str(func)).strip("_")  # (Tensor.__add__: "add")
        result = _floats(tree_flatten(out)[0])
        if not result:
            return out
        if name in _MATMULS:
            self.matmuls.append((name, result[0].dtype))
        if (
            self.promoted is None
            and result[0].dtype == torch.float32
            and any(t.dtype == torch.float16 and t.dim() for t in floats)
        ):
            wides = [t for t in floats if t.dtype == torch.float32]
            wide = next((t for t in wides if _storage(t) in self.names), wides[0])
            what = self.names.get(_storage(wide))
            self.promoted = (
                name,
                f"{what} (float32 {list(wide.shape)})"
                if what
                else f"a float32 tensor {list(wide.shape)}",
            )
        return out


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, AttributeError):  # (a tensor without storage)
        return -1


def check_mixed(model: torch.nn.Module, args: tuple, kwargs: dict) -> MixedDtypes | None:
    """Run one micro-batch (float inputs float16, as sent under "16-mixed") through the model
    on the host, recording the dtype of each op (``MixedDtypes``; buffers and the host RNG
    as they were), and warn when most matmuls and convolutions compute in float32: a float32
    parameter or buffer mixed into the activations (a class token, a position embedding)
    promotes every op after it. A model that fails this run (an op the host cannot compute
    this way) is not checked: the float32 probe has passed. Returns the record (None then)."""
    names: dict[int, str] = {}
    own: Any = model.model if issubclass(type(model), WithLoss) else model  # (the user's names)
    for kind, named in (("parameter", own.named_parameters()), ("buffer", own.named_buffers())):
        for n, t in named:
            if t.is_floating_point() and t.dtype == torch.float32:
                names.setdefault(_storage(t), f"the {kind} {n!r}")
    record = MixedDtypes(names)
    saved = [b.clone() for b in model.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the float32 probe has shown them)
            with record:  # (each module in the mode it trains in)
                model(*args, **kwargs)
    except Exception:  # noqa: BLE001 (a model that runs in float32 may fail here in float16)
        return None
    finally:
        _restore(model, saved)
    wide = [n for n, dtype in record.matmuls if dtype == torch.float32]
    if 2 * len(wide) <= len(record.matmuls):
        return record
    if record.promoted is not None:
        op, operand = record.promoted
        where = (
            f"The first op that promoted float16 activations to float32 is {op!r}, where "
            f"{operand} met them: every op after it computes in float32. To compute them in "
            "float16, cast that tensor to the activations' dtype in forward (e.g. "
            "x + self.pos_embed.to(x.dtype))"
        )
    else:
        where = (
            "No float16 input reached them: the activations start as float32 (an embedding "
            "of integer inputs gives float32 activations from its float32 weights). To "
            "compute them in float16, cast the activations in forward (e.g. "
            "self.embed(ids).to(torch.float16))"
        )
    warnings.warn(
        f'precision="16-mixed": {len(wide)} of the model\'s {len(record.matmuls)} matmuls '
        "and convolutions compute in float32, run on the host with the first micro-batch as "
        "the device gets it (float inputs float16, weights float32). An op follows torch's "
        "type promotion: float16 with a float32 tensor gives float32. "
        f'{where}, or use precision="16-true" (float16 weights). docs/precision.md says '
        "what each precision computes in float16.",
        stacklevel=5,
    )
    return record
