"""What the loop does on real PopTorch 3.4, where the emulator used to be more forgiving.

Each test pins a PopTorch behaviour the emulator now has (its source line cited) and the
loop's use of it: reading weights after a detach, precision, optimizer state, inference
options, custom batch samplers, distributed slices, the backend fallback, learning rates,
the IPU count and recomputation checkpoints.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch_versions import newer_torch
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Callback, CancelFit, Loop, poptorch
from ipuloop.callbacks.checkpoint import ModelCheckpoint, load_checkpoint

IN, OUT = 6, 3


class Net(nn.Module):
    """A model-with-loss: (output, loss) with labels, output without."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(IN, 8), nn.ReLU(), nn.Linear(8, OUT))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        out = self.net(x)
        return out if labels is None else (out, self.loss(out, labels))


def data(n: int = 32, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


def make_loop(**kw) -> Loop:
    model = Net()
    kw.setdefault("optimizer", poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return Loop(model, kw.pop("opts", None), progress=False, **kw)


# -- 1. weights are never read from a detached executor ---------------------------------------
def test_copy_weights_to_host_on_a_detached_model_is_an_error():
    """PopTorch's ``copyWeightsToHost`` checks only ``isCompiled()`` and then runs
    ``poptorch_core.copyWeightsToHost_impl(self._executable, ...)`` (``_poplar_executor.py``,
    ``PoplarExecutor.copyWeightsToHost``): on a detached model that reads a device the process
    no longer holds, so the emulator raises; ``detachFromDevice`` already copied them back
    (``self.copyWeightsToHostIfNeeded()`` before ``poptorch_core.detachFromDevice``)."""
    model = Net()
    train = poptorch.trainingModel(
        model, poptorch.Options(), poptorch.optim.SGD(model.parameters(), lr=0.1)
    )
    x, y = data(4)[:]
    train(x, y)
    train.detachFromDevice()
    trained = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(poptorch.Error, match="detached"):
        train.copyWeightsToHost()
    assert not train.copyWeightsToHostIfNeeded()  # the detach synced: nothing to read
    assert all(torch.equal(a, b) for a, b in zip(trained, model.parameters()))


class _After(Callback):
    """Runs ``action(loop)`` at ``on_validation_end`` of the first epoch."""

    def __init__(self, action) -> None:
        self.action = action

    def on_validation_end(self, loop):
        if loop.state.epoch == 0:
            self.action(loop)


def _sigterm(loop):
    loop.state.preempted = True  # what the SIGTERM handler does


def _fail(loop):
    raise RuntimeError("boom")


@pytest.mark.parametrize("when", ["epoch_end", "sigterm", "exception", "after_fit"])
def test_checkpoints_after_validation_hold_the_trained_weights(tmp_path, when):
    """A save after validation (epoch end, SIGTERM, an exception) or after ``fit`` finds the
    training model detached (the inference model ran); the weights it holds are the host's."""
    ckpt = ModelCheckpoint(tmp_path, every_n_epochs=1 if when == "epoch_end" else None)
    action = {"sigterm": _sigterm, "exception": _fail}.get(when)
    loop = make_loop(callbacks=[ckpt] + ([_After(action)] if action else []))
    if when == "sigterm":
        with pytest.raises(SystemExit):
            loop.fit(DataLoader(data(), batch_size=4), epochs=2, val_loader=DataLoader(data(8)))
    elif when == "exception":
        with pytest.raises(RuntimeError, match="boom"):
            loop.fit(DataLoader(data(), batch_size=4), epochs=2, val_loader=DataLoader(data(8)))
    else:
        loop.fit(DataLoader(data(), batch_size=4), epochs=1, val_loader=DataLoader(data(8)))
    assert not loop.train_model.isAttachedToDevice()
    saved = (
        loop.state_dict()["model"]
        if when == "after_fit"
        else load_checkpoint(sorted(tmp_path.glob("*/manifest.json"))[0].parent)["model"]
    )
    host = loop.model.state_dict()
    assert saved.keys() == host.keys()
    assert all(torch.equal(saved[k], host[k]) for k in host)
    assert not torch.equal(host["net.0.weight"], Net().state_dict()["net.0.weight"])  # trained


# -- 7. small ones -----------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["auto", "poptorch"])
def test_a_poptorch_that_fails_to_import_falls_back_only_under_auto(tmp_path, monkeypatch, choice):
    """A PopTorch wheel built for another torch fails with an ``AssertionError``, not an
    ``ImportError``: ``assert torch.__version__.startswith("@TORCH_VERSION@"), ("This version
    of PopTorch only works with torch==...")`` (``python/__init__.py``)."""
    from ipuloop import backend

    (tmp_path / "poptorch.py").write_text(
        "raise AssertionError('This version of PopTorch only works with torch==2.0.1')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("IPULOOP_BACKEND", choice)
    monkeypatch.setattr(backend, "_resolved", None)
    if choice == "poptorch":
        with pytest.raises(backend.BackendError, match="AssertionError: This version of PopTorch"):
            backend.poptorch_module()
        return
    with pytest.warns(RuntimeWarning, match="AssertionError: This version of PopTorch"):
        assert backend.poptorch_module() is poptorch
    assert backend.backend_name() == "emulator"


def test_the_emulator_asserts_numbers_as_hyperparameters():
    """``_assertIsNumber``: ``assert isinstance(value, numbers.Number), (f"Expected a number for
    {name} but got {value} instead")`` on every group variable, lr included
    (``_optimizer_attributes.py``, ``convertOptimizerToDict``)."""
    model = Net()
    with pytest.raises(AssertionError, match="Expected a number for lr"):
        poptorch.trainingModel(
            model, poptorch.Options(), torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
        )
    ok = torch.optim.SGD(model.parameters(), lr=0.1)
    train = poptorch.trainingModel(model, poptorch.Options(), ok)
    ok.param_groups[0]["lr"] = torch.tensor(0.05)
    with pytest.raises(AssertionError, match="Expected a number for lr"):
        train.setOptimizer(ok)


def test_the_loop_pushes_tensor_learning_rates_as_numbers():
    """The loop keeps a tensor lr a tensor on the host (updated in place) and pushes floats."""
    lr = torch.tensor(0.1)

    class Halve(Callback):
        def on_train_step_end(self, loop):
            lr.mul_(0.5)

    model = Net()
    loop = Loop(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        progress=False,
        callbacks=[Halve()],
    )
    loop.fit(DataLoader(data(12), batch_size=4))
    assert loop.optimizer.param_groups[0]["lr"] is lr and loop.optimizer_pushes == 2
    assert loop.train_model._device_optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_replicas_count_ipus_as_poptorch_reserves_them(monkeypatch):
    """PopTorch reserves max(IPUs used, highest IPU + 1) x replicationFactor IPUs, rounded up to
    a power of 2 with autoRoundNumIPUs (``CompilerImpl.cpp`` ``createDevice``; docs/poptorch-semantics.md §1.3):
    an IPU with no layers past the last used one is not reserved, and the system is asked for
    the rounded count."""
    from ipuloop.integrations.ipu_config import IPUConfig

    asked = []
    monkeypatch.setattr(
        poptorch,
        "ipuHardwareIsAvailable",
        lambda num_ipus=1: asked.append(num_ipus) or num_ipus <= 64,
    )
    loop = make_loop(opts=IPUConfig(layers_per_ipu=[2, 0], ipus_per_replica=2), replicas=64)
    assert loop.train_opts.replication_factor == 64 and asked[-1] == 64
    make_loop(opts=IPUConfig(layers_per_ipu=[1, 1, 1]), replicas=2)
    assert asked[-1] == 8  # 2 x 3 = 6 IPUs, reserved as 8
    with pytest.raises(ValueError, match="= 3 is not one"):
        make_loop(opts=poptorch.Options(), replicas=3)


def test_recomputation_checkpoints_get_tensors_only():
    """``recomputationCheckpoint`` raises ``ValueError("All inputs must be tensors")`` for any
    other argument (``ops.py``); a layer returning (tensor, None) passes the None through."""
    from ipuloop.integrations.placement import _RecomputeHook

    with pytest.raises(ValueError, match="All inputs must be tensors"):
        poptorch.recomputationCheckpoint(torch.ones(1), None)
    out = _RecomputeHook(poptorch)(nn.Identity(), (), (torch.ones(2), None))
    assert torch.equal(out[0], torch.ones(2)) and out[1] is None


def test_mnist_ipu_config_inference_uses_the_training_ipus(tmp_path):
    """Inference options from an IPUConfig shard with ``AutoStage.AutoIncrement``, whose stage
    ids start at 1: blocks B1..B4 would land on IPUs 1..4, 5 IPUs (``_options_impl.py``,
    ``AutoStage.AutoIncrement``); the example places them as training does."""
    from ipuloop.integrations.ipu_config import IPUConfig
    from ipuloop.examples import mnist

    IPUConfig(device_iterations=1, gradient_accumulation_steps=8).save(tmp_path / "c.json")
    args = mnist.parse_args(["--ipu-config", str(tmp_path / "c.json")])
    _, opts, inference = mnist.config_options(args)
    model = mnist.TrainingModelWithLoss(mnist.Network())
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    train = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1))
    train.compile(x, y)
    infer = poptorch.inferenceModel(model, inference)
    infer.compile(x[:1])
    assert infer.num_ipus <= train.num_ipus == 4


# -- 3. optimizer state: poptorch.optim only ---------------------------------------------------
def test_a_torch_optim_optimizer_state_stays_on_the_device():
    """PopTorch reads the device's optimizer state only for its own optimizers:
    ``_read_optim_state_dict_if_needed`` returns at ``if not isinstance(self._optimizer,
    Optimizer)`` and ``setOptimizer`` rebinds ``state_dict`` only ``if isinstance(optimizer,
    Optimizer)``; ``_write_optim_state_dict_if_needed`` likewise (``_poplar_executor.py``)."""
    for cls, read_back in ((torch.optim.Adam, False), (poptorch.optim.Adam, True)):
        model = Net()
        opt = cls(model.parameters(), lr=0.01)
        train = poptorch.trainingModel(model, poptorch.Options().deviceIterations(2), opt)
        train(*data(8)[:])
        assert bool(opt.state_dict()["state"]) is read_back
        train.detachFromDevice()
        assert bool(opt.state) is read_back


class _SubclassedAdamW(torch.optim.AdamW):
    """A torch.optim subclass: its update may differ from AdamW's, so it has no twin."""


@pytest.mark.parametrize("how", ["checkpoint", "resume", "state_dict"])
def test_checkpointing_a_stateful_optimizer_without_a_twin_is_refused_before_training(
    tmp_path, how
):
    model = Net()
    opt = _SubclassedAdamW(model.parameters(), lr=0.02)
    loop = Loop(
        model,
        optimizer=opt,
        progress=False,
        callbacks=[ModelCheckpoint(tmp_path)] if how == "checkpoint" else [],
    )
    with pytest.raises(ValueError, match=r"poptorch.optim.AdamW\(params, lr=0.02, "):
        if how == "state_dict":
            loop.state_dict()
        else:
            loop.fit(
                DataLoader(data(), batch_size=4),
                resume_from=str(tmp_path) if how == "resume" else None,
            )
    assert loop.train_model is None  # refused before anything was compiled
    # stateless (SGD without momentum), poptorch.optim optimizers and the torch.optim ones the
    # loop runs as their poptorch.optim twin checkpoint exactly
    for opt in (
        torch.optim.SGD(model.parameters(), lr=0.1),
        poptorch.optim.AdamW(model.parameters(), lr=0.02),
        torch.optim.AdamW(model.parameters(), lr=0.02),
    ):
        Loop(model, optimizer=opt, progress=False).state_dict()


# -- 4. inference options ----------------------------------------------------------------------
@newer_torch("torch < 2.1 has no float16 CPU kernels for backward and optimizer ops")
def test_inference_options_drop_training_only_settings():
    """``_TrainingOptions``: "You must not set these options for inference models"
    (``options.py``); PopART refuses automatic loss scaling for a session that does not train,
    and an inference graph has no gradients or updated weights to anchor. (Automatic loss
    scaling needs float16 gradients: the loop trains in "16-mixed", float32 weights computing
    in float16.)"""
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    with pytest.raises(poptorch.Error, match="Automatic loss scaling is a training setting"):
        poptorch.inferenceModel(Net(), opts.clone())
    opts.anchorTensor("grad", "Gradient___net.0.weight")
    loop = make_loop(opts=opts, precision="16-mixed")
    hist = loop.fit(DataLoader(data(), batch_size=4), val_loader=DataLoader(data(8), batch_size=4))
    assert "val_loss" in hist[-1]
    assert loop.train_model.getAnchoredTensor("grad").shape == (8, IN)


# -- 5. custom batch samplers ------------------------------------------------------------------
class _Pairs(torch.utils.data.Sampler):
    """A custom batch sampler: consecutive pairs of indices (``batch_size`` 2)."""

    batch_size = 2

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter([[i, i + 1] for i in range(0, self.n - 1, 2)])

    def __len__(self) -> int:
        return self.n // 2


def test_the_emulator_counts_a_batch_samplers_batches():
    """With a ``batch_sampler``, PopTorch's ``DataLoader.__len__`` is ``super().__len__()`` (the
    sampler's micro-batches) and ``__iter__`` returns ``_utils.combined_batch_generator(...)``,
    a plain generator (``python/__init__.py``)."""
    loader = poptorch.DataLoader(
        poptorch.Options().deviceIterations(2), data(16), batch_sampler=_Pairs(16)
    )
    assert len(loader) == 8 and len(list(loader)) == 4


class _Workers(Callback):
    """Records the running epoch's loader worker processes (its iterator: the last of
    ``epochs``, the ``epoch_readers`` fixture)."""

    def __init__(self, epochs: list) -> None:
        self.epochs = epochs
        self.workers = []

    def on_train_step_end(self, loop):
        self.workers += getattr(self.epochs[-1].units, "_workers", [])


@pytest.mark.parametrize("max_steps", [None, 3])
def test_a_custom_batch_sampler_counts_host_calls(max_steps, epoch_readers):
    """DI 2 and 2-sample batches: 32 samples are 16 batches, 8 host calls an epoch; the
    progress total, the counters and epoch completion count host calls, and the loader's
    worker processes end with the fit."""
    workers = _Workers(epoch_readers)
    loop = make_loop(opts=poptorch.Options().deviceIterations(2), callbacks=[workers])
    loader = DataLoader(data(32), batch_sampler=_Pairs(32), num_workers=1)
    hist = loop.fit(loader, epochs=2, max_steps=max_steps)
    assert loop.state.steps_per_epoch == 8
    if max_steps is None:
        assert loop.state.step == 16 and len(hist) == 2 and loop.state.samples == 64
    else:  # stopped in the first epoch: not complete
        assert loop.state.step == 3 and loop.state.epoch == 0 and loop.state.epoch_step == 3
    assert workers.workers and not any(w.is_alive() for w in workers.workers)


# -- 6. distributed slices ---------------------------------------------------------------------
class _Seen(TensorDataset):
    """Records every index read."""

    def __init__(self, n: int) -> None:
        super().__init__(*data(n).tensors)
        self.read: list[int] = []

    def __getitem__(self, i):
        self.read.append(int(i))
        return super().__getitem__(i)


def _process_plan(rank: int, loader: DataLoader, replicas: int = 1):
    from ipuloop.plan import build

    opts = poptorch.Options().replicationFactor(replicas).randomSeed(0)
    opts.Distributed.configureProcessId(rank, 2)
    opts.outputMode(poptorch.OutputMode.All)
    return build(poptorch, loader, opts, training=True, name="train_loader")


def _indices(plan) -> list[int]:
    """The dataset indices this instance's plan reads in its first epoch, in order."""
    order = plan.source.order
    order.selection = replace(plan.selection, stop=plan.steps * plan.per_step)
    return [int(i) for batch in order for i in batch]


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_process_reads_its_replicas_share_of_every_host_call(shuffle):
    """With ``Distributed.numProcesses`` 2 the loop does not take PopTorch's contiguous
    per-process slice (``_SubDataset``): each process reads, of every host call of the run
    (2 processes x 2 replicas x micro-batches of 4: 16 samples), the micro-batches its own
    replicas read in one process with 4 replicas; together they read each sample once."""
    reads = []
    for rank in (0, 1):
        plan = _process_plan(rank, DataLoader(_Seen(32), batch_size=4, shuffle=shuffle), 2)
        assert plan.combined == 8 and plan.steps == 2
        torch.manual_seed(3)  # the same global order on both
        reads.append(_indices(plan))
    torch.manual_seed(3)
    order = list(iter(torch.utils.data.RandomSampler(range(32)))) if shuffle else list(range(32))
    assert reads[0] == order[0:8] + order[16:24] and reads[1] == order[8:16] + order[24:32]
    assert sorted(reads[0] + reads[1]) == list(range(32))


def test_a_sampler_over_the_whole_dataset_gives_the_global_order():
    sampler = torch.utils.data.SubsetRandomSampler(range(32), generator=torch.Generator())
    reads = []
    for rank in (0, 1):
        sampler.generator.manual_seed(5)
        plan = _process_plan(rank, DataLoader(data(32), batch_size=4, sampler=sampler))
        reads.append(_indices(plan))
    sampler.generator.manual_seed(5)
    order = [int(i) for i in sampler]
    assert reads[0] == [i for k in range(4) for i in order[8 * k : 8 * k + 4]]
    assert reads[1] == [i for k in range(4) for i in order[8 * k + 4 : 8 * k + 8]]


# -- 2. one precision path ---------------------------------------------------------------------
class _HostFloat32(nn.Module):
    """A linear model whose host runs (outside the device) compute float32 only, as torch
    2.0.1's CPU, which has no float16 matmul ("addmm_impl_cpu_" not implemented for 'Half')."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x, labels=None):
        if not poptorch.isRunningOnIpu():
            assert x.dtype == self.lin.weight.dtype == torch.float32, "no float16 on this host"
        out = self.lin(x)
        return out if labels is None else (out, nn.functional.cross_entropy(out.float(), labels))


@pytest.mark.parametrize("precision", ["16-true", "16-mixed"])
def test_the_host_probe_computes_in_float32(precision):
    """Before compiling, the loop runs one micro-batch on the host: in float32, whatever the
    precision, since the host may lack float16 kernels; the device gets float16 inputs."""
    seen = []

    class BeforeCompiling(Callback):  # the fit ends there: what ran is the probe alone
        def on_compile_start(self, loop) -> None:
            raise CancelFit

    model = _HostFloat32()
    model.lin.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    loop = Loop(
        model,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1),
        precision=precision,
        progress=False,
        callbacks=[BeforeCompiling()],
    )
    loop.fit(DataLoader(data(8), batch_size=4))
    assert loop.state.step == 0 and not loop.train_model.isCompiled()
    assert seen == [torch.float32]
    assert model.lin.weight.dtype == (torch.float16 if precision == "16-true" else torch.float32)


_DEVICE_INPUTS: list[torch.dtype] = []  # (the emulator runs a copy of the module)


class _Recording(nn.Module):
    """Records the dtype of the inputs the device runs; computes in its weights' dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x, labels=None):
        if poptorch.isRunningOnIpu():
            _DEVICE_INPUTS.append(x.dtype)
        out = self.lin(x.to(self.lin.weight.dtype))
        return out if labels is None else (out, nn.functional.cross_entropy(out.float(), labels))


@pytest.mark.parametrize("backend", ["emulator", "poptorch"])
def test_16_bit_precisions_take_one_path_on_every_backend(monkeypatch, backend):
    """Mixed and true 16-bit send float16 inputs to the model the executors wrap (the user's,
    its weights float32 for mixed) on the emulator and on an IPU alike: no emulator-only
    autocast. PopTorch 3.x has no autocast (``python/`` has no ``autocasting.py`` since 3.1)."""
    from ipuloop import backend as backend_mod

    monkeypatch.setattr(backend_mod, "backend_name", lambda: backend)
    wrapped = []
    real = poptorch.trainingModel
    monkeypatch.setattr(
        poptorch,
        "trainingModel",
        lambda model, *a, **k: wrapped.append(model) or real(model, *a, **k),
    )
    for precision, weights in (("16-mixed", torch.float32), ("16-true", torch.float16)):
        _DEVICE_INPUTS.clear()
        model = _Recording()
        loop = Loop(
            model,
            optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1),
            precision=precision,
            progress=False,
        )
        loop.fit(DataLoader(data(8), batch_size=4), max_steps=1)
        assert wrapped[-1] is model and model.lin.weight.dtype == weights
        assert _DEVICE_INPUTS and set(_DEVICE_INPUTS) == {torch.float16}
