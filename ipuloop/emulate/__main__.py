"""``python -m ipuloop.emulate``: the command, ``ipuloop.emulate.main``."""

from __future__ import annotations

from . import main

if __name__ == "__main__":
    main()
