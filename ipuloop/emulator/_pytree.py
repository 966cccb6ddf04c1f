"""``torch.utils._pytree`` as every supported torch release (2.0 to 2.14) spells it."""

from __future__ import annotations

from typing import Any, Callable

import torch.utils._pytree as _p
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "tree_flatten",
    "tree_unflatten",
    "tree_map",
    "tree_leaves",
    "register_pytree_node",
    "deregister_pytree_node",
    "SUPPORTED_NODES",
]

SUPPORTED_NODES = _p.SUPPORTED_NODES  # the registered types (one dict in every release)

if hasattr(_p, "tree_leaves"):
    tree_leaves = _p.tree_leaves
else:  # torch 2.0

    def tree_leaves(tree: Any) -> list[Any]:
        return tree_flatten(tree)[0]


def register_pytree_node(cls: type, flatten: Callable, unflatten: Callable) -> None:
    register = getattr(_p, "register_pytree_node", None) or _p._register_pytree_node
    register(cls, flatten, unflatten)


def deregister_pytree_node(cls: type) -> None:
    if hasattr(_p, "_deregister_pytree_node"):
        _p._deregister_pytree_node(cls)
    else:  # torch 2.0 keeps the registry in one dict
        _p.SUPPORTED_NODES.pop(cls, None)
