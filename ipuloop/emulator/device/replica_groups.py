"""Weights with one value per group of replicas: ``executor.W.replicaGrouping(...)``.

PopTorch (user guide, "Grouping tensor weights across replicas"): the host parameter holds one
slice per group along a new leading dimension, ``[groups, *shape]``; the graph is traced with
slice 0, and replica r computes with its group's slice. Gradients are all-reduced within a
group only (the Mean still divides by GA x RF, as for any weight), and the optimizer updates
each slice, its state ``[groups, *shape]`` too. ``copyWeightsToHost`` reads one value per
group (``OnePerGroup``: each group's first replica's), into the same host tensor.

On the emulator the device tensor is the whole ``[groups, *shape]`` weight. During a run
``GroupedWeights`` gives the user's parameter replica r's slice before its forward
(``use``), moves the gradient its backward left into that slice's gradient (``collect``),
and gives the parameter the whole weight and gradient back for the update (``whole``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..enums import CommGroupType, VariableRetrievalMode
from ..errors import Error
from ..optim import LAMB

__all__ = ["GroupedWeights", "ReplicaGroupingWrapper", "check_setting", "replica_groups", "resolve"]


class ReplicaGroupingWrapper:
    """What a wrapped model's parameter attribute reads as (``executor.W``): the parameter's
    attributes, plus ``replicaGrouping``, which applies to this wrapper's model only."""

    def __init__(self, executor: Any, name: str, param: torch.nn.Parameter) -> None:
        self._executor = executor
        self._name = name
        self._param = param

    def replicaGrouping(
        self,
        comm_group_type: CommGroupType,
        shards: int,
        variable_retrieval_mode: VariableRetrievalMode,
    ) -> None:
        """Give each group of replicas its own slice of this weight (see the module doc)."""
        ex = self._executor
        setting = (comm_group_type, shards, variable_retrieval_mode)
        check_setting(self._name, self._param, setting, ex._options.replication_factor)
        ex._replica_grouping[self._name] = setting  # read when the model compiles

    def __getattr__(self, attr: str) -> Any:
        if attr in ("_executor", "_name", "_param"):  # not set yet (copy, unpickling)
            raise AttributeError(attr)
        return getattr(self._param, attr)


def replica_groups(setting: tuple, rf: int) -> list[int] | None:
    """The group of each of ``rf`` replicas (None: ``CommGroupType.All``, one shared value)."""
    comm, shards, _ = setting
    if comm == CommGroupType.All:  # PopTorch: replicaGrouping has no effect
        return None
    if comm == CommGroupType.NoGrouping or shards == 1:
        return list(range(rf))
    if comm == CommGroupType.Consecutive:
        return [r // shards for r in range(rf)]
    return [r % (rf // shards) for r in range(rf)]  # Orthogonal: {0, m, 2m, ...}, m groups


def _show(value: Any) -> str:
    """An enum as the program wrote it (``CommGroupType.Orthogonal``), anything else by repr."""
    name = getattr(value, "name", None)
    return f"{type(value).__name__}.{name}" if name is not None else repr(value)


def check_setting(name: str, param: torch.Tensor, setting: tuple, rf: int) -> int:
    """Raise unless ``replicaGrouping(*setting)`` fits parameter ``name`` with ``rf``
    replicas; returns the number of groups."""
    comm, shards, mode = setting
    call = f"{name}.replicaGrouping({_show(comm)}, {shards!r}, {_show(mode)})"
    if not isinstance(comm, CommGroupType):
        raise ValueError(f"{call}: comm_group_type must be a poptorch.CommGroupType.")
    if not isinstance(mode, VariableRetrievalMode):
        raise ValueError(
            f"{call}: variable_retrieval_mode must be a poptorch.VariableRetrievalMode."
        )
    if comm in (CommGroupType.Consecutive, CommGroupType.Orthogonal) and (
        isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or rf % shards
    ):
        raise ValueError(
            f"{call}: shards is the number of replicas in each group and must "
            f"divide replicationFactor ({rf})."
        )
    groups = replica_groups(setting, rf)
    if groups is None:
        return 1
    count = max(groups) + 1
    if param.dim() == 0:
        raise Error(
            f"Scalars cannot be passed as per-replica weight tensor values: {name} is "
            "a scalar. Give it a leading dimension of one slice per replica group."
        )
    if param.shape[0] != count:
        raise Error(
            f"{call}: the host tensor holds one slice per replica group along its first "
            f"dimension, so {name} needs shape [{count}, ...] for {count} groups of "
            f"replicationFactor({rf}). Received: shape {list(param.shape)}."
        )
    if mode == VariableRetrievalMode.AllReplicas and count != rf:
        raise Error(
            f"{call}: VariableRetrievalMode.AllReplicas returns one value per replica "
            f"({rf}), which {name}'s host tensor of one slice per group ({count}) "
            "cannot hold. Use VariableRetrievalMode.OnePerGroup (replicas of a group "
            "hold the same value)."
        )
    return count


class GroupedWeights:
    """The device's grouped weights during a run (see the module doc)."""

    def __init__(self, weights: Any, entries: list[tuple[int, list[int]]]) -> None:
        """``weights``: the executor's ``DeviceWeights``; ``entries``: (index of the parameter
        in ``weights.host_params``, group of each replica)."""
        self._weights = weights
        self._entries = entries
        self._grads: list[torch.Tensor | None] = [None] * len(entries)

    @property
    def indices(self) -> frozenset[int]:
        """Indices of the grouped parameters in ``weights.host_params``."""
        return frozenset(i for i, _ in self._entries)

    def use(self, r: int) -> None:
        """Before replica ``r``'s forward: each grouped parameter is its group's slice."""
        w = self._weights
        for i, groups in self._entries:
            w.host_params[i].data = w.dev_params[i][groups[r]]

    def collect(self, r: int) -> None:
        """After replica ``r``'s backward: its gradient joins its group's (a sum, as the
        group's all-reduce is)."""
        w = self._weights
        for k, (i, groups) in enumerate(self._entries):
            p = w.host_params[i]
            if p.grad is None:
                continue
            grad = self._grads[k]
            if grad is None:
                grad = self._grads[k] = torch.zeros_like(w.dev_params[i], dtype=p.grad.dtype)
            grad[groups[r]] += p.grad
            p.grad = None

    def whole(self) -> None:
        """Before the update: each grouped parameter is its whole weight, with the gradients
        of all its groups (or none, when no replica's backward reached it)."""
        w = self._weights
        for k, (i, _) in enumerate(self._entries):
            p = w.host_params[i]
            p.data = w.dev_params[i]
            p.grad, self._grads[k] = self._grads[k], None


def resolve(
    settings: dict[str, tuple],
    model: torch.nn.Module,
    weights: Any,
    options: Any,
    optimizer: torch.optim.Optimizer | None,
) -> GroupedWeights | None:
    """At compile: the grouped weights of ``model`` as PopTorch finds them (by parameter name,
    those ``replicaGrouping`` named), checked; None when there are none."""
    if not settings:
        return None
    rf = options.replication_factor
    index = {id(p): i for i, p in enumerate(weights.host_params)}
    entries = []
    for name, p in model.named_parameters():
        if name not in settings:
            continue
        check_setting(name, p, settings[name], rf)
        groups = replica_groups(settings[name], rf)
        if groups is not None:
            entries.append((index[id(p)], groups))
    if not entries:
        return None
    if options.Distributed.numProcesses > 1:
        raise Error(
            "replicaGrouping with Distributed.numProcesses > 1 is not supported by the "
            "ipuloop emulator: run the replicas in one process (replicationFactor)."
        )
    if optimizer is not None:
        # The update of a grouped weight must be element-wise to be its groups' own updates:
        # LAMB's trust ratio and gradient clipping take norms, which each replica takes of its
        # own slices on an IPU.
        if isinstance(optimizer, LAMB) or getattr(optimizer, "max_grad_norm", math.inf) != math.inf:
            raise Error(
                "replicaGrouping with LAMB or max_grad_norm is not supported by the "
                "ipuloop emulator (each replica takes its own norms on an IPU): use "
                "SGD, Adam, AdamW or RMSprop without max_grad_norm."
            )
    return GroupedWeights(weights, entries)
