"""device/anchors.py: what a host call hands back, in closed form: a forward's outputs as
leaves and back, the host's types (no 64-bit ones), the rows of a call put together, and
dict subclasses taken apart by their keys."""

from __future__ import annotations

from collections import OrderedDict

import torch

from ipuloop.emulator.device import anchors


def test_out_leaves_and_back_for_a_tensor_a_tuple_and_a_structure():
    t = torch.ones(2)
    assert anchors.out_leaves(t) == ([t], None)
    assert anchors.out_unflatten([t], None) is t
    leaves, spec = anchors.out_leaves((t, t + 1))
    assert spec == 2 and anchors.out_unflatten(leaves, spec) == (leaves[0], leaves[1])
    out = {"loss": t, "parts": [t + 1, "name"]}
    leaves, spec = anchors.out_leaves(out)
    assert len(leaves) == 3  # (a string is a leaf of the structure too)
    back = anchors.out_unflatten(leaves, spec)
    assert back["parts"][1] == "name" and torch.equal(back["parts"][0], t + 1)


def test_to_host_narrows_64_bit_types():
    assert anchors.to_host(torch.tensor([1, 2])).dtype == torch.int32
    assert anchors.to_host(torch.tensor([1.5], dtype=torch.float64)).dtype == torch.float32
    half = torch.ones(1, dtype=torch.float16)
    assert anchors.to_host(half) is half
    assert anchors.NARROWED == {torch.int64, torch.float64}


def test_assemble_stacks_scalars_and_concatenates_tensors_row_by_row():
    rows = [
        [torch.tensor(1.0), torch.tensor([[1, 2]]), "first"],
        [torch.tensor(2.0), torch.tensor([[3, 4]]), "second"],
    ]
    _, spec = anchors.out_leaves((torch.tensor(0.0), torch.zeros(1, 2), "x"))
    loss, outs, name = anchors.assemble(rows, [True, True, False], spec)
    assert torch.equal(loss, torch.tensor([1.0, 2.0]))
    assert torch.equal(outs, torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    assert name == "first"  # a non-tensor comes from the first row


def test_one_row_is_returned_as_it_is_on_the_host():
    x = torch.tensor([5, 6])
    got = anchors.assemble([[x]], [True], None)
    assert got.dtype == torch.int32 and got.tolist() == [5, 6]


class Output(OrderedDict):
    """A dict subclass as libraries return (a Transformers ``ModelOutput``)."""


def test_a_dict_subclass_is_registered_and_rebuilt_with_its_type():
    out = Output(logits=torch.ones(1), hidden=(torch.zeros(1), Output(last=torch.ones(2))))
    anchors.register_mappings(out)
    leaves, spec = anchors.out_leaves(out)
    assert len(leaves) == 3
    back = anchors.out_unflatten([x * 2 for x in leaves], spec)
    assert type(back) is Output and type(back["hidden"][1]) is Output
    assert torch.equal(back["hidden"][1]["last"], torch.full((2,), 2.0))
