"""Layers placed on IPUs as an `IPUConfig` says: a `BeginBlock` per layer, the execution
strategy `to_options` sets, and a recomputation checkpoint after each layer where asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["place_layers", "unplace_layers", "strategy"]


class Placing(Protocol):
    """What placing layers reads of an `IPUConfig`."""

    recompute_checkpoint_every_layer: bool

    def layer_ipu(
        self, num_layers: int | Sequence[Any] | None, *, for_inference: bool = False
    ) -> list[int]: ...


def strategy(pt: Any, *, for_inference: bool) -> Any:
    auto = pt.AutoStage.AutoIncrement
    return pt.ShardedExecution(auto) if for_inference else pt.PipelinedExecution(auto)


class _CheckpointedForward:
    """Instance-level `forward` recomputing the layer's activations in backward (emulator).

    Holds the bound original, so `copy.deepcopy(model)` rebinds it to the copy."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


class _RecomputeHook:
    """Forward hook: `poptorch.recomputationCheckpoint` on the layer's output(s) (hardware)."""

    def __init__(self, pt: Any) -> None:
        self.pt = pt

    def __call__(self, module: Any, inputs: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return self.pt.recomputationCheckpoint(output)
        if isinstance(output, tuple):  # PopTorch takes tensors only: the rest pass through
            return tuple(
                self.pt.recomputationCheckpoint(y) if isinstance(y, torch.Tensor) else y
                for y in output
            )
        return output


def place_layers(
    layers: Sequence[torch.nn.Module], config: Placing, *, for_inference: bool = False
) -> Any:
    """Annotate `layers` so each IPU gets its layers (`config.layer_ipu`); return the strategy.

    Every layer gets `BeginBlock(layer, user_id=f"ipu{k}", ipu_id=k)`: one block per IPU, so
    each layer says where it runs even when the model calls code between layers. Returns
    `PipelinedExecution(AutoStage.AutoIncrement)` (training) or `ShardedExecution(...)`
    (inference), the strategies `to_options` sets. With `recompute_checkpoint_every_layer`
    (training only), each layer's output is a recomputation checkpoint: PopTorch's
    `recomputationCheckpoint` on an IPU, `torch.utils.checkpoint` on the emulator.
    Layers already placed raise `poptorch.Error`; call `unplace_layers` first.
    """
    from ipuloop.backend import backend_name, poptorch_module

    pt = poptorch_module()
    layers = list(layers)
    checkpointing = config.recompute_checkpoint_every_layer and not for_inference
    for layer, ipu in zip(layers, config.layer_ipu(len(layers), for_inference=for_inference)):
        pt.BeginBlock(layer, user_id=f"ipu{ipu}", ipu_id=ipu)
        if checkpointing and backend_name() == "emulator":
            if not isinstance(layer.__dict__.get("forward"), _CheckpointedForward):
                layer.forward = _CheckpointedForward(layer.forward)
        elif checkpointing:
            if not any(isinstance(h, _RecomputeHook) for h in layer._forward_hooks.values()):
                layer.register_forward_hook(_RecomputeHook(pt))
    return strategy(pt, for_inference=for_inference)


def unplace_layers(layers: Sequence[torch.nn.Module]) -> None:
    """Undo `place_layers`: `poptorch.removeBlocks` (recursive) and remove the checkpointing."""
    from ipuloop.backend import poptorch_module

    pt = poptorch_module()
    for layer in layers:
        pt.removeBlocks(layer)
        if isinstance(layer.__dict__.get("forward"), _CheckpointedForward):
            del layer.__dict__["forward"]
        for key, hook in list(layer._forward_hooks.items()):
            if isinstance(hook, _RecomputeHook):
                del layer._forward_hooks[key]
