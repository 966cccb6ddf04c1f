"""``ipuloop.config``, deprecated: the first layout's name of ``ipuloop.integrations.ipu_config``.

Importing it warns (``DeprecationWarning``) and forwards the public names:
``from ipuloop.config import IPUConfig, place_layers`` works until ipuloop 0.2.0
(``ipuloop.deprecated.REMOVED_IN``), which removes this module.
"""

from __future__ import annotations

from . import deprecated

deprecated.warn("ipuloop.config")

from .integrations.ipu_config import (  # noqa: E402 (after the warning)
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
