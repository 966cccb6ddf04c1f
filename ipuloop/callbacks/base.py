"""Callbacks and the loop's events.

The loop, with every event (``Loop.fit``; ``Loop.describe()`` prints this with the callbacks
attached at each event)::

    [first fit only: on_configure]           # the one place to change loop.train_opts
    build the loader, check it; resume_from: load the checkpoint
    on_fit_start
    for epoch in range(state.epoch, epochs):
        on_epoch_start
        for each host batch (one step = DI*GA*RF micro-batches):
            [first step only: on_compile_start, compile the training model, on_compile_end]
            on_train_step_start                  # CancelStep: skip this step's remaining hooks
            run the training model               # DI optimizer updates on the device
            reduce the returned loss (and logged values), check it, update the train metrics
            if val_loader and state.step % val_every_n_steps == 0: validation, as below
            on_train_step_end                    # state.logs["loss"] is this step's mean loss
            if loop.stop() was called or max_steps is reached: leave the epoch
        epoch logs: train_loss, train_<metric> (Final, EveryN: "estimated" names the estimates)
        if the epoch was left before its last step: go to on_fit_end   # incomplete epoch
        if val_loader (and the last step did not validate):
            on_validation_start
            [first time: on_compile_start, compile the inference model, on_compile_end]
            for each val set, each host batch: run the inference model; on_validation_step_end
            on_validation_end                    # state.logs has val_loss, val_<metric>
        on_epoch_end                             # the place to checkpoint or stop on val logs
        if loop.stop() was called: leave
    on_fit_end

``on_configure`` fires once per loop, at the start of its first ``fit``, before the loader is
built: a callback may change ``loop.train_opts`` there (e.g. ``deviceIterations``). Then the
options freeze, and the loader, the output layout, the logs and the compiled model all use
them; a later change raises PopTorch's frozen-options error.
An incomplete epoch (stopped before its last step) is not counted in ``state.epoch`` and gets
no validation and no ``on_epoch_end``; ``fit`` with ``resume_from`` finishes it.
SIGTERM: the running step finishes, then ``on_preempt`` (checkpoint here), ``on_fit_end``,
and the process exits with status 143; during a validation, it stops there, and a fit
resumed from that checkpoint runs the validation again from its start (a step's validation:
then that step's ``on_train_step_end``).
``Loop.validate`` runs the validation block alone (on_fit_start/on_fit_end not fired; a
CancelEpoch or CancelFit from its hooks ends it with no val logs, returning ``{}``);
``Loop.predict`` fires only on_compile_start/on_compile_end, when it compiles.
``on_save_checkpoint`` fires when ``ModelCheckpoint`` saves, before the callbacks'
``state_dict()`` is read; ``on_load_checkpoint`` at the end of ``Loop.load_state_dict``.
Any exception other than the Cancel* ones fires ``on_exception`` once per failing ``fit``,
``validate`` or ``predict`` call (``loop.exception`` is the error), then propagates; an
exception raised in a hook carries a note naming the callback and the hook. A Cancel*
exception skips the rest of its scope, later callbacks' hooks for that event included:
``CancelStep`` from a train step hook: to the next step. ``CancelEpoch`` from
on_epoch_start or a step hook: to the epoch logs (validation and on_epoch_end still run);
from a validation hook: to on_epoch_end (no val logs that epoch; from a step's validation,
to the epoch logs); from on_epoch_end: no effect. ``CancelFit`` from any fit hook: to on_fit_end.

Hooks fire per step, never per micro-batch: the host never sees a micro-batch on an IPU.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
import weakref
from typing import Any, Callable, Iterable, Protocol

from ..state import State

__all__ = [
    "Callback",
    "CancelStep",
    "CancelEpoch",
    "CancelFit",
    "EVENTS",
    "LoopView",
    "register_default",
    "arrange",
    "resume_path",
    "check_mode",
    "monitored",
    "overridden",
    "check_monitor",
    "check_val_set",
    "LIGHTNING_HOOKS",
]

EVENTS = (
    "on_configure",
    "on_fit_start",
    "on_epoch_start",
    "on_compile_start",
    "on_compile_end",
    "on_train_step_start",
    "on_train_step_end",
    "on_validation_start",
    "on_validation_step_end",
    "on_validation_end",
    "on_epoch_end",
    "on_fit_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_preempt",
    "on_exception",
)


class LoopView(Protocol):
    """The view of the loop a callback is given: what a hook may use of it (``ipuloop.Loop``
    provides it).

    Callbacks read ``state`` (counters, logs, steps per epoch, the exception being handled)
    and end the fit with ``stop()`` or a Cancel* exception; nothing else of the loop.
    """

    state: State
    train_opts: Any  # poptorch.Options: settable in on_configure, frozen from fit on
    optimizer: Any  # the host optimizer (changes reach the device before the next step)
    callbacks: list[Callback]

    @property
    def exception(self) -> BaseException | None: ...  # the same as state.exception

    def stop(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...  # fires on_save_checkpoint first
    def load_weights(self, weights: dict[str, Any]) -> None: ...  # between fits (on_fit_end)
    def check_resumable(self) -> None: ...


class CancelStep(Exception):
    """Raised in ``on_train_step_start``: skip this training step itself (its host batch is
    read but never run: no update, no loss; ``state.epoch_step`` counts it as read, so a
    resume does not read it again) and its remaining hooks. Raised in
    ``on_train_step_end``: skip the later callbacks' ``on_train_step_end`` only."""


class CancelEpoch(Exception):
    """Raised in a step or epoch hook: end the running epoch now (epoch-end hooks still run)."""


class CancelFit(Exception):
    """Raised in any fit hook: end the fit now (``on_fit_end`` still runs)."""


class Callback:
    """Base class: override the hooks you need; each takes the loop (``loop.state`` etc.).

    The loop calls only the hooks a callback overrides, in ascending ``order`` (stable).
    A callback with state to checkpoint returns it from ``state_dict()`` (tensors, numbers,
    strings, lists and dicts only) and takes it back in ``load_state_dict()``: their
    docstrings give the contract.

    A method named like a hook but not one (``on_epoch_begin``), or named as a Lightning hook
    the loop never calls (``on_train_batch_end``, ``transfer_batch_to_device``,
    ``training_step``...), is never called: the first construction of such a class warns,
    naming the nearest event, or saying there is none and what to do instead. So does an
    event hook written with Lightning's arguments (``trainer, pl_module``): events take the
    loop alone.

    With several processes (``state.instances`` > 1) a callback with ``main_instance_only``
    True runs on instance 0 only (progress displays and loggers); the others run everywhere.
    """

    order: int = 0
    main_instance_only: bool = False

    def __new__(cls, *args: object, **kwargs: object) -> Callback:
        if cls not in _CHECKED:
            _CHECKED.add(cls)
            _warn_misnamed_hooks(cls)
        return super().__new__(cls)

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint (unique per loop): the class name. A
        class of which a loop may hold several overrides it (``ModelCheckpoint``: ``name=``)."""
        return type(self).__qualname__

    def state_dict(self) -> dict[str, Any]:
        """This callback's state for a checkpoint; the base has none (``{}``).

        Read by ``Loop.state_dict()``, which ``ModelCheckpoint`` calls when it saves (or a
        program calls by hand), after ``on_save_checkpoint`` has fired: a hook may stash there
        what this returns. The result is stored in the checkpoint under ``state_key`` and must
        hold only tensors, numbers, strings, booleans, None, and lists, tuples and dicts of
        them: checkpoints load with ``torch.load(weights_only=True)``, which rejects any other
        object, so a checkpoint holding one fails to load (``CheckpointError``), though it
        saved.

        It is read on every instance of a run, ``main_instance_only`` or not (that flag only
        keeps the hooks from firing elsewhere), and instance 0 writes the checkpoint: what is
        saved is instance 0's state.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back a ``state_dict()`` result, as saved; the base ignores it.

        Called by ``Loop.load_state_dict`` (``fit(resume_from=...)`` calls it before
        ``on_fit_start``), in the order of the loop's callbacks, before ``on_load_checkpoint``
        fires; only when the checkpoint holds state under this callback's ``state_key``
        (otherwise the callback keeps the state it has). On several processes every instance
        gets the state instance 0 saved, ``main_instance_only`` callbacks too, although their
        hooks run on instance 0 only.
        """

    def on_configure(self, loop: LoopView) -> None: ...
    def on_fit_start(self, loop: LoopView) -> None: ...
    def on_epoch_start(self, loop: LoopView) -> None: ...
    def on_compile_start(self, loop: LoopView) -> None: ...
    def on_compile_end(self, loop: LoopView) -> None: ...
    def on_train_step_start(self, loop: LoopView) -> None: ...
    def on_train_step_end(self, loop: LoopView) -> None: ...
    def on_validation_start(self, loop: LoopView) -> None: ...
    def on_validation_step_end(self, loop: LoopView) -> None: ...
    def on_validation_end(self, loop: LoopView) -> None: ...
    def on_epoch_end(self, loop: LoopView) -> None: ...
    def on_fit_end(self, loop: LoopView) -> None: ...
    def on_save_checkpoint(self, loop: LoopView) -> None: ...
    def on_load_checkpoint(self, loop: LoopView) -> None: ...
    def on_preempt(self, loop: LoopView) -> None: ...
    def on_exception(self, loop: LoopView) -> None: ...

    def resume_path(self) -> Any:
        """Not an event: override it to answer ``fit(resume_from="last")`` with the checkpoint
        to load (a path), or None when there is none yet (the fit starts from scratch)."""
        return None


_CHECKED: weakref.WeakSet = weakref.WeakSet()  # Callback classes already checked
_SYNONYMS = (("begin", "start"), ("batch", "step"))  # other loops' words for the same events

_PER_STEP = (
    "fires once per step: one host call of DI*GA*RF micro-batches, none of which the "
    "host sees alone"
)
_TRANSFER = (
    "the compiled step takes the host batch as the loader yields it and PopTorch "
    "sends it to the device; change batches in the dataset or the DataLoader's "
    "collate_fn"
)
_ON_DEVICE = (
    "backward and the optimizer step run on the device inside the compiled step, so "
    "the host sees no gradients; clip with Loop(max_grad_norm=), or change the "
    "optimizer's hyper-parameters in on_train_step_start"
)
_MODULE = (
    "it is a LightningModule method: put the step's computation in the model's forward "
    "(returning (output, loss) when given labels), or pass a plain model and loss_fn= to "
    "Loop"
)
_PREDICT = "Loop.predict fires only on_compile_start and on_compile_end"

# Lightning's hooks the loop never calls: the nearest loop event and how it differs, or None
# and what to do instead.
LIGHTNING_HOOKS: dict[str, tuple[str | None, str]] = {
    "on_train_batch_start": ("on_train_step_start", _PER_STEP),
    "on_train_batch_end": ("on_train_step_end", _PER_STEP),
    "on_validation_batch_end": ("on_validation_step_end", _PER_STEP),
    "on_validation_batch_start": (
        None,
        "validation has no event before each step: use "
        "on_validation_start, or on_validation_step_end",
    ),
    "on_train_epoch_start": ("on_epoch_start", "the same moment"),
    "on_train_epoch_end": ("on_epoch_end", "which fires after the epoch's validation"),
    "on_validation_epoch_start": ("on_validation_start", "the same moment"),
    "on_validation_epoch_end": ("on_validation_end", "the val logs are in state.logs there"),
    "on_train_start": ("on_fit_start", "the same moment"),
    "on_train_end": ("on_fit_end", "the same moment"),
    "setup": (
        "on_configure",
        "fires once per loop, before its first fit; on_fit_start fires at every fit",
    ),
    "teardown": ("on_fit_end", "fires when each fit ends, however it ends"),
    "on_before_batch_transfer": (None, _TRANSFER),
    "on_after_batch_transfer": (None, _TRANSFER),
    "transfer_batch_to_device": (None, _TRANSFER),
    "on_before_backward": (None, _ON_DEVICE),
    "on_after_backward": (None, _ON_DEVICE),
    "on_before_optimizer_step": (None, _ON_DEVICE),
    "on_before_zero_grad": (None, _ON_DEVICE),
    "optimizer_step": (None, _ON_DEVICE),
    "optimizer_zero_grad": (None, _ON_DEVICE),
    "configure_gradient_clipping": (None, _ON_DEVICE),
    "training_step": (None, _MODULE),
    "validation_step": (None, _MODULE),
    "test_step": (None, _MODULE),
    "predict_step": (None, _MODULE),
    "configure_optimizers": (None, "pass the optimizer to Loop(optimizer=)"),
    "on_sanity_check_start": (
        None,
        "the loop runs no sanity check: before compiling, it runs "
        "one micro-batch through the model on the host",
    ),
    "on_sanity_check_end": (
        None,
        "the loop runs no sanity check: before compiling, it runs "
        "one micro-batch through the model on the host",
    ),
    "on_predict_start": (None, _PREDICT),
    "on_predict_end": (None, _PREDICT),
    "on_predict_batch_start": (None, _PREDICT),
    "on_predict_batch_end": (None, _PREDICT),
}


def _warn_misnamed_hooks(cls: type) -> None:
    """Warn about each method of ``cls`` the loop would never call as its author meant: a
    Lightning hook, an ``on_*`` name close to an event but not one, or an event written with
    Lightning's arguments."""
    methods = {
        n: v
        for klass in reversed(cls.__mro__)
        if klass is not Callback and klass is not object
        for n, v in vars(klass).items()
        if callable(v)
    }
    for name in sorted(methods):
        if name in LIGHTNING_HOOKS:
            event, note = LIGHTNING_HOOKS[name]
            warnings.warn(
                f"{cls.__name__}.{name} is a Lightning hook, which the loop never calls: "
                + (
                    f"the nearest loop event is {event} ({note})."
                    if event is not None
                    else f"the loop has no such event; {note}."
                )
                + " (All events: ipuloop.callbacks.base.EVENTS.)",
                stacklevel=3,
            )
        elif name in EVENTS:
            _warn_lightning_arguments(cls, name, methods[name])
        elif name.startswith("on_"):
            key = name
            for word, ours in _SYNONYMS:
                key = key.replace(word, ours)
            close = difflib.get_close_matches(key, EVENTS, n=1, cutoff=0.6)
            if close:
                warnings.warn(
                    f"{cls.__name__}.{name} is not a loop event, so the loop never "
                    f"calls it. Did you mean {close[0]}? (All events: "
                    "ipuloop.callbacks.base.EVENTS.)",
                    stacklevel=3,
                )


def _warn_lightning_arguments(cls: type, name: str, method: Callable) -> None:
    """An event hook that needs more arguments than the loop: Lightning's (trainer, ...)."""
    try:
        params = list(inspect.signature(method).parameters.values())[1:]  # after self
    except (TypeError, ValueError):  # no signature to read (a builtin): nothing to say
        return
    needed = [
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(needed) > 1:
        warnings.warn(
            f"{cls.__name__}.{name} takes ({', '.join(needed)}), as Lightning's hooks "
            "do, but the loop calls every event with the loop alone, so it would "
            f"fail there. Define {name}(self, loop) (loop.state, loop.optimizer...).",
            stacklevel=4,
        )


class DefaultCallback(Protocol):
    """A function that adds a callback a loop lacks (``register_default``): given the loop's
    callbacks and its ``progress`` argument, the callback to add, or None."""

    def __call__(self, callbacks: list[Callback], *, progress: bool | int) -> Callback | None: ...


# Factories of the callbacks a loop adds unless given one: f(callbacks, progress=) -> Callback
# or None. Registered by the module of each such callback (the progress display).
_DEFAULTS: list[DefaultCallback] = []


def register_default(factory: DefaultCallback) -> None:
    _DEFAULTS.append(factory)


def arrange(callbacks: Iterable[Callback], *, progress: bool | int) -> list[Callback]:
    """A loop's callbacks, checked, with the registered defaults they lack (for a loop built
    with ``progress``), sorted by ``order`` once."""
    cbs = list(callbacks)
    for cb in cbs:
        if not isinstance(cb, Callback):
            raise TypeError(
                f"callbacks must be ipuloop.Callback instances. Received: {type(cb).__name__}."
            )
    cbs += [cb for cb in (f(cbs, progress=progress) for f in _DEFAULTS) if cb is not None]
    cbs.sort(key=lambda cb: cb.order)
    keys = [cb.state_key for cb in cbs]
    shared = sorted({k for k in keys if keys.count(k) > 1})
    if shared:
        same = [_describe(cb) for cb in cbs if cb.state_key in shared]
        raise ValueError(
            f"Several callbacks have the state_key {', '.join(map(repr, shared))} "
            f"({', '.join(same)}), so a checkpoint could not tell their states "
            "apart. Give each its own: ModelCheckpoint(..., name='best') sets it (two "
            "ModelCheckpoints that differ in folder, filename, when they save or what they "
            "rank by and keep have their own already); another Callback class overrides "
            "its state_key property."
        )
    return cbs


def _describe(cb: Callback) -> str:
    return repr(cb) if type(cb).__repr__ is not object.__repr__ else type(cb).__name__


def resume_path(callbacks: list[Callback]) -> Any:
    """``fit(resume_from="last")``: the checkpoint that the callbacks overriding
    ``resume_path`` name; of several, the one written last (None, with a warning: none yet)."""
    finders = [cb for cb in callbacks if overridden(cb, "resume_path")]
    if not finders:
        raise ValueError(
            'resume_from="last" needs a ModelCheckpoint callback to know '
            "the folder; pass a checkpoint path instead."
        )
    paths = [p for p in (cb.resume_path() for cb in finders) if p is not None]
    if not paths:
        warnings.warn(
            f'resume_from="last": no checkpoint yet '
            f"({', '.join(map(_describe, finders))})"
            ": starting from scratch.",
            stacklevel=4,
        )
        return None
    if len(paths) == 1:
        return paths[0]
    from ..checkpoint_io import newest  # (the manifests say when each was written)

    return newest(paths)


def check_mode(mode: str) -> float:
    """A monitoring callback's ``mode``, checked: the sign that makes lower better (1.0 for
    "min", -1.0 for "max")."""
    if mode not in ("min", "max"):
        raise ValueError(f'mode must be "min" or "max". Received: mode={mode!r}.')
    return 1.0 if mode == "min" else -1.0


def check_monitor(state: State, monitor: str | None, who: str) -> None:
    """At fit start: a ``ValueError`` when ``monitor`` is a validation log (``val_...``) and
    the fit has no ``val_loader``, so it would never exist (found before any step rather than
    at the first epoch end), or names no validation set of the fit (``check_val_set``)."""
    if monitor is not None and monitor.startswith("val_") and not state.validates:
        raise ValueError(
            f"{who}: monitor={monitor!r} is a validation log, but this fit has no val_loader, "
            "so it is never written. Pass val_loader= to fit, or monitor a log of the "
            "training (e.g. 'train_loss')."
        )
    if monitor is not None:
        check_val_set(state, monitor, f"{who}: monitor={monitor!r}")


def check_val_set(state: State, log: str, what: str) -> None:
    """At fit start: a ``ValueError`` when the validation log ``log`` (``what`` says where it
    was given) could not be written by this fit: a log without a set's name in a fit with
    several validation sets (each set's is ``val_<name>/<set>``), or with one in a fit with
    one val_loader (``val_<name>`` alone)."""
    if not (log.startswith("val_") and state.validates):
        return
    name, slash, suffix = log.partition("/")
    sets = state.val_sets
    if sets and suffix not in sets:
        raise ValueError(
            f"{what} names the log {log!r}, which this fit never writes: with several "
            "validation sets each validation log carries its set's name "
            f"({', '.join(f'{name}/{s}' for s in sets)}). Name one of those."
        )
    if not sets and slash:
        raise ValueError(
            f"{what} names the log {log!r}, of a validation set, but this fit has one "
            f"val_loader, whose logs carry no set's name. Name {name!r}, or pass val_loader= "
            "a dict or list of loaders."
        )


def monitored(state: State, monitor: str, who: str) -> float:
    """The value of the log ``monitor`` in ``state.logs``; a ``ValueError`` naming ``who``,
    the epoch and step, and the logs there are when it is missing."""
    logs = state.logs
    if monitor not in logs:
        raise ValueError(
            f"{who}: monitor={monitor!r} is not in the logs at epoch "
            f"{state.epoch}, step {state.step}. Available: {sorted(logs)}."
        )
    return float(logs[monitor])


def overridden(callback: Callback, event: str) -> bool:
    return getattr(type(callback), event) is not getattr(Callback, event)
