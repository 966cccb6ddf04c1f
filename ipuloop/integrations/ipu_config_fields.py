"""`IPUConfig`'s fields read and checked: each field's type and range check, the keys an
optimum-graphcore `ipu_config.json` may hold that ipuloop drops, and a field's value parsed
from `update_from_string`'s text like its current value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

__all__ = ["FIELDS", "OPTIMUM_ONLY", "PLACEMENT", "convert", "is_int"]

_OUTPUT_MODES = ("all", "sum", "final", "default")
_TRUE, _FALSE = ("true", "1", "y", "yes"), ("false", "0", "n", "no")


# ---- per-field checks: each returns the value to store (lists copied, numbers as float) ----


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _type_error(name: str, v: object, expected: str) -> TypeError:
    return TypeError(f"{name} must be {expected}. Received: {name}={v!r} ({type(v).__name__}).")


def _pos_int(name: str, v: Any) -> int:
    if not is_int(v):
        raise _type_error(name, v, "an int")
    if v < 1:
        raise ValueError(f"{name} must be >= 1. Received: {name}={v}.")
    return v


def _layers(name: str, v: Any) -> list[int]:
    if not isinstance(v, (list, tuple)) or not all(is_int(x) for x in v):
        raise _type_error(name, v, "a list of ints")
    if not v:
        raise ValueError(
            f"{name} must not be empty; [-1] splits the layers evenly. Received: {name}=[]."
        )
    if min(v) < -1:
        raise ValueError(
            f"{name} must have all elements >= -1 (-1 is the wildcard). Received: {name}={list(v)}."
        )
    return list(v)


def _proportion(name: str, v: Any) -> float | list[float]:
    if _is_num(v):
        values: list[Any] = [v]
    elif isinstance(v, (list, tuple)) and v and all(_is_num(x) for x in v):
        values = list(v)
    else:
        raise _type_error(name, v, "a float or a non-empty list of floats (one per IPU)")
    if min(values) < 0:
        raise ValueError(f"{name} must have all elements >= 0. Received: {name}={v!r}.")
    return float(v) if _is_num(v) else [float(x) for x in values]


def _typed(ok: Callable[[object], bool], expected: str) -> Callable[[str, Any], Any]:
    def check(name: str, v: Any) -> Any:
        if not ok(v):
            raise _type_error(name, v, expected)
        return v

    return check


_bool = _typed(lambda v: isinstance(v, bool), "a bool")
_str = _typed(lambda v: isinstance(v, str), "a str")
_seed = _typed(lambda v: v is None or is_int(v), "an int or None")


def _output_mode(name: str, v: Any) -> str:
    if _str(name, v) not in _OUTPUT_MODES:
        raise ValueError(f"{name} must be one of {_OUTPUT_MODES}. Received: {name}={v!r}.")
    return v


# Field -> check, in constructor order (a test keeps this in sync with __init__).
FIELDS = {
    "replication_factor": _pos_int,
    "inference_replication_factor": _pos_int,
    "gradient_accumulation_steps": _pos_int,
    "device_iterations": _pos_int,
    "inference_device_iterations": _pos_int,
    "layers_per_ipu": _layers,
    "inference_layers_per_ipu": _layers,
    "ipus_per_replica": _pos_int,
    "inference_ipus_per_replica": _pos_int,
    "optimizer_state_offchip": _bool,
    "replicated_tensor_sharding": _bool,
    "matmul_proportion": _proportion,
    "inference_matmul_proportion": _proportion,
    "enable_half_partials": _bool,
    "recompute_checkpoint_every_layer": _bool,
    "output_mode": _output_mode,
    "seed": _seed,
    "auto_loss_scaling": _bool,
    "executable_cache_dir": _str,
}
# Keys an optimum-graphcore `ipu_config.json` may hold that ipuloop does not use: accepted so
# its files load; each with the values that mean "off" (any other value warns, then is dropped).
_SERIALISATION = tuple(
    f"{p}{k}"
    for p in ("", "inference_")
    for k in (
        "embedding_serialization_factor",
        "serialized_embedding_splits_per_ipu",
        "projection_serialization_factor",
        "serialized_projection_splits_per_ipu",
    )
)
OPTIMUM_ONLY: dict[str, tuple[Any, ...] | None] = {
    **dict.fromkeys(_SERIALISATION, (None, 1)),
    "explicit_ir_inference": (False,),
    "parallelize_kwargs": (None, {}),
    "inference_parallelize_kwargs": (None, {}),
    "execute_encoder_on_cpu_for_generation": (False,),
    "sharded_execution_for_inference": (None, False, True),  # inference is always sharded
    "enable_half_first_order_momentum": (None, False),  # deprecated in optimum too
    "optimum_version": None,
    "transformers_version": None,  # metadata written by save_pretrained
}
# Set last by the constructor, in the order of optimum's fallback rules.
PLACEMENT = (
    "layers_per_ipu",
    "inference_layers_per_ipu",
    "ipus_per_replica",
    "inference_ipus_per_replica",
    "matmul_proportion",
    "inference_matmul_proportion",
)


def convert(key: str, raw: str, current: Any) -> Any:
    """Parse `raw` like the field's current value (bool is tested before int)."""
    if isinstance(current, bool):
        if raw.lower() not in _TRUE + _FALSE:
            raise ValueError(
                f"Can't derive true or false from {raw!r} (key {key}). "
                f"Use true/false, 1/0, y/n or yes/no."
            )
        return raw.lower() in _TRUE
    if key == "seed" and raw.lower() in ("none", "null"):
        return None
    try:
        if key.endswith("matmul_proportion") and not raw.startswith("["):
            return float(raw)  # a list-valued proportion may go back to one float for all IPUs
        if (raw.startswith("[") and not isinstance(current, str)) or isinstance(current, list):
            if not (raw.startswith("[") and raw.endswith("]")):
                raise ValueError("expected a list like [a b c]")
            items = (t for t in re.split(r"[\s,]+", raw[1:-1]) if t)
            return json.loads("[" + ",".join(items) + "]")
        if current is None:  # seed while unset: take the literal as an int if it is one
            for parse in (int, float):
                try:
                    return parse(raw)
                except ValueError:
                    pass
            return raw  # the field check then says what it expected
        return type(current)(raw)  # int, float or str
    except ValueError as e:
        raise ValueError(
            f"Cannot convert {key}={raw!r} like its current value {current!r} "
            f"({type(current).__name__}): {e}."
        ) from None
