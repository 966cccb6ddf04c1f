"""``python -m ipuloop.plot logs.csv -o curves.png``: forwards to ``ipuloop.integrations.plotting``.

The command's name, and ``from ipuloop.plot import main, plot_csv, read_csv``, as they were;
the code lives with the other integrations. The kernel never imports it.
"""

from __future__ import annotations

import sys

from .integrations.plotting import main, plot_csv, read_csv

__all__ = ["main", "plot_csv", "read_csv"]

if __name__ == "__main__":
    sys.exit(main())
