"""What a host call hands back: its outputs, row by row as the output mode returns them, and
the tensors anchored with ``Options.anchorTensor``.

The emulator can anchor what exists outside the model's forward: each parameter (its device
value), "Gradient___<name>" (its per-micro-batch gradient, times loss_scaling) and
"UpdatedVar___<name>" (its value after the call's last update). "model." may prefix <name>.
With automatic loss scaling, also "finalLossScale" and "lossScaleUpdateFactor" (Final).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch

from ... import rules
from .. import _pytree as pytree
from ..enums import OutputMode
from ..errors import Error

__all__ = [
    "out_leaves",
    "out_unflatten",
    "to_host",
    "assemble",
    "NARROWED",
    "Anchors",
    "register_mappings",
]

NARROWED = frozenset({torch.int64, torch.float64})  # outputs ``to_host`` narrows


def register_mappings(out: Any) -> None:
    """PopTorch takes any dict of a forward's outputs apart by its keys and rebuilds it with
    its own type; torch's pytree only takes apart the types registered with it. Register
    each other dict type of ``out`` (a subclass such as a Transformers ``ModelOutput``), as
    ``registerCustomArgParser`` registers its types: called once, on the traced outputs."""
    items: Iterable[Any]
    if isinstance(out, dict):
        cls = type(out)
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_pytree_node(
                cls,
                lambda d: (list(d.values()), list(d.keys())),
                lambda values, keys, cls=cls: cls(dict(zip(keys, values))),
            )
        items = out.values()
    elif isinstance(out, (tuple, list)):
        items = out
    else:
        return
    for item in items:
        register_mappings(item)


def out_leaves(out: Any) -> tuple[list[Any], Any]:
    """A forward's outputs as leaves and a spec for ``out_unflatten`` (None: one tensor; an
    int: a tuple of that many tensors; else a pytree spec)."""
    if isinstance(out, torch.Tensor):
        return [out], None
    if type(out) is tuple:
        for o in out:
            if not isinstance(o, torch.Tensor):
                return pytree.tree_flatten(out)
        return list(out), len(out)
    return pytree.tree_flatten(out)


def out_unflatten(leaves: list[Any], spec: Any) -> Any:
    """Undo ``out_leaves``."""
    if spec is None:
        return leaves[0]
    if isinstance(spec, int):
        return tuple(leaves)
    return pytree.tree_unflatten(leaves, spec)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """An output as the host receives it: the IPU has no 64-bit types (int64 comes back as
    int32, float64 as float32), on the CPU."""
    if t.dtype == torch.int64:
        t = t.to(torch.int32)
    elif t.dtype == torch.float64:
        t = t.to(torch.float32)
    return t if t.is_cpu else t.cpu()


def assemble(rows: list[list[Any]], tensor_out: list[bool], spec: Any) -> Any:
    """The call's return value from its returned rows (each a micro-batch's output leaves, or
    a replica's sum): scalars stack, other tensors concatenate, non-tensors come from row 0."""
    if len(rows) == 1:
        leaves = [to_host(t) if isinstance(t, torch.Tensor) else t for t in rows[0]]
    else:
        leaves = []
        for i, is_tensor in enumerate(tensor_out):
            col = [row[i] for row in rows]
            if not is_tensor:
                leaves.append(col[0])
            elif col[0].dim() == 0:
                leaves.append(to_host(torch.stack(col)))
            else:
                leaves.append(to_host(torch.cat(col)))
    return out_unflatten(leaves, spec)


class Anchors:
    """The tensors ``options`` anchor for a compiled executor.

    ``weights`` is its ``DeviceWeights``; ``factors`` (DI, GA, RF, Mean reduction) its host
    call's; ``version()`` counts its training calls (a gradient recorded in an earlier call is
    not this call's).
    """

    def __init__(
        self,
        options: Any,
        training: bool,
        weights: Any,
        factors: tuple[int, int, int, bool],
        version: Callable[[], int],
        scalars: dict[str, Callable[[], torch.Tensor]] | None = None,
    ) -> None:
        self._training = training
        self._scalars = dict(scalars or {})  # name -> its current value (one per call)
        self._weights = weights
        self._factors = factors
        self._version = version
        self._anchors: dict[str, tuple[str, Any, OutputMode, int]] = {}
        self._grads: dict[int, list] = {}
        self._hooks: list[Any] = []
        if options.anchored_tensors:
            self._setup(options)

    def names(self) -> dict[str, tuple[str, int]]:
        """Each name anchorTensor accepts: (kind, index of the parameter)."""
        names = {}
        index = {id(p): i for i, p in enumerate(self._weights.host_params)}
        for name, p in self._weights.model.named_parameters():
            i = index[id(p)]
            for kind in ("", "Gradient___", "UpdatedVar___") if self._training else ("",):
                names[kind + name] = (kind, i)
        for name in self._scalars:
            names[name] = ("Scalar", -1)
        return names

    def _setup(self, o: Any) -> None:
        names = self.names()
        model_mode = OutputMode(o.output_mode)
        for short, (long_name, inherit, mode, period) in o.anchored_tensors.items():
            kind_name = long_name
            for kind in ("Gradient___", "UpdatedVar___", ""):
                if long_name.startswith(kind + "model.") and long_name not in names:
                    kind_name = kind + long_name[len(kind) + len("model.") :]
                    break
            if kind_name not in names:
                raise Error(
                    f"Options.anchorTensor({short!r}, {long_name!r}): the ipuloop emulator "
                    "can anchor a parameter, its gradient or its updated value. Valid "
                    f"names: {', '.join(names)} (see getTensorNames())."
                )
            kind, i = names[kind_name]
            mode = model_mode if inherit else OutputMode(mode)
            period = o.output_return_period if inherit else period
            if kind != "Gradient___" and mode != OutputMode.Final:
                raise Error(
                    f"Options.anchorTensor({short!r}, {long_name!r}) with output mode "
                    f"{mode.name}: the ipuloop emulator anchors weights and updated "
                    "weights with OutputMode.Final only. Pass output_mode="
                    "poptorch.OutputMode.Final to anchorTensor."
                )
            if mode == OutputMode.EveryN:
                rules.check_return_period(
                    period,
                    self._factors[0],
                    Error,
                    f"anchorTensor({short!r}, ..., EveryN, {period})",
                )
            self._anchors[short] = (kind, kind_name if kind == "Scalar" else i, mode, period)
            if kind == "Gradient___" and i not in self._grads:
                self._grads[i] = [-1, []]
                self._hooks.append(
                    self._weights.host_params[i].register_hook(
                        functools.partial(self._record_gradient, self._grads[i])
                    )
                )

    def parameters(self) -> set[int]:
        """Indices (in the weights' ``host_params``) of the parameters anchored."""
        return {i for _, i, _, _ in self._anchors.values()}

    def remove(self) -> None:
        """Remove the gradient hooks (the executor recompiles or is destroyed)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _record_gradient(self, record: list, grad: torch.Tensor) -> None:
        # One call per micro-batch backward, in [DI, GA, RF] order. The executor scaled the loss
        # by loss_scaling / (GA*RF) under Mean: undo the 1 / (GA*RF) to report the micro-batch's.
        version = self._version()
        if record[0] != version:
            record[0], record[1] = version, []
        _, ga, rf, mean = self._factors
        grad = grad.detach()
        record[1].append(grad * (ga * rf) if mean and ga * rf > 1 else grad.clone())

    def get(self, short_name: str) -> torch.Tensor:
        """The value of the tensor anchored as ``short_name`` in the last call."""
        assert short_name in self._anchors, "No tensor with name " + short_name + " found."
        kind, i, mode, period = self._anchors[short_name]
        di, ga, rf, _ = self._factors
        if kind == "Scalar":  # i: its name
            return self._scalars[i]()
        if kind != "Gradient___":  # Final: one copy per replica (replicas hold equal weights)
            w = self._weights.dev_params[i].detach()
            return to_host(
                w.clone() if rf == 1 else torch.cat([w] * rf) if w.dim() else w.repeat(rf)
            )
        version, grads = self._grads[i]
        assert version == self._version() - 1 and len(grads) == di * ga * rf, (
            "No tensor with name " + short_name + " found: run the model first."
        )
        rows = [
            sum((grads[j] for j in row[1:]), grads[row[0]])
            for row in rules.returned_rows(mode, di, ga, rf, period)
        ]
        if len(rows) == 1:
            return to_host(rows[0])
        return to_host(torch.stack(rows) if rows[0].dim() == 0 else torch.cat(rows))
