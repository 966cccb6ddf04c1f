"""``ipuloop.dispatcher.Dispatcher``: the hooks of each event, called in order with the loop's
view; the scope of a start and an end event; an error's note, its source and its report."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ipuloop import Callback, CancelEpoch, CancelStep, State
from ipuloop.dispatcher import Dispatcher


class Recorder(Callback):
    """Records (its name, the event, the view it was given) in a shared ``log``; raises
    ``raises[event]`` from that event's hook."""

    def __init__(self, name: str, log: list, raises: dict | None = None) -> None:
        self.name, self.log, self.raises = name, log, raises or {}

    def _hook(self, event: str, view) -> None:
        self.log.append((self.name, event, view))
        if event in self.raises:
            raise self.raises[event]

    def on_fit_start(self, loop) -> None:
        self._hook("on_fit_start", loop)

    def on_epoch_start(self, loop) -> None:
        self._hook("on_epoch_start", loop)

    def on_epoch_end(self, loop) -> None:
        self._hook("on_epoch_end", loop)

    def on_exception(self, loop) -> None:
        self._hook("on_exception", loop)


class Quiet(Callback):
    main_instance_only = True

    def on_fit_start(self, loop) -> None:
        pass


def dispatcher(*callbacks: Callback) -> Dispatcher:
    return Dispatcher(SimpleNamespace(state=State()), list(callbacks))


def test_fire_calls_the_overriding_hooks_in_order_with_the_view():
    log: list = []
    d = dispatcher(Recorder("a", log), Callback(), Recorder("b", log))
    d.fire("on_fit_start")
    assert log == [("a", "on_fit_start", d.view), ("b", "on_fit_start", d.view)]
    assert [type(cb).__name__ for cb, _ in d.hooks["on_fit_start"]] == ["Recorder", "Recorder"]
    assert d.hooks["on_train_step_end"] == []  # nobody overrides it


def test_a_hook_error_names_its_callback_and_stops_the_later_hooks():
    log: list = []
    boom = Recorder("a", log, {"on_fit_start": KeyError("boom")})
    d = dispatcher(boom, Recorder("b", log))
    with pytest.raises(KeyError) as e:
        d.fire("on_fit_start")
    assert "raised in callback Recorder.on_fit_start" in getattr(e.value, "__notes__", [])
    assert d.view.state.exception_source is boom and [x[0] for x in log] == ["a"]


def test_a_cancel_passes_through_without_a_note_and_event_says_false():
    log: list = []
    d = dispatcher(Recorder("a", log, {"on_epoch_end": CancelStep()}), Recorder("b", log))
    with pytest.raises(CancelStep) as e:
        d.fire("on_epoch_end")
    assert not getattr(e.value, "__notes__", None) and d.view.state.exception_source is None
    assert d.event("on_epoch_end", CancelStep) is False
    assert d.event("on_fit_start", CancelStep) is True
    assert [x[:2] for x in log] == [
        ("a", "on_epoch_end"),
        ("a", "on_epoch_end"),
        ("a", "on_fit_start"),
        ("b", "on_fit_start"),
    ]


@pytest.mark.parametrize(
    "cancel_in,expected",
    [
        (None, ["a:on_epoch_start", "body", "a:on_epoch_end"]),
        ("on_epoch_start", ["a:on_epoch_start", "a:on_epoch_end"]),  # the body skipped
        ("body", ["a:on_epoch_start", "body", "a:on_epoch_end"]),
    ],
)
def test_scope_runs_start_body_end_and_a_cancel_skips_to_the_end(cancel_in, expected):
    log: list = []
    raises = {cancel_in: CancelEpoch()} if cancel_in not in (None, "body") else {}
    d = dispatcher(Recorder("a", log, raises))

    def body():
        log.append(("body", None, None))
        if cancel_in == "body":
            raise CancelEpoch()

    d.scope("on_epoch_start", body, CancelEpoch, "on_epoch_end")
    assert [f"{n}:{e}" if e else n for n, e, _ in log] == expected


def test_report_tells_on_exception_once_and_a_failing_hook_is_warned_of():
    log: list = []
    failing = Recorder("a", log, {"on_exception": RuntimeError("in the report")})
    d = dispatcher(failing, Recorder("b", log))
    error = ValueError("the fit's")
    with pytest.warns(UserWarning, match="Recorder.on_exception failed: RuntimeError"):
        d.report(error)
    d.report(error)  # a nested call reporting it again: not repeated
    assert [x[:2] for x in log] == [("a", "on_exception"), ("b", "on_exception")]
    assert d.view.state.exception is error


def test_main_instance_only_callbacks_are_left_out_on_other_instances():
    log: list = []
    d = dispatcher(Quiet(), Recorder("a", log))
    d.main_instance_only(0)
    assert len(d.hooks["on_fit_start"]) == 2
    d.main_instance_only(1)
    assert [type(cb) for cb, _ in d.hooks["on_fit_start"]] == [Recorder]


def test_describe_lists_each_event_with_its_callbacks():
    text = dispatcher(Quiet(), Recorder("a", [])).describe()
    lines = dict(line.split(None, 1) for line in text.splitlines())
    assert lines["on_fit_start"] == "Quiet, Recorder" and lines["on_train_step_end"] == "-"
