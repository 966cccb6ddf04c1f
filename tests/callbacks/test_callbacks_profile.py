"""ProfileCapture: a window of steps gives a Chrome trace and an op table; failures close it."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import ipuloop.callbacks.profile as profile_mod
from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks import ProfileCapture

DI, STEPS = 2, 6

# torch 2.0's profiler exports its trace through kineto's C++ writer, which reports no write
# error, and names its steps otherwise (ProfilerStep#2 twice): these tests need torch >= 2.1.
OLD_PROFILER = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 1),
    reason="torch < 2.1's trace exporter reports no write error and numbers steps otherwise",
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)  # two aten::addmm per forward

    def forward(self, x, y):
        out = self.b(torch.relu(self.a(x)))
        return out, nn.functional.cross_entropy(out, y)


def run(cb, *extra, **kw):
    n = STEPS * DI * 2
    ds = TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
    model = Net()
    loop = Loop(
        model,
        poptorch.Options().deviceIterations(DI),
        progress=False,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[cb, *extra],
    )
    loop.fit(DataLoader(ds, batch_size=2), epochs=1, **kw)
    return loop


def profiler_on() -> bool:
    return torch._C._autograd._profiler_enabled()


PHASES = set("XBEiIstfMCbneNOD")  # the Trace Event Format's event phases


def _strict(constant):
    raise ValueError(f"{constant} is not JSON: a browser's JSON.parse rejects the file")


def events(path):
    """The trace's events, checked against the Trace Event Format that chrome://tracing and
    Perfetto read: strict JSON, and every event with the fields its phase needs."""
    with open(path) as f:
        trace = json.load(f, parse_constant=_strict)
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    for e in trace["traceEvents"]:
        assert isinstance(e, dict) and e.get("ph") in PHASES, e
        assert isinstance(e.get("name"), str) and "pid" in e and "tid" in e, e
        if e["ph"] != "M":
            assert isinstance(e.get("ts"), (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0, e
        if e["ph"] in "stf":
            assert "id" in e, e
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["name"].startswith("ProfilerStep#")
    )
    # one after the other (to 1 us: the exporter rounds)
    assert all(a[1] <= b[0] + 1 for a, b in zip(steps, steps[1:])), steps
    return trace["traceEvents"]


@OLD_PROFILER
def test_window_writes_a_chrome_trace_and_an_op_table(tmp_path, capsys):
    cb = ProfileCapture(start_step=2, num_steps=3, dirpath=tmp_path / "prof")
    run(cb)
    ev = events(tmp_path / "prof" / "trace.json")
    steps = sorted(e["name"] for e in ev if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    # Exactly the window's forwards: 3 steps x DI updates x 2 linear layers.
    assert sum(e.get("name") == "aten::addmm" for e in ev) == 3 * DI * 2
    table = (tmp_path / "prof" / "ops.txt").read_text()
    assert "aten::addmm" in table and "Self CPU" in table
    out = capsys.readouterr().out
    assert f"steps 2-4 profiled: trace {tmp_path / 'prof' / 'trace.json'}" in out
    assert not profiler_on()


def test_fit_ending_inside_the_window_writes_what_it_captured(tmp_path):
    class StopAt(Callback):
        def on_train_step_end(self, loop):
            if loop.state.step == 3:
                loop.stop()

    cb = ProfileCapture(start_step=1, num_steps=4, dirpath=tmp_path)
    run(cb, StopAt())
    ev = events(tmp_path / "trace.json")
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in ev) == 2
    assert not profiler_on()


def test_window_after_the_fit_warns(tmp_path):
    with pytest.warns(UserWarning, match="ended before step 50"):
        run(ProfileCapture(start_step=50, dirpath=tmp_path))
    assert not os.listdir(tmp_path)


def test_write_failure_names_the_callback_and_closes_the_profiler(tmp_path, monkeypatch):
    def full(self, path, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", full)
    cb = ProfileCapture(start_step=1, num_steps=2, dirpath=tmp_path)
    with pytest.raises(OSError, match="ProfileCapture cannot write") as info:
        run(cb)
    assert info.value.errno == errno.ENOSPC
    assert "raised in callback ProfileCapture.on_train_step_end" in info.value.__notes__
    assert not profiler_on() and cb._prof is None


@pytest.mark.parametrize("break_it", ["remove folder", "trace.json is a folder"])
@OLD_PROFILER
def test_unwritable_output_is_an_error_not_a_silent_miss(tmp_path, break_it):
    class Break(Callback):  # the output becomes unwritable while the window runs
        def on_train_step_end(self, loop):
            if loop.state.step == 1:
                if break_it == "remove folder":
                    (tmp_path / "prof").rmdir()
                else:
                    (tmp_path / "prof" / "trace.json").mkdir()

    cb = ProfileCapture(start_step=1, num_steps=2, dirpath=tmp_path / "prof")
    with pytest.raises(OSError, match="ProfileCapture cannot write"):
        run(cb, Break())
    assert not profiler_on()


def test_unwritable_folder_fails_before_the_first_step(tmp_path):
    (tmp_path / "file").write_text("")
    cb = ProfileCapture(dirpath=tmp_path / "file" / "prof")
    with pytest.raises(OSError, match="ProfileCapture cannot write to dirpath="):
        run(cb)
    assert cb._prof is None and not profiler_on()


def test_exception_inside_the_window_closes_the_profiler(tmp_path):
    class Boom(Callback):
        def on_train_step_end(self, loop):
            if loop.state.step == 2:
                assert profiler_on()
                raise RuntimeError("boom")

    cb = ProfileCapture(start_step=1, num_steps=3, dirpath=tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        run(cb, Boom())
    assert not profiler_on() and not os.listdir(tmp_path)


def test_poptorch_sets_popvision_options_before_compilation(tmp_path, monkeypatch):
    monkeypatch.setattr(profile_mod, "backend_name", lambda: "poptorch")
    compiled_with: dict = {}

    class Spy(Callback):
        def on_compile_start(self, loop):
            compiled_with.update(loop.train_model._options._popart.options["engineOptions"])

    loop = run(ProfileCapture(dirpath=tmp_path / "pv"), Spy())
    assert compiled_with["autoReport.all"] == "true"
    assert compiled_with["autoReport.directory"] == str(tmp_path / "pv")
    assert not (tmp_path / "pv" / "trace.json").exists() and not profiler_on()
    assert loop.state.step == STEPS


@pytest.mark.parametrize("kw", [{"start_step": -1}, {"num_steps": 0}, {"num_steps": 1.5}])
def test_bad_arguments(kw):
    with pytest.raises(ValueError, match=f"{next(iter(kw))} must be an int"):
        ProfileCapture(**kw)
