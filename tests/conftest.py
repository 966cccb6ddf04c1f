"""Fixtures that show a test what a running fit reads, through the parts it is built from."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

# Every folder's modules are imported by name from any other's (the harness in support/: warm,
# launch, helpers_train, batch_way, ci_share; a test file's shared pieces), whichever file runs
# first or alone: each basename is unique under tests/
_TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_TESTS / "support")] + sorted(
    str(d)
    for d in _TESTS.glob("*/**")
    if d.is_dir() and "fixtures" not in d.parts and d.name != "__pycache__" and d.name != "support"
)

import ci_share  # noqa: E402
import pytest  # noqa: E402

import ipuloop.loop  # noqa: E402
import ipuloop.running  # noqa: E402
from ipuloop.plan import Plan  # noqa: E402

# Another project's programs, kept as published (tests/programs/test_model_garden.py runs them): their
# helper modules are not tests of this one
collect_ignore_glob = ["fixtures/*"]


@pytest.fixture
def epoch_readers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What each training epoch reads (``Plan.epoch`` given a ``Draw``), in the order the
    epochs start: ``units``, torch's iterator of its loader's batches (its workers: ``_workers``),
    and ``calls``, the host calls it hands out (read ahead: a ``read_ahead.Ahead``)."""
    readers: list[Any] = []
    epoch = Plan.epoch

    def recorded(self: Plan, *args: Any, **kwargs: Any) -> Any:
        it = epoch(self, *args, **kwargs)
        if (args[2:] or [kwargs.get("draw")])[0] is not None:  # a training epoch's
            readers.append(SimpleNamespace(units=self.source.live, calls=it))
        return it

    monkeypatch.setattr(Plan, "epoch", recorded)
    return readers


@pytest.fixture
def second_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> list[Callable[[], None]]:
    """What a second Ctrl-C runs before the process exits (the ``on_abort`` each fit gives
    ``signals.handle_signals``), one per fit: ``second_ctrl_c[-1]()`` runs the last fit's."""
    aborts: list[Callable[[], None]] = []
    handle_signals = ipuloop.running.handle_signals

    def recorded(on_term: Callable[[], None], on_abort: Callable[[], None]) -> Any:
        aborts.append(on_abort)
        return handle_signals(on_term, on_abort)

    monkeypatch.setattr(ipuloop.running, "handle_signals", recorded)
    return aborts


# Words in a test's source that show it forks processes or starts threads in the test's own
# process (loader workers, the accessor's worker process): such a test is marked ``threads``
# (as one marked by hand), and CI runs these again with torch's default thread count
# (docs/reliability.md §2.18), where a fork from a process whose thread pool runs deadlocks. A
# new test of that kind is marked without anyone's word. (A test that only starts a new
# interpreter, which starts with no thread pool, is not: mark it by hand if its program forks.)
_THREADS_WORDS = (
    "num_workers",
    "workers=",
    "DataLoaderMode.Async",
    "async_data",
    "AsynchronousDataAccessor",
    "multiprocessing",
    "Thread(",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_threads(items)
    if ci_share.SIDE:  # in CI: this environment's files (tests/support/ci_share.py)
        kept = ci_share.select(items)
        ids = {id(item) for item in kept}
        config.hook.pytest_deselected(items=[i for i in items if id(i) not in ids])
        items[:] = kept


def _mark_threads(items: list[pytest.Item]) -> None:
    sources: dict[Any, str] = {}
    for item in items:
        function = getattr(item, "function", None)
        if function is None or item.get_closest_marker("threads"):
            continue
        if function not in sources:
            try:
                sources[function] = inspect.getsource(function)
            except (OSError, TypeError):
                sources[function] = ""
        if any(word in sources[function] for word in _THREADS_WORDS):
            item.add_marker(pytest.mark.threads)
