"""Emulator fidelity: PopTorch's device ops whose behaviour is more than torch's math.

``dynamic_slice`` / ``dynamic_update`` (a start tensor read when the device runs, the
compiler's size checks), ``cond`` (on-device if/else: both branches in the graph, inference
only) and ``ipu_print_tensor``'s formatting arguments. Each test cites the PopTorch 3.4 source
that defines the behaviour; expected values are plain torch doing the same math.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

import ipuloop.emulator as poptorch


class Fn(nn.Module):
    """A model whose forward is ``fn``."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


# -- dynamic_slice / dynamic_update ------------------------------------------------------------


def test_dynamic_slice_reads_its_start_when_the_device_runs_and_keeps_every_step_th():
    """python/ops.py ``dynamic_slice`` lowers to a PopART DynamicSlice of ``size`` elements
    along ``dim`` whose start is a device tensor (SliceOps.cpp ``dynamicSliceHandler``),
    subsampled by ``step`` (``subsampleSlice``): a model compiled with one start (here out of
    range, as PopTorch's own tests compile it) slices at the start each run gives."""
    t = torch.arange(8.0)
    model = poptorch.inferenceModel(Fn(lambda x, s: poptorch.dynamic_slice(x, 0, s, 4, 2)))
    model.compile(t, torch.tensor([21]))
    assert model(t, torch.tensor([4])).tolist() == t[4:8:2].tolist()
    assert model(t, torch.tensor([0])).tolist() == t[0:4:2].tolist()
    t2 = torch.arange(24.0).reshape(2, 12)
    inner = poptorch.inferenceModel(Fn(lambda x, s: poptorch.dynamic_slice(x, 1, s, 3, 1)))
    inner.compile(t2, torch.tensor([20]))
    assert torch.equal(inner(t2, torch.tensor([6])), t2[:, 6:9])


def test_dynamic_slice_start_out_of_range_reads_from_zero_and_wraps():
    """The start is cast to UINT32 (SliceOps.cpp ``dynamicSliceHandler``) and PopLibs' dynamic
    slice reads an offset beyond the dimension as 0 and wraps at its end: a compile whose
    example start is out of range succeeds, as on an IPU."""
    t = torch.arange(8.0) * 10
    model = poptorch.inferenceModel(Fn(lambda x, s: poptorch.dynamic_slice(x, 0, s, 4, 1)))
    assert model(t, torch.tensor([21])).tolist() == t[0:4].tolist()
    assert model(t, torch.tensor([-1])).tolist() == t[0:4].tolist()
    assert model(t, torch.tensor([6])).tolist() == t[[6, 7, 0, 1]].tolist()


@pytest.mark.parametrize(
    "size,message",
    [
        (0, r"^The start and end of a slice must be different\.$"),
        (-2, r"^Taking a slice of a tensor with the end less than the start is not supported\.$"),
        (3, r"^The size of the slice \(3\) must be a factor of the slicing dimension \(8\)\.$"),
    ],
)
def test_dynamic_slice_size_checks_when_compiled(size, message):
    """SliceOps.cpp ``ptDynamicSliceHandler`` / ``dynamicSliceHandler``: the size must be
    positive and divide the sliced dimension, checked when the model is compiled."""
    model = poptorch.inferenceModel(Fn(lambda x, s: poptorch.dynamic_slice(x, 0, s, size, 1)))
    with pytest.raises(poptorch.Error, match=message):
        model.compile(torch.arange(8.0), torch.tensor([1]))
    assert not model.isCompiled()


def test_dynamic_slice_step_below_one_is_refused_when_compiled():
    """SliceOps.cpp ``ptDynamicSliceHandler``: "Slicing step must be at least 1"."""
    model = poptorch.inferenceModel(Fn(lambda x, s: poptorch.dynamic_slice(x, 0, s, 4, 0)))
    with pytest.raises(poptorch.Error, match="^Slicing step must be at least 1$"):
        model(torch.arange(8.0), torch.tensor([1]))


def test_dynamic_slice_on_the_host_is_torch_slicing_from_an_integer_start():
    """RegisterAtenOverloads.cpp ``dynamicSlice`` (the CPU kernel): ``at::slice`` from the
    start tensor's first element, which must be an integer tensor; no factor check."""
    t = torch.arange(8.0)
    assert poptorch.dynamic_slice(t, 0, torch.tensor([5]), 3, 1).tolist() == [5.0, 6.0, 7.0]
    assert (
        poptorch.dynamic_slice(t, 0, torch.tensor([1], dtype=torch.int32), 6, 2).tolist()
        == t[1:7:2].tolist()
    )
    with pytest.raises(poptorch.Error, match="^Expected integer typed start tensor$"):
        poptorch.dynamic_slice(t, 0, torch.tensor([1.0]), 2, 1)


def test_dynamic_update_writes_src_at_the_start_read_when_the_device_runs():
    """python/ops.py ``dynamic_update``: a copy of ``input`` with ``src`` at ``start`` along
    ``dim`` (SliceOps.cpp ``dynamicUpdateHandler``); the input is not written in place."""
    t, src = torch.ones(3, 4, 5), -torch.ones(3, 2, 5)
    model = poptorch.inferenceModel(Fn(lambda x, s, i: poptorch.dynamic_update(x, s, 1, i, 2)))
    model.compile(torch.randn(3, 4, 5), torch.randn(3, 2, 5), torch.tensor([21]))
    expected = t.clone()
    expected[:, 1:3] = -1
    assert torch.equal(model(t, src, torch.tensor([1])), expected)
    assert torch.equal(t, torch.ones(3, 4, 5))
    # on the host: torch.slice_scatter
    assert torch.equal(poptorch.dynamic_update(t, src, 1, torch.tensor([1]), 2), expected)


def test_dynamic_update_checks_dtype_as_the_device_holds_it_and_the_size():
    """python/ops.py ``dynamic_update`` compares dtypes of the traced tensors: on the IPU an
    int64 input is int32, so the message names torch.int32; SliceOps.cpp
    ``ptDynamicUpdateHandler`` refuses a zero size."""
    idx = torch.tensor([1])
    model = poptorch.inferenceModel(Fn(lambda x, s: poptorch.dynamic_update(x, s, 0, idx, 1)))
    with pytest.raises(
        poptorch.Error,
        match=r"^input and src tensor must have same dtype\. "
        r"\(torch\.float32 vs torch\.int32\)$",
    ):
        model.compile(torch.zeros(4), torch.tensor([-1]))
    with pytest.raises(
        poptorch.Error,
        match=r"^input and src tensors must have same "
        r"dimensionality\. \(2\) vs \(1\)$",
    ):
        poptorch.dynamic_update(torch.zeros(2, 4), torch.zeros(4), 0, idx, 1)
    empty = poptorch.inferenceModel(Fn(lambda x, s: poptorch.dynamic_update(x, s, 0, idx, 0)))
    with pytest.raises(poptorch.Error, match=r"^The start and end of a slice must be different"):
        empty(torch.zeros(4), torch.zeros(1))
    wrong = poptorch.inferenceModel(Fn(lambda x, s: poptorch.dynamic_update(x, s, 0, idx, 2)))
    with pytest.raises(poptorch.Error, match=r"size=2 .* src has 1"):
        wrong(torch.zeros(4), torch.zeros(1))


# -- cond --------------------------------------------------------------------------------------


class Branchy(nn.Module):
    """then: x + y and x * y from the outer graph; else: its input minus y."""

    def forward(self, condition, x, y):
        return poptorch.cond(condition, lambda: (x + y, x * y), [], lambda a: (a - y, a), [x])


def test_cond_takes_the_branch_its_condition_tensor_selects_at_each_run():
    """python/ops.py ``cond``: the condition is a device tensor, so one compiled model takes
    either branch; outer tensors are usable in the bodies; the result is a list."""
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    model = poptorch.inferenceModel(Branchy())
    out = model(torch.tensor([True]), x, y)
    assert isinstance(out, list) and [o.tolist() for o in out] == [[4.0, 7.0], [3.0, 10.0]]
    out = model(torch.tensor([False]), x, y)
    assert [o.tolist() for o in out] == [[-2.0, -3.0], [1.0, 2.0]]
    # outside a wrapped model it is Python's if
    assert [o.tolist() for o in Branchy()(torch.tensor([False]), x, y)] == [
        [-2.0, -3.0],
        [1.0, 2.0],
    ]


def test_cond_nested_and_with_inputs_passed_by_value():
    """python/ops.py ``cond``: bodies receive their inputs by copy (an in-place edit in a body
    leaves the caller's tensor alone) and may contain another cond."""

    def forward(c1, c2, x):
        def then_body(a):
            a.mul_(10)  # a copy: x is unchanged outside
            return poptorch.cond(c2, lambda b: b + 1, [a], lambda b: b - 1, [a])[0]

        out = poptorch.cond(c1, then_body, [x], lambda b: b * 0, [x])[0]
        return out, x

    model = poptorch.inferenceModel(Fn(forward))
    x = torch.tensor([1.0, 2.0])
    out, x_after = model(torch.tensor([True]), torch.tensor([False]), x)
    assert out.tolist() == [9.0, 19.0] and x_after.tolist() == [1.0, 2.0]
    out, _ = model(torch.tensor([False]), torch.tensor([True]), x)
    assert out.tolist() == [0.0, 0.0]


def test_cond_and_for_loop_in_a_training_model_are_refused_when_compiled():
    """popart_compiler/source/Compiler.cpp ``Compiler::endIfBlock`` / ``endForLoop``:
    "poptorch.cond() is only supported in inference." (and the same for for_loop)."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, condition, x):
            out = poptorch.cond(condition, self.fc, [x], self.fc, [x])[0]
            return out, poptorch.identity_loss(out, reduction="sum")

    model = poptorch.trainingModel(Model())
    with pytest.raises(
        poptorch.Error,
        match=r"^poptorch\.cond\(\) is only supported in "
        r"inference\.",
    ):
        model(torch.tensor([True]), torch.ones(1, 4))

    class Looping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x):
            out = poptorch.for_loop(2, lambda a: a * self.w, [x])[0]
            return out, poptorch.identity_loss(out, reduction="sum")

    with pytest.raises(poptorch.Error, match=r"^poptorch\.for_loop\(\) is only supported"):
        poptorch.trainingModel(Looping())(torch.ones(2))


def test_cond_then_output_takes_the_else_shape_and_a_scalar_else_output_is_refused():
    """poptorch/source/AddSubgraphConnectionNodes.cpp ``markCondOutputs``: a then output of
    another shape is reshaped to the else output's shape; an else output with an empty shape
    (0-dimensional) is an error."""
    reshaped = poptorch.inferenceModel(
        Fn(lambda c, x: poptorch.cond(c, lambda: x.reshape(2, 2), [], lambda: x + 1, [])[0])
    )
    assert reshaped(torch.tensor([True]), torch.arange(4.0)).tolist() == [0.0, 1.0, 2.0, 3.0]
    scalar = poptorch.inferenceModel(
        Fn(lambda c, x: poptorch.cond(c, lambda: x.sum(), [], lambda: x.mean(), [])[0])
    )
    with pytest.raises(poptorch.Error, match="^`else` branch output has an empty shape"):
        scalar(torch.tensor([True]), torch.arange(4.0))


def test_cond_branches_must_return_as_many_tensors_of_the_same_dtypes():
    """python/ops.py ``cond``: "then_body and else_body have to return the same number of
    corresponding outputs" (an ONNX If's outputs have one type per position)."""
    count = poptorch.inferenceModel(
        Fn(lambda c, x: poptorch.cond(c, lambda: (x, x), [], lambda: x, []))
    )
    with pytest.raises(poptorch.Error, match="then_body returns 2 output.* else_body 1"):
        count(torch.tensor([True]), torch.ones(2))
    dtype = poptorch.inferenceModel(
        Fn(lambda c, x: poptorch.cond(c, lambda: x, [], lambda: x.int(), []))
    )
    with pytest.raises(poptorch.Error, match="torch.float32 in then_body and torch.int32"):
        dtype(torch.tensor([True]), torch.ones(2))
    with pytest.raises(ValueError, match="to be a list of tensors"):
        poptorch.cond(torch.tensor([True]), lambda a: a, (torch.ones(1),), lambda a: a, [])


def test_cond_random_draws_are_the_taken_branchs():
    """Only the taken branch runs on the device at run time: the random draws that follow a
    cond are those after the taken branch's, as if the other branch did not exist."""

    def with_cond(c, x):
        out = poptorch.cond(
            c, lambda: x + torch.rand(3), [], lambda: x - torch.rand(5).narrow(0, 0, 3), []
        )
        return out[0], torch.rand(2)

    def only_then(c, x):
        return x + torch.rand(3), torch.rand(2)

    opts = poptorch.Options().randomSeed(7)
    a = poptorch.inferenceModel(Fn(with_cond), opts)(torch.tensor([True]), torch.zeros(3))
    b = poptorch.inferenceModel(Fn(only_then), opts)(torch.tensor([True]), torch.zeros(3))
    assert all(torch.equal(p, q) for p, q in zip(a, b))


# -- ipu_print_tensor --------------------------------------------------------------------------


def _printed(capfd, model, *args) -> str:
    capfd.readouterr()
    model(*args)
    return capfd.readouterr().err


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (
            dict(
                summarise_threshold=1000,
                edge_items=3,
                max_line_width=75,
                digits=8,
                float_format="auto",
                separator=" ",
                open_bracket="{",
                close_bracket="}",
            ),
            "t: {\n {1.4962566 1.7682219}\n {1.0884774 1.1320305}\n}",
        ),
        (
            dict(
                summarise_threshold=500,
                edge_items=2,
                max_line_width=15,
                digits=8,
                float_format="scientific",
                separator=",",
                open_bracket="[",
                close_bracket="]",
            ),
            "t: [\n [1.4962566e+00,\n   1.7682219e+00]\n [1.0884774e+00,\n   1.1320305e+00]\n]",
        ),
        (
            dict(
                summarise_threshold=1500,
                edge_items=1,
                max_line_width=125,
                digits=8,
                float_format="fixed",
                separator=";",
                open_bracket="(",
                close_bracket=")",
            ),
            "t: (\n (1.4962566;1.7682219)\n (1.0884774;1.1320305)\n)",
        ),
    ],
)
def test_ipu_print_tensor_formats_as_poplar_prints(capfd, kwargs, expected):
    """python/ops.py ``ipu_print_tensor``: the formatting arguments of Poplar's
    ``PrintTensorFmt`` (digits, float format, separator, brackets, line width), printed on
    stderr; the strings are the ones PopTorch's tests/ipu_print_tensor_test.py expects."""
    torch.manual_seed(0)
    x = torch.rand(2, 2)
    model = poptorch.inferenceModel(Fn(lambda a: poptorch.ipu_print_tensor(a + 1, "t", **kwargs)))
    assert expected in _printed(capfd, model, x)


def test_ipu_print_tensor_summarises_large_tensors_and_can_skip_the_gradient(capfd):
    """python/ops.py ``ipu_print_tensor``: more than ``summarise_threshold`` elements print
    ``edge_items`` at each end of each dimension; ``print_gradient=False`` prints no gradient
    in the backward pass."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            y = poptorch.ipu_print_tensor(
                x * self.w,
                "big",
                False,
                summarise_threshold=10,
                edge_items=1,
                digits=0,
                separator=" ",
            )
            return y, poptorch.identity_loss(y, reduction="sum")

    err = _printed(capfd, poptorch.trainingModel(Model()), torch.arange(16.0).reshape(4, 4))
    assert "big: (\n (0 ... 3)\n ...\n (12 ... 15)\n)" in err
    assert "big_gradient" not in err


# -- ctc_beam_search_decoder -------------------------------------------------------------------


def _labelling_log_probs(log_probs: torch.Tensor, blank: int) -> dict:
    """Brute force: the log probability of each labelling, summed over every alignment (a
    path of classes, one per step) that collapses to it (repeats merged, then blanks
    dropped)."""
    steps, classes = log_probs.shape
    totals: dict = {}
    for path in itertools.product(range(classes), repeat=steps):
        merged = [c for i, c in enumerate(path) if i == 0 or c != path[i - 1]]
        labels = tuple(c for c in merged if c != blank)
        p = math.exp(sum(float(log_probs[t, c]) for t, c in enumerate(path)))
        totals[labels] = totals.get(labels, 0.0) + p
    return {k: math.log(v) for k, v in totals.items()}


def test_ctc_beam_search_decoder_finds_the_most_likely_labellings():
    """python/ops.py ``ctc_beam_search_decoder``: on the device, the ``top_paths`` most likely
    labellings of each sequence's first ``lengths[b]`` steps (PopLibs' CTC beam search, as
    TensorFlow's): their log probabilities [B, top_paths], lengths [B, top_paths] and labels
    [B, top_paths, T] zero-padded. With a beam wide enough to keep every prefix the search is
    exact: it matches summing every alignment. Outside a wrapped model it is PopTorch's CPU
    kernel, zeros of those shapes (RegisterAtenOverloads.cpp ``ctcBeamSearchDecoder``)."""
    torch.manual_seed(0)
    log_probs = torch.randn(4, 2, 3).log_softmax(-1)
    lengths = torch.tensor([4, 3], dtype=torch.int32)
    model = poptorch.inferenceModel(
        Fn(
            lambda p, n: poptorch.ctc_beam_search_decoder(
                p, n, blank=0, beam_width=100, top_paths=2
            )
        )
    )
    probs, lens, paths = model(log_probs, lengths)
    assert probs.shape == (2, 2) and lens.shape == (2, 2) and paths.shape == (2, 2, 4)
    for b in range(2):
        exact = _labelling_log_probs(log_probs[: int(lengths[b]), b], blank=0)
        best = sorted(exact.items(), key=lambda kv: -kv[1])[:2]
        for k, (labels, score) in enumerate(best):
            assert int(lens[b, k]) == len(labels)
            assert tuple(paths[b, k, : len(labels)].tolist()) == labels
            assert not paths[b, k, len(labels) :].any()
            assert float(probs[b, k]) == pytest.approx(score, abs=1e-5)
    host = poptorch.ctc_beam_search_decoder(log_probs, lengths, top_paths=2)
    assert [t.shape for t in host] == [(2, 2), (2, 2), (2, 2, 4)]
    assert not any(t.any() for t in host)
    with pytest.raises(poptorch.Error, match="^Incorrect shape for first input to CTC beam"):
        poptorch.ctc_beam_search_decoder(log_probs[0], lengths)
