"""``import poptorch`` in a process started under ``python -m ipuloop.emulate``: the emulator.

``ipuloop.emulate.install`` puts this folder first on the module path that a spawned or
forkserver loader worker (multiprocessing's start methods that run a new interpreter) and a
Python subprocess inherit, so they bind ``poptorch`` to the emulator as their parent does.
Importing this module replaces it in ``sys.modules`` with ``ipuloop.emulator``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

__all__: list = []

if importlib.util.find_spec("ipuloop") is None:  # e.g. a subprocess in another folder
    # the folder that holds ipuloop/ (this file: ipuloop/emulate/_binding/poptorch.py)
    sys.path.append(os.path.abspath(os.path.join(__file__, *[os.pardir] * 4)))

from ipuloop.emulate import install  # (the path above first)

install()
