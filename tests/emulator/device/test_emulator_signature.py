"""device/signature.py: a wrapped model's arguments bound and matched as PopTorch's argument
parser does, on plain functions: binding (defaults, keywords, ``*args``, ``**kwargs``), the
tensors of a structure in order, and each kind of mismatch with PopTorch's words."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from ipuloop.emulator.device.signature import Signature, unflatten
from ipuloop.emulator.errors import Error


def forward(x, y=None, scale=2):
    return x


def test_positional_tensors_take_the_shortcut_spec():
    x, y = torch.ones(2, 3), torch.zeros(2)
    sig = Signature(forward, (x, y), {})
    # the default fills scale, which is no tensor: the template rebuilds the call
    assert sig.spec is sig and sig.names == ["x", "y", "scale"] and sig.fast is None
    sig2 = Signature(lambda a, b: a, (x, y), {})
    assert sig2.spec == 2 and sig2.fast == [(x.shape, x.dtype), (y.shape, y.dtype)]
    assert sig2.check((x, y), {}) == [x, y]
    assert unflatten([x, y], sig2.spec) == ((x, y), {})


def test_a_keyword_naming_a_parameter_is_bound_in_its_place():
    x, y = torch.ones(2), torch.zeros(2)
    sig = Signature(forward, (x,), {"y": y})
    assert sig.names == ["x", "y", "scale"]
    leaves = sig.check((x,), {"y": y})
    assert leaves == [x, y]
    assert sig.unflatten(leaves) == ((x, y, 2), {})


def test_structures_give_their_tensors_in_order_and_rebuild_with_their_types():
    def f(batch, extra):
        return batch

    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 5.0)
    batch = OrderedDict([("b", b), ("a", a)])
    sig = Signature(f, (batch, [c, "tag"]), {})
    leaves = sig.check((batch, [c, "tag"]), {})
    assert leaves == [b, a, c]
    args, kwargs = sig.unflatten([b * 2, a * 2, c * 2])
    assert type(args[0]) is OrderedDict and list(args[0]) == ["b", "a"]
    assert torch.equal(args[0]["a"], a * 2) and args[1][1] == "tag" and kwargs == {}


def test_star_args_and_kwargs():
    def f(x, *rest, **extra):
        return x

    x = torch.ones(1)
    sig = Signature(f, (x, x + 1, x + 2), {"k": x + 3})
    assert sig.names == ["x", "*rest[0]", "*rest[1]"]
    args, kwargs = sig.unflatten(sig.check((x, x + 1, x + 2), {"k": x + 3}))
    assert [float(a) for a in args] == [1.0, 2.0, 3.0] and float(kwargs["k"]) == 4.0


@pytest.mark.parametrize(
    "call,match",
    [
        (((torch.ones(2, dtype=torch.float64),), {}), "Data type mismatch for x"),
        (((torch.ones(3),), {}), "Shape mismatch for x"),
        (((torch.ones(2), None, 3), {}), "Value mismatch for scale: expected 2 but got 3"),
        (((torch.ones(2), torch.ones(2)), {}), "Type mismatch for y"),
        (((torch.ones(2), None, 2, 4), {}), "Too many arguments provided"),
    ],
)
def test_a_later_call_must_match_the_compiled_one(call, match):
    sig = Signature(forward, (torch.ones(2),), {})
    with pytest.raises((Error, AssertionError), match=match) as info:
        sig.check(*call)
    if "Too many" not in match:
        assert "don't match the inputs used to compile" in str(info.value)


def test_dict_keys_must_match_in_any_order():
    def f(d):
        return d

    sig = Signature(f, ({"a": torch.ones(1), "b": torch.ones(1)},), {})
    sig.check(({"b": torch.ones(1), "a": torch.ones(1)},), {})
    with pytest.raises(Error, match="Keys mismatch for d: Unexpected arguments: c. Missing"):
        sig.check(({"a": torch.ones(1), "c": torch.ones(1)},), {})


def test_a_missing_mandatory_parameter_and_zero_sized_inputs_are_refused():
    with pytest.raises(Error, match="Mandatory parameter x missing"):
        Signature(forward, (), {})
    with pytest.raises(Error, match=r"Zero-sized tensors are unsupported \(Got shape \[0, 2\]\)"):
        Signature(forward, (torch.ones(0, 2),), {})


def test_keyword_only_parameters_before_star_args_are_refused_with_why():
    def f(x, *, flag=False):
        return x

    with pytest.raises(TypeError, match="keyword-only parameter"):
        Signature(f, (torch.ones(1),), {})
