"""`IPUConfig`: one JSON-serialisable configuration for training and inference `poptorch.Options`.

Its fields are checked and parsed by `ipu_config_fields.py`; `placement.py` places a model's
layers as it says (`place_layers`, `unplace_layers`, re-exported here).

Follows optimum-graphcore's `IPUConfig` (docs/poptorch-semantics.md §7), with these differences:

- the cross-field checks (a list `matmul_proportion`, and a `layers_per_ipu` without -1, must
  have `ipus_per_replica` entries) re-run after every assignment, `update()` and
  `update_from_string()`, not only in the constructor. A change that fails is rolled back.
  Change coupled fields together with `update(...)` or one `update_from_string(...)`;
- `seed=0` is honoured by `to_options` (optimum tests `if self.seed:` and drops it);
- `update_from_string` strips whitespace around keys and values, splits only on commas outside
  brackets (`[a b]` and `[a, b]` both work), can set `seed` while it is None, and can turn a
  float `matmul_proportion` into a list;
- only None means "derive": `ipus_per_replica=0` is rejected and `inference_matmul_proportion=0.0`
  is kept (optimum replaces any falsy value with the fallback);
- wildcard expansion raises when the fixed entries alone exceed the model's layers (optimum
  returns negative layer counts);
- int fields reject bool; assigning a name that is not a field raises AttributeError.

Left out: the train()/eval() mode switch (pass `for_inference=`), embedding and projection
serialisation, `parallelize_kwargs`, `explicit_ir_inference`, `compile_only`, the Hub
(`from_pretrained` takes a local folder or file; a Hub name is refused, naming the fix). An
optimum `ipu_config.json` still loads: those keys and its `optimum_version` /
`transformers_version` are accepted and dropped, with a warning when a setting is switched on.
Derived values (`inference_*`, `ipus_per_replica`) are resolved once, in the constructor, as
in optimum.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast, overload

import torch

from ..checkpoint_io import file_mode
from .ipu_config_fields import FIELDS, OPTIMUM_ONLY, PLACEMENT, convert, is_int
from .placement import place_layers, strategy, unplace_layers

__all__ = [
    "CONFIG_NAME",
    "IPUConfig",
    "IncompatibleIPUConfigError",
    "place_layers",
    "unplace_layers",
]

CONFIG_NAME = "ipu_config.json"


class IncompatibleIPUConfigError(ValueError):
    """IPUConfig values disagree with each other or with the model (optimum's name)."""


class IPUConfig:
    """Replication, accumulation, iterations, layer placement, memory and precision settings.

    Each field is type- and range-checked on construction and on every assignment, then the
    cross-field checks run. None for `inference_layers_per_ipu`, `ipus_per_replica`,
    `inference_ipus_per_replica` or `inference_matmul_proportion` means "derive" (§7.1).

    Example:
        cfg = IPUConfig(layers_per_ipu=[-1, -1], gradient_accumulation_steps=8)
        model = poptorch.trainingModel(net, cfg.to_options(), optimizer)
    """

    def __init__(
        self,
        *,
        replication_factor: int = 1,
        inference_replication_factor: int = 1,
        gradient_accumulation_steps: int = 1,
        device_iterations: int = 1,
        inference_device_iterations: int = 1,
        layers_per_ipu: list[int] = [-1],  # noqa: B006 (validation stores a copy)
        inference_layers_per_ipu: list[int] | None = None,
        ipus_per_replica: int | None = None,
        inference_ipus_per_replica: int | None = None,
        optimizer_state_offchip: bool = False,
        replicated_tensor_sharding: bool = False,
        matmul_proportion: float | list[float] = 0.2,
        inference_matmul_proportion: float | list[float] | None = None,
        enable_half_partials: bool = True,
        recompute_checkpoint_every_layer: bool = False,
        output_mode: str = "final",
        seed: int | None = None,
        auto_loss_scaling: bool = False,
        executable_cache_dir: str = "",
        **unknown: Any,
    ) -> None:
        given = {k: v for k, v in locals().items() if k in FIELDS}
        dropped = {k: unknown.pop(k) for k in list(unknown) if k in OPTIMUM_ONLY}
        active = {
            k: v
            for k, v in dropped.items()
            if OPTIMUM_ONLY[k] is not None and v not in (OPTIMUM_ONLY[k] or ())
        }
        if active:
            names = ", ".join(f"{k}={v!r}" for k, v in sorted(active.items()))
            warnings.warn(
                f"IPUConfig ignores optimum-graphcore settings it does not implement: "
                f"{names}. Remove them to silence this warning.",
                stacklevel=2,
            )
        if unknown:
            names = ", ".join(f"{k}={v!r}" for k, v in sorted(unknown.items()))
            raise IncompatibleIPUConfigError(
                f"IPUConfig received unknown arguments: {names}. Remove them; valid arguments: "
                f"{', '.join(FIELDS)}."
            )
        object.__setattr__(self, "_ready", False)  # cross-field checks wait for every field
        self.update(**{k: v for k, v in given.items() if k not in PLACEMENT})
        # §7.1 fallbacks, in optimum's order; only None means "not given".
        self.layers_per_ipu = layers_per_ipu
        self.inference_layers_per_ipu = (
            self.layers_per_ipu if inference_layers_per_ipu is None else inference_layers_per_ipu
        )
        self.ipus_per_replica = (
            len(self.layers_per_ipu) if ipus_per_replica is None else ipus_per_replica
        )
        if inference_ipus_per_replica is None:
            inference_ipus_per_replica = self.ipus_per_replica
            if self.ipus_per_replica == len(
                self.layers_per_ipu
            ) or self.inference_layers_per_ipu != [-1]:
                inference_ipus_per_replica = len(self.inference_layers_per_ipu)
        self.inference_ipus_per_replica = inference_ipus_per_replica
        self.matmul_proportion = matmul_proportion
        if inference_matmul_proportion is None:  # a per-IPU list that does not fit -> 0.2
            mp = self.matmul_proportion
            fits = not isinstance(mp, list) or len(mp) == self.inference_ipus_per_replica
            inference_matmul_proportion = self.matmul_proportion if fits else 0.2
        self.inference_matmul_proportion = inference_matmul_proportion
        self._check_cross_fields()
        object.__setattr__(self, "_ready", True)
        if self.replicated_tensor_sharding and self.replication_factor == 1:
            warnings.warn(
                "replicated_tensor_sharding=True has no effect with replication_factor=1.",
                stacklevel=2,
            )

    # ---- validation ----
    def __setattr__(self, name: str, value: Any) -> None:
        self.update(**{name: value})

    def update(self, **changes: Any) -> IPUConfig:
        """Set several fields at once: all are checked, then the cross-field checks run once.

        On any error nothing changes. Attribute assignment is `update` of one field.
        """
        for name in changes:
            if name not in FIELDS:
                raise AttributeError(
                    f"IPUConfig has no field {name!r}. Valid fields: {', '.join(FIELDS)}."
                )
        new = {name: FIELDS[name](name, value) for name, value in changes.items()}
        old = {name: self.__dict__[name] for name in new if name in self.__dict__}
        self.__dict__.update(new)
        if self._ready:
            try:
                self._check_cross_fields()
            except IncompatibleIPUConfigError:
                self.__dict__.update(old)  # roll back: the config stays valid
                raise
        return self

    def _check_cross_fields(self) -> None:
        for p in ("", "inference_"):  # both modes, like optimum's _validate_ipu_config
            n = getattr(self, p + "ipus_per_replica")
            mp, lpi = getattr(self, p + "matmul_proportion"), getattr(self, p + "layers_per_ipu")
            if isinstance(mp, list) and len(mp) != n:
                raise IncompatibleIPUConfigError(
                    f"{p}matmul_proportion={mp} should use the same number of IPUs as "
                    f"{p}ipus_per_replica={n}. Give one value per IPU, or a single float."
                )
            if -1 not in lpi and len(lpi) != n:
                raise IncompatibleIPUConfigError(
                    f"{p}layers_per_ipu={lpi} should use the same number of IPUs as "
                    f"{p}ipus_per_replica={n}. Give one entry per IPU, or use the -1 wildcard."
                )

    # ---- §7.2 layer placement ----
    def expand_layers_per_ipu(
        self, num_layers: int | Sequence[Any] | None, *, for_inference: bool = False
    ) -> list[int]:
        """`layers_per_ipu` with each -1 replaced, for a model of `num_layers` layers.

        Remainders go to the last wildcard IPU: `[-1, -1]` and 9 layers give `[4, 5]`.
        `num_layers` may be a sequence (its length counts) or None (returned unexpanded).
        With `ipus_per_replica == 1` every layer goes to IPU 0 whatever `layers_per_ipu` says
        (optimum's rule): `ipus_per_replica` is derived once, so change it together with
        `layers_per_ipu`, e.g. `update(layers_per_ipu=[2, -1], ipus_per_replica=2)`.
        """
        p = "inference_" if for_inference else ""
        lpi, n = list(getattr(self, p + "layers_per_ipu")), getattr(self, p + "ipus_per_replica")
        if not all(is_int(k) and k >= -1 for k in lpi):  # only reachable by in-place mutation
            raise IncompatibleIPUConfigError(
                f"Invalid values in {p}layers_per_ipu. {p}layers_per_ipu={lpi}"
            )
        if num_layers is None:
            return lpi
        total = cast(int, num_layers) if is_int(num_layers) else len(cast(Sequence, num_layers))
        if n == 1:  # everything on IPU 0; layers_per_ipu is ignored
            return [total]
        if lpi in ([-1], [-1] * n):
            q, r = divmod(total, n)
            return [q] * (n - 1) + [q + r]
        if -1 in lpi and len(lpi) == n:
            wild = [i for i, k in enumerate(lpi) if k == -1]
            left = total - sum(k for k in lpi if k != -1)
            if left < 0:
                raise IncompatibleIPUConfigError(
                    f"{p}layers_per_ipu={lpi} places {total - left} layers besides its wildcards, "
                    f"but the model has {total} layers. Lower the fixed entries."
                )
            q, r = divmod(left, len(wild))
            for i in wild:
                lpi[i] = q
            lpi[wild[-1]] += r
            return lpi
        if len(lpi) != n:
            raise IncompatibleIPUConfigError(
                f"{p}layers_per_ipu has a non-default value set, but its length does not match "
                f"{p}ipus_per_replica. {p}layers_per_ipu={lpi}, {p}ipus_per_replica={n}."
            )
        if sum(lpi) != total:
            raise IncompatibleIPUConfigError(
                f"{p}layers_per_ipu does not define the correct number of layers for the current "
                f"model. The current IPU Config specifies IPU assignments for {sum(lpi)} layers "
                f"but there are {total} layers in the model. {p}layers_per_ipu={lpi}"
            )
        return lpi

    def ipus_used(self, *, for_inference: bool = False) -> int:
        """IPUs a replica reserves, counted as PopTorch counts them: max(IPUs used, highest
        IPU + 1), i.e. one past the last IPU that can hold layers (an entry other than 0)."""
        p = "inference_" if for_inference else ""
        lpi, n = getattr(self, p + "layers_per_ipu"), getattr(self, p + "ipus_per_replica")
        if n == 1 or len(lpi) != n:  # all on IPU 0, or [-1] spread over the n IPUs
            return n
        return max((i + 1 for i, k in enumerate(lpi) if k != 0), default=1)

    def layer_ipu(
        self, num_layers: int | Sequence[Any] | None, *, for_inference: bool = False
    ) -> list[int]:
        """The IPU of each layer: `[2, -1]` and 6 layers give `[0, 0, 1, 1, 1, 1]`."""
        counts = self.expand_layers_per_ipu(num_layers, for_inference=for_inference)
        return [ipu for ipu, k in enumerate(counts) for _ in range(k)]

    # ---- §7.3-7.4 batch size and Options ----
    # (batch_size_factor and to_options are optimum-graphcore's, whose programs pass
    # for_inference positionally: they keep its signatures)
    def batch_size_factor(self, for_inference: bool = False) -> int:  # noqa: FBT001, FBT002
        """Host batch / micro-batch: RF*GA*DI for training, RF*DI for inference."""
        if for_inference:
            return self.inference_replication_factor * self.inference_device_iterations
        return self.replication_factor * self.gradient_accumulation_steps * self.device_iterations

    def to_options(self, for_inference: bool = False) -> Any:  # noqa: FBT001, FBT002
        """A new `poptorch.Options` (real or emulated) for training or for inference.

        Not done, unlike optimum: the Mk2 hardware check, `compile_only`/offline target, and
        the PopART-only tuning (`_Popart` flags and patterns, engine options, initializer file).
        """
        from ipuloop.backend import poptorch_module

        pt = poptorch_module()
        p = "inference_" if for_inference else ""
        opts = pt.Options()
        opts.autoRoundNumIPUs(True)  # noqa: FBT003 (PopTorch's positional API)
        opts.replicationFactor(getattr(self, p + "replication_factor"))
        opts.deviceIterations(getattr(self, p + "device_iterations"))
        if not for_inference:
            opts.Training.gradientAccumulation(self.gradient_accumulation_steps)
            opts.Training.accumulationAndReplicationReductionType(pt.ReductionType.Mean)
            if self.auto_loss_scaling:
                opts.Training.setAutomaticLossScaling(True)
        mode = getattr(pt.OutputMode, "All" if for_inference else self.output_mode.capitalize())
        opts.outputMode(mode)
        if self.seed is not None:  # 0 included; poptorch also seeds the host torch RNG here
            opts.randomSeed(self.seed)
        opts.TensorLocations.setOptimizerLocation(
            pt.TensorLocationSettings()
            .useOnChipStorage(not self.optimizer_state_offchip)
            .useReplicatedTensorSharding(
                self.replicated_tensor_sharding and opts.replication_factor > 1
            )
        )
        opts.setExecutionStrategy(strategy(pt, for_inference=for_inference))
        n, mp = getattr(self, p + "ipus_per_replica"), getattr(self, p + "matmul_proportion")
        mp = mp if isinstance(mp, list) else [mp] * n
        opts.setAvailableMemoryProportion({f"IPU{i}": mp[i] for i in range(n)})
        if self.executable_cache_dir not in ("", "disabled"):
            opts.enableExecutableCaching(self.executable_cache_dir)
        opts.Precision.enableStochasticRounding(not for_inference)
        if self.enable_half_partials:
            opts.Precision.setPartialsType(torch.float16)
        return opts

    # ---- §7.5 overrides ----
    def update_from_string(self, update_str: str) -> IPUConfig:
        """Apply `"k=v,k2=[a b],flag=true"`, converting each value by its field's current type.

        bool: true/1/y/yes or false/0/n/no (any case); int; float; list `[a b]` or `[a, b]`;
        str as is. The `matmul_proportion` fields take a float or a list whatever they hold
        now; `seed` also takes `none`. Applied like one `update(...)` call.
        """
        changes = {}
        # Split on commas outside brackets, so "[0.1, 0.2]" stays one value.
        for item in filter(str.strip, re.split(r",(?![^\[]*\])", update_str)):
            key, sep, raw = (s.strip() for s in item.partition("="))
            if not sep:
                raise ValueError(
                    f"update_from_string expects 'key=value' items separated by ','. "
                    f"Received: {item!r} in {update_str!r}."
                )
            if key not in FIELDS:
                raise ValueError(
                    f"Key {key} isn't in the original config dict. Valid keys: {', '.join(FIELDS)}."
                )
            changes[key] = convert(key, raw, getattr(self, key))
        return self.update(**changes)

    # ---- §7.6 serialisation ----
    def to_dict(self) -> dict[str, Any]:
        """Every field (derived ones resolved), JSON-compatible."""
        return {name: copy.deepcopy(getattr(self, name)) for name in FIELDS}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IPUConfig:
        """Rebuild through the constructor: validation re-runs and unknown keys raise."""
        if not isinstance(data, dict):
            raise TypeError(f"IPUConfig.from_dict expects a dict. Received: {type(data).__name__}.")
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write JSON to `path` and return the file written: `path/ipu_config.json` when `path`
        is a folder (an existing one, a path ending in '/', or a new path whose name does not
        end in ".json", which is created as `save_pretrained` creates it), else the file
        `path` (an existing file, or a new "*.json"). Atomic: temp file, then `os.replace`; the
        file gets the mode `open()` gives (0644 under the usual umask), as checkpoints do."""
        target = Path(path)
        folder = (
            target.is_dir()
            or str(path).endswith(("/", os.sep))
            or (not target.exists() and target.suffix.lower() != ".json")
        )
        return self._write(target / CONFIG_NAME if folder else target)

    def save_pretrained(self, save_directory: str | os.PathLike[str], **kwargs: Any) -> Path:
        """optimum-graphcore's (transformers') `save_pretrained`: make the folder
        `save_directory` if needed and write `ipu_config.json` in it; returns that file.
        Hub uploads (`push_to_hub=True`) are refused."""
        folder = Path(save_directory)
        if folder.is_file():
            raise ValueError(
                f"save_pretrained(save_directory={str(save_directory)!r}): that is a file, and "
                "save_pretrained writes a folder holding ipu_config.json. Pass a folder, or "
                f"write this file with save({str(save_directory)!r})."
            )
        if kwargs.get("push_to_hub"):
            raise ValueError(
                "save_pretrained(push_to_hub=True): ipuloop does not upload to the Hugging Face "
                "Hub. Save to a folder, then upload it with `huggingface-cli upload`."
            )
        return self._write(folder / CONFIG_NAME)

    def _write(self, target: Path) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                os.fchmod(f.fileno(), file_mode())  # mkstemp's 0600 would hide it from others
                f.write(self.to_json_string())
                f.flush()
                os.fsync(f.fileno())  # the data is on disk before the rename makes it visible
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> IPUConfig:
        """Read what `save` wrote; a folder means `folder/ipu_config.json`."""
        target = Path(path)
        target = target / CONFIG_NAME if target.is_dir() else target
        try:
            data = json.loads(target.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{target} is not a JSON IPUConfig ({e}). Write it with IPUConfig.save(path)."
            ) from None
        return cls.from_dict(data)

    @overload
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike[str],
        *,
        return_unused_kwargs: Literal[False] = ...,
        **kwargs: Any,
    ) -> IPUConfig: ...

    @overload
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike[str],
        *,
        return_unused_kwargs: Literal[True],
        **kwargs: Any,
    ) -> tuple[IPUConfig, dict[str, Any]]: ...

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike[str],
        *,
        return_unused_kwargs: bool = False,
        **kwargs: Any,
    ) -> IPUConfig | tuple[IPUConfig, dict[str, Any]]:
        """optimum-graphcore's (transformers') `from_pretrained`, for local paths: a folder
        holding `ipu_config.json` (or `subfolder=` inside it), or a JSON file. Each keyword
        naming a field overrides the file's value, as in optimum; with
        `return_unused_kwargs=True` the others come back beside the config, else they are an
        error naming them. Anything that is neither an existing folder nor a file (a Hub name,
        "Graphcore/bert-base-ipu") is refused at once, offline, naming the fix."""
        where = Path(pretrained_model_name_or_path)
        subfolder = kwargs.pop("subfolder", None)
        if subfolder:
            where = where / subfolder
        if not where.exists():
            name = str(pretrained_model_name_or_path)
            raise ValueError(
                f"IPUConfig.from_pretrained({name!r}): no such folder or file here, and ipuloop "
                "reads no Hugging Face Hub repository. Pass a local folder holding "
                f"{CONFIG_NAME} or a JSON file; for a Hub repository, download it first, e.g. "
                f"`huggingface-cli download {name} {CONFIG_NAME} --local-dir DIR`, then pass "
                "DIR."
            )
        if where.is_dir() and not (where / CONFIG_NAME).is_file():
            raise ValueError(
                f"IPUConfig.from_pretrained({str(pretrained_model_name_or_path)!r}): the folder "
                f"{where} holds no {CONFIG_NAME}. Pass the folder save_pretrained wrote, or the "
                "JSON file itself."
            )
        config = cls.load(where)
        overrides = {k: v for k, v in kwargs.items() if k in FIELDS}
        unused = {k: v for k, v in kwargs.items() if k not in FIELDS}
        if unused and not return_unused_kwargs:
            raise TypeError(
                f"IPUConfig.from_pretrained got keyword(s) that are no IPUConfig field: "
                f"{', '.join(sorted(unused))}. Valid fields: {', '.join(FIELDS)}; pass "
                "return_unused_kwargs=True to get the others back."
            )
        if overrides:
            config.update(**overrides)
        return (config, unused) if return_unused_kwargs else config

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IPUConfig):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        defaults = IPUConfig().to_dict()
        shown = (f"{k}={v!r}" for k, v in self.to_dict().items() if v != defaults[k])
        return f"IPUConfig({', '.join(shown)})"
