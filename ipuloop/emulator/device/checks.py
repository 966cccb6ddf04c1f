"""What PopTorch's compiler checks in a traced model, checked in the emulator's trace.

The executor traces the first micro-batch of a wrapped model's first call inside
``TraceChecks``, a torch function mode that sees every torch op ``forward`` runs. It follows
the data flow as PopTorch's graph does, to

* find the loss: each ``identity_loss`` and each torch loss function (which PopTorch lowers to
  an identity loss) is a loss; a loss that feeds a later one is folded into it, one that feeds
  no output is dead code. Exactly one must remain (``find_loss``); when the outputs only use
  it, ``LossCapture`` takes it from each forward as a training call runs;
* reject a CPU tensor meeting the graph's tensors in one op, as the IPU does: the graph's
  tensors are the inputs, the parameters and buffers, and what ops made from them or from
  nothing (factory functions). Ops on CPU tensors alone run on the host, as in PopTorch;
* see parameters and buffers written in place (``updated``), which replicas broadcasting their
  buffers cannot have (``check_replicated_updates``);
* reject ``poptorch.for_loop`` and ``poptorch.cond`` in a training model, the ops PopTorch
  cannot compile (``unsupported``), a ``MultiConv`` nested or without a convolution, and
  ``set_overlap_for_input`` / ``set_overlap_for_output`` on what is not a model input / output.

It also holds the other checks of a compiled model: buffers and parameters removed or
reassigned by ``forward`` (``check_addresses``), cycle-count logging (``check_options``),
``updatableNamedBuffers`` naming buffers (``check_updatable_buffers``), the pipeline's stages
and the IPUs they need (``check_stages``) and ``backward()`` on a model's outputs
(``forbid_backward``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ... import rules
from .. import _logging
from .. import _pytree as pytree
from ..enums import ConnectionType
from ..errors import Error
from . import device_state
from . import unsupported as _unsupported

__all__ = [
    "LossCapture",
    "TraceChecks",
    "check_addresses",
    "check_options",
    "check_replicated_updates",
    "check_stages",
    "check_updatable_buffers",
    "forbid_backward",
    "note_inference_only",
    "note_identity_loss",
    "note_multiconv",
    "note_overlap",
    "tensor_addresses",
]

_LOSS_FUNCTIONS = frozenset(
    getattr(F, name)
    for name in (
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "cosine_embedding_loss",
        "cross_entropy",
        "ctc_loss",
        "gaussian_nll_loss",
        "hinge_embedding_loss",
        "huber_loss",
        "kl_div",
        "l1_loss",
        "margin_ranking_loss",
        "mse_loss",
        "multi_margin_loss",
        "multilabel_margin_loss",
        "multilabel_soft_margin_loss",
        "nll_loss",
        "poisson_nll_loss",
        "smooth_l1_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "triplet_margin_with_distance_loss",
    )
    if hasattr(F, name)
)

_CONVOLUTIONS = frozenset(
    getattr(F, name)
    for name in (
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
    )
)

_NO_LOSSES: frozenset[int] = frozenset()
_active: _LossMode | None = None


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


_getitem = torch.Tensor.__getitem__  # what a function mode sees ``x[index]`` as
_getitem_shown: list[bool] = []  # [whether function modes see it], once probed
_probe_lock = threading.Lock()


class _GetitemProbe(TorchFunctionMode):
    seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen = self.seen or func is _getitem
        return func(*args, **(kwargs or {}))


def modes_see_indexing() -> bool:
    """Whether function modes see ``x[index]`` of a plain tensor (torch >= 2.1); torch 2.0
    shows them neither basic nor advanced indexing (``x[idx]``, ``x[mask]``)."""
    with _probe_lock:
        if not _getitem_shown:
            probe = _GetitemProbe()
            with probe:
                torch.zeros(1)[torch.zeros(1, dtype=torch.long)]
            _getitem_shown.append(probe.seen)
        return _getitem_shown[0]


_aten = torch.ops.aten
# What ``x[index]`` dispatches to: advanced indexing, and basic indexing's views
_INDEXING = {
    _aten.index.Tensor: True,  # (its index tensors are args[1])
    _aten.slice.Tensor: False,
    _aten.select.int: False,
    _aten.unsqueeze.default: False,
    _aten.alias.default: False,
}


class _IndexWatch(TorchDispatchMode):
    """On torch < 2.1, beside ``TraceChecks``: the ops of ``x[index]`` (which function modes
    do not see there) that ``forward`` itself makes, shown to the checks as
    ``Tensor.__getitem__``: advanced indexing (``aten.index``) and basic indexing's views
    (``aten.slice``, ``aten.select``, ...; a view of a view has the first one's base, not the
    indexed tensor). Nothing of torch's classes is changed."""

    def __init__(self, checks: TraceChecks) -> None:
        super().__init__()
        self.checks = checks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        advanced = _INDEXING.get(func)
        if advanced is not None and not self.checks.inside:
            self.checks.indexed(args[0], list(args[1]) if advanced else [], out)
        return out


class _LossMode(TorchFunctionMode):
    """A mode that ``identity_loss`` reports to (``note_loss``) while it is active."""

    def __enter__(self) -> _LossMode:
        global _active
        self._previous, _active = _active, self
        return super().__enter__()

    def __exit__(self, *exc_info: object) -> None:
        global _active
        _active = self._previous
        return super().__exit__(*exc_info)

    def note_loss(self, t: torch.Tensor) -> None:
        raise NotImplementedError


class LossCapture(_LossMode):
    """While a training call runs: keeps the ``index``-th loss of each micro-batch's forward,
    for a model whose final loss is not among its outputs (see ``TraceChecks.find_loss``)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.seen: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _LOSS_FUNCTIONS and isinstance(out, torch.Tensor):
            self.seen.append(out)
        return out

    def note_loss(self, t: torch.Tensor) -> None:
        self.seen.append(t)

    def take(self) -> torch.Tensor:
        """The final loss of the micro-batch that just ran (and forget that micro-batch's)."""
        seen, self.seen = self.seen, []
        if len(seen) <= self.index:
            raise Error(
                f"The model's forward computed {len(seen)} loss(es) in this call, but "
                f"its first call's final loss was loss #{self.index}: a training graph "
                "is fixed when compiled. Compute the same losses on every call."
            )
        return seen[self.index]


class TraceChecks(_LossMode):
    """The mode the executor traces a wrapped model's forward in (see the module doc)."""

    def __init__(self, models: list[torch.nn.Module], inputs: list[Any], training: bool) -> None:
        """``models``: the modules whose parameters and buffers are on the device (the wrapped
        module, and the copy the emulator runs); ``inputs``: the traced call's inputs."""
        super().__init__()
        self.training = training
        self.losses: list[torch.Tensor] = []  # in creation order
        self.updated: list[str] = []  # names of parameters and buffers written in place
        self.half_grads = False  # an op used or made a float16 tensor that requires grad
        self._multiconv: int | None = None  # convolutions in the open MultiConv scope
        # the model's input tensors (id -> position), those an op used, and what
        # set_overlap_for_output marked
        self._inputs = {id(t): i for i, t in enumerate(_tensors(inputs))}
        self._used_inputs: set[int] = set()
        self._overlap_outputs: list[torch.Tensor] = []
        self._graph: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> losses it uses
        named = [
            nt for model in models for nt in [*model.named_parameters(), *model.named_buffers()]
        ]
        # Normalisation statistics are PopART's to update, not an in-place write of a buffer.
        stats = {
            id(t)
            for model in models
            for m in model.modules()
            if isinstance(m, _NormBase)
            for t in m.buffers()
        }
        self._names = {id(t): n for n, t in named if id(t) not in stats}
        for t in [*(t for _, t in named), *_tensors(inputs)]:
            self._graph[t] = _NO_LOSSES
        self.inside = 0  # torch functions running (their own ops are not forward's)
        self._watch: _IndexWatch | None = None

    def __enter__(self) -> TraceChecks:
        super().__enter__()
        if not modes_see_indexing():
            self._watch = _IndexWatch(self)
            self._watch.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._watch is not None:
            self._watch.__exit__(*exc_info)
            self._watch = None
        return super().__exit__(*exc_info)

    def indexed(self, t: torch.Tensor, index: list[Any], out: torch.Tensor) -> None:
        """``out = t[index]`` seen below torch's functions (torch < 2.1; ``index`` the tensors of
        advanced indexing, empty for a view): refused for a boolean mask of a graph tensor,
        and a graph tensor when ``t`` is."""
        if not self._in_graph(t):
            return
        _unsupported.check(_getitem, (t, tuple(index)), {})
        tensors = [t, *(i for i in index if isinstance(i, torch.Tensor))]
        self._graph[out] = _NO_LOSSES.union(*(self._graph.get(i, _NO_LOSSES) for i in tensors))

    def _in_graph(self, t: torch.Tensor) -> bool:
        if t in self._graph or isinstance(t, torch.nn.Parameter):
            return True
        # A view of a graph tensor is one: torch < 2.1 does not show basic indexing (x[0],
        # x[:1]) to function modes, so its output is known by its base alone.
        base = t._base
        if base is not None and (base in self._graph or isinstance(base, torch.nn.Parameter)):
            self._graph[t] = self._graph.get(base, _NO_LOSSES)
            return True
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _getitem and self._watch is not None:  # the watch's (a subclass's index)
            return func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        in_graph = [self._in_graph(t) for t in inputs]
        if any(in_graph) and not all(in_graph) and func is not torch.Tensor.to:
            cpu = inputs[in_graph.index(False)]
            raise Error(
                f"Expected an IPU tensor but got tensor(device={cpu.device.type}, "
                f"shape={list(cpu.shape)}, dtype={_dtype_name(cpu.dtype)}).\nConstant "
                "tensors should be moved explicitly to the IPU, via "
                "cpu_tensor.to(ipu_tensor.device). A tensor made inside forward() by "
                "a legacy constructor (torch.LongTensor([...])), from numpy, or kept as "
                "a plain module attribute stays on the host: make it with torch.tensor("
                "...) or register it as a buffer."
            )
        if all(in_graph):
            _unsupported.check(func, args, kwargs)
            if self._multiconv is not None and func in _CONVOLUTIONS:
                self._multiconv += 1
        for t in inputs:
            if id(t) in self._inputs:
                self._used_inputs.add(id(t))
        watched = [(t, t._version) for t in inputs if id(t) in self._names]
        self.inside += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.inside -= 1
        for t, version in watched:
            if t._version != version and self._names[id(t)] not in self.updated:
                self.updated.append(self._names[id(t)])
        if all(in_graph) or func is torch.Tensor.to:  # an op of the graph (or a factory)
            losses = _NO_LOSSES.union(*(self._graph.get(t, _NO_LOSSES) for t in inputs))
            outputs = _tensors(out)
            if func in _LOSS_FUNCTIONS and isinstance(out, torch.Tensor):
                losses = losses | {len(self.losses)}
                self.losses.append(out)
            for t in outputs:
                self._graph[t] = losses
            if not self.half_grads:  # a float16 tensor the backward computes a gradient for
                self.half_grads = any(
                    t.dtype == torch.float16 and t.requires_grad for t in (*inputs, *outputs)
                )
        return out

    def multiconv(self, begin: bool) -> None:
        """A ``MultiConv`` scope begins or ends (PopartLateCanonicalization.cpp)."""
        if begin:
            if self._multiconv is not None:
                raise Error("Nested poptorch.MultiConv is not supported.")
            self._multiconv = 0
            return
        if not self._multiconv:  # none open, or no convolution inside
            raise Error("Unexpected end_multi_conv, is the IR malformed?")
        self._multiconv = None

    def overlap(self, tensors: list[torch.Tensor], what: str) -> None:
        """``set_overlap_for_input`` / ``_output`` marks ``tensors`` (OverlappedIO.cpp)."""
        if what == "outputs":
            self._overlap_outputs.extend(tensors)
            return
        for t in tensors:
            position = self._inputs.get(id(t))
            if position is None:
                raise Error(
                    "poptorch.set_overlap_for_input applied on a node which is not a "
                    "tensor input to the model."
                )
            if id(t) in self._used_inputs:
                raise Error(
                    "poptorch.set_overlap_for_input must be the only op applied to an "
                    f"input. This is not the case for input {position} to the model."
                )

    def check_overlap_outputs(self, outputs: list[Any]) -> None:
        """Each tensor ``set_overlap_for_output`` marked is returned, once."""
        for t in self._overlap_outputs:
            returned = sum(o is t for o in outputs)
            if returned == 0:
                raise Error(
                    "poptorch.set_overlap_for_output applied on a node which is not a "
                    "tensor output to the model."
                )
            if returned > 1:
                raise Error(
                    "poptorch.set_overlap_for_output cannot be used with a tensor that "
                    "is returned twice. Please check all returned tensors including "
                    "those nested in tuples/lists."
                )

    def note_loss(self, t: torch.Tensor) -> None:
        """``t`` is an ``identity_loss``: a loss of the graph."""
        self._graph[t] = self._graph.get(t, _NO_LOSSES) | {len(self.losses)}
        self.losses.append(t)

    def find_loss(self, outputs: list[Any]) -> tuple[int | None, int]:
        """The graph's one final loss (PopTorch's loss pass): its index among ``outputs`` (None
        when the outputs only use it) and among the losses in the order forward made them."""
        used = _NO_LOSSES.union(
            *(self._graph.get(t, _NO_LOSSES) for t in outputs if isinstance(t, torch.Tensor))
        )  # others are dead code
        folded = _NO_LOSSES.union(
            *(self._graph[t] - {i} for i, t in enumerate(self.losses) if i in used)
        )
        final = sorted(used - folded)
        if not final:
            raise Error(
                "Couldn't find a loss in graph! A training model must return its loss: "
                "a torch loss function's output (for example `return output, "
                "F.mse_loss(output, target)`), or a custom loss wrapped in "
                "poptorch.identity_loss(loss, reduction=...)."
            )
        if len(final) > 1:
            raise Error(
                "Multiple independent losses found in graph. Graph must have one final "
                "loss. Wrap final graph loss in poptorch.identity_loss."
            )
        loss = self.losses[final[0]]
        returned = [i for i, t in enumerate(outputs) if t is loss]
        return (returned[0] if returned else None), final[0]


def _dtype_name(dtype: torch.dtype) -> str:
    """torch.int64 -> "Long", as c10 prints scalar types."""
    return {
        torch.int64: "Long",
        torch.int32: "Int",
        torch.int16: "Short",
        torch.int8: "Char",
        torch.uint8: "Byte",
        torch.bool: "Bool",
        torch.float32: "Float",
        torch.float64: "Double",
        torch.float16: "Half",
        torch.bfloat16: "BFloat16",
    }.get(dtype, str(dtype).replace("torch.", ""))


def note_identity_loss(t: torch.Tensor) -> None:
    """Called by ``identity_loss``: while a wrapped model runs, ``t`` is a loss of its graph."""
    if _active is not None:
        _active.note_loss(t)


def note_multiconv(begin: bool) -> None:
    """Called by ``MultiConv``'s ``__enter__`` (``begin``) and ``__exit__``."""
    if isinstance(_active, TraceChecks):
        _active.multiconv(begin)


def note_overlap(tensors: list[torch.Tensor], what: str) -> None:
    """Called by ``set_overlap_for_input`` (``what`` "inputs") and ``_output`` ("outputs")."""
    if isinstance(_active, TraceChecks):
        _active.overlap(tensors, what)


def note_inference_only(op: str, fix: str) -> None:
    """Called by ``for_loop`` and ``cond``: PopTorch compiles them for inference graphs only
    (``op`` names it, ``fix`` says what to do instead)."""
    if isinstance(_active, TraceChecks) and _active.training:
        raise Error(f"{op} is only supported in inference. {fix}")


def check_replicated_updates(checks: TraceChecks, options: Any) -> None:
    """Replicas broadcasting their buffers cannot have them written in place (PopTorch)."""
    if checks.updated and options.replication_factor > 1 and options.broadcast_buffers:
        raise Error(
            "PopTorch does not support broadcasting buffers. If your model is able to "
            "tolerate buffers becoming out of sync between replicas, you can disable "
            "buffer broadcasting using poptorch.Options.broadcastBuffers(False). "
            f"Written in place by forward(): {', '.join(checks.updated)}."
        )


# BatchNorm replaces its statistics' tensors as it likes; PopTorch does not check them.
_BUFFERS_CAN_CHANGE = (_BatchNorm,)


def tensor_addresses(model: torch.nn.Module) -> tuple[dict, dict]:
    """Buffers and parameters of ``model`` by name: (tensor, storage address) each."""
    buffers = {
        name: (t, t.data_ptr())
        for prefix, m in model.named_modules()
        if not isinstance(m, _BUFFERS_CAN_CHANGE)
        for name, t in m.named_buffers(prefix=prefix, recurse=False)
    }
    params = {name: (t, t.data_ptr()) for name, t in model.named_parameters()}
    return buffers, params


def check_addresses(before: tuple[dict, dict], after: tuple[dict, dict]) -> None:
    """Raise if ``forward`` removed or reassigned a buffer or parameter (PopTorch's check)."""
    for kind, old, new in zip(("Buffer", "Parameter"), before, after):
        for name, (_, address) in old.items():
            if name not in new:
                raise Error(
                    f"{kind} {name} is removed from the model when calling the forward method."
                )
            if new[name][1] != address:
                raise Error(
                    f"{kind} {name} is reassigned within the model when calling the "
                    "forward method. This is not supported. Consider using "
                    f"self.{name}.copy_(src) to copy data from a source tensor, where "
                    "src is the name of the source tensor."
                )


def check_options(options: Any) -> None:
    """Options a compile on a host without IPU hardware rejects, and an offline target's; a
    warning where profiling is asked for (no Poplar engine, no report)."""
    if options.connection_type == ConnectionType.Never:  # useOfflineIpuTarget
        # PopTorch's createDevice: an offline target is a Poplar device of its own.
        if rules.uses_ipu_model(options):
            raise Error(
                "ConnectionType.Never / poptorch.Options.useOfflineIpuTarget not "
                "supported for the IPU model: call useIpuModel(False) (or unset "
                "POPTORCH_IPU_MODEL) to compile for an offline IPU target."
            )
        if options.exists("ipu_id"):
            raise Error(
                "Offline compilation targeting a specific id not supported: remove "
                "Options.useIpuId() when using useOfflineIpuTarget()."
            )
    engine = options._Popart.options.get("engineOptions", {})
    if any(k.startswith("autoReport.") for k in engine) or "autoReport." in os.environ.get(
        "POPLAR_ENGINE_OPTIONS", ""
    ):
        _logging.logger.warning(
            "Profiling is on (Options.enableProfiling or Poplar's autoReport engine options), "
            "but the ipuloop emulator has no Poplar engine to profile and writes no PopVision "
            "report: use ipuloop.callbacks.ProfileCapture or torch.profiler for a host trace."
        )
    if options._Popart.options.get("instrumentWithHardwareCycleCounter"):
        raise Error(
            "Cycle count logging is only supported on actual IPU hardware. The ipuloop "
            "emulator has no cycle counters: set poptorch.Options().logCycleCount(False) "
            "(time host calls instead, e.g. ipuloop.callbacks.ProfileCapture)."
        )


def _backward_error(*args: Any, **kwargs: Any) -> None:
    raise Error(
        "backward() cannot be called explicitly on outputs of a PopTorch model. If "
        "you're using a trainingModel, the backwards pass is performed automatically "
        "when invoking the model. If you're using an inferenceModel, you should use a "
        "trainingModel instead."
    )


def forbid_backward(out: Any) -> Any:
    """``out`` with ``backward()`` of each of its tensors raising PopTorch's error."""
    if isinstance(out, torch.Tensor):
        out.backward = _backward_error  # type: ignore[method-assign]
    elif isinstance(out, (tuple, list)):
        for o in out:
            forbid_backward(o)
    elif isinstance(out, dict):
        for o in out.values():
            forbid_backward(o)
    return out


def check_updatable_buffers(options: Any, model: torch.nn.Module) -> None:
    """``Options.updatableNamedBuffers`` must name buffers of ``model``."""
    unknown = sorted(
        set(options._Popart.options.get("updatableNamedBuffers", ()))
        - {name for name, _ in model.named_buffers()}
    )
    if unknown:
        raise Error(
            f"Options.updatableNamedBuffers names {unknown}, which are not buffers of "
            "the model: use names from model.named_buffers()."
        )


def check_stages(trace: Any, options: Any, training: bool, di: int, ga: int, rf: int) -> int:
    """Check a traced model's pipeline stages against GA (training) or DI (inference), and the
    IPUs it needs against what PopTorch can reserve; returns that number of IPUs."""
    f = trace.num_forward_stages
    if trace.is_pipelined and f > 1:
        if training and ga < 2 * f - 1:
            raise Error(
                "poptorch.Options().Training.gradientAccumulation must be greater than or "
                f"equal to the number of pipeline stages ({2 * f - 1}) when using "
                f"poptorch.PipelinedExecution. Please note that a model with {f} pipeline "
                f"stages in PopTorch will have an additional {f - 1} stages when training. "
                f"Received: gradientAccumulation={ga}."
            )
        if not training and di < f:
            raise Error(
                "poptorch.Options().deviceIterations must be greater than or equal to the "
                f"number of pipeline stages ({f}) when using poptorch.PipelinedExecution. "
                f"Received: deviceIterations={di}."
            )
    ipus = trace.ipus or {0}
    per_replica = max(len(ipus), max(ipus) + 1)
    n = per_replica * rf
    problem = rules.ipu_count_error(options, rf, per_replica)
    if problem is not None:
        raise Error(
            f"The model needs {per_replica} IPU(s) per replica x replicationFactor({rf}): {problem}"
        )
    reserved = rules.reserved_ipus(options, n)
    if reserved != n:
        _logging.logger.warning("Reserving %d IPUs instead of %d (autoRoundNumIPUs).", reserved, n)
    system = device_state.system_ipus()
    if (
        system
        and reserved > system
        and not rules.uses_ipu_model(options)
        and options.connection_type != ConnectionType.Never
    ):  # as attaching on a system with fewer IPUs fails
        raise Error(
            f"The model needs {reserved} IPUs ({per_replica} per replica x "
            f"replicationFactor({rf})), more than the emulated system has: "
            f"IPULOOP_EMULATOR_IPUS={system}. Use fewer replicas or IPUs, or emulate a larger "
            "system (python -m ipuloop.emulate --ipus N)."
        )
    return n
