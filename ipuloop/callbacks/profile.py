"""``ProfileCapture``: a profile of a window of training steps (PopVision, or torch.profiler)."""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

import torch

from ..backend import backend_name
from ..rules import check_int
from .base import Callback, LoopView

__all__ = ["ProfileCapture"]


class ProfileCapture(Callback):
    """Profiles the host steps ``start_step ... start_step + num_steps - 1`` (0-based).

    On real PopTorch it turns on PopVision reports (``Options.enableProfiling(dirpath)``:
    ``autoReport.all``, ``autoReport.directory``) at fit start, before compilation; Poplar then
    decides which runs the execution report covers, not this window. On the emulator it runs
    ``torch.profiler`` over exactly the window (one ``ProfilerStep#<step>`` per host step) and
    writes ``trace.json`` (Chrome trace: chrome://tracing or https://ui.perfetto.dev) and
    ``ops.txt`` (the most expensive operations). The default skips step 0, which pays for
    first-call costs. A fit that ends inside the window writes what it captured; the profiler
    is always closed, also on an exception. A step's hooks are part of its window, and so is
    the validation ``fit(val_every_n_steps=)`` runs at a step in it (it runs before that
    step's ``on_train_step_end``): its ops appear in the trace under that step.

    Args:
        start_step: index of the first host step profiled (``loop.state.step`` before it runs).
        num_steps: how many host steps to profile.
        dirpath: output folder (created).

    Example::

        loop = Loop(model, opts, callbacks=[ProfileCapture(start_step=2, num_steps=3)])
    """

    order = 200  # starts after other step-start hooks; its steps then include every end hook

    def __init__(
        self, start_step: int = 1, num_steps: int = 3, dirpath: str | os.PathLike = "profile"
    ) -> None:
        check_int("start_step", start_step, 0)
        check_int("num_steps", num_steps)
        self.start_step = start_step
        self.num_steps = num_steps
        self.dirpath = os.fspath(dirpath)
        self._prof: Any = None
        self._seen = 0  # steps completed in the window
        self._cuda = False  # the window also records CUDA kernels
        self.written: list[str] = []  # the files of the last capture (PopVision: the folder)

    def on_fit_start(self, loop: LoopView) -> None:
        try:
            os.makedirs(self.dirpath, exist_ok=True)
        except OSError as e:
            raise self._write_error(e) from e

    def on_configure(self, loop: LoopView) -> None:  # before the options freeze (the first fit)
        if backend_name() != "poptorch" or self.written:
            return
        loop.train_opts.enableProfiling(self.dirpath)  # autoReport.all, autoReport.directory
        self.written = [self.dirpath]
        print(
            f"ProfileCapture: PopVision reports go to {self.dirpath} (open them with the "
            "PopVision Graph Analyser).",
            flush=True,
        )

    def on_train_step_start(self, loop: LoopView) -> None:
        if self._prof is not None:
            self._prof.step()  # ends the previous ProfilerStep, starts this step's
            return
        if backend_name() == "poptorch" or loop.state.step != self.start_step:
            return
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # emulating on CUDA
            acts.append(ProfilerActivity.CUDA)
        # A schedule makes torch mark each step (ProfilerStep#n); this one records them all.
        prof = profile(activities=acts, schedule=lambda _: ProfilerAction.RECORD)
        prof.step_num = loop.state.step  # markers carry the loop's step index
        prof.__enter__()
        self._prof = prof
        self._seen = 0
        self._cuda = len(acts) > 1

    def on_train_step_end(self, loop: LoopView) -> None:
        if self._prof is None:
            return
        self._seen += 1
        if self._seen == self.num_steps:
            self._finish(loop)

    def on_fit_end(self, loop: LoopView) -> None:
        if self._prof is not None:  # the fit ended inside the window
            self._finish(loop)
        elif not self.written and backend_name() != "poptorch":
            warnings.warn(
                f"ProfileCapture: the fit ended before step {self.start_step}, so "
                "nothing was profiled. Lower start_step.",
                stacklevel=2,
            )

    def on_exception(self, loop: LoopView) -> None:
        self._close()

    def _close(self) -> Any:
        prof = self._prof
        self._prof = None
        if prof is not None:
            prof.__exit__(None, None, None)
        return prof

    def _finish(self, loop: LoopView) -> None:
        prof = self._close()
        if not self._seen:  # no step of the window completed: nothing worth writing
            return
        trace = os.path.join(self.dirpath, "trace.json")
        ops = os.path.join(self.dirpath, "ops.txt")
        key = "self_device_time_total" if self._cuda else "self_cpu_time_total"
        try:
            # The Python exporter raises when it cannot write (torch's default fails silently;
            # torch 2.0 has only the Python exporter, and no switch for it).
            if "use_python_export" in inspect.signature(prof.export_chrome_trace).parameters:
                prof.export_chrome_trace(trace, use_python_export=True)
            else:
                prof.export_chrome_trace(trace)
                if not os.path.isfile(trace):  # that exporter can fail without a word
                    raise OSError(f"the profiler wrote no trace to {trace}")
            with open(ops, "w") as f:
                f.write(prof.key_averages().table(sort_by=key, row_limit=15) + "\n")
        except OSError as e:
            raise self._write_error(e) from e
        self.written = [trace, ops]
        first = loop.state.step - self._seen
        print(
            f"ProfileCapture: steps {first}-{loop.state.step - 1} profiled: trace {trace} "
            f"(chrome://tracing or ui.perfetto.dev), top operations {ops}.",
            flush=True,
        )

    def _write_error(self, e: OSError) -> OSError:
        return OSError(
            e.errno,
            f"ProfileCapture cannot write to dirpath={self.dirpath!r}: "
            f"{e.strerror or e}. Free space or pass another dirpath.",
        )
