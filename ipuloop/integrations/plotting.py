"""Training curves from a ``CSVLogger`` file:
``python -m ipuloop.integrations.plotting logs.csv -o curves.png``.

One panel per quantity, each against optimizer updates (the ``update`` column): ``loss``
(the step losses of ``CSVLogger(every_n_steps=...)`` rows, ``train_loss`` and ``val_loss``
per epoch), then one panel per metric (``train_<name>`` and ``val_<name>``) and per other
logged value. A value the file's ``estimated`` column names (under ``OutputMode.Final`` or
``EveryN``) is labelled "(estimate)". Needs matplotlib (``pip install "ipuloop[plot]"``). A
file that is not a CSVLogger file is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys

from ..state import CSV_COUNTERS as COUNTERS
from ..state import ESTIMATED  # CSVLogger's column naming each row's estimates (not a curve)

__all__ = ["main", "plot_csv", "read_csv"]

INSTALL = 'pip install "ipuloop[plot]"'


class NotALog(ValueError):
    pass


def read_csv(path: str) -> dict[str, list[tuple[float, float]]]:
    """The series of a CSVLogger file: ``{column: [(update, value), ...]}``, empty cells left out.

    Raises ``NotALog`` when the header does not begin ``epoch,step,update``, a cell is not a
    number, or there are no rows; ``OSError`` when the file cannot be read.
    """
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except UnicodeDecodeError as e:
        raise NotALog(f"not a CSVLogger file (not text: {e.reason})") from e
    except csv.Error as e:
        raise NotALog(f"not a CSVLogger file ({e})") from e
    if not rows or tuple(rows[0][:3]) != COUNTERS:
        first = ",".join(rows[0])[:60] if rows else "an empty file"
        raise NotALog(
            f"not a CSVLogger file: its header must begin with "
            f"{','.join(COUNTERS)}, found {first!r}"
        )
    header, data = rows[0], rows[1:]
    if not data:
        raise NotALog("a CSVLogger file with no rows: nothing to plot")
    keys = [k for k in header[3:] if k != ESTIMATED]
    series: dict[str, list[tuple[float, float]]] = {k: [] for k in keys}
    for line, row in enumerate(data, start=2):
        if len(row) > len(header):
            raise NotALog(f"line {line} has {len(row)} cells, the header {len(header)}")
        cells = dict(zip(header, row))
        try:
            update = float(cells["update"])
            for key in keys:
                if cells.get(key, ""):
                    series[key].append((update, float(cells[key])))
        except ValueError as e:
            raise NotALog(f"line {line}: {e}") from e
    return series


def estimates(path: str) -> set[str]:
    """The columns that the file's ``estimated`` column names in any row."""
    with open(path, newline="") as f:
        return {k for row in csv.DictReader(f) for k in (row.get(ESTIMATED) or "").split()}


def panels(columns: list[str]) -> dict[str, list[str]]:
    """Columns grouped by quantity: ``loss``, ``train_loss`` and ``val_loss`` in one panel."""
    out: dict[str, list[str]] = {}
    for key in columns:
        if key.endswith("_exact"):  # a flag (is train_loss exact?), not a curve
            continue
        name = re.sub(r"^(train|val)_", "", key)
        out.setdefault(name, []).append(key)
    return out


def plot_csv(path: str, output: str) -> list[str]:
    """Draws ``path``'s curves into ``output`` (any format matplotlib writes, by extension);
    returns the panel names."""
    series = read_csv(path)
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            f"python -m ipuloop.integrations.plotting needs matplotlib, which is not installed. "
            f"Install it with: {INSTALL}"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    estimated = estimates(path)
    groups = {name: [k for k in keys if series[k]] for name, keys in panels(list(series)).items()}
    groups = {name: keys for name, keys in groups.items() if keys}
    if not groups:
        raise NotALog("the file has counters but no logged values to plot")
    cols = min(len(groups), 2)
    rows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), squeeze=False)
    for ax, (name, keys) in zip(axes.flat, groups.items()):
        for key in keys:
            xs, ys = zip(*series[key])
            mark = " (estimate)" if key in estimated else ""
            if key.startswith(("train_", "val_")):  # one point per epoch
                color = "tab:blue" if key.startswith("train_") else "tab:orange"
                ax.plot(xs, ys, marker="o", linewidth=2, color=color, label=key + mark)
            else:  # one point per logged step
                label = f"{key} (step{', estimate' if mark else ''})"
                ax.plot(xs, ys, linewidth=1, color="tab:gray", alpha=0.7, label=label)
        ax.set_title(name)
        ax.set_xlabel("optimizer updates")
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(groups) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return list(groups)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ipuloop.integrations.plotting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("csv", help="a file written by ipuloop.callbacks.CSVLogger")
    p.add_argument("-o", "--output", default="curves.png", help="image file (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        names = plot_csv(args.csv, args.output)
    except (NotALog, OSError, ImportError) as e:
        where = f"{args.csv}: " if isinstance(e, NotALog) else ""  # OSError names its file
        print(f"error: {where}{e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
