"""The emulator on CUDA (IPULOOP_EMULATOR_DEVICE=cuda) computes what it computes on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCRIPT = r"""
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from ipuloop import Loop, poptorch
torch.manual_seed(0)
x = torch.randn(256, 8, dtype=torch.float64)
y = (x[:, 0] > 0).long()
model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
opts.Training.gradientAccumulation(2)
loop = Loop(model, opts, loss_fn=nn.CrossEntropyLoss(), progress=False,
            optimizer=poptorch.optim.AdamW(model.parameters(), lr=1e-2))
loop.fit(DataLoader(TensorDataset(x, y), batch_size=4), epochs=2)
out = loop.predict(DataLoader(TensorDataset(x[:10]), batch_size=2))
assert out.device.type == "cpu" and out.dtype == torch.float32
torch.save({k: v.cpu() for k, v in model.state_dict().items()}, "%s")
"""


def run(device: str, path: str) -> dict:
    env = dict(os.environ, IPULOOP_EMULATOR_DEVICE=device, IPULOOP_BACKEND="emulator")
    subprocess.run([sys.executable, "-c", SCRIPT % path], env=env, check=True, timeout=300)
    return torch.load(path, weights_only=True)


def test_cuda_emulation_matches_cpu(tmp_path):
    cpu = run("cpu", str(tmp_path / "cpu.pt"))
    gpu = run("cuda", str(tmp_path / "gpu.pt"))
    for k in cpu:
        assert torch.allclose(cpu[k].float(), gpu[k].float(), atol=1e-4), k
