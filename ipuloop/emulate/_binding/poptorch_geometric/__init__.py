"""``import poptorch_geometric`` under ``python -m ipuloop.emulate``: PopTorch Geometric where it is
installed elsewhere on the module path, else an import error saying why it is not emulated."""

from __future__ import annotations

import importlib.util
import os
import sys

if importlib.util.find_spec("ipuloop") is None:  # e.g. a subprocess in another folder
    # the folder that holds ipuloop/ (this file: ipuloop/emulate/_binding/*/__init__.py)
    sys.path.append(os.path.abspath(os.path.join(__file__, *[os.pardir] * 5)))

from ipuloop.emulate import stand_in  # (the path above first)

stand_in(
    "poptorch_geometric",
    None,
    refused=(
        "poptorch_geometric is not emulated: PopTorch Geometric ships with the Poplar SDK "
        "(its fixed-size batching, its ops compiled for IPUs), and ipuloop's emulator offers "
        "only PopTorch's API: run such a program on an IPU system with the SDK."
    ),
)
