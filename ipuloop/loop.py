"""``Loop``: fit / validate / predict over the PopTorch API, and the only place events are ordered.

The event order is written once, in ``ipuloop.callbacks.base``.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import sys
import time
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch

from .backend import poptorch_module
from .callbacks.base import EVENTS, Callback, CancelEpoch, CancelFit, CancelStep, overridden
from .data import Plan, build_plan, combined_factor, describe_factors
from .signals import Preempted, handle_signals
from .outputs import ALL, DEFAULT, EVERY_N, FINAL, MODE_NAMES, SUM, Layout
from .state import State

__all__ = ["Loop", "WithLoss", "NonFiniteLossError"]


class NonFiniteLossError(FloatingPointError):
    """A returned loss was NaN or infinite."""


class WithLoss(torch.nn.Module):
    """``model`` plus ``loss_fn`` as a model-with-loss: ``forward(*inputs[, labels])``.

    Called with ``num_inputs`` inputs it returns ``output``; with one more argument, the
    labels, it returns ``(output, loss_fn(output, labels))``. The loss runs after the model's
    last layer, so it joins the model's last pipeline block.
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
        return output, self.loss_fn(output, args[-1])


class _Autocast(torch.nn.Module):
    """Runs ``module`` under ``torch.autocast`` (mixed 16-bit precision on the emulator)."""

    def __init__(self, module: torch.nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.device_type, self.dtype = device_type, dtype

    def forward(self, *args: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args)


PRECISIONS = ("32", "16-mixed", "16-true")


def _hyper(opt: torch.optim.Optimizer) -> tuple:
    """The optimizer's hyper-parameters, to tell when they changed (host only, no sync).

    Read every step, so kept cheap: a group's items in their own (insertion) order, which
    only changes when a key is added, and that is a change too.
    """
    T = torch.Tensor
    groups = tuple(tuple((k, float(v) if isinstance(v, T) else v)
                         for k, v in g.items() if k != "params")
                   for g in opt.param_groups)
    extras = tuple(getattr(opt, k, None) for k in ("loss_scaling", "max_grad_norm",
                                                    "velocity_scaling", "max_weight_norm"))
    return groups, extras


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
    return type(x).__name__


def _describe(inputs: tuple, labels: Any) -> str:
    """The batch as the model sees it, e.g. "inputs (float32 [4, 6]) and labels int64 [4]"."""
    return (f"input{'s' if len(inputs) != 1 else ''} ({', '.join(_shape(x) for x in inputs)}) "
            f"and labels {_shape(labels)}")


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
            from what the device returns, logged as ``train_<name>`` and ``val_<name>``.
        callbacks: ``Callback`` instances; a progress display is added unless ``progress``
            is False.
        replicas: data-parallel replicas (``replicationFactor``), or "auto".
        inference_opts: options for validation and predict; default: a clone of the
            training options with gradientAccumulation 1 and a device-iteration count that
            keeps one validation call about the size of a training call.
        seed: seeds python, numpy, torch and the device (``Options.randomSeed``).
        check_finite: raise ``NonFiniteLossError`` on a NaN or infinite returned loss.
        precision: "32" (default), "16-mixed" or "16-true". Mixed: autocast on the emulator
            (bfloat16 on the CPU, float16 on CUDA), float inputs cast to half on an IPU.
            True: the model and float inputs in float16. Loss scaling is static: set
            ``loss_scaling`` on a ``poptorch.optim`` optimizer.
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
                 metrics: Any = None, callbacks: Iterable[Callback] = (),
                 replicas: int | str | None = None, inference_opts: Any = None,
                 seed: int | None = None, progress: bool | int = True,
                 check_finite: bool = True, max_grad_norm: float | None = None,
                 precision: str = "32") -> None:
        self.poptorch = pt = poptorch_module()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module. Received: model={type(model)!r}.")
        self.model = WithLoss(model, loss_fn) if loss_fn is not None else model
        self._set_precision(precision)
        self.train_opts, inf = self._resolve_options(opts, inference_opts)
        self._user_inference_opts = inf
        if replicas is not None:
            self._set_replicas(replicas)
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
        self.optimizer = optimizer
        self.metrics = self._resolve_metrics(metrics)  # validation's; training uses clones
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
        self.optimizer_pushes = 0  # setOptimizer calls made (only when a hyper-parameter changed)
        self._epoch_loss = [0.0, 0, True]  # total, count, exact
        self._epoch_rng: dict[str, Any] | None = None
        self._resume_rng: dict[str, Any] | None = None
        self._sampler: Any = None  # the running fit's ResumableSampler
        self._sampler_rng: torch.Tensor | None = None  # its generator, resumed at an epoch start
        self._device_rng: torch.Tensor | None = None
        self._max_steps: int | None = None
        self._exception_fired = False
        self.exception: BaseException | None = None  # set while on_exception hooks run
        self.exception_source: Callback | None = None  # the callback whose hook raised it
        self._batches: Any = None  # the running epoch's batch iterator
        self._preempted = False

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

    def _set_replicas(self, replicas: int | str) -> None:
        if replicas == "auto":
            # Emulator: no IPUs to count; on hardware, the most replicas the free IPUs allow.
            n = 1
            while self.poptorch.ipuHardwareIsAvailable(2 * n):
                n *= 2
            replicas = n
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1 or 'auto'. Received: "
                             f"replicas={replicas!r}.")
        current = self.train_opts.replication_factor
        if current not in (1, replicas):
            raise ValueError(f"replicas={replicas} contradicts opts.replicationFactor({current}): "
                             "set one of them.")
        self.train_opts.replicationFactor(replicas)

    def _set_precision(self, precision: str) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}. Received: "
                             f"precision={precision!r}.")
        self.precision = precision
        self._device_module = self.model  # what the executors wrap
        self._input_dtype: torch.dtype | None = None
        if precision == "16-true":
            self.model.half()
            self._input_dtype = torch.float16
        elif precision == "16-mixed":
            from .backend import backend_name
            if backend_name() == "emulator":
                device = os.environ.get("IPULOOP_EMULATOR_DEVICE", "cpu").split(":")[0]
                dtype = torch.float16 if device == "cuda" else torch.bfloat16
                self._device_module = _Autocast(self.model, device, dtype)
            else:  # PopTorch 3.x: half inputs, ops follow PyTorch's type promotion
                self._input_dtype = torch.float16

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
                if hasattr(e, "add_note"):
                    e.add_note(f"raised in callback {type(cb).__name__}.{event}")
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

        ``resume_from`` (a checkpoint path, or "last" with a ModelCheckpoint callback)
        continues an interrupted fit exactly. ``max_steps`` ends the fit after that many
        training steps in total (for smoke runs), like ``stop()``: an epoch it cuts short is
        not counted as complete.

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
        plan = self._plan(train_loader, training=True, name="train_loader")
        val_plan = self._val_plan(val_loader) if val_loader is not None else None
        self._probe(plan)
        if resume_from is not None:
            self._resume(resume_from)
        st = self.state
        st.stop_requested = False
        self._exception_fired = False
        self.exception = self.exception_source = None
        self._max_steps = max_steps
        self._steps_hint = plan.steps
        self._preempted = False
        with handle_signals(self._on_sigterm, self._kill_workers):
            try:
                self._fire("on_fit_start")
                try:
                    while st.epoch < epochs and not self._should_stop():
                        self._check_preempted()  # SIGTERM during epoch-end hooks: stop here
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
        self._preempted = True

    def _check_preempted(self) -> None:
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
        for name, m in self._train_metrics().items():
            st.logs[f"train_{name}"] = float(m.compute())  # host-side metric: no device sync
        if self._should_stop() and plan.steps and st.epoch_step < plan.steps:
            return  # stopped mid-epoch (stop() or max_steps): the epoch is not complete
        if val_plan is not None:
            self._run_validation(val_plan)
        st.epoch += 1
        st.epoch_step = 0
        st.history.append({"epoch": st.epoch, **st.logs})
        self._fire("on_epoch_end")

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
        fresh, seen = st.epoch_step == 0, False
        for batch in batches:
            seen = True
            self._check_preempted()  # SIGTERM while the batch was read: stop before the step
            inputs, labels = self._split(batch, plan)
            if self.train_model is None or not self.train_model.isCompiled():
                self._compile_train(inputs, labels)
            try:
                self._fire("on_train_step_start")
            except CancelStep:
                continue
            self._activate(self.train_model)
            self._push_optimizer()
            output, loss = self.train_model(*inputs, labels)
            step_loss = layout.step_loss(loss)  # host tensor: reading it syncs nothing
            if self.check_finite and not math.isfinite(step_loss.total):
                self._raise_non_finite(loss, layout)
            st.step += 1
            st.epoch_step += 1
            st.update += layout.di
            st.micro_batch += layout.micro_batches
            st.samples += per_step_samples
            el = self._epoch_loss
            el[0] += step_loss.total
            el[1] += step_loss.count
            el[2] = el[2] and step_loss.exact
            st.logs["loss"] = step_loss.mean
            if metrics:
                aligned = layout.align(labels)
                for m in metrics.values():
                    m.update(output, aligned)
            self._fire("on_train_step_end")
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
            self.train_model = pt.trainingModel(self._device_module, self.train_opts,
                                                optimizer=self.optimizer)
            if self.optimizer is None:
                self.optimizer = getattr(self.train_model, "_optimizer", None)
        self._fire("on_compile_start")
        start = time.perf_counter()
        self._activate(self.train_model)
        self.train_model.compile(*inputs, labels)
        self.state.compile_time["train"] = time.perf_counter() - start
        device_rng, self._device_rng = self._device_rng, None
        if device_rng is not None:  # resumed: the device continues the saved random stream
            self.train_model.rng_state = device_rng
        self._pushed = _hyper(self.optimizer) if self.optimizer is not None else None
        self._fire("on_compile_end")

    def _push_optimizer(self) -> None:
        # The device never re-reads the host optimizer: push only what changed (setOptimizer).
        if self.optimizer is None:
            return
        current = _hyper(self.optimizer)
        if current != self._pushed:
            self.train_model.setOptimizer(self.optimizer)
            self.optimizer_pushes += 1
            self._pushed = current

    def _activate(self, model: Any) -> None:
        """Detach every other executor before ``model`` runs (one set of IPUs at a time)."""
        for other in (self.train_model, *self._inference.values()):
            if other is not None and other is not model and other.isAttachedToDevice():
                other.detachFromDevice()

    # -- batches --------------------------------------------------------------------------------
    def _plan(self, loader: Any, training: bool, name: str, opts: Any = None,
              pad: bool = False) -> Plan:
        # The DataLoader freezes the options it gets: give it a copy, so train_opts stay
        # settable (e.g. by on_fit_start callbacks) until the training model is built.
        opts = self.train_opts.clone() if opts is None else opts
        return build_plan(self.poptorch, loader, opts, self._layout(opts, training),
                          training=training, name=name, pad=pad, sequential=pad)

    def _cast(self, x: Any) -> Any:
        if self._input_dtype is not None and isinstance(x, torch.Tensor) \
                and x.is_floating_point():
            return x.to(self._input_dtype)  # 16-bit: float inputs are sent as half
        return x

    def _split(self, batch: Any, plan: Plan) -> tuple[tuple, torch.Tensor]:
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            if isinstance(self.model, WithLoss):
                self.model.num_inputs = len(batch) - 1
            if self._input_dtype is not None:
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
        inputs, labels = self._split(batch, plan)
        n = labels.shape[0] if isinstance(labels, torch.Tensor) and labels.dim() else None
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor) and x.dim() and n is not None and x.shape[0] != n:
                raise ValueError(f"{plan.name}: input {i} has batch size {x.shape[0]} but the "
                                 f"labels have {n}. Every tensor in a batch must have the "
                                 "samples on dimension 0.")
        model = self.model
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

    # -- validation -----------------------------------------------------------------------------
    def _inference_options(self, loader: Any, micro_hint: int | None) -> Any:
        pt = self.poptorch
        if self._user_inference_opts is not None:
            return self._user_inference_opts.clone()
        inf = self.train_opts.clone()
        inf.Training.gradientAccumulation(1)
        inf.outputMode(pt.OutputMode.All)
        if isinstance(loader, pt.DataLoader):
            lo = loader.options
            inf.deviceIterations(lo.device_iterations)
            inf.replicationFactor(lo.replication_factor)
            return inf
        t = self.train_opts
        di = t.device_iterations * t.Training.gradient_accumulation
        micro = micro_hint or 1
        with contextlib.suppress(TypeError):
            fits = len(loader.dataset) // (micro * t.replication_factor)
            di = max(1, min(di, fits))
        inf.deviceIterations(di)
        return inf

    def _val_plan(self, loader: Any, *, pad: bool = False, name: str = "val_loader") -> Plan:
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
        return self._plan(loader, training=False, name=name, opts=opts, pad=pad)

    def _inference_model(self, plan: Plan, kind: str, sample: tuple) -> Any:
        key = (kind, plan.combined, plan.loader.options.device_iterations)
        model = self._inference.get(key)
        if model is None:
            self.model.eval()
            model = self.poptorch.inferenceModel(self._device_module, plan.loader.options)
            self.model.train()
            self._inference[key] = model
        if not model.isCompiled():
            self._fire("on_compile_start")
            start = time.perf_counter()
            self._activate(model)
            model.compile(*sample)
            self.state.compile_time[kind] = time.perf_counter() - start
            self._fire("on_compile_end")
        return model

    def validate(self, loader: Any) -> dict[str, float]:
        """Run ``loader`` through the inference model; returns val_loss and val metrics."""
        plan = self._val_plan(loader)
        try:
            return self._run_validation(plan)
        except BaseException:
            self._on_exception()
            raise

    def _run_validation(self, plan: Plan) -> dict[str, float]:
        st = self.state
        self._fire("on_validation_start")
        for m in self.metrics.values():
            m.reset()
        total, count = 0.0, 0
        model = None
        for batch in plan.epoch():
            inputs, labels = self._split(batch, plan)
            if model is None:
                model = self._inference_model(plan, "validate", (*inputs, labels))
            self._activate(model)
            output, loss = model(*inputs, labels)
            total += float(loss.double().sum())  # host tensor: no device sync
            count += loss.numel()
            for m in self.metrics.values():
                m.update(output, labels)  # All mode, [DI, RF, B] order: labels line up as-is
            self._fire("on_validation_step_end")
            self._check_preempted()
        logs = {"val_loss": total / max(count, 1)}
        for name, m in self.metrics.items():
            logs[f"val_{name}"] = float(m.compute())
        st.logs.update(logs)
        self._fire("on_validation_end")
        return logs

    # -- predict --------------------------------------------------------------------------------
    def predict(self, loader: Any) -> Any:
        """Outputs for every sample of ``loader``'s dataset, in dataset order.

        Batches are read in order (shuffle is ignored); the last host batch is padded with
        copies of the last sample and the padding's outputs are dropped. A batch that is a
        tuple of two or more elements is taken as (inputs..., labels) and labels are ignored.
        """
        plan = self._val_plan(loader, pad=True, name="loader")
        outputs: list[Any] = []
        model = None
        try:
            for batch in plan.epoch():
                inputs = tuple(batch[:-1]) if isinstance(batch, (tuple, list)) \
                    and len(batch) >= 2 else (batch if isinstance(batch, (tuple, list))
                                              else (batch,))
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
        n = plan.samples
        if isinstance(outputs[0], torch.Tensor):
            return torch.cat(outputs)[:n]
        return type(outputs[0])(torch.cat(col)[:n] for col in zip(*outputs))

    # -- failure --------------------------------------------------------------------------------
    def _on_exception(self) -> None:
        if self._exception_fired:
            return
        self._exception_fired = True
        self.exception = sys.exc_info()[1]  # what on_exception callbacks are told about
        for cb, hook in self._hooks["on_exception"]:
            try:
                hook(self)
            except Exception as e:  # the original exception is the one to report
                warnings.warn(f"{type(cb).__name__}.on_exception failed: {e!r}")

    # -- checkpoint state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs, as tensors, numbers, strings, lists and dicts."""
        if self.train_model is not None and self.train_model.isCompiled():
            self.train_model.copyWeightsToHost()  # the device holds the current weights
        model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        sd: dict[str, Any] = {
            "model": model_state,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "counters": self.state.counters(),
            "history": [dict(h) for h in self.state.history],
            "logs": dict(self.state.logs),  # an epoch ending right after a resume logs these
            "epoch_loss": list(self._epoch_loss),
            "rng": _rng_state(),
            "sampler_rng": self._sampler.generator_state() if self._sampler is not None else None,
            "epoch_rng": self._epoch_rng,
            "metrics": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v
                            for n, v in m.metric_state.items()}
                        for k, m in self._train_metrics().items()},
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
        }
        if self.train_model is not None and self.train_model.isCompiled():
            sd["device_rng"] = self.train_model.rng_state
        return copy.deepcopy(sd)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a ``state_dict()``: the next ``fit`` continues where it was taken."""
        if self.train_model is not None:
            self.train_model.load_state_dict(sd["model"])
        else:
            self.model.load_state_dict(sd["model"])
        if sd.get("optimizer") is not None:
            if self.optimizer is None:
                raise ValueError("The checkpoint has optimizer state but the loop has no "
                                 "optimizer: pass the same optimizer as the saved run.")
            self.optimizer.load_state_dict(sd["optimizer"])
        self.state.load_counters(sd["counters"])
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
