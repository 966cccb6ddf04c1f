"""``import horovod.torch`` under ``python -m ipuloop.emulate``: the host-side collectives over
the instances' process group (``ipuloop.emulator.horovod``); a Horovod installed elsewhere on
the module path is imported in its place."""

from __future__ import annotations

import importlib.util
import os
import sys

if importlib.util.find_spec("ipuloop") is None:  # e.g. a subprocess in another folder
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))

from ipuloop.emulate import stand_in  # (the path above first)

stand_in("horovod", None, {"torch": "ipuloop.emulator.horovod"})
