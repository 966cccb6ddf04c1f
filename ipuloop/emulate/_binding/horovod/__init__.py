"""``import horovod.torch`` under ``python -m ipuloop.emulate``: the host-side collectives over
the instances' process group (``ipuloop.emulator.horovod``); a Horovod installed elsewhere on
the module path is imported in its place."""

from __future__ import annotations

import importlib.util
import os
import sys

if importlib.util.find_spec("ipuloop") is None:  # e.g. a subprocess in another folder
    # the folder that holds ipuloop/ (this file: ipuloop/emulate/_binding/*/__init__.py)
    sys.path.append(os.path.abspath(os.path.join(__file__, *[os.pardir] * 5)))

from ipuloop.emulate import stand_in  # (the path above first)

stand_in("horovod", None, {"torch": "ipuloop.emulator.horovod"})
