"""``ipuloop.plot``, deprecated: the first layout's name of ``ipuloop.integrations.plotting``.

``python -m ipuloop.plot logs.csv -o curves.png`` still runs the plotting command, and
``from ipuloop.plot import main, plot_csv, read_csv`` still imports its functions, each with a
``DeprecationWarning``, until ipuloop 0.2.0 (``ipuloop.deprecated.REMOVED_IN``), which removes
this module: the command is ``python -m ipuloop.integrations.plotting``.
"""

from __future__ import annotations

import sys
import warnings

from . import deprecated

if __name__ == "__main__":  # shown: Python shows the DeprecationWarnings of ``__main__``
    warnings.warn(deprecated.message("python -m ipuloop.plot"), DeprecationWarning, stacklevel=1)
else:
    deprecated.warn("ipuloop.plot")

from .integrations.plotting import main, plot_csv, read_csv

__all__ = ["main", "plot_csv", "read_csv"]

if __name__ == "__main__":
    sys.exit(main())
