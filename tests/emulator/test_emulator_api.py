"""The rest of PopTorch's public API on the emulator, and what real programs do with it.

Programs written for PopTorch use more than the wrappers: ``poptorch.OverlapMode``,
``poptorch.ipu_print_tensor``, ``opts.anchorTensor`` + ``getAnchoredTensor``, float16 optimizers,
``copy.deepcopy`` of a wrapped model, ``model.double()`` and so on. Each is either emulated with
PopTorch's semantics (the ops are identities or plain torch math on an IPU too) or refused with
a ``poptorch.Error`` / ``AttributeError`` saying why and what to do instead.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipuloop.emulator as poptorch

# -- enums -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "enum, members",
    [
        (
            "OverlapMode",
            {
                "NoOverlap": "no_overlap",
                "OverlapAccumulationLoop": "overlap_accumulation_loop",
                "OverlapDeviceIterationLoop": "overlap_device_iteration_loop",
            },
        ),
        (
            "MatMulSerializationMode",
            {
                "InputChannels": "input_channels",
                "ReducingDim": "reducing_dim",
                "OutputChannels": "output_channels",
                "Disabled": "none",
            },
        ),
        ("MultiConvPlanType", {"Parallel": 0, "Serial": 1}),
        ("VariableRetrievalMode", {"OnePerGroup": 0, "AllReplicas": 2}),
        ("SharingStrategy", {"SharedMemory": 0, "FileSystem": 1, "Fork": 2, "ForkServer": 3}),
        (
            "Liveness",
            {
                "AlwaysLive": 0,
                "OffChipAfterFwd": 1,
                "OffChipAfterFwdNoOverlap": 2,
                "OffChipAfterEachPhase": 3,
            },
        ),
        (
            "HalfFloatCastingBehavior",
            {"FloatDowncastToHalf": 0, "HalfUpcastToFloat": 1, "Default": 2},
        ),
    ],
)
def test_every_poptorch_enum_is_exported_with_its_values(enum, members):
    cls = getattr(poptorch, enum)
    assert {m.name: m.value for m in cls} == members


def test_async_options_can_name_a_sharing_strategy():
    opts = poptorch.Options()
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    loader = poptorch.DataLoader(
        opts,
        data,
        batch_size=2,
        mode=poptorch.DataLoaderMode.Async,
        async_options={
            "sharing_strategy": poptorch.SharingStrategy.SharedMemory,
            "load_indefinitely": True,
        },
    )
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    loader.terminate()


# -- ops ---------------------------------------------------------------------------------------


class Printer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([2.0]))

    def forward(self, x, y):
        a = poptorch.ipu_print_tensor(x * self.w, "scaled")
        out = a + 1
        return out, F.mse_loss(out, y, reduction="sum")


def test_ipu_print_tensor_prints_value_and_gradient_only_when_the_device_runs(capsys):
    model = Printer()
    x, y = torch.tensor([1.0]), torch.tensor([0.0])
    model(x, y)  # host execution: an identity, prints nothing
    assert capsys.readouterr().err == ""
    training = poptorch.trainingModel(model)
    training(x, y)  # compile-time trace prints nothing; the run prints value and gradient
    # on stderr, in Poplar's default format: 4 digits, ", " between elements, ( and )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("scaled")]
    assert lines == ["scaled: (2.000)", "scaled_gradient: (6.000)"]  # d/da (a+1)^2


def test_ipu_print_tensor_needs_a_tensor():
    with pytest.raises(poptorch.Error, match="^ipu print tensor must take a torch.tensor"):
        poptorch.ipu_print_tensor(3.0)


def test_overlap_helpers_return_the_same_structure_and_check_their_arguments():
    x, y = torch.ones(2), torch.zeros(3)
    mode = poptorch.OverlapMode.OverlapDeviceIterationLoop
    assert poptorch.set_overlap_for_input(x, mode) is x
    out = poptorch.set_overlap_for_output({"a": x, "b": (y,)}, mode)
    assert out["a"] is x and out["b"][0] is y
    with pytest.raises(poptorch.Error, match="^You may only set overlap for torch.tensor inputs"):
        poptorch.set_overlap_for_input([x, 1], mode)
    with pytest.raises(AssertionError, match="OverlapMode"):
        poptorch.set_overlap_for_output(x, "overlap")


def test_serialized_matmul_is_a_matmul_and_checks_its_arguments():
    a, b = torch.randn(4, 6), torch.randn(6, 8)
    out = poptorch.serializedMatMul(a, b, poptorch.MatMulSerializationMode.ReducingDim, 2)
    assert torch.equal(out, a @ b)
    with pytest.raises(AssertionError):
        poptorch.serializedMatMul(a, b, "reducing_dim", 2)


def test_dynamic_slice_and_update_match_python_slicing():
    t = torch.arange(20.0).reshape(2, 10)
    start = torch.tensor([3])
    assert torch.equal(poptorch.dynamic_slice(t, 1, start, 4, 2), t[:, 3:7:2])
    src = -torch.ones(2, 3)
    expected = t.clone()
    expected[:, 3:6] = src
    assert torch.equal(poptorch.dynamic_update(t, src, 1, start, 3), expected)
    with pytest.raises(poptorch.Error, match="^Slice start argument to dynamic_slice"):
        poptorch.dynamic_slice(t, 1, 3, 4, 1)


def test_for_loop_feeds_outputs_back_as_inputs_and_checks_inputs():
    out = poptorch.for_loop(3, lambda a, b: (a * 2, b + a), [torch.ones(2), torch.zeros(2)])
    assert [o.tolist() for o in out] == [[8.0, 8.0], [7.0, 7.0]]
    with pytest.raises(ValueError, match="^poptorch.for_loop expects input tensors"):
        poptorch.for_loop(2, lambda a: a, torch.ones(2))


def test_cpu_op_multiconv_and_name_scope_run_their_body():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cpu = poptorch.CPU(lambda x: x * 2.0, "Double")
            self.conv_a, self.conv_b = nn.Conv2d(1, 2, 3), nn.Conv2d(1, 2, 3)

        def forward(self, x):
            mc = (
                poptorch.MultiConv()
                .availableMemoryProportions((0.3, 0.2))
                .partialsTypes(torch.half)
                .planType(poptorch.MultiConvPlanType.Serial)
            )
            with mc:
                a, b = self.conv_a(x), self.conv_b(x)
            with poptorch.NameScope("sum"):
                return self.cpu(a + b)

    model = M()
    x = torch.randn(2, 1, 5, 5)
    expected = model(x)
    out = poptorch.inferenceModel(model)(x)
    assert torch.allclose(out, expected) and torch.allclose(
        expected, 2 * (model.conv_a(x) + model.conv_b(x))
    )
    with pytest.raises(ValueError, match="^Invalid partials types"):
        poptorch.MultiConv().partialsTypes(torch.int32)


def test_attribute_scopes_record_outlining_attributes_and_change_no_value():
    """python/options.py ``Attribute``: PopTorch's ``poptorch.Attribute(__outline={...})``
    (BERT's and GPT-2's ``outline_attribute``, entered and left by forward hooks) sets the
    attributes of the ops it wraps, merged over the enclosing scopes' and restored on exit;
    outlining reuses code and changes no value, so the model trains as without it."""

    def outline_attribute(module: nn.Module, value: str) -> None:
        context = poptorch.Attribute(__outline={"layer": value})
        module.register_forward_pre_hook(lambda *args: context.__enter__())
        module.register_forward_hook(lambda *args: context.__exit__(None, None, None))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    seen = []
    for i, layer in enumerate(model):
        outline_attribute(layer, "AB"[i % 2])
        layer.register_forward_pre_hook(
            lambda *args: seen.append(copy.deepcopy(poptorch.Attribute._current_attrs))
        )

    class WithLoss(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x):
            out = self.net(x)
            return out, poptorch.identity_loss((out**2).mean(), "none")

    x = torch.randn(8, 4)
    train = poptorch.trainingModel(
        WithLoss(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
    )
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        _, loss = train(x)
        opt.zero_grad()
        ref_loss = (ref(x) ** 2).mean()
        ref_loss.backward()
        opt.step()
        assert torch.allclose(loss, ref_loss.detach())
    train.copyWeightsToHost()
    assert all(torch.allclose(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert seen[:3] == [{"__outline": {"layer": v}} for v in "ABA"]
    assert poptorch.Attribute._current_attrs == {}

    with poptorch.Attribute(__outline={"layer": "x"}, other={"k": 1}):
        with poptorch.Attribute(__outline={"scope": "y"}):
            inner = copy.deepcopy(poptorch.Attribute._current_attrs)
        outer = copy.deepcopy(poptorch.Attribute._current_attrs)
    assert inner == {"__outline": {"layer": "x", "scope": "y"}, "other": {"k": 1}}
    assert outer == {"__outline": {"layer": "x"}, "other": {"k": 1}}
    assert poptorch.Attribute._current_attrs == {}


def test_torch_ops_poptorch_name_scopes_attributes_and_casts():
    """poptorch/source/dispatch_tracer/RegisterAtenOverloads.cpp ``TORCH_LIBRARY(poptorch)``:
    importing PopTorch defines ``torch.ops.poptorch.*``, which model code calls directly
    (name scopes pushed and popped by layer hooks, ``internal_cast`` around a float32
    region of a float16 model). On the device ``internal_cast`` casts to the named type and is
    differentiable; outside a wrapped model it is PopTorch's CPU kernel (``castOp``: "FLOAT16"
    and "FLOAT32" give float32, any other type the input unchanged)."""
    torch.ops.poptorch.push_name_scope("outer")
    torch.ops.poptorch.set_attribute("__outline", "layer", "A")
    torch.ops.poptorch.clear_attribute("__outline", "layer")
    torch.ops.poptorch.pop_name_scope()
    half = torch.ones(2, dtype=torch.float16)
    assert torch.ops.poptorch.internal_cast(half, "FLOAT16").dtype == torch.float32
    assert torch.ops.poptorch.internal_cast(half, "FLOAT").dtype == torch.float16

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            for name, layer in self.named_children():
                layer.register_forward_pre_hook(
                    lambda *args, n=name: torch.ops.poptorch.push_name_scope(n)
                )
                layer.register_forward_hook(lambda *args: torch.ops.poptorch.pop_name_scope())

        def forward(self, x):
            y = torch.ops.poptorch.internal_cast(self.fc(x), "FLOAT16")
            loss = torch.ops.poptorch.internal_cast(y, "FLOAT").sum()
            return y, poptorch.identity_loss(loss, "none")

    torch.manual_seed(0)
    model = M()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    train = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    y, loss = train(x)
    assert y.dtype == torch.float16 and loss.dtype == torch.float32
    expected = ref.fc(x).half()
    assert torch.equal(y, expected) and torch.equal(loss, expected.float().sum())
    train.copyWeightsToHost()
    assert torch.allclose(model.fc.bias, ref.fc.bias - 0.1 * 3)  # d loss / d bias = 3
    with pytest.raises(poptorch.Error, match="internal_cast: unknown type 'INT8'"):
        poptorch.inferenceModel(_InternalCast("INT8"))(x)


class _InternalCast(nn.Module):
    def __init__(self, dtype: str) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return torch.ops.poptorch.internal_cast(x, self.dtype)


def test_config_file_error_is_a_top_level_name(tmp_path):
    """python/__init__.py imports ``options`` with ``*``: an options file's syntax error is
    ``poptorch.ConfigFileError``, the name programs catch."""
    path = tmp_path / "opts.conf"
    path.write_text("deviceIterations(\n")
    with pytest.raises(poptorch.ConfigFileError, match="SyntaxError at line"):
        poptorch.Options().loadFromFile(str(path))


@pytest.mark.parametrize(
    "call, words",
    [
        (
            lambda: poptorch.custom_op([torch.ones(1)], "Cube", "com.acme", 1, [torch.ones(1)]),
            r"^poptorch.custom_op\('Cube'\) runs a PopART custom op",
        ),
        (lambda: poptorch.load("model.popef"), r"^poptorch.load\('model.popef'\) needs a Poplar"),
    ],
)
def test_what_needs_ipu_binaries_is_refused_with_a_reason(call, words):
    with pytest.raises(poptorch.Error, match=words):
        call()


# -- the executor's options and anchored tensors --------------------------------------------


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x, y=None):
        out = self.fc2(torch.tanh(self.fc1(x)))
        if y is None:
            return out
        return out, F.mse_loss(out, y)


def _anchored(*args) -> poptorch.Options:
    opts = poptorch.Options()
    opts.anchorTensor(*args)
    return opts


def test_executor_options_property_is_the_resolved_copy():
    opts = poptorch.Options().deviceIterations(2)
    model = poptorch.trainingModel(TwoLayer(), opts)
    assert model.options is not opts
    assert model.options.device_iterations == 2
    assert poptorch.OutputMode(model.options.output_mode) == poptorch.OutputMode.Final


def test_get_tensor_names_needs_a_compiled_model_and_lists_anchorable_names():
    model = poptorch.trainingModel(TwoLayer())
    with pytest.raises(
        AssertionError, match="^Model must be compiled before calling getTensorNames"
    ):
        model.getTensorNames()
    model.compile(torch.zeros(2, 3), torch.zeros(2, 2))
    names = model.getTensorNames()
    assert {"fc1.weight", "Gradient___fc1.weight", "UpdatedVar___fc2.bias"} <= set(names)


def _micro_batch_grads(model: nn.Module, x, y, di, ga, rf, b, name):
    """Per-micro-batch gradients of ``name`` in [DI, GA, RF] order, and the model after DI
    SGD updates on the mean of GA x RF micro-batch gradients."""
    model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=0.01)
    recorded = []
    for d in range(di):
        for a in range(ga):
            for r in range(rf):
                s = ((d * ga + a) * rf + r) * b
                loss = model(x[s : s + b], y[s : s + b])[1]
                grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
                recorded.append(grads[name])
                for key, p in params.items():
                    g = grads[key] / (ga * rf)
                    p.grad = g if p.grad is None else p.grad + g
        opt.step()
        opt.zero_grad()
    return recorded, model


@pytest.mark.parametrize(
    "mode, period",
    [
        (poptorch.OutputMode.All, 1),
        (poptorch.OutputMode.Final, 1),
        (poptorch.OutputMode.Sum, 1),
        (poptorch.OutputMode.EveryN, 2),
    ],
)
def test_anchored_gradients_follow_the_output_mode(mode, period):
    di, ga, rf, b = 2, 2, 2, 3
    torch.manual_seed(1)
    x, y = torch.randn(di * ga * rf * b, 3), torch.randn(di * ga * rf * b, 2)
    model = TwoLayer()
    grads, reference = _micro_batch_grads(model, x, y, di, ga, rf, b, "fc2.weight")
    opts = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    opts.Training.gradientAccumulation(ga)
    opts.anchorTensor("g", "Gradient___fc2.weight", mode, period)
    opts.anchorTensor("w", "UpdatedVar___model.fc2.weight", poptorch.OutputMode.Final)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
    training(x, y)
    got = training.getAnchoredTensor("g")
    if mode == poptorch.OutputMode.All:
        expected = torch.cat(grads)
    elif mode == poptorch.OutputMode.EveryN:
        expected = torch.cat(grads[ga * rf :])  # d = 1 only: (d + 1) % 2 == 0
    elif mode == poptorch.OutputMode.Sum:
        expected = torch.cat([sum(grads[r::rf]) for r in range(rf)])
    else:
        expected = torch.cat(grads[-rf:])
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-6)
    weight = training.getAnchoredTensor("w")
    assert weight.shape == (rf * 2, 4)
    assert torch.allclose(weight, torch.cat([reference.fc2.weight.detach()] * rf), atol=1e-6)


def test_anchors_inherit_the_model_output_mode_and_refresh_every_call():
    opts = poptorch.Options().deviceIterations(2)
    opts.anchorTensor("g", "Gradient___fc1.bias")  # inherits Default -> Final for training
    model = TwoLayer()
    training = poptorch.trainingModel(model, opts)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    with pytest.raises(AssertionError, match="^No tensor with name g found"):
        training.getAnchoredTensor("g")  # not compiled / never run
    training(x, y)
    first = training.getAnchoredTensor("g")
    assert first.shape == (4,)
    training(x, y)
    assert not torch.equal(first, training.getAnchoredTensor("g"))  # weights moved
    with pytest.raises(AssertionError, match="^No tensor with name other found"):
        training.getAnchoredTensor("other")


def test_anchored_gradient_includes_loss_scaling():
    x, y = torch.randn(2, 3), torch.randn(2, 2)
    model = TwoLayer()
    expected = torch.autograd.grad(model(x, y)[1], model.fc2.bias)[0] * 8.0
    opts = _anchored("g", "Gradient___fc2.bias")
    training = poptorch.trainingModel(
        model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=8.0)
    )
    training(x, y)
    assert torch.allclose(training.getAnchoredTensor("g"), expected, atol=1e-6)


def test_unknown_anchor_name_or_unsupported_weight_mode_fails_at_compile():
    opts = _anchored("act", "relu/Relu:0")
    training = poptorch.trainingModel(TwoLayer(), opts)
    with pytest.raises(
        poptorch.Error,
        match=r"^Options.anchorTensor\('act', 'relu/Relu:0'\): "
        "the ipuloop emulator can anchor",
    ):
        training(torch.randn(2, 3), torch.randn(2, 2))
    assert not training.isCompiled()
    opts = _anchored("w", "UpdatedVar___fc1.bias", poptorch.OutputMode.All)
    with pytest.raises(poptorch.Error, match="OutputMode.Final only"):
        poptorch.trainingModel(TwoLayer(), opts)(torch.randn(2, 3), torch.randn(2, 2))


def test_inference_can_anchor_a_weight_but_not_a_gradient():
    model = TwoLayer()
    opts = _anchored("w", "fc1.weight", poptorch.OutputMode.Final)
    inference = poptorch.inferenceModel(model, opts)
    inference(torch.randn(2, 3))
    assert torch.equal(inference.getAnchoredTensor("w"), model.fc1.weight.detach())
    opts = _anchored("g", "Gradient___fc1.weight")
    with pytest.raises(poptorch.Error, match="can anchor"):
        poptorch.inferenceModel(model, opts)(torch.randn(2, 3))


def test_executor_options_copy_is_frozen():
    model = poptorch.trainingModel(TwoLayer(), poptorch.Options())
    with pytest.raises(AttributeError, match="^Can't modify frozen Options"):
        model.options.deviceIterations(4)


# -- the mean reduction strategy follows the optimizer's accumulator type (docs/poptorch-semantics.md §1.2, §4.6) -------


@pytest.mark.parametrize(
    "accum_type, training, combined, expected",
    [
        (torch.float32, True, False, poptorch.MeanReductionStrategy.Post),
        (torch.float16, True, False, poptorch.MeanReductionStrategy.Running),
        (torch.float16, True, True, poptorch.MeanReductionStrategy.Post),  # combined: Post only
        (None, True, False, poptorch.MeanReductionStrategy.Post),
        (None, False, False, poptorch.MeanReductionStrategy.Post),
    ],
)
def test_float16_accumulators_switch_to_the_running_mean_strategy(
    accum_type, training, combined, expected
):
    model = TwoLayer()
    opts = poptorch.Options()
    if training:
        optimizer = poptorch.optim.SGD(
            model.parameters(),
            lr=0.1,
            momentum=0.9,
            accum_type=accum_type,
            use_combined_accum=combined,
        )
        wrapped = poptorch.trainingModel(model, opts, optimizer)
    else:
        wrapped = poptorch.inferenceModel(model, opts)
    assert wrapped.options.Training.meanAccumulationAndReplicationReductionStrategy == expected
    assert (
        opts.Training.meanAccumulationAndReplicationReductionStrategy
        == poptorch.MeanReductionStrategy.Post
    )  # the user's object is untouched


def test_float16_accumulator_after_compile_needs_running_already():
    model = TwoLayer()
    x, y = torch.randn(2, 3), torch.randn(2, 2)
    training = poptorch.trainingModel(
        model, poptorch.Options(), poptorch.optim.Adam(model.parameters(), lr=0.5)
    )
    training(x, y)
    with pytest.raises(
        ValueError,
        match="^Invalid optimizer: the new optimizer would require "
        "changing options.Training.meanAccumulation",
    ):
        training.setOptimizer(
            poptorch.optim.Adam(model.parameters(), lr=0.5, accum_type=torch.float16)
        )
    training.destroy()
    half = poptorch.optim.Adam(model.parameters(), lr=0.5, accum_type=torch.float16)
    training = poptorch.trainingModel(model, poptorch.Options(), half)
    training(x, y)
    half.param_groups[0]["lr"] = 0.01
    training.setOptimizer(half)  # already Running: fine


# -- docs/poptorch-semantics.md §9 end to end: a drop_last=False remainder reaches a compiled model ---------------------


def test_drop_last_false_remainder_fails_the_compiled_model_shape_check():
    opts = poptorch.Options().deviceIterations(2)
    data = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.randn(10, 2))
    loader = poptorch.DataLoader(opts, data, batch_size=2, drop_last=False)
    training = poptorch.trainingModel(TwoLayer(), opts)
    batches = list(loader)
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    for x, y in batches[:-1]:
        training(x, y)
    with pytest.raises(
        poptorch.Error, match=r"^Shape mismatch for x: expected torch.Size\(\[4, 3\]\) but got"
    ):
        training(*batches[-1])


# -- APIs older PopTorch versions had: AttributeError (as on PopTorch 3.4) naming the successor


@pytest.mark.parametrize(
    "read, words",
    [
        (
            lambda: poptorch.Options().anchorMode,
            "anchorMode was removed in PopTorch 2.5: use "
            r"Options.outputMode",
        ),
        (
            lambda: poptorch.Options().Precision.autocastEnabled,
            "autocastEnabled was removed in PopTorch 3.1",
        ),
        (lambda: poptorch.Options().Precision.autocastPolicy, "autocastPolicy was removed"),
        (
            lambda: poptorch.AnchorMode,
            "AnchorMode was removed in PopTorch 2.5: use poptorch.OutputMode",
        ),
        (lambda: poptorch.autocast, "autocast was removed in PopTorch 3.1"),
    ],
)
def test_removed_apis_raise_attribute_error_naming_the_replacement(read, words):
    with pytest.raises(AttributeError, match=words):
        read()
    assert not hasattr(poptorch, "no_such_name")


# -- docs/poptorch-semantics.md §4.7 / §8.12: torch loss functions are losses, other returned scalars are not ------------


class ExtraScalar(nn.Module):
    """Returns a differentiable scalar that is not a loss next to a built-in loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 2)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.fc(x)
        return out.mean(), self.loss(out, y)


def test_builtin_loss_is_the_loss_even_next_to_another_differentiable_scalar():
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    model = ExtraScalar()
    reference = copy.deepcopy(model)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    mean, loss = training(x, y)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_mean, ref_loss = reference(x, y)
    ref_loss.backward()
    opt.step()
    assert torch.allclose(loss, ref_loss.detach()) and torch.allclose(mean, ref_mean.detach())
    assert torch.allclose(model.fc.weight, reference.fc.weight)


def test_two_returned_builtin_losses_are_multiple_independent_losses():
    class Two(ExtraScalar):
        def forward(self, x, y):
            out = self.fc(x)
            return self.loss(out, y), F.l1_loss(out, torch.zeros_like(out))

    training = poptorch.trainingModel(Two())
    with pytest.raises(poptorch.Error, match="^Multiple independent losses found in graph"):
        training(torch.randn(4, 3), torch.tensor([0, 1, 1, 0]))


# -- docs/poptorch-semantics.md §4.3: copies of a wrapped module are the user's module with the device's weights --------


class WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2)

    def forward(self, x, y):
        out = self.bn(self.fc(x))
        return out, F.mse_loss(out, y)


@pytest.mark.parametrize("copier", ["deepcopy", "torch.save"])
def test_copying_a_wrapped_module_gives_an_unwrapped_module_with_device_weights(copier):
    model = WithNorm()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    training(torch.randn(4, 3), torch.randn(4, 2))
    device = {k: v.clone() for k, v in training._device_weights().items()}
    if copier == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert type(copied) is WithNorm and "_poptorch_executor" not in copied.__dict__
    assert all(type(p) is nn.Parameter for p in copied.parameters())
    for key, value in copied.state_dict().items():  # trained weights and BatchNorm statistics
        assert torch.equal(value, device[key]), key
    again = poptorch.trainingModel(copied)  # an unwrapped module can be wrapped again
    again(torch.randn(4, 3), torch.randn(4, 2))
    assert type(model).__name__ == "PoptorchWithNorm"  # the original stays wrapped


def test_deep_copies_of_a_wrapped_module_each_hold_its_own_buffers():
    """PopTorch's buffer class copies as a plain tensor, through a temporary kept alive with the
    deepcopy memo: a temporary freed early lends its id, a memo key, to a later buffer, which
    then copied as the earlier one (a BatchNorm's running_var as another's statistics)."""
    model = nn.Sequential(*(nn.BatchNorm1d(3) for _ in range(6)))
    with torch.no_grad():
        for i, bn in enumerate(model):
            bn.running_mean.fill_(i)
            bn.running_var.fill_(10 + i)
    poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(20):
        copied = copy.deepcopy(model)
        assert all(type(b) is torch.Tensor for b in copied.buffers())
        for key, value in copied.state_dict().items():
            assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize(
    "method",
    [
        "getPerfCounters",
        "getHostIpuLatency",
        "getComputeLatency",
        "getIpuHostLatency",
        "cycleCount",
    ],
)
def test_device_timing_reads_are_refused_with_a_reason(method):
    model = poptorch.inferenceModel(TwoLayer())
    model(torch.randn(2, 3))
    with pytest.raises(poptorch.Error, match=rf"^{method}\(\) (reads|needs) (the )?IPU"):
        getattr(model, method)()


def test_float64_model_runs_in_float32_on_the_device_and_keeps_its_host_dtype():
    torch.manual_seed(0)
    model = TwoLayer().double()
    reference = copy.deepcopy(model).float()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = training(x, y)
    assert out.dtype == loss.dtype == torch.float32
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x.float(), y.float())[1].backward()
    opt.step()
    assert model.fc1.weight.dtype == torch.float64  # host copy keeps the user's dtype
    assert torch.equal(model.fc1.weight.float(), reference.fc1.weight)
