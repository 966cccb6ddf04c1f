"""``trainingModel`` / ``inferenceModel``: PopTorch's executors, run on CPU (or CUDA).

One host call of a wrapped model runs what the IPU runs (poptorch-semantics §2, §4):

    host batch of B*DI*GA*(RF/g) samples, split [DI, GA, RF/g, B]
    for d in range(DI):                      # one optimizer update per d (training)
        for a in range(GA):
            for r in range(RF):              # replica r reads input group r // g (or r % (RF/g))
                out = model(micro_batch[d, a, r])     # BatchNorm and the loss see B samples
                (loss * loss_scaling / (GA*RF if Mean else 1)).backward()
        optimizer.step(); optimizer.zero_grad()
    return what the output mode anchors (All / Final / Sum / EveryN)

The "device" is a deep copy of the module with its own optimizer and RNG: the host module is
stale after a training call until something reads it (``copyWeightsToHost``), and host-side
optimizer changes reach the device only through ``setOptimizer``, as on hardware.
"""
from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import time
import warnings
import weakref
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from . import blocks as _blocks
from . import optim as _optim
from .enums import ConnectionType, OutputMode, ReductionType
from .errors import Error

__all__ = ["PoplarExecutor", "trainingModel", "inferenceModel", "identity_loss", "isRunningOnIpu"]

logger = logging.getLogger("poptorch")

_NO_EXECUTABLE = "Model has not been compiled or has been destroyed."
_running_on_ipu = False  # True while a wrapped model's forward runs "on the device"


def isRunningOnIpu() -> bool:
    """True while the emulated device runs a wrapped model's forward, as while PopTorch traces."""
    return _running_on_ipu


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark ``x`` as the graph's final loss; ``reduction`` is "sum", "mean" or "none"."""
    assert reduction in ("sum", "mean", "none"), (
        f'reduction must be "sum", "mean" or "none". Received: reduction={reduction!r}.')
    out = x.sum() if reduction == "sum" else x.mean() if reduction == "mean" else x * 1
    out._poptorch_identity_loss = True  # lets the executor find the loss as PopTorch's graph pass does
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

        _wrapped_classes[cls] = type(f"Poptorch{cls.__name__}", (cls,),
                                     {"__getattribute__": __getattribute__,
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


def _plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` as the user defined it (no executor, original classes)."""
    ex = model.__dict__.pop("_poptorch_executor", None)
    if ex is None:
        out = copy.deepcopy(model)  # reading wrapped parameters syncs them first
    else:
        ex.copyWeightsToHostIfNeeded()
        cls = type(model)
        model.__class__ = cls.__mro__[1]
        try:
            out = copy.deepcopy(model)
        finally:
            model.__class__ = cls
            model.__dict__["_poptorch_executor"] = ex
    _unwrap_parameters(list(out.parameters()))  # device copies: no host hooks
    return out


def _tensors(module: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return list(module.parameters()), list(module.buffers())


# ---------------------------------------------------------------------------------------------
# Inputs and outputs

def _flatten(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        return list(args), len(args)  # fast path: positional tensors only
    return pytree.tree_flatten((args, kwargs))


def _unflatten(leaves: list[Any], spec: Any) -> tuple[tuple, dict]:
    if isinstance(spec, int):
        return tuple(leaves), {}
    return pytree.tree_unflatten(leaves, spec)


def _out_leaves(out: Any) -> tuple[list[Any], Any]:
    if isinstance(out, torch.Tensor):
        return [out], None
    if type(out) is tuple and all(isinstance(o, torch.Tensor) for o in out):
        return list(out), len(out)
    return pytree.tree_flatten(out)


def _out_unflatten(leaves: list[Any], spec: Any) -> Any:
    if spec is None:
        return leaves[0]
    if isinstance(spec, int):
        return tuple(leaves)
    return pytree.tree_unflatten(leaves, spec)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64:
        t = t.to(torch.int32)  # the IPU has no 64-bit types: outputs come back narrowed
    elif t.dtype == torch.float64:
        t = t.to(torch.float32)
    return t if t.is_cpu else t.cpu()


class _Signature:
    """What the first call compiled for; later calls must match it exactly (PopTorch §2.1)."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict) -> None:
        try:
            names = list(inspect.signature(forward).parameters)
        except (TypeError, ValueError):
            names = []
        self.names = names
        self.num_args = len(args)
        self.kwarg_keys = sorted(kwargs)
        leaves, self.spec = _flatten(args, kwargs)
        self.meta = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves]
        # Positional tensors only: what a matching call looks like, compared in one pass.
        self.fast = [(torch.Size(m[0]), m[1]) for m in self.meta] \
            if isinstance(self.spec, int) else None

    def arg_name(self, i: int) -> str:
        return repr(self.names[i]) if i < len(self.names) else f"#{i}"

    def check(self, args: tuple, kwargs: dict) -> list[Any]:
        fast = self.fast
        if fast is not None and not kwargs and len(args) == len(fast) and all(
                type(x) is torch.Tensor and x.dtype == dt and x.shape == sh
                for x, (sh, dt) in zip(args, fast)):
            return list(args)  # the common case; anything else gets the full check below
        if len(args) != self.num_args:
            raise Error(f"Number of positional arguments mismatch: expected {self.num_args} "
                        f"arguments but got {len(args)}. To compile a new model call destroy() "
                        "on the wrapped model and wrap it again.")
        if sorted(kwargs) != self.kwarg_keys:
            raise Error(f"Keys mismatch for keyword arguments: expected {self.kwarg_keys} but got "
                        f"{sorted(kwargs)}.")
        leaves, spec = _flatten(args, kwargs)
        if spec != self.spec:
            raise Error("Type or structure mismatch of the inputs: expected the same nesting of "
                        "tuples, lists and dicts as the first call, which compiled the model.")
        for i, (x, m) in enumerate(zip(leaves, self.meta)):
            where = f"input {self.arg_name(i)}" if isinstance(spec, int) else f"input #{i}"
            if isinstance(x, torch.Tensor) != isinstance(m, tuple):
                raise Error(f"Type mismatch for {where}: expected {m!r} but got {type(x).__name__}.")
            if isinstance(x, torch.Tensor):
                if x.dtype != m[1]:  # checked before the shape, as PopTorch does
                    raise Error(f"Data type mismatch for {where}: expected {m[1]} but got {x.dtype}.")
                if tuple(x.shape) != m[0]:
                    raise Error(f"Shape mismatch for {where}: expected {list(m[0])} but got "
                                f"{list(x.shape)}. The model was compiled for the first call's "
                                "shapes: call destroy() on the wrapped model and wrap it again "
                                "to compile for new ones.")
            elif x != m:
                raise Error(f"Value mismatch for {where}: expected {m!r} but got {x!r}. Non-tensor "
                            "arguments are constants of the compiled graph.")
        return leaves


# ---------------------------------------------------------------------------------------------

class PoplarExecutor:
    """A model wrapped by ``trainingModel`` or ``inferenceModel``."""

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
        self._compiled = False
        self._attached = False
        self._host_dirty = False
        self._host_weights_version = 0  # bumped each time host weights are refreshed from device
        self._trained_version = 0  # bumped by each training call
        self._source: PoplarExecutor | None = None  # training executor an inference one follows
        self._source_version = -1
        self._signature: _Signature | None = None
        self._compile_time = 0.0
        self._rng_state: torch.Tensor | None = None
        self._optimizer = optimizer
        self._device_optimizer: torch.optim.Optimizer | None = None
        self._optimizer_snapshot: dict | None = None
        self._optimizer_constants: set[str] = set()
        self._optimizer_dirty = False
        self._replica_buffers: list[list[torch.Tensor]] | None = None

        strategy = getattr(opts, "_execution_strategy", None)
        if strategy is not None and not getattr(strategy, "emulated", True):
            raise Error(f"{type(strategy).__name__} is not supported by the ipuloop emulator: "
                        "use poptorch.PipelinedExecution or poptorch.ShardedExecution.")
        # The device copy: same structure, its own storage. Values are uploaded on attach.
        self._device_model = _plain_copy(model).to(self._device)
        self._device_model.train(training)
        if training:
            ex = model.__dict__.get("_poptorch_executor")
            if ex is not None:
                raise RuntimeError("Model has already been wrapped in 'poptorch.trainingModel'. "
                                   "Call model.destroy() on the model to unwrap it before "
                                   "wrapping it again.")
            if self._optimizer is None:
                self._optimizer = _optim.default_optimizer(model.parameters())
            _optim.check_supported(self._optimizer)
            self._host_params, self._host_buffers = _tensors(model)
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
            self._host_params, self._host_buffers = _tensors(model)
        self._dev_params, self._dev_buffers = _tensors(self._device_model)

    # -- the user's module -------------------------------------------------------------------
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

    def getCompilationTime(self) -> float:
        """Seconds the last compilation took (tracing and checks on the emulator)."""
        return self._compile_time

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
        leaves, spec = _flatten(args, kwargs)
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
        self._signature = _Signature(self._device_model.forward, args, kwargs)
        self._consts = self._run_constants(di, ga, rf, rfg, mode)
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
        self._compile_time = time.perf_counter() - start

    def _trace(self, leaves: list[Any], spec: Any, prod: int, di: int, ga: int, rf: int) -> None:
        """Trace the first micro-batch: finds the loss, the blocks and the pipeline stages."""
        micro = [self._prepare(x)[:x.shape[0] // prod] if isinstance(x, torch.Tensor) and x.dim()
                 else self._prepare(x) for x in leaves]
        margs, mkwargs = _unflatten(micro, spec)
        saved = [b.clone() for b in self._dev_buffers]
        # Random ops draw from the device generator, which the trace leaves as it found it; the
        # host generator is not touched (the device's RNG is its own).
        rng = self._rng_state if self._rng_state is not None else self._initial_rng_state()
        host_rng = self._swap_rng(rng)
        global _running_on_ipu
        strategy = self._options._execution_strategy
        try:
            _running_on_ipu = True
            with _blocks.trace_stages(strategy) as trace, torch.set_grad_enabled(self._training):
                out = self._device_model(*margs, **mkwargs)
        finally:
            _running_on_ipu = False
            with torch.no_grad():
                for b, s in zip(self._dev_buffers, saved):
                    b.copy_(s)
            self._swap_rng(host_rng)
        out_leaves, self._out_spec = _out_leaves(out)
        self._tensor_out = [isinstance(t, torch.Tensor) for t in out_leaves]
        if self._training:
            self._loss_index = self._find_loss(out_leaves)
        self._check_stages(trace, di, ga, rf)

    @staticmethod
    def _find_loss(leaves: list[Any]) -> int:
        marked = [i for i, t in enumerate(leaves)
                  if isinstance(t, torch.Tensor) and getattr(t, "_poptorch_identity_loss", False)]
        scalars = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)
                   and t.dim() == 0 and t.requires_grad and t.is_floating_point()]
        found = marked or scalars
        if not found:
            raise Error("Couldn't find a loss in graph! The training model must return a scalar "
                        "loss that depends on the parameters (for example `return output, loss`), "
                        "or wrap a custom loss in poptorch.identity_loss(loss, reduction=...).")
        if len(found) > 1:
            raise Error("Multiple independent losses found in graph. Graph must have one final "
                        "loss. Wrap final graph loss in poptorch.identity_loss.")
        return found[0]

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
        if o.exists("use_model"):  # useIpuModel() takes precedence over the environment
            use_model = bool(o.use_model)
        else:
            try:  # PopTorch: std::stoi(POPTORCH_IPU_MODEL) != 0
                use_model = int(os.environ.get("POPTORCH_IPU_MODEL", "0").strip() or 0) != 0
            except ValueError:
                use_model = False
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
            raise Error("Trying to attach a model compiled for an offline IPU target "
                        "(ConnectionType.Never): use model.compile(inputs) instead.")
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
        """Free the executable; a training wrapper also unwraps the user's module."""
        if self._training and self._user_model.__dict__.get("_poptorch_executor") is self:
            if self._compiled:
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
            for d, h in zip(self._dev_params + self._dev_buffers,
                            self._host_params + self._host_buffers):
                d.copy_(h)
        self._replica_buffers = None

    def copyWeightsToHost(self) -> None:
        """Read the device's weights back into the host module (replica 0's buffers)."""
        if not self._compiled:
            raise Error(_NO_EXECUTABLE)  # the device copy would overwrite host edits
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
        # PopTorch rebinds state_dict()/load_state_dict() so they read and write the IPU's state.
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
        memo = {id(h): d for h, d in zip(self._host_params, self._dev_params)}
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in memo:
                    raise ValueError("The optimizer holds a parameter that is not in the wrapped "
                                     "model. Build the optimizer from model.parameters().")
        patched = {k: opt.__dict__.pop(k) for k in ("state_dict", "load_state_dict")
                   if k in opt.__dict__}
        try:
            dev = copy.deepcopy(opt, memo)
        finally:
            opt.__dict__.update(patched)
        # Instance-level wrappers (an LR scheduler's step counter) would call the host optimizer.
        for name in ("step", "zero_grad", "_opt_called"):
            dev.__dict__.pop(name, None)
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
        if self._device_optimizer is not None:
            type(self._optimizer).load_state_dict(self._optimizer, self._device_state_dict())

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Push the optimizer's hyper-parameters (and loaded state) to the device."""
        if not self._training:
            raise Error("setOptimizer() is only available on a poptorch.trainingModel.")
        _optim.check_supported(optimizer)
        if optimizer is not self._optimizer:
            self._unpatch_optimizer(self._optimizer)
            self._optimizer = optimizer
            self._patch_optimizer(optimizer)
            if optimizer.state:  # only an optimizer carrying state resets the device's
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
        if x.dtype in (torch.float64, torch.bfloat16):
            x = x.float()  # sent to the IPU as float32
        if not x.is_contiguous():
            if "contig" not in self._warned:
                self._warned.add("contig")
                logger.warning("At least one input tensor is not contiguous: non-contiguous "
                               "tensors will be converted.")
            x = x.contiguous()
        return x.to(self._device, non_blocking=True) if x.device != self._device else x

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._offline:
            raise AssertionError("Trying to run a model compiled for an offline IPU target: use "
                                 "model.compile(inputs) instead.")
        if not self._compiled:
            self._compile(args, kwargs)
            leaves, spec = _flatten(args, kwargs)
        else:
            leaves, spec = self._signature.check(args, kwargs), self._signature.spec
            if not self._attached:
                self._attach()  # a call re-attaches a detached model
        if self._training:
            if self._optimizer_dirty:
                self._upload_optimizer(self._optimizer)
        elif self._source is not None and self._source._trained_version != self._source_version:
            # PopTorch: an inference model made from the trained module re-uploads fresh weights.
            self._source.copyWeightsToHostIfNeeded()
            self.copyWeightsToDevice()
            self._source_version = self._source._trained_version
        di, ga, rf, rfg = self._consts[:4]
        prod = di * ga * rfg
        leaves = [self._prepare(x) for x in leaves]
        chunks = [x.split(x.shape[0] // prod) if isinstance(x, torch.Tensor) else None
                  for x in leaves] if prod > 1 else [None] * len(leaves)
        host_rng = self._swap_rng(self._rng_state)
        global _running_on_ipu
        _running_on_ipu = True
        grad_was = torch.is_grad_enabled()  # torch.enable_grad() / no_grad(), minus their cost
        torch._C._set_grad_enabled(self._training)
        try:
            out = self._run(leaves, chunks, spec, di, ga, rf, rfg)
            if self._training:
                self._host_dirty = True
                self._trained_version += 1
        finally:
            torch._C._set_grad_enabled(grad_was)
            _running_on_ipu = False
            self._rng_state = self._swap_rng(host_rng)
        return out

    def _swap_rng(self, state: torch.Tensor) -> torch.Tensor:
        """Install ``state`` as the generator the device's random ops use; return the old one."""
        if self._device.type == "cuda":
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
            self._buffer_slots = [(m, n) for m in self._device_model.modules()
                                  for n, b in m._buffers.items() if b is not None]
            own = [m._buffers[n] for m, n in self._buffer_slots]
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
             rfg: int) -> Any:
        mode, period, grouped, g, mean = self._consts[4:]
        model = self._device_model
        training = self._training
        if training:
            opt = self._device_optimizer
            scale = self._loss_scaling / (ga * rf) if mean else self._loss_scaling
            loss_index = self._loss_index
        replica_buffers = self._replica_buffer_sets(rf) if rf > 1 else None
        keep_all = mode in (OutputMode.All, OutputMode.EveryN)
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
                        for (m, n), b in zip(self._buffer_slots, replica_buffers[r]):
                            m._buffers[n] = b
                    out = model(*margs, **mkwargs)
                    outs, _ = _out_leaves(out)
                    if training:
                        loss = outs[loss_index]
                        if loss.dim():
                            loss = loss.sum()  # identity_loss(reduction="none")
                        (loss * scale if scale != 1.0 else loss).backward()
                    outs = [t.detach() if isinstance(t, torch.Tensor) else t for t in outs]
                    if anchored:
                        kept.append(outs)
                    elif mode == OutputMode.Sum:
                        final[r] = outs if final[r] is None else [
                            s + t if isinstance(t, torch.Tensor) else t
                            for s, t in zip(final[r], outs)]
                    elif last_d and a == ga - 1:
                        final[r] = outs
            if training:
                opt.step()
                opt.zero_grad(set_to_none=True)
        if replica_buffers is not None:
            for (m, n), b in zip(self._buffer_slots, replica_buffers[0]):
                m._buffers[n] = b
        rows = kept if keep_all else final
        return self._assemble(rows)

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

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        raise Error("Anchored tensors (Options.anchorTensor) are not supported by the ipuloop "
                    "emulator: return the tensor from forward() instead.")

    def compileAndExport(self, filename: str, *args: Any, **kwargs: Any) -> None:
        raise Error("compileAndExport() writes a Poplar executable, which the ipuloop emulator "
                    "cannot produce: use compile() and torch.save(model.state_dict()).")

    def loadExecutable(self, filename: str) -> None:
        raise Error("loadExecutable() needs a Poplar executable, which the ipuloop emulator "
                    "cannot load.")


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
        pipelined = isinstance(getattr(options, "_execution_strategy", None),
                               _blocks.PipelinedExecution)
        raise Error("You must set poptorch.Options().Training.gradientAccumulation to 1 or use "
                    "the default options when using poptorch.inferenceModel."
                    + (" Use poptorch.Options().deviceIterations to fill the pipeline instead."
                       if pipelined else "")
                    + f" Received: gradientAccumulation={options.Training.gradient_accumulation}.")
    return PoplarExecutor(model, options, training=False)
