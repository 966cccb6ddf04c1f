"""``ipuloop.config``, the first layout's name of ``ipuloop.integrations.ipu_config``.

Forwards its public names: ``from ipuloop.config import IPUConfig, place_layers`` still works.
The kernel never imports it.
"""

from __future__ import annotations

from .integrations.ipu_config import (
    CONFIG_NAME,
    IncompatibleIPUConfigError,
    IPUConfig,
    place_layers,
    unplace_layers,
)

__all__ = [
    "CONFIG_NAME",
    "IPUConfig",
    "IncompatibleIPUConfigError",
    "place_layers",
    "unplace_layers",
]
