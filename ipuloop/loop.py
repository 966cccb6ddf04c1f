"""``Loop``: fit / validate / predict over the PopTorch API, and the only place events are ordered.

The event order is written once, in ``ipuloop.callbacks.base``.
"""
from __future__ import annotations

import contextlib
import copy
import math
import operator
import random
import sys
import time
import warnings
from typing import Any, Callable, Iterable

import torch

from .backend import poptorch_module, uses_ipu_model
from .callbacks.base import EVENTS, Callback, CancelEpoch, CancelFit, CancelStep, overridden
from .data import Plan, build_plan, describe_factors
from .signals import Preempted, handle_signals
from . import distributed
from .outputs import ALL, DEFAULT, EVERY_N, MODE_NAMES, SUM, Layout
from .state import State

__all__ = ["Loop", "WithLoss", "NonFiniteLossError"]


class NonFiniteLossError(FloatingPointError):
    """A returned loss was NaN or infinite."""


class WithLoss(torch.nn.Module):
    """``model`` plus ``loss_fn`` as a model-with-loss: ``forward(*inputs[, labels])``.

    Called with ``num_inputs`` inputs it returns ``output``; with one more argument, the
    labels, it returns ``(output, loss_fn(output, labels))``. The loss runs after the model's
    last layer, so it joins the block started last (``BeginBlock``/``Stage`` placement; after a
    ``with poptorch.Block(...)`` has ended no op may run, so such a model computes its loss
    itself, inside its last block). On the device the loss is marked
    with ``identity_loss`` (reduction "none": the value unchanged), so that PopTorch finds it
    whether ``loss_fn`` is a torch loss function or hand-written arithmetic.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, num_inputs: int = 1) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs

    def forward(self, *args: Any) -> Any:
        if len(args) == self.num_inputs:
            return self.model(*args)
        if len(args) != self.num_inputs + 1:
            raise TypeError(f"expected {self.num_inputs} input(s) and optionally the labels. "
                            f"Received {len(args)} arguments.")
        output = self.model(*args[:-1])
        loss = self.loss_fn(output, args[-1])
        pt = poptorch_module()
        if pt.isRunningOnIpu():  # in the device graph, a loss PopTorch finds whatever loss_fn does
            loss = pt.identity_loss(loss, reduction="none")
        return output, loss


PRECISIONS = ("32", "16-mixed", "16-true")
# poptorch.optim attributes outside optimizer.state_dict(): checkpointed, and (with
# velocity_scaling, a per-group value on the emulator) compared before each step
OPTIMIZER_EXTRAS = ("loss_scaling", "max_grad_norm", "max_weight_norm")
_PUSHED_EXTRAS = (*OPTIMIZER_EXTRAS, "velocity_scaling")
# Lightning's spellings: PL 1.x took 16/32 (16 = mixed), lightning-graphcore "32-true"/"16-mixed".
_PRECISION_ALIASES = {32: "32", "32": "32", "32-true": "32", 16: "16-mixed", "16": "16-mixed",
                      "16-mixed": "16-mixed", "16-true": "16-true"}


def _hyper(opt: torch.optim.Optimizer) -> tuple:
    """The optimizer's hyper-parameters, to tell when they changed (host only, no sync).

    Read every step, so kept cheap: a group's items in their own (insertion) order, which
    only changes when a key is added, and that is a change too.
    """
    T = torch.Tensor
    groups = tuple(tuple((k, float(v) if isinstance(v, T) else v)
                         for k, v in g.items() if k != "params")
                   for g in opt.param_groups)
    return groups, _hyper_extras(opt)


def _hyper_extras(opt: torch.optim.Optimizer) -> tuple:
    return tuple(getattr(opt, k, None) for k in _PUSHED_EXTRAS)


@contextlib.contextmanager
def _plain_numbers(opt: torch.optim.Optimizer | None) -> Any:
    """While PopTorch reads ``opt`` (``trainingModel``, ``setOptimizer``), its tensor
    hyper-parameters (an lr a scheduler updates in place) are their floats: PopTorch asserts
    numbers. The tensors are put back after, so in-place updates keep working."""
    swapped = []
    for group in (opt.defaults, *opt.param_groups) if opt is not None else ():
        for k, v in group.items():
            if k != "params" and isinstance(v, torch.Tensor):
                swapped.append((group, k, v))
                group[k] = float(v)  # a host tensor: no device sync
    try:
        yield
    finally:
        for group, k, v in swapped:
            group[k] = v


class _Seen:
    """An optimizer's param groups and PopTorch attributes as ``_push_optimizer`` last read them.

    ``unchanged(opt)`` is the per-step test, True only when ``opt`` is that optimizer and
    ``_hyper(opt)`` would return what it returned then: the same keys, the very same value
    objects (a value set anew, even an equal one, is left to ``_hyper``), tensor values (a
    learning rate a scheduler updates in place) at the float they had, and equal
    optimizer-wide attributes. False sends the step to ``_push_optimizer``'s full comparison.
    """

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self.keys = [tuple(g) for g in opt.param_groups]
        self.values = [tuple(g.values()) for g in opt.param_groups]
        self.tensors = [(v, float(v)) for g in opt.param_groups for k, v in g.items()
                        if k != "params" and isinstance(v, torch.Tensor)]
        self.extras = _hyper_extras(opt)

    def unchanged(self, opt: torch.optim.Optimizer | None) -> bool:
        if opt is not self.opt:
            return False
        groups = opt.param_groups
        if len(groups) != len(self.keys):
            return False
        try:
            for g, keys, values in zip(groups, self.keys, self.values):
                if tuple(g) != keys or not all(map(operator.is_, g.values(), values)):
                    return False
            for t, v in self.tensors:
                if float(t) != v:
                    return False
            return _hyper_extras(opt) == self.extras
        except (RuntimeError, TypeError, ValueError):  # an exotic value: compare in full
            return False


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": _plain(random.getstate()), "torch": torch.get_rng_state()}
    with contextlib.suppress(ImportError):
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _shape(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')} {list(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} ({', '.join(_shape(v) for v in x)})"
    return type(x).__name__


def _device_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the device holds it: float64 is float32 on an IPU."""
    return x.float() if x.dtype == torch.float64 else x


def _add_note(e: BaseException, note: str) -> None:
    """``e.add_note(note)``; before Python 3.11, the ``__notes__`` list it would write."""
    if hasattr(e, "add_note"):
        e.add_note(note)
    else:
        try:
            notes = e.__dict__.setdefault("__notes__", [])
        except AttributeError:  # an exception type without a __dict__
            return
        notes.append(note)


def _metric_state(metric: Any) -> dict[str, Any]:
    """A torchmetrics metric's state by name (``metric_state``, which torchmetrics 1.0 lacks)."""
    return {name: getattr(metric, name) for name in metric._defaults}


def _identity(x: Any) -> Any:
    return x


def _describe(inputs: tuple, labels: Any) -> str:
    """The batch as the model sees it, e.g. "inputs (float32 [4, 6]) and labels int64 [4]"."""
    return (f"input{'s' if len(inputs) != 1 else ''} ({', '.join(_shape(x) for x in inputs)}) "
            f"and labels {_shape(labels)}")


def _concat(parts: list, keep: Any, rows: Callable) -> Any:
    """Per-call outputs (tensors, or tuples, lists, namedtuples and dicts of them) joined
    along the samples, each call's rows put in host-batch order by ``rows``, then indexed
    by ``keep`` (a slice, or a boolean mask over the rows)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([rows(p).reshape(-1) if p.dim() == 0 else rows(p)
                          for p in parts])[keep]
    if isinstance(first, dict):
        return type(first)((k, _concat([p[k] for p in parts], keep, rows)) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # a namedtuple
        return type(first)(*(_concat(list(col), keep, rows) for col in zip(*parts)))
    if isinstance(first, (tuple, list)):
        return type(first)(_concat(list(col), keep, rows) for col in zip(*parts))
    return parts  # not a tensor: one value per call, as returned


class _Flagged(torch.utils.data.IterableDataset):
    """(True, sample) per sample, then (False, last sample) up to a multiple of ``multiple``."""

    def __init__(self, dataset: Any, multiple: int) -> None:
        self.dataset, self.multiple = dataset, multiple

    def __iter__(self) -> Any:
        n, last = 0, None
        for last in self.dataset:
            n += 1
            yield True, last
        while n % self.multiple:
            n += 1
            yield False, last


class _FlagCollate:
    """Collates ``_Flagged`` samples: (the flags as a bool tensor, the samples collated)."""

    def __init__(self, collate: Callable) -> None:
        self.collate = collate

    def __call__(self, batch: list) -> tuple[torch.Tensor, Any]:
        return torch.tensor([f for f, _ in batch]), self.collate([s for _, s in batch])


def _map_tensors(x: Any, fn: Callable) -> Any:
    """``fn`` applied to every tensor of ``x`` (a tensor, or tuples, lists, dicts of them)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return type(x)((k, _map_tensors(v, fn)) for k, v in x.items())
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_map_tensors(v, fn) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_map_tensors(v, fn) for v in x)
    return x


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def _has_loss(result: Any, losses: int) -> bool:
    """Whether an inference call returned ``(output, loss)``: a loss per micro-batch."""
    return (isinstance(result, (tuple, list)) and len(result) == 2
            and isinstance(result[1], torch.Tensor) and result[1].numel() == losses
            and result[1].is_floating_point())


def _metric_logs(prefix: str, metrics: dict[str, Any]) -> dict[str, float]:
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


def _plain(x: Any) -> Any:
    return [_plain(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuple(x: Any) -> Any:
    return tuple(_tuple(v) for v in x) if isinstance(x, list) else x


class Loop:
    """Train, validate and predict with a PopTorch model.

    Args:
        model: a model-with-loss (``forward(*inputs, labels)`` returns ``(output, loss)``,
            and ``output`` without labels), or a plain model together with ``loss_fn``.
        opts: ``poptorch.Options`` (never modified: the loop clones it), an
            ``ipuloop.IPUConfig``, or None for defaults.
        optimizer: one optimizer over the model's parameters (``poptorch.optim`` or
            ``torch.optim`` SGD/Adam/AdamW/RMSprop); None gives PopTorch's SGD(lr=0.01).
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
        inference_opts: options for validation and predict; default: a clone of the
            training options without their training-only settings (gradientAccumulation 1,
            no automatic loss scaling, no anchored tensors) and, of the device-iteration counts
            from DI*GA down to half of it (fewer only for a short loader), the one that
            needs the least padding to make whole host calls of the loader's samples.
        seed: seeds python, numpy, torch and the device (``Options.randomSeed``).
        check_finite: raise ``NonFiniteLossError`` on a NaN or infinite returned loss.
        precision: "32" (default), "16-mixed" or "16-true" (Lightning's 32, 16, "32-true"
            are accepted: 16 means mixed, as in Lightning's IPU docs), the same on the
            emulator and on an IPU. Both send float inputs as float16. True: the model's
            weights are float16 too. Mixed: they stay float32, and an op with a float16 input
            and float32 weights (Linear, Conv) computes in float16, while an op mixing float16
            and float32 activations computes in float32: PopTorch's user guide, "16-bit float
            support" (overview.rst), item 2 and its note, as PopTorch's half_float_test.py
            checks. The host check before compiling runs in float32. Loss scaling is static:
            set ``loss_scaling`` on a ``poptorch.optim`` optimizer.
        max_grad_norm: clip the global gradient norm on the device; sets the
            ``max_grad_norm`` of a ``poptorch.optim`` SGD/Adam/AdamW (the optimizers that
            can clip on the IPU) and rejects any other optimizer.

    Batches are ``(inputs..., labels)`` tuples, the labels last; a dict batch is rejected with
    its keys named (convert it in the dataset or the ``collate_fn``). Before compiling, the
    loop runs one micro-batch through the model on the host, so a label batch that differs
    from the input batch, labels that would broadcast against the output, or a dtype the loss
    rejects fail before the first step, naming the shapes and dtypes received.

    Example::

        loop = Loop(model, poptorch.Options().deviceIterations(10), loss_fn=nn.CrossEntropyLoss(),
                    optimizer=poptorch.optim.AdamW(model.parameters(), lr=1e-3),
                    metrics={"acc": torchmetrics.Accuracy("multiclass", num_classes=10)})
        history = loop.fit(train_loader, epochs=3, val_loader=val_loader)
    """

    def __init__(self, model: torch.nn.Module, opts: Any = None, *,
                 optimizer: torch.optim.Optimizer | None = None, loss_fn: Callable | None = None,
                 metrics: Any = None, metric_output: Callable | None = None,
                 callbacks: Iterable[Callback] = (),
                 replicas: int | str | None = None, inference_opts: Any = None,
                 seed: int | None = None, progress: bool | int = True,
                 check_finite: bool = True, max_grad_norm: float | None = None,
                 precision: str | int = "32") -> None:
        self.poptorch = pt = poptorch_module()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module. Received: model={type(model)!r}.")
        self.model = WithLoss(model, loss_fn) if loss_fn is not None else model
        self._set_precision(precision)
        from .config import IPUConfig
        per_replica = opts.ipus_used() if isinstance(opts, IPUConfig) else 1
        self.train_opts, inf = self._resolve_options(opts, inference_opts)
        self._user_inference_opts = inf
        if replicas is not None:
            self._set_replicas(replicas, per_replica)
        if seed is not None:
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise TypeError(f"seed must be an int. Received: seed={seed!r}.")
            random.seed(seed)
            with contextlib.suppress(ImportError):
                import numpy as np
                np.random.seed(seed % 2**32)
            self.train_opts.randomSeed(seed)  # seeds torch on the host and the device
        if isinstance(optimizer, (list, tuple)):
            raise ValueError(f"IPUs currently only support one optimizer. Received "
                             f"{len(optimizer)} optimizers: combine their parameter groups "
                             "into one optimizer.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer. Received: "
                            f"optimizer={type(optimizer).__name__}.")
        if max_grad_norm is not None:
            self._set_clipping(optimizer, max_grad_norm)
        # PopTorch's default, made here rather than inside trainingModel, so that it exists
        # (and its state loads) before the first compilation.
        self.optimizer = optimizer if optimizer is not None else \
            pt.optim.SGD(self.model.parameters(), lr=0.01)
        self.metrics = self._resolve_metrics(metrics)  # validation's; training uses clones
        if metric_output is not None and not callable(metric_output):
            raise TypeError(f"metric_output must be a function of the model's output. "
                            f"Received: metric_output={metric_output!r}.")
        self._metric_output = metric_output or _identity
        self._train_metric_objs = {k: m.clone() for k, m in self.metrics.items()}
        self.check_finite = check_finite
        self.state = State()
        mode = self.train_opts.output_mode
        if mode == DEFAULT:  # what logging and metrics need at the least transfer
            self.train_opts.outputMode(pt.OutputMode.All if self.metrics else pt.OutputMode.Sum)
        elif mode == SUM and self.metrics:
            raise ValueError("OutputMode.Sum returns per-replica sums, not per-sample outputs, so "
                             f"the metrics {sorted(self.metrics)} cannot be computed. Use "
                             "OutputMode.All (exact) or Final (last micro-batch), or leave the "
                             "output mode at Default and the loop picks All.")
        elif mode == EVERY_N:  # PopART's rule, checked here rather than at compile time
            period, di = self.train_opts.output_return_period, self.train_opts.device_iterations
            if di % period:
                divisors = [d for d in range(1, di + 1) if di % d == 0]
                raise ValueError(
                    f"OutputMode.EveryN({period}) returns every {period}-th device iteration of "
                    f"a host call, so the period must divide deviceIterations ({di}). Received: "
                    f"output_return_period={period}. Use one of {divisors}.")
        self.callbacks: list[Callback] = []
        cbs = list(callbacks)
        for cb in cbs:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be ipuloop.Callback instances. Received: "
                                f"{type(cb).__name__}.")
        if progress:
            from .callbacks.progress import ProgressBar
            if not any(isinstance(cb, ProgressBar) for cb in cbs):
                cbs.append(ProgressBar(every=progress if progress is not True else None))
        self.callbacks = sorted(cbs, key=lambda cb: cb.order)
        keys = [cb.state_key for cb in self.callbacks]
        if len(set(keys)) != len(keys):
            raise ValueError(f"Two callbacks share a state_key ({keys}): give each a unique "
                             "state_key so checkpoints can tell them apart.")
        self._hooks = {e: [(cb, getattr(cb, e)) for cb in self.callbacks if overridden(cb, e)]
                       for e in EVENTS}
        self.train_model: Any = None
        self._inference: dict[tuple, Any] = {}
        self._pushed: tuple | None = None
        self._seen: _Seen | None = None  # what _push_optimizer last looked at
        self.optimizer_pushes = 0  # setOptimizer calls made (only when a hyper-parameter changed)
        self._epoch_loss = [0.0, 0, True]  # total, count, exact
        self._epoch_rng: dict[str, Any] | None = None
        self._resume_rng: dict[str, Any] | None = None
        self._val_rng: dict[str, Any] | None = None  # host RNG as the running validation began
        self._sampler: Any = None  # the running fit's ResumableSampler
        self._sampler_rng: torch.Tensor | None = None  # its generator, resumed at an epoch start
        self._device_rng: torch.Tensor | None = None
        self._max_steps: int | None = None
        self.exception: BaseException | None = None  # the error on_exception hooks were told of
        self.exception_source: Callback | None = None  # the callback whose hook raised it
        self._batches: Any = None  # the running epoch's batch iterator
        self._preempted = False
        self._warned_no_val_loss = False
        self._warned_partial_val_loss = False
        self._options_frozen = False  # train_opts: settable in on_configure, then frozen
        self._train_data: dict[str, Any] | None = None  # the running fit's data factors
        self._loaded_data: dict[str, Any] | None = None  # a loaded checkpoint's, until fit
        self._num_inputs: int | None = None  # inputs per batch in the last fit or validate
        # several processes (torchrun, mpirun, poprun): this loop is one instance of the run
        self._dist = distributed.attach(self, replicas_given=replicas is not None)

    # -- configuration ------------------------------------------------------------------------
    def _resolve_options(self, opts: Any, inference_opts: Any) -> tuple[Any, Any]:
        pt = self.poptorch
        from .config import IPUConfig
        if isinstance(opts, IPUConfig):
            if inference_opts is None:
                inference_opts = opts.to_options(for_inference=True)
            opts = opts.to_options()
        if opts is None:
            opts = pt.Options()
        if not isinstance(opts, pt.Options):
            raise TypeError(f"opts must be poptorch.Options, an ipuloop.IPUConfig or None. "
                            f"Received: opts={type(opts).__name__}.")
        if inference_opts is not None and not isinstance(inference_opts, pt.Options):
            raise TypeError(f"inference_opts must be poptorch.Options or None. Received: "
                            f"inference_opts={type(inference_opts).__name__}.")
        return opts.clone(), inference_opts.clone() if inference_opts is not None else None

    def _set_replicas(self, replicas: int | str, ipus_per_replica: int = 1) -> None:
        """``replicas=``, checked as PopTorch checks the IPUs it reserves, before compiling.

        ``ipus_per_replica`` is known from an ``IPUConfig``; otherwise 1 is assumed (a
        pipelined model's IPUs are only known once it is traced).
        """
        pt, opts = self.poptorch, self.train_opts
        hardware = pt.ipuHardwareIsAvailable()
        use_model = uses_ipu_model(opts)

        def reserved(n: int) -> int:  # what PopTorch reserves for n IPUs (CompilerImpl.cpp)
            if use_model or not n & (n - 1) or not opts.auto_round_num_ipus:
                return n
            return 1 << (n - 1).bit_length()  # autoRoundNumIPUs: the next power of 2

        if replicas == "auto":
            # The most replicas (a power of two) whose IPUs the system has; 1 without IPUs.
            n = 1
            while hardware and reserved(2 * n * ipus_per_replica) <= 64 \
                    and pt.ipuHardwareIsAvailable(reserved(2 * n * ipus_per_replica)):
                n *= 2
            replicas = n
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1 or 'auto'. Received: "
                             f"replicas={replicas!r}.")
        current = opts.replication_factor
        if current not in (1, replicas):
            raise ValueError(f"replicas={replicas} contradicts opts.replicationFactor({current}): "
                             "set one of them.")
        ipus = replicas * ipus_per_replica
        if not use_model:  # PopTorch reserves a power of two of IPUs, at most 64 a process
            if ipus & (ipus - 1) and not opts.auto_round_num_ipus:
                below = 1 << (replicas.bit_length() - 1)
                other = "" if ipus_per_replica & (ipus_per_replica - 1) else \
                    f"use replicas={below} or {2 * below}, or "
                raise ValueError(
                    f"replicas={replicas}: PopTorch reserves a power of 2 of IPUs, and "
                    f"{replicas} replica(s) x {ipus_per_replica} IPU(s) = {ipus} is not one. "
                    f"{other.capitalize()}set opts.autoRoundNumIPUs(True) to reserve "
                    f"{1 << (ipus - 1).bit_length()}.")
            if reserved(ipus) > 64:
                raise ValueError(f"replicas={replicas} x {ipus_per_replica} IPU(s) per replica "
                                 f"= {ipus} IPUs, but a process can reserve at most 64.")
        if hardware and not use_model and not pt.ipuHardwareIsAvailable(reserved(ipus)):
            raise ValueError(f"replicas={replicas} x {ipus_per_replica} IPU(s) per replica "
                             f"needs {reserved(ipus)} IPUs, more than this system has. Use "
                             "fewer replicas, or replicas='auto'.")
        opts.replicationFactor(replicas)

    def _set_precision(self, precision: str | int) -> None:
        if (isinstance(precision, bool) or not isinstance(precision, (str, int))
                or precision not in _PRECISION_ALIASES):
            raise ValueError(f"precision must be one of {PRECISIONS} (or Lightning's 32, 16, "
                             f"'32-true'). Received: precision={precision!r}.")
        precision = _PRECISION_ALIASES[precision]
        self.precision = precision
        # One path on the emulator and on an IPU: float inputs are sent as float16; "16-true"
        # also makes the weights float16, "16-mixed" keeps them float32 (each op with a
        # float16 input casts them to float16, as PopTorch does: see ``Loop``).
        if precision == "16-true":
            self.model.half()
        self._input_dtype = None if precision == "32" else torch.float16

    def _set_clipping(self, optimizer: Any, max_grad_norm: float) -> None:
        pt = self.poptorch
        if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a number > 0. Received: "
                             f"max_grad_norm={max_grad_norm!r}.")
        clipping = (pt.optim.SGD, pt.optim.Adam, pt.optim.AdamW)
        if not isinstance(optimizer, clipping):
            name = "None" if optimizer is None else type(optimizer).__module__ + "." + \
                type(optimizer).__qualname__
            raise ValueError(
                f"Gradient clipping runs on the device only with poptorch.optim.SGD, Adam or "
                f"AdamW (their max_grad_norm). Received: optimizer={name}. Build the optimizer "
                f"as poptorch.optim.AdamW(params, ..., max_grad_norm={max_grad_norm})"
                + (" (LAMB clamps weight norms instead: max_weight_norm)."
                   if isinstance(optimizer, pt.optim.LAMB) else "."))
        optimizer.max_grad_norm = float(max_grad_norm)

    @staticmethod
    def _resolve_metrics(metrics: Any) -> dict[str, Any]:
        if metrics is None:
            return {}
        if hasattr(metrics, "items"):
            out = dict(metrics.items())
        else:
            raise TypeError("metrics must be a dict of torchmetrics metrics or a "
                            f"MetricCollection. Received: {type(metrics).__name__}.")
        for name, m in out.items():
            if not (hasattr(m, "update") and hasattr(m, "compute") and hasattr(m, "reset")):
                raise TypeError(f"metrics[{name!r}] must be a torchmetrics Metric. Received: "
                                f"{type(m).__name__}.")
        return out

    def _layout(self, opts: Any, training: bool) -> Layout:
        return Layout(opts.device_iterations,
                      opts.Training.gradient_accumulation if training else 1,
                      opts.replication_factor, opts.output_mode,
                      max(opts.output_return_period, 1), opts.input_group_size,
                      int(opts.input_cgt) == 2)

    # -- events ---------------------------------------------------------------------------------
    def _fire(self, event: str) -> None:
        for cb, hook in self._hooks[event]:
            try:
                hook(self)
            except (CancelStep, CancelEpoch, CancelFit):
                raise
            except BaseException as e:
                if self.exception_source is None:  # the innermost hook: the one that failed
                    self.exception_source = cb
                _add_note(e, f"raised in callback {type(cb).__name__}.{event}")
                if isinstance(e, AttributeError) and "frozen Options" in str(e):
                    _add_note(e, "The loop's options freeze when fit starts: change "
                                 "loop.train_opts in a callback's on_configure.")
                raise

    def describe(self) -> str:
        """The loop's events, with the callbacks attached to each."""
        lines = []
        for e in EVENTS:
            names = [type(cb).__name__ for cb, _ in self._hooks[e]]
            lines.append(f"{e:24s} {', '.join(names) if names else '-'}")
        return "\n".join(lines)

    def stop(self) -> None:
        """End the fit after the current step."""
        self.state.stop_requested = True

    # -- fit ------------------------------------------------------------------------------------
    def fit(self, train_loader: Any, epochs: int = 1, val_loader: Any = None, *,
            resume_from: str | None = None, max_steps: int | None = None) -> list[dict]:
        """Train for ``epochs`` epochs in total; returns the per-epoch logs.

        ``resume_from`` (a checkpoint path, or "last" with a ModelCheckpoint callback: the
        newest checkpoint written in its folder) continues an interrupted fit exactly. With
        other factors than the saved run (micro-batch size, deviceIterations,
        gradientAccumulation, replicas, dataset length), a checkpoint taken at an epoch
        boundary resumes with a warning; one taken mid-epoch continues at the same sample
        when the samples already read make whole host calls of the new factors (same dataset
        length), and is a ``ValueError`` naming each changed factor otherwise, raised before
        any step. ``max_steps`` ends the fit after that many
        training steps in total (for smoke runs), like ``stop()``: an epoch it cuts short is
        not counted as complete. A fit asked for no more epochs than ``state.epoch`` already
        holds runs none, with a warning.

        An epoch is ``len(dataset) // (B * DI * GA * RF)`` steps (host calls, B the loader's
        batch size), each running DI optimizer updates; the remainder is dropped (with a
        warning) whatever the loader's ``drop_last``. A dataset shorter than one host call is
        a ``ValueError`` naming every factor, raised before anything is compiled.
        """
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            raise ValueError(f"epochs must be an int >= 1. Received: epochs={epochs!r}.")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be an int >= 1 or None. Received: "
                             f"max_steps={max_steps!r}.")
        if not self._options_frozen:
            self._fire("on_configure")  # the one place where callbacks change train_opts
            self.train_opts._freeze()  # from here on the loader, outputs, logs and model agree
            self._options_frozen = True
        plan = self._plan(train_loader, training=True, name="train_loader")
        val_plan = self._val_plan(val_loader) if val_loader is not None else None
        self._probe(plan)
        if self._dist is not None:  # several processes: the same settings on each
            self._dist.check_agreement(self, plan, val_plan, epochs, max_steps)
        if resume_from is not None:
            self.check_resumable()
            self._resume(resume_from)
        self._continue_at(plan)
        st = self.state
        if st.epoch >= epochs:  # e.g. a second fit(epochs=3) after the first: nothing to run
            warnings.warn(f"fit(epochs={epochs}) has no epoch to run: {st.epoch} epoch(s) are "
                          "already complete, and epochs is the total, not a number to add. "
                          f"Pass epochs={st.epoch + epochs} to train {epochs} more.", stacklevel=2)
        st.stop_requested = False
        self.exception = self.exception_source = None
        self._max_steps = max_steps
        self._val_rng = None
        self._steps_hint = plan.steps
        self._preempted = False
        with handle_signals(self._on_sigterm, self._kill_workers):
            try:
                try:
                    self._fire("on_fit_start")
                    while st.epoch < epochs:
                        self._check_preempted()  # SIGTERM during epoch-end hooks: stop here
                        if self._should_stop():
                            break
                        self._fit_epoch(plan, val_plan)
                    self._check_preempted()
                except CancelFit:
                    pass
                except Preempted:
                    self._fire("on_preempt")
                self._detach(self.train_model)  # weights and optimizer state to host
                self._fire("on_fit_end")
            except BaseException:
                self._on_exception()
                for model in (self.train_model, *self._inference.values()):  # release the device
                    self._detach(model, quiet=True)
                raise
            finally:
                self._close_batches()
        if self._preempted:  # also when SIGTERM came after the last step: never swallowed
            raise SystemExit(143)  # 128 + SIGTERM, as if the signal had ended the process
        return st.history

    @staticmethod
    def num_updates(loader: Any, opts: Any, epochs: int = 1) -> int:
        """Optimizer updates that ``fit(loader, epochs)`` runs from the first epoch, with the
        training options ``opts`` (``poptorch.Options``, an ``IPUConfig`` or None, as given to
        ``Loop``; a ``replicas=`` given to ``Loop`` instead must be set in them too).

        ``epochs`` x the steps of an epoch (``len(dataset) // (B * DI * GA * RF)``) x DI: the
        ``total_steps`` of a scheduler stepped per update (``LRScheduler``'s default), such
        as ``OneCycleLR``. A static method, so it can size the scheduler the ``Loop`` takes.
        (``len(loader) * epochs`` counts micro-batches: GA * RF times too many.)
        """
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            raise ValueError(f"epochs must be an int >= 1. Received: epochs={epochs!r}.")
        pt = poptorch_module()
        from .config import IPUConfig
        if isinstance(opts, IPUConfig):
            opts = opts.to_options()
        opts = pt.Options() if opts is None else opts
        if not isinstance(opts, pt.Options):
            raise TypeError(f"opts must be poptorch.Options, an ipuloop.IPUConfig or None. "
                            f"Received: opts={type(opts).__name__}.")
        opts = distributed.configured(opts.clone())  # under a launcher: N processes
        layout = Layout(opts.device_iterations, opts.Training.gradient_accumulation,
                        opts.replication_factor, opts.output_mode)
        plan = build_plan(pt, loader, opts, layout, training=True, name="loader")
        if plan.steps is None:
            raise ValueError(f"loader reads an {type(plan.loader.dataset).__name__}, whose "
                             "length is unknown, so neither is its number of updates. Count "
                             "them as epochs x (samples per epoch // (B * DI * GA * RF)) x DI.")
        return epochs * plan.steps * opts.device_iterations

    @staticmethod
    def _detach(model: Any, quiet: bool = False) -> None:
        if model is None or not model.isAttachedToDevice():
            return
        try:
            model.detachFromDevice()
        except Exception as e:
            if not quiet:
                raise
            # tearing down after an error: that error is the one to report
            warnings.warn(f"Could not detach {type(model).__name__} from the device: {e!r}")

    def _on_sigterm(self) -> None:
        if self._dist is not None:  # several processes: all stop at the next agreed boundary
            self._dist.on_sigterm(self)
            return
        self._preempted = True

    def _check_preempted(self) -> None:
        if self._dist is not None:  # several processes: SIGTERM or stop() on any stops all
            self._dist.agree_on_stop(self)
        if self._preempted:
            raise Preempted

    def _kill_workers(self) -> None:
        # A second Ctrl-C: the process exits at once, so its loader workers must go first.
        for w in getattr(self._batches, "_workers", ()):
            with contextlib.suppress(Exception):
                w.kill()

    def _close_batches(self) -> None:
        # Stop loader worker processes now rather than when the iterator is collected.
        it, self._batches = self._batches, None
        shutdown = getattr(it, "_shutdown_workers", None) or getattr(it, "terminate", None)
        if shutdown is not None:
            shutdown()

    def _should_stop(self) -> bool:
        st = self.state
        return st.stop_requested or (self._max_steps is not None and st.step >= self._max_steps)

    def _fit_epoch(self, plan: Plan, val_plan: Plan | None) -> None:
        st = self.state
        if st.epoch_step == 0:
            self._epoch_loss = [0.0, 0, True]
            for m in self._train_metrics().values():
                m.reset()
        try:
            self._fire("on_epoch_start")
            self._train_epoch(plan)
        except CancelEpoch:
            pass
        total, count, exact = self._epoch_loss
        if count:
            st.logs["train_loss"] = total / count
            st.logs["train_loss_exact"] = float(exact)
            st.logs.update(_metric_logs("train_", self._train_metrics()))  # host-side: no sync
        else:  # no step ran (cancelled): no train values, rather than the last epoch's
            self._drop_logs("train_", ("loss", "loss_exact", *self.metrics))
        if self._should_stop() and plan.steps and st.epoch_step < plan.steps:
            return  # stopped mid-epoch (stop() or max_steps): the epoch is not complete
        if val_plan is not None:
            # A checkpoint taken during validation (SIGTERM) must resume with the RNG as it was
            # before validation began: the resumed fit replays validation from its start.
            self._val_rng = _rng_state()
            try:
                self._run_validation(val_plan)
            except CancelEpoch:  # raised in a validation hook: skip to on_epoch_end
                self._drop_logs("val_", ("loss", *self.metrics))
            self._val_rng = None  # not in a finally: a preemption save must still see it
        st.epoch += 1
        st.epoch_step = 0
        st.history.append({"epoch": st.epoch, **st.logs})
        try:
            self._fire("on_epoch_end")
        except CancelEpoch:  # the epoch is over: nothing left to skip
            pass

    def _drop_logs(self, prefix: str, names: Iterable[str]) -> None:
        """Remove the loop's logs ``<prefix><name>`` (and ``<prefix><name>_<part>``)."""
        logs = self.state.logs
        for name in names:
            key = prefix + name
            for k in [k for k in logs if k == key or k.startswith(key + "_")]:
                del logs[k]

    def _train_metrics(self) -> dict[str, Any]:
        return self._train_metric_objs

    def _train_epoch(self, plan: Plan) -> None:
        st = self.state
        layout = plan.layout
        resume_rng, self._resume_rng = self._resume_rng, None
        self._sampler = plan.sampler
        if resume_rng is None:
            if plan.sampler is not None and self._sampler_rng is not None:
                plan.sampler.set_generator_state(self._sampler_rng)  # resumed at an epoch start
            self._sampler_rng = None
            self._epoch_rng = _rng_state()
            if plan.sampler is not None:
                self._epoch_rng["sampler"] = plan.sampler.generator_state()
        else:  # resuming: replay the epoch's order from its start state
            _set_rng_state(self._epoch_rng)
            if plan.sampler is not None:
                plan.sampler.set_generator_state(self._epoch_rng.get("sampler"))
        batches = self._batches = plan.epoch(st.epoch_step)
        if resume_rng is not None:
            _set_rng_state(resume_rng)
        metrics = self._train_metrics()
        per_step_samples = plan.combined
        per_step_updates, per_step_micro_batches = layout.di, layout.micro_batches
        if self._dist is not None:  # several processes: the counters count the whole run
            per_step_samples, per_step_micro_batches = \
                per_step_samples * self._dist.size, per_step_micro_batches * self._dist.size
        hooks = self._hooks
        fresh, seen = st.epoch_step == 0, False
        for batch in batches:
            seen = True
            if self._preempted:  # SIGTERM while the batch was read: stop before the step
                raise Preempted
            inputs, labels = self._split(batch, plan)
            if self.train_model is None or not self.train_model.isCompiled():
                self._compile_train(inputs, labels)
            if hooks["on_train_step_start"]:
                try:
                    self._fire("on_train_step_start")
                except CancelStep:
                    continue
            if self._inference:  # validation or predict ran: their executors hold the device
                self._activate(self.train_model)
            pushed = self._seen  # the cheap test first: _push_optimizer compares in full
            if pushed is None or not pushed.unchanged(self.optimizer):
                self._push_optimizer()
            output, loss = self.train_model(*inputs, labels)
            step_loss = layout.step_loss(loss)  # host tensor: reading it syncs nothing
            if self._dist is not None:  # several processes: the run's loss, summed over them
                step_loss = self._dist.step_loss(self, step_loss)
            if self.check_finite and not math.isfinite(step_loss.total):
                self._raise_non_finite(loss, layout)
            st.step += 1
            st.epoch_step += 1
            st.update += per_step_updates
            st.micro_batch += per_step_micro_batches
            st.samples += per_step_samples
            el = self._epoch_loss
            el[0] += step_loss.total
            el[1] += step_loss.count
            el[2] = el[2] and step_loss.exact
            st.logs["loss"] = step_loss.mean
            if metrics:
                aligned, output = layout.align(labels), self._metric_output(output)
                for m in metrics.values():
                    m.update(output, aligned)
            if hooks["on_train_step_end"]:
                try:
                    self._fire("on_train_step_end")
                except CancelStep:  # the step has run: nothing left to skip
                    pass
            self._check_preempted()
            if self._should_stop():
                break
        if fresh and not seen:  # only an IterableDataset can get here (lengths are checked)
            raise ValueError(
                f"{plan.name} yielded no complete host call in epoch {st.epoch}: one host call "
                f"takes {describe_factors(plan.loader.options, plan.micro, True)}. An "
                "IterableDataset must yield at least that many samples each time it is iterated "
                "(a generator can be iterated only once).")

    def _raise_non_finite(self, loss: torch.Tensor, layout: Layout) -> None:
        flat = loss.reshape(-1)
        i = int(torch.nonzero(~torch.isfinite(flat))[0])
        m = layout.micro_batch_index(i)
        per_iter = layout.ga * layout.rf
        d, rest = divmod(m, per_iter)
        a, r = divmod(rest, layout.rf)
        what = "replica" if layout.mode == SUM else "micro-batch"
        raise NonFiniteLossError(
            f"Non-finite loss {float(flat[i])} at epoch {self.state.epoch}, step "
            f"{self.state.step} (0-based host call), {what} {m} of the step "
            + (f"(device iteration {d}, accumulation step {a}, replica {r})."
               if layout.mode != SUM else "(a replica's sum over the step; OutputMode.All "
               "names the micro-batch).")
            + " Lower the learning rate, check the data, or pass check_finite=False.")

    def _compile_train(self, inputs: tuple, labels: torch.Tensor) -> None:
        pt = self.poptorch
        if self.train_model is None:
            self.model.train()
            with _plain_numbers(self.optimizer):
                self.train_model = pt.trainingModel(self.model, self.train_opts,
                                                    optimizer=self.optimizer)
        self._fire("on_compile_start")
        start = time.perf_counter()
        self._activate(self.train_model)
        self.train_model.compile(*inputs, labels)
        self.state.compile_time["train"] = time.perf_counter() - start
        device_rng, self._device_rng = self._device_rng, None
        if device_rng is not None:  # resumed: the device continues the saved random stream
            self.train_model.rng_state = device_rng
        self._pushed = _hyper(self.optimizer) if self.optimizer is not None else None
        self._seen = None
        self._fire("on_compile_end")

    def _push_optimizer(self) -> None:
        # The device never re-reads the host optimizer: push only what changed (setOptimizer).
        opt = self.optimizer
        if opt is None:
            return
        current = _hyper(opt)
        if current != self._pushed:
            with _plain_numbers(opt):
                self.train_model.setOptimizer(opt)
            self.optimizer_pushes += 1
            self._pushed = current
        self._seen = _Seen(opt)

    def _activate(self, model: Any) -> None:
        """Detach every other executor before ``model`` runs (one set of IPUs at a time)."""
        for other in (self.train_model, *self._inference.values()):
            if other is not None and other is not model and other.isAttachedToDevice():
                other.detachFromDevice()

    # -- batches --------------------------------------------------------------------------------
    def _plan(self, loader: Any, training: bool, name: str, opts: Any = None,
              pad: bool = False, partition: bool = True) -> Plan:
        # The loader's own copy of the (frozen) training options.
        opts = self.train_opts.clone() if opts is None else opts
        return build_plan(self.poptorch, loader, opts, self._layout(opts, training),
                          training=training, name=name, pad=pad, sequential=pad,
                          partition=partition)

    def _cast(self, x: Any) -> Any:
        if self._input_dtype is not None and isinstance(x, torch.Tensor) \
                and x.is_floating_point():
            return x.to(self._input_dtype)  # 16-bit: float inputs are sent as half
        return x

    def _split(self, batch: Any, plan: Plan, cast: bool = True) -> tuple[tuple, torch.Tensor]:
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            self._num_inputs = len(batch) - 1  # what predict feeds
            model = self.model  # (issubclass: isinstance would read the wrapped __class__)
            if issubclass(type(model), WithLoss) and model.num_inputs != len(batch) - 1:
                model.num_inputs = len(batch) - 1  # (Module.__setattr__: only when it changes)
            if self._input_dtype is not None and cast:
                batch = [self._cast(x) for x in batch]
            return tuple(batch[:-1]), batch[-1]
        if isinstance(batch, dict):
            raise ValueError(
                f"{plan.name} yields dict batches (keys {list(batch)}), but the loop takes "
                "(inputs..., labels) tuples, the labels last. Return a tuple from the dataset's "
                "__getitem__, e.g. (d['image'], d['label']), or convert in the collate_fn.")
        raise ValueError(f"{plan.name} must yield (inputs..., labels) tuples: the last element "
                         f"is the labels. Received a {type(batch).__name__}"
                         + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                         + ". Return (x, y) from the dataset's __getitem__.")

    def _probe(self, plan: Plan) -> None:
        """Check one micro-batch on the host before anything is compiled."""
        ds = plan.loader.dataset
        if plan.samples is None or plan.sampler is None:
            return
        collate = plan.loader.collate_fn
        batch = collate([ds[i] for i in range(min(plan.micro, plan.samples))])
        batch = _map_tensors(batch, _device_dtype)  # float64 as the device receives it
        inputs, labels = self._split(batch, plan, cast=False)  # float32: the host computes it
        n = labels.shape[0] if isinstance(labels, torch.Tensor) and labels.dim() else None
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor) and x.dim() and n is not None and x.shape[0] != n:
                raise ValueError(f"{plan.name}: input {i} has batch size {x.shape[0]} but the "
                                 f"labels have {n}. Every tensor in a batch must have the "
                                 "samples on dimension 0.")
        model = self.model
        if self.precision == "16-true":  # a float32 copy: the host may have no float16 kernels
            model = copy.deepcopy(model).float()  # (torch 2.0.1's CPU has no float16 matmul)
        saved = [b.clone() for b in model.buffers()]
        was_training = model.training
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                    warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.train()
                out = model(*inputs, labels)
        except Exception as e:  # name what the model was given: usually the labels are wrong
            raise ValueError(
                f"{plan.name}: the model failed on the first micro-batch, run on the host before "
                f"compilation, with {_describe(inputs, labels)}: {type(e).__name__}: {e}") from e
        finally:
            with torch.no_grad():
                for b, s in zip(model.buffers(), saved):
                    b.copy_(s)
            model.train(was_training)
        if not (isinstance(out, (tuple, list)) and len(out) == 2
                and isinstance(out[1], torch.Tensor)):
            raise ValueError(
                "With labels, the model must return (output, loss). Received: "
                f"{type(out).__name__}" + (f" of length {len(out)}"
                                           if isinstance(out, (tuple, list)) else "")
                + ". Write forward(self, *inputs, labels=None) returning (output, loss) when "
                "labels are given, or pass a plain model with loss_fn=.")
        output, loss = out
        if loss.numel() != 1:
            raise ValueError(f"The loss must be a scalar per micro-batch. Received a loss of "
                             f"shape {list(loss.shape)}: reduce it (mean or sum).")
        if (isinstance(output, torch.Tensor) and isinstance(labels, torch.Tensor)
                and labels.is_floating_point() and output.dim() == labels.dim() + 1
                and output.shape[-1] == 1 and output.shape[:-1] == labels.shape):
            raise ValueError(
                f"{plan.name}: outputs of shape {list(output.shape)} and labels of shape "
                f"{list(labels.shape)} would broadcast to {list(output.shape[:-1]) * 2} in the "
                "loss. Give the labels shape [N, 1] (e.g. y.unsqueeze(-1)) or squeeze the "
                "output.")
        for w in caught:  # torch's losses only warn when the labels broadcast: that is an error
            if "different to the input size" in str(w.message):
                raise ValueError(
                    f"{plan.name}: the loss would broadcast the labels against the output "
                    f"({w.message}), with {_describe(inputs, labels)} and an output of shape "
                    f"{_shape(output)}. Give the labels the output's shape.")
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self._probe_metrics(output, labels)

    def _probe_metrics(self, output: Any, labels: Any) -> None:
        """Update a copy of each metric with the probe's output, so a metric that rejects it
        (another task, shape or class count; a tuple output) fails before compiling."""
        for name, metric in self.metrics.items():
            try:
                copy.deepcopy(metric).update(self._metric_output(output), labels)
            except Exception as e:
                given = (_shape(output) if self._metric_output is _identity
                         else f"{_shape(output)}, given as {_shape(self._metric_output(output))} "
                         "by metric_output")
                raise ValueError(
                    f"metrics[{name!r}] ({type(metric).__name__}) rejects the model's output: "
                    f"update(output, labels) with output {given} and labels {_shape(labels)} "
                    f"raised {type(e).__name__} ({e}). Metrics receive the output the model "
                    "returns with its loss; pass metric_output= (e.g. lambda out: out[0]) to "
                    "give them another, or build the metric for this output.") from e

    # -- validation -----------------------------------------------------------------------------
    def _inference_options(self, loader: Any, micro_hint: int | None) -> Any:
        pt = self.poptorch
        if self._user_inference_opts is not None:
            return self._user_inference_opts.clone()
        inf = self.train_opts.clone()
        # training-only settings PopTorch or PopART reject for inference: accumulation,
        # automatic loss scaling, anchors (of gradients and updated weights, or anything else
        # the training step returns)
        inf.Training.gradientAccumulation(1)
        inf.Training.setAutomaticLossScaling(False)
        inf.anchored_tensors.clear()
        inf.outputMode(pt.OutputMode.All)
        if isinstance(loader, pt.DataLoader):
            lo = loader.options
            inf.deviceIterations(lo.device_iterations)
            inf.replicationFactor(lo.replication_factor)
            return inf
        t = self.train_opts
        di = target = t.device_iterations * t.Training.gradient_accumulation
        per_iteration = (micro_hint or 1) * max(t.replication_factor // t.input_group_size, 1)
        with contextlib.suppress(TypeError):
            n = len(loader.dataset)
            if n < per_iteration * target:
                di = max(1, n // per_iteration)
            else:  # from DI*GA down to half of it: the count that pads the fewest samples
                di = min(range(target, (target - 1) // 2, -1),
                         key=lambda d: -n % (per_iteration * d))
        inf.deviceIterations(di)
        return inf

    def _val_plan(self, loader: Any, *, pad: bool = True, name: str = "val_loader",
                  partition: bool = True) -> Plan:
        micro = loader.batch_size if not isinstance(loader, self.poptorch.DataLoader) else None
        opts = self._inference_options(loader, micro)
        if opts.Training.gradient_accumulation != 1:
            raise ValueError("inference_opts must have Training.gradientAccumulation(1). "
                             f"Received: {opts.Training.gradient_accumulation}.")
        if opts.output_mode not in (ALL, DEFAULT):
            raise ValueError("inference_opts must use OutputMode.All (or Default): validation "
                             f"and predict need every output. Received: "
                             f"{MODE_NAMES.get(opts.output_mode, opts.output_mode)}.")
        opts.outputMode(self.poptorch.OutputMode.All)
        try:
            empty = len(loader.dataset) == 0
        except TypeError:  # an IterableDataset: its length is unknown
            empty = False
        if empty:
            raise ValueError(f"{name} has 0 samples (the loader is empty): there is nothing "
                             "to run. Pass a loader over a dataset with at least one sample.")
        return self._plan(loader, training=False, name=name, opts=opts, pad=pad,
                          partition=partition)

    def _inference_model(self, plan: Plan, kind: str, sample: tuple) -> Any:
        key = (kind, plan.combined, plan.loader.options.device_iterations)
        model = self._inference.get(key)
        if model is not None and model.isCompiled():
            return model
        # PopTorch's inference wrapper is a shallow copy that shares the submodules and traces
        # them in the mode they are in: keep them in eval mode until the graph is compiled.
        module = self.model
        module.eval()
        try:
            if model is None:
                model = self.poptorch.inferenceModel(module, plan.loader.options)
                self._inference[key] = model
            self._fire("on_compile_start")
            start = time.perf_counter()
            self._activate(model)
            model.compile(*sample)
            self.state.compile_time[kind] = time.perf_counter() - start
        finally:
            module.train()
        self._fire("on_compile_end")
        return model

    def validate(self, loader: Any) -> dict[str, float]:
        """Run ``loader`` through the inference model; returns val_loss and val metrics.

        Every sample counts: the samples are read in order and the last host call is padded
        with copies of the last one. The metrics see every sample, and so does val_loss, the
        mean loss per sample: the device's loss for the micro-batches without padding and,
        with ``loss_fn``, ``loss_fn`` on the host for the samples of the one with padding
        (without ``loss_fn`` those are left out, and a warning says how many samples
        val_loss covers). A model that returns no loss in eval mode gets no val_loss.
        """
        self.exception = self.exception_source = None
        plan = self._val_plan(loader)
        try:
            return self._run_validation(plan)
        except (CancelEpoch, CancelFit):  # a hook ended the validation early: no val logs
            self._drop_logs("val_", ("loss", *self.metrics))
            return {}
        except BaseException:
            self._on_exception()
            raise

    def _run_validation(self, plan: Plan) -> dict[str, float]:
        st = self.state
        self._fire("on_validation_start")
        for m in self.metrics.values():
            m.reset()
        total, count, uncovered = 0.0, 0, 0  # val_loss: sum over samples, samples, left out
        model = None
        layout, combined, micro = plan.layout, plan.combined, plan.micro
        loss_fn = self.model.loss_fn if issubclass(type(self.model), WithLoss) else None
        # The loader is padded to whole host calls (copies of the last sample): count only the
        # samples. The device's loss covers the micro-batches without padding; the samples of
        # the one with padding get loss_fn on the host (their outputs are here), when given.
        left = plan.samples if plan.sampler is not None and plan.samples else None
        for batch in plan.epoch():
            inputs, labels = self._split(batch, plan)
            if model is None:
                model = self._inference_model(plan, "validate", (*inputs, labels))
            self._activate(model)
            output = model(*inputs, labels)
            valid = combined if left is None else min(combined, left)
            if left is not None:
                left -= valid
            if _has_loss(output, layout.micro_batches):
                output, loss = output
                loss = layout.input_rows(loss.reshape(-1))  # one per micro-batch of samples
                whole = valid // micro * micro  # samples in micro-batches without padding
                if valid < combined:  # the padded call: its whole micro-batches of samples
                    loss = loss[:valid // micro]
                total += float(loss.double().sum()) * micro  # host tensor: no device sync
                count += whole
                if valid > whole and loss_fn is not None:  # the rest: exactly, on the host
                    part = _map_tensors(output, lambda t: t if t.dim() == 0 else
                                        _float32(layout.input_rows(t)[whole:valid]))
                    with torch.no_grad():
                        rest = loss_fn(part, _map_tensors(labels, lambda t: t[whole:valid]))
                    total += float(rest) * (valid - whole)
                    count += valid - whole
                else:
                    uncovered += valid - whole
            elif not self._warned_no_val_loss:
                # e.g. ``if self.training: return x, loss`` / ``return x``: no loss in eval mode
                self._warned_no_val_loss = True
                warnings.warn("In eval mode the model returns its output without a loss, so "
                              "validation logs no val_loss (metrics are still computed). "
                              "Return (output, loss) whenever labels are given to get one.",
                              stacklevel=2)
            if self.metrics and valid:  # All mode, [DI, RF, B]: the host batch's order, per
                # input group (several processes: a call may be all padding, and skipped)
                output = _map_tensors(output, lambda t: t if t.dim() == 0
                                      else layout.input_rows(t)[:valid])
                if valid < combined:
                    labels = _map_tensors(labels, lambda t: t[:valid])
                output = self._metric_output(output)
                for m in self.metrics.values():
                    m.update(output, labels)
            self._fire("on_validation_step_end")
            self._check_preempted()
        if self._dist is not None:  # several processes: each validated a slice
            total, count, uncovered = self._dist.val_sums(total, count, uncovered)
        if uncovered and not self._warned_partial_val_loss:
            self._warned_partial_val_loss = True
            warnings.warn(
                f"val_loss covers {count} of the {count + uncovered} validation samples: the "
                f"last {uncovered} share a micro-batch of {micro} with padding, whose loss the "
                "device computes over both. Pass loss_fn= to Loop (then the loop computes the "
                "loss of those samples on the host), or use a micro-batch size that divides "
                "the sample count.", stacklevel=3)
        logs = {"val_loss": total / count} if count else {}
        logs.update(_metric_logs("val_", self.metrics))
        if not count:
            self._drop_logs("val_", ("loss",))  # none this time, rather than a stale one
        st.logs.update(logs)
        self._fire("on_validation_end")
        return logs

    # -- predict --------------------------------------------------------------------------------
    def predict(self, loader: Any) -> Any:
        """Outputs for every sample of ``loader``'s dataset, in dataset order.

        Batches are read in order (shuffle and the sampler are ignored). The samples are
        padded with copies of the last one up to whole host calls and the padding's outputs
        are dropped, so no sample is lost to the combined batch size (an IterableDataset is
        padded as it streams; with workers, its order is the loader's). With input replica
        grouping each sample's output is returned once. A model returning a tuple, list,
        namedtuple or dict of tensors gets the same structure back, each tensor joined over
        the samples. After a fit (or validate) with N inputs, every batch of N elements is
        fed whole, and the last element of a batch of N + 1 (the labels) is ignored; before
        any, a batch of two or more elements is taken as (inputs..., labels).
        Float64 inputs run, and come back, as float32 (as on the device).
        """
        self.exception = self.exception_source = None
        plan = self._val_plan(loader, pad=True, name="loader", partition=False)
        flagged = isinstance(plan.loader.dataset, torch.utils.data.IterableDataset)
        if flagged:  # length unknown: pad the stream, and flag which rows are samples
            plan = self._flagged_plan(plan)
        outputs: list[Any] = []
        flags: list[torch.Tensor] = []
        model = None
        try:
            for batch in plan.epoch():
                if flagged:
                    flag, batch = batch
                    flags.append(flag)
                inputs = self._predict_inputs(batch, plan)
                if model is None and isinstance(self.model, WithLoss):
                    self.model.num_inputs = len(inputs)
                inputs = tuple(self._cast(x) for x in inputs)
                if model is None:
                    model = self._inference_model(plan, "predict", inputs)
                self._activate(model)
                outputs.append(model(*inputs))
        except BaseException:
            self._on_exception()
            raise
        if not outputs:
            raise ValueError(f"loader yielded no samples: {type(plan.loader.dataset).__name__} "
                             "was empty. predict needs at least one sample.")
        keep = torch.cat(flags) if flagged else slice(None, plan.samples)
        return _concat(outputs, keep, plan.layout.input_rows)

    def _predict_inputs(self, batch: Any, plan: Plan) -> tuple:
        """The model's inputs in a predict batch: all of its elements, or all but the labels.

        After a fit or validate with N inputs, a batch of N elements is N inputs and one of
        N + 1 is N inputs and the labels; before, a batch of two or more elements is taken
        as (inputs..., labels).
        """
        if not isinstance(batch, (tuple, list)):
            return (batch,)
        n = self._num_inputs
        if n is None:
            return tuple(batch[:-1]) if len(batch) >= 2 else tuple(batch)
        if len(batch) in (n, n + 1):
            return tuple(batch[:n])
        raise ValueError(f"{plan.name} yields batches of {len(batch)} elements, but the model "
                         f"was fit with {n} input(s): predict takes (inputs...) or "
                         "(inputs..., labels) batches of those inputs.")

    def _flagged_plan(self, plan: Plan) -> Plan:
        """``plan`` over an IterableDataset, each sample flagged True and the stream padded
        (per worker) to whole host calls with False-flagged copies of its last sample."""
        src = plan.loader
        kwargs = {k: getattr(src, k) for k in ("num_workers", "worker_init_fn",
                                               "multiprocessing_context")}
        if kwargs["num_workers"] == 0:
            kwargs.pop("multiprocessing_context")
        loader = self.poptorch.DataLoader(
            src.options, _Flagged(src.dataset, plan.combined), batch_size=plan.micro,
            drop_last=True, collate_fn=_FlagCollate(src.collate_fn), **kwargs)
        return Plan(loader, None, plan.micro, plan.combined, plan.layout, None, plan.name)

    # -- failure --------------------------------------------------------------------------------
    def _on_exception(self) -> None:
        """Fire on_exception for the error being handled, once (a nested call reported it)."""
        error = sys.exc_info()[1]
        if error is self.exception:
            return
        self.exception = error  # what on_exception callbacks are told about
        for cb, hook in self._hooks["on_exception"]:
            try:
                hook(self)
            except Exception as e:  # the original exception is the one to report
                warnings.warn(f"{type(cb).__name__}.on_exception failed: {e!r}")

    # -- checkpoint state -----------------------------------------------------------------------
    def check_resumable(self) -> None:
        """Raise ``ValueError`` when a checkpoint could not resume exactly: PopTorch reads and
        writes optimizer state (momentum, moments) only for ``poptorch.optim`` optimizers, so a
        stateful ``torch.optim`` one keeps it on the device, out of every checkpoint."""
        opt = self.optimizer
        pt = self.poptorch
        if opt is None or isinstance(opt, (pt.optim.SGD, pt.optim.Adam, pt.optim.AdamW,
                                           pt.optim.RMSprop, pt.optim.LAMB)):
            return
        if isinstance(opt, torch.optim.SGD) and not any(g.get("momentum")
                                                        for g in opt.param_groups):
            return  # plain SGD: no state to lose
        twin = next((c.__name__ for c in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD,
                                          torch.optim.RMSprop) if isinstance(opt, c)),
                    type(opt).__name__)
        args = ", ".join(f"{k}={v!r}" for k, v in opt.defaults.items() if k in (
            "lr", "momentum", "dampening", "nesterov", "betas", "eps", "weight_decay", "alpha",
            "centered"))
        raise ValueError(
            f"optimizer={type(opt).__module__}.{type(opt).__qualname__} keeps its state "
            "(momentum, moments) on the IPU only: PopTorch reads and writes optimizer state for "
            "poptorch.optim optimizers alone, so a checkpoint would hold none and a resumed fit "
            "would restart it from zero. Use its poptorch.optim twin, with the same values: "
            f"poptorch.optim.{twin}(params, {args}).")

    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs, as tensors, numbers, strings, lists and dicts.

        A ``torch.optim`` optimizer with state is refused (``check_resumable``)."""
        self.check_resumable()
        if self.train_model is not None and self.train_model.isAttachedToDevice():
            # the device holds the current weights (a detached model copied them back when it
            # detached, and reading from a device it no longer holds is undefined in PopTorch)
            self.train_model.copyWeightsToHostIfNeeded()
        model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        sd: dict[str, Any] = {
            "model": model_state,
            "optimizer": self.optimizer.state_dict(),
            "optimizer_type": type(self.optimizer).__name__,
            "data": copy.deepcopy(self._train_data),  # the factors the counters refer to
            "counters": self.state.counters(),
            "history": [dict(h) for h in self.state.history],
            "logs": dict(self.state.logs),  # an epoch ending right after a resume logs these
            "epoch_loss": list(self._epoch_loss),
            "rng": self._val_rng if self._val_rng is not None else _rng_state(),
            # poptorch.optim attributes outside optimizer.state_dict() (loss_scaling, ...)
            "optimizer_extras": {k: float(getattr(self.optimizer, k)) for k in OPTIMIZER_EXTRAS
                                 if hasattr(self.optimizer, k)},
            "sampler_rng": self._sampler.generator_state() if self._sampler is not None else None,
            "epoch_rng": self._epoch_rng,
            "metrics": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v
                            for n, v in _metric_state(m).items()}
                        for k, m in self._train_metrics().items()},
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
        }
        if self.train_model is not None and self.train_model.isCompiled():
            sd["device_rng"] = self.train_model.rng_state
        if self._dist is not None:  # several processes: the run's sums, each one's RNG
            sd = self._dist.checkpoint_state(self, sd)
        return copy.deepcopy(sd)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a ``state_dict()``: the next ``fit`` continues where it was taken.

        The optimizer must be of the saved type with the saved parameter-group layout
        (checked before anything is restored). The next ``fit`` compares its loader's factors
        with the saved ones: see ``fit``.
        """
        self._check_optimizer(sd)
        if self._dist is not None:  # several processes: this one's share and RNG
            sd = self._dist.own_state(self, sd)
        if self.train_model is not None:
            self.train_model.load_state_dict(sd["model"])
        else:
            self.model.load_state_dict(sd["model"])
        if sd.get("optimizer") is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
            for k, v in sd.get("optimizer_extras", {}).items():  # pushed before the first step
                setattr(self.optimizer, k, v)
        self.state.load_counters(sd["counters"])
        self._loaded_data = sd.get("data")  # checked against the next fit's loader
        self.state.history = [dict(h) for h in sd["history"]]
        self.state.logs = dict(sd.get("logs", {}))
        self._epoch_loss = list(sd["epoch_loss"])
        for k, m in self._train_metrics().items():
            for n, v in sd.get("metrics", {}).get(k, {}).items():
                setattr(m, n, v)
        for cb in self.callbacks:
            if cb.state_key in sd["callbacks"]:
                cb.load_state_dict(sd["callbacks"][cb.state_key])
        if sd.get("device_rng") is not None:
            if self.train_model is not None and self.train_model.isCompiled():
                self.train_model.rng_state = sd["device_rng"]
            else:
                self._device_rng = sd["device_rng"]
        if self.state.epoch_step:
            self._epoch_rng, self._resume_rng = sd["epoch_rng"], sd["rng"]
        else:
            _set_rng_state(sd["rng"])
            self._sampler_rng = sd.get("sampler_rng")  # the loader's own generator, if any
        self._fire("on_load_checkpoint")

    def _check_optimizer(self, sd: dict[str, Any]) -> None:
        saved = sd.get("optimizer")
        if saved is None:
            return
        ours = self.optimizer
        theirs_type = sd.get("optimizer_type", type(ours).__name__)  # older checkpoints: unnamed
        layout = [len(g["params"]) for g in saved["param_groups"]]
        our_layout = [len(g["params"]) for g in ours.param_groups]
        if theirs_type != type(ours).__name__ or layout != our_layout:
            raise ValueError(
                f"Cannot resume: the checkpoint's optimizer is {theirs_type} with "
                f"{len(layout)} parameter group(s) of {layout} parameters, but the loop's is "
                f"{type(ours).__name__} with {len(our_layout)} of {our_layout}. Build the loop "
                "with the optimizer type and parameter groups of the saved run, or start a new "
                'fit from its weights: model.load_state_dict(load_checkpoint(path)["model"]).')

    @staticmethod
    def _data_factors(plan: Plan) -> dict[str, Any]:
        o = plan.loader.options
        return {"factors": {"micro-batch size": plan.micro,
                            "deviceIterations": o.device_iterations,
                            "gradientAccumulation": o.Training.gradient_accumulation,
                            "replicationFactor": o.replication_factor,
                            "input_group_size": o.input_group_size,
                            "dataset length": plan.samples},
                "samples_per_step": plan.combined}

    def _continue_at(self, plan: Plan) -> None:
        """The training data factors of this fit; after a load (that recorded them), checked
        by ``_align`` first. A failed check keeps the loaded ones for the next fit."""
        now = self._data_factors(plan)
        if self._loaded_data is not None:
            self._align(self._loaded_data, now, plan)
        self._loaded_data, self._train_data = None, now

    def _align(self, saved: dict[str, Any], now: dict[str, Any], plan: Plan) -> None:
        """Continue the saved epoch at the same sample with the new factors, or raise naming
        each factor that changed."""
        old, new = saved["factors"], now["factors"]
        changed = ", ".join(f"{k} {old[k]} -> {new[k]}" for k in new
                            if k in old and old[k] != new[k])
        st = self.state
        if not changed:
            return
        if st.epoch_step == 0:
            warnings.warn(f"Resuming at the start of epoch {st.epoch} with other factors than "
                          f"the checkpoint's ({changed}): the epochs from here on use the new "
                          "ones.", stacklevel=4)
            return
        position = st.epoch_step * saved["samples_per_step"]  # samples the epoch has read
        if old.get("dataset length") == new["dataset length"] and not position % plan.combined:
            st.epoch_step = position // plan.combined  # the same sample, in the new host calls
            warnings.warn(f"Resuming epoch {st.epoch} after its {position} samples already "
                          f"read, with other factors than the checkpoint's ({changed}): "
                          f"{st.epoch_step} host calls of the new factors.", stacklevel=4)
            return
        raise ValueError(
            f"Cannot resume in the middle of epoch {st.epoch} with other factors ({changed}): "
            f"the checkpoint stopped after {position} of the epoch's samples, and "
            + ("a different dataset length changes the epoch's sample order"
               if old.get("dataset length") != new["dataset length"] else
               f"{position} is not a whole number of the new host calls of "
               f"{describe_factors(plan.loader.options, plan.micro, True)}")
            + ". Resume with the saved factors (finishing this epoch, then change them at an "
            "epoch boundary), or from a checkpoint taken at the end of an epoch.")

    def _resume(self, source: str) -> None:
        from .callbacks.checkpoint import ModelCheckpoint, load_checkpoint
        if source == "last":
            cps = [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]
            if not cps:
                raise ValueError('resume_from="last" needs a ModelCheckpoint callback to know '
                                 "the folder; pass a checkpoint path instead.")
            path = cps[0].latest()
            if path is None:
                warnings.warn(f"No checkpoint in {cps[0].dirpath}: starting from scratch.")
                return
            source = path
        from .backend import backend_name
        self.load_state_dict(load_checkpoint(source, backend=backend_name()))
