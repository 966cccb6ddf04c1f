"""Emulator fidelity: what PopTorch's compiler refuses (and accepts) when a model compiles,
and the attributes of PopTorch's errors.

Each test cites the PopTorch 3.4 source that raises the error; the refusals happen when the
model compiles (its first call), before any weight changes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException

import ipuloop.emulator as poptorch


class Fn(nn.Module):
    """A model whose forward is ``fn``."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


# -- ops PopTorch cannot compile ---------------------------------------------------------------


@pytest.mark.parametrize(
    "fn,x,message",
    [
        (
            lambda x: nn.functional.one_hot(x),
            torch.tensor([0, 2, 1]),
            r"^OneHot num classes must be specified and must be constant\.$",
        ),
        (
            lambda x: torch.bincount(x),
            torch.tensor([0, 2, 1]),
            r"^Bincount `minlength` must be specified and must be a constant\. On the IPU MK2 platform "
            r"the minimum length is also the maximum length$",
        ),
        (
            lambda x: nn.functional.interpolate(x, scale_factor=2, mode="linear"),
            torch.ones(1, 2, 3),
            r"^Unsupported upsample mode aten::upsample_linear1d: currently only 'nearest' is "
            r"supported$",
        ),
        (
            lambda x: nn.functional.interpolate(x, scale_factor=2, mode="trilinear"),
            torch.ones(1, 1, 2, 2, 2),
            r"^Unsupported upsample mode aten::upsample_trilinear3d",
        ),
    ],
)
def test_ops_poptorch_cannot_lower_are_refused_when_compiled(fn, x, message):
    """popart_canonicalization/EmbeddingOps.cpp ``onehotHandler``, dispatch_tracer/
    RegisterMetaOps.cpp.inc ``bincount`` and popart_canonicalization/ReshapeOps.cpp
    ``unsupportedUpsampleHandler``; the same ops with what PopTorch needs compile and run."""
    model = poptorch.inferenceModel(Fn(fn))
    with pytest.raises(poptorch.Error, match=message):
        model(x)
    assert not model.isCompiled()
    fine = poptorch.inferenceModel(
        Fn(lambda t: (nn.functional.one_hot(t, 3), torch.bincount(t, minlength=3)))
    )
    one_hot, counts = fine(torch.tensor([0, 2, 1]))
    assert counts.tolist() == [1, 1, 1] and one_hot.shape == (3, 3)


@pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 1),
    reason="torch < 2.1 does not show tensor indexing to function modes",
)
def test_outputs_whose_shape_depends_on_the_data_are_refused_when_compiled():
    """PopTorch's dispatcher computes every output shape before the data exists, so a boolean
    mask index raises torch's ``DynamicOutputShapeException`` (tests/index_ops_test.py
    ``test_index_bool_mask_failure``); assigning through a mask has a fixed shape and runs."""
    mask = torch.tensor([True, False, True])
    model = poptorch.inferenceModel(Fn(lambda x, m: x[m]))
    with pytest.raises(DynamicOutputShapeException):
        model(torch.arange(3.0), mask)
    nonzero = poptorch.inferenceModel(Fn(lambda x: torch.nonzero(x)))
    with pytest.raises(DynamicOutputShapeException):
        nonzero(torch.arange(3.0))

    def assign(x, m):
        x = x.clone()
        x[m] = 0.0
        return x

    assert poptorch.inferenceModel(Fn(assign))(torch.arange(1.0, 4.0), mask).tolist() == [
        0.0,
        2.0,
        0.0,
    ]


def test_multiconv_nested_or_without_a_convolution_is_refused():
    """poptorch/source/PopartLateCanonicalization.cpp ``MultiConvHandler``: "Nested
    poptorch.MultiConv is not supported." and, for a scope with no convolution, "Unexpected
    end_multi_conv"."""
    conv = nn.Conv2d(1, 2, 3)

    def nested(x):
        with poptorch.MultiConv():
            with poptorch.MultiConv():
                return conv(x)

    def empty(x):
        with poptorch.MultiConv():
            return x * 2

    def fine(x):
        with poptorch.MultiConv():
            return conv(x)

    x = torch.ones(1, 1, 5, 5)
    with pytest.raises(poptorch.Error, match="^Nested poptorch.MultiConv is not supported"):
        poptorch.inferenceModel(Fn(nested))(x)
    with pytest.raises(poptorch.Error, match="^Unexpected end_multi_conv"):
        poptorch.inferenceModel(Fn(empty))(x)
    assert torch.allclose(poptorch.inferenceModel(Fn(fine))(x), conv(x))


def test_overlap_marks_only_model_inputs_and_returned_outputs():
    """poptorch/source/OverlappedIO.cpp ``attributiseOverlappedIO``: ``set_overlap_for_input``
    on a tensor that is not a model input, or on an input another op already used, and
    ``set_overlap_for_output`` on a tensor the model does not return (or returns twice) are
    errors when the model compiles."""
    mode = poptorch.OverlapMode.OverlapAccumulationLoop

    def not_input(x):
        return poptorch.set_overlap_for_input(x + 1, mode)

    def used_first(x):
        y = x + 1
        return y, poptorch.set_overlap_for_input(x, mode)

    def not_returned(x):
        return poptorch.set_overlap_for_output(x * 2, mode).mean()

    def twice(x):
        y = poptorch.set_overlap_for_output(x * 2, mode)
        return y, y

    def fine(x):
        x = poptorch.set_overlap_for_input(x, mode)
        return poptorch.set_overlap_for_output(x * 2, mode)

    x = torch.ones(2)
    for fn, message in (
        (not_input, "applied on a node which is not a tensor input"),
        (
            used_first,
            "must be the only op applied to an input. This is not "
            "the case for input 0 to the model",
        ),
        (not_returned, "applied on a node which is not a tensor output"),
        (twice, "cannot be used with a tensor that is returned twice"),
    ):
        with pytest.raises(poptorch.Error, match=message):
            poptorch.inferenceModel(Fn(fn))(x)
    assert poptorch.inferenceModel(Fn(fine))(x).tolist() == [2.0, 2.0]


def test_profiling_warns_that_no_report_is_written(capfd):
    """python/options.py ``enableProfiling`` sets Poplar's ``autoReport`` engine options, for a
    PopVision report of the compiled engine; the emulator has none: the model compiles and runs,
    and the compile says no report is written."""
    opts = poptorch.Options().enableProfiling("reports")
    model = poptorch.inferenceModel(Fn(lambda x: x + 1), opts)
    capfd.readouterr()
    assert model(torch.zeros(2)).tolist() == [1.0, 1.0]
    assert "writes no PopVision report" in capfd.readouterr().err


# -- what PopTorch accepts -----------------------------------------------------------------------


def test_indexing_a_graph_tensor_gives_a_graph_tensor():
    """Indexing an input or weight inside ``forward`` (``x[0]``, ``x[:1]``) gives a device
    tensor that may meet the other device tensors: only host tensors (a legacy constructor, a
    plain attribute) raise PopTorch's "Expected an IPU tensor" (on torch 2.0, whose function
    modes do not see basic indexing, too)."""

    class Index(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.full((3,), 2.0))

        def forward(self, x):
            return x[0] * self.w + x[:1].sum() + self.w[1:].sum()

    x = torch.arange(6.0).reshape(2, 3)
    assert poptorch.inferenceModel(Index())(x).tolist() == [7.0, 9.0, 11.0]


def test_a_loss_that_depends_on_no_trained_weight_trains_nothing():
    """A training model whose loss does not reach any weight that requires grad (an eval-mode
    dropout before an L1 loss, frozen BatchNorm: tests/misc_nn_layers_test.py
    ``test_dropout_eval_during_training``, tests/norms_test.py
    ``test_batchNorm_eval_during_training``) runs on an IPU: no gradients, no update."""

    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.unused = nn.Parameter(torch.ones(3))
            self.fc.requires_grad_(False)

        def forward(self, x, y):
            out = self.fc(x)
            return out, nn.functional.l1_loss(out, y)

    model = Frozen()
    before = [p.detach().clone() for p in model.parameters()]
    train = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    out, loss = train(torch.ones(4, 2), torch.zeros(4, 2))
    assert out.shape == (4, 2) and loss.dim() == 0
    train.copyWeightsToHost()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


def test_copy_weights_to_device_after_training_writes_the_stale_host_weights():
    """python/_poplar_executor.py ``copyWeightsToDevice``: it clears the dirty flag before
    reading the host's parameters ("Don't trigger a copyToHost"), so after training it writes
    the host's weights as they were, and the device forgets the training
    (tests/weights_writing_test.py ``test_weight_overwrite_trained_weight``)."""

    class Lin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x, y):
            out = self.fc(x)
            return out, nn.functional.mse_loss(out, y)

    torch.manual_seed(0)
    model = Lin()
    initial = model.fc.weight.detach().clone()
    train = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    for _ in range(3):
        train(x, y)
    train.copyWeightsToDevice()
    assert torch.equal(model.fc.weight.detach(), initial)  # the host was never synced
    train.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    out, _ = train(x, y)
    assert torch.allclose(out, x @ initial.t() + model.fc.bias.detach())


# -- PopTorch's errors -------------------------------------------------------------------------


def test_errors_have_message_type_and_location():
    """python/poptorch.cpp (class ``Error``) and python/_impl.py ``createPoptorchError``: a
    ``poptorch.Error`` has the string attributes ``message`` (the text), ``type`` (which part
    raised it) and ``location``, as PopTorch's user guide ("Error handling") shows."""
    model = poptorch.inferenceModel(Fn(lambda x: x * 2))
    with pytest.raises(poptorch.Error) as info:
        model.copyWeightsToHost()
    e = info.value
    assert e.message == str(e) and "compiled" in e.message
    assert e.type == "poptorch_py_error" and e.location == ""


@pytest.mark.parametrize(
    "kind,cls,type_,action",
    [
        ("Poptorch", poptorch.Error, "poptorch_cpp_error", None),
        ("Popart", poptorch.Error, "popart_exception", None),
        (
            "PoplarUnrecoverable",
            poptorch.UnrecoverableError,
            "poplar_unrecoverable_runtime_error",
            None,
        ),
        (
            "PoplarRecoverableFullReset",
            poptorch.RecoverableError,
            "poplar_recoverable_runtime_error",
            "FULL_RESET",
        ),
        ("PoplarLinkError", poptorch.Error, "poplar_link_error", None),
    ],
)
def test_throw_test_error_raises_each_category_as_poptorch_reports_it(kind, cls, type_, action):
    """popart_compiler/source/Compiler.cpp ``throwTestError`` and
    poptorch_err/source/ExceptionHandling.cpp: each category's class, ``type``, the two
    contexts in ``location`` (not in ``message``), and a recoverable error's
    ``recovery_action``, so a program can exercise its error handling (user guide,
    error_handling.py)."""
    core = poptorch.poptorch_core
    with pytest.raises(cls) as info:
        core._throwTestError(core.TestErrorType[kind])
    e = info.value
    assert e.type == type_
    assert "throwTestError::topLevel" in e.location and "throwTestError::bottomLevel" in e.location
    assert "throwTestError" not in e.message and "throwTestError::bottomLevel" in str(e)
    if action is not None:
        assert e.recovery_action == action
    if kind == "PoplarLinkError":
        assert "-lfoo not found" in e.message
