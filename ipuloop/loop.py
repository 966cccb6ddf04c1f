"""``Loop``: wires options, data, executors and callbacks, and is the only place events are ordered.

The event order is written once, in ``ipuloop.callbacks.base``. Each scope runs start event,
body, end event (``_with_events``); ``stop()``, ``max_steps`` and SIGTERM are flags read at
step boundaries (``_step_boundary``).
"""
from __future__ import annotations

import contextlib
import copy
import math
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch

from .backend import backend_name, poptorch_module
from .callbacks.base import (EVENTS, Callback, CancelEpoch, CancelFit, CancelStep,
                             default_callbacks, overridden)
from .checkpoint_io import load_checkpoint
from .data import (Plan, build_plan, concat, first_micro_batch, flagged_plan, predict_inputs,
                   split_batch)
from .device import Executors, WithLoss
from .errors import NonFiniteLossError, add_note
from .metrics import ValLoss, has_loss, metric_logs, metric_state, probe, resolve_metrics
from .options import (check_optimizer_arg, inference_options, layout, resolve_options,
                      resolve_output_mode, resolve_precision, seed_options, set_clipping,
                      set_replicas)
from .outputs import SUM, Layout, map_tensors
from .resume import Resume, check_optimizer, check_resumable, optimizer_extras, rng_state
from .rules import describe_factors
from .signals import Preempted, handle_signals
from .state import State

__all__ = ["Loop", "WithLoss", "NonFiniteLossError"]


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
        self.precision = resolve_precision(precision)
        # One path on the emulator and on an IPU: float inputs are sent as float16; "16-true"
        # also makes the weights float16, "16-mixed" keeps them float32 (see ``Loop``).
        if self.precision == "16-true":
            self.model.half()
        self._input_dtype = None if self.precision == "32" else torch.float16
        self.train_opts, self._user_inference_opts, per_replica = \
            resolve_options(pt, opts, inference_opts)
        if replicas is not None:
            set_replicas(pt, self.train_opts, replicas, per_replica)
        if seed is not None:
            seed_options(self.train_opts, seed)
        check_optimizer_arg(optimizer)
        if max_grad_norm is not None:
            set_clipping(pt, optimizer, max_grad_norm)
        # PopTorch's default, made here rather than inside trainingModel, so that it exists
        # (and its state loads) before the first compilation.
        self.optimizer = optimizer if optimizer is not None else \
            pt.optim.SGD(self.model.parameters(), lr=0.01)
        self.metrics = resolve_metrics(metrics)  # validation's; training uses clones
        if metric_output is not None and not callable(metric_output):
            raise TypeError(f"metric_output must be a function of the model's output. "
                            f"Received: metric_output={metric_output!r}.")
        self._metric_output = metric_output
        self._train_metrics = {k: m.clone() for k, m in self.metrics.items()}
        self.check_finite = check_finite
        self.state = State()
        resolve_output_mode(pt, self.train_opts, self.metrics)
        cbs = list(callbacks)
        for cb in cbs:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be ipuloop.Callback instances. Received: "
                                f"{type(cb).__name__}.")
        self.callbacks = sorted(cbs + default_callbacks(cbs, progress), key=lambda cb: cb.order)
        keys = [cb.state_key for cb in self.callbacks]
        if len(set(keys)) != len(keys):
            raise ValueError(f"Two callbacks share a state_key ({keys}): give each a unique "
                             "state_key so checkpoints can tell them apart.")
        self._hooks = {e: [(cb, getattr(cb, e)) for cb in self.callbacks if overridden(cb, e)]
                       for e in EVENTS}
        self.executors = Executors(pt, self.model, self.optimizer)
        self._resume = Resume()
        self._batches: Any = None  # the running epoch's batch iterator
        self._warned: set[str] = set()  # one-time warnings given
        self._frozen = False  # train_opts: settable in on_configure, then frozen
        self._num_inputs: int | None = None  # inputs per batch in the last fit or validate

    @property
    def train_model(self) -> Any:
        """The training executor (``poptorch.trainingModel``), None before the first step."""
        return self.executors.train

    @property
    def optimizer_pushes(self) -> int:
        """``setOptimizer`` calls made (only when a hyper-parameter changed)."""
        return self.executors.pushes

    @property
    def exception(self) -> BaseException | None:
        """The error ``on_exception`` hooks are told of (``state.exception``)."""
        return self.state.exception

    @property
    def exception_source(self) -> Callback | None:
        """The callback whose hook raised ``exception``, if one did."""
        return self.state.exception_source

    # -- events ---------------------------------------------------------------------------------
    def _fire(self, event: str) -> None:
        for cb, hook in self._hooks[event]:
            try:
                hook(self)
            except (CancelStep, CancelEpoch, CancelFit):
                raise
            except BaseException as e:
                if self.state.exception_source is None:  # the innermost hook: the one that failed
                    self.state.exception_source = cb
                add_note(e, f"raised in callback {type(cb).__name__}.{event}")
                if isinstance(e, AttributeError) and "frozen Options" in str(e):
                    add_note(e, "The loop's options freeze when fit starts: change "
                                "loop.train_opts in a callback's on_configure.")
                raise

    def _event(self, event: str, cancel: type) -> bool:
        """Fire ``event``; False when a hook raised ``cancel`` (the later hooks skipped)."""
        try:
            self._fire(event)
            return True
        except cancel:
            return False

    def _with_events(self, start: str, body: Callable[[], Any], cancel: type,
                     end: str | None = None) -> None:
        """``start``, ``body``, ``end``: ``cancel`` from the first two skips to ``end`` (from
        ``end`` itself, it has nothing left to skip)."""
        try:
            self._fire(start)
            body()
        except cancel:
            pass
        if end is not None:
            self._event(end, cancel)

    @contextlib.contextmanager
    def _reporting(self, fit: bool = False) -> Iterator[None]:
        """Any error fires ``on_exception`` once and propagates; a fit's also releases the
        device. A fit's loader workers stop when it ends, however it ends."""
        try:
            yield
        except BaseException as error:
            st = self.state
            if error is not st.exception:  # a nested call reported it already
                st.exception = error
                for cb, hook in self._hooks["on_exception"]:
                    try:
                        hook(self)
                    except Exception as e:  # the original exception is the one to report
                        warnings.warn(f"{type(cb).__name__}.on_exception failed: {e!r}")
            if fit:
                self.executors.release()
            raise
        finally:
            if fit:
                self._close_batches()

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

    def _on_sigterm(self) -> None:
        self.state.preempted = True

    def _check_preempted(self) -> None:
        if self.state.preempted:
            raise Preempted

    def _should_stop(self) -> bool:
        st = self.state
        return st.stop_requested or (st.max_steps is not None and st.step >= st.max_steps)

    def _step_boundary(self) -> bool:
        """Between two steps: a SIGTERM preempts the fit here; True when it should stop."""
        self._check_preempted()
        return self._should_stop()

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
        if not self._frozen:
            self._fire("on_configure")  # the one place where callbacks change train_opts
            self.train_opts._freeze()  # from here on the loader, outputs, logs and model agree
            self._frozen = True
        plan = self._plan(train_loader, training=True, name="train_loader")
        val_plan = self._val_plan(val_loader) if val_loader is not None else None
        self._probe(plan)
        st = self.state
        if resume_from is not None:
            self.check_resumable()
            self._load(resume_from)
        self._resume.continue_at(plan, st)
        if st.epoch >= epochs:  # e.g. a second fit(epochs=3) after the first: nothing to run
            warnings.warn(f"fit(epochs={epochs}) has no epoch to run: {st.epoch} epoch(s) are "
                          "already complete, and epochs is the total, not a number to add. "
                          f"Pass epochs={st.epoch + epochs} to train {epochs} more.", stacklevel=2)
        st.stop_requested = st.preempted = False
        st.exception = st.exception_source = None
        st.max_steps, st.steps_per_epoch = max_steps, plan.steps
        self._resume.val_rng = None
        with handle_signals(self._on_sigterm, self._kill_workers), self._reporting(fit=True):
            try:
                self._with_events("on_fit_start", lambda: self._epochs(plan, val_plan, epochs),
                                  CancelFit)
            except Preempted:
                self._fire("on_preempt")
            self.executors.detach(self.train_model)  # weights and optimizer state to host
            self._fire("on_fit_end")
        if st.preempted:  # also when SIGTERM came after the last step: never swallowed
            raise SystemExit(143)  # 128 + SIGTERM, as if the signal had ended the process
        return st.history

    def _epochs(self, plan: Plan, val_plan: Plan | None, epochs: int) -> None:
        while self.state.epoch < epochs and not self._step_boundary():
            self._fit_epoch(plan, val_plan)
        self._check_preempted()  # SIGTERM during the last epoch-end hooks

    def _fit_epoch(self, plan: Plan, val_plan: Plan | None) -> None:
        st = self.state
        if st.epoch_step == 0:
            st.epoch_loss = [0.0, 0, True]
            for m in self._train_metrics.values():
                m.reset()
        self._with_events("on_epoch_start", lambda: self._train_epoch(plan), CancelEpoch)
        total, count, exact = st.epoch_loss
        if count:
            st.logs["train_loss"] = total / count
            st.logs["train_loss_exact"] = float(exact)
            st.logs.update(metric_logs("train_", self._train_metrics))  # host-side: no sync
        else:  # no step ran (cancelled): no train values, rather than the last epoch's
            self._drop_logs("train_", ("loss", "loss_exact", *self.metrics))
        if self._should_stop() and plan.steps and st.epoch_step < plan.steps:
            return  # stopped mid-epoch (stop() or max_steps): the epoch is not complete
        if val_plan is not None:
            # A checkpoint taken during validation (SIGTERM) must resume with the RNG as it was
            # before validation began: the resumed fit replays validation from its start.
            self._resume.val_rng = rng_state()
            try:
                self._run_validation(val_plan)
            except CancelEpoch:  # raised in a validation hook: skip to on_epoch_end
                self._drop_logs("val_", ("loss", *self.metrics))
            self._resume.val_rng = None  # not in a finally: a preemption save must still see it
        st.epoch += 1
        st.epoch_step = 0
        st.history.append({"epoch": st.epoch, **st.logs})
        self._event("on_epoch_end", CancelEpoch)  # the epoch is over: nothing left to skip

    def _train_epoch(self, plan: Plan) -> None:
        st, layout, executors = self.state, plan.layout, self.executors
        batches = self._batches = self._resume.epoch_batches(plan, st.epoch_step)
        metrics, metric_output, check_finite = self._train_metrics, self._metric_output, \
            self.check_finite
        per_step_samples = plan.combined
        per_step_updates, per_step_micro_batches = layout.di, layout.micro_batches
        step_start, step_end = self._hooks["on_train_step_start"], self._hooks["on_train_step_end"]
        epoch_loss = st.epoch_loss
        fresh, seen = st.epoch_step == 0, False
        for batch in batches:
            seen = True
            if st.preempted:  # SIGTERM while the batch was read: stop before the step
                raise Preempted
            inputs, labels = self._split(batch, plan.name)
            model = executors.train
            if model is None or not model.isCompiled():
                model = self._compile_train(inputs, labels)
            if step_start and not self._event("on_train_step_start", CancelStep):
                continue
            if executors.inference:  # validation or predict ran: their executors hold the device
                executors.activate(model)
            executors.push_optimizer()
            output, loss = model(*inputs, labels)
            step_loss = layout.step_loss(loss)  # host tensor: reading it syncs nothing
            if check_finite and not math.isfinite(step_loss.total):
                self._raise_non_finite(loss, layout)
            st.step += 1
            st.epoch_step += 1
            st.update += per_step_updates
            st.micro_batch += per_step_micro_batches
            st.samples += per_step_samples
            epoch_loss[0] += step_loss.total
            epoch_loss[1] += step_loss.count
            epoch_loss[2] = epoch_loss[2] and step_loss.exact
            st.logs["loss"] = step_loss.mean
            if metrics:
                aligned = layout.align(labels)
                if metric_output is not None:
                    output = metric_output(output)
                for m in metrics.values():
                    m.update(output, aligned)
            if step_end:
                self._event("on_train_step_end", CancelStep)  # the step has run: nothing to skip
            if self._step_boundary():
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
        d, rest = divmod(m, layout.ga * layout.rf)
        a, r = divmod(rest, layout.rf)
        what = "replica" if layout.mode == SUM else "micro-batch"
        raise NonFiniteLossError(
            f"Non-finite loss {float(flat[i])} at epoch {self.state.epoch}, step "
            f"{self.state.step} (0-based host call), {what} {m} of the step "
            + (f"(device iteration {d}, accumulation step {a}, replica {r})."
               if layout.mode != SUM else "(a replica's sum over the step; OutputMode.All "
               "names the micro-batch).")
            + " Lower the learning rate, check the data, or pass check_finite=False.")

    def _compile_train(self, inputs: tuple, labels: Any) -> Any:
        executors = self.executors
        model = executors.training_model(self.train_opts)
        self._fire("on_compile_start")
        self.state.compile_time["train"] = executors.compile(model, (*inputs, labels))
        device_rng = self._resume.take_device_rng()
        if device_rng is not None:  # resumed: the device continues the saved random stream
            model.rng_state = device_rng
        self._fire("on_compile_end")
        return model

    def _drop_logs(self, prefix: str, names: Iterable[str]) -> None:
        """Remove the loop's logs ``<prefix><name>`` (and ``<prefix><name>_<part>``)."""
        logs = self.state.logs
        for name in names:
            key = prefix + name
            for k in [k for k in logs if k == key or k.startswith(key + "_")]:
                del logs[k]

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
        opts = resolve_options(pt, opts, None)[0]
        plan = build_plan(pt, loader, opts, layout(opts, True), training=True, name="loader")
        if plan.steps is None:
            raise ValueError(f"loader reads an {type(plan.loader.dataset).__name__}, whose "
                             "length is unknown, so neither is its number of updates. Count "
                             "them as epochs x (samples per epoch // (B * DI * GA * RF)) x DI.")
        return epochs * plan.steps * opts.device_iterations

    # -- batches --------------------------------------------------------------------------------
    def _plan(self, loader: Any, training: bool, name: str, opts: Any = None,
              pad: bool = False) -> Plan:
        opts = self.train_opts if opts is None else opts  # the one (frozen) options object
        return build_plan(self.poptorch, loader, opts, layout(opts, training),
                          training=training, name=name, pad=pad, sequential=pad)

    def _cast(self, x: Any) -> Any:
        if self._input_dtype is not None and isinstance(x, torch.Tensor) \
                and x.is_floating_point():
            return x.to(self._input_dtype)  # 16-bit: float inputs are sent as half
        return x

    def _split(self, batch: Any, name: str, cast: bool = True) -> tuple[tuple, Any]:
        inputs, labels = split_batch(batch, name)
        n = self._num_inputs = len(inputs)  # what predict feeds
        model = self.model  # (issubclass: isinstance would read the wrapped __class__)
        if issubclass(type(model), WithLoss) and model.num_inputs != n:
            model.num_inputs = n  # (Module.__setattr__: only when it changes)
        if self._input_dtype is not None and cast:
            return tuple(self._cast(x) for x in inputs), self._cast(labels)
        return inputs, labels

    def _probe(self, plan: Plan) -> None:
        """Check one micro-batch on the host before anything is compiled."""
        batch = first_micro_batch(plan)
        if batch is not None:
            inputs, labels = self._split(batch, plan.name, cast=False)  # float32 on the host
            probe(self.model, inputs, labels, plan.name, copy_float=self.precision == "16-true",
                  metrics=self.metrics, metric_output=self._metric_output)

    # -- validation and predict -----------------------------------------------------------------
    def _val_plan(self, loader: Any, *, pad: bool = True, name: str = "val_loader") -> Plan:
        opts = inference_options(self.poptorch, self.train_opts, self._user_inference_opts,
                                 loader)
        try:
            empty = len(loader.dataset) == 0
        except TypeError:  # an IterableDataset: its length is unknown
            empty = False
        if empty:
            raise ValueError(f"{name} has 0 samples (the loader is empty): there is nothing "
                             "to run. Pass a loader over a dataset with at least one sample.")
        return self._plan(loader, training=False, name=name, opts=opts, pad=pad)

    def _inference_model(self, plan: Plan, kind: str, sample: tuple) -> Any:
        key = (kind, plan.combined, plan.loader.options.device_iterations)
        model = self.executors.inference.get(key)
        if model is not None and model.isCompiled():
            return model
        module = self.model  # traced in eval mode (PopTorch's wrapper shares the submodules)
        module.eval()
        try:
            model = self.executors.inference_model(key, plan.loader.options)
            self._fire("on_compile_start")
            self.state.compile_time[kind] = self.executors.compile(model, sample)
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
        self.state.exception = self.state.exception_source = None
        plan = self._val_plan(loader)
        with self._reporting():
            try:
                return self._run_validation(plan)
            except (CancelEpoch, CancelFit):  # a hook ended the validation early: no val logs
                self._drop_logs("val_", ("loss", *self.metrics))
                return {}

    def _run_validation(self, plan: Plan) -> dict[str, float]:
        st = self.state
        self._fire("on_validation_start")
        for m in self.metrics.values():
            m.reset()
        model = None
        layout, combined, micro = plan.layout, plan.combined, plan.micro
        val_loss = ValLoss(layout, micro, self.model.loss_fn
                           if issubclass(type(self.model), WithLoss) else None)
        # The loader is padded to whole host calls (copies of the last sample): count only the
        # samples.
        left = plan.samples if plan.sampler is not None and plan.samples else None
        for batch in plan.epoch():
            inputs, labels = self._split(batch, plan.name)
            if model is None:
                model = self._inference_model(plan, "validate", (*inputs, labels))
            self.executors.activate(model)
            output = model(*inputs, labels)
            valid = combined if left is None else min(combined, left)
            if left is not None:
                left -= valid
            if has_loss(output, layout.micro_batches):
                output, loss = output
                val_loss.add(loss, output, labels, valid, combined)
            elif "no_val_loss" not in self._warned:
                # e.g. ``if self.training: return x, loss`` / ``return x``: no loss in eval mode
                self._warned.add("no_val_loss")
                warnings.warn("In eval mode the model returns its output without a loss, so "
                              "validation logs no val_loss (metrics are still computed). "
                              "Return (output, loss) whenever labels are given to get one.",
                              stacklevel=2)
            if self.metrics:  # All mode, [DI, RF, B]: the host batch's order, per input group
                output = map_tensors(output, lambda t: t if t.dim() == 0
                                     else layout.input_rows(t)[:valid])
                if valid < combined:
                    labels = map_tensors(labels, lambda t: t[:valid])
                if self._metric_output is not None:
                    output = self._metric_output(output)
                for m in self.metrics.values():
                    m.update(output, labels)
            self._fire("on_validation_step_end")
            self._check_preempted()
        count, uncovered = val_loss.count, val_loss.uncovered
        if uncovered and "partial_val_loss" not in self._warned:
            self._warned.add("partial_val_loss")
            warnings.warn(
                f"val_loss covers {count} of the {count + uncovered} validation samples: the "
                f"last {uncovered} share a micro-batch of {micro} with padding, whose loss the "
                "device computes over both. Pass loss_fn= to Loop (then the loop computes the "
                "loss of those samples on the host), or use a micro-batch size that divides "
                "the sample count.", stacklevel=3)
        logs = {"val_loss": val_loss.total / count} if count else {}
        logs.update(metric_logs("val_", self.metrics))
        if not count:
            self._drop_logs("val_", ("loss",))  # none this time, rather than a stale one
        st.logs.update(logs)
        self._fire("on_validation_end")
        return logs

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
        self.state.exception = self.state.exception_source = None
        plan = self._val_plan(loader, pad=True, name="loader")
        flagged = isinstance(plan.loader.dataset, torch.utils.data.IterableDataset)
        if flagged:  # length unknown: pad the stream, and flag which rows are samples
            plan = flagged_plan(self.poptorch, plan)
        outputs: list[Any] = []
        flags: list[torch.Tensor] = []
        model = None
        with self._reporting():
            for batch in plan.epoch():
                if flagged:
                    flag, batch = batch
                    flags.append(flag)
                inputs = predict_inputs(batch, self._num_inputs, plan.name)
                if model is None and isinstance(self.model, WithLoss):
                    self.model.num_inputs = len(inputs)
                inputs = tuple(self._cast(x) for x in inputs)
                if model is None:
                    model = self._inference_model(plan, "predict", inputs)
                self.executors.activate(model)
                outputs.append(model(*inputs))
        if not outputs:
            raise ValueError(f"loader yielded no samples: {type(plan.loader.dataset).__name__} "
                             "was empty. predict needs at least one sample.")
        keep = torch.cat(flags) if flagged else slice(None, plan.samples)
        return concat(outputs, keep, plan.layout.input_rows)

    # -- checkpoint state -----------------------------------------------------------------------
    def check_resumable(self) -> None:
        """Raise ``ValueError`` when a checkpoint could not resume exactly: PopTorch reads and
        writes optimizer state (momentum, moments) only for ``poptorch.optim`` optimizers, so a
        stateful ``torch.optim`` one keeps it on the device, out of every checkpoint."""
        check_resumable(self.optimizer, self.poptorch)

    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs, as tensors, numbers, strings, lists and dicts.

        Fires ``on_save_checkpoint`` first (callbacks stash what their ``state_dict`` needs).
        A ``torch.optim`` optimizer with state is refused (``check_resumable``)."""
        self.check_resumable()
        self._fire("on_save_checkpoint")
        train, st = self.train_model, self.state
        if train is not None and train.isAttachedToDevice():
            # the device holds the current weights (a detached model copied them back when it
            # detached, and reading from a device it no longer holds is undefined in PopTorch)
            train.copyWeightsToHostIfNeeded()
        resume = self._resume.state_dict()
        sd: dict[str, Any] = {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "optimizer_type": type(self.optimizer).__name__,
            "data": resume["data"],  # the factors the counters refer to
            "counters": st.counters(),
            "history": [dict(h) for h in st.history],
            "logs": dict(st.logs),  # an epoch ending right after a resume logs these
            "epoch_loss": list(st.epoch_loss),
            "rng": resume["rng"],
            "optimizer_extras": optimizer_extras(self.optimizer),
            "sampler_rng": resume["sampler_rng"],
            "epoch_rng": resume["epoch_rng"],
            "metrics": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v
                            for n, v in metric_state(m).items()}
                        for k, m in self._train_metrics.items()},
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
        }
        if train is not None and train.isCompiled():
            sd["device_rng"] = train.rng_state
        return copy.deepcopy(sd)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a ``state_dict()``: the next ``fit`` continues where it was taken.

        The optimizer must be of the saved type with the saved parameter-group layout
        (checked before anything is restored). The next ``fit`` compares its loader's factors
        with the saved ones: see ``fit``.
        """
        check_optimizer(sd, self.optimizer)
        (self.train_model or self.model).load_state_dict(sd["model"])
        if sd.get("optimizer") is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
            for k, v in sd.get("optimizer_extras", {}).items():  # pushed before the first step
                setattr(self.optimizer, k, v)
        st = self.state
        st.load_counters(sd["counters"])
        st.history = [dict(h) for h in sd["history"]]
        st.logs = dict(sd.get("logs", {}))
        st.epoch_loss = list(sd["epoch_loss"])
        for k, m in self._train_metrics.items():
            for n, v in sd.get("metrics", {}).get(k, {}).items():
                setattr(m, n, v)
        for cb in self.callbacks:
            if cb.state_key in sd["callbacks"]:
                cb.load_state_dict(sd["callbacks"][cb.state_key])
        self._resume.load_state_dict(sd, st.epoch_step, self.train_model)
        self._fire("on_load_checkpoint")

    def _load(self, source: str) -> None:
        if source == "last":  # the callbacks that know where checkpoints are say which
            finders = [cb for cb in self.callbacks if overridden(cb, "resume_path")]
            if not finders:
                raise ValueError('resume_from="last" needs a ModelCheckpoint callback to know '
                                 "the folder; pass a checkpoint path instead.")
            source = finders[0].resume_path()
            if source is None:
                return
        self.load_state_dict(load_checkpoint(source, backend=backend_name()))

