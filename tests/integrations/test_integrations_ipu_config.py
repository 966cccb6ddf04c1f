"""IPUConfig against docs/poptorch-semantics.md §7: optimum-graphcore's rules and examples."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch
from torch import nn

from ipuloop.integrations.ipu_config import (
    CONFIG_NAME,
    IncompatibleIPUConfigError,
    IPUConfig,
    place_layers,
    unplace_layers,
)

# ---- §7.2 wildcard expansion: every documented example ----


@pytest.mark.parametrize(
    "kwargs, num_layers, expected",
    [
        ({}, 9, [9]),  # default: all on one IPU
        ({"layers_per_ipu": [5]}, 3, [3]),  # P == 1 ignores layers_per_ipu
        ({"ipus_per_replica": 2}, 9, [4, 5]),  # remainder to the last IPU
        ({"ipus_per_replica": 2}, 7, [3, 4]),
        ({"ipus_per_replica": 2}, 6, [3, 3]),
        ({"layers_per_ipu": [-1, -1]}, 9, [4, 5]),
        ({"ipus_per_replica": 4}, 3, [0, 0, 0, 3]),  # T < P: zero-layer IPUs
        ({"ipus_per_replica": 4}, 8, [2, 2, 2, 2]),
        ({"layers_per_ipu": [2, -1]}, 6, [2, 4]),
        ({"layers_per_ipu": [-1, 2]}, 6, [4, 2]),
        ({"layers_per_ipu": [-1, 2, -1, 2]}, 7, [1, 2, 2, 2]),  # remainder to the last wildcard
        ({"layers_per_ipu": [1, 2, -1, -1]}, 9, [1, 2, 3, 3]),  # the docstring's example
        ({"layers_per_ipu": [1, 2, -1, -1]}, 10, [1, 2, 3, 4]),
        ({"layers_per_ipu": [1, 2]}, 3, [1, 2]),
        ({"layers_per_ipu": [1, 2]}, None, [1, 2]),  # no model: unchanged
        ({"layers_per_ipu": [2, -1]}, [nn.Identity()] * 5, [2, 3]),  # a sequence counts its length
    ],
)
def test_expand_layers_per_ipu_documented_examples(kwargs, num_layers, expected):
    assert IPUConfig(**kwargs).expand_layers_per_ipu(num_layers) == expected


@pytest.mark.parametrize(
    "kwargs, num_layers, expected",
    [
        ({"layers_per_ipu": [1, 2]}, 3, [0, 1, 1]),
        ({"ipus_per_replica": 2}, 6, [0, 0, 0, 1, 1, 1]),
        ({"ipus_per_replica": 2}, 7, [0, 0, 0, 1, 1, 1, 1]),
        ({"layers_per_ipu": [2, -1]}, 6, [0, 0, 1, 1, 1, 1]),
        ({"layers_per_ipu": [-1, 2]}, 6, [0, 0, 0, 0, 1, 1]),
        ({"layers_per_ipu": [-1, 2, -1, 2]}, 7, [0, 1, 1, 2, 2, 3, 3]),
        ({"ipus_per_replica": 4, "layers_per_ipu": [-1]}, 8, [0, 0, 1, 1, 2, 2, 3, 3]),
        ({}, 4, [0, 0, 0, 0]),
    ],
)
def test_layer_ipu_documented_examples(kwargs, num_layers, expected):
    assert IPUConfig(**kwargs).layer_ipu(num_layers) == expected


def test_expansion_uses_the_inference_fields_for_inference():
    cfg = IPUConfig(layers_per_ipu=[1, 2, 3, 4], inference_layers_per_ipu=[3, 7])
    assert cfg.expand_layers_per_ipu(10) == [1, 2, 3, 4]
    assert cfg.expand_layers_per_ipu(10, for_inference=True) == [3, 7]
    assert cfg.layer_ipu(10, for_inference=True) == [0] * 3 + [1] * 7


@pytest.mark.parametrize("num_layers", [2, 4])  # too few, too many
def test_expansion_rejects_a_wrong_layer_count(num_layers):
    match = "layers_per_ipu does not define the correct number of layers for the current model"
    with pytest.raises(IncompatibleIPUConfigError, match=match):
        IPUConfig(layers_per_ipu=[1, 2]).layer_ipu(num_layers)


def test_expansion_rejects_a_wildcard_list_of_the_wrong_length():
    cfg = IPUConfig(layers_per_ipu=[1, -1], ipus_per_replica=4)  # constructs, like optimum
    match = (
        "layers_per_ipu has a non-default value set, but its length does not match ipus_per_replica"
    )
    with pytest.raises(IncompatibleIPUConfigError, match=match):
        cfg.layer_ipu(3)


def test_expansion_errors_name_the_inference_fields():
    cfg = IPUConfig(inference_layers_per_ipu=[1, 2])
    match = "^inference_layers_per_ipu does not define"
    with pytest.raises(IncompatibleIPUConfigError, match=match):
        cfg.layer_ipu(4, for_inference=True)


def test_expansion_rejects_fixed_entries_beyond_the_model():  # optimum would return [5, -2]
    with pytest.raises(IncompatibleIPUConfigError, match="places 5 layers besides its wildcards"):
        IPUConfig(layers_per_ipu=[5, -1]).expand_layers_per_ipu(3)


# ---- §7.1 fallbacks and validation ----


def test_fallbacks_follow_optimum():
    cfg = IPUConfig(layers_per_ipu=[1, 2])
    assert (cfg.ipus_per_replica, cfg.inference_layers_per_ipu) == (2, [1, 2])
    assert cfg.inference_ipus_per_replica == 2
    assert cfg.inference_layers_per_ipu is not cfg.layers_per_ipu
    # layers_per_ipu=[-1] with an explicit P and no inference layers: inference keeps P.
    assert IPUConfig(ipus_per_replica=4).inference_ipus_per_replica == 4
    # inference_layers_per_ipu given (not [-1]): its length wins.
    cfg = IPUConfig(ipus_per_replica=4, inference_layers_per_ipu=[-1, -1])
    assert cfg.inference_ipus_per_replica == 2
    cfg = IPUConfig(
        layers_per_ipu=[1, 2, 3, 4],
        matmul_proportion=[0.1, 0.2, 0.3, 0.4],
        inference_layers_per_ipu=[3, 7],
    )
    # A per-IPU list whose length does not fit the inference IPUs falls back to 0.2.
    assert (cfg.inference_ipus_per_replica, cfg.inference_matmul_proportion) == (2, 0.2)
    cfg = IPUConfig(layers_per_ipu=[1, 2], matmul_proportion=[0.1, 0.3])
    assert cfg.inference_matmul_proportion == [0.1, 0.3]
    assert IPUConfig(matmul_proportion=0.5).inference_matmul_proportion == 0.5
    # Explicit falsy values are honoured or rejected, not silently replaced (optimum replaces them).
    assert IPUConfig(inference_matmul_proportion=0.0).inference_matmul_proportion == 0.0
    with pytest.raises(
        ValueError, match="ipus_per_replica must be >= 1. Received: ipus_per_replica=0."
    ):
        IPUConfig(ipus_per_replica=0)


def test_defaults():
    d = IPUConfig().to_dict()
    assert d == {
        "replication_factor": 1,
        "inference_replication_factor": 1,
        "gradient_accumulation_steps": 1,
        "device_iterations": 1,
        "inference_device_iterations": 1,
        "layers_per_ipu": [-1],
        "inference_layers_per_ipu": [-1],
        "ipus_per_replica": 1,
        "inference_ipus_per_replica": 1,
        "optimizer_state_offchip": False,
        "replicated_tensor_sharding": False,
        "matmul_proportion": 0.2,
        "inference_matmul_proportion": 0.2,
        "enable_half_partials": True,
        "recompute_checkpoint_every_layer": False,
        "output_mode": "final",
        "seed": None,
        "auto_loss_scaling": False,
        "executable_cache_dir": "",
    }
    params = set(inspect.signature(IPUConfig).parameters) - {"unknown"}
    assert params == set(d)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"gradient_accumulation_steps": 0},
            ValueError,
            "gradient_accumulation_steps must be >= 1. Received: gradient_accumulation_steps=0.",
        ),
        (
            {"replication_factor": 2.0},
            TypeError,
            "replication_factor must be an int. Received: replication_factor=2.0 (float).",
        ),
        ({"device_iterations": True}, TypeError, "device_iterations must be an int"),
        ({"layers_per_ipu": [1, -2]}, ValueError, "layers_per_ipu must have all elements >= -1"),
        ({"layers_per_ipu": "1,2"}, TypeError, "layers_per_ipu must be a list of ints"),
        ({"layers_per_ipu": []}, ValueError, "layers_per_ipu must not be empty"),
        ({"matmul_proportion": -0.1}, ValueError, "matmul_proportion must have all elements >= 0"),
        (
            {"matmul_proportion": "0.2"},
            TypeError,
            "matmul_proportion must be a float or a non-empty",
        ),
        (
            {"output_mode": "every"},
            ValueError,
            "output_mode must be one of ('all', 'sum', 'final', 'default'). "
            "Received: output_mode='every'.",
        ),
        ({"output_mode": 2}, TypeError, "output_mode must be a str"),
        ({"seed": 1.5}, TypeError, "seed must be an int or None"),
        ({"enable_half_partials": 1}, TypeError, "enable_half_partials must be a bool"),
        ({"executable_cache_dir": None}, TypeError, "executable_cache_dir must be a str"),
        (
            {"matmul_proportion": [0.1, 0.2]},
            IncompatibleIPUConfigError,
            "matmul_proportion=[0.1, 0.2] should use the same number of IPUs as ipus_per_replica=1",
        ),
        (
            {"layers_per_ipu": [1, 2], "ipus_per_replica": 3},
            IncompatibleIPUConfigError,
            "layers_per_ipu=[1, 2] should use the same number of IPUs as ipus_per_replica=3",
        ),
        (
            {"inference_layers_per_ipu": [1, 2], "inference_ipus_per_replica": 3},
            IncompatibleIPUConfigError,
            "inference_layers_per_ipu=[1, 2] should use the same number of IPUs as "
            "inference_ipus_per_replica=3",
        ),
        (
            {"foo": 1, "bar": 2},
            IncompatibleIPUConfigError,
            "IPUConfig received unknown arguments: bar=2, foo=1. Remove them",
        ),
    ],
)
def test_constructor_validation(kwargs, error, message):
    with pytest.raises(error) as info:
        IPUConfig(**kwargs)
    assert message in str(info.value)


def test_incompatible_error_is_a_value_error():
    assert issubclass(IncompatibleIPUConfigError, ValueError)


def test_assignment_is_validated_and_rolled_back():
    cfg = IPUConfig(layers_per_ipu=[2, 2])
    with pytest.raises(ValueError, match="device_iterations must be >= 1"):
        cfg.device_iterations = 0
    with pytest.raises(IncompatibleIPUConfigError, match="should use the same number of IPUs"):
        cfg.ipus_per_replica = 3  # cross-field checks re-run on assignment (optimum: __init__ only)
    with pytest.raises(IncompatibleIPUConfigError):
        cfg.matmul_proportion = [0.1, 0.2, 0.3]
    assert (cfg.device_iterations, cfg.ipus_per_replica, cfg.matmul_proportion) == (1, 2, 0.2)
    with pytest.raises(AttributeError, match="IPUConfig has no field 'gradient_accumulation'"):
        cfg.gradient_accumulation = 4
    cfg.update(layers_per_ipu=[1, 1, 1], ipus_per_replica=3, matmul_proportion=[0.1, 0.2, 0.3])
    assert cfg.layer_ipu(3) == [0, 1, 2]


# ---- §7.3 ----


def test_batch_size_factor_both_modes():
    cfg = IPUConfig(
        replication_factor=2,
        gradient_accumulation_steps=3,
        device_iterations=5,
        inference_replication_factor=7,
        inference_device_iterations=11,
    )
    assert cfg.batch_size_factor() == 2 * 3 * 5
    assert cfg.batch_size_factor(for_inference=True) == 7 * 11  # GA does not apply to inference
    assert IPUConfig().batch_size_factor() == IPUConfig().batch_size_factor(True) == 1


# ---- §7.5 update_from_string ----


def test_update_from_string_converts_by_current_type():
    cfg = IPUConfig(ipus_per_replica=4)
    cfg.update_from_string(
        "replication_factor=4,matmul_proportion=[0.08 0.2 0.25 0.25],"
        "output_mode=all,optimizer_state_offchip=true,"
        "inference_matmul_proportion=0.5,executable_cache_dir=./c"
    )
    assert cfg.replication_factor == 4 and isinstance(cfg.replication_factor, int)
    assert cfg.matmul_proportion == [0.08, 0.2, 0.25, 0.25]  # a float field may become a list
    assert (cfg.output_mode, cfg.optimizer_state_offchip) == ("all", True)
    assert cfg.inference_matmul_proportion == 0.5 and cfg.executable_cache_dir == "./c"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("true", True),
        ("1", True),
        ("y", True),
        ("yes", True),
        ("TRUE", True),
        ("Yes", True),
        ("false", False),
        ("0", False),
        ("n", False),
        ("no", False),
        ("False", False),
        ("NO", False),
    ],
)
def test_update_from_string_bool_spellings(text, expected):
    cfg = IPUConfig(auto_loss_scaling=not expected)
    cfg.update_from_string(f"auto_loss_scaling={text}")
    assert cfg.auto_loss_scaling is expected


def test_update_from_string_lists_whitespace_and_none_fields():
    cfg = IPUConfig()
    cfg.update_from_string(" layers_per_ipu = [1, 2 3] , ipus_per_replica = 3 , seed = 0 ,")
    assert (cfg.layers_per_ipu, cfg.ipus_per_replica, cfg.seed) == ([1, 2, 3], 3, 0)
    cfg.update_from_string("seed=none")
    assert cfg.seed is None
    cfg.update_from_string("seed=42")
    assert cfg.seed == 42
    cfg.update_from_string("")  # nothing to do
    assert cfg.seed == 42


@pytest.mark.parametrize(
    "text, error, message",
    [
        (
            "gradient_accumulation=4",
            ValueError,
            "Key gradient_accumulation isn't in the original config dict. "
            "Valid keys: replication_factor,",
        ),
        ("replication_factor=abc", ValueError, "Cannot convert replication_factor='abc'"),
        ("ipus_per_replica=1.5", ValueError, "Cannot convert ipus_per_replica='1.5'"),
        (
            "enable_half_partials=maybe",
            ValueError,
            "Can't derive true or false from 'maybe' (key enable_half_partials)",
        ),
        ("layers_per_ipu=[1.5 2]", TypeError, "layers_per_ipu must be a list of ints"),
        ("layers_per_ipu=3", ValueError, "expected a list like [a b c]"),
        ("seed=1.5", TypeError, "seed must be an int or None"),
        ("output_mode=every", ValueError, "output_mode must be one of"),
        ("replication_factor", ValueError, "update_from_string expects 'key=value' items"),
    ],
)
def test_update_from_string_errors(text, error, message):
    cfg = IPUConfig()
    with pytest.raises(error) as info:
        cfg.update_from_string(text)
    assert message in str(info.value)
    assert cfg == IPUConfig()


def test_update_from_string_reruns_cross_field_checks_and_is_atomic():
    cfg = IPUConfig(layers_per_ipu=[2, 2])
    match = r"matmul_proportion=\[0.1, 0.2, 0.3\] should use"
    with pytest.raises(IncompatibleIPUConfigError, match=match):
        cfg.update_from_string("device_iterations=8,matmul_proportion=[0.1 0.2 0.3]")
    with pytest.raises(IncompatibleIPUConfigError, match=r"layers_per_ipu=\[2, 2\] should use"):
        cfg.update_from_string("ipus_per_replica=3")
    assert cfg == IPUConfig(layers_per_ipu=[2, 2])  # device_iterations=8 was not applied either
    cfg.update_from_string(
        "layers_per_ipu=[1 1 1],ipus_per_replica=3,matmul_proportion=[0.1 0.2 0.3]"
    )
    assert cfg.matmul_proportion == [0.1, 0.2, 0.3]


# ---- §7.6 JSON ----


def _rich_config() -> IPUConfig:
    return IPUConfig(
        replication_factor=2,
        gradient_accumulation_steps=8,
        layers_per_ipu=[1, -1],
        inference_layers_per_ipu=[3],
        matmul_proportion=[0.1, 0.3],
        seed=0,
        output_mode="sum",
        executable_cache_dir="cache",
        recompute_checkpoint_every_layer=True,
    )


def test_json_round_trip_string_file_and_folder(tmp_path):
    cfg = _rich_config()
    assert IPUConfig.from_dict(json.loads(cfg.to_json_string())) == cfg
    file = cfg.save(tmp_path / "my.json")
    assert file == tmp_path / "my.json" and IPUConfig.load(file) == cfg
    folder = tmp_path / "run"
    folder.mkdir()
    assert cfg.save(folder) == folder / CONFIG_NAME
    assert IPUConfig.load(folder) == cfg
    # A path ending in "/" is a folder, created if needed.
    assert cfg.save(str(tmp_path / "new") + "/") == tmp_path / "new" / CONFIG_NAME
    assert sorted(os.listdir(tmp_path)) == ["my.json", "new", "run"]  # no temporary files left
    assert IPUConfig.load(tmp_path / "new") != IPUConfig()


def test_save_to_a_new_name_makes_the_folder_the_docs_name(tmp_path):
    """``save("ipu_config")`` writes ``ipu_config/ipu_config.json`` (docs/ipu-config.md), as
    optimum's ``save_pretrained`` does; a new "*.json" name is a file."""
    cfg = _rich_config()
    assert cfg.save(tmp_path / "ipu_config") == tmp_path / "ipu_config" / CONFIG_NAME
    assert IPUConfig.load(tmp_path / "ipu_config") == cfg
    (tmp_path / "plain").write_text("{}")  # an existing file is overwritten, as before
    assert cfg.save(tmp_path / "plain") == tmp_path / "plain"
    assert IPUConfig.load(tmp_path / "plain") == cfg


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_a_saved_config_gets_the_mode_a_checkpoint_gets(tmp_path, umask, mode):
    import stat

    old = os.umask(umask)
    try:
        written = [IPUConfig().save(tmp_path / "a.json"), IPUConfig().save_pretrained(tmp_path)]
    finally:
        os.umask(old)
    assert [stat.S_IMODE(p.stat().st_mode) for p in written] == [mode, mode]


def test_save_pretrained_and_from_pretrained_as_optimum(tmp_path):
    cfg = _rich_config()
    folder = tmp_path / "out" / "run"  # made, parents too
    assert cfg.save_pretrained(folder) == folder / CONFIG_NAME
    assert sorted(os.listdir(folder)) == [CONFIG_NAME]
    assert IPUConfig.from_pretrained(folder) == cfg
    assert IPUConfig.from_pretrained(str(folder / CONFIG_NAME)) == cfg  # the file itself
    assert IPUConfig.from_pretrained(tmp_path / "out", subfolder="run") == cfg
    # keyword overrides, as optimum's: fields set, the others returned or refused
    again = IPUConfig.from_pretrained(folder, device_iterations=7, seed=3)
    assert (again.device_iterations, again.seed) == (7, 3)
    assert again.replication_factor == cfg.replication_factor
    got, unused = IPUConfig.from_pretrained(
        folder, device_iterations=2, foo=1, return_unused_kwargs=True
    )
    assert got.device_iterations == 2 and unused == {"foo": 1}
    with pytest.raises(TypeError, match="no IPUConfig field: foo"):
        IPUConfig.from_pretrained(folder, foo=1)
    with pytest.raises(ValueError, match="that is a file"):
        cfg.save_pretrained(folder / CONFIG_NAME)
    with pytest.raises(ValueError, match=f"holds no {CONFIG_NAME}"):
        IPUConfig.from_pretrained(tmp_path)


def test_a_hub_name_is_refused_at_once_naming_a_local_path(tmp_path, monkeypatch):
    import socket

    def offline(*args, **kwargs):
        raise AssertionError("from_pretrained opened a connection")

    monkeypatch.setattr(socket, "create_connection", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        IPUConfig.from_pretrained("Graphcore/bert-base-ipu")
    msg = str(info.value)
    assert "'Graphcore/bert-base-ipu'" in msg and "no such folder or file here" in msg
    assert "huggingface-cli download Graphcore/bert-base-ipu ipu_config.json" in msg
    assert "Pass a local folder" in msg


def test_loading_reruns_validation(tmp_path):
    data = {**IPUConfig().to_dict(), "layer_per_ipu": [1]}
    (tmp_path / CONFIG_NAME).write_text(json.dumps(data))
    with pytest.raises(IncompatibleIPUConfigError, match=r"unknown arguments: layer_per_ipu=\[1\]"):
        IPUConfig.load(tmp_path)
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be >= 1"):
        IPUConfig.from_dict({**IPUConfig().to_dict(), "gradient_accumulation_steps": 0})


def test_equality():
    assert IPUConfig(seed=0) == IPUConfig(seed=0)
    assert IPUConfig(seed=0) != IPUConfig()
    assert IPUConfig() != IPUConfig().to_dict()
    assert eval(repr(_rich_config())) == _rich_config()


# ---- §7.4 to_options, read back from the emulator's Options ----


@pytest.fixture
def emulated():
    from ipuloop.backend import backend_name

    if backend_name() != "emulator":
        pytest.skip("reads the emulator's Options and block tracing")


def test_to_options_training(emulated):
    from ipuloop.emulator import blocks as _b
    from ipuloop.emulator import enums as _e
    from ipuloop.emulator import options as _o

    cfg = IPUConfig(
        replication_factor=2,
        gradient_accumulation_steps=5,
        device_iterations=3,
        inference_replication_factor=4,
        inference_device_iterations=7,
        layers_per_ipu=[1, 1],
        matmul_proportion=[0.1, 0.3],
        seed=0,
        output_mode="sum",
        replicated_tensor_sharding=True,
        auto_loss_scaling=True,
        executable_cache_dir="cache",
    )
    opts = cfg.to_options()
    assert isinstance(opts, _o.Options)
    assert (opts.replication_factor, opts.device_iterations) == (2, 3)
    assert opts.Training.gradient_accumulation == 5
    assert opts.Training.accumulation_and_replication_reduction_type == _e.ReductionType.Mean
    assert opts.auto_round_num_ipus is True
    assert opts.output_mode == 3  # Sum
    assert opts.exists("random_seed") and opts.random_seed == 0  # optimum drops seed 0
    assert type(opts._execution_strategy) is _b.PipelinedExecution
    assert opts._execution_strategy._auto_stage == _e.AutoStage.AutoIncrement
    assert opts.available_memory_proportion == {0: 0.1, 1: 0.3}
    assert opts.TensorLocations.location_optimizer == {
        "onChip": 1,
        "useReplicatedTensorSharding": 1,
    }
    popart = opts._Popart.options
    assert popart["automaticLossScalingSettings.enabled"] is True
    assert popart["enableStochasticRounding"] is True and popart["partialsTypeMatMuls"] == "half"
    assert popart["cachePath"] == "cache" and popart["enableEngineCaching"] is True


def test_to_options_inference(emulated):
    from ipuloop.emulator import blocks as _b

    cfg = IPUConfig(
        replication_factor=2,
        gradient_accumulation_steps=5,
        device_iterations=3,
        inference_replication_factor=4,
        inference_device_iterations=7,
        replicated_tensor_sharding=True,
        auto_loss_scaling=True,
        optimizer_state_offchip=True,
        ipus_per_replica=2,
        matmul_proportion=0.4,
        enable_half_partials=False,
        executable_cache_dir="disabled",
    )
    opts = cfg.to_options(for_inference=True)
    assert (opts.replication_factor, opts.device_iterations) == (4, 7)
    assert opts.Training.gradient_accumulation == 1  # GA is training only
    assert opts.output_mode == 2  # always All for inference
    assert not opts.exists("random_seed")
    assert type(opts._execution_strategy) is _b.ShardedExecution
    assert opts.available_memory_proportion == {0: 0.4, 1: 0.4}  # a float is broadcast per IPU
    assert opts.TensorLocations.location_optimizer == {
        "onChip": 0,
        "useReplicatedTensorSharding": 1,
    }
    popart = opts._Popart.options
    assert popart["enableStochasticRounding"] is False
    assert "partialsTypeMatMuls" not in popart
    assert "automaticLossScalingSettings.enabled" not in popart  # training only
    assert "cachePath" not in popart or os.environ.get("POPTORCH_CACHE_DIR")
    # RTS needs replicas: with RF=1 it is off.
    with pytest.warns(UserWarning, match="replicated_tensor_sharding=True has no effect"):
        cfg = IPUConfig(replicated_tensor_sharding=True)
    assert cfg.to_options().TensorLocations.location_optimizer["useReplicatedTensorSharding"] == 0


@pytest.mark.parametrize("mode, value", [("final", 0), ("all", 2), ("sum", 3), ("default", 4)])
def test_to_options_output_modes(emulated, mode, value):
    assert IPUConfig(output_mode=mode).to_options().output_mode == value
    assert IPUConfig(output_mode=mode).to_options(for_inference=True).output_mode == 2


# ---- automatic placement ----


def _mlp(n_layers: int = 4, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_layers))
    )


@pytest.mark.parametrize(
    "kwargs, for_inference, layer_ipus, stages",
    [
        ({"layers_per_ipu": [1, 3]}, False, [0, 1, 1, 1], 2),
        ({"ipus_per_replica": 4}, False, [0, 1, 2, 3], 4),
        ({"ipus_per_replica": 2, "layers_per_ipu": [-1]}, False, [0, 0, 1, 1], 2),
        ({"layers_per_ipu": [0, 4]}, False, [1, 1, 1, 1], 2),  # code before layer 0 runs on IPU 0
        ({"layers_per_ipu": [1, 3], "inference_layers_per_ipu": [-1]}, True, [0, 0, 0, 0], 1),
        ({"inference_layers_per_ipu": [3, -1]}, True, [0, 0, 0, 1], 2),
    ],
)
def test_place_layers_puts_each_layer_on_its_ipu(
    emulated, kwargs, for_inference, layer_ipus, stages
):
    from ipuloop.emulator import blocks as _b

    model = _mlp()
    strategy = place_layers(list(model), IPUConfig(**kwargs), for_inference=for_inference)
    assert type(strategy) is (_b.ShardedExecution if for_inference else _b.PipelinedExecution)
    with _b.trace_stages(strategy) as trace:
        model(torch.randn(2, 8) * 2)
    assert [ipu for _, _, ipu in trace.blocks] == layer_ipus
    assert [block for block, _, _ in trace.blocks] == [f"ipu{ipu}" for ipu in layer_ipus]
    assert trace.num_forward_stages == stages
    unplace_layers(list(model))
    assert all(not layer._forward_pre_hooks for layer in model)
    with _b.trace_stages(strategy) as trace:
        model(torch.randn(2, 8))
    assert trace.blocks == []


def test_place_layers_twice_needs_unplace(emulated):
    model, cfg = _mlp(), IPUConfig(ipus_per_replica=2)
    place_layers(list(model), cfg)
    with pytest.raises(RuntimeError, match="module has already been assigned to a block"):
        place_layers(list(model), cfg)
    unplace_layers(list(model))
    place_layers(list(model), cfg)


def _count_calls(module: nn.Module) -> list[int]:
    calls: list[int] = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_recompute_checkpointing_gives_identical_gradients(emulated):
    plain, ckpt = _mlp(), _mlp()
    place_layers(list(ckpt), IPUConfig(ipus_per_replica=2, recompute_checkpoint_every_layer=True))
    x = torch.randn(5, 8)
    for model in (plain, ckpt):
        model(x).square().sum().backward()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad)
    calls = _count_calls(ckpt[0][0])  # the Linear inside layer 0 runs again in backward
    ckpt(x).sum().backward()
    assert len(calls) == 2
    unplace_layers(list(ckpt))
    calls.clear()
    ckpt(x).sum().backward()
    assert len(calls) == 1 and "forward" not in ckpt[0].__dict__


def test_recompute_survives_deepcopy_and_skips_inference(emulated):
    import copy

    cfg = IPUConfig(ipus_per_replica=2, recompute_checkpoint_every_layer=True)
    model = _mlp()
    place_layers(list(model), cfg)
    device = copy.deepcopy(model)  # what the executor does: the copy must checkpoint itself
    calls = _count_calls(device[0][0])
    device(torch.randn(3, 8)).sum().backward()
    assert len(calls) == 2  # the copy recomputes too
    assert all(p.grad is not None for p in device.parameters())
    assert all(p.grad is None for p in model.parameters())
    other = _mlp()
    place_layers(list(other), cfg, for_inference=True)
    calls = _count_calls(other[0][0])
    other(torch.randn(3, 8)).sum().backward()
    assert len(calls) == 1  # no recomputation for inference placement


class _WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = _mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers(x), y)


def test_a_config_drives_the_emulated_training_model(emulated):
    from ipuloop import emulator as poptorch

    torch.manual_seed(1)
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    weights = []
    for recompute in (False, True):  # recomputation changes memory, not results
        model = _WithLoss()
        cfg = IPUConfig(
            layers_per_ipu=[-1, -1],
            gradient_accumulation_steps=3,
            device_iterations=2,
            recompute_checkpoint_every_layer=recompute,
        )
        place_layers(list(model.layers), cfg)
        step = poptorch.trainingModel(
            model, cfg.to_options(), torch.optim.SGD(model.parameters(), lr=0.1)
        )
        assert cfg.batch_size_factor() * 2 == len(x)
        step(x, y)
        step.copyWeightsToHost()
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))
    assert not torch.equal(weights[0][0], _mlp()[0][0].weight)  # it trained
    # 2 IPUs pipelined need GA >= 2*2-1: the executor sees the placement.
    model = _WithLoss()
    cfg = IPUConfig(layers_per_ipu=[-1, -1], gradient_accumulation_steps=2)
    place_layers(list(model.layers), cfg)
    step = poptorch.trainingModel(
        model, cfg.to_options(), torch.optim.SGD(model.parameters(), lr=0.1)
    )
    with pytest.raises(poptorch.Error, match="gradientAccumulation must be greater than or equal"):
        step(x[:4], y[:4])


def test_update_from_string_turns_a_proportion_list_back_into_one_float():
    cfg = IPUConfig(layers_per_ipu=[1, 1], matmul_proportion=[0.1, 0.3])
    cfg.update_from_string("matmul_proportion=0.25,inference_matmul_proportion=[0.5 0.6]")
    assert (cfg.matmul_proportion, cfg.inference_matmul_proportion) == (0.25, [0.5, 0.6])
    with pytest.raises(ValueError, match="Cannot convert matmul_proportion='high'"):
        cfg.update_from_string("matmul_proportion=high")


def test_load_names_a_file_that_is_not_json(tmp_path):
    (tmp_path / CONFIG_NAME).write_text("replication_factor: 2\n")
    with pytest.raises(ValueError, match=f"{CONFIG_NAME} is not a JSON IPUConfig"):
        IPUConfig.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        IPUConfig.load(tmp_path / "missing.json")


def test_one_ipu_ignores_layers_per_ipu_until_ipus_per_replica_changes_with_it():
    cfg = IPUConfig()
    cfg.update_from_string("layers_per_ipu=[2 -1]")  # ipus_per_replica stays 1 (derived once)
    assert cfg.expand_layers_per_ipu(6) == [6]
    cfg.update(layers_per_ipu=[2, -1], ipus_per_replica=2)
    assert cfg.expand_layers_per_ipu(6) == [2, 4]


# An ipu_config.json as optimum-graphcore's save_pretrained writes it (a 4-IPU BERT layout):
# its own metadata and the settings ipuloop does not implement, at their "off" values.
OPTIMUM_JSON = {
    "device_iterations": 1,
    "embedding_serialization_factor": 1,
    "enable_half_partials": True,
    "executable_cache_dir": "./exe_cache",
    "explicit_ir_inference": False,
    "gradient_accumulation_steps": 16,
    "inference_device_iterations": 4,
    "inference_embedding_serialization_factor": 1,
    "inference_ipus_per_replica": 4,
    "inference_layers_per_ipu": [0, 4, 4, 4],
    "inference_matmul_proportion": [0.1, 0.15, 0.15, 0.15],
    "inference_parallelize_kwargs": {},
    "inference_projection_serialization_factor": 1,
    "inference_replication_factor": 4,
    "inference_serialized_embedding_splits_per_ipu": None,
    "inference_serialized_projection_splits_per_ipu": None,
    "ipus_per_replica": 4,
    "layers_per_ipu": [0, 4, 4, 4],
    "matmul_proportion": [0.1, 0.15, 0.15, 0.15],
    "optimizer_state_offchip": True,
    "optimum_version": "1.6.1",
    "output_mode": "final",
    "parallelize_kwargs": {},
    "projection_serialization_factor": 1,
    "recompute_checkpoint_every_layer": True,
    "replicated_tensor_sharding": True,
    "replication_factor": 1,
    "seed": 42,
    "serialized_embedding_splits_per_ipu": None,
    "serialized_projection_splits_per_ipu": None,
    "transformers_version": "4.29.2",
    "auto_loss_scaling": False,
}


def test_an_optimum_ipu_config_json_loads(tmp_path, recwarn):
    (tmp_path / CONFIG_NAME).write_text(json.dumps(OPTIMUM_JSON))
    cfg = IPUConfig.load(tmp_path)
    assert not [w for w in recwarn if "ignores optimum-graphcore" in str(w.message)]
    assert (
        cfg.layers_per_ipu,
        cfg.ipus_per_replica,
        cfg.gradient_accumulation_steps,
        cfg.seed,
    ) == ([0, 4, 4, 4], 4, 16, 42)
    assert cfg.layer_ipu(12) == [1] * 4 + [2] * 4 + [3] * 4
    assert "optimum_version" not in cfg.to_dict()
    assert IPUConfig.load(cfg.save(tmp_path / "again.json")) == cfg  # ipuloop's own round trip


def test_optimum_settings_ipuloop_does_not_implement_warn_when_on():
    with pytest.warns(
        UserWarning,
        match=r"ignores optimum-graphcore settings it does not "
        r"implement: embedding_serialization_factor=4, explicit_ir_inference=True",
    ):
        cfg = IPUConfig(
            embedding_serialization_factor=4,
            explicit_ir_inference=True,
            sharded_execution_for_inference=True,
            optimum_version="1.6.1",
        )
    assert cfg == IPUConfig()
    with pytest.raises(IncompatibleIPUConfigError, match="unknown arguments: profile_dir="):
        IPUConfig(profile_dir="x", optimum_version="1.6.1")
