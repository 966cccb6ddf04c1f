"""ipuloop: a minimal training loop for the PopTorch execution model.

Its kernel (the loop, its parts and the built-in callbacks) is 4,949 statements (counted
2026-12-02: ``ast`` statements less docstrings, by ``tests/loop/test_layering.py``).
``IPUConfig``, the TensorBoard, W&B and MLflow loggers and plotting live in
``ipuloop.integrations``, which the kernel never imports: ``IPUConfig`` here is imported on
first use. Importing ipuloop loads the kernel's modules and changes nothing else.

``from ipuloop import poptorch`` gives the real poptorch when it is installed, else the
CPU/CUDA emulator (``IPULOOP_BACKEND`` overrides; see ``ipuloop.backend``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .backend import backend_name
from .callbacks import Callback, CancelEpoch, CancelFit, CancelStep, ProgressBar
from .loop import Loop, NonFiniteLossError, WithLoss
from .state import State
from .version import __version__

if TYPE_CHECKING:  # imported on first use (``__getattr__``): the kernel imports no integration
    from .integrations.ipu_config import IPUConfig

__all__ = [
    "Callback",
    "CancelEpoch",
    "CancelFit",
    "CancelStep",
    "IPUConfig",
    "Loop",
    "NonFiniteLossError",
    "ProgressBar",
    "State",
    "WithLoss",
    "backend_name",
    "poptorch",
    "__version__",
]


def __getattr__(name: str):
    # Resolved on first use, so importing ipuloop imports no poptorch and has no side effects.
    if name == "poptorch":
        from .backend import poptorch_module

        return poptorch_module()
    if name == "IPUConfig":
        from .integrations.ipu_config import IPUConfig

        return IPUConfig
    raise AttributeError(f"module 'ipuloop' has no attribute {name!r}")
