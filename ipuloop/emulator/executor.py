"""``trainingModel`` / ``inferenceModel``: PopTorch's executors, run on CPU (or CUDA).

One host call of a wrapped model runs what the IPU runs (poptorch-semantics §2, §4):

    host batch of B*DI*GA*(RF/g) samples, split [DI, GA, RF/g, B]
    for d in range(DI):                      # one optimizer update per d (training)
        for a in range(GA):
            for r in range(RF):              # replica r reads input group r // g (or r % (RF/g))
                out = model(micro_batch[d, a, r])     # BatchNorm and the loss see B samples
                (loss * loss_scaling / (GA*RF if Mean else 1)).backward()
        optimizer.step(); optimizer.zero_grad()  # N processes: all-reduce first (distributed.py)
    return what the output mode anchors (All / Final / Sum / EveryN)

The "device" is a tensor per parameter and buffer, its own optimizer and RNG. A run swaps the
device tensors into the user's own parameters and buffers, so whatever the model reaches runs
on them, and swaps the host's back afterwards: the host module is stale after a training call
until something reads it (``copyWeightsToHost``), and host-side optimizer changes reach the
device only through ``setOptimizer``, as on hardware.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import copyreg
import datetime
import functools
import logging
import os
import time
import warnings
import weakref
from typing import Any, Callable

import torch
from . import _pytree as pytree

from . import blocks as _blocks
from . import checks as _checks
from . import distributed as _distributed
from . import optim as _optim
from .enums import ConnectionType, MeanReductionStrategy, OutputMode, ReductionType
from .errors import Error
from .precision import MixedFloat
from .signature import Signature, unflatten as _unflatten
from ..backend import uses_ipu_model

__all__ = ["PoplarExecutor", "trainingModel", "inferenceModel", "identity_loss", "isRunningOnIpu"]

logger = logging.getLogger("poptorch")

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
        f'reduction={reduction!r}.')
    out = x.sum() if reduction == "sum" else x.mean() if reduction == "mean" else x * 1
    _checks.note_identity_loss(out)  # a loss of the graph being traced, if any
    return out


def _emulator_device() -> torch.device:
    name = os.environ.get("IPULOOP_EMULATOR_DEVICE", "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"IPULOOP_EMULATOR_DEVICE={name!r} asks for CUDA, but torch sees no CUDA "
                           "device. Unset it to emulate on the CPU.")
    return device


# ---------------------------------------------------------------------------------------------
# The host module: wrapped in place, as PopTorch does, so reading it syncs device weights back.

_SYNC_ON_READ = frozenset({"_parameters", "_buffers", "_modules", "forward", "state_dict",
                           "parameters", "named_parameters", "buffers", "named_buffers",
                           "modules", "named_modules", "children", "named_children"})
_wrapped_classes: dict[type, type] = {}


def _wrapped_class(cls: type) -> type:
    if cls not in _wrapped_classes:
        def __getattribute__(self, name):
            if name in _SYNC_ON_READ or not name.startswith("__"):
                d = object.__getattribute__(self, "__dict__")
                ex = d.get("_poptorch_executor")
                if ex is not None and ex._host_dirty and (
                        name in _SYNC_ON_READ or name in d["_modules"]
                        or name in d["_parameters"] or name in d["_buffers"]):
                    ex.copyWeightsToHost()
            return cls.__getattribute__(self, name)

        def __reduce_ex__(self, protocol):
            # Pickling or deep-copying the wrapped module gives the user's class, with fresh
            # weights and no executor, as PopTorch's registered wrapper types do.
            d = object.__getattribute__(self, "__dict__")
            ex = d.get("_poptorch_executor")
            if ex is not None:
                ex.copyWeightsToHostIfNeeded()
            state = {k: v for k, v in d.items() if k != "_poptorch_executor"}
            return copyreg._reconstructor, (cls, object, None), state  # no ipuloop reference

        def destroy(self):
            """Destroy the model: release the IPUs and the executable (and unwrap the model)."""
            ex = object.__getattribute__(self, "__dict__").get("_poptorch_executor")
            if ex is not None:
                ex.destroy()

        def copyWeightsToHostIfNeeded(self):
            """Whether the host weights were out of date (and have now been copied back)."""
            ex = object.__getattribute__(self, "__dict__").get("_poptorch_executor")
            return ex.copyWeightsToHostIfNeeded() if ex is not None else False

        # PopTorch's wrapper class exposes destroy() and copyWeightsToHostIfNeeded() too.
        _wrapped_classes[cls] = type(f"Poptorch{cls.__name__}", (cls,),
                                     {"__getattribute__": __getattribute__,
                                      "__reduce_ex__": __reduce_ex__,
                                      "destroy": destroy,
                                      "copyWeightsToHostIfNeeded": copyWeightsToHostIfNeeded,
                                      "_poptorch_wrapped_base": cls,
                                      "__module__": cls.__module__})
    return _wrapped_classes[cls]


def _host_parameter_class(ex: PoplarExecutor, base: type) -> type:
    """PopTorch's ``PoptorchParameter``: reading a host parameter (any attribute, or passing it
    to a torch function) first syncs the device's weights if a training call made them stale."""
    parent = weakref.ref(ex)

    class PoptorchParameter(base):
        _poptorch_base = base

        def __getattribute__(self, name):
            owner = parent()
            if owner is not None and owner._host_dirty:
                owner.copyWeightsToHost()
            return base.__getattribute__(self, name)

        def __deepcopy__(self, memo):
            result = base.__deepcopy__(self, memo)  # reads (and so syncs) the data first
            result.__class__ = base  # a copy is a plain parameter, not tied to the executor
            return result

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            # Defined so torch looks it up on the instance (running the hook above); results
            # are plain tensors, as for torch.nn.Parameter.
            return super().__torch_function__(func, types, args, kwargs or {})

    return PoptorchParameter


def _unwrap_parameters(params: list[torch.Tensor]) -> None:
    for p in params:
        base = getattr(type(p), "_poptorch_base", None)
        if base is not None:
            p.__class__ = base


def _device_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else dtype  # the IPU has no 64-bit floats


def _buffer_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str]]:
    """Where ``model``'s buffers live (module, name, full name): a buffer reassigned later is
    read from its slot."""
    return [(m, n, f"{prefix}.{n}" if prefix else n) for prefix, m in model.named_modules()
            for n, b in m.__dict__["_buffers"].items() if b is not None]


# ---------------------------------------------------------------------------------------------
# Inputs and outputs

def _out_leaves(out: Any) -> tuple[list[Any], Any]:
    if isinstance(out, torch.Tensor):
        return [out], None
    if type(out) is tuple:
        for o in out:
            if not isinstance(o, torch.Tensor):
                return pytree.tree_flatten(out)
        return list(out), len(out)
    return pytree.tree_flatten(out)


def _out_unflatten(leaves: list[Any], spec: Any) -> Any:
    if spec is None:
        return leaves[0]
    if isinstance(spec, int):
        return tuple(leaves)
    return pytree.tree_unflatten(leaves, spec)


_SENT_AS_FLOAT32 = frozenset({torch.float64, torch.bfloat16})  # inputs the IPU gets as float32
_NARROWED = frozenset({torch.int64, torch.float64})  # outputs ``_to_host`` narrows


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64:
        t = t.to(torch.int32)  # the IPU has no 64-bit types: outputs come back narrowed
    elif t.dtype == torch.float64:
        t = t.to(torch.float32)
    return t if t.is_cpu else t.cpu()


# ---------------------------------------------------------------------------------------------

class PoplarExecutor:
    """A model wrapped by ``trainingModel`` or ``inferenceModel``."""

    # registerPreCompileHook / registerPostCompileHook: handle id -> hook, in registration order
    # (OrderedDicts: a RemovableHandle holds its dict by weak reference, which dict refuses)
    _precompile_hooks: dict[int, Callable[[], Any]] = collections.OrderedDict()
    _postcompile_hooks: dict[int, Callable[[], Any]] = collections.OrderedDict()

    def __init__(self, model: torch.nn.Module, options: Any, training: bool,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
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
        self._device = _emulator_device()
        self._on_cpu = self._device.type == "cpu"
        self._compiled = False
        self._attached = False
        self._host_dirty = False
        self._host_weights_version = 0  # bumped each time host weights are refreshed from device
        self._trained_version = 0  # bumped by each training call
        self._source: PoplarExecutor | None = None  # training executor an inference one follows
        self._source_version = -1
        self._signature: Signature | None = None
        self._compile_time = 0.0
        self._rng_state: torch.Tensor | None = None
        self._draws_random = True  # False once a trace drew no random numbers (``_trace``)
        self._mixed = False  # an op mixed float16 and float32 in the trace: ``MixedFloat``
        self._ready: list | None = None  # see ``_compile`` and ``_as_ready``
        self._optimizer = optimizer
        self._device_optimizer: torch.optim.Optimizer | None = None
        self._optimizer_snapshot: dict | None = None
        self._optimizer_constants: set[str] = set()
        self._optimizer_dirty = False
        self._replica_buffers: list[list[torch.Tensor]] | None = None
        self._loss_capture: Any = _NO_CAPTURE  # see ``_trace``

        strategy = getattr(opts, "_execution_strategy", None)
        if strategy is not None and not getattr(strategy, "emulated", True):
            raise Error(f"{type(strategy).__name__} is not supported by the ipuloop emulator: "
                        "use poptorch.PipelinedExecution or poptorch.ShardedExecution.")
        # The device: a tensor per parameter and per buffer, swapped into the user's own
        # tensors for a run (``_swap_in``), so that whatever the model reaches (submodules,
        # closures, globals) runs on the device's values. Values are uploaded on attach.
        self._buffer_slots = _buffer_slots(model)
        named = list(model.named_parameters())
        self._param_names = [name for name, _ in named]
        params = [p for _, p in named]
        if training:
            ex = model.__dict__.get("_poptorch_executor")
            if ex is not None:
                raise RuntimeError("Model has already been wrapped in 'poptorch.trainingModel'. "
                                   "Call model.destroy() on the model to unwrap before "
                                   "wrapping again.")
            if self._optimizer is None:
                self._optimizer = _optim.default_optimizer(model.parameters())
            _optim.check_supported(self._optimizer)
            self._attribute_tracker = _optim.AttributeTracker(opts._relax_optimizer_checks)
            self._attribute_tracker.check(self._optimizer)
            self._set_reduction_strategy(self._optimizer)
            known = {id(p) for p in params}
            for group in self._optimizer.param_groups:  # trained wherever the model reaches them
                for p in group["params"]:
                    if id(p) not in known:
                        known.add(id(p))
                        params.append(p)
            self._host_params = params
            self._patch_optimizer(self._optimizer)
            classes: dict[type, type] = {}
            for p in self._host_params:
                base = type(p)
                if base not in classes:
                    classes[base] = _host_parameter_class(self, base)
                p.__class__ = classes[base]
            model.__class__ = _wrapped_class(type(model))
            model.__dict__["_poptorch_executor"] = self
        else:
            self._source = model.__dict__.get("_poptorch_executor")
            self._host_params = params
        # The IPU has no 64-bit floats: float64 weights live as float32 on the device.
        self._dev_params = [self._device_tensor(p) for p in self._host_params]
        self._dev_buffers = [self._device_tensor(b) for b in self._host_buffers]
        self._swapped: list = []  # what ``_swap_in`` took out of the user's tensors
        opts._freeze()  # resolved: changing it now would desynchronise it from the executable

    # -- the user's module -------------------------------------------------------------------
    def _device_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self._device, _device_dtype(t.dtype), copy=True)

    @property
    def _host_buffers(self) -> list[torch.Tensor]:
        # Read through ``__dict__``: no sync from the device (as PopTorch's copies avoid one).
        return [m.__dict__["_buffers"][n] for m, n, _ in self._buffer_slots]

    def _device_weights(self) -> dict[str, torch.Tensor]:
        """The device's parameters and buffers by their names in the module (no host sync)."""
        names = [*self._param_names, *(name for _, _, name in self._buffer_slots)]
        return dict(zip(names, self._dev_params + self._dev_buffers))

    def _swap_in(self) -> list[torch.Tensor]:
        """Give the user's module, parameters and buffers the device's storage for a run;
        returns the buffer tensors (a replica swaps its own statistics into them)."""
        buffers = self._host_buffers  # first: nothing is swapped if this raises
        model = self._user_model
        cls = type(model)
        base = cls.__dict__.get("_poptorch_wrapped_base")
        if base is not None:  # no sync hooks while the device runs (Module.__setattr__ skipped)
            object.__setattr__(model, "__class__", base)
        flags = None
        if model.training != self._training:
            flags = [(m, m.training) for m in model.modules()]
            model.train(self._training)
        params = []
        for p, d in zip(self._host_params, self._dev_params):
            pcls = type(p)
            pbase = pcls.__dict__.get("_poptorch_base")
            if pbase is not None:
                p.__class__ = pbase
            params.append((p, pcls, p.data, p.grad))
            p.grad = None
            p.data = d
        saved = [b.data for b in buffers]
        for b, d in zip(buffers, self._dev_buffers):
            b.data = d
        self._swapped = [cls, flags, params, buffers, saved]
        return buffers

    def _swap_out(self) -> None:
        """Undo ``_swap_in``: the user's tensors hold the host's values again."""
        cls, flags, params, buffers, saved = self._swapped
        self._swapped = []
        for b, data in zip(buffers, saved):
            b.data = data
        for p, pcls, data, grad in params:
            p.data = data
            p.grad = grad
            p.__class__ = pcls
        model = self._user_model
        if flags is not None:
            for m, flag in flags:
                m.training = flag
        object.__setattr__(model, "__class__", cls)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._user_model, name)

    def __repr__(self) -> str:
        kind = "trainingModel" if self._training else "inferenceModel"
        return f"poptorch.{kind}({self._user_model!r})"

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
        self._host_dirty = False
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

    def isAttachedToDevice(self) -> bool:
        return self._compiled and self._attached

    def compilationTime(self) -> datetime.timedelta:
        """How long the last compilation took (on the emulator: tracing and checks)."""
        if not self._compiled:
            raise Error("Please compile the model before obtaining compilation time.")
        if not self._options._show_compilation_progress_bar:
            raise Error("Please set showCompilationProgressBar option to obtain compilation "
                        "time.")
        return datetime.timedelta(seconds=self._compile_time)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile for these inputs without running (PopTorch: explicit AOT compilation)."""
        if self._compiled:
            logger.warning("Call to compile() ignored: the model has already been compiled.")
            warnings.warn("the model has already been compiled; compile() ignored", stacklevel=2)
            return
        self._compile(args, kwargs)

    def _factors(self) -> tuple[int, int, int, int]:
        o = self._options
        ga = o.Training.gradient_accumulation if self._training else 1
        rf = o.replication_factor
        return o.device_iterations, ga, rf, max(rf // o.input_group_size, 1)

    def _compile(self, args: tuple, kwargs: dict) -> None:
        start = time.perf_counter()
        o = self._options
        _checks.check_options(o)
        di, ga, rf, rfg = self._factors()
        if self._training and ga < 1 or di < 1 or rf < 1:
            raise Error(f"deviceIterations, replicationFactor and gradientAccumulation must be "
                        f">= 1. Received: {di}, {rf}, {ga}.")
        mode = OutputMode(o.output_mode)
        if mode == OutputMode.EveryN:
            n = o.output_return_period
            if n < 1 or n > di or di % n:
                raise Error(f"Return period must be a factor of the number of batches per step: "
                            f"outputMode(EveryN, {n}) with deviceIterations({di}). Choose a "
                            "period that divides deviceIterations.")
        unknown = sorted(set(o._Popart.options.get("updatableNamedBuffers", ())) -
                         {name for name, _ in self._user_model.named_buffers()})
        if unknown:
            raise Error(f"Options.updatableNamedBuffers names {unknown}, which are not buffers of "
                        "the model: use names from model.named_buffers().")
        self._signature = Signature(self._user_model.forward, args, kwargs)
        leaves, spec = self._signature.flatten(args, kwargs), self._signature.spec
        prod = di * rfg * ga
        for x in leaves:
            if isinstance(x, torch.Tensor):
                n = x.shape[0] if x.dim() else 1
                assert n % prod == 0, (
                    f"Invalid batch dimension: In the input {x.shape}, the batch dimension "
                    f"({n}) must be a multiple of Options.deviceIterations({di}) * "
                    f"(Options.replicationFactor({rf}) / "
                    f"Options.inputReplicaGrouping.input_group_size({o.input_group_size})) * "
                    f"Options.Training.gradientAccumulation({ga}) = {prod} because it is used to "
                    "calculate the batch size which will be executed on the device in any given "
                    "iteration. For a full explanation see the batching semantics page of the "
                    "documentation.")
        # Distributed.numProcesses > 1: join the other instances, check they agree (distributed.py)
        self._dist = _distributed.join(o, self._device, self._optimizer if self._training else None,
                                       self._user_model, self._host_params)
        self._consts = self._run_constants(di, ga, rf, rfg, mode)
        self._single = di * ga * rf == 1  # one micro-batch per call: ``_run_single``
        fast = self._signature.fast  # inputs that ``_prepare`` leaves as they are: ``_as_ready``
        self._ready = fast if fast is not None and self._on_cpu and not any(
            dtype in _SENT_AS_FLOAT32 for _, dtype in fast) else None
        for hook in list(PoplarExecutor._precompile_hooks.values()):
            hook()
        self._compiled = True
        try:
            if o.connection_type != ConnectionType.Never:  # offline target: compile only
                self._attach()  # uploads weights, optimizer and RNG, as on hardware
            self._trace(leaves, spec, prod, di, ga, rf)
        except BaseException:
            # A failed compilation leaves no executable behind (PopTorch: isCompiled() False).
            self._compiled = self._attached = False
            self._signature = self._device_optimizer = None
            raise
        finally:  # as in PopTorch, post-compile hooks run whether or not compilation succeeded
            for hook in list(PoplarExecutor._postcompile_hooks.values()):
                hook()
        self._compile_time = time.perf_counter() - start

    def _trace(self, leaves: list[Any], spec: Any, prod: int, di: int, ga: int, rf: int) -> None:
        """Trace the first micro-batch: finds the loss, the blocks and the pipeline stages."""
        # Copies: the trace must not apply a forward's in-place edits of its inputs, which the
        # call that follows applies once, as the device run does.
        micro = [self._prepare(x)[:x.shape[0] // prod].clone() if isinstance(x, torch.Tensor)
                 and x.dim() else self._prepare(x).clone() if isinstance(x, torch.Tensor) else x
                 for x in leaves]
        margs, mkwargs = _unflatten(micro, spec)
        saved = [b.clone() for b in self._dev_buffers]
        # Random ops draw from the device generator, which the trace leaves as it found it; the
        # host generator is not touched (the device's RNG is its own).
        rng = self._rng_state if self._rng_state is not None else self._initial_rng_state()
        host_rng = self._swap_rng(rng)
        global _running_on_ipu
        strategy = self._options._execution_strategy
        # float16 and float32 operands in one op run as on an IPU; calls pay for it only if
        # the trace needed it (``__call__``).
        mixed = MixedFloat()
        try:
            self._swap_in()  # the checks see the device's tensors in the user's module
            checks = _checks.TraceChecks([self._user_model], micro, self._training)
            addresses = _checks.tensor_addresses(self._user_model)
            _running_on_ipu = True
            with _blocks.trace_stages(strategy) as trace, torch.set_grad_enabled(self._training), \
                    mixed, checks:
                out = self._user_model(*margs, **mkwargs)
            _checks.check_addresses(addresses, _checks.tensor_addresses(self._user_model))
        finally:
            if self._swapped:
                self._swap_out()
            _running_on_ipu = False
            with torch.no_grad():
                for b, s in zip(self._dev_buffers, saved):
                    b.copy_(s)
            traced_rng = self._swap_rng(host_rng)
        self._mixed = mixed.cast
        # PopTorch runs the traced graph: if the trace drew no random numbers, no call will, and
        # calls need not swap the device generator in and out (``__call__``).
        self._draws_random = not torch.equal(traced_rng, rng)
        out_leaves, self._out_spec = _out_leaves(out)
        self._tensor_out = [isinstance(t, torch.Tensor) for t in out_leaves]
        if self._training:
            self._loss_index, nth = checks.find_loss(out_leaves)
            # A final loss the outputs only use is taken from each forward as it runs.
            self._loss_capture = _NO_CAPTURE if self._loss_index is not None else \
                _checks.LossCapture(nth)
        _checks.check_replicated_updates(checks, self._options)
        self._check_stages(trace, di, ga, rf)
        self._setup_anchors()

    def _check_stages(self, trace: Any, di: int, ga: int, rf: int) -> None:
        f = trace.num_forward_stages
        if trace.is_pipelined and f > 1:
            if self._training and ga < 2 * f - 1:
                raise Error(
                    "poptorch.Options().Training.gradientAccumulation must be greater than or "
                    f"equal to the number of pipeline stages ({2 * f - 1}) when using "
                    f"poptorch.PipelinedExecution. Please note that a model with {f} pipeline "
                    f"stages in PopTorch will have an additional {f - 1} stages when training. "
                    f"Received: gradientAccumulation={ga}.")
            if not self._training and di < f:
                raise Error(
                    "poptorch.Options().deviceIterations must be greater than or equal to the "
                    f"number of pipeline stages ({f}) when using poptorch.PipelinedExecution. "
                    f"Received: deviceIterations={di}.")
        ipus = trace.ipus or {0}
        per_replica = max(len(ipus), max(ipus) + 1)
        n = per_replica * rf
        o = self._options
        use_model = uses_ipu_model(o)
        if not use_model and n & (n - 1):
            rounded = 1 << (n - 1).bit_length()
            if not o.auto_round_num_ipus:
                raise Error(f"The model needs {per_replica} IPU(s) per replica x "
                            f"replicationFactor({rf}) = {n} IPUs, but you must reserve a power "
                            "of 2 or maximum of 64 IPUs per process. Set "
                            "poptorch.Options().autoRoundNumIPUs(True) to reserve "
                            f"{rounded} IPUs.")
            logger.warning("Reserving %d IPUs instead of %d (autoRoundNumIPUs).", rounded, n)
        if n > 64 and not use_model:
            raise Error(f"The model needs {n} IPUs: a process can reserve at most 64.")
        self.num_ipus = n

    def _attach(self) -> None:
        if self._options.connection_type == ConnectionType.Never:
            raise AssertionError("Trying to attach to an offline device (ConnectionType.Never): "
                                 "a model for an offline IPU target can only be compiled.")
        self._attached = True
        if self._source is not None:
            self._source.copyWeightsToHostIfNeeded()
        self.copyWeightsToDevice()
        if self._training and (self._device_optimizer is None or self._optimizer_dirty):
            self._upload_optimizer(self._optimizer)
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
            self._download_optimizer()
        self._attached = False

    def destroy(self) -> None:
        """Free the executable; a training wrapper also unwraps the user's module. A no-op
        before compilation (as in PopTorch: the module then stays wrapped)."""
        if not self._compiled:
            return
        if self._training and self._user_model.__dict__.get("_poptorch_executor") is self:
            self.copyWeightsToHostIfNeeded()
            self._download_optimizer()
            model = self._user_model
            model.__class__ = type(model).__mro__[1]
            del model.__dict__["_poptorch_executor"]
            _unwrap_parameters(self._host_params)
            self._unpatch_optimizer(self._optimizer)
        self._compiled = False
        self._attached = False
        self._signature = None
        self._device_optimizer = None

    # -- weights -----------------------------------------------------------------------------
    def copyWeightsToDevice(self) -> None:
        """Push the host module's weights (and buffers, to every replica) to the device."""
        if not self._compiled:
            raise Error(_NO_EXECUTABLE)
        with torch.no_grad():
            for d, h in zip(self._dev_params, self._host_params):
                d.copy_(h)
            for i, (d, h) in enumerate(zip(self._dev_buffers, self._host_buffers)):
                if d.shape == h.shape and d.dtype == _device_dtype(h.dtype):
                    d.copy_(h)
                else:  # a buffer the host reassigned with another shape or dtype
                    self._dev_buffers[i] = self._device_tensor(h)
        self._replica_buffers = None

    def copyNamedBuffersToDevice(self) -> None:
        """Push only the buffers named in ``Options.updatableNamedBuffers`` to the device."""
        if not self._compiled:
            raise Error(_NO_EXECUTABLE)
        names = self._options._Popart.options.get("updatableNamedBuffers")
        if names is None:
            raise Error("No named buffers marked as updatable via updatableNamedBuffers option. "
                        "Call options.updatableNamedBuffers([...]) before wrapping the model.")
        index = {name: i for i, (name, _) in enumerate(self._user_model.named_buffers())}
        replicas = self._replica_buffers or []
        with torch.no_grad():
            for name in names:
                if name not in index:
                    raise Error(f"updatableNamedBuffers names {name!r}, which is not a buffer of "
                                f"the model. Its buffers: {sorted(index)}.")
                dev = self._dev_buffers[index[name]]
                dev.copy_(self._host_buffers[index[name]])
                if replicas:  # every replica's copy of the buffer gets the host's value
                    j = next(j for j, b in enumerate(replicas[0]) if b is dev)
                    for own in replicas[1:]:
                        own[j].copy_(dev)

    def copyWeightsToHost(self) -> None:
        """Read the device's weights back into the host module (replica 0's buffers)."""
        if not self._compiled:
            raise Error(_NO_EXECUTABLE)  # the device copy would overwrite host edits
        if not self._attached:  # PopTorch runs a program on a device it no longer holds
            raise Error("copyWeightsToHost() on a model detached from its device: detaching "
                        "already copied the weights to the host. Read them from the host "
                        "module, or call attachToDevice() first.")
        self._host_dirty = False
        with torch.no_grad():
            for h, d in zip(self._host_params + self._host_buffers,
                            self._dev_params + self._dev_buffers):
                h.copy_(d)
        self._host_weights_version += 1

    def copyWeightsToHostIfNeeded(self) -> bool:
        if self._host_dirty:
            self.copyWeightsToHost()
            return True
        return False

    # -- optimizer ---------------------------------------------------------------------------
    def _patch_optimizer(self, opt: torch.optim.Optimizer) -> None:
        # PopTorch rebinds state_dict()/load_state_dict() so they read and write the IPU's state,
        # for poptorch.optim optimizers only: a torch.optim one's state stays on the device.
        if not isinstance(opt, _optim.Optimizer):
            return
        cls_state_dict, cls_load = type(opt).state_dict, type(opt).load_state_dict

        def state_dict():
            if self._device_optimizer is not None and self._attached:
                return self._device_state_dict()
            return cls_state_dict(opt)

        def load_state_dict(sd):
            cls_load(opt, sd)
            self._optimizer_dirty = True

        opt.state_dict, opt.load_state_dict = state_dict, load_state_dict

    @staticmethod
    def _unpatch_optimizer(opt: torch.optim.Optimizer) -> None:
        opt.__dict__.pop("state_dict", None)
        opt.__dict__.pop("load_state_dict", None)

    def _upload_optimizer(self, opt: torch.optim.Optimizer) -> None:
        memo = {id(h): h for h in self._host_params}  # runs on them, swapped in
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in memo:
                    raise ValueError("The optimizer holds a parameter that the optimizer given "
                                     "when wrapping did not hold and the model does not have: "
                                     "wrap the model again with this optimizer.")
        patched = {k: opt.__dict__.pop(k) for k in ("state_dict", "load_state_dict")
                   if k in opt.__dict__}
        try:
            dev = copy.deepcopy(opt, memo)
        finally:
            opt.__dict__.update(patched)
        # Instance-level wrappers (an LR scheduler's step counter) would call the host optimizer.
        for name in ("step", "zero_grad", "_opt_called"):
            dev.__dict__.pop(name, None)
        if not isinstance(dev, _optim.Optimizer) and _optim.has_16bit_params(dev):
            dev.step = _optim.float32_step(dev)  # as poptorch.optim's own step does
        if self._dist is not None:  # each update first all-reduces across the instances
            self._dist.wrap(dev)
        self._device_optimizer = dev
        self._optimizer_snapshot = _optim.hyperparameters(opt)
        self._optimizer_constants = _optim.constant_attributes(opt)
        self._loss_scaling = _optim.loss_scaling(opt)
        self._optimizer_dirty = False

    def _device_state_dict(self) -> dict:
        # The device's state (moments, step counts) with the host's hyper-parameters: as in
        # PopTorch, reading the state back must not undo host LR scheduling.
        sd = self._device_optimizer.state_dict()
        sd["param_groups"] = type(self._optimizer).state_dict(self._optimizer)["param_groups"]
        return sd

    def _download_optimizer(self) -> None:
        if self._device_optimizer is not None and isinstance(self._optimizer, _optim.Optimizer):
            type(self._optimizer).load_state_dict(self._optimizer, self._device_state_dict())

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Push the optimizer's hyper-parameters (and loaded state) to the device."""
        if not self._training:
            raise Error("setOptimizer() is only available on a poptorch.trainingModel.")
        _optim.check_supported(optimizer)
        self._attribute_tracker.check(optimizer)
        self._set_reduction_strategy(optimizer)
        if optimizer is not self._optimizer:
            self._unpatch_optimizer(self._optimizer)
            self._optimizer = optimizer
            self._patch_optimizer(optimizer)
            if optimizer.state and isinstance(optimizer, _optim.Optimizer):
                # only a poptorch.optim optimizer carrying state resets the device's
                self._optimizer_dirty = True
        if self._device_optimizer is None:
            return  # not compiled yet: used as is at compile time
        new = _optim.hyperparameters(optimizer)
        changed = _optim.changed_constants(self._optimizer_snapshot, new, self._optimizer_constants)
        if changed:
            raise ValueError(f"Optimizer attribute(s) {changed} are constant in the compiled "
                             "graph and cannot change: pass them explicitly to the optimizer's "
                             "constructor to make them variable, or re-wrap the model.")
        if self._optimizer_dirty:
            self._upload_optimizer(optimizer)
        else:
            _optim.apply_hyperparameters(self._device_optimizer, new)
            self._optimizer_snapshot = new
            self._loss_scaling = _optim.loss_scaling(optimizer)

    def _set_reduction_strategy(self, optimizer: torch.optim.Optimizer) -> None:
        # PopTorch: a float16 accumulator (non-combined) needs the Running mean strategy; it is
        # switched before compilation and cannot be switched after. Numerics here are exact
        # means either way: only the option and the error are reproduced.
        if not _optim.needs_running_mean(optimizer):
            return
        training = self._options.Training
        if not self._compiled:
            self._options._unfreeze()
            training.setMeanAccumulationAndReplicationReductionStrategy(
                MeanReductionStrategy.Running)
            self._options._freeze()
        elif training.meanAccumulationAndReplicationReductionStrategy != \
                MeanReductionStrategy.Running:
            raise ValueError("Invalid optimizer: the new optimizer would require changing "
                             "options.Training.meanAccumulationAndReplicationReductionStrategy to "
                             "poptorch.MeanReductionStrategy.Running but the executable is "
                             "already compiled.")

    # -- running -----------------------------------------------------------------------------
    _warned: set[str] = set()

    def _prepare(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.requires_grad:
            if "grad" not in self._warned:
                self._warned.add("grad")
                logger.warning("Input tensor has requires_grad=True set. This tensor will be "
                               "detached.")
            x = x.detach()
        if x.dtype in _SENT_AS_FLOAT32:
            x = x.float()  # sent to the IPU as float32
        if not x.is_contiguous():
            if "contig" not in self._warned:
                self._warned.add("contig")
                logger.warning("At least one input tensor is not contiguous: non-contiguous "
                               "tensors will be converted.")
            x = x.contiguous()
        if x.is_cpu if self._on_cpu else x.device == self._device:
            return x
        return x.to(self._device, non_blocking=True)

    def _as_ready(self, args: tuple) -> list | None:
        """``args`` as they are, when they are what the model compiled for and ``_prepare``
        would leave them as they are: plain tensors of the compiled shapes and dtypes (none it
        converts), contiguous, not requiring grad, on the CPU. Else None: the general path
        (``Signature.check``, then ``_prepare``) checks, converts and raises."""
        ready = self._ready
        if len(args) != len(ready):
            return None
        for x, (shape, dtype) in zip(args, ready):
            if not (type(x) is torch.Tensor and x.dtype == dtype and x.shape == shape
                    and x.is_cpu and not x.requires_grad and x.is_contiguous()):
                return None
        return list(args)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._offline:
            raise AssertionError("Trying to run a model on an offline device "
                                 "(ConnectionType.Never): use model.compile(inputs) instead of "
                                 "model(inputs)")
        ready = None
        if not self._compiled:
            self._compile(args, kwargs)
            leaves = self._signature.flatten(args, kwargs)
        else:
            if self._ready is not None and not kwargs:
                ready = self._as_ready(args)
            if ready is None:
                leaves = self._signature.check(args, kwargs)
            if not self._attached:
                self._attach()  # a call re-attaches a detached model
        spec = self._signature.spec
        if self._training:
            if self._optimizer_dirty:
                self._upload_optimizer(self._optimizer)
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
            edited = [(x, y, y._version) for x, y in zip(given, leaves)
                      if isinstance(y, torch.Tensor) and y is not x]
        single = self._single
        if not single:
            di, ga, rf, rfg = self._consts[:4]
            prod = di * ga * rfg
            chunks = [x.split(x.shape[0] // prod) if isinstance(x, torch.Tensor) else None
                      for x in leaves] if prod > 1 else [None] * len(leaves)
        draws_random = self._draws_random
        if draws_random:
            host_rng = self._swap_rng(self._rng_state)
        global _running_on_ipu
        _running_on_ipu = True
        grad_was = torch.is_grad_enabled()  # torch.enable_grad() / no_grad(), minus their cost
        torch._C._set_grad_enabled(self._training)
        try:
            buffers = self._swap_in()
            with self._loss_capture, (MixedFloat() if self._mixed else _NO_CAPTURE):
                out = self._run_single(leaves, spec) if single else \
                    self._run(leaves, chunks, spec, di, ga, rf, rfg, buffers)
            if self._training:
                self._host_dirty = True
                self._trained_version += 1
            if edited:
                with torch.no_grad():
                    for x, y, version in edited:
                        if y._version != version:
                            x.copy_(y)
        finally:
            if self._swapped:
                self._swap_out()
            torch._C._set_grad_enabled(grad_was)
            _running_on_ipu = False
            if draws_random:
                self._rng_state = self._swap_rng(host_rng)
        return _checks.forbid_backward(out)

    def _swap_rng(self, state: torch.Tensor) -> torch.Tensor:
        """Install ``state`` as the generator the device's random ops use; return the old one."""
        if not self._on_cpu:
            old = torch.cuda.get_rng_state(self._device)
            torch.cuda.set_rng_state(state, self._device)
        else:  # torch.get_rng_state / set_rng_state, without their Python wrappers
            gen = torch.default_generator
            old = gen.get_state()
            gen.set_state(state)
        return old

    def _replica_buffer_sets(self, rf: int) -> list[list[torch.Tensor]] | None:
        # Each replica keeps its own BatchNorm statistics; replica 0's are the module's own.
        if rf == 1 or not self._dev_buffers:
            return None
        if self._replica_buffers is None:
            own = self._dev_buffers
            self._replica_buffers = [own] + [[b.clone() for b in own] for _ in range(rf - 1)]
        return self._replica_buffers

    def _run_constants(self, di: int, ga: int, rf: int, rfg: int, mode: OutputMode) -> tuple:
        o = self._options
        period = o.output_return_period if mode == OutputMode.EveryN else 1
        grouped = o.input_cgt == 2  # CommGroupType.Orthogonal
        mean = ReductionType(o.Training.accumulation_and_replication_reduction_type) \
            == ReductionType.Mean
        return di, ga, rf, rfg, mode, period, grouped, o.input_group_size, mean

    def _run(self, leaves: list, chunks: list, spec: Any, di: int, ga: int, rf: int,
             rfg: int, buffers: list[torch.Tensor]) -> Any:
        mode, period, grouped, g, mean = self._consts[4:]
        model = self._user_model
        training = self._training
        if training:
            opt = self._device_optimizer
            scale = self._loss_scaling / (ga * rf) if mean else self._loss_scaling
        replica_buffers = self._replica_buffer_sets(rf) if rf > 1 else None
        keep_all = mode in (OutputMode.All, OutputMode.EveryN)
        is_sum = mode == OutputMode.Sum  # compared once, not per micro-batch
        kept: list[list[Any]] = []
        final: list[Any] = [None] * rf
        for d in range(di):
            anchored = keep_all and (d + 1) % period == 0
            last_d = d == di - 1
            for a in range(ga):
                for r in range(rf):
                    slot = (d * ga + a) * rfg + ((r % rfg) if grouped else (r // g))
                    mb = [x if c is None else c[slot] for x, c in zip(leaves, chunks)]
                    margs, mkwargs = _unflatten(mb, spec)
                    if replica_buffers is not None:
                        for b, own in zip(buffers, replica_buffers[r]):
                            b.data = own
                    out = model(*margs, **mkwargs)
                    outs, _ = _out_leaves(out)
                    if training:
                        self._backward(outs, scale)
                    outs = [t.detach() if isinstance(t, torch.Tensor) else t for t in outs]
                    if anchored:
                        kept.append(outs)
                    elif is_sum:
                        final[r] = outs if final[r] is None else [
                            s + t if isinstance(t, torch.Tensor) else t
                            for s, t in zip(final[r], outs)]
                    elif last_d and a == ga - 1:
                        final[r] = outs
            if training:
                opt.step()
                opt.zero_grad(set_to_none=True)
        rows = kept if keep_all else final
        return self._assemble(rows)

    def _backward(self, outs: list, scale: float) -> None:
        """Backward of one micro-batch's loss (an output leaf, or taken by ``_loss_capture``
        when the outputs only use it), scaled by ``scale``."""
        index = self._loss_index
        loss = outs[index] if index is not None else self._loss_capture.take()
        if loss.dim():
            loss = loss.sum()  # identity_loss(reduction="none")
        (loss * scale if scale != 1.0 else loss).backward()

    def _run_single(self, leaves: list, spec: Any) -> Any:
        """``_run`` for DI = GA = RF = 1, with its loops unrolled: the host batch is the one
        micro-batch, the loss scale is loss_scaling (Mean over 1), and every output mode
        returns that micro-batch's outputs."""
        if isinstance(spec, int):  # positional tensors
            out = self._user_model(*leaves)
        else:
            margs, mkwargs = _unflatten(leaves, spec)
            out = self._user_model(*margs, **mkwargs)
        outs, _ = _out_leaves(out)
        if self._training:
            self._backward(outs, self._loss_scaling)
            opt = self._device_optimizer
            opt.step()
            opt.zero_grad(set_to_none=True)
        host = []  # _to_host(t.detach()) of each tensor; a loop, not a comprehension: per call
        for t in outs:
            if isinstance(t, torch.Tensor):
                t = t.detach()
                if t.dtype in _NARROWED or not t.is_cpu:
                    t = _to_host(t)
            host.append(t)
        return _out_unflatten(host, self._out_spec)

    def _assemble(self, rows: list[list[Any]]) -> Any:
        if len(rows) == 1:
            leaves = [_to_host(t) if isinstance(t, torch.Tensor) else t for t in rows[0]]
        else:
            leaves = []
            for i, is_tensor in enumerate(self._tensor_out):
                col = [row[i] for row in rows]
                if not is_tensor:
                    leaves.append(col[0])
                elif col[0].dim() == 0:
                    leaves.append(_to_host(torch.stack(col)))
                else:
                    leaves.append(_to_host(torch.cat(col)))
        return _out_unflatten(leaves, self._out_spec)

    # -- what the emulator cannot measure ----------------------------------------------------
    def cycleCount(self) -> int:
        raise Error("cycleCount() needs IPU hardware cycle counters, which the ipuloop emulator "
                    "does not have: time host calls instead (ipuloop.callbacks.ProfileCapture).")

    def _no_timestamps(self, name: str) -> Any:
        raise Error(f"{name}() reads the IPU's host-transfer timestamps, which the ipuloop "
                    "emulator does not have: time host calls instead (time.perf_counter() "
                    "around the call, or ipuloop.callbacks.ProfileCapture).")

    def getPerfCounters(self) -> dict:
        return self._no_timestamps("getPerfCounters")

    def getLatency(self) -> tuple[float, float, float]:
        return self._no_timestamps("getLatency")

    def getHostIpuLatency(self) -> tuple[float, float, float]:
        return self._no_timestamps("getHostIpuLatency")

    def getComputeLatency(self) -> tuple[float, float, float]:
        return self._no_timestamps("getComputeLatency")

    def getIpuHostLatency(self) -> tuple[float, float, float]:
        return self._no_timestamps("getIpuHostLatency")

    # -- anchored tensors (Options.anchorTensor) ---------------------------------------------
    # The emulator can anchor what exists outside the model's forward: each parameter (its
    # device value), "Gradient___<name>" (its per-micro-batch gradient, times loss_scaling) and
    # "UpdatedVar___<name>" (its value after the call's last update). "model." may prefix <name>.
    _anchors: dict[str, tuple[str, int, OutputMode, int]] = {}
    _anchor_hooks: list[Any] = []

    def _anchor_names(self) -> dict[str, tuple[str, int]]:
        names = {}
        index = {id(p): i for i, p in enumerate(self._host_params)}
        for name, p in self._user_model.named_parameters():
            i = index[id(p)]
            for kind in ("", "Gradient___", "UpdatedVar___") if self._training else ("",):
                names[kind + name] = (kind, i)
        return names

    def getTensorNames(self) -> list[str]:
        """The tensor names ``Options.anchorTensor`` accepts on the emulator (needs a compile)."""
        assert self._compiled, "Model must be compiled before calling getTensorNames"
        return list(self._anchor_names())

    def _setup_anchors(self) -> None:
        for handle in self._anchor_hooks:
            handle.remove()
        self._anchor_hooks, self._anchors, self._anchor_grads = [], {}, {}
        o = self._options
        if not o.anchored_tensors:
            return
        names = self._anchor_names()
        model_mode = OutputMode(o.output_mode)
        for short, (long_name, inherit, mode, period) in o.anchored_tensors.items():
            kind_name = long_name
            for kind in ("Gradient___", "UpdatedVar___", ""):
                if long_name.startswith(kind + "model.") and long_name not in names:
                    kind_name = kind + long_name[len(kind) + len("model."):]
                    break
            if kind_name not in names:
                raise Error(f"Options.anchorTensor({short!r}, {long_name!r}): the ipuloop emulator "
                            "can anchor a parameter, its gradient or its updated value. Valid "
                            f"names: {', '.join(names)} (see getTensorNames()).")
            kind, i = names[kind_name]
            mode = model_mode if inherit else OutputMode(mode)
            period = o.output_return_period if inherit else period
            if kind != "Gradient___" and mode != OutputMode.Final:
                raise Error(f"Options.anchorTensor({short!r}, {long_name!r}) with output mode "
                            f"{mode.name}: the ipuloop emulator anchors weights and updated "
                            "weights with OutputMode.Final only. Pass output_mode="
                            "poptorch.OutputMode.Final to anchorTensor.")
            if mode == OutputMode.EveryN and (period < 1 or self._consts[0] % period):
                raise Error(f"Return period must be a factor of the number of batches per step: "
                            f"anchorTensor({short!r}, ..., EveryN, {period}) with "
                            f"deviceIterations({self._consts[0]}).")
            self._anchors[short] = (kind, i, mode, period)
            if kind == "Gradient___" and i not in self._anchor_grads:
                self._anchor_grads[i] = [-1, []]
                self._anchor_hooks.append(self._host_params[i].register_hook(
                    functools.partial(self._record_gradient, self._anchor_grads[i])))

    def _record_gradient(self, record: list, grad: torch.Tensor) -> None:
        # One call per micro-batch backward, in [DI, GA, RF] order. The executor scaled the loss
        # by loss_scaling / (GA*RF) under Mean: undo the 1 / (GA*RF) to report the micro-batch's.
        if record[0] != self._trained_version:
            record[0], record[1] = self._trained_version, []
        ga, rf, mean = self._consts[1], self._consts[2], self._consts[8]
        grad = grad.detach()
        record[1].append(grad * (ga * rf) if mean and ga * rf > 1 else grad.clone())

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The value of the tensor anchored as ``short_name`` in the last call."""
        assert short_name in self._anchors, "No tensor with name " + short_name + " found."
        kind, i, mode, period = self._anchors[short_name]
        di, ga, rf = self._consts[:3]
        if kind != "Gradient___":  # Final: one copy per replica (replicas hold equal weights)
            w = self._dev_params[i].detach()
            return _to_host(w.clone() if rf == 1 else torch.cat([w] * rf) if w.dim()
                            else w.repeat(rf))
        version, grads = self._anchor_grads[i]
        assert version == self._trained_version - 1 and len(grads) == di * ga * rf, (
            "No tensor with name " + short_name + " found: run the model first.")
        if mode == OutputMode.All:
            rows = grads
        elif mode == OutputMode.EveryN:
            rows = [g for j, g in enumerate(grads) if (j // (ga * rf) + 1) % period == 0]
        elif mode == OutputMode.Sum:
            rows = [sum(grads[r::rf][1:], grads[r]) for r in range(rf)]
        else:  # Final: the last micro-batch of each replica
            rows = grads[-rf:]
        if len(rows) == 1:
            return _to_host(rows[0])
        return _to_host(torch.stack(rows) if rows[0].dim() == 0 else torch.cat(rows))

    def compileAndExport(self, filename: str, *args: Any, **kwargs: Any) -> None:
        raise Error("compileAndExport() writes a Poplar executable, which the ipuloop emulator "
                    "cannot produce: use compile() and torch.save(model.state_dict()).")

    def loadExecutable(self, filename: str) -> None:
        raise Error("loadExecutable() needs a Poplar executable, which the ipuloop emulator "
                    "cannot load.")


def _register_hook(hooks: dict[int, Callable[[], Any]], hook: Callable[[], Any], what: str
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


def trainingModel(model: torch.nn.Module, options: Any = None,
                  optimizer: torch.optim.Optimizer | None = None) -> PoplarExecutor:
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
        pipelined = isinstance(strategy, _blocks.PipelinedExecution) and \
            not isinstance(strategy, _blocks.ShardedExecution)
        raise Error("You must set poptorch.Options().Training.gradientAccumulation to 1 or leave "
                    "it as its default value (1) when running a poptorch.inferenceModel()."
                    + (" Use poptorch.Options().deviceIterations to process a sufficient number "
                       "of batches each run for pipelined execution instead." if pipelined else "")
                    + f" Received: gradientAccumulation={options.Training.gradient_accumulation}.")
    if options is not None and options._Popart.options.get("automaticLossScalingSettings.enabled"):
        # PopART refuses it for a session that does not train (Training options: "You must not
        # set these options for inference models")
        raise Error("Automatic loss scaling is a training setting: an inferenceModel cannot use "
                    "options with Training.setAutomaticLossScaling(True). Clone the options and "
                    "call Training.setAutomaticLossScaling(False) for inference.")
    return PoplarExecutor(model, options, training=False)
