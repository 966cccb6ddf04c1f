"""``ipuloop/emulator/examples_utils.py``: examples-utils' ``load_lib`` refuses to build a C++
custom op, naming the file and the way to run without it (the binding: test_emulator_bindings)."""

from __future__ import annotations

import pytest

from ipuloop.emulator import Error
from ipuloop.emulator.examples_utils import load_lib


def test_load_lib_is_refused_naming_the_file_and_the_way_round():
    with pytest.raises(Error) as caught:
        load_lib("/apps/bert/custom_ops/workarounds/residual_add_inplace_pattern.cpp")
    message = str(caught.value)
    assert message.startswith(
        "examples_utils.load_lib('residual_add_inplace_pattern.cpp'): C++ custom ops"
    )
    assert message.endswith("(e.g. --custom-ops False).")
