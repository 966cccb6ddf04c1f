"""``import examples_utils`` under ``python -m ipuloop.emulate``: Graphcore's examples-utils where
it is installed elsewhere on the module path, else the emulator's ``load_lib``, which refuses to
build a C++ custom op and says what to run instead."""

from __future__ import annotations

import importlib.util
import os
import sys

if importlib.util.find_spec("ipuloop") is None:  # e.g. a subprocess in another folder
    # the folder that holds ipuloop/ (this file: ipuloop/emulate/_binding/*/__init__.py)
    sys.path.append(os.path.abspath(os.path.join(__file__, *[os.pardir] * 5)))

from ipuloop.emulate import stand_in  # (the path above first)

stand_in("examples_utils", "ipuloop.emulator.examples_utils")
