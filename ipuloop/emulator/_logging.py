"""``poptorch.logger``: PopTorch's console logger, its levels and ``POPTORCH_LOG_LEVEL``.

One ``logging.Logger`` named ``poptorch::python`` as in PopTorch, printing to stderr as
``[HH:MM:SS.mmm] [poptorch::python] [warning] text`` (coloured on a terminal). It carries
what PopTorch's Python side logs and also what its C++ side (PopTorch's compiler, PopART)
logs about the options and the optimizer state, at the level PopTorch logs it. Its level is
``POPTORCH_LOG_LEVEL`` when the module is imported (WARN when unset), then ``setLogLevel``.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from typing import ClassVar

__all__ = [
    "logger",
    "setLogLevel",
    "setPopartLogLevel",
    "popart_log_level",
    "LEVEL_NAMES",
    "show_compilation_progress",
]

logger = logging.getLogger("poptorch::python")

# Each PopTorch level name: (its legacy integer, the Python level). TRACE is DEBUG on the
# Python side in PopTorch too (the C++ side has a finer one this emulator never needs).
_LEVELS = {
    "TRACE": (0, logging.DEBUG),
    "DEBUG": (1, logging.DEBUG),
    "INFO": (2, logging.INFO),
    "WARN": (3, logging.WARNING),
    "ERR": (4, logging.ERROR),
    "OFF": (6, logging.CRITICAL),
}
_INTERNAL = {"TRACE_ALL": (0, logging.DEBUG), "DEBUG_IR": (1, logging.DEBUG)}  # accepted, unlisted
LEVEL_NAMES = tuple(sorted(_LEVELS))
_popart_level = ["WARN"]


def _unknown_level_error(level: object) -> ValueError:
    names = list(LEVEL_NAMES)
    return ValueError(
        f"Unknown log level: {level}. Valid values are {', '.join(names[:-1])} and {names[-1]}"
    )


def setLogLevel(level: int | str) -> None:
    """Set how much PopTorch prints: TRACE, DEBUG, INFO, WARN, ERR or OFF, or the legacy
    integer of one of them (0, 1, 2, 3, 4 or 6)."""
    if isinstance(level, int) and not isinstance(level, bool):
        names = [n for n, (legacy, _) in _LEVELS.items() if legacy == level]
        if not names:
            raise ValueError("Invalid log level integer")
        level = names[0]
    entry = None
    if isinstance(level, str):
        entry = _LEVELS.get(level) or _INTERNAL.get(level)
    if entry is None:
        raise _unknown_level_error(level)
    logger.setLevel(entry[1])


def setPopartLogLevel(level: str) -> None:
    """PopART's log level. There is no PopART on the emulator, so it prints nothing at any
    level; the value is checked and kept as PopTorch does."""
    if not isinstance(level, str) or (level not in _LEVELS and level not in _INTERNAL):
        raise ValueError("Level must be one of " + ", ".join([*_LEVELS, *_INTERNAL]))
    _popart_level[0] = level


def popart_log_level() -> str:
    """The level last given to ``setPopartLogLevel`` (WARN by default)."""
    return _popart_level[0]


_compilation_told = [False]  # the process has said what its compilations do


def show_compilation_progress(seconds: float, device: object) -> None:
    """Where PopTorch shows its "Graph compilation" progress bar (tqdm, on stderr): what the
    emulator did instead, once per process. Its compilation is a trace of one micro-batch and
    PopTorch's checks, done in a moment, with no stages to show one by one: a bar jumping to
    100% at every compilation would say nothing."""
    if _compilation_told[0]:
        return
    _compilation_told[0] = True
    print(
        f"Graph compilation (emulated): the model was traced and checked on {device} in "
        f"{seconds:.2f}s; there is no Poplar graph to compile, and later compilations of "
        "this process say nothing.",
        file=sys.stderr,
        flush=True,
    )


class _Formatter(logging.Formatter):
    """PopTorch's console format: lower-case level names, milliseconds, and colours only when
    both stdout and stderr are terminals."""

    _COLOURS: ClassVar[dict[int, str]] = {
        logging.DEBUG: "\033[36m",
        logging.INFO: "\033[0m",
        logging.WARNING: "\033[1;33m",
        logging.ERROR: "\033[1;31m",
        logging.CRITICAL: "\033[1;31m",
    }
    _FMT = "[%(asctime)s] [%(name)s] [%(levelname)s] %(message)s"

    def __init__(self) -> None:
        super().__init__(self._FMT)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        t = datetime.datetime.fromtimestamp(record.created)
        return (
            t.strftime(datefmt) if datefmt else f"{t.strftime('%H:%M:%S')}.{int(record.msecs):03d}"
        )

    def format(self, record: logging.LogRecord) -> str:
        record = logging.makeLogRecord(record.__dict__)  # other handlers keep the original
        record.levelname = record.levelname.lower()
        text = super().format(record)
        colour = self._COLOURS.get(record.levelno)
        if colour and _isatty(sys.stdout) and _isatty(sys.stderr):
            text = f"{colour}{text}\033[0m"
        return text


def _isatty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (a test's or a redirection's), not the one there was
    at import."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
    _console = _StderrHandler()
    _console.setFormatter(_Formatter())
    _console.setLevel(logging.DEBUG)
    logger.addHandler(_console)

_env = os.environ.get("POPTORCH_LOG_LEVEL", "WARN")
try:
    setLogLevel(_env)
except ValueError as e:  # PopTorch fails its import on a bad value too
    raise ValueError(
        f"POPTORCH_LOG_LEVEL={_env!r}: {e}. Set it to one of {', '.join(LEVEL_NAMES)}, or unset it."
    ) from None
