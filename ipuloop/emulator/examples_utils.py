"""Graphcore's examples-utils (``examples_utils``) as the model garden's programs use it under
the emulator, where it is not installed (it is published on GitHub only): ``load_lib``, which
builds a C++ custom op against the Poplar SDK and loads it, is refused with why and what to run
instead. BERT and GPT-2 import it at module level and call it only with their custom ops on."""

from __future__ import annotations

import os

from .errors import Error

__all__ = ["load_lib"]


def load_lib(filename: str, *args: object, **kwargs: object) -> None:
    """Refused: a custom op is C++ compiled for the IPU (Poplar and PopART), which the
    emulator cannot build or run."""
    raise Error(
        f"examples_utils.load_lib({os.path.basename(str(filename))!r}): C++ custom ops are "
        "compiled against the Poplar SDK and run on IPUs, which the emulator cannot do. "
        "Run the application with its custom ops turned off (e.g. --custom-ops False)."
    )
