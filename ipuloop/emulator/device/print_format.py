"""How ``ipu_print_tensor`` lays out a tensor: Poplar's print format (its ``PrintTensorFmt``:
summarising, line width, digits, float format, separator and brackets)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

__all__ = ["FLOAT_FORMATS", "PrintFormat", "format_tensor"]

FLOAT_FORMATS = ("auto", "fixed", "scientific", "none")
_ELLIPSIS = "..."


class PrintFormat:
    """The formatting arguments of ``poptorch.ipu_print_tensor``, checked (their defaults are
    its signature's)."""

    __slots__ = (
        "summarise_threshold",
        "edge_items",
        "max_line_width",
        "digits",
        "float_format",
        "separator",
        "open_bracket",
        "close_bracket",
    )

    def __init__(
        self,
        summarise_threshold: int,
        edge_items: int,
        max_line_width: int,
        digits: int,
        float_format: str,
        separator: str,
        open_bracket: str,
        close_bracket: str,
    ) -> None:
        for name, value in (
            ("summarise_threshold", summarise_threshold),
            ("edge_items", edge_items),
            ("max_line_width", max_line_width),
            ("digits", digits),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"ipu_print_tensor: {name} must be an int. Received: {name}={value!r}."
                )
            if value < 0:
                raise ValueError(
                    f"ipu_print_tensor: {name} must be >= 0 (0 turns it off). "
                    f"Received: {name}={value!r}."
                )
        if float_format not in FLOAT_FORMATS:
            raise ValueError(
                f"ipu_print_tensor: float_format must be one of {FLOAT_FORMATS}. "
                f"Received: float_format={float_format!r}."
            )
        for name, text in (
            ("separator", separator),
            ("open_bracket", open_bracket),
            ("close_bracket", close_bracket),
        ):
            if not isinstance(text, str):
                raise TypeError(
                    f"ipu_print_tensor: {name} must be a str. Received: {name}={text!r}."
                )
        self.summarise_threshold = summarise_threshold
        self.edge_items = edge_items
        self.max_line_width = max_line_width
        self.digits = digits
        self.float_format = float_format
        self.separator = separator
        self.open_bracket = open_bracket
        self.close_bracket = close_bracket


def _kept(n: int, edge: int, summarise: bool) -> list[int | None]:
    """The indices of a dimension of size ``n`` that are printed; None stands for the
    elided middle."""
    if summarise and n > 2 * edge:
        return [*range(edge), None, *range(n - edge, n)]
    return list(range(n))


def _printed_values(t: torch.Tensor, edge: int, summarise: bool) -> list[Any]:
    """The values that appear in the output (what the element format is chosen from)."""
    if t.dim() == 0:
        return [t.item()]
    out: list[Any] = []
    for i in _kept(t.shape[0], edge, summarise):
        if i is not None:
            out.extend(_printed_values(t[i], edge, summarise))
    return out


def _float_formatter(values: Sequence[float], fmt: PrintFormat):
    """One function formatting every float element alike (the format chosen from the printed
    values, as the "auto" analysis does), or each on its own ("none", or digits=0)."""
    digits = fmt.digits
    if digits == 0 or fmt.float_format == "none":
        precision = digits if digits else 6
        return lambda v: _special(v) or f"{v:.{precision}g}"
    finite = [abs(v) for v in values if math.isfinite(v)]
    style = fmt.float_format
    if style == "auto":
        nonzero = [v for v in finite if v != 0.0]
        big, small = (max(nonzero), min(nonzero)) if nonzero else (0.0, 0.0)
        # fixed notation unless the magnitudes need an exponent to keep ``digits`` digits
        style = (
            "scientific"
            if nonzero and (big >= 1e8 or small < 1e-4 or big / small > 1e3)
            else "fixed"
        )
    if style == "scientific":
        return lambda v: _special(v) or f"{v:.{max(digits - 1, 0)}e}"
    # fixed: ``digits`` significant digits for the largest magnitude
    biggest = max(finite, default=0.0)
    int_digits = len(str(int(biggest))) if biggest >= 1 else 1
    decimals = max(digits - int_digits, 0)
    return lambda v: _special(v) or f"{v:.{decimals}f}"


def _special(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return ""


def format_tensor(t: torch.Tensor, fmt: PrintFormat) -> str:
    """``t`` as Poplar prints it: nested brackets, one line per innermost row (wrapped at
    ``max_line_width``), rows indented by depth; summarised (``edge_items`` at each end of
    each dimension, ``...`` between) when it has more than ``summarise_threshold`` elements;
    elements right-aligned to one width unless ``digits`` is 0."""
    t = t.detach().cpu()
    if t.dtype == torch.bool:
        t = t.to(torch.int32)  # printed as 1 and 0
    summarise = 0 < fmt.summarise_threshold < t.numel()
    values = _printed_values(t, fmt.edge_items, summarise)
    if t.is_floating_point():
        one = _float_formatter(values, fmt)
    else:
        one = str
    width = max((len(one(v)) for v in values), default=0) if fmt.digits else 0

    def element(v: Any) -> str:
        return one(v).rjust(width)

    def row(sub: torch.Tensor, indent: int) -> str:
        items = [
            _ELLIPSIS.rjust(width) if i is None else element(sub[i].item())
            for i in _kept(sub.shape[0], fmt.edge_items, summarise)
        ]
        lines: list[str] = []
        line = " " * indent + fmt.open_bracket + (items[0] if items else "")
        continuation = " " * (indent + len(fmt.open_bracket) + 1)
        for k, item in enumerate(items[1:], start=1):
            tail = fmt.close_bracket if k == len(items) - 1 else ""
            if (
                fmt.max_line_width
                and len(line) + len(fmt.separator) + len(item) + len(tail) > fmt.max_line_width
            ):
                lines.append(line + fmt.separator)
                line = continuation + item
            else:
                line += fmt.separator + item
        lines.append(line + fmt.close_bracket)
        return "\n".join(lines)

    def block(sub: torch.Tensor, indent: int) -> str:
        if sub.dim() == 1:
            return row(sub, indent)
        inner = [
            " " * (indent + 1) + _ELLIPSIS if i is None else block(sub[i], indent + 1)
            for i in _kept(sub.shape[0], fmt.edge_items, summarise)
        ]
        return "\n".join(
            [" " * indent + fmt.open_bracket, *inner, " " * indent + fmt.close_bracket]
        )

    if t.dim() == 0:
        return element(t.item())
    return block(t, 0)
