"""``Loop``'s arguments resolved once: training and inference ``Options``, precision, metrics.

``Loop`` resolves here what its arguments ask of the options (replicas, seed, precision,
clipping, the output mode) and checks its model, metrics and ``fit``'s counts. The training
options freeze when the first ``fit`` starts, after the ``on_configure`` hooks; from then on
the loader, the output layout, the logs and the executor all read that one object.
"""

from __future__ import annotations

import contextlib
import random
import re
import warnings
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader

from .feed import Feed
from .outputs import MODE_NAMES, Returns, WithLoss
from .poptorch_types import Options
from .rules import (
    ALL,
    DEFAULT,
    EVERY_N,
    MAX_IPUS,
    SUM,
    check_int,
    check_return_period,
    ipu_count_error,
    reserved_ipus,
    uses_ipu_model,
)

__all__ = [
    "OptionsBuilder",
    "LoopArgs",
    "Resolved",
    "resolve",
    "PRECISIONS",
    "resolve_options",
    "resolve_precision",
    "check_model_dtype",
    "set_replicas",
    "seed_options",
    "check_optimizer_arg",
    "set_clipping",
    "resolve_output_mode",
    "resolve_metrics",
    "inference_options",
    "check_fit_args",
    "check_val_every",
    "val_sets",
    "warn_no_epochs",
]

PRECISIONS = ("32", "16-mixed", "16-true")
# Lightning's spellings: PL 1.x took 16/32 (16 = mixed), lightning-graphcore "32-true"/"16-mixed".
_PRECISION_ALIASES = {
    32: "32",
    "32": "32",
    "32-true": "32",
    16: "16-mixed",
    "16": "16-mixed",
    "16-mixed": "16-mixed",
    "16-true": "16-true",
}


@runtime_checkable
class OptionsBuilder(Protocol):
    """What ``opts=`` may be besides ``poptorch.Options``: an object that builds them and
    knows the IPUs a replica uses, as ``ipuloop.IPUConfig`` does. The loop calls these two
    methods and names no such class: the integrations sit above the kernel."""

    def to_options(self, *, for_inference: bool = False) -> Any: ...

    def ipus_used(self, *, for_inference: bool = False) -> int: ...


@dataclass(frozen=True)
class LoopArgs:
    """``Loop``'s arguments as given, recorded once: what ``resolve`` and the loop's parts read.

    Attributes:
        model: a model-with-loss (``forward(*inputs, labels)`` returns ``(output, loss)``,
            and ``output`` without labels), or a plain model together with ``loss_fn``.
        opts: ``poptorch.Options`` (never modified: the loop clones it), an
            ``ipuloop.IPUConfig``, or None for defaults.
        optimizer: one optimizer over the model's parameters (``poptorch.optim`` or
            ``torch.optim`` SGD/Adam/AdamW/RMSprop); None gives PopTorch's SGD(lr=0.01). A
            ``torch.optim`` one runs on the device as its ``poptorch.optim`` twin, which
            follows its hyper-parameters, and gets the state back after each fit (so
            checkpoints hold it).
        loss_fn: makes ``model`` a model-with-loss (``loss_fn(output, labels)``).
        metrics: torchmetrics metrics (a dict or ``MetricCollection``), computed on the host
            from what the device returns, logged as ``train_<name>`` and ``val_<name>``. Each
            gets ``update(output, labels)``: ``output`` is what the model returns beside its
            loss (for the samples the output mode returns), labels aligned to it. Checked on
            the host before compiling: a metric that rejects the output fails there.
        metric_output: a function of that ``output`` giving what the metrics receive instead,
            e.g. ``lambda out: out[0]`` for a model whose output is a tuple.
        callbacks: ``Callback`` instances; a progress display is added unless ``progress``
            is False.
        replicas: data-parallel replicas (``replicationFactor``), or "auto" (on IPUs, the
            most the system has room for; 1 on the emulator). Checked before compiling as
            PopTorch checks the IPUs it reserves: a power of 2 (unless autoRoundNumIPUs or
            the IPU Model), at most 64 IPUs, and no more than the system has.
        inference_opts: options for validation and predict; default: the training options
            without their training-only settings (``ipuloop.loop_options.inference_options``).
        seed: seeds python, numpy, torch and the device (``Options.randomSeed``).
        check_finite: raise ``NonFiniteLossError`` on a NaN or infinite returned loss.
        precision: "32" (default), "16-mixed" or "16-true" (Lightning's 32, 16, "32-true"
            are accepted: 16 means mixed), the same on the emulator and on an IPU: float
            inputs are sent as float16; "16-true" also makes the weights float16
            (docs/precision.md says how mixed ops compute). Loss scaling is static: set
            ``loss_scaling`` on a ``poptorch.optim`` optimizer.
        max_grad_norm: clip the global gradient norm on the device; sets the
            ``max_grad_norm`` of a ``poptorch.optim`` SGD/Adam/AdamW (the optimizers that
            can clip on the IPU) and rejects any other optimizer.
        label_key: the key of the labels in a dict batch (Transformers' "labels").
        loss_key: the loss's key in a dict-like output ("loss", as Transformers'), or its
            index in a tuple (0 for Transformers' ``(loss, logits)``; by default a tuple is
            ``(output, loss)``).
        async_data: read every torch ``DataLoader`` ahead, as ``DataLoaderMode.Async`` does
            (True, or a dict of its ``async_options``, e.g. ``{"buffer_size": 4}``): the same
            batches in the same order as reading synchronously (a ``poptorch.DataLoader``
            keeps its own mode).
    """

    model: torch.nn.Module
    opts: object
    optimizer: torch.optim.Optimizer | None
    loss_fn: Callable | None
    metrics: object
    metric_output: Callable | None
    callbacks: Any  # an iterable of Callback instances
    replicas: int | str | None
    inference_opts: object
    seed: int | None
    progress: bool | int
    check_finite: bool
    max_grad_norm: float | None
    precision: str | int
    label_key: str
    loss_key: str | int
    async_data: bool | dict

    @classmethod
    def of(cls, given: dict[str, Any]) -> LoopArgs:
        """The record of ``Loop.__init__``'s ``locals()``, taken before it sets any other."""
        return cls(**{f.name: given[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class Resolved:
    """What ``Loop``'s arguments resolve to, once."""

    args: LoopArgs  # the arguments as given
    model: torch.nn.Module  # the model-with-loss (the model given, or it with loss_fn)
    returns: Returns  # where its return value holds the loss (loss_key)
    metrics: dict[str, Any]  # the metrics given, as a dict
    train: Options  # the training options (a clone; frozen when the first fit starts)
    inference: Options | None  # the inference_opts given (a clone), or None: derived per loader
    precision: str  # one of PRECISIONS
    input_dtype: torch.dtype | None  # float inputs are sent as this (16-bit precisions)
    optimizer: torch.optim.Optimizer  # the one given, or PopTorch's default
    feed: Feed  # a batch as the model's call (the labels of a dict batch kept when read)


def resolve(pt: ModuleType, args: LoopArgs) -> Resolved:
    """``Loop``'s arguments, checked before anything compiles (each error names its
    argument)."""
    model, label_key, metrics, precision = args.model, args.label_key, args.metrics, args.precision
    optimizer, max_grad_norm = args.optimizer, args.max_grad_norm
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module. Received: model={type(model)!r}.")
    if not (isinstance(label_key, str) and label_key):
        raise TypeError(
            f"label_key must be a non-empty str (the labels' key in a dict "
            f"batch). Received: label_key={label_key!r}."
        )
    check_model_dtype(model)
    returns = Returns(args.loss_key)
    if args.loss_fn is not None:
        model = WithLoss(model, args.loss_fn, label_key=label_key)
    metrics = resolve_metrics(metrics, args.metric_output)
    precision = resolve_precision(precision)
    # One path on the emulator and on an IPU: float inputs are sent as float16; "16-true"
    # also makes the weights float16, "16-mixed" keeps them float32 (see ``Loop``).
    if precision == "16-true":
        model.half()
    train, inference, per_replica = resolve_options(pt, args.opts, args.inference_opts)
    if args.replicas is not None:
        set_replicas(pt, train, args.replicas, per_replica)
    if args.seed is not None:
        seed_options(train, args.seed)
    check_optimizer_arg(optimizer)
    if max_grad_norm is not None:
        set_clipping(pt, optimizer, max_grad_norm)
    if optimizer is None:  # PopTorch's default, made here rather than inside trainingModel,
        optimizer = pt.optim.SGD(model.parameters(), lr=0.01)  # so that its state can load
    resolve_output_mode(pt, train, metrics)
    input_dtype = None if precision == "32" else torch.float16
    return Resolved(
        args=args,
        model=model,
        returns=returns,
        metrics=metrics,
        train=train,
        inference=inference,
        precision=precision,
        input_dtype=input_dtype,
        optimizer=optimizer,
        # (the labels of a dict batch are needed for loss_fn or the metrics)
        feed=Feed(
            model,
            label_key,
            needs_labels=args.loss_fn is not None or bool(metrics),
            dtype=input_dtype,
        ),
    )


def check_model_dtype(model: torch.nn.Module) -> None:
    """A ``TypeError`` for float64 parameters (``model.double()``): the IPU computes in 32 and
    16 bits, and the loop sends float64 inputs as float32, so such a model fails on its first
    batch; named here, before anything is built, with the fix."""
    wide = [n for n, p in model.named_parameters() if p.dtype == torch.float64]
    if wide:
        more = f" and {len(wide) - 3} more" if len(wide) > 3 else ""
        raise TypeError(
            f"model must hold float32 (or float16) parameters: IPUs compute in 32 and 16 bits, "
            f"and the loop sends float64 inputs as float32. Received: float64 parameters "
            f"{', '.join(wide[:3])}{more} (model.double()?). Call model.float() before "
            "building the Loop."
        )


def resolve_options(
    pt: ModuleType, opts: object, inference_opts: object
) -> tuple[Options, Options | None, int]:
    """Clones of the training and (if given) inference options, and the IPUs per replica
    (known from an ``OptionsBuilder`` such as ``IPUConfig``; else 1)."""
    per_replica = 1
    if isinstance(opts, OptionsBuilder):
        per_replica = opts.ipus_used()
        if inference_opts is None:
            inference_opts = opts.to_options(for_inference=True)
        opts = opts.to_options()
    if opts is None:
        opts = pt.Options()
    if not isinstance(opts, pt.Options):
        raise TypeError(
            f"opts must be poptorch.Options, an ipuloop.IPUConfig or None. "
            f"Received: opts={type(opts).__name__}."
        )
    if inference_opts is not None and not isinstance(inference_opts, pt.Options):
        raise TypeError(
            f"inference_opts must be poptorch.Options or None. Received: "
            f"inference_opts={type(inference_opts).__name__}."
        )
    return (
        opts.clone(),
        inference_opts.clone() if inference_opts is not None else None,
        per_replica,
    )


def resolve_precision(precision: str | int) -> str:
    if (
        isinstance(precision, bool)
        or not isinstance(precision, (str, int))
        or precision not in _PRECISION_ALIASES
    ):
        raise ValueError(
            f"precision must be one of {PRECISIONS} (or Lightning's 32, 16, "
            f"'32-true'). Received: precision={precision!r}."
        )
    return _PRECISION_ALIASES[precision]


def set_replicas(
    pt: ModuleType, opts: Options, replicas: int | str, ipus_per_replica: int = 1
) -> None:
    """``replicas=``, checked as PopTorch checks the IPUs it reserves, before compiling.

    ``ipus_per_replica`` is known from an ``IPUConfig``; otherwise 1 is assumed (a
    pipelined model's IPUs are only known once it is traced).
    """
    hardware = pt.ipuHardwareIsAvailable()
    if replicas == "auto":
        # The most replicas (a power of two) whose IPUs the system has; 1 without IPUs.
        n = 1
        while (
            hardware
            and reserved_ipus(opts, 2 * n * ipus_per_replica) <= MAX_IPUS
            and pt.ipuHardwareIsAvailable(reserved_ipus(opts, 2 * n * ipus_per_replica))
        ):
            n *= 2
        replicas = n
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ValueError(
            f"replicas must be an int >= 1 or 'auto'. Received: replicas={replicas!r}."
        )
    current = opts.replication_factor
    if current not in (1, replicas):
        raise ValueError(
            f"replicas={replicas} contradicts opts.replicationFactor({current}): set one of them."
        )
    error = ipu_count_error(opts, replicas, ipus_per_replica)
    if error is not None:
        if not ipus_per_replica & (ipus_per_replica - 1) and "power of 2" in error:
            below = 1 << (replicas.bit_length() - 1)
            error += f" Or use replicas={below} or {2 * below}."
        raise ValueError(f"replicas={replicas}: {error}")
    ipus = reserved_ipus(opts, replicas * ipus_per_replica)
    if hardware and not uses_ipu_model(opts) and not pt.ipuHardwareIsAvailable(ipus):
        raise ValueError(
            f"replicas={replicas} x {ipus_per_replica} IPU(s) per replica "
            f"needs {ipus} IPUs, more than this system has. Use "
            "fewer replicas, or replicas='auto'."
        )
    opts.replicationFactor(replicas)


def seed_options(opts: Options, value: int) -> None:
    """Seed python, numpy and (through ``Options.randomSeed``) torch and the device."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"seed must be an int. Received: seed={value!r}.")
    random.seed(value)
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(value % 2**32)
    opts.randomSeed(value)  # seeds torch on the host and the device


def check_optimizer_arg(optimizer: object) -> None:
    if isinstance(optimizer, (list, tuple)):
        raise ValueError(
            f"IPUs currently only support one optimizer. Received "
            f"{len(optimizer)} optimizers: combine their parameter groups "
            "into one optimizer."
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer. Received: "
            f"optimizer={type(optimizer).__name__}."
        )


def set_clipping(pt: ModuleType, optimizer: Any, max_grad_norm: float) -> None:
    if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(
            f"max_grad_norm must be a number > 0. Received: max_grad_norm={max_grad_norm!r}."
        )
    if not isinstance(optimizer, (pt.optim.SGD, pt.optim.Adam, pt.optim.AdamW)):
        name = (
            "None"
            if optimizer is None
            else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        )
        raise ValueError(
            f"Gradient clipping runs on the device only with poptorch.optim.SGD, Adam or "
            f"AdamW (their max_grad_norm). Received: optimizer={name}. Build the optimizer "
            f"as poptorch.optim.AdamW(params, ..., max_grad_norm={max_grad_norm})"
            + (
                " (LAMB clamps weight norms instead: max_weight_norm)."
                if isinstance(optimizer, pt.optim.LAMB)
                else "."
            )
        )
    optimizer.max_grad_norm = float(max_grad_norm)


def resolve_output_mode(pt: ModuleType, opts: Options, metrics: dict[str, Any]) -> None:
    """Default: what logging and metrics need at the least transfer; Sum with metrics and an
    EveryN period that does not divide DI are rejected here, before compiling."""
    mode = opts.output_mode
    if mode == DEFAULT:
        opts.outputMode(pt.OutputMode.All if metrics else pt.OutputMode.Sum)
    elif mode == SUM and metrics:
        raise ValueError(
            "OutputMode.Sum returns per-replica sums, not per-sample outputs, so "
            f"the metrics {sorted(metrics)} cannot be computed. Use "
            "OutputMode.All (exact) or Final (last micro-batch), or leave the "
            "output mode at Default and the loop picks All."
        )
    elif mode == EVERY_N:  # PopART's rule, checked here rather than at compile time
        check_return_period(opts.output_return_period, opts.device_iterations)


def resolve_metrics(metrics: object, metric_output: Callable | None = None) -> dict[str, Any]:
    """``Loop``'s ``metrics`` as a dict, checked with its ``metric_output``."""
    if metric_output is not None and not callable(metric_output):
        raise TypeError(
            f"metric_output must be a function of the model's output. "
            f"Received: metric_output={metric_output!r}."
        )
    if metrics is None:
        return {}
    if not hasattr(metrics, "items"):
        raise TypeError(
            "metrics must be a dict of torchmetrics metrics or a "
            f"MetricCollection. Received: {type(metrics).__name__}."
        )
    out = dict(metrics.items())
    for name, m in out.items():
        if not (hasattr(m, "update") and hasattr(m, "compute") and hasattr(m, "reset")):
            raise TypeError(
                f"metrics[{name!r}] must be a torchmetrics Metric. Received: {type(m).__name__}."
            )
    return out


def check_fit_args(
    epochs: object, max_steps: object, val_every_n_steps: object, val_loader: object
) -> None:
    """``Loop.fit``'s counts, checked before anything is built."""
    check_int("epochs", epochs)
    check_int("max_steps", max_steps, optional=True)
    check_int("val_every_n_steps", val_every_n_steps, optional=True)
    if val_every_n_steps is not None and val_loader is None:
        raise ValueError(
            f"val_every_n_steps={val_every_n_steps} validates on val_loader, "
            "but this fit has none. Pass val_loader= too."
        )


_SET_NAME = re.compile(r"[A-Za-z0-9_-]+")


def val_sets(value: object, arg: str = "val_loader") -> list[tuple[str, str | None, DataLoader]]:
    """``fit``'s ``val_loader`` (or ``validate``'s ``arg``) as ``(log suffix, name, loader)``
    per validation set: one loader is ``("", None, loader)`` (logs ``val_loss``...); a dict
    of name -> loader gives each its name (``val_loss/<name>``), a list or tuple of several
    Lightning's ``dataloader_idx_<i>`` (``val_loss/dataloader_idx_<i>``; a list of one logs as
    one loader, as in Lightning). Anything else is refused,
    naming ``arg``, what it got and the fix, before anything is built."""
    shapes = (
        f"{arg} must be a DataLoader, a list of DataLoaders or a dict of name -> DataLoader "
        "(several validation sets)"
    )

    def loader(v: object, where: str) -> DataLoader:
        if isinstance(v, DataLoader):
            return v
        hint = (
            "wrap the tensors in a DataLoader: DataLoader(TensorDataset(x, y), batch_size=B)"
            if isinstance(v, torch.Tensor)
            else "pass a torch.utils.data.DataLoader or poptorch.DataLoader"
        )
        raise TypeError(f"{shapes}. Received: {where}={type(v).__name__}: {hint}.")

    if isinstance(value, DataLoader):
        return [("", None, value)]
    if isinstance(value, dict):
        if not value:
            raise ValueError(
                f"{shapes}. Received: {arg}={{}} (no set): pass at least one, or leave {arg} out."
            )
        out: list[tuple[str, str | None, DataLoader]] = []
        for name, v in value.items():
            if not isinstance(name, str):
                raise TypeError(
                    f"{shapes}, each name a str. Received: a key {name!r} "
                    f"({type(name).__name__}) in {arg}: name each set with a str, e.g. "
                    f"{{'clean': loader}}."
                )
            if not _SET_NAME.fullmatch(name):
                raise ValueError(
                    f"{arg}: each set's name is part of its log names (val_loss/<name>) and "
                    "of checkpoint filename fields, so it must be letters, digits, '_' and "
                    f"'-'. Received: a key {name!r} in {arg}: rename it, e.g. "
                    f"{re.sub(r'[^A-Za-z0-9_-]+', '_', name).strip('_') or 'set'!r}."
                )
            out.append((name, f"{arg}[{name!r}]", loader(v, f"{arg}[{name!r}]")))
        return out
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(
                f"{shapes}. Received: {arg}={value!r} (no set): pass at least one, or leave "
                f"{arg} out."
            )
        return [  # (as Lightning: one loader in a list logs as one loader)
            (
                "" if len(value) == 1 else f"dataloader_idx_{i}",
                f"{arg}[{i}]",
                loader(v, f"{arg}[{i}]"),
            )
            for i, v in enumerate(value)
        ]
    return [("", None, loader(value, arg))]


def check_val_every(
    val_every_n_steps: int | None, steps_per_epoch: int | None, epochs: int, max_steps: int | None
) -> None:
    """Warn when ``val_every_n_steps`` is more than the fit's steps: it would never validate
    mid-fit, most likely a count in other units (samples, micro-batches) or for a longer run."""
    if val_every_n_steps is None or steps_per_epoch is None:  # (a stream: unknown length)
        return
    steps = epochs * steps_per_epoch
    if max_steps is not None:
        steps = min(steps, max_steps)
    if val_every_n_steps <= steps:
        return
    warnings.warn(
        f"val_every_n_steps={val_every_n_steps} is more than the {steps} steps of this fit "
        f"({epochs} epoch(s) of {steps_per_epoch} steps"
        + (f", max_steps={max_steps}" if max_steps is not None else "")
        + "), so no step validates: only the epoch ends do. It counts steps (host calls of "
        "B * DI * GA * RF samples), not samples or micro-batches: pass a count of at most "
        f"{steps}, or leave it out to validate at epoch ends only.",
        stacklevel=4,
    )


def inference_options(pt: ModuleType, train: Options, user: Options | None) -> Options:
    """Options for validating or predicting: a clone of ``user`` (the ``inference_opts``),
    else of the training options without their training-only settings (the loader it reads
    fits their device iterations: ``measure.fit_iterations``)."""
    if user is not None:
        opts = user.clone()
        if opts.Training.gradient_accumulation != 1:
            raise ValueError(
                "inference_opts must have Training.gradientAccumulation(1). "
                f"Received: {opts.Training.gradient_accumulation}."
            )
        if opts.output_mode not in (ALL, DEFAULT):
            raise ValueError(
                "inference_opts must use OutputMode.All (or Default): validation "
                f"and predict need every output. Received: "
                f"{MODE_NAMES.get(opts.output_mode, opts.output_mode)}."
            )
        opts.outputMode(pt.OutputMode.All)
        return opts
    opts = train.clone()
    # training-only settings PopTorch or PopART reject for inference: accumulation,
    # automatic loss scaling, anchors (of gradients and updated weights, or anything else
    # the training step returns)
    opts.Training.gradientAccumulation(1)
    opts.Training.setAutomaticLossScaling(False)
    opts.anchored_tensors.clear()
    opts.outputMode(pt.OutputMode.All)
    return opts


def warn_no_epochs(epochs: int, done: int) -> None:
    """A fit asked for no more epochs than the ``done`` ones (``epochs`` is the total)."""
    if done >= epochs:
        warnings.warn(
            f"fit(epochs={epochs}) has no epoch to run: {done} epoch(s) are "
            "already complete, and epochs is the total, not a number to add. "
            f"Pass epochs={done + epochs} to train {epochs} more.",
            stacklevel=4,
        )
