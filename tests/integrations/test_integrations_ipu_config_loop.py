"""An IPUConfig drives the Loop's training and inference options."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import IPUConfig, Loop, poptorch
from ipuloop.integrations.ipu_config import place_layers


def test_ipu_config_drives_training_and_inference_options(tmp_path):
    config = IPUConfig(
        device_iterations=2,
        gradient_accumulation_steps=3,
        inference_device_iterations=4,
        replication_factor=2,
        inference_replication_factor=1,
        output_mode="all",
        seed=0,
    )
    config.save(tmp_path)
    config = IPUConfig.load(tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    ds = TensorDataset(torch.randn(96, 4), torch.randint(0, 3, (96,)))
    loop = Loop(model, config, loss_fn=nn.CrossEntropyLoss(), progress=False)
    hist = loop.fit(DataLoader(ds, batch_size=2), epochs=1, val_loader=DataLoader(ds, batch_size=2))
    t = loop.train_model._options
    assert (t.device_iterations, t.Training.gradient_accumulation, t.replication_factor) == (
        2,
        3,
        2,
    )
    assert t.output_mode == poptorch.OutputMode.All and t.random_seed == 0
    (inf,) = loop.executors.inference.values()
    i = inf._options
    assert (i.device_iterations, i.Training.gradient_accumulation, i.replication_factor) == (
        4,
        1,
        1,
    )
    assert i.output_mode == poptorch.OutputMode.All
    assert isinstance(i._execution_strategy, poptorch.ShardedExecution)
    assert loop.state.step == 96 // (2 * 2 * 3 * 2)
    assert "val_loss" in hist[0]


def _placed(config: IPUConfig) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(4, 16), nn.Tanh()),
        nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
        nn.Linear(16, 3),
    )
    place_layers(list(model), config)  # [-1, -1] over 3 layers: IPU0 gets 1, IPU1 gets 2
    return model


def test_placed_layers_and_a_config_drive_a_pipelined_fit():
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(144, 4), torch.randint(0, 3, (144,)))
    config = IPUConfig(
        layers_per_ipu=[-1, -1],
        gradient_accumulation_steps=2,
        device_iterations=2,
        inference_device_iterations=3,
    )
    loop = Loop(_placed(config), config, loss_fn=nn.CrossEntropyLoss(), progress=False)
    # Two pipelined stages need GA >= 3: the Loop compiled the config's placement and strategy.
    with pytest.raises(poptorch.Error, match=r"number of pipeline stages \(3\)"):
        loop.fit(DataLoader(ds, batch_size=4), epochs=1)
    config.gradient_accumulation_steps = 3
    loop = Loop(_placed(config), config, loss_fn=nn.CrossEntropyLoss(), progress=False)
    hist = loop.fit(DataLoader(ds, batch_size=4), epochs=2, val_loader=DataLoader(ds, batch_size=4))
    assert loop.state.step == 2 * 144 // (4 * 2 * 3)
    assert hist[1]["train_loss"] < hist[0]["train_loss"]
    (inf,) = loop.executors.inference.values()
    assert inf._options.device_iterations == 3
    assert isinstance(inf._options._execution_strategy, poptorch.ShardedExecution)
