"""What an exact resume captures and restores beyond weights and counters: RNG points, data factors.

The host random state is read at named points, which this module records: ``epoch_rng`` as an
epoch draws its sample order (with the loader's own generator, if any: the plan draws it,
``plan.Plan.epoch``, and holds the state it drew from), ``val_rng`` as a validation inside a fit
begins (a checkpoint taken during it resumes before it: the resumed fit runs that validation
again from its start, and after a step's own validation, ``fit(val_every_n_steps=)``, that
step's ``on_train_step_end``), and the state at the checkpointed step itself. A resumed
mid-epoch fit draws the epoch's order again from ``epoch_rng``, then goes on from the step's
state (``random_state.Draw``). The device's random state is set once the training model compiles.

The data factors are those of the whole run: N processes of R replicas each count as one
process with N*R replicas, whose host call is N times one instance's. So a checkpoint of
``torchrun --nproc-per-node 2`` with ``replicas=1`` resumes in one process with
``replicas=2`` (and the reverse) at the same sample, with no warning. With other factors than
the saved run (micro-batch size, deviceIterations, gradientAccumulation, replicas of all
instances, dataset length), a checkpoint taken at an epoch boundary resumes with a warning;
one taken mid-epoch continues at the same sample when the samples already read make whole
host calls of the new factors (same dataset length), and is a ``ValueError`` naming each
changed factor otherwise, raised before any step. (An ``IterableDataset``, which each
instance reads on its own, continues mid-epoch only with the saved number of instances.)
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterator, Sequence

import torch

from . import optimizer_twin
from .accumulators import TrainEpoch, upgrade_logs
from .backend import backend_name
from .callbacks.base import Callback, CancelEpoch, CancelFit, resume_path
from .checkpoint_io import load_checkpoint
from .outputs import loss_fn_state, weights_for
from .plan import Plan
from .poptorch_types import Executor
from .random_state import Draw, rng_state, set_rng_state
from .rules import describe_factors
from .state import State

__all__ = [
    "Resume",
    "read_checkpoint",
    "Checkpointed",
    "check_resumable",
    "check_optimizer",
    "group_shapes",
    "optimizer_extras",
]

# poptorch.optim attributes outside optimizer.state_dict() that a fit may change (the others
# are fixed when the optimizer is built): checkpointed, and set again before the next push
OPTIMIZER_EXTRAS = ("loss_scaling", "max_grad_norm", "max_weight_norm")


def check_resumable(opt: torch.optim.Optimizer | None, poptorch: ModuleType) -> None:
    """Raise ``ValueError`` when a checkpoint could not resume exactly: PopTorch reads and
    writes optimizer state (momentum, moments) only for ``poptorch.optim`` optimizers. A
    ``torch.optim`` SGD, Adam, AdamW or RMSprop runs as its ``poptorch.optim`` twin
    (``optimizer_twin``), whose state the loop reads back; a stateful optimizer without a twin
    would keep its state on the device, out of every checkpoint."""
    reason = optimizer_twin.why_not(poptorch, opt)
    if reason is None:
        return
    if isinstance(opt, torch.optim.SGD) and not any(g.get("momentum") for g in opt.param_groups):
        return  # plain SGD: no state to lose
    twin = next(
        (
            c.__name__
            for c in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.RMSprop)
            if isinstance(opt, c)
        ),
        None,
    )
    assert opt is not None  # (None has no reason)
    args = ", ".join(
        f"{k}={v!r}"
        for k, v in opt.defaults.items()
        if k
        in (
            "lr",
            "momentum",
            "dampening",
            "nesterov",
            "betas",
            "eps",
            "weight_decay",
            "alpha",
            "centered",
        )
    )
    fix = (
        f"Use a poptorch.optim optimizer with the same values, e.g. "
        f"poptorch.optim.{twin}(params, {args}), or a torch.optim.{twin} itself with only the "
        "arguments its poptorch.optim twin takes."
        if twin is not None
        else "Use a torch.optim or poptorch.optim SGD, Adam, AdamW or RMSprop (or "
        "poptorch.optim.LAMB), whose state the loop checkpoints."
    )
    raise ValueError(
        f"optimizer={type(opt).__module__}.{type(opt).__qualname__} {reason}: PopTorch reads "
        "and writes optimizer state (momentum, moments) for poptorch.optim optimizers alone, "
        "so its state would stay on the IPU, out of every checkpoint, and a resumed fit would "
        f"restart it from zero. {fix}"
    )


def read_checkpoint(source: str, callbacks: list[Callback]) -> tuple[str, dict[str, Any]] | None:
    """The checkpoint ``source`` names (a path, or "last": the newest of those the callbacks
    that know where checkpoints are write), read: its path and contents; None: none yet."""
    if source == "last":
        found = resume_path(callbacks)
        if found is None:
            return None
        source = found
    return str(source), load_checkpoint(source, backend=backend_name())


def optimizer_extras(opt: torch.optim.Optimizer) -> dict[str, float]:
    return {k: float(getattr(opt, k)) for k in OPTIMIZER_EXTRAS if hasattr(opt, k)}


def group_shapes(opt: torch.optim.Optimizer) -> list[list[list[int]]]:
    """The shape of each parameter of each group, in order: the layout a checkpoint records."""
    return [[list(p.shape) for p in g["params"]] for g in opt.param_groups]


def check_optimizer(sd: dict[str, Any], ours: torch.optim.Optimizer) -> None:
    """Raise ``ValueError`` unless ``ours`` has the saved optimizer's type and group layout:
    the parameters' shapes, group by group, in order (a checkpoint without them, written
    before they were recorded: the number of parameters per group)."""
    saved = sd.get("optimizer")
    if saved is None:
        return
    fix = (
        "Build the loop with the optimizer type and parameter groups of the saved run, in "
        "the same order, or start a new fit from its weights: "
        'model.load_state_dict(load_checkpoint(path)["model"]).'
    )
    theirs_type = sd.get("optimizer_type", type(ours).__name__)  # older checkpoints: unnamed
    layout = [len(g["params"]) for g in saved["param_groups"]]
    our_layout = [len(g["params"]) for g in ours.param_groups]
    if theirs_type != type(ours).__name__ or layout != our_layout:
        raise ValueError(
            f"Cannot resume: the checkpoint's optimizer is {theirs_type} with "
            f"{len(layout)} parameter group(s) of {layout} parameters, but the loop's is "
            f"{type(ours).__name__} with {len(our_layout)} of {our_layout}. {fix}"
        )
    shapes = sd.get("optimizer_shapes")
    our_shapes = group_shapes(ours)
    if shapes is not None and [[list(s) for s in g] for g in shapes] != our_shapes:
        differ = [
            i for i, (a, b) in enumerate(zip(shapes, our_shapes)) if [list(s) for s in a] != b
        ]
        raise ValueError(
            "Cannot resume: the optimizer's parameter groups hold other parameters than the "
            "checkpoint's (parameter shapes per group: "
            + "; ".join(
                f"group {i}: saved {[list(s) for s in shapes[i]]}, now {our_shapes[i]}"
                for i in differ
            )
            + "): the saved momentum and moments would go to the wrong parameters. "
            + fix
        )


def _data_factors(plan: Plan) -> dict[str, Any]:
    """The training data factors of the whole run: ``plan`` is one instance's share of N, and
    N instances of R replicas read as one process with N*R replicas (``ipuloop.processes``)."""
    o = plan.opts
    n = o.Distributed.numProcesses
    return {
        "factors": {
            "micro-batch size": plan.micro,
            "deviceIterations": o.device_iterations,
            "gradientAccumulation": o.Training.gradient_accumulation,
            "replicationFactor": o.replication_factor * n,
            "input_group_size": o.input_group_size,
            "dataset length": plan.samples,
        },
        "samples_per_step": plan.combined * n,
        "instances": n,
    }


def _run_factors(data: dict[str, Any] | None, processes: object) -> dict[str, Any] | None:
    """A checkpoint's data factors as the whole run's: those written before they were
    recorded so held one instance's, ``processes`` (one entry per instance) says how many."""
    if data is None or "instances" in data:
        return data
    n = len(processes) if isinstance(processes, list) else 1
    factors = dict(data["factors"], replicationFactor=data["factors"]["replicationFactor"] * n)
    return {"factors": factors, "samples_per_step": data["samples_per_step"] * n, "instances": n}


@dataclass(frozen=True)
class Checkpointed:
    """The parts of a loop a checkpoint holds (``Resume.capture``) and a resume puts back
    (``Resume.restore``), besides the RNG points and data factors ``Resume`` keeps."""

    model: torch.nn.Module  # the user's module: a checkpoint's "model" is its state_dict
    optimizer: torch.optim.Optimizer
    state: State  # counters, history, logs
    epoch: TrainEpoch  # the running epoch's sums and train metrics
    callbacks: Sequence[Callback]  # each one's state_dict, under its state_key
    executor: Executor | None  # the training executor, None before the first step
    model_with_loss: torch.nn.Module  # what runs: ``model``, or the WithLoss around it
    twin: torch.optim.Optimizer | None = None  # what the device runs for a torch.optim one


class Resume:
    """The RNG points and data factors of one loop's running fit, saved and restored."""

    def __init__(self) -> None:
        self.val_rng: dict[str, Any] | None = None  # as the running validation began
        self.val_in_step = False  # the running validation is a step's (val_every_n_steps)
        self.plan: Plan | None = None  # the running (or last) fit's: its epochs' draws
        self.val_plans: tuple[Plan, ...] = ()  # its validation sets'
        self._seeded: set[str] = set()  # a loaded checkpoint's loaders that drew a base seed
        self._draw: Draw | None = None  # a loaded checkpoint's, until the next epoch draws
        self._step_validation = False  # a loaded checkpoint was taken during one: run it again
        self._device_rng: torch.Tensor | None = None  # a loaded one, until the model compiles
        self._train_data: dict[str, Any] | None = None  # the running fit's data factors
        self._loaded_data: dict[str, Any] | None = None  # a loaded checkpoint's, until fit

    def draw(self) -> Draw:
        """How the next training epoch draws its order: a loaded checkpoint's saved random
        state, once, or the random state as it is (``Plan.epoch`` records it, and a
        checkpoint reads it from the fit's plan)."""
        draw = self._draw
        self._draw = None
        return draw if draw is not None else Draw()

    @contextlib.contextmanager
    def validation(self, *, in_step: bool) -> Iterator[None]:
        """A validation inside a fit (``in_step``: a step's, before its on_train_step_end): a
        checkpoint taken during it (SIGTERM, an error) resumes with the RNG as it was before
        it began, and the resumed fit runs it again from its start."""
        self.val_rng = rng_state()
        self.val_in_step = in_step
        try:
            yield
        except (CancelEpoch, CancelFit):  # a hook ended it: nothing to run again
            self.val_rng = None
            raise
        self.val_rng = None  # not in a finally: a SIGTERM or error save must still see it

    def take_step_validation(self) -> bool:
        """Whether the loaded checkpoint was taken during a step's validation, once: the
        resumed fit runs it again, then that step's ``on_train_step_end``."""
        pending = self._step_validation
        self._step_validation = False
        return pending

    def carry_device_rng(self, rng: torch.Tensor) -> None:
        """The device random state of a training model destroyed to be wrapped again: the
        next one continues it, and a checkpoint taken before that one compiles holds it."""
        self._device_rng = rng

    def take_device_rng(self) -> torch.Tensor | None:
        """A loaded device random state, once: the compiled model continues it."""
        rng = self._device_rng
        self._device_rng = None
        return rng

    def capture(self, parts: Checkpointed) -> dict[str, Any]:
        """A loop's ``state_dict``: its ``parts`` (the model, optimizer, counters, logs,
        running epoch, callbacks) and the RNG points."""
        model = parts.model
        optimizer = parts.optimizer
        st = parts.state
        executor = parts.executor
        if executor is not None and executor.isAttachedToDevice():
            # the device holds the current weights (a detached model copied them back when it
            # detached, and reading from a device it no longer holds is undefined in PopTorch)
            executor.copyWeightsToHostIfNeeded()
        sd: dict[str, Any] = {
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "loss_fn": loss_fn_state(parts.model_with_loss),  # (loss_fn=CrossEntropyLoss(weight=))
            "optimizer": (
                optimizer.state_dict()
                if parts.twin is None
                else optimizer_twin.state_dict(optimizer, parts.twin)  # the device's state
            ),
            "optimizer_type": type(optimizer).__name__,
            "optimizer_shapes": group_shapes(optimizer),  # checked by the resume
            "data": self._train_data,  # the factors the counters refer to
            "counters": st.counters(),
            "history": [dict(h) for h in st.history],
            "logs": dict(st.logs),  # an epoch ending right after a resume logs these
            **parts.epoch.state_dict(),  # epoch_loss, epoch_logs, metrics
            "rng": self.val_rng if self.val_rng is not None else rng_state(),
            "step_validation": self.val_rng is not None and self.val_in_step,
            "optimizer_extras": optimizer_extras(optimizer),
            "sampler_rng": self._sampler_rng(),
            "epoch_rng": self._epoch_rng(),
            "seeded": sorted(self._seeded | self._seeded_now()),
            "callbacks": {cb.state_key: cb.state_dict() for cb in parts.callbacks},
        }
        if executor is not None and executor.isCompiled():
            sd["device_rng"] = executor.rng_state
        elif self._device_rng is not None:  # loaded, and no step compiled since: the same
            sd["device_rng"] = self._device_rng
        return copy.deepcopy(sd)

    def _sampler_rng(self) -> object:
        """The states of the generators the loader's order draws from: a loaded epoch start's,
        until the epoch draws; else those of the fit's plan (as they are now)."""
        if self._draw is not None and self._draw.order is None:
            return self._draw.sampler
        return self.plan.generator_state() if self.plan is not None else None

    def _seeded_now(self) -> set[str]:
        """The fit's loaders whose workers' base seed was drawn (persistent workers draw it
        once: a resumed run's workers start without drawing it again)."""
        plans = (self.plan, *self.val_plans) if self.plan is not None else ()
        return {p.name for p in plans if p.source.was_seeded()}

    def _epoch_rng(self) -> dict[str, Any] | None:
        """The state the running epoch drew its order from (a loaded one until it draws)."""
        if self._draw is not None and self._draw.order is not None:
            return self._draw.order
        return self.plan.drawn_from if self.plan is not None else None

    def restore(self, sd: dict[str, Any], parts: Checkpointed) -> None:
        """Put back into ``parts`` what ``capture`` took (the optimizer checked first:
        ``check_optimizer``)."""
        optimizer = parts.optimizer
        st = parts.state
        executor = parts.executor
        callbacks = parts.callbacks
        check_optimizer(sd, optimizer)
        weights = weights_for(parts.model_with_loss, parts.model, sd["model"], sd.get("loss_fn"))
        (executor or parts.model_with_loss).load_state_dict(weights)
        if sd.get("optimizer") is not None and parts.twin is not None:
            optimizer_twin.load_state_dict(optimizer, parts.twin, sd["optimizer"])
        elif sd.get("optimizer") is not None:
            optimizer.load_state_dict(sd["optimizer"])
            for k, v in sd.get("optimizer_extras", {}).items():  # pushed before the first step
                setattr(optimizer, k, v)
        st.load_counters(sd["counters"])
        st.history = [upgrade_logs(h) for h in sd["history"]]  # (older: train_loss_exact)
        st.logs = upgrade_logs(sd.get("logs", {}))
        parts.epoch.load_state_dict(sd)
        self._step_validation = bool(sd.get("step_validation", False))
        for cb in callbacks:
            key = _state_key_in(cb, sd["callbacks"], callbacks)
            if key is not None:
                cb.load_state_dict(sd["callbacks"][key])
        # checked against the next fit's loader
        self._loaded_data = _run_factors(sd.get("data"), sd.get("processes"))
        self._seeded = set(sd.get("seeded", ()))
        if sd.get("device_rng") is not None:
            if executor is not None and executor.isCompiled():
                executor.rng_state = sd["device_rng"]
            else:
                self._device_rng = sd["device_rng"]
        if st.epoch_step:  # the epoch's order drawn again, then the saved step's state
            self._draw = Draw(order=sd["epoch_rng"], then=sd["rng"])
        else:
            set_rng_state(sd["rng"])
            self._draw = Draw(sampler=sd.get("sampler_rng"))  # the loader's own generator

    def continue_at(self, plan: Plan, state: State, val_plans: tuple[Plan, ...] = ()) -> None:
        """A fit starts with the training ``plan`` (and ``val_plans``): its data factors, after
        a load (that recorded them) checked by ``_align`` first (a failed check keeps the
        loaded ones for the next fit); its epochs' draws, which a checkpoint records; the
        loaders whose workers' base seed the saved run drew. No validation of it has begun."""
        self.val_rng = None
        for p in (plan, *val_plans):
            if p.name in self._seeded:
                p.source.seeded()
        now = _data_factors(plan)
        if self._loaded_data is not None:
            _align(self._loaded_data, now, plan, state)
        elif state.epoch_step and self.plan is not None and self.plan.drawn_from is not None:
            # a fit of this loop ended mid-epoch (max_steps, stop(), an error): this one goes
            # on in that epoch's order, drawn again, then from the random state as it is, as
            # a resume from a checkpoint taken at that step would
            if self._train_data is not None:
                _align(self._train_data, now, plan, state, "the last fit")
            self._draw = Draw(order=self.plan.drawn_from, then=rng_state())
        self._loaded_data = None
        self._train_data = now
        self.plan = plan
        self.val_plans = val_plans


def _state_key_in(
    cb: Callback, states: dict[str, Any], callbacks: Sequence[Callback]
) -> str | None:
    """The key of ``cb``'s state among a checkpoint's callback ``states``: its ``state_key``,
    else a key it had in older checkpoints (``former_state_keys``: an unnamed
    ``ModelCheckpoint`` was keyed by its class) that no other callback of the loop claims;
    None when the checkpoint holds none."""
    if cb.state_key in states:
        return cb.state_key
    for key in getattr(cb, "former_state_keys", ()):
        if key not in states or any(o.state_key == key for o in callbacks):
            continue
        claims = [
            o
            for o in callbacks
            if key in getattr(o, "former_state_keys", ()) and o.state_key not in states
        ]
        if len(claims) == 1:
            return key
        warnings.warn(
            f"The checkpoint holds the state of one callback under {key!r} (an older "
            f"checkpoint's key), and {len(claims)} callbacks of this loop could have written "
            "it: none restores it (each starts with no kept checkpoints). Resume it with its "
            "own one alone, then add the others.",
            stacklevel=5,
        )
    return None


def _align(
    saved: dict[str, Any],
    now: dict[str, Any],
    plan: Plan,
    st: State,
    source: str = "the checkpoint",
) -> None:
    """Continue the saved epoch at the same sample with the new factors (the whole run's),
    or raise naming each factor that changed; ``source`` says what ended it (a checkpoint, or
    the loop's last fit)."""
    old = saved["factors"]
    new = now["factors"]
    was = saved.get("instances", 1)
    instances = now["instances"]
    if st.epoch_step and plan.own and was != instances:
        raise ValueError(
            f"Cannot resume in the middle of epoch {st.epoch} with {instances} instance(s): "
            f"{source} was written by {was}, and each instance reads its loader on its own (an "
            "IterableDataset, a poptorch.DataLoader), so the samples already read are not "
            "known in another layout. Resume "
            f"with {was} instance(s) (finishing this epoch), or from a checkpoint taken at the "
            "end of an epoch."
        )
    changed = ", ".join(f"{k} {old[k]} -> {new[k]}" for k in new if k in old and old[k] != new[k])
    if not changed:
        return
    if "replicationFactor " in changed and max(was, instances) > 1:
        changed += " (replicas of all instances together)"
    if st.epoch_step == 0:
        warnings.warn(
            f"Resuming at the start of epoch {st.epoch} with other factors than "
            f"the checkpoint's ({changed}): the epochs from here on use the new "
            "ones.",
            stacklevel=4,
        )
        return
    position = st.epoch_step * saved["samples_per_step"]  # samples the epoch has read
    per_step = now["samples_per_step"]
    if old.get("dataset length") == new["dataset length"] and not position % per_step:
        st.epoch_step = position // per_step  # the same sample, in the new host calls
        warnings.warn(
            f"Resuming epoch {st.epoch} after its {position} samples already "
            f"read, with other factors than {source}'s ({changed}): "
            f"{st.epoch_step} host calls of the new factors.",
            stacklevel=4,
        )
        return
    calls = describe_factors(plan.opts, plan.micro, training=True)
    if instances > 1:
        calls += f" on each of {instances} instances, {per_step} in all"
    raise ValueError(
        f"Cannot resume in the middle of epoch {st.epoch} with other factors ({changed}): "
        f"{source} stopped after {position} of the epoch's samples, and "
        + (
            "a different dataset length changes the epoch's sample order"
            if old.get("dataset length") != new["dataset length"]
            else f"{position} is not a whole number of the new host calls of {calls}"
        )
        + ". Resume with the saved factors (finishing this epoch, then change them at an "
        "epoch boundary), or from a checkpoint taken at the end of an epoch."
    )
