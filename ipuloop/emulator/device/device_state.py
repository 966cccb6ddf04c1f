"""The device's weights: a tensor per parameter and buffer of a wrapped module, and the module's
wrapping, so that reading the host module syncs the device's weights back.

A run swaps the device tensors into the user's own parameters and buffers (``swap_in``), so
whatever the model reaches (submodules, closures, globals) runs on them, and swaps the host's
back afterwards (``swap_out``). Which parameters and buffers the device holds is read from the
module when it is bound (``bind``): at wrap time and again at compile time, as PopTorch traces
the module as it is when it compiles.
"""

from __future__ import annotations

import copyreg
import os
import weakref
from typing import Any, Sequence

import torch

from ..errors import Error

__all__ = [
    "DeviceWeights",
    "wrapped_class",
    "device_dtype",
    "emulator_device",
    "system_ipus",
    "rng_state",
    "swap_rng",
]


def emulator_device() -> torch.device:
    """The torch device the emulated IPU computes on: ``IPULOOP_EMULATOR_DEVICE`` (default
    "cpu")."""
    name = os.environ.get("IPULOOP_EMULATOR_DEVICE", "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"IPULOOP_EMULATOR_DEVICE={name!r} asks for CUDA, but torch sees "
            "no CUDA device. Unset it to emulate on the CPU."
        )
    return device


def system_ipus() -> int:
    """How many IPUs the emulated system has: ``IPULOOP_EMULATOR_IPUS`` (default 0, PopTorch's
    answers on a machine without IPUs). ``python -m ipuloop.emulate`` sets it to 16 unless it is
    set already (``--ipus N``)."""
    value = os.environ.get("IPULOOP_EMULATOR_IPUS", "").strip() or "0"
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(
            "IPULOOP_EMULATOR_IPUS must be the number of IPUs of the emulated system, an int "
            f">= 0 (0: no IPU). Received: IPULOOP_EMULATOR_IPUS={value!r}."
        )
    return n


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator the device's random ops use."""
    if device.type != "cpu":
        return torch.cuda.get_rng_state(device)
    return torch.default_generator.get_state()


def swap_rng(state: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Install ``state`` as the generator the device's random ops use; return the old one."""
    if device.type != "cpu":
        old = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(state, device)
    else:  # torch.get_rng_state / set_rng_state, without their Python wrappers
        gen = torch.default_generator
        old = gen.get_state()
        gen.set_state(state)
    return old


# -- the host module: wrapped in place, as PopTorch does, so reading it syncs device weights back

_SYNC_ON_READ = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "forward",
        "state_dict",
        "parameters",
        "named_parameters",
        "buffers",
        "named_buffers",
        "modules",
        "named_modules",
        "children",
        "named_children",
    }
)
_wrapped_classes: dict[type, type] = {}


def wrapped_class(cls: type) -> type:
    """PopTorch's wrapper class of a module class ``cls``: reading a submodule, parameter or
    buffer of an instance whose ``_poptorch_executor`` trained since its last sync first copies
    the device's weights back; it pickles as ``cls``."""
    if cls not in _wrapped_classes:

        def __getattribute__(self, name):
            if name in _SYNC_ON_READ or not name.startswith("__"):
                d = object.__getattribute__(self, "__dict__")
                ex = d.get("_poptorch_executor")
                if (
                    ex is not None
                    and ex._dirty_host_weights
                    and (
                        name in _SYNC_ON_READ
                        or name in d["_modules"]
                        or name in d["_parameters"]
                        or name in d["_buffers"]
                    )
                ):
                    ex.copyWeightsToHost()
            return cls.__getattribute__(self, name)  # type: ignore[call-arg]

        def __reduce_ex__(self, protocol):
            # Pickling or deep-copying the wrapped module gives the user's class, with fresh
            # weights and no executor, as PopTorch's registered wrapper types do.
            d = object.__getattribute__(self, "__dict__")
            ex = d.get("_poptorch_executor")
            if ex is not None:
                ex.copyWeightsToHostIfNeeded()
            state = {k: v for k, v in d.items() if k != "_poptorch_executor"}
            reconstruct = copyreg._reconstructor  # type: ignore[attr-defined]
            return reconstruct, (cls, object, None), state  # no ipuloop reference

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
        _wrapped_classes[cls] = type(
            f"Poptorch{cls.__name__}",
            (cls,),
            {
                "__getattribute__": __getattribute__,
                "__reduce_ex__": __reduce_ex__,
                "destroy": destroy,
                "copyWeightsToHostIfNeeded": copyWeightsToHostIfNeeded,
                "_poptorch_wrapped_base": cls,
                "__module__": cls.__module__,
            },
        )
    return _wrapped_classes[cls]


def _host_parameter_class(owner: Any, base: type) -> type:
    """PopTorch's ``PoptorchParameter``: reading a host parameter (any attribute, or passing it
    to a torch function) first syncs the device's weights if a training call made them stale.
    ``owner`` (held weakly) has ``_dirty_host_weights`` and ``copyWeightsToHost()``."""
    parent = weakref.ref(owner)

    class PoptorchParameter(base):
        _poptorch_base = base

        def __getattribute__(self, name):
            owner = parent()
            if owner is not None and owner._dirty_host_weights:
                owner.copyWeightsToHost()
            return base.__getattribute__(self, name)  # type: ignore[call-arg]

        def __deepcopy__(self, memo):
            # reads (and so syncs) the data first
            result = base.__deepcopy__(self, memo)  # type: ignore[attr-defined]
            result.__class__ = base  # a copy is a plain parameter, not tied to the executor
            return result

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            # Defined so torch looks it up on the instance (running the hook above); results
            # are plain tensors, as for torch.nn.Parameter.
            return super().__torch_function__(func, types, args, kwargs or {})

    return PoptorchParameter


def _host_buffer_class(owner: Any) -> type:
    """PopTorch's ``PoptorchBuffer``: reading a host buffer (a BatchNorm's statistics) syncs the
    device's weights first, as reading a parameter does; what torch functions return from it
    are plain tensors (a state_dict's copies pickle)."""
    parent = weakref.ref(owner)

    class PoptorchBuffer(torch.Tensor):
        _poptorch_base = torch.Tensor

        def __getattribute__(self, name):
            owner = parent()
            if owner is not None and owner._dirty_host_weights:
                owner.copyWeightsToHost()
            return torch.Tensor.__getattribute__(self, name)

        def __deepcopy__(self, memo):
            plain = self.as_subclass(torch.Tensor)  # reads (and so syncs) first
            # kept alive with the memo (as copy.deepcopy keeps what it copies): its id is a
            # key of the memo, which a later object given the same id would otherwise hit
            memo.setdefault(id(memo), []).append(plain)
            result = memo[id(self)] = plain.__deepcopy__(memo)  # a copy is a plain tensor
            return result

        def __reduce_ex__(self, protocol):
            return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)

        # (as nn.Parameter's, whose stub types it as a method)
        __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    return PoptorchBuffer


def _unwrap(params: list[torch.Tensor]) -> None:
    for p in params:
        base = getattr(type(p), "_poptorch_base", None)
        if base is not None:
            p.__class__ = base


def device_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a host tensor of ``dtype`` has on the device: the IPU has no 64-bit floats."""
    return torch.float32 if dtype == torch.float64 else dtype


def _buffer_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str]]:
    """Where ``model``'s buffers live (module, name, full name): a buffer reassigned later is
    read from its slot."""
    return [
        (m, n, f"{prefix}.{n}" if prefix else n)
        for prefix, m in model.named_modules()
        for n, b in m.__dict__["_buffers"].items()
        if b is not None
    ]


class DeviceWeights:
    """The device's copy of a module's parameters and buffers, and their swap into the module.

    ``owner`` is the executor (``_dirty_host_weights``, ``copyWeightsToHost``); ``wrap`` says
    whether the host parameters and buffers get PopTorch's syncing classes while the module is
    wrapped by ``owner`` (a training model's do).
    """

    def __init__(
        self, owner: Any, model: torch.nn.Module, device: torch.device, wrap: bool
    ) -> None:
        self.model = model
        self.device = device
        self._owner = weakref.ref(owner)
        self._wrap = wrap
        self._classes: dict[type, type] = {}
        self.host_params: list[torch.Tensor] = []
        self.param_names: list[str] = []
        self.buffer_slots: list[tuple[torch.nn.Module, str, str]] = []
        self.dev_params: list[torch.Tensor] = []
        self.dev_buffers: list[torch.Tensor] = []
        self.replica_buffers: list[list[torch.Tensor]] | None = None
        self.swapped: list = []  # what ``swap_in`` took out of the user's tensors
        # each submodule's train/eval flag as bound (traced): a training model runs in them
        self.modes: list[tuple[torch.nn.Module, bool]] = []

    def device_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A device copy of host tensor ``t`` (float64 as float32)."""
        return t.detach().to(self.device, device_dtype(t.dtype), copy=True)

    def bind(self, extra_params: Sequence[torch.Tensor] = ()) -> None:
        """Read which parameters and buffers the module has now (with ``extra_params``, those
        an optimizer trains that the module does not list). A tensor bound before keeps its
        device value; a new one is copied to the device; one no longer bound is unwrapped."""
        model = self.model
        named = list(model.named_parameters())
        params: list[torch.Tensor] = [p for _, p in named]
        known = {id(p) for p in params}
        for p in extra_params:  # trained wherever the model reaches them
            if id(p) not in known:
                known.add(id(p))
                params.append(p)
        old = {id(h): d for h, d in zip(self.host_params, self.dev_params)}
        _unwrap([p for p in self.host_params if id(p) not in known])
        self.param_names = [name for name, _ in named]
        self.host_params = params
        self.modes = [(m, m.training) for m in model.modules()]
        owner = self._owner()
        wrapping = self._wrap and self.model.__dict__.get("_poptorch_executor") is owner
        if wrapping:
            for p in params:
                base = type(p)
                if getattr(base, "_poptorch_base", None) is None:
                    if base not in self._classes:
                        self._classes[base] = _host_parameter_class(owner, base)
                    p.__class__ = self._classes[base]
        self.dev_params = [old[id(p)] if id(p) in old else self.device_tensor(p) for p in params]
        old_buffers = (
            {id(b): d for b, d in zip(self.host_buffers, self.dev_buffers)}
            if self.buffer_slots
            else {}
        )
        if self.buffer_slots:  # a buffer no longer the module's is unwrapped
            kept = {id(b) for b in model.buffers()}
            _unwrap([b for b in self.host_buffers if id(b) not in kept])
        self.buffer_slots = _buffer_slots(model)
        if wrapping:
            for b in self.host_buffers:
                if type(b) is torch.Tensor:
                    if torch.Tensor not in self._classes:
                        self._classes[torch.Tensor] = _host_buffer_class(owner)
                    b.__class__ = self._classes[torch.Tensor]
        self.dev_buffers = [
            old_buffers[id(b)] if id(b) in old_buffers else self.device_tensor(b)
            for b in self.host_buffers
        ]
        self.replica_buffers = None

    def unwrap(self) -> None:
        """Give the host parameters their own class back (the module is unwrapped)."""
        _unwrap(self.host_params)
        _unwrap(self.host_buffers if self.buffer_slots else [])

    @property
    def host_buffers(self) -> list[torch.Tensor]:
        """The module's buffers, read from their slots through ``__dict__``: no sync from the
        device (as PopTorch's copies avoid one)."""
        return [m.__dict__["_buffers"][n] for m, n, _ in self.buffer_slots]

    def named(self) -> dict[str, torch.Tensor]:
        """The device's parameters and buffers by their names in the module (no host sync)."""
        names = [*self.param_names, *(name for _, _, name in self.buffer_slots)]
        return dict(zip(names, self.dev_params + self.dev_buffers))

    # -- a run -------------------------------------------------------------------------------
    def swap_in(self, training: bool) -> list[torch.Tensor]:
        """Give the user's module, parameters and buffers the device's storage for a run (in
        ``training`` mode); returns the buffer tensors (a replica swaps its own statistics into
        them). ``swap_out`` undoes it."""
        buffers = self.host_buffers if self.buffer_slots else []  # first: may raise
        model = self.model
        cls = type(model)
        base = cls.__dict__.get("_poptorch_wrapped_base")
        if base is not None:  # no sync hooks while the device runs (Module.__setattr__ skipped)
            object.__setattr__(model, "__class__", base)
        flags = None
        if training:  # each submodule in the mode it was traced in (a frozen BatchNorm stays so)
            if any(m.training is not t for m, t in self.modes):
                flags = [(m, m.training) for m, _ in self.modes]
                for m, t in self.modes:
                    m.training = t
        elif model.training:  # an inference model runs in eval mode
            flags = [(m, m.training) for m in model.modules()]
            model.train(False)
        params = []
        for p, d in zip(self.host_params, self.dev_params):
            pcls = type(p)
            pbase = pcls.__dict__.get("_poptorch_base")
            if pbase is not None:
                p.__class__ = pbase
            grad = p.grad
            if grad is not None:
                p.grad = None
            params.append((p, pcls, p.data, grad))
            p.data = d
        classes = [type(b) for b in buffers]
        for b, bcls in zip(buffers, classes):
            if "_poptorch_base" in bcls.__dict__:  # no sync hooks while the device runs
                b.__class__ = torch.Tensor
        saved = [b.data for b in buffers]
        for b, d in zip(buffers, self.dev_buffers):
            b.data = d
        self.swapped = [cls, flags, params, buffers, saved, classes]
        return buffers

    def swap_out(self) -> None:
        """Undo ``swap_in``: the user's tensors hold the host's values again."""
        cls, flags, params, buffers, saved, classes = self.swapped
        self.swapped = []
        for b, data, bcls in zip(buffers, saved, classes):
            b.data = data
            b.__class__ = bcls
        for p, pcls, data, grad in params:
            p.data = data
            if grad is not None or p.grad is not None:
                p.grad = grad
            p.__class__ = pcls
        if flags is not None:
            for m, flag in flags:
                m.training = flag
        object.__setattr__(self.model, "__class__", cls)

    def replica_sets(self, rf: int) -> list[list[torch.Tensor]] | None:
        """Each replica's own buffers (BatchNorm statistics): replica 0's are the device's."""
        if rf == 1 or not self.dev_buffers:
            return None
        if self.replica_buffers is None:
            own = self.dev_buffers
            self.replica_buffers = [own] + [[b.clone() for b in own] for _ in range(rf - 1)]
        return self.replica_buffers

    # -- copies ------------------------------------------------------------------------------
    def check_bound(self) -> None:
        """Refuse a module whose parameters or buffer-holding submodules are no longer those
        bound at compile (a submodule rebuilt, a parameter replaced): PopTorch copies weights
        by name into its compiled graph, the emulator runs the module on the bound tensors."""
        params = dict(self.model.named_parameters())
        modules = dict(self.model.named_modules())
        replaced = [n for n, p in zip(self.param_names, self.host_params) if params.get(n) is not p]
        replaced += [
            full
            for m, _, full in self.buffer_slots
            if modules.get(full.rpartition(".")[0]) is not m
        ]
        if replaced:
            raise Error(
                f"The model's {replaced[0]!r} is not the tensor it had when it was compiled "
                f"({len(replaced)} such): a submodule was rebuilt or a parameter replaced "
                "since. PopTorch copies weights by name into its compiled graph; the emulator "
                "runs the module on the tensors it bound at compile and cannot follow. "
                "destroy() the model and wrap it again."
            )

    def to_device(self) -> None:
        """Copy the host's parameters and buffers (to every replica) to the device."""
        self.check_bound()
        with torch.no_grad():
            for d, h in zip(self.dev_params, self.host_params):
                d.copy_(h)
            for i, (d, h) in enumerate(zip(self.dev_buffers, self.host_buffers)):
                if d.shape == h.shape and d.dtype == device_dtype(h.dtype):
                    d.copy_(h)
                else:  # a buffer the host reassigned with another shape or dtype
                    self.dev_buffers[i] = self.device_tensor(h)
        self.replica_buffers = None

    def named_buffers_to_device(self, names: list[str]) -> None:
        """Copy the named buffers only, to every replica's copy; ``KeyError`` names one that
        the module does not have."""
        index = {name: i for i, (name, _) in enumerate(self.model.named_buffers())}
        replicas = self.replica_buffers or []
        with torch.no_grad():
            for name in names:
                dev = self.dev_buffers[index[name]]
                dev.copy_(self.host_buffers[index[name]])
                if replicas:  # every replica's copy of the buffer gets the host's value
                    j = next(j for j, b in enumerate(replicas[0]) if b is dev)
                    for own in replicas[1:]:
                        own[j].copy_(dev)

    def to_host(self) -> None:
        """Copy the device's parameters and (replica 0's) buffers into the host module."""
        with torch.no_grad():
            for h, d in zip(
                self.host_params + self.host_buffers, self.dev_params + self.dev_buffers
            ):
                h.copy_(d)
