"""device/print_format.py: Poplar's tensor print format as ``ipu_print_tensor`` lays it out,
in closed form (the arguments' defaults are ``ipu_print_tensor``'s)."""

from __future__ import annotations

import math

import pytest
import torch

from ipuloop.emulator.device.print_format import PrintFormat, format_tensor

DEFAULTS = {
    "summarise_threshold": 1000,
    "edge_items": 3,
    "max_line_width": 80,
    "digits": 4,
    "float_format": "auto",
    "separator": ", ",
    "open_bracket": "(",
    "close_bracket": ")",
}


def fmt(**changes) -> PrintFormat:
    return PrintFormat(**{**DEFAULTS, **changes})


def show(t: torch.Tensor, **changes) -> str:
    return format_tensor(t, fmt(**changes))


def test_integers_right_aligned_to_one_width():
    assert show(torch.tensor([1, 2, 3])) == "(1, 2, 3)"
    assert show(torch.tensor([1, 10, -5])) == "( 1, 10, -5)"
    assert show(torch.tensor(7)) == "7"
    assert show(torch.tensor([True, False])) == "(1, 0)"


def test_rows_one_per_line_indented_by_depth():
    assert show(torch.tensor([[1, 2], [3, 4]])) == "(\n (1, 2)\n (3, 4)\n)"


def test_summarised_above_the_threshold_with_edge_items_at_each_end():
    assert show(torch.arange(10), summarise_threshold=5, edge_items=2) == "(0, 1, ..., 8, 9)"
    assert show(torch.arange(5), summarise_threshold=0) == "(0, 1, 2, 3, 4)"  # 0: off


def test_floats_fixed_with_digits_significant_for_the_largest():
    assert show(torch.tensor([1.5, 2.25])) == "(1.500, 2.250)"
    assert show(torch.tensor([12.5, 100.0])) == "( 12.5, 100.0)"


def test_floats_scientific_where_magnitudes_need_an_exponent():
    assert show(torch.tensor([1e9, 2.0])) == "(1.000e+09, 2.000e+00)"
    assert show(torch.tensor([1.0, 2.0]), float_format="scientific") == "(1.000e+00, 2.000e+00)"


def test_non_finite_values_and_digits_zero():
    t = torch.tensor([1.0, math.nan, math.inf, -math.inf])
    assert show(t) == "(1.000,   nan,   inf,  -inf)"
    assert show(torch.tensor([1.5, 10.0]), digits=0) == "(1.5, 10)"  # each on its own


def test_lines_wrap_at_max_line_width():
    assert show(torch.arange(6), max_line_width=10) == "(0, 1, 2, \n  3, 4, 5)"


def test_separator_and_brackets():
    assert show(torch.tensor([1, 2, 3]), separator=" ", open_bracket="[", close_bracket="]") == (
        "[1 2 3]"
    )


@pytest.mark.parametrize(
    "changes,error",
    [
        ({"edge_items": -1}, ValueError),
        ({"digits": True}, TypeError),
        ({"max_line_width": 1.5}, TypeError),
        ({"float_format": "hex"}, ValueError),
        ({"separator": 1}, TypeError),
        ({"close_bracket": None}, TypeError),
    ],
)
def test_arguments_are_checked(changes, error):
    with pytest.raises(error, match="ipu_print_tensor: "):
        fmt(**changes)
