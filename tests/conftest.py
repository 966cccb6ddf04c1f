"""Fixtures that show a test what a running fit reads, through the parts it is built from."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any, Callable

import ci_share
import pytest

import ipuloop.loop
from ipuloop.plan import Plan

# Another project's programs, kept as published (tests/test_model_garden.py runs them): their
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
    handle_signals = ipuloop.loop.handle_signals

    def recorded(on_term: Callable[[], None], on_abort: Callable[[], None]) -> Any:
        aborts.append(on_abort)
        return handle_signals(on_term, on_abort)

    monkeypatch.setattr(ipuloop.loop, "handle_signals", recorded)
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
    if ci_share.SHARE:
        ci_share.order(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """In CI, a test whose file the other environment runs is passed over (tests/ci_share.py)."""
    if ci_share.SHARE and not ci_share.runs_here(item):
        return True
    return None


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
