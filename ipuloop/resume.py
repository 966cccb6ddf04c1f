"""What an exact resume captures and restores beyond weights and counters: RNG points, data factors.

The host random state is read at named points: ``epoch_rng`` as an epoch draws its sample
order (with the loader's own generator, if any), ``val_rng`` as a validation inside a fit
begins (a checkpoint taken during it resumes before it: the resumed fit runs that validation
again from its start, and after a step's own validation, ``fit(val_every_n_steps=)``, that
step's ``on_train_step_end``), and the state at the checkpointed step itself. A resumed mid-epoch fit replays the epoch's order from ``epoch_rng``, then goes
on from the step's state. The device's random state is set once the training model compiles.

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
import random
import warnings
from typing import Any, Iterator

import torch

from .callbacks.base import CancelEpoch, CancelFit
from .metrics import metric_state
from .rules import describe_factors

__all__ = ["rng_state", "set_rng_state", "Resume", "check_resumable", "check_optimizer",
           "group_shapes", "optimizer_extras"]

# poptorch.optim attributes outside optimizer.state_dict() that a fit may change (the others
# are fixed when the optimizer is built): checkpointed, and set again before the next push
OPTIMIZER_EXTRAS = ("loss_scaling", "max_grad_norm", "max_weight_norm")


def _plain(x: Any) -> Any:
    return [_plain(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuple(x: Any) -> Any:
    return tuple(_tuple(v) for v in x) if isinstance(x, list) else x


def rng_state() -> dict[str, Any]:
    """The host's random state (python, numpy when installed, torch, CUDA when in use)."""
    state: dict[str, Any] = {"python": _plain(random.getstate()), "torch": torch.get_rng_state()}
    with contextlib.suppress(ImportError):
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def check_resumable(opt: torch.optim.Optimizer, poptorch: Any) -> None:
    """Raise ``ValueError`` when a checkpoint could not resume exactly: PopTorch reads and
    writes optimizer state (momentum, moments) only for ``poptorch.optim`` optimizers, so a
    stateful ``torch.optim`` one keeps it on the device, out of every checkpoint."""
    po = poptorch.optim
    if opt is None or isinstance(opt, (po.SGD, po.Adam, po.AdamW, po.RMSprop, po.LAMB)):
        return
    if isinstance(opt, torch.optim.SGD) and not any(g.get("momentum") for g in opt.param_groups):
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
    fix = ("Build the loop with the optimizer type and parameter groups of the saved run, in "
           "the same order, or start a new fit from its weights: "
           'model.load_state_dict(load_checkpoint(path)["model"]).')
    theirs_type = sd.get("optimizer_type", type(ours).__name__)  # older checkpoints: unnamed
    layout = [len(g["params"]) for g in saved["param_groups"]]
    our_layout = [len(g["params"]) for g in ours.param_groups]
    if theirs_type != type(ours).__name__ or layout != our_layout:
        raise ValueError(
            f"Cannot resume: the checkpoint's optimizer is {theirs_type} with "
            f"{len(layout)} parameter group(s) of {layout} parameters, but the loop's is "
            f"{type(ours).__name__} with {len(our_layout)} of {our_layout}. {fix}")
    shapes, our_shapes = sd.get("optimizer_shapes"), group_shapes(ours)
    if shapes is not None and [[list(s) for s in g] for g in shapes] != our_shapes:
        differ = [i for i, (a, b) in enumerate(zip(shapes, our_shapes))
                  if [list(s) for s in a] != b]
        raise ValueError(
            "Cannot resume: the optimizer's parameter groups hold other parameters than the "
            "checkpoint's (parameter shapes per group: "
            + "; ".join(f"group {i}: saved {[list(s) for s in shapes[i]]}, now {our_shapes[i]}"
                        for i in differ)
            + "): the saved momentum and moments would go to the wrong parameters. " + fix)


def _data_factors(plan: Any) -> dict[str, Any]:
    """The training data factors of the whole run: ``plan`` is one instance's share of N, and
    N instances of R replicas read as one process with N*R replicas (``ipuloop.distributed``)."""
    o = plan.loader.options
    n = o.Distributed.numProcesses
    return {"factors": {"micro-batch size": plan.micro,
                        "deviceIterations": o.device_iterations,
                        "gradientAccumulation": o.Training.gradient_accumulation,
                        "replicationFactor": o.replication_factor * n,
                        "input_group_size": o.input_group_size,
                        "dataset length": plan.samples},
            "samples_per_step": plan.combined * n, "instances": n}


def _run_factors(data: dict[str, Any] | None, processes: Any) -> dict[str, Any] | None:
    """A checkpoint's data factors as the whole run's: those written before they were
    recorded so held one instance's, ``processes`` (one entry per instance) says how many."""
    if data is None or "instances" in data:
        return data
    n = len(processes) if isinstance(processes, list) else 1
    factors = dict(data["factors"], replicationFactor=data["factors"]["replicationFactor"] * n)
    return {"factors": factors, "samples_per_step": data["samples_per_step"] * n, "instances": n}


class Resume:
    """The RNG points and data factors of one loop's running fit, saved and restored."""

    def __init__(self) -> None:
        self.epoch_rng: dict[str, Any] | None = None  # as the running epoch drew its order
        self.val_rng: dict[str, Any] | None = None  # as the running validation began
        self.val_in_step = False  # the running validation is a step's (val_every_n_steps)
        self._step_validation = False  # a loaded checkpoint was taken during one: run it again
        self._step_rng: dict[str, Any] | None = None  # a loaded mid-epoch step's, until replayed
        self._sampler_rng: torch.Tensor | None = None  # a loaded epoch start's loader generator
        self._device_rng: torch.Tensor | None = None  # a loaded one, until the model compiles
        self.sampler: Any = None  # the running fit's ResumableSampler (or batch sampler)
        self._train_data: dict[str, Any] | None = None  # the running fit's data factors
        self._loaded_data: dict[str, Any] | None = None  # a loaded checkpoint's, until fit

    def epoch_batches(self, plan: Any, skip: int, number: int | None = None) -> Any:
        """The epoch's batches after ``skip`` steps, its order drawn at the epoch's RNG point
        (replayed from the saved one when a checkpoint resumes mid-epoch); ``number``: the
        epoch's, for a sampler with ``set_epoch``."""
        step_rng, self._step_rng = self._step_rng, None
        sampler = plan.sampler if plan.batches is None else plan.batches  # its own generator
        self.sampler = sampler
        if step_rng is None:
            if sampler is not None and self._sampler_rng is not None:
                sampler.set_generator_state(self._sampler_rng)  # resumed at an epoch start
            self._sampler_rng = None
            self.epoch_rng = rng_state()
            if sampler is not None:
                self.epoch_rng["sampler"] = sampler.generator_state()
        else:  # resuming: replay the epoch's order from its start state
            set_rng_state(self.epoch_rng)
            if sampler is not None:
                sampler.set_generator_state(self.epoch_rng.get("sampler"))
        batches = plan.epoch(skip, number)
        if step_rng is not None:
            set_rng_state(step_rng)
        return batches

    @contextlib.contextmanager
    def validation(self, in_step: bool) -> Iterator[None]:
        """A validation inside a fit (``in_step``: a step's, before its on_train_step_end): a
        checkpoint taken during it (SIGTERM, an error) resumes with the RNG as it was before
        it began, and the resumed fit runs it again from its start."""
        self.val_rng, self.val_in_step = rng_state(), in_step
        try:
            yield
        except (CancelEpoch, CancelFit):  # a hook ended it: nothing to run again
            self.val_rng = None
            raise
        self.val_rng = None  # not in a finally: a SIGTERM or error save must still see it

    def take_step_validation(self) -> bool:
        """Whether the loaded checkpoint was taken during a step's validation, once: the
        resumed fit runs it again, then that step's ``on_train_step_end``."""
        pending, self._step_validation = self._step_validation, False
        return pending

    def take_device_rng(self) -> torch.Tensor | None:
        """A loaded device random state, once: the compiled model continues it."""
        rng, self._device_rng = self._device_rng, None
        return rng

    def capture(self, model: torch.nn.Module, optimizer: Any, st: Any,
                metrics: dict[str, Any], callbacks: list, executor: Any) -> dict[str, Any]:
        """A loop's ``state_dict``: its model, optimizer, counters, logs, train metrics,
        callbacks and RNG points; ``executor`` is the training model (or None)."""
        if executor is not None and executor.isAttachedToDevice():
            # the device holds the current weights (a detached model copied them back when it
            # detached, and reading from a device it no longer holds is undefined in PopTorch)
            executor.copyWeightsToHostIfNeeded()
        sd: dict[str, Any] = {
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "optimizer_type": type(optimizer).__name__,
            "optimizer_shapes": group_shapes(optimizer),  # checked by the resume
            "data": self._train_data,  # the factors the counters refer to
            "counters": st.counters(),
            "history": [dict(h) for h in st.history],
            "logs": dict(st.logs),  # an epoch ending right after a resume logs these
            "epoch_loss": list(st.epoch_loss),
            "epoch_logs": {k: list(v) for k, v in st.epoch_logs.items()},
            "rng": self.val_rng if self.val_rng is not None else rng_state(),
            "step_validation": self.val_rng is not None and self.val_in_step,
            "optimizer_extras": optimizer_extras(optimizer),
            "sampler_rng": self.sampler.generator_state() if self.sampler is not None else None,
            "epoch_rng": self.epoch_rng,
            "metrics": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v
                            for n, v in metric_state(m).items()} for k, m in metrics.items()},
            "callbacks": {cb.state_key: cb.state_dict() for cb in callbacks},
        }
        if executor is not None and executor.isCompiled():
            sd["device_rng"] = executor.rng_state
        elif self._device_rng is not None:  # loaded, and no step compiled since: the same
            sd["device_rng"] = self._device_rng
        return copy.deepcopy(sd)

    def restore(self, sd: dict[str, Any], model: torch.nn.Module, optimizer: Any, st: Any,
                metrics: dict[str, Any], callbacks: list, executor: Any) -> None:
        """Put back what ``capture`` took (the optimizer checked first: ``check_optimizer``)."""
        check_optimizer(sd, optimizer)
        (executor or model).load_state_dict(sd["model"])
        if sd.get("optimizer") is not None:
            optimizer.load_state_dict(sd["optimizer"])
            for k, v in sd.get("optimizer_extras", {}).items():  # pushed before the first step
                setattr(optimizer, k, v)
        st.load_counters(sd["counters"])
        st.history = [dict(h) for h in sd["history"]]
        st.logs = dict(sd.get("logs", {}))
        st.epoch_loss = list(sd["epoch_loss"])
        st.epoch_logs = {k: list(v) for k, v in sd.get("epoch_logs", {}).items()}
        self._step_validation = bool(sd.get("step_validation", False))
        for k, m in metrics.items():
            for n, v in sd.get("metrics", {}).get(k, {}).items():
                setattr(m, n, v)
        for cb in callbacks:
            if cb.state_key in sd["callbacks"]:
                cb.load_state_dict(sd["callbacks"][cb.state_key])
        # checked against the next fit's loader
        self._loaded_data = _run_factors(sd.get("data"), sd.get("processes"))
        if sd.get("device_rng") is not None:
            if executor is not None and executor.isCompiled():
                executor.rng_state = sd["device_rng"]
            else:
                self._device_rng = sd["device_rng"]
        if st.epoch_step:
            self.epoch_rng, self._step_rng = sd["epoch_rng"], sd["rng"]
        else:
            set_rng_state(sd["rng"])
            self._sampler_rng = sd.get("sampler_rng")  # the loader's own generator, if any

    def continue_at(self, plan: Any, state: Any) -> None:
        """The training data factors of this fit; after a load (that recorded them), checked
        by ``_align`` first. A failed check keeps the loaded ones for the next fit."""
        now = _data_factors(plan)
        if self._loaded_data is not None:
            _align(self._loaded_data, now, plan, state)
        self._loaded_data, self._train_data = None, now


def _align(saved: dict[str, Any], now: dict[str, Any], plan: Any, st: Any) -> None:
    """Continue the saved epoch at the same sample with the new factors (the whole run's),
    or raise naming each factor that changed."""
    old, new = saved["factors"], now["factors"]
    was, instances = saved.get("instances", 1), now["instances"]
    if st.epoch_step and plan.samples is None and was != instances:
        raise ValueError(
            f"Cannot resume in the middle of epoch {st.epoch} with {instances} instance(s): "
            f"the checkpoint was written by {was}, and each instance reads an IterableDataset "
            "on its own, so the samples already read are not known in another layout. Resume "
            f"with {was} instance(s) (finishing this epoch), or from a checkpoint taken at the "
            "end of an epoch.")
    changed = ", ".join(f"{k} {old[k]} -> {new[k]}" for k in new
                        if k in old and old[k] != new[k])
    if not changed:
        return
    if "replicationFactor " in changed and max(was, instances) > 1:
        changed += " (replicas of all instances together)"
    if st.epoch_step == 0:
        warnings.warn(f"Resuming at the start of epoch {st.epoch} with other factors than "
                      f"the checkpoint's ({changed}): the epochs from here on use the new "
                      "ones.", stacklevel=4)
        return
    position = st.epoch_step * saved["samples_per_step"]  # samples the epoch has read
    per_step = now["samples_per_step"]
    if old.get("dataset length") == new["dataset length"] and not position % per_step:
        st.epoch_step = position // per_step  # the same sample, in the new host calls
        warnings.warn(f"Resuming epoch {st.epoch} after its {position} samples already "
                      f"read, with other factors than the checkpoint's ({changed}): "
                      f"{st.epoch_step} host calls of the new factors.", stacklevel=4)
        return
    calls = describe_factors(plan.loader.options, plan.micro, True)
    if instances > 1:
        calls += f" on each of {instances} instances, {per_step} in all"
    raise ValueError(
        f"Cannot resume in the middle of epoch {st.epoch} with other factors ({changed}): "
        f"the checkpoint stopped after {position} of the epoch's samples, and "
        + ("a different dataset length changes the epoch's sample order"
           if old.get("dataset length") != new["dataset length"] else
           f"{position} is not a whole number of the new host calls of {calls}")
        + ". Resume with the saved factors (finishing this epoch, then change them at an "
        "epoch boundary), or from a checkpoint taken at the end of an epoch.")
