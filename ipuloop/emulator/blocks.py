"""Model-parallel annotations (Block, BeginBlock, ...) and execution strategies.

Outside ``trace_stages`` every annotation is a no-op costing one attribute read, exactly as
PopTorch's are on CPU. The executor wraps the trace of its first micro-batch in
``trace_stages(strategy)`` to learn how many forward pipeline stages the model has (F) and
which IPUs it uses, following docs/poptorch-semantics.md §5, and to check a phased execution's
phases. Every strategy runs the unsplit model's arithmetic.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from ._pytree import tree_leaves
from .enums import AutoStage, Liveness
from .errors import Error

__all__ = [
    "AutoStage",
    "BeginBlock",
    "Block",
    "BlockFunction",
    "ParallelPhasedExecution",
    "Phase",
    "PipelinedExecution",
    "SerialPhasedExecution",
    "ShardedExecution",
    "module_repr",
    "Stage",
    "StageTrace",
    "removeBlocks",
    "trace_stages",
]


class Stage:
    """One or more blocks that run on one IPU. ``Stage("A", "B").ipu(1)``."""

    def __init__(self, *block_ids: str) -> None:
        assert all(isinstance(b, str) for b in block_ids), (
            f"Block IDs are supposed to be strings but got {block_ids}"
        )
        self._blocks = block_ids
        self._stage_id = -1
        self._phase_id = -1
        self._ipu: int | None = None

    @property
    def blocks(self) -> tuple[str, ...]:
        """Ids of the blocks this stage is made of."""
        return self._blocks

    def ipu(self, ipu: int) -> Stage:
        """Run this stage on IPU ``ipu`` (overrides the blocks' ``ipu_id``)."""
        assert isinstance(ipu, int) and ipu >= 0, (
            f"Stage.ipu expects an int >= 0. Received: ipu={ipu!r}."
        )
        self._ipu = ipu
        return self


class StageTrace:
    """What one traced forward pass revealed; also resolves block -> stage -> IPU while tracing."""

    def __init__(self, strategy: _IExecutionStrategy) -> None:
        self.is_pipelined: bool = strategy._pipelined
        self._phased = strategy if isinstance(strategy, _IPhasedExecution) else None
        self.blocks: list[tuple[str, int, int]] = []  # (block id, stage id, ipu) in entry order
        self._strategy = strategy
        self._auto_stages: dict[str, Stage] = {}
        self._next_stage_id = 1
        self._next_auto_id = 0
        self._hook_ids: dict[int, str] = {}
        self._current_ipu = 0  # PopTorch's counter starts on IPU 0
        self._changes = 0
        self._ran_before_first_block = False
        self.in_block = True  # ops before the first block run on IPU 0; leaving a block ends it
        self._entered: set[str] = set()
        # id(tensor) -> (weak reference, stage that computed it), while pipelined
        self.produced: dict[int, tuple[Any, int]] = {}

    @property
    def num_forward_stages(self) -> int:
        """F: IPU changes seen while tracing + 1."""
        return self._changes + 1

    @property
    def ipus(self) -> set[int]:
        """IPUs used; IPU 0 counts when code ran before the first block (or there is no block)."""
        used = {ipu for _, _, ipu in self.blocks}
        if self._ran_before_first_block or not self.blocks:
            used.add(0)
        return used

    def _auto_id(self, key: object | None) -> str:
        if key is not None and id(key) in self._hook_ids:  # a BeginBlock keeps its auto id
            return self._hook_ids[id(key)]
        block_id = str(self._next_auto_id)
        self._next_auto_id += 1
        if key is not None:
            self._hook_ids[id(key)] = block_id
        return block_id

    def _stage(self, block_id: str, ipu_from_block: int | None) -> Stage:
        block_map = self._strategy._block_map
        if block_map:
            assert block_id in block_map, (
                f"Unknown Block '{block_id}' list of expected Blocks: {list(block_map)}"
            )
            return block_map[block_id]
        if block_id not in self._auto_stages:
            stage = Stage(block_id)
            if self._strategy._auto_stage == AutoStage.SameAsIpu:
                assert ipu_from_block is not None, (
                    f"poptorch.AutoStage.SameAsIpu was selected but no IPU was specified for block "
                    f"{block_id}. Pass ipu_id=... to the block, or use "
                    f"PipelinedExecution(AutoStage.AutoIncrement) or explicit stages."
                )
                stage._stage_id = ipu_from_block
            else:
                stage._stage_id = self._next_stage_id
                self._next_stage_id += 1
            self._auto_stages[block_id] = stage
        return self._auto_stages[block_id]

    def begin(self, user_id: str | None, ipu_id: int | None, key: object | None = None) -> None:
        """Start block ``user_id`` (auto id when None) requested on ``ipu_id``."""
        block_id = user_id or self._auto_id(key)
        stage = self._stage(block_id, ipu_id)
        ipu = stage._ipu if stage._ipu is not None else ipu_id
        if ipu is None:
            ipu = stage._stage_id
        # A block entered again (a stage revisited, e.g. a decoder's positions in the
        # embeddings' block) takes its ops into its stage, as PopTorch does; they may then use
        # no later stage's tensors (``_OpWatcher``). A new block must not go back.
        if (
            self.is_pipelined
            and self.blocks
            and block_id not in self._entered
            and stage._stage_id < max(s for _, s, _ in self.blocks)
        ):
            raise Error(
                f"Pipeline stages must be used in ascending order: block '{block_id}' (stage "
                f"{stage._stage_id}) runs after stage {self.blocks[-1][1]}. Reorder the stages, or "
                f"use PipelinedExecution(AutoStage.AutoIncrement) when an IPU is revisited."
            )
        if self._phased is not None:
            self._phased.check_block(block_id, stage, ipu)
        if ipu != self._current_ipu:
            self._changes += 1
            self._current_ipu = ipu
        self.blocks.append((block_id, stage._stage_id, ipu))
        self._entered.add(block_id)
        self.in_block = True

    def end(self) -> None:
        """A ``with Block`` ended: ops that follow belong to no block until the next one."""
        self.in_block = False

    def reset_auto_id(self) -> None:
        self._next_auto_id = 0


class _OpWatcher(TorchFunctionMode):
    """Notes whether any torch op ran before the first block (that code lives on IPU 0), and
    rejects an op outside every block after a ``with Block`` ended, as PopTorch does."""

    def __init__(self, trace: StageTrace) -> None:
        super().__init__()
        self._trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        trace = self._trace
        if trace.is_pipelined and trace.blocks and getattr(func, "__name__", "") != "__get__":
            self._check_data_flow(func, args, kwargs, out)
        if getattr(func, "__name__", "") != "__get__" and isinstance(out, torch.Tensor):
            if not self._trace.in_block:
                raise Error(
                    f"No active Block, all the ops must belong to a Block: "
                    f"{getattr(func, '__name__', func)}() runs after a `with "
                    "poptorch.Block(...)` ended and before the next block began. Move it "
                    "into a block (for example the loss into the last block)."
                )
            if not self._trace.blocks:
                self._trace._ran_before_first_block = True
        return out

    def _check_data_flow(self, func, args, kwargs, out) -> None:
        """An op of a pipeline stage uses no tensor that a later stage computed (which a
        revisited block could do); its outputs are its stage's."""
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:  # a query (dim(), is_floating_point()...): no op on the device
            return
        trace = self._trace
        block_id, stage, _ = trace.blocks[-1]
        produced = trace.produced
        for t in tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor):
                entry = produced.get(id(t))
                if entry is not None and entry[1] > stage and entry[0]() is t:
                    raise Error(
                        f"Pipeline stages must be used in ascending order: "
                        f"{getattr(func, '__name__', func)}() in block '{block_id}' (stage "
                        f"{stage}) uses a tensor computed in the later stage {entry[1]}."
                    )
        for t in outputs:
            produced[id(t)] = (weakref.ref(t), stage)


@contextlib.contextmanager
def trace_stages(strategy: _IExecutionStrategy | None = None) -> Iterator[StageTrace]:
    """Record blocks entered while the body runs: ``with trace_stages(s) as t: model(x)``."""
    trace = StageTrace(strategy if strategy is not None else PipelinedExecution())
    previous, Block._trace = Block._trace, trace
    try:
        with _OpWatcher(trace):
            yield trace
    finally:
        Block._trace = previous


def _check_ids(user_id: Any, ipu_id: Any) -> None:
    # An int is PopTorch's legacy form: a block id of its own (Stage ids must then match it).
    if user_id is not None and (not isinstance(user_id, (str, int)) or isinstance(user_id, bool)):
        raise TypeError(
            f"Block user_id must be a str, an int or None. Received: user_id={user_id!r}."
        )
    if ipu_id is not None and not (isinstance(ipu_id, int) and ipu_id >= 0):
        raise TypeError(f"Block ipu_id must be an int >= 0 or None. Received: ipu_id={ipu_id!r}.")


class Block:
    """Context manager: code inside runs in block ``user_id`` on IPU ``ipu_id``."""

    _trace: StageTrace | None = None  # set only inside trace_stages()
    __slots__ = ("_user_id", "_ipu_id")

    def __init__(self, user_id: str | None = None, ipu_id: int | None = None) -> None:
        _check_ids(user_id, ipu_id)
        self._user_id = user_id
        self._ipu_id = ipu_id

    @staticmethod
    def useAutoId() -> None:
        """Restart automatic block ids at "0" (call at the start of ``forward``)."""
        if Block._trace is not None:
            Block._trace.reset_auto_id()

    @staticmethod
    def start(user_id: str | None = None, ipu_id: int | None = None) -> None:
        """Start a block without a ``with`` statement."""
        if Block._trace is not None:
            Block._trace.begin(user_id, ipu_id)

    def __enter__(self) -> Block:
        if Block._trace is not None:
            Block._trace.begin(self._user_id, self._ipu_id)
        return self

    def __exit__(self, *exc_info: object) -> None:
        # As in PopTorch, leaving a block does not move code back to an earlier one: ops that
        # follow belong to no block, an error until the next block begins.
        if Block._trace is not None:
            Block._trace.end()
        return None


class _BlockHook:
    """Forward pre-hook registered by ``BeginBlock``."""

    def __init__(self, user_id: str | None, ipu_id: int | None) -> None:
        self._user_id = user_id
        self._ipu_id = ipu_id

    def __call__(self, module: torch.nn.Module, inputs: Any) -> None:
        if Block._trace is not None:
            Block._trace.begin(self._user_id, self._ipu_id, key=self)

    def __repr__(self) -> str:
        return f"BeginBlock(user_id={self._user_id}, ipu_id={self._ipu_id})"


class _LegacyBeginBlockFn:
    """``BeginBlock`` applied to a plain callable (old PopTorch API): returns a wrapper, with
    PopTorch's ``_user_id`` and ``_ipu_id``; it pickles when the callable does."""

    def __init__(self, fn: Callable[..., Any], user_id: str | None, ipu_id: int | None) -> None:
        self._fn = fn
        self._hook = _BlockHook(user_id, ipu_id)

    @property
    def _user_id(self) -> str | None:
        return self._hook._user_id

    @property
    def _ipu_id(self) -> int | None:
        return self._hook._ipu_id

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._hook(None, args)
        return self._fn(*args, **kwargs)


def module_repr(m: torch.nn.Module) -> str:
    """``repr(m)`` with each module's forward pre-hooks (its ``BeginBlock``) before its name."""
    extra = m.extra_repr()
    lines = extra.split("\n") if extra else []
    lines += [
        f"({name}): " + (module_repr(child) if child is not None else "None").replace("\n", "\n  ")
        for name, child in m._modules.items()
    ]
    hooks = "".join(f"{hook!r} " for hook in m._forward_pre_hooks.values())
    if len(lines) == 1 and extra and not m._modules:
        body = lines[0]
    else:
        body = "\n  " + "\n  ".join(lines) + "\n" if lines else ""
    return f"{hooks}{m._get_name()}({body})"


def BeginBlock(
    layer_to_call: torch.nn.Module, user_id: str | None = None, ipu_id: int | None = None
) -> torch.nn.Module:
    """Start block ``user_id`` (on ``ipu_id``) each time ``layer_to_call`` runs; returns it."""
    _check_ids(user_id, ipu_id)
    if not isinstance(layer_to_call, torch.nn.Module):
        if callable(layer_to_call):
            return _LegacyBeginBlockFn(layer_to_call, user_id, ipu_id)  # type: ignore[return-value]
        raise Error(
            "module is not an instance of torch.nn.Module or function. "
            f"Received: {type(layer_to_call).__name__}."
        )
    if any(isinstance(h, _BlockHook) for h in layer_to_call._forward_pre_hooks.values()):
        raise Error(
            "module has already been assigned to a block. Call "
            "poptorch.removeBlocks(module) first to re-assign it."
        )
    layer_to_call.register_forward_pre_hook(_BlockHook(user_id, ipu_id))
    return layer_to_call


def BlockFunction(
    user_id: str | None = None, ipu_id: int | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the decorated function runs inside ``Block(user_id, ipu_id)``."""
    _check_ids(user_id, ipu_id)

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with Block(user_id, ipu_id):
                return func(*args, **kwargs)

        return wrapper

    return decorator


def removeBlocks(module: torch.nn.Module) -> None:
    """Remove every ``BeginBlock`` annotation from ``module`` and its sub-modules."""
    assert isinstance(module, torch.nn.Module), (
        f"removeBlocks expects a torch.nn.Module. Received: {type(module).__name__}."
    )
    for m in module.modules():
        for key in [k for k, h in m._forward_pre_hooks.items() if isinstance(h, _BlockHook)]:
            del m._forward_pre_hooks[key]
            m._forward_pre_hooks_with_kwargs.pop(key, None)


class _IExecutionStrategy:
    """Base of the execution strategies: maps block ids to stages."""

    _pipelined = False

    def __init__(self, block_map: dict[str, Stage], auto_stage: AutoStage) -> None:
        self._block_map = block_map
        self._auto_stage = auto_stage

    def stage(self, block_id: str) -> Stage:
        """The ``Stage`` that ``block_id`` belongs to (explicit stages only)."""
        assert block_id in self._block_map, f"Unknown block {block_id}"
        return self._block_map[block_id]

    def backendOptions(self) -> dict[str, Any]:
        return {}


class PipelinedExecution(_IExecutionStrategy):
    """Pipeline the stages: ``PipelinedExecution(AutoStage)`` or stages as ids/id lists/Stages."""

    _pipelined = True

    def __init__(self, *args: Any) -> None:
        block_map: dict[str, Stage] = {}
        auto_stage = AutoStage.SameAsIpu
        if len(args) == 1 and isinstance(args[0], AutoStage):
            auto_stage = args[0]
        else:
            for stage_id, arg in enumerate(args):
                if isinstance(arg, Stage):
                    stage = arg
                elif isinstance(arg, str):
                    stage = Stage(arg)
                else:
                    assert all(isinstance(b, str) for b in arg), (
                        "Stages must be Stage objects, block ids or lists of block ids. "
                        f"Received: {arg!r}."
                    )
                    stage = Stage(*arg)
                stage._stage_id = stage_id
                for block in stage.blocks:
                    assert block not in block_map, f"{block} associated with more than one stage"
                    block_map[block] = stage
        super().__init__(block_map, auto_stage)

    def backendOptions(self) -> dict[str, Any]:
        return {"execution_mode": 0}


class ShardedExecution(PipelinedExecution):
    """Run the stages one after another on their IPUs (same constructor, no pipelining)."""

    _pipelined = False

    def backendOptions(self) -> dict[str, Any]:
        return {"execution_mode": 1}


class Phase:
    """Stages executed in parallel within one execution phase."""

    def __init__(self, *arg: str | Stage) -> None:
        if all(isinstance(a, Stage) for a in arg):
            self.stages: tuple[Stage, ...] | list[Stage] = arg
        else:
            assert all(isinstance(a, str) for a in arg), (
                "All arguments must either be block IDs (strings) or Stages: "
                f"{[type(a) for a in arg]}"
            )
            self.stages = [Stage(*arg)]

    def stage(self, idx: int) -> Stage:
        return self.stages[idx]

    def ipus(self, *ipus: int) -> None:
        """Assign one IPU to each stage of this phase."""
        assert len(ipus) == len(self.stages), (
            f"Phase contains {len(self.stages)} stages but you provided {len(ipus)} ipus"
        )
        for stage, ipu in zip(self.stages, ipus):
            stage.ipu(ipu)


class _IPhasedExecution(_IExecutionStrategy):
    """Phased execution: where each block's weights and activations live between phases, a
    memory and scheduling plan; the arithmetic is the unsplit model's (as for sharding). A
    trace checks each block's phase and IPU as PopTorch's compiler does (``check_block``)."""

    _serial = True

    def __init__(self, *phases: Phase | list[Any]) -> None:
        assert phases, (
            "There is currently no AutoStage for PhasedExecution, please explicitly "
            "specify the phases"
        )
        self._tensors_liveness = Liveness.AlwaysLive
        self._separate_backward_phase = False
        self._phases: list[Phase] = []
        block_map: dict[str, Stage] = {}
        for phase_id, arg in enumerate(phases):
            if not isinstance(arg, Phase):
                arg = Phase(*(arg if isinstance(arg, list) else [arg]))
            phase = arg
            self._phases.append(phase)
            for stage in phase.stages:
                stage._phase_id = phase_id
                for block in stage.blocks:
                    assert block not in block_map, f"{block} associated with more than one stage"
                    block_map[block] = stage
        super().__init__(block_map, AutoStage.SameAsIpu)

    def phase(self, phase: int) -> Phase:
        assert isinstance(phase, int) and phase >= 0, "Phases are identified by positive integers"
        return self._phases[phase]

    def useSeparateBackwardPhase(self, use: bool = True) -> _IPhasedExecution:
        assert isinstance(use, bool)
        self._separate_backward_phase = use
        return self

    def backendOptions(self) -> dict[str, Any]:
        return {
            "execution_mode": 2,
            "separate_backward_phase": self._separate_backward_phase,
            "tensors_liveness": int(self._tensors_liveness),
        }

    def check_block(self, block_id: str, stage: Stage, ipu: int) -> None:
        """PopTorch's checks (``Compiler::setActiveIpu``) as block ``block_id`` of ``stage``
        starts on ``ipu`` (-1: neither the stage nor the block named one)."""
        kind = type(self).__name__
        liveness = Liveness(self._tensors_liveness)
        # Off-chip liveness modes space the forward phases 2 or 4 apart, serial phases only.
        spacing = {Liveness.OffChipAfterFwdNoOverlap: 2, Liveness.OffChipAfterEachPhase: 4}.get(
            liveness, 1
        )
        if spacing > 1 and not self._serial:
            raise Error(
                f"This is only supported for serial phase execution: {kind} with "
                f"tensors liveness {liveness.name}. Use SerialPhasedExecution, or "
                "Liveness.AlwaysLive / OffChipAfterFwd."
            )
        if ipu < 0:
            raise Error(
                f"{kind}: block '{block_id}' (phase {stage._phase_id}) has no IPU. Give "
                "its stage one with Stage(...).ipu(n) or Phase(...).ipus(...), or the "
                "block with Block(..., ipu_id=n)."
            )
        phase = stage._phase_id * spacing
        if not self._serial and phase % 2 != ipu % 2:
            raise Error(
                "When phases are executed in parallel: even phases must run on even "
                f"IPUs and odd phases on odd IPUs. Received: block '{block_id}' in "
                f"phase {phase} on IPU {ipu}."
            )


class ParallelPhasedExecution(_IPhasedExecution):
    """Phases alternate between two groups of IPUs: even phases on even IPUs, odd on odd."""

    _serial = False

    def sendTensorsOffChipAfterFwd(self, off_chip: bool = True) -> ParallelPhasedExecution:
        assert isinstance(off_chip, bool)
        self._tensors_liveness = Liveness.OffChipAfterFwd if off_chip else Liveness.AlwaysLive
        return self

    def backendOptions(self) -> dict[str, Any]:
        return {**super().backendOptions(), "serial_phases_execution": False}


class SerialPhasedExecution(_IPhasedExecution):
    """All phases run serially on one group of IPUs."""

    def setTensorsLiveness(self, liveness: Liveness) -> SerialPhasedExecution:
        assert isinstance(liveness, Liveness)
        self._tensors_liveness = liveness
        return self

    def backendOptions(self) -> dict[str, Any]:
        return {**super().backendOptions(), "serial_phases_execution": True}
