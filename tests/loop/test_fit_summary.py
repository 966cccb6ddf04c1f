"""``Loop.summary``: what a fit runs, read from the options, the plan and the model's
``BeginBlock`` placement; the threads line and its fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import IPUConfig, Loop, poptorch
from ipuloop import fit_summary as fs
from ipuloop.integrations.ipu_config import place_layers


@pytest.fixture
def quiet_host(monkeypatch):
    """8 torch threads on an idle 8-core host: no advice."""
    monkeypatch.setattr(fs, "host_cores", lambda: 8)
    monkeypatch.setattr(fs, "host_load", lambda: 0.2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)


def _pipeline() -> nn.Module:
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(16, 32), nn.ReLU()),
        nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
        nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
        nn.Linear(32, 2),
    ]
    for ipu, layer in enumerate(layers):
        poptorch.BeginBlock(layer, ipu_id=ipu)
    return nn.Sequential(*layers)


def _loader(n: int = 2048) -> DataLoader:
    x = torch.randn(n, 16)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


def test_a_four_stage_pipeline_in_ten_lines(quiet_host):
    model = _pipeline()
    opts = poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.Final)
    opts.Training.gradientAccumulation(8)
    loop = Loop(
        model,
        opts,
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        progress=False,
    )
    assert loop.summary(_loader()).splitlines() == [
        f"fit: the emulator (PopTorch {poptorch.__version__} API) on cpu",
        "  batch: micro 8 x DI 2 x GA 8 x RF 1 = 128 samples a host call",
        "  epoch: 16 steps, 32 optimizer updates; output mode Final",
        "  ipu 0: 0 Sequential; 544 params",
        "  ipu 1: 1 Sequential; 1,056 params",
        "  ipu 2: 2 Sequential; 1,056 params",
        "  ipu 3: 3 Linear; 66 params",
        "  precision 32; optimizer torch.optim.Adam (lr 0.001), run as poptorch.optim.Adam",
        "  threads: torch 8, host 8 core(s), load 0.2",
    ]
    assert loop.train_model is None  # nothing compiled, nothing run


def test_layers_placed_by_an_ipu_config_are_listed_as_runs(quiet_host):
    config = IPUConfig(layers_per_ipu=[-1, -1], device_iterations=2, gradient_accumulation_steps=4)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(8)] + [nn.Linear(8, 2)]
    place_layers(layers, config)
    model = nn.Sequential(*layers)
    loop = Loop(model, config, loss_fn=nn.CrossEntropyLoss(), progress=False)
    x = torch.randn(512, 8)
    text = loop.summary(DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8))
    assert "  ipu 0: 0-3 Sequential; 288 params" in text.splitlines()
    assert "  ipu 1: 4-7 Sequential, 8 Linear; 306 params" in text.splitlines()
    assert "output mode Final" in text  # IPUConfig's default, as optimum's


def test_nested_blocks_take_the_parameters_of_their_layers():
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)  # 40: before the first block, IPU 0
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])  # 20 each
            poptorch.BeginBlock(self.layers[1], ipu_id=1)
            poptorch.BeginBlock(self.layers[2], "head")  # a block without an IPU

    assert fs.placement(Encoder()) == [
        ("ipu 0", ["embed", "layers.0"], 60),
        ("ipu 1", ["layers.1"], 20),
        ("block head", ["layers.2"], 20),
    ]
    assert fs.placement(nn.Linear(2, 2)) == []  # no BeginBlock: nothing to place


def test_without_begin_block_the_model_is_one_line(quiet_host):
    loop = Loop(nn.Linear(16, 2), loss_fn=nn.CrossEntropyLoss(), progress=False)
    lines = loop.summary(_loader(64)).splitlines()
    assert "  model: Linear, 34 params (no BeginBlock)" in lines
    assert "  epoch: 8 steps, 8 optimizer updates; output mode Sum" in lines
    assert "optimizer poptorch.optim.SGD (lr 0.01)" in lines[-2]  # PopTorch's default


@pytest.mark.parametrize(
    "threads, cores, load, fix",
    [
        (8, 8, 0.2, None),
        (2, 2, 1.7, "OMP_NUM_THREADS=1 (before Python starts) or torch.set_num_threads(1)"),
        (16, 2, 3.1, "16 torch threads > 1 idle core(s)"),
        (8, 16, 10.0, "OMP_NUM_THREADS=6"),
        (4, 16, 10.0, None),
        (4, 4, None, None),  # no load average: every core counts as idle
    ],
)
def test_threads_beyond_the_idle_cores_name_the_fix(threads, cores, load, fix):
    line, advice = fs.thread_advice(threads, cores, load)
    assert line.startswith(f"threads: torch {threads}, host {cores} core(s)")
    if fix is None:
        assert advice is None
    else:
        assert advice is not None and fix in advice


def test_blocks_opened_in_forward_are_listed_by_the_strategy_s_stages(quiet_host):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 2)

        def forward(self, x):
            with poptorch.Block("B1"):
                x = self.a(x)
            with poptorch.Block("B2"):
                return self.b(x)

    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(4)
    opts.setExecutionStrategy(
        poptorch.PipelinedExecution(poptorch.Stage("B1").ipu(0), poptorch.Stage("B2").ipu(1))
    )
    loop = Loop(Net(), opts, loss_fn=nn.CrossEntropyLoss(), progress=False)
    lines = loop.summary(_loader(64)).splitlines()
    assert "  stages: B1 on ipu 0, B2 on ipu 1 (poptorch.Block in forward)" in lines
    assert "  model: Net, 154 params (no BeginBlock)" in lines
