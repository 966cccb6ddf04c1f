"""The instances of a run: a process alone, or a ``Loop`` per process (torchrun, mpirun, poprun).

A process alone is a run of one instance (``Processes``): its sums return their input and its
stop flags are its own, so the loop has one path for one process and for several. Started by a
launcher (torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_*``, mpirun's
``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``, poprun's ``POPDIST_*``, read by
``launchers.py``), each process's
``Loop`` is one instance of a run with N instances of R replicas each (``replicas=`` stays per
process, as PopDist's local replicas), and needs no change to the program:

- the options get the process id and count (``Distributed.configureProcessId``), and a
  torch.distributed process group (gloo, host tensors) is joined or created, its timeout
  ``IPULOOP_DIST_TIMEOUT`` seconds (default 300): an instance that dies or hangs makes the
  others fail with an error within that time;
- a training loader is read in the order one process with N*R replicas would read it: every
  instance draws the same global order, and of each global host call ``[DI, GA, N*R, B]``
  instance p reads ``[:, :, p*R:(p+1)*R, :]``, the micro-batches of its replicas (the loop
  builds its ``poptorch.DataLoader`` with ``auto_distributed_partitioning=False``); a custom
  batch sampler's batches are shared out alike, a batch per micro-batch; a
  ``poptorch.DataLoader`` used outside the loop keeps PopTorch's per-process slices. A
  ``DistributedSampler`` (DDP's idiom) is read as the order of its whole dataset
  (``loaders.whole_order``), with the epoch set each epoch (``plan`` builds the loaders);
- validation inside ``fit`` gives each instance a contiguous slice of the samples, padded
  so that every instance runs the same number of host calls, and counts each sample once;
  ``validate()`` and predict run every sample on each instance that calls them, alone;
- the step loss, the epoch loss and val_loss are summed over the instances; torchmetrics
  metrics sync themselves over the process group in ``compute()``; only instance 0 shows
  progress and writes logs (``ProgressBar``, ``CSVLogger``, ``TensorBoardLogger``) and
  checkpoints, which every instance can resume from, as can a run of another layout with
  the same N*R replicas (``resume``: the data factors are the whole run's);
- SIGTERM to any instance, ``Loop.stop()`` on any instance, and ``max_steps`` stop every
  instance at the same step boundary (a sum of flags over the instances after each step);
- before the first step the instances compare their settings (seed, factors, dataset
  length, epochs...) and an instance that differs is an error naming it;
- an error that ends ``fit`` on one instance ends it on every instance within seconds: the
  first to fail leaves its error in the process group's store and leaves the group, and
  the others raise ``InstanceFailedError`` naming it (``ProcessGroup.failed``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .exceptions import InstanceFailedError
from .group_teardown import destroy_group, keep_until_left, leave_process_group
from .launchers import (
    DEFAULT_TIMEOUT,
    TIMEOUT_ENV,
    Launch,
    detect,
    is_main_process,
    num_processes,
    process_index,
    timeout_seconds,
)
from .poptorch_types import Options
from .rules import tell_launcher
from .signals import Preempted
from .state import State

__all__ = [
    "Launch",
    "detect",
    "process_index",
    "num_processes",
    "is_main_process",
    "timeout_seconds",
    "TIMEOUT_ENV",
    "DEFAULT_TIMEOUT",
    "Processes",
    "ProcessGroup",
    "ALONE",
    "join",
    "configured",
]


def _init_group(rank: int, size: int) -> None:
    """Join the default process group, creating it (gloo) when nobody has."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(
            "Several processes need torch.distributed, which this torch build lacks."
        )
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, size):
            raise ValueError(
                f"The torch.distributed process group has rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the options say process {rank} of {size}: "
                "initialise the group with the launcher's rank and world size."
            )
        return
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT", "29500")
    # env:// where the launcher set MASTER_*: under torchrun it joins the launcher's own store
    launched = "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
    method = "env://" if launched else f"tcp://{addr}:{port}"
    seconds = timeout_seconds()
    try:
        dist.init_process_group(
            "gloo",
            init_method=method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=seconds),
        )
    except Exception as e:
        raise RuntimeError(
            f"Instance {rank} of {size} could not join the other instances at "
            f"{addr}:{port} within {seconds:g} s ({type(e).__name__}: {e}). Set MASTER_ADDR and "
            f"MASTER_PORT to the same address on every instance (torchrun does), and "
            f"{TIMEOUT_ENV} to wait longer."
        ) from e
    atexit.register(leave_process_group)


def _default_store() -> Any:
    """The process group's key-value store, where a failing instance leaves its error for
    the others; None where this torch does not give it."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 (a private function: the others then only learn it failed)
        return None


FAILURE_KEY = "ipuloop/failure"
SEEN_KEY = "ipuloop/failure_seen"
STORE_WAIT = 3.0  # seconds a failing instance waits on the store and for the others to read


class Processes:
    """A run of one instance: this process alone. Every reduction returns its input, and a
    SIGTERM stops the fit at the next step boundary; ``ProcessGroup`` is the run of several."""

    rank = 0
    size = 1
    launcher: str | None = None

    def sum(self, values: list[float], what: str) -> list[float]:
        """``values`` summed over the instances: here, ``values`` (``what``: for errors)."""
        return values

    def gather(self, obj: object, what: str) -> list[Any]:
        """``obj`` of every instance, in instance order."""
        return [obj]

    def failed(self, error: BaseException, st: State) -> BaseException:
        """``error`` is ending this instance's fit; returns what to raise: ``error``."""
        return error

    @contextlib.contextmanager
    def failing_together(self, st: State) -> Iterator[None]:
        """An error escaping the block ends every instance's fit (here: this one's)."""
        yield

    def on_sigterm(self, st: State) -> None:
        """SIGTERM: the fit stops at the next step boundary (``st``: the loop's ``State``)."""
        st.preempted = True

    def agree_on_stop(self, st: State) -> None:
        """At a step boundary: the instances agree on ``st``'s stop flags (here: its own)."""

    def check_preempted(self, st: State) -> None:
        """Raise ``Preempted`` when a SIGTERM (on any instance) stops the fit here."""
        self.agree_on_stop(st)
        if st.preempted:
            raise Preempted

    def at_boundary(self, st: State) -> bool:
        """Between two steps: a SIGTERM preempts the fit here (``check_preempted``); True
        when it should stop (``State.should_stop``, agreed by the instances)."""
        self.check_preempted(st)
        return st.should_stop()

    def check_agreement(self, fit: FitSettings) -> None:
        """Before the first step: the instances compare their settings (here: none to)."""

    def checkpoint_state(
        self, st: State, train_metrics: dict[str, Any], sd: dict[str, Any]
    ) -> dict[str, Any]:
        """The run's state for a checkpoint: here, ``sd``."""
        return sd

    def own_state(self, sd: dict[str, Any], train_metrics: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's state for this instance: here, ``sd``."""
        return sd

    @contextlib.contextmanager
    def unsynced(self, metrics: dict[str, Any]) -> Iterator[None]:
        """While this instance works alone (``Loop.validate``), its metrics compute from its
        own states (here: the only ones)."""
        yield


@dataclass(frozen=True)
class FitSettings:
    """What every instance of a run must share as a fit starts (``check_agreement``)."""

    opts: Options  # the training options
    micro: int  # the training plan's micro-batch size
    samples: int | None  # its dataset length
    steps: int | None  # its host calls per epoch
    val_steps: int | tuple[int | None, ...] | None  # the validation plan's, if any (several
    # validation sets: each one's)
    val_every_n_steps: int | None
    epochs: int
    max_steps: int | None
    optimizer: torch.optim.Optimizer
    model: torch.nn.Module
    step: int  # the step counter (after a resume: the checkpoint's)

    def compared(self) -> dict[str, Any]:
        """The settings by name, as the instances compare them."""
        o = self.opts
        return {
            "randomSeed": o.random_seed if o.exists("random_seed") else None,
            "deviceIterations": o.device_iterations,
            "gradientAccumulation": o.Training.gradient_accumulation,
            "replicationFactor": o.replication_factor,
            "micro-batch size": self.micro,
            "training samples": self.samples,
            "training steps per epoch": self.steps,
            "validation steps": self.val_steps,
            "val_every_n_steps": self.val_every_n_steps,
            "epochs": self.epochs,
            "max_steps": self.max_steps,
            "optimizer": type(self.optimizer).__name__,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "step counter": self.step,
        }


ALONE = Processes()  # a run of one instance: what validate() and predict() run as


class ProcessGroup(Processes):
    """The instances of a run started by a launcher, as one ``Loop`` sees them: sums, settings
    and stop flags agreed over a torch.distributed process group, a failure told to all."""

    def __init__(self, rank: int, size: int, launcher: str) -> None:
        self.rank = rank
        self.size = size
        self.launcher = launcher
        self.term_pending = False  # SIGTERM seen here, not yet agreed on
        self.store: Any = None  # the group's store, taken at a failure (None: not described)
        self.failure: tuple[BaseException, BaseException] | None = None  # (error, raised)

    # -- collectives ---------------------------------------------------------------------------
    def _collective_error(self, what: str, e: BaseException) -> RuntimeError:
        if self.failure is not None:  # this instance left the run at a failure already
            return RuntimeError(
                f"Instance {self.rank} of {self.size} cannot go on while {what}: the run's "
                f"instances ended at a failure ({self.failure[1]!r}). Start the run again."
            )
        return RuntimeError(
            f"Instance {self.rank} of {self.size} lost the other instances while {what}: an "
            f"instance died or stopped answering within {timeout_seconds():g} s "
            f"({TIMEOUT_ENV}). ({type(e).__name__}: {e})"
        )

    def sum(self, values: list[float], what: str) -> list[float]:
        """``values`` summed over the instances (float64)."""
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        keep_until_left("ipuloop.processes.sum", t)  # (never freed by a gloo worker)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        except (RuntimeError, ValueError) as e:  # (ValueError: a group left already)
            raise self._collective_error(what, e) from e
        return t.tolist()

    def gather(self, obj: object, what: str) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj)
        except (RuntimeError, ValueError) as e:
            raise self._collective_error(what, e) from e
        return out

    # -- a failure ends every instance's fit -------------------------------------------------
    def failed(self, error: BaseException, st: State) -> BaseException:
        """``error`` is ending this instance's fit: tell the others and leave the process
        group now, so that their collectives fail at once instead of waiting for
        ``IPULOOP_DIST_TIMEOUT``; returns what to raise.

        The first instance to fail leaves its error in the group's store; each instance
        then leaves the group (its connections close, the others' waits fail). An instance
        whose error came after another's (its collective failed because that one left) raises
        ``InstanceFailedError`` naming that instance and its error; the first raises its own,
        as does an instance whose error is the same (e.g. a check every instance made). The
        loop's own exit after an agreed SIGTERM (``SystemExit``) is no failure.
        """
        if isinstance(error, SystemExit) and st.preempted:
            return error
        if self.failure is not None:  # told already (the error passes through twice)
            return self.failure[1] if error in self.failure else error
        notes = "".join(f" ({n})" for n in getattr(error, "__notes__", ()))
        mine = f"{type(error).__name__}: {error}{notes}"[:4000]
        self.store = _default_store()  # (held: it outlives the group, which goes next)
        first = self._first_failure({"instance": self.rank, "error": mine, "step": st.step})
        if first is not None:  # and for a launcher serving the store (ipuloop.emulate.poprun)
            tell_launcher(self.store, first)
        _leave_group()
        raised = error
        if first is not None:
            if first["instance"] == self.rank:
                self._wait_for_readers()
            else:
                self._read()
                if isinstance(error, Exception) and first["error"] != mine:
                    k = first["instance"]
                    raised = InstanceFailedError(
                        f"Instance {k} of {self.size} failed at step {first['step']} with "
                        f"{first['error']}. Instance {self.rank} stopped at step {st.step} "
                        f"because of it (its own error, the __cause__, shows that instance "
                        f"{k} left); the traceback is in instance {k}'s output.",
                        k,
                        first["error"],
                    )
        self.failure = (error, raised)
        return raised

    def _first_failure(self, mine: dict[str, Any]) -> dict[str, Any] | None:
        """The run's first failure (``mine`` when there was none before), from the store."""
        if self.store is None:
            return None
        try:  # the store's host may have gone too: wait seconds, not the run's timeout
            self.store.set_timeout(datetime.timedelta(seconds=STORE_WAIT))
            return json.loads(self.store.compare_set(FAILURE_KEY, "", json.dumps(mine)))
        except Exception:  # noqa: BLE001 (the store is gone or slow: the error is told undescribed)
            return None

    def _read(self) -> None:
        with contextlib.suppress(Exception):
            self.store.add(SEEN_KEY, 1)

    def _wait_for_readers(self) -> None:
        """Keep this process (which may host the store) until the others have read the
        failure, or a few seconds (an instance may be busy, hung, or gone)."""
        deadline = time.monotonic() + STORE_WAIT
        with contextlib.suppress(Exception):
            while self.store.add(SEEN_KEY, 0) < self.size - 1 and time.monotonic() < deadline:
                time.sleep(0.02)

    # -- the loop's hooks ----------------------------------------------------------------------
    def agree_on_stop(self, st: State) -> None:
        """SIGTERM or ``stop()`` on any instance stops them all here (``st``: the loop's
        ``State``)."""
        term, stop = self.sum(
            [float(self.term_pending or st.preempted), float(st.stop_requested)],
            f"ending step {st.step}",
        )
        if term:
            st.preempted = True
            self.term_pending = False
        if stop:
            st.stop_requested = True

    def on_sigterm(self, st: State) -> None:
        """SIGTERM here: every instance stops at the next boundary they agree on."""
        self.term_pending = True

    @contextlib.contextmanager
    def failing_together(self, st: State) -> Iterator[None]:
        """An error escaping the block (``Loop.fit``, from its first check to its last hook)
        on one instance ends the others' fits within seconds, naming it (``failed``)."""
        try:
            yield
        except BaseException as error:
            raised = self.failed(error, st)
            if raised is error:
                raise
            raise raised from error

    def check_agreement(self, fit: FitSettings) -> None:
        """Compare what every instance must share; an instance that differs is named."""
        mine = fit.compared()
        every = self.gather(mine, "comparing the instances' settings")
        for index, theirs in enumerate(every):
            diff = [
                f"{k} {every[0][k]!r} on instance 0 but {theirs[k]!r} on instance {index}"
                for k in mine
                if theirs.get(k) != every[0].get(k)
            ]
            if diff:
                raise ValueError(
                    f"Instance {index} of {self.size} differs from instance 0: "
                    + "; ".join(diff)
                    + ". Every instance must run the same program with "
                    "the same settings (seed, factors, data, epochs); only the launcher's "
                    "environment may differ."
                )

    def checkpoint_state(
        self, st: State, train_metrics: dict[str, Any], sd: dict[str, Any]
    ) -> dict[str, Any]:
        """The run's state for a checkpoint: the train metrics of every instance together,
        and every instance's own random streams (the losses are the run's already)."""
        if st.exception is not None:  # failing: the others may not be here to answer
            sd["processes"] = None
            return sd
        for name, metric in train_metrics.items():
            metric.sync(should_sync=True, distributed_available=lambda: True)
            try:
                sd["metrics"][name] = {
                    **sd["metrics"].get(name, {}),  # (its update count: this instance's)
                    **{
                        n: v.clone()
                        if isinstance(v, torch.Tensor)
                        else list(v)
                        if isinstance(v, list)
                        else v
                        for n, v in ((n, getattr(metric, n)) for n in metric._defaults)
                    },
                }
            finally:
                metric.unsync()
        own = {k: sd.get(k) for k in ("rng", "device_rng", "epoch_rng", "sampler_rng")}
        sd["processes"] = self.gather(own, "gathering the checkpoint's random states")
        return sd

    def own_state(self, sd: dict[str, Any], train_metrics: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's state for this instance: instance 0 holds the metrics' states of
        all, the others start theirs from zero; each takes its own random streams.

        A checkpoint of another number of instances (one process, or a failing run's, which
        holds instance 0's streams alone) gives every instance instance 0's streams: the host
        ones draw each epoch's order, the same on every instance of a run, so the data
        continue exactly (``resume``: at the same sample of the whole run); the device's
        continues instance 0's, where random ops (dropout) draw differently from an
        uninterrupted run of either layout, as they differ between layouts anyway.
        """
        sd = dict(sd)
        every = sd.get("processes")
        if every is not None and len(every) == self.size:
            sd.update(every[self.rank])
        if self.rank != 0:
            sd["metrics"] = {}  # reset below, as at an epoch start
            for m in train_metrics.values():
                m.reset()
        return sd

    @contextlib.contextmanager
    def unsynced(self, metrics: dict[str, Any]) -> Iterator[None]:
        """While this instance works alone (``Loop.validate``), torchmetrics metrics (and
        the metrics inside them) compute from its own states, without gathering the other
        instances' over the process group."""
        saved = []
        for metric in metrics.values():
            for m in metric.modules() if isinstance(metric, torch.nn.Module) else (metric,):
                if hasattr(m, "distributed_available_fn"):
                    saved.append((m, m.distributed_available_fn))
                    m.distributed_available_fn = _no_group
        try:
            yield
        finally:
            for m, fn in saved:
                m.distributed_available_fn = fn


def _leave_group() -> None:
    """Destroy the default process group at once (no meeting: the others may be waiting in
    a collective, which this makes fail); exit then has no group to leave."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            destroy_group()


def _no_group() -> bool:
    return False


def join(opts: Options, inference_opts: Options | None, *, replicas_given: bool) -> Processes:
    """The run this process is an instance of: alone (``Processes``), or one of a run started
    by a launcher (``ProcessGroup``), whose process id and count ``opts`` (and the
    ``inference_opts`` given, if any) then get, and whose process group it joins."""
    launch = detect()
    procs = opts.Distributed.numProcesses
    if procs > 1:  # set by the program (configureProcessId) or read by Options (mpirun)
        rank = opts.Distributed.processId
        size = procs
        launcher = launch.launcher if launch else "the options"
        if launch is not None and (launch.rank, launch.size) != (rank, size):
            raise ValueError(
                f"The options say process {rank} of {size}, but {launch.launcher} started "
                f"instance {launch.rank} of {launch.size}. Leave opts.Distributed unset: the "
                "loop reads the launcher's environment."
            )
    elif launch is None:
        return ALONE
    else:
        rank = launch.rank
        size = launch.size
        launcher = launch.launcher
        opts.Distributed.configureProcessId(rank, size)
    if launch is not None and launch.local_replicas is not None:  # poprun: replicas per instance
        if opts.replication_factor == 1 and not replicas_given:
            opts.replicationFactor(launch.local_replicas)
        elif opts.replication_factor != launch.local_replicas:
            raise ValueError(
                f"poprun gives each instance {launch.local_replicas} replica(s), but the loop "
                f"has replicationFactor {opts.replication_factor}. Leave replicas= unset under "
                "poprun (its --num-replicas / --num-instances decide), or pass the same number."
            )
    if launch is not None and launch.launcher == "poprun":
        _check_popdist_options(opts)
    if inference_opts is not None and inference_opts.Distributed.numProcesses == 1:
        inference_opts.Distributed.configureProcessId(rank, size)
    _init_group(rank, size)
    return ProcessGroup(rank, size, launcher)


def _check_popdist_options(opts: Options) -> None:
    """On an IPU system, PopDist's options also pick the instance's IPUs: say so when the
    program built plain ones (the loop has set their process id and replicas)."""
    try:
        import popdist.poptorch
    except ImportError:  # no Poplar SDK: nothing but the environment to go by
        return
    popdist_options = getattr(popdist.poptorch, "Options", None)
    if isinstance(popdist_options, type) and not isinstance(opts, popdist_options):
        warnings.warn(
            "Running under poprun with options that are not popdist.poptorch.Options: "
            "the loop set their process id and local replicas from PopDist, but "
            "PopDist's own options also select this instance's IPUs. Build them with "
            "popdist.poptorch.Options(ipus_per_replica=...) and pass those to Loop.",
            stacklevel=4,
        )


def configured(opts: Options) -> Options:
    """``opts`` with the launcher's process id and count, when a launcher started us."""
    launch = detect()
    if launch is None or opts.Distributed.numProcesses > 1:
        return opts
    opts = opts.clone()
    opts.Distributed.configureProcessId(launch.rank, launch.size)
    return opts
