"""A ``torch.optim`` optimizer runs as its ``poptorch.optim`` twin: the same math as plain torch,
its LR schedule on the device, its state read back and checkpointed, a resume in a new process
bitwise equal to the uninterrupted fit; what has no twin stays refused, naming the fix."""

from __future__ import annotations

import copy
import sys
import textwrap

import pytest
from torch_versions import newer_torch
import torch
import warm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Loop, poptorch
from ipuloop import optimizer_twin as twin_mod
from ipuloop.callbacks import LRScheduler, ModelCheckpoint

OPTIMIZERS = {
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
}


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 5, generator=g), torch.randn(64, 1, generator=g))


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def _plain_torch(model, opt, data, epochs, lr_at=None):
    x, y = data.tensors
    for epoch in range(epochs):
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(epoch)
        for i in range(0, len(x), 8):  # DI 2 x micro-batch 4: an update per micro-batch
            opt.zero_grad()
            nn.functional.mse_loss(model(x[i : i + 4]), y[i : i + 4]).backward()
            opt.step()
            opt.zero_grad()
            nn.functional.mse_loss(model(x[i + 4 : i + 8]), y[i + 4 : i + 8]).backward()
            opt.step()


def _max_diff(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_torch_optimizer_trains_as_plain_torch_and_reads_its_state_back(name):
    model, data = _model(), _data()
    ref = copy.deepcopy(model)
    opt = OPTIMIZERS[name](model.parameters())
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2),
        optimizer=opt,
        loss_fn=nn.MSELoss(),
        progress=False,
    )
    loop.fit(DataLoader(data, batch_size=4), epochs=2)
    assert loop.executors.twin is not None and loop.optimizer is opt  # the host keeps its own
    ref_opt = OPTIMIZERS[name](ref.parameters())
    _plain_torch(ref, ref_opt, data, 2)
    assert _max_diff(model.parameters(), ref.parameters()) < 2e-5
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sorted(got) == sorted(want) and want  # every parameter's state, after the fit
    for i in want:
        assert set(got[i]) == set(want[i])
        for k, v in want[i].items():
            assert torch.allclose(torch.as_tensor(got[i][k]), torch.as_tensor(v), atol=2e-5)


def test_an_lr_schedule_on_the_torch_optimizer_reaches_the_device():
    model, data = _model(), _data()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(2),
        optimizer=opt,
        loss_fn=nn.MSELoss(),
        progress=False,
        callbacks=[LRScheduler(sched, interval="epoch")],
    )
    loop.fit(DataLoader(data, batch_size=4), epochs=3)
    assert loop.optimizer_pushes == 2  # the two epochs' new LR, each pushed once
    assert loop.executors.twin.param_groups[0]["lr"] == pytest.approx(0.02 * 0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.02)
    _plain_torch(ref, ref_opt, data, 3, lr_at=lambda e: 0.02 * 0.1**e)
    assert _max_diff(model.parameters(), ref.parameters()) < 2e-5
    # without the pushes the device would have trained 3 epochs at lr 0.02: far away
    far = copy.deepcopy(_model())
    _plain_torch(far, torch.optim.Adam(far.parameters(), lr=0.02), data, 3)
    assert _max_diff(model.parameters(), far.parameters()) > 1e-3


# Trains 3 epochs of a torch.optim.Adam fit with a checkpoint every step; "stop" ends it after
# step 5 (mid-epoch 2), "resume" continues from the newest checkpoint in a new process.
SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from ipuloop import Callback, Loop, poptorch
    from ipuloop.callbacks import LRScheduler, ModelCheckpoint

    class Start(Callback):
        def on_fit_start(self, loop):
            self.step = loop.state.step

    mode, folder, out = sys.argv[1:4]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 5, generator=g), torch.randn(48, 1, generator=g))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loop = Loop(model, poptorch.Options().deviceIterations(2), optimizer=opt,
                loss_fn=nn.MSELoss(), seed=3, progress=False,
                callbacks=[LRScheduler(sched, interval="epoch"), start := Start(),
                           ModelCheckpoint(folder, every_n_steps=1)])
    loader = DataLoader(data, batch_size=4, shuffle=True)
    loop.fit(loader, epochs=3, max_steps=5 if mode == "stop" else None,
             resume_from="last" if mode == "resume" else None)
    torch.save({"weights": model.state_dict(), "state": opt.state_dict(),
                "history": loop.state.history, "start": start.step}, out)
""")


def test_a_fit_stopped_and_resumed_in_a_new_process_equals_the_uninterrupted_one(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)

    def run(mode: str, folder: str) -> dict:
        out = tmp_path / f"{mode}-{folder}.pt"
        r = warm.run(
            [sys.executable, str(script), mode, str(tmp_path / folder), str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        return torch.load(out, weights_only=False)

    whole = run("whole", "a")
    run("stop", "b")
    resumed = run("resume", "b")
    assert (
        resumed["start"] == 5 and whole["start"] == 0
    )  # it continued after step 5    assert whole["weights"].keys() == resumed["weights"].keys()
    for k, v in whole["weights"].items():
        assert torch.equal(v, resumed["weights"][k]), k
    for i, state in whole["state"]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, resumed["state"]["state"][i][k]), (i, k)
    assert whole["state"]["param_groups"][0]["lr"] == resumed["state"]["param_groups"][0]["lr"]
    assert [h["train_loss"] for h in whole["history"]] == [
        h["train_loss"] for h in resumed["history"]
    ]


class _MyAdam(torch.optim.Adam):
    """A subclass: its step may differ from Adam's, so it has no twin."""


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: _MyAdam(p, lr=0.01), "no torch.optim SGD, Adam, AdamW or RMSprop itself"),
        pytest.param(
            lambda p: torch.optim.Adam(p, lr=0.01, decoupled_weight_decay=True),
            "has decoupled_weight_decay at a value its poptorch.optim twin does not take",
            marks=newer_torch("torch.optim.Adam takes decoupled_weight_decay from torch 2.5"),
        ),
        (lambda p: torch.optim.Adagrad(p, lr=0.01), "no torch.optim SGD, Adam, AdamW"),
    ],
)
def test_a_stateful_optimizer_without_a_twin_is_refused_naming_the_fix(tmp_path, make, reason):
    model = _model()
    loop = Loop(
        model,
        optimizer=make(model.parameters()),
        loss_fn=nn.MSELoss(),
        progress=False,
        callbacks=[ModelCheckpoint(tmp_path)],
    )
    with pytest.raises(ValueError, match="Use a") as info:
        loop.fit(DataLoader(_data(), batch_size=4))
    assert reason in str(info.value)
    assert loop.train_model is None  # before anything compiled


def test_the_twin_compiles_the_constants_poptorch_gives_the_torch_optimizer():
    """``_optimizer_attributes.py``: for a torch optimizer (no ``variable_attrs``), ``lr`` is
    never constant, ``momentum``, ``dampening`` and ``weight_decay`` are constant at 0 (AdamW's
    weight decay at 1e-2), ``eps`` at 1e-8, ``betas`` and ``nesterov`` always, ``loss_scaling``
    at 1.0."""
    p = list(_model().parameters())
    sgd = twin_mod.make(poptorch, torch.optim.SGD(p, lr=0.1, momentum=0.9))
    va = sgd.variable_attrs
    assert isinstance(sgd, poptorch.optim.SGD)
    assert not va.isConstant("lr") and not va.isConstant("momentum")
    assert va.isConstant("dampening") and va.isConstant("weight_decay")
    assert va.isConstant("nesterov") and va.isConstant("loss_scaling")
    adamw = twin_mod.make(poptorch, torch.optim.AdamW(p, lr=0.1)).variable_attrs
    assert adamw.isConstant("weight_decay") and adamw.isConstant("betas")
    assert adamw.isConstant("eps") and not adamw.isConstant("lr")
    adam = twin_mod.make(poptorch, torch.optim.Adam(p, lr=0.1, weight_decay=0.01, eps=1e-6))
    assert not adam.variable_attrs.isConstant("weight_decay")
    assert not adam.variable_attrs.isConstant("eps")
    assert twin_mod.make(poptorch, poptorch.optim.Adam(p, lr=0.1)) is None  # its own already


def test_a_constant_changed_after_compiling_fails_as_for_the_torch_optimizer():
    """Momentum 0 is constant for a torch SGD: a callback raising it fails at the push, as
    PopTorch fails a torch optimizer's constant changing."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loop = Loop(model, optimizer=opt, loss_fn=nn.MSELoss(), progress=False)
    loader = DataLoader(_data(), batch_size=4)
    loop.fit(loader, max_steps=1)
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match=r"\['momentum'\] are constant"):
        loop.fit(loader)
