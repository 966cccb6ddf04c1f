"""An IPUConfig drives the Loop's training and inference options."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import IPUConfig, Loop, poptorch


def test_ipu_config_drives_training_and_inference_options(tmp_path):
    config = IPUConfig(device_iterations=2, gradient_accumulation_steps=3,
                       inference_device_iterations=4, replication_factor=2,
                       inference_replication_factor=1, output_mode="all", seed=0)
    config.save(tmp_path)
    config = IPUConfig.load(tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    ds = TensorDataset(torch.randn(96, 4), torch.randint(0, 3, (96,)))
    loop = Loop(model, config, loss_fn=nn.CrossEntropyLoss(), progress=False)
    hist = loop.fit(DataLoader(ds, batch_size=2), epochs=1, val_loader=DataLoader(ds, batch_size=2))
    t = loop.train_model._options
    assert (t.device_iterations, t.Training.gradient_accumulation, t.replication_factor) == (2, 3, 2)
    assert t.output_mode == poptorch.OutputMode.All and t.random_seed == 0
    (inf,) = loop._inference.values()
    i = inf._options
    assert (i.device_iterations, i.Training.gradient_accumulation, i.replication_factor) == (4, 1, 1)
    assert i.output_mode == poptorch.OutputMode.All
    assert isinstance(i._execution_strategy, poptorch.ShardedExecution)
    assert loop.state.step == 96 // (2 * 2 * 3 * 2)
    assert "val_loss" in hist[0]
