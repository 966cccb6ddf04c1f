"""``trainingModel`` / ``inferenceModel``: PopTorch's executors, run on CPU (or CUDA).

One host call of a wrapped model runs what the IPU runs (docs/poptorch-semantics.md §2, §4):

    host batch of B*DI*GA*(RF/g) samples, split [DI, GA, RF/g, B]
    for d in range(DI):                      # one optimizer update per d (training)
        for a in range(GA):
            for r in range(RF):              # replica r reads input group r // g (or r % (RF/g))
                out = model(micro_batch[d, a, r])     # BatchNorm and the loss see B samples
                (loss * loss_scaling / (GA*RF if Mean else 1)).backward()
                # each forward sees plain attributes as traced (constants), and a weight given
                # replicaGrouping as r's group's slice, updated from that group's gradients
        optimizer.step(); optimizer.zero_grad()  # N processes: all-reduce first (distributed.py)
    return what the output mode anchors (All / Final / Sum / EveryN)

The "device" is a tensor per parameter and buffer (``device_state``), its own optimizer
(``optimizer_sync``) and RNG. A run swaps the device tensors into the user's own parameters and
buffers, so whatever the model reaches runs on them, and swaps the host's back afterwards: the
host module is stale after a training call until something reads it (``copyWeightsToHost``),
and host-side optimizer changes reach the device only through ``setOptimizer``, as on hardware.
Inputs become what the device gets in ``inputs``; outputs and anchored tensors come back
through ``anchors``. This module compiles (traces) and runs.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import time
from typing import Any, Callable, ClassVar

import torch
from torch.autograd.variable import Variable

from .. import rules
from ..mixed_float import MixedFloat
from . import _logging
from . import blocks as _blocks
from . import options as _options_mod
from .device import anchors as _anchors
from .device import checks as _checks
from .device import constants as _constants
from .device import group_norm as _group_norm
from .device import inputs as _inputs
from .device import loss_scaling as _loss_scaling
from .device import replica_groups as _replica_groups
from .device.anchors import Anchors
from .device.device_state import DeviceWeights, emulator_device, swap_rng, wrapped_class
from .device.latency import latency
from .device.optimizer_sync import OptimizerSync
from .device.signature import Signature
from .device.signature import unflatten as _unflatten
from .enums import ConnectionType, OutputMode, ReductionType
from .errors import Error
from .hardware_only import HardwareOnly

__all__ = ["PoplarExecutor", "trainingModel", "inferenceModel", "identity_loss", "isRunningOnIpu"]

logger = _logging.logger

_run_backward = Variable._execution_engine.run_backward
_NO_EXECUTABLE = "Model has not been compiled or has been destroyed."
_NO_CAPTURE = contextlib.nullcontext()
_running_on_ipu = False  # True while a wrapped model's forward runs "on the device"


def isRunningOnIpu() -> bool:
    """True while the emulated device runs a wrapped model's forward, as while PopTorch traces."""
    return _running_on_ipu


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark ``x`` as the graph's final loss; ``reduction`` is "sum", "mean" or "none"."""
    assert reduction in ("sum", "mean", "none"), (
        f'Unsupported reduction type! reduction must be "sum", "mean" or "none". Received: '
        f"reduction={reduction!r}."
    )
    out = IdentityLoss.apply(x, reduction)
    _checks.note_identity_loss(out)  # a loss of the graph being traced, if any
    return out


class IdentityLoss(torch.autograd.Function):
    """``identity_loss`` as an op of its own, as PopTorch's ``poptorch::identity_loss`` is: its
    result's autograd node (``IdentityLossBackward``) says the tensor is a loss."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, reduction: str) -> torch.Tensor:
        ctx.shape, ctx.reduction = x.shape, reduction
        return x.sum() if reduction == "sum" else x.mean() if reduction == "mean" else x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.reduction == "none":
            return grad, None
        n = 1 if ctx.reduction == "sum" else max(ctx.shape.numel(), 1)
        return (grad / n).expand(ctx.shape), None


class Executable:
    """What ``PoplarExecutor._executable`` holds while a model is compiled: on the emulator, the
    executor itself stands for its executable (traced, checked, weights on the device)."""

    __slots__ = ("executor",)

    def __init__(self, executor: PoplarExecutor) -> None:
        self.executor = executor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Executable) and other.executor is self.executor

    def __hash__(self) -> int:
        return id(self.executor)

    def __repr__(self) -> str:
        return f"<emulated PopTorch executable of {type(self.executor.model).__name__}>"


_clock = time.perf_counter


class PoplarExecutor(HardwareOnly):
    """A model wrapped by ``trainingModel`` or ``inferenceModel``."""

    # registerPreCompileHook / registerPostCompileHook: handle id -> hook, in registration order
    # (OrderedDicts: a RemovableHandle holds its dict by weak reference, which dict refuses)
    _precompile_hooks: ClassVar[dict[int, Callable[[], Any]]] = collections.OrderedDict()
    _postcompile_hooks: ClassVar[dict[int, Callable[[], Any]]] = collections.OrderedDict()

    def __init__(
        self,
        model: torch.nn.Module,
        options: Any,
        training: bool,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        from .options import Options

        options = Options() if options is None else options
        options._freeze()  # PopTorch freezes the user's object ...
        opts = options.clone()  # ... and works on a resolved copy
        if OutputMode(opts.output_mode) == OutputMode.Default:
            opts.outputMode(OutputMode.Final if training else OutputMode.All)
        self._options = opts
        self._offline = opts.connection_type == ConnectionType.Never
        self._consts: tuple | None = None  # what every call reads from the options (compile)
        self._training = training
        self._user_model = model
        self._device = emulator_device()
        self._on_cpu = self._device.type == "cpu"
        self._compiled = False
        self._attached = False
        # the last call's host-side timestamps: each device iteration's start, and when each
        # output the call returns was complete (getLatency)
        self._marks: tuple[list[float], list[float]] = ([], [])
        self._dirty_host_weights = False
        self._host_weights_version = 0  # bumped each time host weights are refreshed from device
        self._trained_version = 0  # bumped by each training call
        self._source: PoplarExecutor | None = None  # training executor an inference one follows
        self._source_version = -1
        self._signature: Signature | None = None
        self._compile_time = 0.0
        self._rng_state: torch.Tensor | None = None
        self._draws_random = True  # False once a trace drew no random numbers (``_trace``)
        # the function modes each call's ops run in (``_trace``): ``MixedFloat`` if an op mixed
        # float16 and float32 in the trace, ``StridedGroupNorm`` if the options ask for it
        self._op_modes: tuple = ()
        self._ready: list | None = None  # see ``_compile`` and ``inputs.as_ready``
        self._loss_capture: Any = _NO_CAPTURE  # see ``_trace``
        self._attributes: _constants.Constants | None = None  # plain attributes calls freeze
        self._anchors: Anchors | None = None  # Options.anchorTensor's (compile)
        self._opt: OptimizerSync | None = None  # a training model's optimizer
        # replicaGrouping settings by parameter name, and the grouped weights (compile)
        self._replica_grouping: dict[str, tuple] = {}
        self._grouped: _replica_groups.GroupedWeights | None = None

        # The device: a tensor per parameter and per buffer (``DeviceWeights``), uploaded on
        # attach. The IPU has no 64-bit floats: float64 weights live as float32 on the device.
        self._weights = DeviceWeights(self, model, self._device, wrap=training)
        if training:
            ex = model.__dict__.get("_poptorch_executor")
            if ex is not None:
                raise RuntimeError(
                    "Model has already been wrapped in 'poptorch.trainingModel'. "
                    "Call model.destroy() on the model to unwrap before "
                    "wrapping again."
                )
            self._opt = OptimizerSync(self, model, optimizer)
            model.__class__ = wrapped_class(type(model))
            model.__dict__["_poptorch_executor"] = self
            self._weights.bind(self._opt.params())
        else:
            self._source = model.__dict__.get("_poptorch_executor")
            self._weights.bind()
        opts._freeze()  # resolved: changing it now would desynchronise it from the executable

    # -- the user's module -------------------------------------------------------------------
    def _device_weights(self) -> dict[str, torch.Tensor]:
        """The device's parameters and buffers by their names in the module (no host sync)."""
        return self._weights.named()

    @property
    def _device_optimizer(self) -> torch.optim.Optimizer | None:
        """A training model's optimizer on the device (once compiled)."""
        return self._opt.device if self._opt is not None else None

    @property
    def _loss_scaling(self) -> float:
        """The factor each loss is multiplied by before its backward."""
        return self._opt.loss_scaling

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self._user_model, name)
        if isinstance(attr, torch.nn.Parameter):  # as PopTorch: it offers replicaGrouping()
            return _replica_groups.ReplicaGroupingWrapper(self, name, attr)
        return attr

    def __repr__(self) -> str:
        """The user's model as ``poptorch.module_repr`` shows it (PopTorch: its BeginBlocks)."""
        return _blocks.module_repr(self._user_model)

    def __reduce__(self) -> tuple:
        """An inference wrapper pickles as its model and options, wrapped anew when loaded (no
        executable is pickled); a training wrapper (it owns the model's class and parameters)
        does not."""
        if self._training:
            raise Error(
                "A poptorch.trainingModel cannot be pickled: save the module's "
                "state_dict() (and the optimizer's) with torch.save, and wrap it again "
                "after loading."
            )
        return (inferenceModel, (self._user_model, self._options))

    @property
    def model(self) -> torch.nn.Module:
        return self._user_model

    @property
    def options(self) -> Any:
        """The executor's own resolved (frozen) copy of the options."""
        return self._options

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> Any:
        """Load into the host module, and push to the device when attached."""
        result = self._user_model.load_state_dict(state_dict, strict)
        self._dirty_host_weights = False
        if self._attached:
            self.copyWeightsToDevice()
        return result

    @property
    def rng_state(self) -> torch.Tensor:
        """The device's random generator state (dropout and other random ops)."""
        if self._rng_state is None:
            self._rng_state = self._initial_rng_state()
        return self._rng_state.clone()

    @rng_state.setter
    def rng_state(self, state: torch.Tensor) -> None:
        self._rng_state = state.clone()

    def _initial_rng_state(self) -> torch.Tensor:
        o = self._options
        seed = o.random_seed if o.exists("random_seed") else torch.initial_seed()
        return torch.Generator().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF).get_state()

    # -- compile / attach --------------------------------------------------------------------
    def isCompiled(self) -> bool:
        return self._compiled

    @property
    def _executable(self) -> Executable | None:
        """The compiled executable: ``None`` until compiled and after ``destroy()`` (PopTorch's
        attribute, which libraries such as Lightning's IPU strategy read to know whether a
        model is compiled)."""
        return Executable(self) if self._compiled else None

    def isAttachedToDevice(self) -> bool:
        return self._compiled and self._attached

    def compilationTime(self) -> datetime.timedelta:
        """How long the last compilation took (on the emulator: tracing and checks)."""
        if not self._compiled:
            raise Error("Please compile the model before obtaining compilation time.")
        if not self._options._show_compilation_progress_bar:
            raise Error("Please set showCompilationProgressBar option to obtain compilation time.")
        return datetime.timedelta(seconds=self._compile_time)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile for these inputs without running (PopTorch: explicit AOT compilation)."""
        if self._compiled:
            logger.warning("Call to compile() ignored: the executable is already compiled")
            return
        self._compile(args, kwargs)

    def _factors(self) -> tuple[int, int, int, int]:
        """DI, GA (1 for inference), RF and the input groups RF // g of one host call."""
        o = self._options
        ga = o.Training.gradient_accumulation if self._training else 1
        rf = o.replication_factor
        return o.device_iterations, ga, rf, rules.input_groups(o)

    def _compile(self, args: tuple, kwargs: dict) -> None:
        start = time.perf_counter()
        o = self._options
        _checks.check_options(o)
        di, ga, rf, rfg = self._factors()
        if (self._training and ga < 1) or di < 1 or rf < 1:
            raise Error(
                f"deviceIterations, replicationFactor and gradientAccumulation must be "
                f">= 1. Received: {di}, {rf}, {ga}."
            )
        mode = OutputMode(o.output_mode)
        if mode == OutputMode.EveryN:
            rules.check_return_period(o.output_return_period, di, Error)
        _checks.check_updatable_buffers(o, self._user_model)
        # PopTorch traces the module as it is now: a layer, parameter or buffer replaced since
        # wrapping is what the device holds (and the optimizer's parameters what it trains).
        self._weights.bind(self._opt.params() if self._opt is not None else ())
        self._grouped = _replica_groups.resolve(
            self._replica_grouping,
            self._user_model,
            self._weights,
            o,
            self._opt.optimizer if self._opt is not None else None,
        )
        self._signature = Signature(self._user_model.forward, args, kwargs)
        leaves, spec = self._signature.flatten(args, kwargs), self._signature.spec
        prod = di * rfg * ga
        _inputs.check_batch(leaves, di, ga, rf, o.input_group_size)
        _inputs.warn_at_compile(leaves)
        if self._opt is not None:  # numProcesses > 1: join the others (distributed.py)
            self._opt.join(o, self._device, self._user_model, self._weights.host_params)
        self._consts = self._run_constants(di, ga, rf, rfg, mode)
        self._returned = frozenset(rules.returned_iterations(mode, di, self._consts[5]))
        # one micro-batch per call, and no replica's own weights: ``_run_single``
        self._single = di * ga * rf == 1 and self._grouped is None
        # inputs ``prepare`` leaves as they are: the ``as_ready`` shortcut
        self._ready = _inputs.ready_shapes(self._signature.fast, self._on_cpu)
        for hook in list(PoplarExecutor._precompile_hooks.values()):
            hook()
        self._compiled = True
        try:
            if o.connection_type != ConnectionType.Never:  # offline target: compile only
                self._attach()  # uploads weights, optimizer and RNG, as on hardware
            self._trace(leaves, spec, prod, di, ga, rf)
            _options_mod.log_compiled_options(o, self.num_ipus // rf)
            if o._show_compilation_progress_bar:
                _logging.show_compilation_progress(time.perf_counter() - start, self._device)
        except BaseException:
            # A failed compilation leaves no executable behind (PopTorch: isCompiled() False).
            self._compiled = self._attached = False
            self._signature = None
            if self._opt is not None:
                self._opt.device = None
            raise
        finally:  # as in PopTorch, post-compile hooks run whether or not compilation succeeded
            for hook in list(PoplarExecutor._postcompile_hooks.values()):
                hook()
        self._compile_time = time.perf_counter() - start

    def _trace(self, leaves: list[Any], spec: Any, prod: int, di: int, ga: int, rf: int) -> None:
        """Trace the first micro-batch: finds the loss, the blocks and the pipeline stages."""
        # Copies: the trace must not apply a forward's in-place edits of its inputs, which the
        # call that follows applies once, as the device run does.
        micro = [
            self._prepare(x)[: x.shape[0] // prod].clone()
            if isinstance(x, torch.Tensor) and x.dim()
            else self._prepare(x).clone()
            if isinstance(x, torch.Tensor)
            else x
            for x in leaves
        ]
        margs, mkwargs = _unflatten(micro, spec)
        weights = self._weights
        # PopTorch traces without running the graph on the device: a forward's in-place writes
        # to its weights and buffers (statistics, an EMA under no_grad) are undone
        kept = [*weights.dev_params, *weights.dev_buffers]
        saved = [t.detach().clone() for t in kept]
        # Random ops draw from the device generator, which the trace leaves as it found it; the
        # host generator is not touched (the device's RNG is its own).
        rng = self._rng_state if self._rng_state is not None else self._initial_rng_state()
        host_rng = self._swap_rng(rng)
        global _running_on_ipu
        strategy = self._options._execution_strategy
        # float16 and float32 operands in one op run as on an IPU; calls pay for it only if
        # the trace needed it (``__call__``).
        mixed = MixedFloat()
        strided = _group_norm.strided(self._options)
        # forward's Python runs once on an IPU: what the trace changes stays changed on the
        # host, and each call sees the attributes as the trace found them (``constants``).
        before = _constants.capture(self._user_model, [*weights.host_params, *weights.host_buffers])
        try:
            # the checks see the device's tensors in the user's module
            weights.swap_in(self._training)
            if self._grouped is not None:
                self._grouped.use(0)  # PopTorch traces a grouped weight's first slice
            checks = _checks.TraceChecks([self._user_model], micro, self._training)
            addresses = _checks.tensor_addresses(self._user_model)
            _running_on_ipu = True
            with _blocks.trace_stages(strategy) as trace, torch.set_grad_enabled(
                self._training
            ), mixed, _group_norm.StridedGroupNorm() if strided else _NO_CAPTURE, checks:
                out = self._user_model(*margs, **mkwargs)
            _checks.check_addresses(addresses, _checks.tensor_addresses(self._user_model))
        finally:
            if weights.swapped:
                weights.swap_out()
            _running_on_ipu = False
            with torch.no_grad():
                for t, s in zip(kept, saved):
                    t.copy_(s)
            traced_rng = self._swap_rng(host_rng)
        self._op_modes = tuple(
            m for m, on in ((MixedFloat, mixed.cast), (_group_norm.StridedGroupNorm, strided)) if on
        )
        self._attributes = _constants.settle(before)
        # PopTorch runs the traced graph: if the trace drew no random numbers, no call will, and
        # calls need not swap the device generator in and out (``__call__``).
        self._draws_random = not torch.equal(traced_rng, rng)
        _anchors.register_mappings(out)  # any dict of the outputs, as PopTorch takes dicts
        out_leaves, self._out_spec = _anchors.out_leaves(out)
        checks.check_overlap_outputs(out_leaves)
        self._tensor_out = [isinstance(t, torch.Tensor) for t in out_leaves]
        if self._training:
            self._loss_index, nth = checks.find_loss(out_leaves)
            # A final loss the outputs only use is taken from each forward as it runs.
            self._loss_capture = (
                _NO_CAPTURE if self._loss_index is not None else _checks.LossCapture(nth)
            )
            if _loss_scaling.settings(self._options) is not None:
                _loss_scaling.check_float16_gradients(checks.half_grads)
        _checks.check_replicated_updates(checks, self._options)
        self.num_ipus = _checks.check_stages(trace, self._options, self._training, di, ga, rf)
        if self._anchors is not None:
            self._anchors.remove()
        o = self._options
        mean = (
            ReductionType(o.Training.accumulation_and_replication_reduction_type)
            == ReductionType.Mean
        )
        self._anchors = _anchors.Anchors(
            o,
            self._training,
            self._weights,
            (di, ga, rf, mean),
            lambda: self._trained_version,
            self._opt.anchor_scalars() if self._training else {},
        )
        if self._grouped is not None and self._anchors.parameters() & self._grouped.indices:
            raise Error(
                "Options.anchorTensor names a weight given replicaGrouping(): the "
                "ipuloop emulator does not anchor grouped weights. Read the weight "
                "from the host model (copyWeightsToHost) instead."
            )

    def _attach(self) -> None:
        if self._options.connection_type == ConnectionType.Never:
            raise AssertionError(
                "Trying to attach to an offline device (ConnectionType.Never): "
                "a model for an offline IPU target can only be compiled."
            )
        self._attached = True
        if self._source is not None:
            self._source.copyWeightsToHostIfNeeded()
        self.copyWeightsToDevice()
        if self._training and (self._opt.device is None or self._opt.dirty):
            self._opt.upload(self._weights.host_params)
        if self._rng_state is None:
            self._rng_state = self._initial_rng_state()
        if self._source is not None:
            self._source_version = self._source._trained_version

    def attachToDevice(self) -> None:
        if not self._compiled:
            raise Error(_NO_EXECUTABLE)
        if self._attached:
            raise Error("Device is already attached")
        self._attach()

    def detachFromDevice(self) -> None:
        if not self._compiled:
            raise Error(_NO_EXECUTABLE)
        if not self._attached:
            raise Error("Device is not attached")
        if self._training:
            self.copyWeightsToHostIfNeeded()
            self._opt.download()
        self._attached = False

    def destroy(self) -> None:
        """Free the executable; a training wrapper also unwraps the user's module. A no-op
        before compilation (as in PopTorch: the module then stays wrapped)."""
        if not self._compiled:
            return
        unwrapped = False  # by poptorch._impl.unwrapModelIfNecessary
        if self._training and self._user_model.__dict__.get("_poptorch_executor") is self:
            self.copyWeightsToHostIfNeeded()
            self._opt.download()
            model = self._user_model
            base = type(model).__dict__.get("_poptorch_wrapped_base")
            unwrapped = base is None
            if base is not None:
                object.__setattr__(model, "__class__", base)
            del model.__dict__["_poptorch_executor"]
            self._weights.unwrap()
            self._opt.release()
        self._compiled = False
        self._attached = False
        self._marks = ([], [])
        self._signature = None
        if self._opt is not None:
            self._opt.device = None
        if unwrapped:  # as PopTorch: the executable is freed, then this
            raise Error("model was never wrapped")

    # -- weights -----------------------------------------------------------------------------
    def copyWeightsToDevice(self) -> None:
        """Push the host module's weights (and buffers, to every replica) to the device: the
        host's as they are, stale after training included (PopTorch clears its dirty flag
        first, so reading them does not sync the trained weights back)."""
        if not self._compiled:
            raise Error(_NO_EXECUTABLE)
        self._dirty_host_weights = False
        self._weights.to_device()

    def copyNamedBuffersToDevice(self) -> None:
        """Push only the buffers named in ``Options.updatableNamedBuffers`` to the device."""
        if not self._compiled:
            raise Error(_NO_EXECUTABLE)
        names = self._options._Popart.options.get("updatableNamedBuffers")
        if names is None:
            raise Error(
                "No named buffers marked as updatable via updatableNamedBuffers option. "
                "Call options.updatableNamedBuffers([...]) before wrapping the model."
            )
        known = [name for name, _ in self._user_model.named_buffers()]
        for name in names:
            if name not in known:
                raise Error(
                    f"updatableNamedBuffers names {name!r}, which is not a buffer of "
                    f"the model. Its buffers: {sorted(known)}."
                )
        self._weights.named_buffers_to_device(names)

    def copyWeightsToHost(self) -> None:
        """Read the device's weights back into the host module (replica 0's buffers)."""
        if not self._compiled:
            raise Error(_NO_EXECUTABLE)  # the device copy would overwrite host edits
        if not self._attached:  # PopTorch runs a program on a device it no longer holds
            raise Error(
                "copyWeightsToHost() on a model detached from its device: detaching "
                "already copied the weights to the host. Read them from the host "
                "module, or call attachToDevice() first."
            )
        self._dirty_host_weights = False
        self._weights.to_host()
        self._host_weights_version += 1

    def copyWeightsToHostIfNeeded(self) -> bool:
        if self._dirty_host_weights:
            self.copyWeightsToHost()
            return True
        return False

    # -- optimizer ---------------------------------------------------------------------------
    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Push the optimizer's hyper-parameters (and loaded state) to the device."""
        if not self._training:
            raise Error("setOptimizer() is only available on a poptorch.trainingModel.")
        self._opt.set(optimizer, self._weights.host_params)

    # -- running -----------------------------------------------------------------------------
    def _prepare(self, x: Any) -> Any:
        return _inputs.prepare(x, self._device, self._on_cpu)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._offline:
            raise AssertionError(
                "Trying to run a model on an offline device "
                "(ConnectionType.Never): use model.compile(inputs) instead of "
                "model(inputs)"
            )
        ready = None
        if not self._compiled:
            self._compile(args, kwargs)
            leaves = self._signature.flatten(args, kwargs)
        else:
            if self._ready is not None and not kwargs:
                ready = _inputs.as_ready(args, self._ready)
            if ready is None:
                leaves = self._signature.check(args, kwargs)
            if not self._attached:
                self._attach()  # a call re-attaches a detached model
        started = _clock()  # the first input requested, as PopTorch's timestamps start
        spec = self._signature.spec
        if self._training:
            if self._opt.dirty:
                self._opt.upload(self._weights.host_params)
        elif self._source is not None and self._source._trained_version != self._source_version:
            # PopTorch: an inference model made from the trained module re-uploads fresh weights.
            self._source.copyWeightsToHostIfNeeded()
            self.copyWeightsToDevice()
            self._source_version = self._source._trained_version
        edited = None  # inputs ``_prepare`` converted: the device's in-place edits come back
        if ready is not None:
            leaves = ready
        else:
            prepare = self._prepare
            given, leaves = leaves, [prepare(x) for x in leaves]
            edited = [
                (x, y, y._version)
                for x, y in zip(given, leaves)
                if isinstance(y, torch.Tensor) and y is not x
            ]
        single = self._single
        if not single:
            di, ga, rf, rfg = self._consts[:4]
            prod = di * ga * rfg
            chunks = (
                [
                    x.split(x.shape[0] // prod) if isinstance(x, torch.Tensor) else None
                    for x in leaves
                ]
                if prod > 1
                else [None] * len(leaves)
            )
        draws_random = self._draws_random
        if draws_random:
            host_rng = self._swap_rng(self._rng_state)
        global _running_on_ipu
        _running_on_ipu = True
        grad_was = torch.is_grad_enabled()  # torch.enable_grad() / no_grad(), minus their cost
        torch._C._set_grad_enabled(self._training)
        frozen, host_attributes = self._attributes, None
        try:
            buffers = self._weights.swap_in(self._training)
            if frozen is not None:
                host_attributes = frozen.enter()
            self._marks = ([started], [])
            if self._loss_capture is _NO_CAPTURE and not self._op_modes:  # no modes to enter
                out = (
                    self._run_single(leaves, spec)
                    if single
                    else self._run(leaves, chunks, spec, di, ga, rf, rfg, buffers)
                )
            else:
                with self._loss_capture, contextlib.ExitStack() as modes:
                    for mode in self._op_modes:
                        modes.enter_context(mode())
                    out = (
                        self._run_single(leaves, spec)
                        if single
                        else self._run(leaves, chunks, spec, di, ga, rf, rfg, buffers)
                    )
            if not self._marks[1]:  # the outputs come back once, at the end of the call
                self._marks[1].append(_clock())
            if self._training:
                self._dirty_host_weights = True
                self._trained_version += 1
            if edited:
                _inputs.write_back(edited)
        finally:
            if host_attributes is not None:
                frozen.exit(host_attributes)
            if self._weights.swapped:
                self._weights.swap_out()
            torch._C._set_grad_enabled(grad_was)
            _running_on_ipu = False
            if draws_random:
                self._rng_state = self._swap_rng(host_rng)
        return _checks.forbid_backward(out)

    def getLatency(self) -> tuple[float, float, float]:
        """The last call's round-trip latency in seconds (minimum, maximum, mean over its
        device iterations), as PopTorch 3.4 computes it from its timestamps: from the first
        input requested to the last output written back, here the host-side times the
        emulator starts each device iteration and has each returned output; (0, 0, 0) before
        the first run."""
        return latency(*self._marks)

    def _swap_rng(self, state: torch.Tensor) -> torch.Tensor:
        return swap_rng(state, self._device)

    def _run_constants(self, di: int, ga: int, rf: int, rfg: int, mode: OutputMode) -> tuple:
        o = self._options
        period = o.output_return_period if mode == OutputMode.EveryN else 1
        grouped = o.input_cgt == 2  # CommGroupType.Orthogonal
        mean = (
            ReductionType(o.Training.accumulation_and_replication_reduction_type)
            == ReductionType.Mean
        )
        return di, ga, rf, rfg, mode, period, grouped, o.input_group_size, mean

    def _run(
        self,
        leaves: list,
        chunks: list,
        spec: Any,
        di: int,
        ga: int,
        rf: int,
        rfg: int,
        buffers: list[torch.Tensor],
    ) -> Any:
        mode, _, grouped, g, mean = self._consts[4:]
        model = self._user_model
        training = self._training
        if training:
            step = self._opt.step
            scale = self._opt.loss_scaling / (ga * rf) if mean else self._opt.loss_scaling
        replica_buffers = self._weights.replica_sets(rf) if rf > 1 else None
        frozen = self._attributes  # each micro-batch starts from the attributes as traced
        per_group = self._grouped  # replicaGrouping: each replica's own slice of those weights
        refresh = frozen.refresh if frozen is not None and frozen.changing else None
        keep_all = mode in (OutputMode.All, OutputMode.EveryN)  # rows: one per micro-batch
        returned = self._returned  # of these device iterations
        is_sum = mode == OutputMode.Sum  # compared once, not per micro-batch
        kept: list[list[Any]] = []
        final: list[Any] = [None] * rf
        starts, ends = self._marks
        for d in range(di):
            anchored = keep_all and d in returned
            last_d = d == di - 1
            if d:
                starts.append(_clock())
            for a in range(ga):
                for r in range(rf):
                    slot = (d * ga + a) * rfg + ((r % rfg) if grouped else (r // g))
                    mb = [x if c is None else c[slot] for x, c in zip(leaves, chunks)]
                    margs, mkwargs = _unflatten(mb, spec)
                    if replica_buffers is not None:
                        for b, own in zip(buffers, replica_buffers[r]):
                            b.data = own
                    if refresh is not None:
                        refresh()
                    if per_group is not None:
                        per_group.use(r)
                    out = model(*margs, **mkwargs)
                    outs, _ = _anchors.out_leaves(out)
                    if training:
                        self._backward(outs, scale)
                        if per_group is not None:
                            per_group.collect(r)
                    outs = [t.detach() if isinstance(t, torch.Tensor) else t for t in outs]
                    if anchored:
                        kept.append(outs)
                    elif is_sum:
                        final[r] = (
                            outs
                            if final[r] is None
                            else [
                                s + t if isinstance(t, torch.Tensor) else t
                                for s, t in zip(final[r], outs)
                            ]
                        )
                    elif last_d and a == ga - 1:
                        final[r] = outs
            if training:
                if per_group is not None:
                    per_group.whole()
                step()  # the device iteration's gradients are complete: one update
                # the next one's loss scale (automatic loss scaling changes it each update)
                scale = self._opt.loss_scaling / (ga * rf) if mean else self._opt.loss_scaling
            if anchored:
                ends.append(_clock())  # this iteration's outputs are the host's
        rows = kept if keep_all else final
        return _anchors.assemble(rows, self._tensor_out, self._out_spec)

    def _backward(self, outs: list, scale: float) -> None:
        """Backward of one micro-batch's loss (an output leaf, or taken by ``_loss_capture``
        when the outputs only use it), scaled by ``scale``; none where the loss depends on no
        weight that requires grad."""
        index = self._loss_index
        loss = outs[index] if index is not None else self._loss_capture.take()
        als = self._opt.als
        if als is not None:  # automatic loss scaling counts this backward's float16 gradients
            als.track(loss)
        if loss.dim():
            loss = loss.sum()  # identity_loss(reduction="none")
        if scale != 1.0:
            loss = loss * scale
        if type(loss) is torch.Tensor and loss.grad_fn is not None:
            # loss.backward() without its Python layers: the engine, seeded as backward()
            # seeds it (a fresh seed: autograd may keep it as a gradient and add to it)
            _run_backward(
                (loss,),
                (torch.ones_like(loss),),
                False,
                False,
                (),
                allow_unreachable=True,
                accumulate_grad=True,
            )
        elif loss.requires_grad:
            loss.backward()
        # else the loss depends on no trained weight (frozen, or not used): as on an IPU, the
        # step has no gradients and leaves the weights as they are

    def _run_single(self, leaves: list, spec: Any) -> Any:
        """``_run`` for DI = GA = RF = 1, with its loops unrolled: the host batch is the one
        micro-batch, the loss scale is loss_scaling (Mean over 1), and every output mode
        returns that micro-batch's outputs."""
        if isinstance(spec, int):  # positional tensors
            out = self._user_model(*leaves)
        else:
            margs, mkwargs = _unflatten(leaves, spec)
            out = self._user_model(*margs, **mkwargs)
        outs, _ = _anchors.out_leaves(out)
        if self._training:
            self._backward(outs, self._opt.loss_scaling)
            self._opt.step()  # the call's gradients are complete: one update
        host = []  # _to_host(t.detach()) of each tensor; a loop, not a comprehension: per call
        for t in outs:
            if isinstance(t, torch.Tensor):
                t = t.detach()
                if t.dtype in _anchors.NARROWED or not t.is_cpu:
                    t = _anchors.to_host(t)
            host.append(t)
        return _anchors.out_unflatten(host, self._out_spec)

    # -- anchored tensors (Options.anchorTensor) ---------------------------------------------
    def getTensorNames(self) -> list[str]:
        """The tensor names ``Options.anchorTensor`` accepts on the emulator (needs a compile)."""
        assert self._compiled, "Model must be compiled before calling getTensorNames"
        return list(self._anchors.names())

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The value of the tensor anchored as ``short_name`` in the last call."""
        assert self._anchors is not None, "No tensor with name " + short_name + " found."
        return self._anchors.get(short_name)


def _register_hook(
    hooks: dict[int, Callable[[], Any]], hook: Callable[[], Any], what: str
) -> torch.utils.hooks.RemovableHandle:
    if not callable(hook):
        raise RuntimeError(f"{what} hook must be callable. Received: {hook!r}.")
    handle = torch.utils.hooks.RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def registerPreCompileHook(hook: Callable[[], Any]) -> torch.utils.hooks.RemovableHandle:
    """Call ``hook()`` before each model compilation; ``handle.remove()`` unregisters it."""
    return _register_hook(PoplarExecutor._precompile_hooks, hook, "Pre-compile")


def registerPostCompileHook(hook: Callable[[], Any]) -> torch.utils.hooks.RemovableHandle:
    """Call ``hook()`` after each model compilation, failed ones included."""
    return _register_hook(PoplarExecutor._postcompile_hooks, hook, "Post-compile")


def trainingModel(
    model: torch.nn.Module, options: Any = None, optimizer: torch.optim.Optimizer | None = None
) -> PoplarExecutor:
    """Wrap ``model`` for training: each call runs DI optimizer updates (see module doc)."""
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    return PoplarExecutor(model, options, training=True, optimizer=optimizer)


def inferenceModel(model: torch.nn.Module, options: Any = None) -> PoplarExecutor:
    """Wrap ``model`` for inference: each call runs DI x RF forward passes."""
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    if options is not None and options.Training.gradient_accumulation != 1:
        strategy = getattr(options, "_execution_strategy", None)
        pipelined = isinstance(strategy, _blocks.PipelinedExecution) and not isinstance(
            strategy, _blocks.ShardedExecution
        )
        raise Error(
            "You must set poptorch.Options().Training.gradientAccumulation to 1 or leave "
            "it as its default value (1) when running a poptorch.inferenceModel()."
            + (
                " Use poptorch.Options().deviceIterations to process a sufficient number "
                "of batches each run for pipelined execution instead."
                if pipelined
                else ""
            )
            + f" Received: gradientAccumulation={options.Training.gradient_accumulation}."
        )
    if options is not None and options._Popart.options.get("automaticLossScalingSettings.enabled"):
        # PopART refuses it for a session that does not train (Training options: "You must not
        # set these options for inference models")
        raise Error(
            "Automatic loss scaling is a training setting: an inferenceModel cannot use "
            "options with Training.setAutomaticLossScaling(True). Clone the options and "
            "call Training.setAutomaticLossScaling(False) for inference."
        )
    return PoplarExecutor(model, options, training=False)
