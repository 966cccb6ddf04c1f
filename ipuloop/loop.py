"""``Loop``: wires options, plans, executors, accumulators and callbacks; it alone orders events.

Its ``Dispatcher`` fires the events (``ipuloop.dispatcher``); a process alone is a run of one
instance (``processes.Processes``), so fit, validate and predict have one path for one
process and for several.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader

from .accumulators import Predictions, SetMetrics, TrainEpoch, Validation, mark_estimates
from .backend import backend_name, poptorch_module
from .callbacks.base import Callback, CancelEpoch, CancelFit, CancelStep, arrange
from .dispatcher import Dispatcher
from .exceptions import NonFiniteLossError
from .executors import Executors
from .fit_summary import describe, resumed_at
from .loop_options import (
    LoopArgs,
    check_fit_args,
    check_val_every,
    resolve,
    val_sets,
    warn_no_epochs,
)
from .modes import warn_if_evaluating
from .outputs import WithLoss, non_finite_error, weights_for
from .plan import (
    Plan,
    Plans,
    ValPlans,
    no_host_call_error,
    num_updates,
    val_steps,
)
from .poptorch_types import Executor
from .probe import probe_plan
from .processes import ALONE, FitSettings, Processes, join
from .read_ahead import async_settings
from .resume import Checkpointed, Resume, check_resumable, read_checkpoint
from .running import Reading
from .signals import Preempted
from .state import State

__all__ = ["Loop", "WithLoss", "NonFiniteLossError"]


class Loop:
    """Train, validate and predict with a PopTorch model.

    Its arguments are recorded as given in ``ipuloop.loop_options.LoopArgs``, which documents
    each (the API reference's "The loop" page shows them).

    ``loop.model`` is the module given; with ``loss_fn`` it runs inside a ``WithLoss``,
    ``loop.model_with_loss`` (without, the same module). Checkpoints hold ``loop.model``'s
    ``state_dict``, which loads into that module with plain ``load_state_dict``.

    Batches are ``(inputs..., labels)`` tuples, fed as ``model(*inputs, labels)``, or dicts,
    fed as ``model(**batch)``; a model-with-loss may return scalars to log beside its loss
    (``outputs.Returns``). One micro-batch runs through the model on the host before compiling,
    so mismatched labels, shapes or dtypes fail before the first step, naming what was received
    (docs/loop.md, "Batches").

    Example::

        loop = Loop(model, poptorch.Options().deviceIterations(10), loss_fn=nn.CrossEntropyLoss(),
                    optimizer=poptorch.optim.AdamW(model.parameters(), lr=1e-3),
                    metrics={"acc": torchmetrics.Accuracy("multiclass", num_classes=10)})
        history = loop.fit(train_loader, epochs=3, val_loader=val_loader)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        opts: object = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        loss_fn: Callable | None = None,
        metrics: object = None,
        metric_output: Callable | None = None,
        callbacks: Iterable[Callback] = (),
        replicas: int | str | None = None,
        inference_opts: object = None,
        seed: int | None = None,
        progress: bool | int = True,
        check_finite: bool = True,
        max_grad_norm: float | None = None,
        precision: str | int = "32",
        label_key: str = "labels",
        loss_key: str | int = "loss",
        async_data: bool | dict = False,
    ) -> None:
        args = LoopArgs.of(locals())  # the arguments as given, recorded once
        self.poptorch = pt = poptorch_module()
        self._settings = r = resolve(pt, args)
        # the user's module (a checkpoint's "model" is its state_dict), and what runs: it, or
        # with loss_fn the WithLoss around it
        self.model: torch.nn.Module = model
        self.model_with_loss = r.model
        self.metrics = r.metrics  # validation's; the training epoch's are clones
        self.train_opts = r.train
        self.optimizer = r.optimizer
        self.precision = r.precision
        self.state = State()
        self.callbacks = arrange(callbacks, progress=progress)
        self.executors = Executors(pt, self.model_with_loss, self.optimizer, r.returns)
        self._returns = r.returns
        self._hooks = Dispatcher(self, self.callbacks)
        self._feed = r.feed  # a batch as the model's call
        self._resume = Resume()
        self._plans = Plans(pt, self.train_opts, r.inference, async_settings(async_data))
        self._warned: set[str] = set()  # one-time warnings given
        self._val_metrics = SetMetrics(self.metrics)  # several val sets, nested validations
        self._frozen = False  # train_opts: settable in on_configure, then frozen
        self._reading = Reading()  # the plans the running calls read
        self._fitting = False  # a fit runs: a validate() or predict() of a hook is its own
        # The run this loop is an instance of: this process alone, or several (torchrun,
        # mpirun, poprun), whose instances other than 0 show no progress and write no logs.
        self._processes: Processes = join(
            self.train_opts, r.inference, replicas_given=replicas is not None
        )
        self.state.instance = self._processes.rank
        self.state.instances = self._processes.size
        self._hooks.main_instance_only(self._processes.rank)
        self._epoch = TrainEpoch(
            metrics=self.metrics,
            metric_output=metric_output,
            returns=self._returns,
            processes=self._processes,
            state=self.state,
        )

    @property
    def train_model(self) -> Executor | None:
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

    num_updates = staticmethod(num_updates)

    def describe(self) -> str:
        """The loop's events, with the callbacks attached to each."""
        return self._hooks.describe()

    def summary(self, train_loader: DataLoader) -> str:
        """What ``fit(train_loader)`` would run, as the progress display prints it before the
        first step (docs/loop.md, "What a fit prints first")."""
        return self._summary(self._plans.train(train_loader))

    def _summary(self, plan: Plan, loaded: str | None = None) -> str:
        """The summary of a fit of ``plan``, resumed from the checkpoint ``loaded``, if any."""
        return describe(
            pt=self.poptorch,
            backend=backend_name(),
            opts=self.train_opts,
            micro=plan.micro,
            combined=plan.combined,
            steps=plan.steps,
            model=self.model,  # the user's module: its names (a loss_fn= wrapper's are not)
            optimizer=self.optimizer,
            twin=self.executors.twin,
            precision=self.precision,
            instances=self._processes.size,
            resumed=None if loaded is None else resumed_at(loaded, self.state, plan.steps),
        )

    def stop(self) -> None:
        """End the fit after the current step."""
        self.state.stop_requested = True

    # -- fit ------------------------------------------------------------------------------------
    def fit(
        self,
        train_loader: DataLoader,
        epochs: int = 1,
        val_loader: DataLoader | list | dict | None = None,
        *,
        resume_from: str | None = None,
        max_steps: int | None = None,
        val_every_n_steps: int | None = None,
    ) -> list[dict]:
        """Train for ``epochs`` epochs in total; returns the per-epoch logs.

        With ``val_loader``, validation runs at each epoch end and, with
        ``val_every_n_steps``, also at each step that is a multiple of it (``state.step``),
        before its ``on_train_step_end`` (an epoch end right after one does not validate
        again). ``history`` has a row per epoch, with the epoch's last validation. Several
        validation sets, a list or a dict of loaders, are validated in turn in one validation,
        each logged under its name (docs/loop.md, "Several validation sets").

        ``resume_from`` (a checkpoint path, or "last": a ModelCheckpoint's newest) continues an
        interrupted fit exactly; other factors than the saved run's warn or fail before any
        step, as ``ipuloop.resume`` says. ``max_steps`` ends the fit after that many steps in
        total, like ``stop()`` (an epoch it cuts short is not complete). A fit asked for no
        more epochs than ``state.epoch`` holds runs none, with a warning.

        The loader's micro-batches are those plain torch iterating it yields, DI * GA * RF a
        host call in that order (docs/loop.md, "What the loop reads"): an epoch is
        ``len(dataset) // (B * DI * GA * RF)`` steps of DI optimizer updates each, its
        remainder read and dropped with a warning; a dataset shorter than one host call is a
        ``ValueError`` naming every factor, before anything compiles.

        With several processes, an error that ends it on one instance ends it on every
        instance within seconds, naming that instance (``ipuloop.processes``).
        """
        # several processes: an error here, from the first check on, ends every instance's fit
        with self._processes.failing_together(self.state):
            return self._fit(
                train_loader,
                epochs=epochs,
                val_loader=val_loader,
                resume_from=resume_from,
                max_steps=max_steps,
                val_every_n_steps=val_every_n_steps,
            )

    def _fit(
        self,
        train_loader: DataLoader,
        *,
        epochs: int,
        val_loader: DataLoader | list | dict | None,
        resume_from: str | None,
        max_steps: int | None,
        val_every_n_steps: int | None,
    ) -> list[dict]:
        check_fit_args(epochs, max_steps, val_every_n_steps, val_loader)
        if not self._frozen:
            self._hooks.fire("on_configure")  # the one place where callbacks change train_opts
            self.train_opts._freeze()  # from here on the loader, outputs, logs and model agree
            self._frozen = True
        st = self.state
        st.val_every_n_steps = val_every_n_steps  # (the instances compare it)
        plan = self._plans.train(train_loader)
        val_plan = None if val_loader is None else self._val_plans(val_loader, "val_loader")
        check_val_every(val_every_n_steps, plan.steps, epochs, max_steps)
        probe_plan(
            self.model_with_loss,
            plan,
            self._feed,
            copy_float=self.precision == "16-true",
            mixed=self.precision == "16-mixed",
            metrics=self.metrics,
            metric_output=self._settings.args.metric_output,
            returns=self._returns,
        )
        self._processes.check_agreement(
            FitSettings(
                opts=self.train_opts,
                micro=plan.micro,
                samples=plan.samples,
                steps=plan.steps,
                val_steps=None if val_plan is None else val_steps(val_plan),
                val_every_n_steps=st.val_every_n_steps,
                epochs=epochs,
                max_steps=max_steps,
                optimizer=self.optimizer,
                model=self.model_with_loss,
                step=st.step,
            )
        )
        if self.executors.train is None:  # the modes the training model is traced in
            warn_if_evaluating(self.model, 4)
        loaded = None
        if resume_from is not None:
            self.check_resumable()
            found = read_checkpoint(resume_from, self.callbacks)  # None: "last", none yet
            if found is not None:
                loaded, sd = found
                self.load_state_dict(sd)
        self._resume.continue_at(plan, st, tuple(p for _, p in val_plan or ()))
        rng = self.executors.rewrap_for(plan.micro)  # (the fit goes on: its checks passed)
        if rng is not None:  # the next training model continues the device's random stream
            self._resume.carry_device_rng(rng)
        warn_no_epochs(epochs, st.epoch)  # e.g. a second fit(epochs=3) after the first
        st.start_fit(
            steps_per_epoch=plan.steps,
            max_steps=max_steps,
            validates=val_plan is not None,
            val_sets=tuple(s for s, _ in val_plan or () if s),
            summary=self._summary(plan, loaded),
        )
        with self._running(
            plan, *(p for _, p in val_plan or ()), fit=True
        ), self.executors.marking_loss():
            self._fitting = True
            try:
                self._hooks.scope(
                    "on_fit_start", lambda: self._epochs(plan, val_plan, epochs), CancelFit
                )
            except Preempted:
                self._hooks.fire("on_preempt")
            finally:
                self._fitting = False
            self.executors.detach(self.train_model)  # weights and optimizer state to host
            self.executors.read_optimizer_state()  # (a torch.optim optimizer's, from its twin)
            self._hooks.fire("on_fit_end")
        if st.preempted:  # also when SIGTERM came after the last step: never swallowed
            raise SystemExit(143)  # 128 + SIGTERM, as if the signal had ended the process
        return st.history

    def _epochs(self, plan: Plan, val_plan: ValPlans | None, epochs: int) -> None:
        st = self.state
        while st.epoch < epochs and not self._processes.at_boundary(st):
            self._fit_epoch(plan, val_plan)
        self._processes.check_preempted(st)  # SIGTERM during the last epoch-end hooks

    def _fit_epoch(self, plan: Plan, val_plan: ValPlans | None) -> None:
        st = self.state
        if st.epoch_step == 0:
            self._epoch.reset()
        self._hooks.scope("on_epoch_start", lambda: self._train_epoch(plan, val_plan), CancelEpoch)
        logs = self._epoch.logs()
        if logs:
            st.logs.update(logs)
        else:  # no step ran (cancelled): no train values, rather than the last epoch's
            st.drop_logs("train_", self._logged())
        if not plan.layout.exact:  # Final, EveryN: from the returned micro-batches only
            mark_estimates(st.logs, self._returns.logged)
        # (a stream's length only promises its steps: it is complete when it ended)
        ended = not plan.source.stream and plan.steps is not None and st.epoch_step >= plan.steps
        if plan.reading.ended and plan.steps is not None and st.epoch_step != plan.steps:
            plan.warn_length(st.epoch_step, self._warned)
        if st.should_stop() and not (ended or plan.reading.ended):
            return  # stopped mid-epoch (stop() or max_steps): the epoch is not complete
        every = st.val_every_n_steps
        if val_plan is not None and not (every and st.step and st.step % every == 0):
            self._validate_in_fit(val_plan)  # (after a step's own: the same weights)
        st.epoch += 1
        st.epoch_step = 0
        st.history.append({"epoch": st.epoch, **st.logs})
        self._hooks.event("on_epoch_end", CancelEpoch)  # the epoch is over: nothing to skip

    def _validate_in_fit(self, val_plan: ValPlans, *, in_step: bool = False) -> None:
        """A validation at an epoch end, or ``in_step`` a step's (``val_every_n_steps``)."""
        try:
            with self._resume.validation(in_step=in_step):  # (a checkpoint in it resumes before it)
                self._run_validation(val_plan, self._processes, in_fit=True)
        except CancelEpoch:  # raised in a validation hook: no val logs this time
            self.state.drop_logs("val_", self._logged())
            if in_step:
                raise  # a step's: the epoch ends there (to its epoch logs)

    def _logged(self) -> tuple[str, ...]:
        """The names of the loss, the metrics and the values the model logged."""
        return ("loss", *self.metrics, *self._returns.logged)

    def _train_epoch(self, plan: Plan, val_plan: ValPlans | None) -> None:
        st = self.state
        epoch = self._epoch
        executors = self.executors
        hooks = self._hooks
        layout = plan.layout
        batches = plan.epoch(st.epoch_step, st.epoch, self._resume.draw())
        split = self._feed.split
        returns = self._returns.split
        check_finite = self._settings.args.check_finite
        metrics = bool(epoch.metrics)
        instances = self._processes.size  # the counters count the whole run
        per_step_samples = plan.combined * instances
        per_step_micro_batches = layout.micro_batches * instances
        per_step_updates = layout.di
        boundary = self._processes.at_boundary
        estimates = not layout.exact  # Final, EveryN: the logs name the estimated values
        logged = self._returns.logged
        step_start = hooks.hooks["on_train_step_start"]
        step_end = hooks.hooks["on_train_step_end"]
        if self._resume.take_step_validation():  # saved during a step's validation: finish it
            if val_plan is not None:
                self._validate_in_fit(val_plan, in_step=True)
            if step_end:
                hooks.event("on_train_step_end", CancelStep)
            if boundary(st):
                plan.read_remainder(batches, st.epoch_step, preempted=st.preempted)
                return
        every = st.val_every_n_steps if val_plan is not None else None
        # The device holds the optimizer as last pushed: it is compared where user code may
        # have changed it since, at the epoch's first step (after its start hooks), then at
        # every step where hooks, a step's validation or metrics run between steps.
        compare_each_step = bool(step_start or step_end or every is not None or metrics)
        compare = True
        fresh = st.epoch_step == 0
        seen = False
        for batch in batches:
            seen = True
            if st.preempted:  # SIGTERM while the batch was read: stop before the step
                raise Preempted
            args, kwargs, labels = split(batch, plan.name)
            model = executors.train
            if model is None or not model.isCompiled():
                model = self._compile_train(args, kwargs)
            if step_start and not hooks.event("on_train_step_start", CancelStep):
                st.epoch_step += 1  # its batch is read: the resume position counts it
                continue
            if compare:  # what user code wrote to the weights since the last step
                executors.push_host_weights()
            if executors.inference:  # validation or predict ran: their executors hold the device
                executors.activate(model)
            if compare:
                executors.push_optimizer()
                compare = compare_each_step
            output, loss, logs = returns(model(*args, **kwargs))
            step = epoch.step_loss(
                loss, layout, check_finite=check_finite
            )  # the run's: host tensors, no sync
            if check_finite and not math.isfinite(step.total):
                raise non_finite_error(
                    loss,
                    layout,
                    st.epoch,
                    st.step,
                    batch=batch,
                    precision=self.precision,
                    last_loss=st.logs.get("loss"),
                    loss_scaling=getattr(self.optimizer, "loss_scaling", None),
                )
            st.step += 1  # (attribute updates, not a method: this runs every step)
            st.epoch_step += 1
            st.update += per_step_updates
            st.micro_batch += per_step_micro_batches
            st.samples += per_step_samples
            st.logs["loss"] = epoch.add(step)
            if logs is not None:  # values the model logs: reduced as the loss is
                st.logs.update(epoch.add_logs(logs, layout))
            if estimates:
                mark_estimates(st.logs, logged)
            if metrics:
                epoch.update_metrics(output, labels, layout)
            if every is not None and st.step % every == 0 and val_plan is not None:
                self._validate_in_fit(val_plan, in_step=True)
            if step_end:
                hooks.event("on_train_step_end", CancelStep)  # the step has run: nothing to skip
            if boundary(st):
                plan.read_remainder(batches, st.epoch_step, preempted=st.preempted)
                break
        else:
            plan.reading.ended = True  # (every host call of the epoch was read)
        if fresh and not seen:  # only an IterableDataset can get here (lengths are checked)
            raise no_host_call_error(plan, st.epoch)

    def _compile_train(self, args: tuple, kwargs: dict) -> Executor:
        model = self.executors.training_model(self.train_opts)
        self._hooks.fire("on_compile_start")
        # resumed: the device continues the saved random stream
        self.state.compile_time["train"] = self.executors.compile(
            model, args, kwargs, rng_state=self._resume.take_device_rng()
        )
        self._hooks.fire("on_compile_end")
        return model

    # -- validation and predict -----------------------------------------------------------------
    def _val_plans(self, loader: object, arg: str, *, partition: bool = True) -> ValPlans:
        """The plans of ``loader``'s validation sets (``loop_options.val_sets``: one loader,
        a list or a dict of them), each built as one validation loader is."""
        return tuple(
            (suffix, self._plans.inference(one, name or "val_loader", partition=partition))
            for suffix, name, one in val_sets(loader, arg)
        )

    def _inference_model(self, plan: Plan, kind: str, args: tuple, kwargs: dict) -> Executor:
        key = (kind, plan.combined, plan.opts.device_iterations)
        model = self.executors.inference.get(key)
        if model is None or not model.isCompiled():
            with self.executors.eval_mode():
                model = self.executors.inference_model(key, plan.opts)
                self._hooks.fire("on_compile_start")
                self.state.compile_time[kind] = self.executors.compile(model, args, kwargs)
            self._hooks.fire("on_compile_end")
        return model

    def validate(self, loader: DataLoader | list | dict) -> dict[str, float]:
        """Run ``loader`` through the inference model; returns val_loss and val metrics.

        ``loader`` may be several validation sets, as ``fit``'s ``val_loader``: a list or a
        dict of loaders, validated in turn; it returns every set's logs, each under its set's
        name (``val_loss/<name>``, ``val_loss/dataloader_idx_<i>``).

        Every sample counts, in the order the loader yields them: the last host call is
        padded with copies of the last sample, the metrics see every sample, and val_loss is
        the mean loss per sample (docs/loop.md, "Validation": the padded host call's loss, and
        what a model-with-loss gives instead). Each value the model logs is ``val_<name>``.

        With several processes, each instance that calls it validates every sample alone, as
        predict does (inside ``fit``, validation is shared out between the instances instead).
        Called from a hook while a fit runs, it returns its own logs and leaves the fit's logs,
        history, monitors and progress display alone (no validation hook fires for it).
        """
        st = self.state
        nested = self._fitting
        if not nested:
            st.start_call()
        plans = self._val_plans(loader, "loader", partition=False)  # every sample
        of = self._val_metrics.of
        metrics = {f"{s}:{k}": m for s, _ in plans for k, m in of(s, nested=nested).items()}
        with self._running(*(p for _, p in plans)), self._processes.unsynced(metrics):
            try:
                return self._run_validation(plans, ALONE, in_fit=False, nested=nested)
            except (CancelEpoch, CancelFit):  # a hook ended the validation early: no val logs
                if not nested:
                    st.drop_logs("val_", self._logged())
                return {}

    def _run_validation(
        self, plans: ValPlans, processes: Processes, *, in_fit: bool, nested: bool = False
    ) -> dict[str, float]:
        """A validation over ``plans`` in turn, summed over ``processes``; ``nested``: a
        ``validate()`` of a hook inside a fit, which fires no hook and writes no log."""
        st = self.state
        if not nested:
            self._hooks.fire("on_validation_start")
        network = self.model_with_loss
        loss_fn = network.loss_fn if isinstance(network, WithLoss) else None
        every: dict[str, float] = {}
        with self.executors.inferring():  # (the returned loss as the model made it)
            for suffix, plan in plans:
                run = Validation(
                    plan,
                    metrics=self._val_metrics.of(suffix, nested=nested),
                    metric_output=self._settings.args.metric_output,
                    loss_fn=loss_fn,
                    warned=self._warned,
                    returns=self._returns,
                )
                model = None
                for batch, samples in plan.counted():
                    args, kwargs, labels = self._feed.split(batch, plan.name)
                    if model is None:
                        model = self._inference_model(plan, "validate", args, kwargs)
                    self.executors.activate(model)
                    run.add(model(*args, **kwargs), labels, samples)
                    if not nested:
                        self._hooks.fire("on_validation_step_end")
                    if in_fit:  # a stop (SIGTERM, on any instance) ends it here
                        processes.check_preempted(st)
                logs = run.logs(processes, suffix)
                every.update(logs)
                if not nested:
                    st.log_validation(logs, suffix)
        if not nested:
            self._hooks.fire("on_validation_end")
        return every

    def predict(self, loader: DataLoader) -> Any:
        """Outputs for every sample ``loader`` yields, in the order it yields them (dataset
        order for a sequential loader), as plain torch iterating it would see them.

        The last host call is padded with copies of the last sample, whose outputs are
        dropped; with input replica grouping each sample's output comes once. A tuple, list,
        namedtuple or dict of tensors comes back in the same structure, each tensor joined over
        the samples. docs/loop.md, "Predict", says which batch elements are inputs (after a
        fit with N inputs, a batch of N + 1 drops its labels) and how dicts and float64 run.
        """
        if not self._fitting:  # (called from a hook of a fit: the fit's error state stays)
            self.state.start_call()
        plan = self._plans.inference(loader, "loader", partition=False)
        run = Predictions(plan.layout, plan.source.dataset)
        model = None
        with self._running(plan), self.executors.inferring():
            for batch, samples in plan.counted():
                args, kwargs = self._feed.predict(batch, plan.name, first=model is None)
                if model is None:
                    model = self._inference_model(plan, "predict", args, kwargs)
                self.executors.activate(model)
                run.add(model(*args, **kwargs), samples)
        return run.result()

    # -- errors, signals and stops ---------------------------------------------------------------
    @contextlib.contextmanager
    def _running(self, *plans: Plan | None, fit: bool = False) -> Iterator[None]:
        """Any error fires ``on_exception`` once and propagates; a fit's also ends the other
        instances' fits first and releases the device. ``running.Reading``: the signals during
        a fit, and the workers of ``plans`` stopped however the call ends."""
        st = self.state  # SIGTERM, several processes: all stop at one boundary
        with self._reading.during(plans, (lambda: self._processes.on_sigterm(st)) if fit else None):
            try:
                yield
            except BaseException as caught:
                error = self._processes.failed(caught, st) if fit else caught
                self._hooks.report(error)
                if fit:
                    self.executors.release()
                if error is caught:
                    raise
                raise error from caught

    # -- checkpoint state -----------------------------------------------------------------------
    def check_resumable(self) -> None:
        """Raise ``ValueError`` when a checkpoint could not resume exactly: a stateful optimizer
        whose state PopTorch cannot read back (no ``poptorch.optim`` twin), naming the fix."""
        check_resumable(self.optimizer, self.poptorch)

    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs, as tensors, numbers, strings, lists and dicts.

        Fires ``on_save_checkpoint`` first (callbacks stash what their ``state_dict`` needs).
        A stateful optimizer whose state PopTorch cannot read back is refused
        (``check_resumable``)."""
        self.check_resumable()
        self._hooks.fire("on_save_checkpoint")
        sd = self._resume.capture(self._checkpointed())
        # several processes: the run's metrics, each instance's random streams
        return self._processes.checkpoint_state(self.state, self._epoch.metrics, sd)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a ``state_dict()``: the next ``fit`` continues where it was taken. The
        optimizer must be of the saved type and parameter-group layout (checked before anything
        is restored); the next ``fit`` compares its loader's factors with the saved ones."""
        sd = self._processes.own_state(sd, self._epoch.metrics)  # several: this one's share
        self.executors.detach_inference()  # (validate, predict: to run the loaded weights)
        self._resume.restore(sd, self._checkpointed())
        self._hooks.fire("on_load_checkpoint")

    def _checkpointed(self) -> Checkpointed:
        return Checkpointed(
            model=self.model,
            optimizer=self.optimizer,
            state=self.state,
            epoch=self._epoch,
            callbacks=self.callbacks,
            executor=self.train_model,
            model_with_loss=self.model_with_loss,
            twin=self.executors.twin,
        )

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Load model weights only (``load_checkpoint(path)["model"]``, or an older checkpoint's
        ``model.``-prefixed keys), between fits; optimizer state and counters stay."""
        self.executors.load_weights(weights_for(self.model_with_loss, self.model, weights))
