"""PopTorch executor emulation: docs/poptorch-semantics.md §2, §4, §8 and §9 (executor items).

Two kinds of tests:
* conformance: one or more per item of §8 / edge case of §9 that concerns trainingModel,
  inferenceModel, PoplarExecutor and identity_loss (errors, messages, shapes, values);
* equivalence: training through ``trainingModel`` with DI/GA/RF gives the weights a plain
  torch loop doing the same math gives (host layout ``[DI, GA, RF, B]``, one update per d).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipuloop.emulator as poptorch
from ipuloop.emulator import optim as popt

IN, HID, OUT = 4, 6, 3


# ---------------------------------------------------------------------------------------------
# Models and helpers


class Net(nn.Module):
    """Linear -> (BatchNorm) -> tanh -> Linear; returns (output, mse loss) given labels."""

    def __init__(self, bn: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(IN, HID)
        self.bn = nn.BatchNorm1d(HID) if bn else nn.Identity()
        self.fc2 = nn.Linear(HID, OUT)

    def forward(self, x, y=None):
        out = self.fc2(torch.tanh(self.bn(self.fc1(x))))
        if y is None:
            return out
        return out, F.mse_loss(out, y)


class Lin(nn.Module):
    """A single Linear layer (easy to inspect weights) with an optional loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        with torch.no_grad():
            self.fc.weight.fill_(1.0)
            self.fc.bias.fill_(0.0)

    def forward(self, x, y=None):
        out = self.fc(x)
        if y is None:
            return out
        return out, F.mse_loss(out, y)


class MicroBatchStat(nn.Module):
    """Inference model whose outputs reveal how the host batch was cut into micro-batches."""

    def forward(self, x):
        # per-sample output [B, 1]: the micro-batch mean repeated; scalar: the micro-batch sum
        return x.mean(0, keepdim=True).expand(x.shape[0], 1), x.sum()


def opts(
    di: int = 1, ga: int = 1, rf: int = 1, mode=None, period=None, reduction=None
) -> poptorch.Options:
    o = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    o.Training.gradientAccumulation(ga)
    if mode is not None:
        o.outputMode(mode, period)
    if reduction is not None:
        o.Training.accumulationAndReplicationReductionType(reduction)
    return o


def data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def host_batch(di: int, ga: int, rf: int, b: int, seed: int = 1):
    return data(di * ga * rf * b, seed)


def reference_train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    di: int,
    ga: int,
    rf: int,
    mean: bool = True,
):
    """Plain torch: one update per device iteration over GA x RF micro-batches, read from the
    host batch with the [DI, GA, RF, B] layout. Returns outputs [DI, GA, RF, B, OUT] and
    losses [DI, GA, RF]."""
    b = x.shape[0] // (di * ga * rf)
    xs = x.reshape(di, ga, rf, b, *x.shape[1:])
    ys = y.reshape(di, ga, rf, b, *y.shape[1:])
    outs = torch.empty(di, ga, rf, b, *y.shape[1:])
    losses = torch.empty(di, ga, rf)
    scale = 1.0 / (ga * rf) if mean else 1.0
    for d in range(di):
        for a in range(ga):
            for r in range(rf):
                out, loss = model(xs[d, a, r], ys[d, a, r])
                outs[d, a, r] = out.detach()
                losses[d, a, r] = loss.detach()
                (loss * scale if scale != 1.0 else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outs, losses


def assert_same_params(wrapped: nn.Module, ref: nn.Module, exact: bool = False) -> None:
    got = wrapped.state_dict()  # reading the wrapped module syncs device weights to the host
    want = ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        if exact:
            assert torch.equal(got[k], want[k]), k
        else:
            torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0, msg=k)


def _linear_pair(seed: int = 0):
    m = Net(seed=seed)
    return m, copy.deepcopy(m)


# ---------------------------------------------------------------------------------------------
# §8.1 / §2.1: batch-size rule


def test_first_call_infers_micro_batch_from_every_tensor_input():
    # DI=2 -> micro-batch 8 / 2 = 4: each micro-batch's mean is over 4 samples
    model = poptorch.inferenceModel(MicroBatchStat(), opts(di=2))
    x = torch.arange(8.0).reshape(8, 1)
    per_sample, sums = model(x)
    assert per_sample.shape == (8, 1)
    assert torch.equal(per_sample[:4], torch.full((4, 1), 1.5))
    assert torch.equal(per_sample[4:], torch.full((4, 1), 5.5))
    assert torch.equal(sums, torch.tensor([6.0, 22.0]))


def test_batch_rule_assertion_message():
    model = poptorch.inferenceModel(Net(), opts(di=4))
    with pytest.raises(AssertionError) as e:
        model(torch.randn(6, IN))
    msg = str(e.value)
    assert msg.startswith(
        "Invalid batch dimension: In the input torch.Size([6, 4]), the batch "
        "dimension (6) must be a multiple of Options.deviceIterations(4) * "
        "(Options.replicationFactor(1) / "
        "Options.inputReplicaGrouping.input_group_size(1)) * "
        "Options.Training.gradientAccumulation(1) = 4"
    ), msg
    assert not model.isCompiled()


def test_batch_rule_product_includes_ga_and_rf_in_training():
    x, y = data(2 * 3 * 2 * 1)  # 12 samples: DI=2, GA=3, RF=2 -> B=1
    model = poptorch.trainingModel(Net(), opts(di=2, ga=3, rf=2))
    model(x, y)
    model2 = poptorch.trainingModel(Net(), opts(di=2, ga=3, rf=2))
    with pytest.raises(AssertionError, match=r"= 12 "):
        model2(x[:6], y[:6])


def test_labels_are_batched_too():
    # every tensor input, labels included, must satisfy the rule (§2.1 (b))
    x, y = data(4)
    model = poptorch.trainingModel(Net(), opts(di=2))
    with pytest.raises(AssertionError, match=r"In the input torch.Size\(\[3, 3\]\)"):
        model(x, y[:3])


def test_zero_dim_input_counts_as_batch_one():
    class M(nn.Module):
        def forward(self, x, t):
            return x * t

    ok = poptorch.inferenceModel(M())  # product 1: a 0-dim input passes
    assert torch.equal(ok(torch.ones(2), torch.tensor(3.0)), torch.full((2,), 3.0))
    bad = poptorch.inferenceModel(M(), opts(di=2))
    with pytest.raises(AssertionError, match=r"the batch dimension \(1\) must be a multiple"):
        bad(torch.ones(2), torch.tensor(3.0))


def test_host_batch_k_times_too_big_compiles_bigger_micro_batch():
    # §9: a host batch 2x too big is accepted and the micro-batch silently doubles
    model = poptorch.inferenceModel(MicroBatchStat(), opts(di=2))
    per_sample, sums = model(torch.arange(16.0).reshape(16, 1))
    assert sums.shape == (2,)
    assert torch.equal(sums, torch.tensor([28.0, 92.0]))  # sums over 8 samples each


def test_input_replica_grouping_changes_combined_batch_not_output_factor():
    # §9: RF=2 with groups of 2 -> one input group: combined batch B*DI, outputs still x RF
    o = poptorch.Options().replicationFactor(2)
    o.inputReplicaGrouping(2, poptorch.CommGroupType.Consecutive)
    model = poptorch.inferenceModel(MicroBatchStat(), o)
    x = torch.arange(3.0).reshape(3, 1)
    per_sample, sums = model(x)
    assert per_sample.shape == (6, 1)  # [RF * B]
    assert torch.equal(sums, torch.tensor([3.0, 3.0]))  # both replicas read the same data


# ---------------------------------------------------------------------------------------------
# §8.1: later calls must match the first call exactly


def test_later_call_shape_mismatch():
    model = poptorch.inferenceModel(Net())
    model(torch.randn(4, IN))
    with pytest.raises(poptorch.Error) as e:
        model(torch.randn(8, IN))
    assert str(e.value).startswith("Shape mismatch"), str(e.value)
    assert "[4, 4]" in str(e.value) and "[8, 4]" in str(e.value)


def test_later_call_dtype_mismatch():
    class M(nn.Module):
        def forward(self, x):
            return x.float() * 2

    model = poptorch.inferenceModel(M())
    model(torch.ones(2, 2))
    with pytest.raises(poptorch.Error) as e:
        model(torch.ones(2, 2, dtype=torch.int32))
    assert str(e.value).startswith("Data type mismatch"), str(e.value)


def test_later_call_dtype_checked_before_shape():
    model = poptorch.inferenceModel(Net())
    model(torch.randn(4, IN))
    with pytest.raises(poptorch.Error, match="^Data type mismatch"):
        model(torch.randn(8, IN, dtype=torch.float16))


def test_later_call_value_mismatch_for_non_tensor_argument():
    class M(nn.Module):
        def forward(self, x, scale):
            return x * scale

    model = poptorch.inferenceModel(M())
    assert torch.equal(model(torch.ones(2), 2.0), torch.full((2,), 2.0))
    assert torch.equal(model(torch.ones(2), 2.0), torch.full((2,), 2.0))  # equal value: fine
    with pytest.raises(poptorch.Error) as e:
        model(torch.ones(2), 3.0)
    assert str(e.value).startswith("Value mismatch"), str(e.value)


def test_later_call_mismatch_is_poptorch_error_and_model_stays_usable():
    model = poptorch.inferenceModel(Net())
    x = torch.randn(4, IN)
    first = model(x)
    with pytest.raises(poptorch.Error):
        model(torch.randn(3, IN))
    assert issubclass(poptorch.Error, RuntimeError)
    assert torch.equal(model(x), first)


# ---------------------------------------------------------------------------------------------
# §8.2 / §9: micro-batch order [DI, GA, RF, B]; replicas get interleaved slices


def test_inference_all_returns_micro_batches_in_host_order():
    model = poptorch.inferenceModel(MicroBatchStat(), opts(di=2, rf=2))
    x = torch.arange(8.0).reshape(8, 1)  # B=2: chunks [0,1] [2,3] [4,5] [6,7]
    per_sample, sums = model(x)
    assert per_sample.shape == (8, 1) and sums.shape == (4,)
    assert torch.equal(sums, torch.tensor([1.0, 5.0, 9.0, 13.0]))


def test_replicas_get_interleaved_slices_final_and_sum():
    x = torch.arange(8.0).reshape(8, 1)  # chunk c = (d * RF + r)
    final = poptorch.inferenceModel(
        MicroBatchStat(), opts(di=2, rf=2, mode=poptorch.OutputMode.Final)
    )
    _, sums = final(x)
    assert torch.equal(sums, torch.tensor([9.0, 13.0]))  # d=1: replica 0 -> chunk 2, 1 -> 3
    summed = poptorch.inferenceModel(
        MicroBatchStat(), opts(di=2, rf=2, mode=poptorch.OutputMode.Sum)
    )
    _, sums = summed(x)
    assert torch.equal(sums, torch.tensor([1.0 + 9.0, 5.0 + 13.0]))  # chunks {0,2} and {1,3}


# ---------------------------------------------------------------------------------------------
# §8.3: equivalence with a plain torch loop


@pytest.mark.parametrize("di,ga,rf", [(1, 1, 1), (3, 1, 1), (1, 4, 1), (1, 1, 2), (2, 3, 2)])
def test_training_equivalence_mean(di, ga, rf):
    m, ref = _linear_pair()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model = poptorch.trainingModel(m, opts(di, ga, rf), opt)
    for step in range(2):
        x, y = host_batch(di, ga, rf, 2, seed=step)
        model(x, y)
        reference_train(ref, ref_opt, x, y, di, ga, rf)
    assert_same_params(m, ref, exact=True)


def test_training_equivalence_sum_reduction():
    di, ga, rf = 2, 2, 2
    m, ref = _linear_pair()
    opt = torch.optim.SGD(m.parameters(), lr=0.02)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.02)
    model = poptorch.trainingModel(m, opts(di, ga, rf, reduction=poptorch.ReductionType.Sum), opt)
    x, y = host_batch(di, ga, rf, 3)
    model(x, y)
    reference_train(ref, ref_opt, x, y, di, ga, rf, mean=False)
    assert_same_params(m, ref, exact=True)
    # and Sum really differs from Mean here (the test can fail)
    mean_ref = copy.deepcopy(Net())
    reference_train(mean_ref, torch.optim.SGD(mean_ref.parameters(), lr=0.02), x, y, di, ga, rf)
    assert not torch.allclose(m.fc1.weight, mean_ref.fc1.weight, atol=1e-6)


def test_training_equivalence_adam_di_ga():
    di, ga, rf = 3, 2, 1
    m, ref = _linear_pair()
    model = poptorch.trainingModel(m, opts(di, ga, rf), torch.optim.Adam(m.parameters(), lr=0.01))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(2):
        x, y = host_batch(di, ga, rf, 2, seed=10 + step)
        model(x, y)
        reference_train(ref, ref_opt, x, y, di, ga, rf)
    assert_same_params(m, ref)


def test_training_equivalence_batchnorm_uses_micro_batch():
    di, ga, rf = 2, 3, 1
    m = Net(bn=True)
    ref = copy.deepcopy(m)
    model = poptorch.trainingModel(m, opts(di, ga, rf), torch.optim.SGD(m.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = host_batch(di, ga, rf, 4, seed=20 + step)
        model(x, y)
        reference_train(ref, ref_opt, x, y, di, ga, rf)
    # weights and BatchNorm running statistics (updated once per micro-batch of B=4)
    assert_same_params(m, ref)
    assert int(m.bn.num_batches_tracked) == 2 * di * ga


def test_reading_a_buffer_first_syncs_device_statistics():
    m = Net(bn=True)
    ref = copy.deepcopy(m)
    model = poptorch.trainingModel(m, opts(di=2), torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = host_batch(2, 1, 1, 4)
    model(x, y)
    reference_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 2, 1, 1)
    # the very first read after the call is a buffer (no parameter touched before it)
    torch.testing.assert_close(m.bn.running_mean, ref.bn.running_mean, atol=1e-6, rtol=0)


def test_training_equivalence_batchnorm_rf2_interleaved():
    di, ga, rf = 2, 2, 2
    m = Net(bn=True)
    ref = copy.deepcopy(m)
    model = poptorch.trainingModel(m, opts(di, ga, rf), torch.optim.SGD(m.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = host_batch(di, ga, rf, 3, seed=30)
    model(x, y)
    reference_train(ref, ref_opt, x, y, di, ga, rf)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(dict(m.named_parameters())[name], p, atol=1e-6, rtol=0)
    # contiguous per-replica shards would train on different micro-batches: must differ
    wrong = copy.deepcopy(Net(bn=True))
    wrong_opt = torch.optim.SGD(wrong.parameters(), lr=0.1)
    b = 3
    xs = x.reshape(rf, di, ga, b, IN).permute(1, 2, 0, 3, 4).reshape(-1, IN)
    ys = y.reshape(rf, di, ga, b, OUT).permute(1, 2, 0, 3, 4).reshape(-1, OUT)
    reference_train(wrong, wrong_opt, xs, ys, di, ga, rf)
    assert not torch.allclose(m.fc1.weight, wrong.fc1.weight, atol=1e-6)


def test_training_call_performs_di_updates():
    # one optimizer update per device iteration (not per micro-batch): count Adam's steps
    m = Net()
    opt = poptorch.optim.Adam(m.parameters(), lr=0.01)
    model = poptorch.trainingModel(m, opts(di=3, ga=2), opt)
    model(*host_batch(3, 2, 1, 2))
    model(*host_batch(3, 2, 1, 2, seed=2))
    sd = opt.state_dict()  # a poptorch.optim optimizer's reflects the device state (§4.3)
    steps = {float(s["step"]) for s in sd["state"].values()}
    assert steps == {6.0}


# ---------------------------------------------------------------------------------------------
# §8.4 / §2.2 / §9: output modes, shapes and values

TRAIN_CFG = dict(di=2, ga=3, rf=2)


def _train_outputs(mode, period=None, **cfg):
    cfg = {**TRAIN_CFG, **cfg}
    di, ga, rf = cfg["di"], cfg["ga"], cfg["rf"]
    m, ref = _linear_pair()
    model = poptorch.trainingModel(
        m, opts(di, ga, rf, mode=mode, period=period), torch.optim.SGD(m.parameters(), lr=0.1)
    )
    x, y = host_batch(di, ga, rf, 2)
    out, loss = model(x, y)
    ref_out, ref_losses = reference_train(
        ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, di, ga, rf
    )
    return out, loss, ref_out, ref_losses


def test_training_default_is_final_last_micro_batch_per_replica():
    out, loss, ref_out, ref_losses = _train_outputs(poptorch.OutputMode.Default)
    assert loss.shape == (2,)  # [RF]
    assert out.shape == (2 * 2, OUT)  # [RF * B]
    assert torch.equal(loss, ref_losses[-1, -1])
    assert torch.equal(out, ref_out[-1, -1].reshape(-1, OUT))


def test_training_final_scalar_loss_stays_0_dim_when_rf_1():
    # §9: with RF=1 and Final the loss is 0-dim even with DI, GA > 1
    out, loss, ref_out, ref_losses = _train_outputs(poptorch.OutputMode.Final, rf=1)
    assert loss.dim() == 0 and out.shape == (2, OUT)
    assert torch.equal(loss, ref_losses[-1, -1, 0])


def test_training_all_returns_every_micro_batch():
    out, loss, ref_out, ref_losses = _train_outputs(poptorch.OutputMode.All)
    assert loss.shape == (2 * 3 * 2,)  # [DI*GA*RF]
    assert out.shape == (2 * 3 * 2 * 2, OUT)
    assert torch.equal(loss, ref_losses.reshape(-1))
    assert torch.equal(out, ref_out.reshape(-1, OUT))


def test_all_with_factor_one_keeps_scalar():
    out, loss, _, ref_losses = _train_outputs(poptorch.OutputMode.All, di=1, ga=1, rf=1)
    assert loss.dim() == 0 and out.shape == (2, OUT)
    assert torch.equal(loss, ref_losses.reshape(()))


def test_training_sum_is_per_replica_sum():
    out, loss, ref_out, ref_losses = _train_outputs(poptorch.OutputMode.Sum)
    assert loss.shape == (2,) and out.shape == (4, OUT)
    torch.testing.assert_close(loss, ref_losses.sum((0, 1)), atol=1e-6, rtol=0)
    torch.testing.assert_close(out, ref_out.sum((0, 1)).reshape(-1, OUT), atol=1e-6, rtol=0)


def test_training_every_n_returns_selected_iterations():
    out, loss, ref_out, ref_losses = _train_outputs(poptorch.OutputMode.EveryN, 2, di=4)
    # iterations d = 1, 3; all GA steps and replicas of each: DI/N * GA * RF = 12
    assert loss.shape == (2 * 3 * 2,)
    assert out.shape == (12 * 2, OUT)
    assert torch.equal(loss, ref_losses[[1, 3]].reshape(-1))
    assert torch.equal(out, ref_out[[1, 3]].reshape(-1, OUT))


def test_every_n_factor_one_keeps_scalar():
    out, loss, _, ref_losses = _train_outputs(poptorch.OutputMode.EveryN, 2, di=2, ga=1, rf=1)
    assert loss.dim() == 0
    assert torch.equal(loss, ref_losses[1, 0, 0])


@pytest.mark.parametrize("di,n", [(4, 3), (2, 4)])
def test_every_n_period_must_divide_di(di, n):
    model = poptorch.inferenceModel(Net(), opts(di=di, mode=poptorch.OutputMode.EveryN, period=n))
    with pytest.raises(
        poptorch.Error, match="Return period must be a factor of the number of batches per step"
    ):
        model(torch.randn(di * 2, IN))
    assert not model.isCompiled()


def test_every_n_divides_di_not_di_times_ga():
    # §9: N=3 divides DI*GA=6 but not DI=2 -> error
    m = Net()
    model = poptorch.trainingModel(m, opts(di=2, ga=3, mode=poptorch.OutputMode.EveryN, period=3))
    with pytest.raises(poptorch.Error, match="Return period"):
        model(*host_batch(2, 3, 1, 1))


def _inference_outputs(mode, period=None, di=4, rf=2):
    model = poptorch.inferenceModel(MicroBatchStat(), opts(di=di, rf=rf, mode=mode, period=period))
    x = torch.arange(float(di * rf * 2)).reshape(-1, 1)
    chunk_sums = x.reshape(di, rf, 2).sum(-1)
    return model(x), chunk_sums


def test_inference_default_is_all():
    (per_sample, sums), chunk_sums = _inference_outputs(poptorch.OutputMode.Default)
    assert per_sample.shape == (16, 1)
    assert torch.equal(sums, chunk_sums.reshape(-1))


def test_inference_final_sum_every_n_values():
    (p, s), cs = _inference_outputs(poptorch.OutputMode.Final)
    assert p.shape == (4, 1) and torch.equal(s, cs[-1])
    (p, s), cs = _inference_outputs(poptorch.OutputMode.Sum)
    assert p.shape == (4, 1) and torch.equal(s, cs.sum(0))
    (p, s), cs = _inference_outputs(poptorch.OutputMode.EveryN, 2)
    assert p.shape == (8, 1) and torch.equal(s, cs[[1, 3]].reshape(-1))


def test_inference_scalar_promoted_only_when_factor_above_one():
    (p, s), cs = _inference_outputs(poptorch.OutputMode.Final, di=4, rf=1)
    assert s.dim() == 0 and torch.equal(s, cs[-1, 0])
    (p, s), cs = _inference_outputs(poptorch.OutputMode.Sum, di=4, rf=1)
    assert s.dim() == 0 and torch.equal(s, cs.sum())
    (p, s), cs = _inference_outputs(poptorch.OutputMode.All, di=1, rf=1)
    assert s.dim() == 0


def test_output_structure_mirrors_forward():
    class M(nn.Module):
        def forward(self, x):
            return {"a": x * 2, "b": (x.sum(), [x + 1])}

    out = poptorch.inferenceModel(M(), opts(di=2))(torch.ones(4, 2))
    assert set(out) == {"a", "b"}
    assert out["a"].shape == (4, 2) and out["b"][0].shape == (2,)
    assert out["b"][1][0].shape == (4, 2)


# ---------------------------------------------------------------------------------------------
# §8.5: output dtype narrowing


def test_output_dtype_narrowing():
    class M(nn.Module):
        def forward(self, x):
            return x.argmax(-1), x.double() * 2, x.int(), x.half()

    idx, dbl, i32, f16 = poptorch.inferenceModel(M(), opts(di=2))(torch.randn(4, 3))
    assert idx.dtype == torch.int32 and idx.shape == (4,)
    assert dbl.dtype == torch.float32
    assert i32.dtype == torch.int32 and f16.dtype == torch.float16


def test_float64_inputs_reach_the_device_as_float32():
    class M(nn.Module):
        def forward(self, x):
            return x * 1

    out = poptorch.inferenceModel(M())(torch.ones(2, dtype=torch.float64))
    assert out.dtype == torch.float32


def test_int32_targets_and_indices_work_as_on_an_ipu():
    """poptorch/source/PoplarExecutable.cpp ``run``: the IPU's integers are int32 (an int64
    input is converted to it), so its ops take int32 targets and indices. A program feeding
    ``labels.int()`` to ``cross_entropy``/``nll_loss`` or ``one_hot`` trains as with int64
    labels, though the host's kernels refuse int32 there."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(IN, OUT)

        def forward(self, x, y):
            out = self.fc(x)
            hot = F.one_hot(y, OUT).float()
            loss = F.cross_entropy(out, y) + F.nll_loss(out.log_softmax(-1), y)
            return hot, poptorch.identity_loss(loss + ((out - hot) ** 2).mean(), "none")

    torch.manual_seed(0)
    model, ref = M(), M()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, IN), torch.tensor([0, 1, 2, 0, 1, 2, 2, 1])
    train = poptorch.trainingModel(model, opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        hot, loss = train(x, y.int())
        opt.zero_grad()
        _, ref_loss = ref(x, y)
        ref_loss.backward()
        opt.step()
        assert torch.allclose(loss, ref_loss.detach())
    assert torch.equal(hot, F.one_hot(y, OUT).float())
    train.copyWeightsToHost()
    assert torch.allclose(model.fc.weight, ref.fc.weight)


# ---------------------------------------------------------------------------------------------
# §8.6: inferenceModel rejects GA != 1; default optimizer SGD(lr=0.01)


def test_inference_model_rejects_gradient_accumulation():
    with pytest.raises(poptorch.Error, match="gradientAccumulation to 1"):
        poptorch.inferenceModel(Net(), opts(ga=2))


def test_default_optimizer_is_sgd_lr_0_01():
    m, ref = _linear_pair()
    model = poptorch.trainingModel(m, opts(di=2))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(3):
        x, y = host_batch(2, 1, 1, 4, seed=step)
        model(x, y)
        reference_train(ref, ref_opt, x, y, 2, 1, 1)
    assert_same_params(m, ref, exact=True)
    # lr 0.1 would give other weights: the comparison is able to fail
    other = copy.deepcopy(Net())
    reference_train(other, torch.optim.SGD(other.parameters(), lr=0.1), x, y, 2, 1, 1)
    assert not torch.allclose(m.fc1.weight, other.fc1.weight)


# ---------------------------------------------------------------------------------------------
# §8.7 / §4.5: optimizer snapshots and setOptimizer


def test_host_lr_change_ignored_until_set_optimizer():
    m, ref = _linear_pair()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = poptorch.trainingModel(m, opts(), opt)
    x, y = host_batch(1, 1, 1, 4)
    model(x, y)
    reference_train(ref, ref_opt, x, y, 1, 1, 1)
    for g in opt.param_groups:
        g["lr"] = 0.5  # not seen by the device yet
    model(x, y)
    reference_train(ref, ref_opt, x, y, 1, 1, 1)  # still lr 0.1
    assert_same_params(m, ref, exact=True)
    model.setOptimizer(opt)  # now used
    for g in ref_opt.param_groups:
        g["lr"] = 0.5
    model(x, y)
    reference_train(ref, ref_opt, x, y, 1, 1, 1)
    assert_same_params(m, ref, exact=True)


def test_lr_scheduler_needs_set_optimizer():
    m = Lin()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    model = poptorch.trainingModel(m, opts(), opt)
    x, y = torch.ones(2, 2), torch.zeros(2, 1)
    model(x, y)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)  # host lr -> 0
    before = m.fc.weight.detach().clone()
    model(x, y)  # device still lr 0.1
    after = m.fc.weight.detach().clone()
    assert not torch.equal(before, after)
    model.setOptimizer(opt)
    model(x, y)
    assert torch.equal(m.fc.weight.detach(), after)


def test_changing_constant_attribute_after_compile_is_an_error():
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # momentum left at default: constant
    model = poptorch.trainingModel(m, opts(), opt)
    model(*host_batch(1, 1, 1, 2))
    for g in opt.param_groups:
        g["momentum"] = 0.9
    with pytest.raises((ValueError, poptorch.Error), match="momentum"):
        model.setOptimizer(opt)


def test_explicit_poptorch_attribute_is_variable_and_lr_always():
    m = Net()
    opt = popt.SGD(m.parameters(), lr=0.1, momentum=0.5)  # passed explicitly: variable
    model = poptorch.trainingModel(m, opts(), opt)
    model(*host_batch(1, 1, 1, 2))
    for g in opt.param_groups:
        g["momentum"] = 0.9
        g["lr"] = 0.01
    model.setOptimizer(opt)  # no error
    model(*host_batch(1, 1, 1, 2))


def test_set_optimizer_on_inference_model_is_an_error():
    model = poptorch.inferenceModel(Net())
    with pytest.raises(poptorch.Error):
        model.setOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1))


def test_optimizer_state_dict_reflects_device_state():
    m = Net()
    opt = poptorch.optim.Adam(m.parameters(), lr=0.01)  # torch.optim's: tests/loop/test_ipu_path.py
    assert opt.state_dict()["state"] == {}
    model = poptorch.trainingModel(m, opts(di=2), opt)
    model(*host_batch(2, 1, 1, 2))
    sd = opt.state_dict()
    assert len(sd["state"]) == len(list(Net().parameters()))
    assert all(float(s["step"]) == 2.0 for s in sd["state"].values())
    model(*host_batch(2, 1, 1, 2))
    assert all(float(s["step"]) == 4.0 for s in opt.state_dict()["state"].values())


# ---------------------------------------------------------------------------------------------
# §8.8 / §1.3: options freezing


def test_wrapping_freezes_user_options_and_clone_is_unfrozen():
    o = opts(di=2)
    poptorch.inferenceModel(Net(), o)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        o.deviceIterations(4)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        o.Training.gradientAccumulation(2)
    c = o.clone()
    c.deviceIterations(4)
    assert c.device_iterations == 4 and o.device_iterations == 2
    model = poptorch.inferenceModel(Net(), c)
    assert model(torch.randn(8, IN)).shape == (8, OUT)


def test_training_model_freezes_options_too():
    o = opts()
    poptorch.trainingModel(Net(), o)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        o.replicationFactor(2)


def test_to_dict_fails_on_default_mode_but_works_on_executor_copy():
    o = opts()
    with pytest.raises(AssertionError, match="output mode must be picked"):
        o.toDict()
    train = poptorch.trainingModel(Net(), o)
    assert train._options.toDict()["output_mode"] == poptorch.OutputMode.Final
    inf = poptorch.inferenceModel(Net(), o.clone())
    assert inf._options.toDict()["output_mode"] == poptorch.OutputMode.All
    assert o.output_mode == poptorch.OutputMode.Default  # the user's object is untouched


# ---------------------------------------------------------------------------------------------
# §4.3: weight synchronisation


def test_reading_wrapped_module_after_training_gives_device_weights():
    m, ref = _linear_pair()
    model = poptorch.trainingModel(m, opts(), torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = host_batch(1, 1, 1, 4)
    model(x, y)
    reference_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 1, 1, 1)
    # attribute access (no explicit copyWeightsToHost)
    assert torch.equal(m.fc1.weight, ref.fc1.weight)
    model(x, y)
    reference_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 1, 1, 1)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    model(x, y)
    reference_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 1, 1, 1)
    assert torch.equal(m.state_dict()["fc2.bias"], ref.state_dict()["fc2.bias"])


def test_held_parameter_reads_device_weights_after_training():
    # §4.3: a parameter's attributes also trigger the implicit copyWeightsToHost()
    m = Lin()
    w = m.fc.weight  # held before wrapping (as an optimizer or EMA helper does)
    model = poptorch.trainingModel(m, opts(), torch.optim.SGD(m.parameters(), lr=0.1))
    model(torch.ones(2, 2), torch.zeros(2, 1))
    assert not torch.equal(w.detach().clone(), torch.ones(1, 2))


def test_state_dict_of_wrapped_module_is_plain_tensors():
    m = Net()
    model = poptorch.trainingModel(m, opts())
    model(*host_batch(1, 1, 1, 2))
    sd = m.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    fresh = Net()
    fresh.load_state_dict(sd)  # loadable into an unwrapped module


def test_host_edits_do_not_reach_device_until_copy_weights_to_device():
    m = Lin()
    model = poptorch.trainingModel(
        m, opts(mode=poptorch.OutputMode.All), torch.optim.SGD(m.parameters(), lr=0.0)
    )
    x, y = torch.ones(1, 2), torch.zeros(1, 1)
    out, _ = model(x, y)
    assert torch.equal(out, torch.tensor([[2.0]]))
    with torch.no_grad():
        m.fc.weight.fill_(3.0)  # host edit
    out, _ = model(x, y)
    assert torch.equal(out, torch.tensor([[2.0]]))  # the device kept its own copy
    # the training call made the host stale: reading it brings back the device's weights
    assert torch.equal(m.fc.weight, torch.ones(1, 2))
    with torch.no_grad():
        m.fc.weight.fill_(3.0)
    model.copyWeightsToDevice()
    out, _ = model(x, y)
    assert torch.equal(out, torch.tensor([[6.0]]))


def test_load_state_dict_on_wrapper_pushes_when_attached():
    m = Lin()
    model = poptorch.inferenceModel(m)
    x = torch.ones(1, 2)
    assert torch.equal(model(x), torch.tensor([[2.0]]))
    sd = {k: v * 2 for k, v in m.state_dict().items()}
    model.load_state_dict(sd)
    assert torch.equal(model(x), torch.tensor([[4.0]]))


def test_inference_model_created_after_training_sees_fresh_weights():
    m, ref = _linear_pair()
    train = poptorch.trainingModel(m, opts(), torch.optim.SGD(m.parameters(), lr=0.1))
    infer = poptorch.inferenceModel(m)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    xt = torch.randn(4, IN)
    for step in range(3):
        x, y = host_batch(1, 1, 1, 4, seed=step)
        train(x, y)  # nothing reads the host module in between
        reference_train(ref, ref_opt, x, y, 1, 1, 1)
        with torch.no_grad():
            assert torch.equal(infer(xt), ref(xt))


def test_inference_model_of_submodule_sees_trained_weights():
    # The tutorial flow: train a loss wrapper, then wrap the inner model for inference.
    class WithLoss(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            out = self.inner(x)
            return out, F.mse_loss(out, y)

    inner = Net()
    ref = copy.deepcopy(inner)
    train = poptorch.trainingModel(
        WithLoss(inner), opts(), torch.optim.SGD(inner.parameters(), lr=0.1)
    )
    x, y = host_batch(1, 1, 1, 4)
    train(x, y)
    train(x, y)
    reference_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 1, 1, 1)
    reference_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, 1, 1, 1)
    infer = poptorch.inferenceModel(inner)
    with torch.no_grad():
        torch.testing.assert_close(infer(x), ref(x), atol=1e-6, rtol=0)


def test_inference_model_created_before_training_refreshes_on_reattach():
    # §9 (derived): no automatic re-upload, but re-attach or copyWeightsToDevice() refreshes
    m = Lin()
    infer = poptorch.inferenceModel(m)
    x = torch.ones(1, 2)
    assert torch.equal(infer(x), torch.tensor([[2.0]]))
    train = poptorch.trainingModel(m, opts(), torch.optim.SGD(m.parameters(), lr=0.1))
    train(x, torch.zeros(1, 1))
    trained = m.fc(x).detach()  # the host module now holds the trained weights
    assert not torch.equal(trained, torch.tensor([[2.0]]))
    assert torch.equal(infer(x), torch.tensor([[2.0]]))  # stale until re-attached
    infer.detachFromDevice()
    infer.attachToDevice()
    assert torch.equal(infer(x), trained)


def test_reattach_after_training_without_host_read_pushes_device_weights():
    m = Lin()
    infer = poptorch.inferenceModel(m)
    x = torch.ones(1, 2)
    infer(x)
    train = poptorch.trainingModel(m, opts(), torch.optim.SGD(m.parameters(), lr=0.1))
    train(x, torch.zeros(1, 1))
    train(x, torch.zeros(1, 1))
    infer.copyWeightsToDevice()  # nothing read the host module since training
    got = infer(x)
    with torch.no_grad():
        want = m.fc(x)
    assert torch.equal(got, want) and not torch.equal(got, torch.tensor([[2.0]]))


# ---------------------------------------------------------------------------------------------
# §8.13 / §4.4: attach, detach, destroy

NOT_COMPILED = "Model has not been compiled or has been destroyed."


def test_detach_attach_error_conditions():
    model = poptorch.inferenceModel(Net())
    assert not model.isCompiled() and not model.isAttachedToDevice()
    with pytest.raises(poptorch.Error, match=NOT_COMPILED):
        model.detachFromDevice()
    with pytest.raises(poptorch.Error, match=NOT_COMPILED):
        model.attachToDevice()
    x = torch.randn(2, IN)
    model(x)
    assert model.isCompiled() and model.isAttachedToDevice()
    with pytest.raises(poptorch.Error, match="Device is already attached"):
        model.attachToDevice()
    model.detachFromDevice()
    assert not model.isAttachedToDevice()
    with pytest.raises(poptorch.Error, match="Device is not attached"):
        model.detachFromDevice()
    model.attachToDevice()
    assert model.isAttachedToDevice()


def test_copy_weights_before_compile_is_an_error_and_keeps_host_edits():
    m = Lin()
    model = poptorch.trainingModel(m, opts(mode=poptorch.OutputMode.All))
    with torch.no_grad():
        m.fc.weight.fill_(4.0)  # e.g. a checkpoint loaded after wrapping
    with pytest.raises(poptorch.Error, match=NOT_COMPILED):
        model.copyWeightsToHost()
    with pytest.raises(poptorch.Error, match=NOT_COMPILED):
        model.copyWeightsToDevice()
    assert torch.equal(m.fc.weight, torch.full((1, 2), 4.0))
    out, _ = model(torch.ones(1, 2), torch.zeros(1, 1))  # the first call uploads the host
    assert torch.equal(out, torch.tensor([[8.0]]))


def test_call_on_detached_model_reattaches():
    m = Net()
    model = poptorch.trainingModel(m, opts())
    x, y = host_batch(1, 1, 1, 2)
    model(x, y)
    model.detachFromDevice()
    model(x, y)
    assert model.isAttachedToDevice()


def test_attach_pushes_host_weights():
    m = Lin()
    model = poptorch.trainingModel(
        m, opts(mode=poptorch.OutputMode.All), torch.optim.SGD(m.parameters(), lr=0.0)
    )
    x, y = torch.ones(1, 2), torch.zeros(1, 1)
    model(x, y)
    model.detachFromDevice()  # syncs the host
    with torch.no_grad():
        m.fc.weight.fill_(5.0)
    model.attachToDevice()
    out, _ = model(x, y)
    assert torch.equal(out, torch.tensor([[10.0]]))
    # implicit re-attach by a call also pushes
    model.detachFromDevice()
    with torch.no_grad():
        m.fc.weight.fill_(7.0)
    out, _ = model(x, y)
    assert torch.equal(out, torch.tensor([[14.0]]))


def test_detach_syncs_weights_and_optimizer_state():
    m = Net()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    model = poptorch.trainingModel(m, opts(di=3), opt)
    model(*host_batch(3, 1, 1, 2))
    model.detachFromDevice()
    sd = opt.state_dict()  # detached: the host copy was synced on detach
    assert all(float(s["step"]) == 3.0 for s in sd["state"].values())


def test_destroy_unwraps_and_allows_rewrapping():
    m = Net()
    cls = type(m)
    model = poptorch.trainingModel(m, opts())
    assert type(m) is not cls and isinstance(m, cls)
    with pytest.raises(RuntimeError, match="already been wrapped in 'poptorch.trainingModel'"):
        poptorch.trainingModel(m, opts())
    model.destroy()  # not compiled: a no-op, as in PopTorch; the module stays wrapped
    assert type(m) is not cls
    with pytest.raises(RuntimeError, match="already been wrapped in 'poptorch.trainingModel'"):
        poptorch.trainingModel(m, opts())
    model.compile(*host_batch(1, 1, 1, 2))
    model.destroy()
    assert type(m) is cls
    model2 = poptorch.trainingModel(m, opts())
    x, y = host_batch(1, 1, 1, 2)
    model2(x, y)
    before = m.fc1.weight.detach().clone()
    model2(x, y)
    model2.destroy()
    assert type(m) is cls and not model2.isCompiled()
    assert not torch.equal(m.fc1.weight, before)  # destroy synced the trained weights
    with pytest.raises(poptorch.Error, match=NOT_COMPILED):
        model2.attachToDevice()
    with pytest.raises(poptorch.Error, match=NOT_COMPILED):
        model2.detachFromDevice()
    poptorch.trainingModel(m, opts())(x, y)


def test_wrapping_an_executor_unwraps_it():
    m = Net()
    infer = poptorch.inferenceModel(m)
    train = poptorch.trainingModel(infer, opts())
    assert train.model is m


def test_destroy_before_compile_is_a_noop_for_inference():
    model = poptorch.inferenceModel(Net())
    model.destroy()
    assert not model.isCompiled()


def test_offline_target_cannot_run_or_attach():
    o = poptorch.Options().useOfflineIpuTarget()
    model = poptorch.inferenceModel(Net(), o)
    x = torch.randn(2, IN)
    model.compile(x)
    assert model.isCompiled()
    with pytest.raises(AssertionError, match="model.compile"):
        model(x)
    with pytest.raises(
        AssertionError,
        match=r"^Trying to attach to an offline device "
        r"\(ConnectionType.Never\)",
    ):
        model.attachToDevice()


# ---------------------------------------------------------------------------------------------
# §8.11 / §5: pipelines (the PopTorch pipelining tutorial's 4-stage model)


class ConvLayer(nn.Module):
    def __init__(self, cin, cout, k, pool):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size=k)
        self.pool = nn.MaxPool2d(kernel_size=pool)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.pool(self.conv(x)))


class TutorialNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Linear(320, 256)
        self.layer3_act = nn.ReLU()
        self.layer4 = nn.Linear(256, 10)

    def forward(self, x):
        with poptorch.Block("B1"):
            x = self.layer1(x)
        with poptorch.Block("B2"):
            x = self.layer2(x)
        with poptorch.Block("B3"):
            x = x.view(-1, 320)
            x = self.layer3_act(self.layer3(x))
        with poptorch.Block("B4"):
            x = self.layer4(x)
        return x


class TutorialWithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, args, labels=None):
        output = self.model(args)
        if labels is None:
            return output
        with poptorch.Block("B4"):
            loss = self.loss(output, labels)
        return output, loss


def _tutorial_strategy(cls=poptorch.PipelinedExecution):
    return cls(
        poptorch.Stage("B1").ipu(0),
        poptorch.Stage("B2").ipu(1),
        poptorch.Stage("B3").ipu(2),
        poptorch.Stage("B4").ipu(3),
    )


def _mnist(n):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_pipeline_training_needs_ga_at_least_2f_minus_1():
    o = opts(ga=6)
    o.setExecutionStrategy(_tutorial_strategy())
    model = poptorch.trainingModel(TutorialWithLoss(TutorialNetwork()), o)
    x, y = _mnist(6)
    with pytest.raises(poptorch.Error) as e:
        model(x, y)
    msg = str(e.value)
    assert (
        "poptorch.Options().Training.gradientAccumulation must be greater than or equal to "
        "the number of pipeline stages (7) when using poptorch.PipelinedExecution"
    ) in msg
    assert "a model with 4 pipeline stages in PopTorch will have an additional 3 stages" in msg
    # GA = 7 is enough (a lower bound, not a multiple)
    o = opts(ga=7)
    o.setExecutionStrategy(_tutorial_strategy())
    model = poptorch.trainingModel(TutorialWithLoss(TutorialNetwork()), o)
    x, y = _mnist(7)
    out, loss = model(x, y)
    assert out.shape == (1, 10) and loss.dim() == 0


def test_failed_compile_leaves_model_uncompiled():
    o = opts(ga=2)
    o.setExecutionStrategy(_tutorial_strategy())
    model = poptorch.trainingModel(TutorialWithLoss(TutorialNetwork()), o)
    x, y = _mnist(2)
    with pytest.raises(poptorch.Error, match="pipeline stages"):
        model(x, y)
    assert not model.isCompiled() and not model.isAttachedToDevice()
    with pytest.raises(poptorch.Error, match="pipeline stages"):
        model(x, y)  # still refused: the failed compile did not leave a runnable model


def test_pipeline_inference_needs_di_at_least_f():
    o = opts(di=3)
    o.setExecutionStrategy(_tutorial_strategy())
    model = poptorch.inferenceModel(TutorialNetwork(), o)
    with pytest.raises(
        poptorch.Error,
        match=r"poptorch.Options\(\).deviceIterations must be "
        r"greater than or equal to the number of pipeline "
        r"stages \(4\)",
    ):
        model(_mnist(3)[0])
    o = opts(di=4)
    o.setExecutionStrategy(_tutorial_strategy())
    model = poptorch.inferenceModel(TutorialNetwork(), o)
    assert model(_mnist(4)[0]).shape == (4, 10)


def test_sharded_execution_has_no_pipeline_constraint():
    o = opts(di=1)
    o.setExecutionStrategy(_tutorial_strategy(poptorch.ShardedExecution))
    model = poptorch.inferenceModel(TutorialNetwork(), o)
    assert model(_mnist(2)[0]).shape == (2, 10)


def test_blocks_are_noops_outside_the_wrapper():
    net = TutorialNetwork()
    assert net(_mnist(2)[0]).shape == (2, 10)


class ThreeIpu(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(IN, IN), nn.Linear(IN, IN), nn.Linear(IN, OUT)

    def forward(self, x):
        with poptorch.Block(ipu_id=0):
            x = self.a(x)
        with poptorch.Block(ipu_id=1):
            x = self.b(x)
        with poptorch.Block(ipu_id=2):
            x = self.c(x)
        return x


def test_power_of_two_ipus_required():
    model = poptorch.inferenceModel(ThreeIpu(), opts(di=3))
    with pytest.raises(poptorch.Error) as e:
        model(torch.randn(3, IN))
    assert "power of 2" in str(e.value) and "autoRoundNumIPUs" in str(e.value)


def test_power_of_two_rounded_with_auto_round(caplog):
    o = opts(di=3).autoRoundNumIPUs(True)
    model = poptorch.inferenceModel(ThreeIpu(), o)
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        assert model(torch.randn(3, IN)).shape == (3, OUT)
    assert any(
        "4" in r.getMessage() and "autoRoundNumIPUs" in r.getMessage() for r in caplog.records
    )


def test_power_of_two_relaxed_on_ipu_model():
    o = opts(di=3).useIpuModel(True)
    model = poptorch.inferenceModel(ThreeIpu(), o)
    assert model(torch.randn(3, IN)).shape == (3, OUT)


def test_ipu_model_environment_variable(monkeypatch):
    # POPTORCH_IPU_MODEL=1 relaxes the rule, =0 does not, and useIpuModel() takes precedence
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "1")
    assert poptorch.inferenceModel(ThreeIpu(), opts(di=3))(torch.randn(3, IN)).shape == (3, OUT)
    with pytest.raises(poptorch.Error, match="power of 2"):
        poptorch.inferenceModel(ThreeIpu(), opts(di=3).useIpuModel(False))(torch.randn(3, IN))
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "0")
    with pytest.raises(poptorch.Error, match="power of 2"):
        poptorch.inferenceModel(ThreeIpu(), opts(di=3))(torch.randn(3, IN))


def test_power_of_two_counts_replicas():
    model = poptorch.inferenceModel(Net(), opts(rf=3))
    with pytest.raises(poptorch.Error, match="power of 2"):
        model(torch.randn(3, IN))
    ok = poptorch.inferenceModel(Net(), opts(rf=4))
    assert ok(torch.randn(4, IN)).shape == (4, OUT)


def test_training_pipeline_on_three_ipus():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = ThreeIpu()

        def forward(self, x, y):
            out = self.net(x)
            with poptorch.Block(ipu_id=2):
                loss = F.mse_loss(out, y)
            return out, loss

    o = opts(ga=4).autoRoundNumIPUs(True)
    with pytest.raises(poptorch.Error, match=r"pipeline stages \(5\)"):
        poptorch.trainingModel(WithLoss(), o)(*host_batch(1, 4, 1, 1))
    o = opts(ga=5)
    with pytest.raises(poptorch.Error, match="power of 2"):
        poptorch.trainingModel(WithLoss(), o)(*host_batch(1, 5, 1, 1))
    o = opts(ga=5).autoRoundNumIPUs(True)
    out, loss = poptorch.trainingModel(WithLoss(), o)(*host_batch(1, 5, 1, 1))
    assert out.shape == (1, OUT)


# ---------------------------------------------------------------------------------------------
# §8.12 / §4.7: losses


def test_identity_loss_reductions():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(poptorch.identity_loss(x, reduction="sum"), torch.tensor(10.0))
    assert torch.equal(poptorch.identity_loss(x, reduction="mean"), torch.tensor(2.5))
    assert torch.equal(poptorch.identity_loss(x, reduction="none"), x)
    with pytest.raises(AssertionError, match="^Unsupported reduction type!"):
        poptorch.identity_loss(x, reduction="max")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_identity_loss_trains_like_the_reduced_loss(reduction):
    class Custom(Net):
        def forward(self, x, y):
            out = self.fc2(torch.tanh(self.fc1(x)))
            return out, poptorch.identity_loss((out - y) ** 2, reduction=reduction)

    m = Custom()
    ref = copy.deepcopy(m)
    di, ga = 2, 2
    model = poptorch.trainingModel(m, opts(di, ga), torch.optim.SGD(m.parameters(), lr=0.05))
    x, y = host_batch(di, ga, 1, 3)
    _, loss = model(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    b = 3
    xs, ys = x.reshape(di, ga, b, IN), y.reshape(di, ga, b, OUT)
    for d in range(di):
        for a in range(ga):
            out = ref.fc2(torch.tanh(ref.fc1(xs[d, a])))
            err = (out - ys[d, a]) ** 2
            ref_loss = err.sum() if reduction == "sum" else err.mean()
            (ref_loss * (1.0 / ga)).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-6, rtol=0)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_identity_loss_none_returns_unreduced_loss():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(IN, OUT)

        def forward(self, x, y):
            return poptorch.identity_loss((self.fc(x) - y) ** 2, reduction="none")

    loss = poptorch.trainingModel(Custom(), opts())(*host_batch(1, 1, 1, 2))
    assert loss.shape == (2, OUT)


def test_no_loss_is_an_error():
    model = poptorch.trainingModel(Net(), opts())
    with pytest.raises(poptorch.Error, match="Couldn't find a loss in graph!"):
        model(torch.randn(2, IN))
    assert not model.isCompiled()


def test_multiple_independent_losses_is_an_error():
    class Two(Net):
        def forward(self, x, y):
            out = self.fc2(torch.tanh(self.fc1(x)))
            return F.mse_loss(out, y), F.l1_loss(out, y)

    with pytest.raises(
        poptorch.Error,
        match="Multiple independent losses found in graph. Graph "
        "must have one final loss. Wrap final graph loss in "
        "poptorch.identity_loss.",
    ):
        poptorch.trainingModel(Two(), opts())(*host_batch(1, 1, 1, 2))


def test_compound_loss_wrapped_in_identity_loss_is_one_loss():
    class Two(Net):
        def forward(self, x, y):
            out = self.fc2(torch.tanh(self.fc1(x)))
            a, b = F.mse_loss(out, y), F.l1_loss(out, y)
            return out, poptorch.identity_loss(a + b, reduction="none")

    out, loss = poptorch.trainingModel(Two(), opts())(*host_batch(1, 1, 1, 2))
    assert loss.dim() == 0


def test_loss_found_anywhere_in_the_output_structure():
    class LossFirst(Net):
        def forward(self, x, y):
            out = self.fc2(torch.tanh(self.fc1(x)))
            return {"loss": F.mse_loss(out, y), "out": out}

    m, ref = LossFirst(), Net()
    ref.load_state_dict(m.state_dict())
    res = poptorch.trainingModel(m, opts(), torch.optim.SGD(m.parameters(), lr=0.1))(
        *host_batch(1, 1, 1, 2)
    )
    assert set(res) == {"loss", "out"} and res["loss"].dim() == 0
    reference_train(
        ref, torch.optim.SGD(ref.parameters(), lr=0.1), *host_batch(1, 1, 1, 2), 1, 1, 1
    )
    assert torch.equal(m.fc1.weight, ref.fc1.weight)


def test_returned_loss_is_per_micro_batch_not_divided():
    # §2.2: the loss value returned is the forward loss of a micro-batch (not / GA / RF)
    out, loss, _, ref_losses = _train_outputs(poptorch.OutputMode.All, di=1, ga=4, rf=2)
    assert torch.equal(loss, ref_losses.reshape(-1))


def test_outputs_cannot_backward():
    m = Net()
    out, loss = poptorch.trainingModel(m, opts())(*host_batch(1, 1, 1, 2))
    assert not loss.requires_grad and not out.requires_grad


# ---------------------------------------------------------------------------------------------
# §1.3 / §8.9: random seed and device RNG


class Dropper(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(IN, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, y):
        out = self.drop(self.fc(x))
        return out, poptorch.identity_loss(out.pow(2), reduction="mean")


def _dropout_run(seed, consume_host_rng=False):
    o = opts(di=2).randomSeed(seed)
    model = poptorch.trainingModel(Dropper(), o)
    x = torch.ones(4, IN)
    if consume_host_rng:
        torch.rand(1000)
    outs = [model(x, torch.zeros(4, 16))[0] for _ in range(2)]
    return torch.cat(outs)


def test_dropout_deterministic_with_random_seed():
    a = _dropout_run(42)
    b = _dropout_run(42, consume_host_rng=True)  # the device RNG is not the host's
    c = _dropout_run(43)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # dropout ran (some zeros), and the two calls drew different masks
    assert (a == 0).any()
    assert not torch.equal(a[:2].eq(0), a[2:].eq(0))


def test_random_seed_also_seeds_host():
    poptorch.Options().randomSeed(7)
    a = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(3))


def test_device_rng_does_not_advance_host_rng():
    o = opts().randomSeed(1)
    model = poptorch.trainingModel(Dropper(), o)
    torch.manual_seed(5)
    model(torch.ones(2, IN), torch.zeros(2, 16))
    got = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(got, torch.rand(3))


def test_is_running_on_ipu_only_inside_the_model():
    seen = []

    class M(nn.Module):
        def forward(self, x):
            seen.append(poptorch.isRunningOnIpu())
            return x * 2

    assert not poptorch.isRunningOnIpu()
    poptorch.inferenceModel(M())(torch.ones(2))
    assert seen and all(seen)
    assert not poptorch.isRunningOnIpu()


# -- getLatency: PopTorch's _computeLatency over host-side timestamps ----------------------------


class Slow(nn.Module):
    """Each forward takes at least ``PAUSE`` seconds."""

    PAUSE = 0.02

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x, y=None):
        import time

        time.sleep(self.PAUSE)
        out = self.fc(x)
        return out if y is None else (out, F.mse_loss(out, y))


def test_get_latency_is_zero_before_the_first_run_and_per_device_iteration_with_all():
    opts = poptorch.Options().deviceIterations(3).outputMode(poptorch.OutputMode.All)
    model = poptorch.inferenceModel(Slow(), opts)
    assert model.getLatency() == (0.0, 0.0, 0.0)
    model(torch.randn(6, 3))
    low, high, mean = model.getLatency()
    assert Slow.PAUSE <= low <= mean <= high < 3 * Slow.PAUSE  # one iteration's each


def test_get_latency_of_a_final_output_spans_the_whole_call():
    opts = poptorch.Options().deviceIterations(3)  # training: OutputMode.Final
    net = Slow()
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    model(torch.randn(6, 3), torch.randn(6, 2))
    low, high, mean = model.getLatency()
    assert low == high == mean >= 3 * Slow.PAUSE  # the one output waits for every iteration
    model.destroy()
    assert model.getLatency() == (0.0, 0.0, 0.0)


def test_the_trace_leaves_weights_a_forward_writes_in_place_as_they_were():
    """PopTorch traces the model without running it on the device: a parameter ``forward``
    writes in place under ``no_grad`` (an EMA) and a BatchNorm's statistics are, after
    ``compile``, what they were; the first call writes them once."""

    class Averaging(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.bn = torch.nn.BatchNorm1d(2)
            self.avg = torch.nn.Parameter(torch.zeros(2), requires_grad=False)

        def forward(self, x, y):
            out = self.bn(self.lin(x))
            with torch.no_grad():
                self.avg.add_(out.mean(0))
            return out, torch.nn.functional.cross_entropy(out, y)

    torch.manual_seed(0)
    model = Averaging()
    reference = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    opt = poptorch.optim.SGD(model.parameters(), lr=0.0)
    training = poptorch.trainingModel(model, poptorch.Options(), optimizer=opt)
    training.compile(x, y)
    training.copyWeightsToHost()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    training(x, y)
    training.copyWeightsToHost()
    reference(x, y)  # once, in plain torch
    torch.testing.assert_close(model.avg, reference.avg)
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)
    training.destroy()
