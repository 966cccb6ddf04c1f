"""``Loop``: wires options, data, executors and callbacks, and is the only place events are ordered.

How an event fires, a scope is bracketed and a stop flag is read: ``ipuloop.events``.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable

import torch

from .backend import backend_name, poptorch_module
from . import distributed, plans
from .callbacks.base import Callback, CancelEpoch, CancelFit, CancelStep, arrange, resume_path
from .checkpoint_io import load_checkpoint
from .data import (Plan, Predictions, as_sent, async_settings, check_not_empty,
                   first_micro_batch, no_host_call, predict_inputs, split_batch)
from .device import Executors, WithLoss
from .errors import NonFiniteLossError
from .events import Events
from .metrics import Validation, metric_logs, probe, resolve_metrics
from .options import inference_options, resolve
from .outputs import Returns, non_finite_error
from .resume import Resume, check_resumable
from .signals import Preempted, handle_signals
from .state import State

__all__ = ["Loop", "WithLoss", "NonFiniteLossError"]


class Loop(Events):
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
        inference_opts: options for validation and predict; default: the training options
            without their training-only settings (``ipuloop.options.inference_options``).
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

    Batches are ``(inputs..., labels)`` tuples, fed as ``model(*inputs, labels)``, or dicts
    (Hugging Face's), fed as ``model(**batch)`` (``data.split_batch``). A model-with-loss may
    return scalars to log beside its loss (``outputs.Returns``): ``<name>`` per step,
    ``train_<name>`` per epoch, ``val_<name>``. Before compiling, the
    loop runs one micro-batch through the model on the host, so a label batch that differs
    from the input batch, labels that would broadcast against the output in the loss (torch
    warns of it; with ``loss_fn``, float labels ``[N]`` against an output ``[N, 1]`` too), or
    a dtype the loss rejects fail before the first step, naming the shapes and dtypes received.

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
                 precision: str | int = "32", label_key: str = "labels",
                 loss_key: str | int = "loss", async_data: bool | dict = False) -> None:
        self.poptorch = pt = poptorch_module()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module. Received: model={type(model)!r}.")
        if not (isinstance(label_key, str) and label_key):
            raise TypeError(f"label_key must be a non-empty str (the labels' key in a dict "
                            f"batch). Received: label_key={label_key!r}.")
        self.label_key, self._returns = label_key, Returns(loss_key)
        self.model = WithLoss(model, loss_fn, label_key=label_key) if loss_fn is not None \
            else model
        self.metrics = resolve_metrics(metrics, metric_output)  # validation's; training: clones
        r = resolve(pt, self.model, opts, inference_opts, replicas=replicas, seed=seed,
                    optimizer=optimizer, max_grad_norm=max_grad_norm, precision=precision,
                    metrics=self.metrics)
        self.train_opts, self.optimizer, self.precision = r.train, r.optimizer, r.precision
        self._user_inference_opts, self._input_dtype = r.inference, r.input_dtype
        self._metric_output = metric_output
        self._train_metrics = {k: m.clone() for k, m in self.metrics.items()}
        self._needs_labels = loss_fn is not None or bool(self.metrics)  # (from a dict batch)
        self.check_finite = check_finite
        self.state = State()
        self.callbacks, self._hooks = arrange(callbacks, progress)
        self.executors = Executors(pt, self.model, self.optimizer)
        self._resume = Resume()
        self._batches: Any = None  # the running epoch's batch iterator
        self._reading: Plan | None = None  # the running validation's or predict's loader
        self._async = async_settings(async_data)  # torch loaders read ahead: async_options
        self._warned: set[str] = set()  # one-time warnings given
        self._frozen = False  # train_opts: settable in on_configure, then frozen
        self._num_inputs: int | None = None  # inputs per batch in the last fit or validate
        # several processes (torchrun, mpirun, poprun): this loop is one instance of the run
        self._dist = distributed.attach(self, replicas_given=replicas is not None)

    @property
    def train_model(self) -> Any:
        """The training executor (``poptorch.trainingModel``), None before the first step."""
        return self.executors.train

    @property
    def optimizer_pushes(self) -> int:
        """``setOptimizer`` calls made (only when a hyper-parameter changed)."""
        return self.executors.pushes

    # -- fit ------------------------------------------------------------------------------------
    @distributed.failing_together  # several processes: an error on one ends every instance's
    def fit(self, train_loader: Any, epochs: int = 1, val_loader: Any = None, *,
            resume_from: str | None = None, max_steps: int | None = None,
            val_every_n_steps: int | None = None) -> list[dict]:
        """Train for ``epochs`` epochs in total; returns the per-epoch logs.

        With ``val_loader``, validation runs at each epoch end and, with
        ``val_every_n_steps``, also at each step that is a multiple of it (``state.step``),
        before its ``on_train_step_end`` (an epoch end right after one does not validate
        again). ``history`` has a row per epoch, with the epoch's last validation.

        ``resume_from`` (a checkpoint path, or "last" with a ModelCheckpoint callback: the
        newest checkpoint written in its folder) continues an interrupted fit exactly; with
        other factors than the saved run, as ``ipuloop.resume`` says (a warning, or a
        ``ValueError`` naming each changed factor before any step). ``max_steps`` ends the
        fit after that many training steps in total (for smoke runs), like ``stop()``: an
        epoch it cuts short is not counted as complete. A fit asked for no more epochs than ``state.epoch`` already
        holds runs none, with a warning.

        An epoch is ``len(dataset) // (B * DI * GA * RF)`` steps (host calls, B the loader's
        batch size), each running DI optimizer updates; the remainder is dropped (with a
        warning) whatever the loader's ``drop_last``. A dataset shorter than one host call is
        a ``ValueError`` naming every factor, raised before anything is compiled.

        With several processes, an error that ends it on one instance ends it on every
        instance within seconds, naming that instance (``ipuloop.distributed``).
        """
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            raise ValueError(f"epochs must be an int >= 1. Received: epochs={epochs!r}.")
        for k, v in (("max_steps", max_steps), ("val_every_n_steps", val_every_n_steps)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{k} must be an int >= 1 or None. Received: {k}={v!r}.")
        if val_every_n_steps is not None and val_loader is None:
            raise ValueError(f"val_every_n_steps={val_every_n_steps} validates on val_loader, "
                             "but this fit has none. Pass val_loader= too.")
        if not self._frozen:
            self._fire("on_configure")  # the one place where callbacks change train_opts
            self.train_opts._freeze()  # from here on the loader, outputs, logs and model agree
            self._frozen = True
        st = self.state
        st.val_every_n_steps = val_every_n_steps  # (the instances compare it)
        plan = self._plan(train_loader, training=True, name="train_loader")
        val_plan = self._val_plan(val_loader) if val_loader is not None else None
        self._probe(plan)
        if self._dist is not None:  # several processes: the same settings on each
            self._dist.check_agreement(self, plan, val_plan, epochs, max_steps)
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
        st.validates = val_plan is not None  # read by monitoring callbacks at on_fit_start
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
            st.epoch_loss, st.epoch_logs = [0.0, 0, True], {}
            for m in self._train_metrics.values():
                m.reset()
        self._with_events("on_epoch_start", lambda: self._train_epoch(plan, val_plan),
                          CancelEpoch)
        total, count, exact = st.epoch_loss
        if count:
            st.logs["train_loss"] = total / count
            st.logs["train_loss_exact"] = float(exact)
            st.logs.update(metric_logs("train_", self._train_metrics))  # host-side: no sync
            st.logs.update({"train_" + k: t / n for k, (t, n) in st.epoch_logs.items() if n})
        else:  # no step ran (cancelled): no train values, rather than the last epoch's
            self.state.drop_logs("train_", self._logged())
        if self._should_stop() and plan.steps and st.epoch_step < plan.steps:
            return  # stopped mid-epoch (stop() or max_steps): the epoch is not complete
        every = st.val_every_n_steps
        if val_plan is not None and not (every and st.step and st.step % every == 0):
            self._validate_in_fit(val_plan)  # (after a step's own: the same weights)
        st.epoch += 1
        st.epoch_step = 0
        st.history.append({"epoch": st.epoch, **st.logs})
        self._event("on_epoch_end", CancelEpoch)  # the epoch is over: nothing left to skip

    def _validate_in_fit(self, val_plan: Plan, in_step: bool = False) -> None:
        """A validation at an epoch end, or ``in_step`` a step's (``val_every_n_steps``)."""
        try:
            with self._resume.validation(in_step):  # (a checkpoint in it resumes before it)
                self._run_validation(val_plan)
        except CancelEpoch:  # raised in a validation hook: no val logs this time
            self.state.drop_logs("val_", self._logged())
            if in_step:
                raise  # a step's: the epoch ends there (to its epoch logs)

    def _logged(self) -> tuple[str, ...]:
        """The names of the loss, the metrics and the values the model logged."""
        return ("loss", "loss_exact", *self.metrics, *self._returns.logged)

    def _train_epoch(self, plan: Plan, val_plan: Plan | None) -> None:
        st, layout, executors = self.state, plan.layout, self.executors
        batches = self._batches = self._resume.epoch_batches(plan, st.epoch_step, st.epoch)
        metrics, metric_output, check_finite = self._train_metrics, self._metric_output, \
            self.check_finite
        per_step_samples = plan.combined
        per_step_updates, per_step_micro_batches = layout.di, layout.micro_batches
        dist = self._dist
        if dist is not None:  # several processes: the counters count the whole run
            per_step_samples *= dist.size
            per_step_micro_batches *= dist.size
        step_start, step_end = self._hooks["on_train_step_start"], self._hooks["on_train_step_end"]
        if self._resume.take_step_validation():  # saved during a step's validation: finish it
            if val_plan is not None:
                self._validate_in_fit(val_plan, in_step=True)
            if step_end:
                self._event("on_train_step_end", CancelStep)
            if self._step_boundary():
                return
        every = st.val_every_n_steps if val_plan is not None else None
        epoch_loss, split = st.epoch_loss, self._returns.split
        fresh, seen = st.epoch_step == 0, False
        for batch in batches:
            seen = True
            if st.preempted:  # SIGTERM while the batch was read: stop before the step
                raise Preempted
            args, kwargs, labels = self._split(batch, plan.name)
            model = executors.train
            if model is None or not model.isCompiled():
                model = self._compile_train(args, kwargs)
            if step_start and not self._event("on_train_step_start", CancelStep):
                st.epoch_step += 1  # its batch is read: the resume position counts it
                continue
            if executors.inference:  # validation or predict ran: their executors hold the device
                executors.activate(model)
            executors.push_optimizer()
            output, loss, logs = split(model(*args, **kwargs))
            step_loss = layout.step_loss(loss)  # host tensor: reading it syncs nothing
            if dist is not None:  # several processes: the run's loss, summed over them
                step_loss = dist.step_loss(st, step_loss, check_finite)
            if check_finite and not math.isfinite(step_loss.total):
                raise non_finite_error(loss, layout, st.epoch, st.step, batch=batch,
                                       precision=self.precision, last_loss=st.logs.get("loss"),
                                       loss_scaling=getattr(self.optimizer, "loss_scaling", None))
            st.step += 1  # (attribute updates, not a method: this runs every step)
            st.epoch_step += 1
            st.update += per_step_updates
            st.micro_batch += per_step_micro_batches
            st.samples += per_step_samples
            epoch_loss[0] += step_loss.total
            epoch_loss[1] += step_loss.count
            epoch_loss[2] = epoch_loss[2] and step_loss.exact
            st.logs["loss"] = step_loss.mean
            if logs is not None:  # values the model logs: reduced as the loss is
                names, sums = self._returns.step_logs(logs, layout, self.metrics)
                if dist is not None:
                    sums = dist.sum(sums, f"summing step {st.step}'s logged values")
                st.add_step_logs(names, sums)
            if metrics:
                aligned = layout.align(labels)
                if metric_output is not None:
                    output = metric_output(output)
                for m in metrics.values():
                    m.update(output, aligned)
            if every is not None and st.step % every == 0:
                self._validate_in_fit(val_plan, in_step=True)
            if step_end:
                self._event("on_train_step_end", CancelStep)  # the step has run: nothing to skip
            if self._step_boundary():
                break
        if fresh and not seen:  # only an IterableDataset can get here (lengths are checked)
            raise no_host_call(plan, st.epoch)

    def _compile_train(self, args: tuple, kwargs: dict) -> Any:
        executors = self.executors
        model = executors.training_model(self.train_opts)
        self._fire("on_compile_start")
        self.state.compile_time["train"] = executors.compile(model, args, kwargs)
        device_rng = self._resume.take_device_rng()
        if device_rng is not None:  # resumed: the device continues the saved random stream
            model.rng_state = device_rng
        self._fire("on_compile_end")
        return model

    num_updates = staticmethod(plans.num_updates)

    # -- batches --------------------------------------------------------------------------------
    def _plan(self, loader: Any, training: bool, name: str, opts: Any = None,
              pad: bool = False, partition: bool = True) -> Plan:
        opts = self.train_opts if opts is None else opts  # the one (frozen) options object
        return plans.build(self.poptorch, loader, opts, training, name, pad, partition,
                           self._async)

    def _split(self, batch: Any, name: str, cast: bool = True) -> tuple[tuple, dict, Any]:
        """The model's call ``(*args, **kwargs)`` for ``batch``, and its labels."""
        args, kwargs, labels = split_batch(batch, name, self.label_key, self._needs_labels)
        if not kwargs:
            n = self._num_inputs = len(args) - 1  # what predict feeds
            model = self.model  # (issubclass: isinstance would read the wrapped __class__)
            if issubclass(type(model), WithLoss) and model.num_inputs != n:
                model.num_inputs = n  # (Module.__setattr__: only when it changes)
        if self._input_dtype is not None and cast:
            args, kwargs = as_sent(args, kwargs, self._input_dtype)
            labels = kwargs.get(self.label_key) if kwargs else args[-1]
        return args, kwargs, labels

    def _probe(self, plan: Plan) -> None:
        """Check one micro-batch on the host before anything is compiled."""
        batch = first_micro_batch(plan)
        if batch is not None:
            args, kwargs, labels = self._split(batch, plan.name, cast=False)  # float32
            probe(self.model, args, kwargs, labels, plan.name,
                  copy_float=self.precision == "16-true", metrics=self.metrics,
                  metric_output=self._metric_output, returns=self._returns,
                  loop_loss=issubclass(type(self.model), WithLoss))

    # -- validation and predict -----------------------------------------------------------------
    def _val_plan(self, loader: Any, *, pad: bool = True, name: str = "val_loader",
                  partition: bool = True) -> Plan:
        opts = inference_options(self.poptorch, self.train_opts, self._user_inference_opts,
                                 loader)
        check_not_empty(loader, name)
        return self._plan(loader, training=False, name=name, opts=opts, pad=pad,
                          partition=partition)

    def _inference_model(self, plan: Plan, kind: str, args: tuple, kwargs: dict) -> Any:
        key = (kind, plan.combined, plan.loader.options.device_iterations)
        model = self.executors.inference.get(key)
        if model is not None and model.isCompiled():
            return model
        module = self.model  # traced in eval mode (PopTorch's wrapper shares the submodules)
        module.eval()
        try:
            model = self.executors.inference_model(key, plan.loader.options)
            self._fire("on_compile_start")
            self.state.compile_time[kind] = self.executors.compile(model, args, kwargs)
        finally:
            module.train()
        self._fire("on_compile_end")
        return model

    def validate(self, loader: Any) -> dict[str, float]:
        """Run ``loader`` through the inference model; returns val_loss and val metrics.

        Every sample counts: the samples are read in order and the last host call is padded
        with copies of the last one (an IterableDataset as it ends, read in the order its
        loader yields it, workers included). The metrics see every sample, and so does val_loss, the
        mean loss per sample: the device's loss for the micro-batches without padding and,
        with ``loss_fn``, ``loss_fn`` on the host for the samples of the one with padding
        (without ``loss_fn`` those are left out, and a warning says how many samples
        val_loss covers). A model that returns no loss in eval mode gets no val_loss. Each
        value the model logs is ``val_<name>``, the mean over the micro-batches without padding.

        With several processes, each instance that calls it validates alone, as predict
        does: every sample, and metrics of its own samples only, waiting for no other
        instance (inside ``fit``, validation is shared out between the instances instead).
        """
        self.state.exception = self.state.exception_source = None
        alone = self._dist is not None
        plan = self._val_plan(loader, partition=not alone)
        with self._reporting(), distributed.unsynced(self.metrics, alone):
            try:
                return self._run_validation(plan, alone)
            except (CancelEpoch, CancelFit):  # a hook ended the validation early: no val logs
                self.state.drop_logs("val_", self._logged())
                return {}

    def _run_validation(self, plan: Plan, alone: bool = False) -> dict[str, float]:
        st = self.state
        self._fire("on_validation_start")
        run = Validation(plan, self.metrics, self._metric_output, self.model.loss_fn
                         if issubclass(type(self.model), WithLoss) else None, self._warned,
                         self._returns)
        model, self._reading = None, plan
        for batch, samples in plan.counted():
            args, kwargs, labels = self._split(batch, plan.name)
            if model is None:
                model = self._inference_model(plan, "validate", args, kwargs)
            self.executors.activate(model)
            run.add(model(*args, **kwargs), labels, samples)
            self._fire("on_validation_step_end")
            if not alone:  # (alone: no stop to agree on with the other instances)
                self._check_preempted()
        dist = None if alone else self._dist  # several processes: the numbers of all of them
        logs = run.logs(None if dist is None else lambda v: dist.sum(v, "summing val logs"))
        if "val_loss" not in logs:
            st.drop_logs("val_", ("loss",))  # none this time, rather than a stale one
        st.logs.update(logs)
        self._fire("on_validation_end")
        return logs

    def predict(self, loader: Any) -> Any:
        """Outputs for every sample of ``loader``'s dataset, in dataset order.

        Batches are read in order (shuffle and the sampler are ignored). The samples are
        padded with copies of the last one up to whole host calls and the padding's outputs
        are dropped, so no sample is lost to the combined batch size (an IterableDataset is
        padded as it ends, and its outputs come in the order its loader yields its samples,
        with workers too, so they line up with the labels the loader gives). With input replica
        grouping each sample's output is returned once. A model returning a tuple, list,
        namedtuple or dict of tensors gets the same structure back, each tensor joined over
        the samples. After a fit (or validate) with N inputs, every batch of N elements is
        fed whole, and the last element of a batch of N + 1 (the labels) is ignored; before
        any, a batch of two or more elements is taken as (inputs..., labels). A dict batch
        is fed as keyword inputs less its ``label_key`` entry. Float64 inputs run, and come
        back, as float32 (as on the device).
        """
        self.state.exception = self.state.exception_source = None
        run = Predictions(self._val_plan(loader, pad=True, name="loader", partition=False))
        model, self._reading = None, run.plan
        with self._reporting():
            for batch in run.batches():
                args, kwargs = predict_inputs(batch, self._num_inputs, run.plan.name,
                                              self.label_key)
                if model is None and isinstance(self.model, WithLoss) and not kwargs:
                    self.model.num_inputs = len(args)
                args, kwargs = as_sent(args, kwargs, self._input_dtype)
                if model is None:
                    model = self._inference_model(run.plan, "predict", args, kwargs)
                self.executors.activate(model)
                run.outputs.append(model(*args, **kwargs))
        return run.result()

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
        sd = self._resume.capture(self.model, self.optimizer, self.state, self._train_metrics,
                                  self.callbacks, self.train_model)
        if self._dist is not None:  # several processes: the run's metrics, each one's RNG
            sd = self._dist.checkpoint_state(self.state, self._train_metrics, sd)
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a ``state_dict()``: the next ``fit`` continues where it was taken.

        The optimizer must be of the saved type with the saved parameter-group layout
        (checked before anything is restored). The next ``fit`` compares its loader's factors
        with the saved ones: see ``fit``.
        """
        if self._dist is not None:  # several processes: this one's share and RNG
            sd = self._dist.own_state(sd, self._train_metrics)
        self.executors.detach_inference()  # (validate, predict: to run the loaded weights)
        self._resume.restore(sd, self.model, self.optimizer, self.state, self._train_metrics,
                             self.callbacks, self.train_model)
        self._fire("on_load_checkpoint")

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Load model weights only (``load_checkpoint(path)["model"]``), between fits: the
        next step, validation or predict runs them; optimizer state and counters stay."""
        self.executors.load_weights(weights)

    def _load(self, source: str) -> None:
        if source == "last":  # the callbacks that know where checkpoints are say which
            source = resume_path(self.callbacks)
            if source is None:
                return
        self.load_state_dict(load_checkpoint(source, backend=backend_name()))
