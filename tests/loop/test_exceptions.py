"""``ipuloop.exceptions``: the errors users catch by type, what crosses processes of them, and
the notes added to an exception on every Python."""

from __future__ import annotations

import pickle

import pytest

import ipuloop
from ipuloop.exceptions import InstanceFailedError, NonFiniteLossError, add_note


def test_the_errors_are_caught_as_the_builtin_kinds():
    assert issubclass(NonFiniteLossError, FloatingPointError)
    assert issubclass(InstanceFailedError, RuntimeError)
    assert ipuloop.NonFiniteLossError is NonFiniteLossError


def test_instance_failed_error_keeps_its_fields_through_pickle():
    e = InstanceFailedError("instance 1 failed", 1, "ValueError('bad batch')")
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is InstanceFailedError and str(again) == "instance 1 failed"
    assert (again.instance, again.error) == (1, "ValueError('bad batch')")


def test_add_note_appends_notes_in_order():
    e = ValueError("x")
    add_note(e, "first")
    add_note(e, "second")
    assert e.__notes__ == ["first", "second"]


def test_add_note_before_python_3_11_writes_the_notes_list():
    class Old(Exception):  # an exception without add_note, as before Python 3.11
        def __getattribute__(self, name):
            if name == "add_note":
                raise AttributeError(name)
            return super().__getattribute__(name)

    e = Old()
    add_note(e, "first")
    add_note(e, "second")
    assert not hasattr(e, "add_note") and e.__dict__["__notes__"] == ["first", "second"]
    with pytest.raises(Old) as info:
        raise e
    assert info.value.__notes__ == ["first", "second"]
