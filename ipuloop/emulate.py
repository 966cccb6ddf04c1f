"""``python -m ipuloop.emulate SCRIPT [ARGS...]``: run a PopTorch program on the emulator.

``import poptorch`` inside SCRIPT (and in everything it imports) gets ``ipuloop.emulator``.
SCRIPT runs as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``; its exit status is ours.
"""
from __future__ import annotations

import os
import runpy
import sys

__all__ = ["install", "main"]


# also importable as ``poptorch.<name>``
_SUBMODULES = ("optim", "enums", "options", "poptorch_core", "_logging")


def install() -> None:
    """Bind ``poptorch`` (and its submodules ``_SUBMODULES``) to the emulator for this process."""
    import ipuloop.emulator as emulator
    sys.modules["poptorch"] = emulator
    for name in _SUBMODULES:
        sys.modules[f"poptorch.{name}"] = getattr(emulator, name)
    os.environ["IPULOOP_BACKEND"] = "emulator"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        print(f"ipuloop.emulate: no such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    install()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
