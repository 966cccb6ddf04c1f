"""The loop's PopTorch executors: built, compiled, one attached at a time; the optimizer pushed."""

from __future__ import annotations

import contextlib
import itertools
import operator
import time
import warnings
from types import ModuleType
from typing import Any, Iterator

import torch

from . import optimizer_twin
from .modes import eval_mode
from .outputs import MarkLoss, Returns, WithLoss
from .poptorch_types import Executor, Options
from .resume import check_resumable
from .rules import OPTIMIZER_GLOBALS, optimizer_hyperparameters

__all__ = ["Executors"]


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


_NONES = (None,) * len(OPTIMIZER_GLOBALS)


def _globals(opt: torch.optim.Optimizer) -> tuple:
    """The optimizer-wide attributes, None where absent (read by ``map``: no Python frame per
    attribute, as this runs every step)."""
    return tuple(map(getattr, itertools.repeat(opt), OPTIMIZER_GLOBALS, _NONES))


class _Seen:
    """An optimizer as the last push read it: ``unchanged(opt)`` is the per-step test.

    True only when ``opt`` is that optimizer with the same group keys, the very same value
    objects (a value set anew, even an equal one, counts as a change), tensor values (an lr a
    scheduler updates in place) at the float they had, and equal optimizer-wide attributes.
    False sends the step to the full comparison of ``optimizer_hyperparameters`` snapshots.
    """

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self.keys = [tuple(g) for g in opt.param_groups]
        self.values = [v for g in opt.param_groups for v in g.values()]  # every group's, in turn
        self.tensors = [
            (v, float(v))
            for g in opt.param_groups
            for k, v in g.items()
            if k != "params" and isinstance(v, torch.Tensor)
        ]
        self.extras = _globals(opt)

    def unchanged(self, opt: torch.optim.Optimizer) -> bool:
        if opt is not self.opt:
            return False
        groups = opt.param_groups
        try:  # the same keys, so as many values: each the same object (``map``: no frames)
            if list(map(tuple, groups)) != self.keys or not all(
                map(
                    operator.is_,
                    itertools.chain.from_iterable(map(dict.values, groups)),
                    self.values,
                )
            ):
                return False
            for t, v in self.tensors:
                if float(t) != v:
                    return False
            return _globals(opt) == self.extras
        except (RuntimeError, TypeError, ValueError):  # an exotic value: compare in full
            return False


def _parameters(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The parameters ``named_parameters`` lists, in its order, read through ``__dict__``."""
    seen: set[int] = set()
    stack = [module]
    modules = []
    while stack:  # named_modules' order: depth first, each module once
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        modules.append(m)
        stack.extend(reversed([c for c in m.__dict__["_modules"].values() if c is not None]))
    params: set[int] = set()
    for m in modules:
        for p in m.__dict__["_parameters"].values():
            if p is not None and id(p) not in params:
                params.add(id(p))
                yield p


def _group_change(now: int, compiled: int) -> str:
    return (
        f"optimizer: it has {now} parameter group(s), and the training model was compiled with "
        f"{compiled}: the compiled model keeps the groups it was compiled with, so a group "
        "added during the fit (optimizer.add_param_group) would never train. Build the "
        "optimizer with every parameter group before the fit, giving a group that should not "
        "train yet lr=0.0, and raise its lr from a callback when it should (e.g. "
        "on_epoch_start: the new lr reaches the device before the next step)."
    )


class Executors:
    """The training model and the inference models (one per host-call shape) of one loop.

    One executor holds the device at a time (``activate`` detaches the others). The device
    never re-reads the host optimizer, so ``push_optimizer`` calls ``setOptimizer`` only when
    a hyper-parameter changed (``pushes`` counts those calls).
    """

    def __init__(
        self,
        poptorch: ModuleType,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        returns: Returns | None = None,
    ) -> None:
        self.poptorch = poptorch
        self.model = model
        self.optimizer = optimizer  # the host's: what callbacks and schedulers change
        # what the device runs: the optimizer itself, or a torch.optim one's poptorch.optim twin
        self.twin = optimizer_twin.make(poptorch, optimizer) if optimizer is not None else None
        self.device_optimizer = self.twin if self.twin is not None else optimizer
        self.returns = returns if returns is not None else Returns()  # where the loss is
        self.train: Executor | None = None
        self.micro: int | None = None  # the micro-batch size the training model is built for
        self.inference: dict[tuple, Executor] = {}
        self.pushes = 0
        self._pushed: dict | None = None  # the snapshot the device holds
        self._seen: _Seen | None = None  # what the last push looked at
        self._bound: dict[str, torch.Tensor] = {}  # the parameters the training model compiled
        self._mark: MarkLoss | None = None  # while a fit runs (``marking_loss``)

    @contextlib.contextmanager
    def marking_loss(self) -> Iterator[None]:
        """While a fit runs, the loss the model returns is the loss that trains (``MarkLoss``);
        ``WithLoss`` marks the loss it computes itself."""
        if isinstance(self.model, WithLoss):
            yield
            return
        self._mark = MarkLoss(self.returns)
        handle = self._mark.handle = self.model.register_forward_hook(self._mark)
        try:
            yield
        finally:
            handle.remove()
            self._mark = None

    @contextlib.contextmanager
    def inferring(self) -> Iterator[None]:
        """While an inference model runs inside a fit (validation), its returned loss is left
        as the model made it: only the training graph's loss is marked."""
        mark = self._mark
        if mark is None:
            yield
            return
        mark.active = False
        try:
            yield
        finally:
            mark.active = True

    def all(self) -> tuple:
        return (self.train, *self.inference.values())

    def training_model(self, opts: Options) -> Executor:
        """The training executor, built (not compiled) on first use."""
        if self.train is None:  # each module in the mode the user set: PopTorch traces them so
            self._follow()
            opt = self.device_optimizer
            with _plain_numbers(opt):
                self.train = self.poptorch.trainingModel(self.model, opts, optimizer=opt)
        return self.train

    def _follow(self) -> None:
        """The twin takes the host optimizer's hyper-parameters as they are now."""
        if self.twin is not None:
            optimizer_twin.follow(self.optimizer, self.twin)

    def read_optimizer_state(self) -> None:
        """A twin's state (as PopTorch last read it back) into the host optimizer, for its
        ``state_dict()``: after a fit, once the training model has detached."""
        if self.twin is not None and self.train is not None:
            optimizer_twin.read_state(self.optimizer, self.twin)

    def compile(
        self, executor: Executor, args: tuple, kwargs: dict, rng_state: torch.Tensor | None = None
    ) -> float:
        """Compile ``executor`` for the call ``(*args, **kwargs)``, then set its device
        random state to ``rng_state`` when given; returns the seconds it took."""
        start = time.perf_counter()
        self.activate(executor)
        if executor is self.train:
            self._follow()  # (a hook may have changed the host optimizer since it was built)
        executor.compile(*args, **kwargs)
        if executor is self.train:
            self._pushed = optimizer_hyperparameters(self.optimizer)
            self._seen = None
            self._bound = dict(self.model.named_parameters())  # (synced: none trained yet)
            if list(self._bound.values()) != list(_parameters(self.model)):
                self._bound = {}  # (an order the walk does not follow: unchecked, not refused)
        seconds = time.perf_counter() - start
        if rng_state is not None:
            executor.rng_state = rng_state
        return seconds

    def eval_mode(self) -> contextlib.AbstractContextManager[None]:
        """The model in eval mode while an inference executor is built and compiled (PopTorch's
        wrapper shares its submodules and traces them in the mode they are in), then each
        module back in the mode it had."""
        return eval_mode(self.model)

    def inference_model(self, key: tuple, opts: Options) -> Executor:
        """The inference executor for ``key`` (kind, samples per call, DI), built on first use.

        PopTorch's inference wrapper is a shallow copy that shares the submodules and traces
        them in the mode they are in: the caller keeps them in eval mode until it compiles.
        """
        model = self.inference.get(key)
        if model is None:
            model = self.inference[key] = self.poptorch.inferenceModel(self.model, opts)
        return model

    def push_host_weights(self) -> None:
        """Before a training step: weights the host read since the last step, and so may have
        written (a callback's weight surgery, a constraint, a head re-initialised), are copied
        to the device. PopTorch syncs the host on any read of a weight after a training call
        (``_dirty_host_weights`` is then False) and never reads the host's weights back on its
        own: without this copy the device would go on with its own and the fit's end would copy
        them over the edit. A detached training model uploads the host's when it attaches."""
        executor = self.train
        if executor is None:
            return
        self._check_bound()
        if not executor._dirty_host_weights and executor.isAttachedToDevice():
            executor.copyWeightsToDevice()

    def _check_bound(self) -> None:
        """Refuse a parameter the host replaced (rather than wrote in place) since compiling:
        the compiled graph and the optimizer hold the one they were given. Read through each
        module's ``__dict__``: reading the module would sync the device's weights."""
        if all(map(operator.is_, _parameters(self.model), self._bound.values())):
            return
        now = dict(zip(self._bound, _parameters(self.model)))
        for name, p in self._bound.items():
            if now.get(name) is not p:
                raise ValueError(
                    f"The model's parameter {name!r} is a new tensor since the training model "
                    "compiled (a module or parameter was replaced, by a callback or between "
                    "fits): the compiled graph and the optimizer hold the tensor they were "
                    "given, so the new one would never train. Write new values in place "
                    f"instead: `with torch.no_grad(): model.get_parameter({name!r}).copy_(new)` "
                    "(a head re-initialised: its reset_parameters())."
                )

    def compiled_for_other(self, micro: int) -> int | None:
        """The micro-batch size the compiled training model was built for, when a fit of
        micro-batches of ``micro`` cannot run it (``rewrap`` then); None, recording ``micro``,
        when it can (or none is compiled yet)."""
        was, train = self.micro, self.train
        if was in (None, micro) or train is None or not train.isCompiled():
            self.micro = micro
            return None
        return was

    def rewrap(self, micro: int) -> torch.Tensor:
        """For a fit of micro-batches of ``micro`` samples (``compiled_for_other``), destroy the
        compiled training model (PopTorch's ``destroy``: the weights and the optimizer state go
        to the host, the model is unwrapped); the next step wraps and compiles it again.
        Returns its device random state, for the next one to continue."""
        assert self.train is not None  # (compiled_for_other found it compiled)
        self.micro = micro
        rng = self.train.rng_state
        self.train.destroy()
        self.train = None
        self._pushed = self._seen = None
        return rng

    def rewrap_for(self, micro: int) -> torch.Tensor | None:
        """A fit of another micro-batch size than the compiled training model's: the model is
        wrapped and compiled again at the first step, with a warning (``rewrap``; returns the
        device's random state, for the next one to continue); refused, naming the fix, when
        the optimizer's state could not carry over (it lives on the device only). None: the
        compiled model runs the fit (or none is compiled yet)."""
        was = self.compiled_for_other(micro)
        if was is None:
            return None
        try:
            check_resumable(self.optimizer, self.poptorch)
        except ValueError as e:
            raise ValueError(
                f"train_loader: micro-batch size {micro}, but the training model was "
                f"compiled for {was}, and wrapping it again would restart the optimizer's "
                f"state. Pass a loader with batch_size={was}, or build the Loop with a "
                f"poptorch.optim optimizer, whose state the host holds. ({e})"
            ) from None
        rng = self.rewrap(micro)
        warnings.warn(
            f"train_loader: micro-batch size {micro}, and the training model was "
            f"compiled for {was}: it is wrapped and compiled again at the first step. "
            "The weights, the optimizer state and the device's random stream carry over.",
            stacklevel=4,
        )
        return rng

    def push_optimizer(self) -> None:
        """Before a training step: ``setOptimizer`` when a hyper-parameter changed."""
        opt = self.optimizer
        seen = self._seen  # the cheap test first, then the full comparison
        if seen is not None and seen.unchanged(opt):
            return
        current = optimizer_hyperparameters(opt)
        if current != self._pushed:
            assert self.train is not None  # (pushed before a training step)
            if self._pushed is not None and len(current["groups"]) != len(self._pushed["groups"]):
                raise ValueError(_group_change(len(current["groups"]), len(self._pushed["groups"])))
            self._follow()
            device = self.device_optimizer
            with _plain_numbers(device):
                self.train.setOptimizer(device)
            self.pushes += 1
            self._pushed = current
        self._seen = _Seen(opt)

    def activate(self, executor: Executor) -> None:
        """Detach every other executor before ``executor`` runs (one set of IPUs at a time)."""
        for other in self.all():
            if other is not None and other is not executor and other.isAttachedToDevice():
                other.detachFromDevice()

    @staticmethod
    def detach(executor: Executor | None, *, quiet: bool = False) -> None:
        """Detach ``executor`` (weights and optimizer state to the host) if it is attached;
        ``quiet``: while tearing down after an error, warn instead of raising."""
        if executor is None or not executor.isAttachedToDevice():
            return
        try:
            executor.detachFromDevice()
        except Exception as e:
            if not quiet:
                raise
            # tearing down after an error: that error is the one to report
            warnings.warn(
                f"Could not detach {type(executor).__name__} from the device: {e!r}", stacklevel=2
            )

    def detach_inference(self) -> None:
        """Before the host's weights change: an attached inference executor would go on
        running its own copy; detached, it uploads the host's when it next attaches."""
        for executor in self.inference.values():
            self.detach(executor)

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Load ``weights`` (a ``state_dict()`` of the model) into the model and the training
        executor (pushed to the device if attached); the inference executors upload them when
        they next attach."""
        self.detach_inference()
        (self.train if self.train is not None else self.model).load_state_dict(weights)

    def release(self) -> None:
        """After an error: every executor off the device, quietly."""
        for executor in self.all():
            self.detach(executor, quiet=True)
