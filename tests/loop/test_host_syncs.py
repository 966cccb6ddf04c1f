"""What a training step costs a GPU beyond the math: host syncs, weight copies, extra kernels.

A CPU forgives what a GPU punishes: a host read of a device value (``.item()``, ``float(t)``, a
Python-side check) waits for every kernel queued before it, and a weight copied between the
executor and the user's module at each call moves the whole model. These tests count, on the
CPU, the places that would do either on a device:

* host syncs: calls of the tensor functions that read a value on the host (``item``,
  ``tolist``, ``__bool__``/``__int__``/``__float__``/``__index__``, ``cpu``, ``numpy``,
  ``equal``, ``nonzero``, ``any``/``all``...), through a ``TorchFunctionMode`` around the
  steps. On the CPU every such call counts, whichever tensor it reads: a conservative count
  of the places;
* weight copies and kernels: the aten operations one call dispatches (``TorchDispatchMode``),
  against a hand-written torch step doing the same math.

On CUDA, ``torch.cuda.set_sync_debug_mode`` counts the syncs themselves (skipped without one).
"""

from __future__ import annotations

import collections
import os
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

import ipuloop
import ipuloop.emulator as poptorch
from ipuloop import Callback, Loop

PACKAGE = os.path.dirname(os.path.abspath(ipuloop.__file__))
FORWARDING = {
    os.path.join(PACKAGE, "mixed_float.py"),
    os.path.join(PACKAGE, "emulator", "device", "group_norm.py"),
}

T = torch.Tensor
# tensor functions that read a device value on the host (each waits for the device)
HOST_READS = frozenset(
    {
        T.item,
        T.tolist,
        T.__bool__,
        T.__int__,
        T.__float__,
        T.__index__,
        T.cpu,
        T.numpy,
        T.equal,
        T.nonzero,
        T.any,
        T.all,
        torch.equal,
        torch.nonzero,
        torch.allclose,
        torch.any,
        torch.all,
        torch.is_nonzero,
    }
)
# aten operations that copy a tensor's data (a weight copy would be one of these)
COPIES = frozenset({"copy_", "_to_copy", "clone", "_copy_from", "copy"})
# aten operations that only make a view or mark a scope: no kernel runs
NO_KERNEL = frozenset(
    {
        "detach",
        "view",
        "t",
        "split",
        "select",
        "slice",
        "_record_function_enter_new",
        "_record_function_exit",
    }
)
IN, OUT, B, DI, GA = 8, 4, 4, 2, 3


class HostReads(TorchFunctionMode):
    """Counts the host reads that ipuloop's own lines make, by function and line (``where``).
    Reads made inside torch (torch.optim's of its CPU step counters, as in a hand-written
    loop) are counted apart (``in_torch``)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: collections.Counter = collections.Counter()
        self.in_torch = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            # the line that made the call: the first frame out of the emulator's own function
            # modes, which pass every call on (``mixed_float.MixedFloat`` on a host without
            # float16 kernels, ``group_norm.StridedGroupNorm``)
            caller = next(
                f
                for f in reversed(traceback.extract_stack()[:-1])
                if os.path.abspath(f.filename) not in FORWARDING
            )
            if os.path.abspath(caller.filename).startswith(PACKAGE):
                at = f"{os.path.abspath(caller.filename)[len(PACKAGE) :]}:{caller.lineno}"
                self.where[(func.__name__, at)] += 1
            else:
                self.in_torch += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.where.values())


class Ops(TorchDispatchMode):
    """Counts the aten operations dispatched, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def kernels(self) -> collections.Counter:
        return collections.Counter({k: v for k, v in self.ops.items() if k not in NO_KERNEL})


class Net(nn.Module):
    """Linear, BatchNorm (a buffer the device updates) and cross-entropy, in float32 loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(IN, OUT)
        self.bn = nn.BatchNorm1d(OUT)

    def forward(self, x, y):
        out = self.bn(self.fc(x))
        return out, nn.functional.cross_entropy(out.float(), y)


def _data(steps: int, half: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = steps * DI * GA * B
    x = torch.randn(n, IN, generator=g)
    return TensorDataset(x.half() if half else x, torch.randint(0, OUT, (n,), generator=g))


def _options(als: bool = False, mode=None, period=None):
    opts = poptorch.Options().deviceIterations(DI)
    opts.Training.gradientAccumulation(GA)
    if als:
        opts.Training.setAutomaticLossScaling(True)
    if mode is not None:
        opts.outputMode(mode, period)
    return opts


def _emulator_calls(
    half: bool, mode=None, period=None, replicas: int = 1, steps: int = 3
) -> HostReads:
    """Host reads during calls 2..steps of a raw trainingModel (the first compiles)."""
    net = Net().half() if half else Net()
    opts = _options(mode=mode, period=period).replicationFactor(replicas)
    optimizer = poptorch.optim.AdamW(net.parameters(), lr=1e-3, loss_scaling=128.0 if half else 1)
    model = poptorch.trainingModel(net, opts, optimizer)
    batches = iter(poptorch.DataLoader(opts, _data(steps * replicas, half), batch_size=B))
    model(*next(batches))
    reads = HostReads()
    with reads:
        for x, y in batches:
            model(x, y)
    return reads


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16-loss-scaling"])
@pytest.mark.parametrize("mode", ["Final", "All", "Sum", "EveryN"])
def test_a_training_call_reads_nothing_on_the_host(half, mode):
    # DI updates of GA micro-batches each, BatchNorm, AdamW: the call only queues work; its
    # outputs come back as tensors (one transfer each, what PopTorch returns)
    period = 2 if mode == "EveryN" else None
    reads = _emulator_calls(half, mode=getattr(poptorch.OutputMode, mode), period=period)
    assert reads.total == 0, dict(reads.where)


def test_a_replicated_training_call_reads_nothing_on_the_host():
    # two replicas: each its own BatchNorm statistics, gradients reduced over both
    reads = _emulator_calls(False, mode=poptorch.OutputMode.All, replicas=2)
    assert reads.total == 0, dict(reads.where)


@pytest.mark.parametrize("period", [1, 2])
def test_automatic_loss_scaling_reads_its_counts_once_per_update_period(period):
    # The update rule needs the step's count of large float16 gradients on the host: one read
    # per update period, not one per gradient tensor of every micro-batch
    calls = 4
    net = Net().half()
    opts = _options(als=True)
    opts._Popart.set("automaticLossScalingSettings.updatePeriod", period)
    model = poptorch.trainingModel(
        net, opts, poptorch.optim.SGD(net.parameters(), lr=0.01, loss_scaling=128.0)
    )
    batches = iter(poptorch.DataLoader(opts, _data(calls + 1, half=True), batch_size=B))
    model(*next(batches))
    reads = HostReads()
    with reads:
        for x, y in batches:
            model(x, y)
    updates = calls * DI
    assert reads.total == updates // period, dict(reads.where)
    assert {at.split(":")[0] for _, at in reads.where} <= {"/emulator/device/loss_scaling.py"}


def test_automatic_loss_scaling_counts_as_before():
    # counting only the steps that decide, summed on the device, changes no factor
    net = Net().half()
    opts = _options(als=True)
    opts._Popart.set("automaticLossScalingSettings.updatePeriod", 2)
    model = poptorch.trainingModel(
        net, opts, poptorch.optim.SGD(net.parameters(), lr=0.01, loss_scaling=128.0)
    )
    factors = []
    for x, y in poptorch.DataLoader(opts, _data(4, half=True), batch_size=B):
        model(x, y)
        factors.append(model._opt.als.factor)
    # from factor 1: each decision (2 updates a call, one in 2 deciding) doubles it while no
    # gradient is near float16's range
    assert factors == [2.0, 4.0, 8.0, 16.0]


class _Window(Callback):
    """Enters ``reads`` (a torch function or dispatch mode) from the end of step ``first`` to
    the end of step ``last``."""

    def __init__(self, reads: Any, first: int, last: int) -> None:
        self.reads, self.first, self.last, self.steps = reads, first, last, 0

    def on_train_step_end(self, loop) -> None:
        self.steps += 1
        if self.steps == self.first:
            self.reads.__enter__()
        elif self.steps == self.last:
            self.reads.__exit__(None, None, None)


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16-loss-scaling"])
def test_loop_fit_reads_one_value_per_step(half):
    # the step's loss, for the logs and the finiteness check, read from the returned (host)
    # tensor: the one transfer per call the device makes anyway
    net = Net().half() if half else Net()
    optimizer = poptorch.optim.AdamW(net.parameters(), lr=1e-3, loss_scaling=128.0 if half else 1)
    reads = HostReads()
    loop = Loop(
        net, _options(), optimizer=optimizer, progress=False, callbacks=[_Window(reads, 2, 4)]
    )
    loop.fit(DataLoader(_data(5, half), batch_size=B), epochs=1)
    assert reads.total == 2, dict(reads.where)  # steps 3 and 4
    assert {at for _, at in reads.where} == {f"/outputs.py:{_line('total = float(loss)')}"}


def _native_step(net: nn.Module, opt: torch.optim.Optimizer, x, y) -> torch.Tensor:
    """One host call's math, hand-written: DI AdamW updates of the Mean of GA micro-batches;
    returns the last micro-batch's loss."""
    xs, ys = x.split(B), y.split(B)
    for d in range(DI):
        for a in range(GA):
            _, loss = net(xs[d * GA + a], ys[d * GA + a])
            (loss * (1.0 / GA)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach()


def test_a_training_call_copies_no_weight_and_runs_the_native_kernels():
    data = _data(3)
    x, y = data.tensors[0][: DI * GA * B], data.tensors[1][: DI * GA * B]
    native = Net()
    opt = torch.optim.AdamW(native.parameters(), lr=1e-3)
    _native_step(native, opt, x, y)  # the optimizer's state exists from here
    native_ops = Ops()
    with native_ops:
        _native_step(native, opt, x, y)

    net = Net()
    opts = _options(mode=poptorch.OutputMode.Final)
    model = poptorch.trainingModel(net, opts, torch.optim.AdamW(net.parameters(), lr=1e-3))
    model(x, y)
    ops = Ops()
    with ops:
        model(x, y)
    # the weights stay on the device: swapped into the user's module, never copied
    assert not COPIES & set(ops.ops), {k: ops.ops[k] for k in COPIES & set(ops.ops)}
    # the same kernels as the hand-written step, none more
    assert ops.kernels() == native_ops.kernels(), (
        ops.kernels() - native_ops.kernels(),
        native_ops.kernels() - ops.kernels(),
    )
    # and the same weights
    model.copyWeightsToHost()
    for a, b in zip(net.state_dict().values(), native.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_syncs_per_call_at_most_native(monkeypatch):
    # on CUDA: the syncs themselves. The hand-written step syncs once to read its loss; a
    # training call once per output it returns (the logits and the loss here), no more.
    monkeypatch.setenv("IPULOOP_EMULATOR_DEVICE", "cuda")
    data = _data(3)
    x, y = data.tensors[0][: DI * GA * B], data.tensors[1][: DI * GA * B]

    def count(fn) -> int:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchronizing" in str(w.message) for w in caught)

    native = Net().cuda()
    opt = torch.optim.AdamW(native.parameters(), lr=1e-3)
    _native_step(native, opt, x.cuda(), y.cuda())

    def native_call():  # the host batch to the device, the step, its loss read on the host
        xd, yd = x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)
        float(_native_step(native, opt, xd, yd))

    native_syncs = count(native_call)
    net = Net()
    model = poptorch.trainingModel(
        net, _options(mode=poptorch.OutputMode.Final), torch.optim.AdamW(net.parameters())
    )
    model(x, y)
    emulator_syncs = count(lambda: model(x, y))
    # native reads one tensor (its loss), the call returns two (the logits and the loss)
    assert emulator_syncs <= native_syncs + 1, (emulator_syncs, native_syncs)


def test_loop_fit_copies_no_weight_per_step():
    # nothing in the loop's step reads the host module (which would copy the trained weights
    # back from the device): the step's aten operations hold no copy at all
    ops = Ops()
    net = Net()
    loop = Loop(
        net,
        _options(),
        optimizer=poptorch.optim.AdamW(net.parameters(), lr=1e-3),
        progress=False,
        callbacks=[_Window(ops, 2, 4)],
    )
    loop.fit(DataLoader(_data(5), batch_size=B), epochs=1)
    assert ops.ops and not COPIES & set(ops.ops), {k: ops.ops[k] for k in COPIES & set(ops.ops)}


def _line(code: str) -> int:
    """The line of ``ipuloop/outputs.py`` that starts with ``code`` (one only)."""
    import ipuloop.outputs

    lines = [
        i
        for i, text in enumerate(Path(ipuloop.outputs.__file__).read_text().splitlines(), 1)
        if text.strip().startswith(code)
    ]
    assert len(lines) == 1, lines
    return lines[0]
