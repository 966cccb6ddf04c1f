"""``ipuloop.State``: the loop's counters, flags and logs, as callbacks and checkpoints read
them."""

from __future__ import annotations

import torch

from ipuloop import State

COUNTERS = ("epoch", "step", "update", "micro_batch", "samples", "epoch_step")


def test_a_new_state_has_counted_nothing_and_shares_no_logs():
    a, b = State(), State()
    assert a.counters() == dict.fromkeys(COUNTERS, 0)
    a.logs["loss"] = 1.0
    a.history.append({"train_loss": 1.0})
    assert b.logs == {} and b.history == []
    assert (a.instance, a.instances, a.exception, a.exception_source) == (0, 1, None, None)


def test_counters_round_trip_as_ints():
    st = State(epoch=1, step=7, update=14, micro_batch=28, samples=112, epoch_step=3)
    again = State()
    again.load_counters({k: torch.tensor(v) for k, v in st.counters().items()})  # as loaded
    assert again.counters() == st.counters()
    assert all(type(v) is int for v in again.counters().values())


def test_should_stop_on_stop_or_max_steps():
    st = State()
    assert not st.should_stop()
    st.stop_requested = True
    assert st.should_stop()
    st.start_fit(steps_per_epoch=4, max_steps=3, validates=False)  # a new fit: no stop flag
    assert not st.should_stop()
    st.step = 3
    assert st.should_stop()
    st.start_fit(steps_per_epoch=None, max_steps=None, validates=True)
    assert not st.should_stop() and st.steps_per_epoch is None and st.validates


def test_start_fit_clears_the_flags_and_the_error_being_handled():
    st = State(stop_requested=True, preempted=True, exception=ValueError(), exception_source=1)
    st.start_fit(steps_per_epoch=2, max_steps=None, validates=False)
    assert not st.stop_requested and not st.preempted
    assert st.exception is None and st.exception_source is None
    st.exception = ValueError()
    st.preempted = True
    st.start_call()  # a validate or predict: the error, not the fit's flags
    assert st.exception is None and st.preempted


def test_drop_logs_removes_a_name_and_its_parts_only():
    st = State(logs={"val_acc": 1.0, "val_acc_0": 0.5, "val_accuracy": 2.0, "train_acc": 3.0})
    st.drop_logs("val_", ["acc"])
    assert st.logs == {"val_accuracy": 2.0, "train_acc": 3.0}
