"""``ModelCheckpoint``: when to save the loop, its checkpoints written and named, and exact resume.

Which checkpoints are kept (the monitored log, top-k, best so far) is ``ranking.py``'s.

How bytes reach the disk (atomic writes, the manifest as the commit, verification, finding
the newest) is ``ipuloop.checkpoint_io``'s. Save order: write, commit, then rotate the old
ones out. A save that fails (disk full, Ctrl-C) removes its own
uncommitted folder; what a killed save leaves (temporary files, a folder without a manifest,
old checkpoints its rotation did not reach, which each checkpoint lists) goes at the next start.
"""

from __future__ import annotations

import io as _bytes
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint_io as cio
from ..checkpoint_io import (
    FORMAT_VERSION,
    MANIFEST,
    STATE,
    TMP_PREFIX,
    CheckpointError,
    load_checkpoint,
    read_manifest,
)
from ..exceptions import NonFiniteLossError
from ..rules import check_int
from ..state import State
from .base import Callback, LoopView, check_monitor, check_val_set, overridden
from .checkpoint_names import check_filename, fields, without
from .ranking import Ranking

__all__ = [
    "ModelCheckpoint",
    "CheckpointError",
    "load_checkpoint",
    "read_manifest",
    "FORMAT_VERSION",
]


class ModelCheckpoint(Callback):
    """Saves the loop every N epochs and/or steps, keeps the best k, and enables resume.

    Args:
        dirpath: folder of the checkpoints (created); nothing is written outside it.
        every_n_epochs: save at ``on_epoch_end`` every N epochs (None or 0: never).
        every_n_steps: save at ``on_train_step_end`` every N training steps (host calls).
        monitor: a log name (``loop.state.logs``) ranking the checkpoints; None ranks by age.
        mode: "min" or "max": which monitored value is better.
        save_top_k: how many of the best (or newest) to keep; -1 keeps all.
        save_last: also keep the newest checkpoint, whatever its rank.
        save_on_exception: when fit raises (not on Ctrl-C), save once as ``<name>-exception``,
            "tainted" if the cause is a non-finite loss or a failure inside a hook of a callback
            whose state the checkpoint holds (e.g. ``LRScheduler``); never rotated out.
        filename: the folder name, formatted with the counters (``{epoch}``, ``{step}``,
            ``{update}``, ``{micro_batch}``, ``{samples}``, ``{epoch_step}``) and the logs the
            loop writes (``{loss}``, ``{train_<name>}``, ``{val_<name>}``) or the monitored
            one, e.g. ``"epoch{epoch}-step{step}-{val_loss:.3f}"``. Checked here: it must hold
            ``{step}`` (or ``{update}``, ``{micro_batch}``, ``{samples}``) so that every save
            has its own name, no path separator, and with ``every_n_steps`` no ``train_``
            log (written at epoch ends only), and a ``val_`` log only when
            ``fit(val_every_n_steps=)`` divides ``every_n_steps``, so that each step save
            follows a validation of its weights (checked when the fit starts). A SIGTERM or
            exception save is always written: a log its filename names that does not exist
            yet (or, an epoch log, belongs to an earlier step's weights) is left out of its
            name, with the text just before it, and a warning says so.
        name: tells this checkpointer from others on the same loop (e.g. "best" beside
            "every100"): its ``state_key`` is ``ModelCheckpoint[<name>]``, so each one resumes
            its own kept list and best score. None: a key made of its settings
            (``ModelCheckpoint{dirpath=..., monitor=..., ...}``), so that checkpointers with
            other folders or settings need no name; name one to change its settings between
            a run and its resume and keep its state.
        load_best_at_end: when the fit ends (not on SIGTERM or an exception), load the
            weights of ``best_path`` into the model. Needs ``monitor``. Weights only: the
            optimizer state, counters and logs stay the last step's, and ``resume_from``
            still continues from the checkpoints. On several processes each instance loads
            them (from memory when this fit saved the best, else from its file).

    Ranking. With ``monitor``, a save is ranked by the monitored value only when that value
    was computed from the weights it holds: an epoch log (``train_``/``val_``) at the step
    where it was written (the epoch end, or a validation), any other log (such as
    ``loss``, written every step) at every step. Other saves, e.g. a mid-epoch step save
    beside ``monitor="val_loss"`` (the last validation scored earlier weights), are kept
    *unranked*: never among the best ``save_top_k``, kept as the last (``save_last``) until
    the next save, and all kept with ``save_top_k=-1``. To keep the best by a validation
    log, save at epoch ends (``every_n_epochs``), or at the steps where the fit validates:
    with ``fit(val_every_n_steps=N)`` a validation runs before the ``on_train_step_end`` of
    every N-th step, so ``every_n_steps`` a multiple of N ranks each step save by it.
    ``best_path``, ``best_score`` and ``best_k`` give the ranked ones; ``last_path`` the newest
    regular save.

    A save at a step that already has a checkpoint (the epoch-end save after the step save of
    the epoch's last step) replaces it, so one state is never kept under two names. The folder
    must be writable: checked when the fit starts (``CheckpointError`` naming it and the
    system's reason).

    Several checkpointers (e.g. the best by val_loss beside a frequent step save) are told
    apart by their settings, or by ``name`` when given (two that cannot be told apart fail
    when the ``Loop`` is built), and those sharing a ``dirpath`` need distinct filenames.
    ``fit(resume_from="last")`` loads the newest checkpoint any of them wrote; each restores
    its own state from it.

    Also saves on SIGTERM (``on_preempt``). Example::

        ckpt = ModelCheckpoint("checkpoints", every_n_steps=100, monitor="val_loss")
        Loop(model, opts, loss_fn=loss, callbacks=[ckpt]).fit(loader, 10, resume_from="last")
    """

    order = 90  # after the callbacks that change state or logs at the same event (the save
    # must include their update for this step), before the progress display

    def __init__(
        self,
        dirpath: str | os.PathLike,
        *,
        every_n_epochs: int | None = 1,
        every_n_steps: int | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool = True,
        save_on_exception: bool = True,
        filename: str = "epoch{epoch}-step{step}",
        name: str | None = None,
        load_best_at_end: bool = False,
    ) -> None:
        # (the ranking checks mode first)
        ranking = Ranking(monitor, mode, save_top_k=save_top_k, save_last=save_last)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty str or None. Received: name={name!r}.")
        if load_best_at_end and monitor is None:
            raise ValueError(
                "ModelCheckpoint(load_best_at_end=True) needs monitor=, the log "
                "that says which checkpoint is best (e.g. monitor='val_loss'). "
                "Received: monitor=None."
            )
        check_int("every_n_epochs", every_n_epochs, 0, optional=True)
        check_int("every_n_steps", every_n_steps, 0, optional=True)
        check_int("save_top_k", save_top_k, -1)
        self.dirpath = Path(dirpath)
        if self.dirpath.is_file():
            raise CheckpointError(
                self.dirpath,
                "is a file: dirpath must be a folder (created "
                "if missing) for the checkpoint folders",
            )
        check_filename(filename, monitor, every_n_steps)
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.save_on_exception = save_on_exception
        self.filename = filename
        self.name = name
        self.load_best_at_end = load_best_at_end
        self._ranking = ranking  # the kept regular saves, ranked
        self.resumed_from: str | None = None  # never deleted while this fit runs
        self._deferred: list[str] = []  # rotated out while protected: deleted at fit end
        self._saving: str | None = None  # the name being written, recorded in its own state
        self._rotating: list[str] = []  # names this save rotates out, recorded in its own state
        self._pending: list[str] = []  # a resumed state's unfinished rotation: done at fit start
        self._last: tuple | None = None  # counters of the last save (skip identical saves)
        self._in_fit = False
        self._cleaned = False  # _clean_up ran in this process (at fit start, or a first save)
        self._best_weights: tuple[str, dict] | None = None  # load_best_at_end: (name, weights)

    @property
    def state_key(self) -> str:
        """``ModelCheckpoint[<name>]`` with ``name``; without, ``ModelCheckpoint{...}`` made of
        the settings that tell checkpointers apart (folder, filename, when it saves, what it
        ranks by and keeps), so that two differing ones each resume their own state (a
        subclass: its own class name)."""
        key = type(self).__qualname__
        if self.name is not None:
            return f"{key}[{self.name}]"
        settings = {
            "dirpath": str(self.dirpath),
            "filename": self.filename,
            "monitor": self.monitor,
            "mode": self.mode,
            "every_n_epochs": self.every_n_epochs,
            "every_n_steps": self.every_n_steps,
            "save_top_k": self.save_top_k,
            "save_last": self.save_last,
        }
        return key + "{" + ", ".join(f"{k}={v!r}" for k, v in settings.items()) + "}"

    @property
    def former_state_keys(self) -> tuple[str, ...]:
        """The key a checkpoint written before ``state_key`` held its settings gave an unnamed
        checkpointer (its class name): restored from when the loop has no other claimant."""
        return () if self.name is not None else (type(self).__qualname__,)

    def __repr__(self) -> str:
        name = "" if self.name is None else f", name={self.name!r}"
        return f"{type(self).__name__}({str(self.dirpath)!r}{name})"

    # -- what is kept ------------------------------------------------------------------------
    @property
    def monitor(self) -> str | None:
        """The log that ranks the checkpoints (None: by age)."""
        return self._ranking.monitor

    @property
    def mode(self) -> str:
        return self._ranking.mode

    @property
    def save_top_k(self) -> int:
        return self._ranking.save_top_k

    @property
    def save_last(self) -> bool:
        return self._ranking.save_last

    @property
    def kept(self) -> list[dict[str, Any]]:
        """``{"name", "step", "score"}`` of the regular saves kept, oldest first."""
        return self._ranking.kept

    @kept.setter
    def kept(self, entries: list[dict[str, Any]]) -> None:
        self._ranking.kept = entries

    @property
    def best_k(self) -> dict[Path, float]:
        """The best ``save_top_k`` ranked checkpoints, best first: folder -> monitored value
        (not the one kept only as the last). Empty without ``monitor``, and before the first
        ranked save."""
        return {self.dirpath / e["name"]: float(e["score"]) for e in self._ranking.ranked()}

    @property
    def best_path(self) -> Path | None:
        """The folder of the best ranked checkpoint kept (None: none, or no ``monitor``)."""
        ranked = self._ranking.ranked()
        return self.dirpath / ranked[0]["name"] if ranked else None

    @property
    def best_score(self) -> float | None:
        """The monitored value of ``best_path``."""
        ranked = self._ranking.ranked()
        return float(ranked[0]["score"]) if ranked else None

    @property
    def last_path(self) -> Path | None:
        """The folder of the newest regular save kept (exception saves are not listed)."""
        return self.dirpath / self.kept[-1]["name"] if self.kept else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "kept": [dict(e) for e in self.kept],
            "name": self._saving,
            "rotating": list(self._rotating),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Names come from a file: keep only plain names, so rotation stays inside dirpath.
        self.kept = [
            dict(e) for e in state.get("kept", []) if cio.plain_name(str(e.get("name", "")))
        ]
        name = state.get("name")
        self.resumed_from = name if isinstance(name, str) and cio.plain_name(name) else None
        # A crash between a commit and its rotation left these behind: delete them at start.
        self._pending = [
            n for n in state.get("rotating", []) if isinstance(n, str) and cio.plain_name(n)
        ]
        self._ranking.val_at = self._ranking.epoch_end_at = None  # another run's steps
        self._best_weights = None

    # -- events --------------------------------------------------------------------------------
    def on_fit_start(self, loop: LoopView) -> None:
        check_monitor(loop.state, self.monitor, "ModelCheckpoint")
        for field in fields(self.filename):  # a validation set's log, as the fit names them
            check_val_set(loop.state, field, f"ModelCheckpoint: filename={self.filename!r}")
        self._check_step_fields(loop.state.val_every_n_steps)
        loop.check_resumable()  # before training, rather than at the first save
        for other in loop.callbacks:  # two writing the same folders would delete each other's
            if (
                other is not self
                and isinstance(other, ModelCheckpoint)
                and other.filename == self.filename
                and os.path.abspath(other.dirpath) == os.path.abspath(self.dirpath)
            ):
                raise ValueError(
                    f"{self!r} and {other!r} would write the same checkpoint folders "
                    f"(dirpath={str(self.dirpath)!r}, filename={self.filename!r}), and each "
                    "would rotate out the other's. Give them other dirpaths or filenames."
                )
        if loop.state.instance == 0:  # several processes: instance 0 owns the folder
            cio.check_writable(self.dirpath)  # now, rather than at the first save
            self._clean_up()
        else:
            self._cleaned = True
        self._in_fit = True
        self._last = None
        st = loop.state
        if st.step == 0 and st.epoch == 0 and next(self.dirpath.glob(f"*/{MANIFEST}"), None):
            warnings.warn(
                f"ModelCheckpoint: {self.dirpath} already holds checkpoints and this "
                "fit starts from scratch: its checkpoints go beside them, and "
                'resume_from="last" takes the newest written. Pass resume_from= to '
                "continue one, or use another folder.",
                stacklevel=2,
            )

    def _check_step_fields(self, val_every: int | None) -> None:
        """A ``val_`` log in the filename of step saves: each step save must follow a
        validation of its own weights, so every_n_steps must be a multiple of
        ``fit(val_every_n_steps=)``."""
        logs = sorted(f for f in fields(self.filename) if f.startswith("val_"))
        every = self.every_n_steps
        if logs and every and not (val_every and every % val_every == 0):
            raise ValueError(
                f"ModelCheckpoint: filename={self.filename!r} names {{{logs[0]}}}, a "
                f"validation log, and every_n_steps={every} saves at steps that "
                f"fit(val_every_n_steps={val_every}) does not validate, so those saves could "
                "not name their folder. Pass fit(val_every_n_steps=) a divisor of "
                "every_n_steps, leave the log out, or set every_n_steps=None."
            )

    def _clean_up(self) -> None:
        """Remove what a killed process left: temporary files, uncommitted folders, and the
        rotation the resumed checkpoint's save did not finish."""
        self._cleaned = True
        try:
            self.dirpath.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file there, no permission...
            raise CheckpointError(
                self.dirpath, f"cannot be used as the checkpoint folder: {e}"
            ) from e
        for p in [*self.dirpath.glob(TMP_PREFIX + "*"), *self.dirpath.glob(f"*/{TMP_PREFIX}*")]:
            cio.remove(p)  # left by a save that was killed
        for p in self.dirpath.iterdir():  # interrupted saves: a state.pt and no manifest
            if p.is_dir() and {c.name for c in p.iterdir()} <= {STATE}:
                cio.remove(p)
        kept = {e["name"] for e in self.kept}
        resumed_here = self.resumed_from is not None and (self.dirpath / self.resumed_from).is_dir()
        for name in self._pending if resumed_here else ():  # same folder: same run's rotation
            if name not in kept and name != self.resumed_from:
                cio.remove(self.dirpath / name)  # a crash between commit and rotation left it
        self._pending = []

    def on_train_step_end(self, loop: LoopView) -> None:
        if self.every_n_steps and loop.state.step % self.every_n_steps == 0:
            self.save(loop, at_step=True)

    def on_validation_end(self, loop: LoopView) -> None:
        self._ranking.val_at = loop.state.step  # the val logs score the weights of this step

    def on_epoch_end(self, loop: LoopView) -> None:
        self._ranking.epoch_end_at = loop.state.step  # the epoch logs belong to this step's weights
        if self.every_n_epochs and loop.state.epoch % self.every_n_epochs == 0:
            self.save(loop)

    def on_preempt(self, loop: LoopView) -> None:
        if self._last != tuple(loop.state.counters().values()):  # not saved at this point yet
            self.save(loop, at_step=True, always=True)

    def on_fit_end(self, loop: LoopView) -> None:
        self._in_fit = False
        for name in self._deferred:  # the fit succeeded: the resumed-from one may go now
            try:
                cio.remove(self.dirpath / name)
            except OSError as err:
                warnings.warn(
                    f"ModelCheckpoint: could not delete {self.dirpath / name} "
                    f"({err}); a fit resumed from {self.latest()} deletes it.",
                    stacklevel=2,
                )
        self._deferred = []
        self.resumed_from = None
        if self.load_best_at_end and not loop.state.preempted:  # (preempted: the process exits)
            self._load_best(loop)
        self._best_weights = None

    def _load_best(self, loop: LoopView) -> None:
        best = self.best_path
        if best is None:
            warnings.warn(
                f"{self!r}: load_best_at_end, but no checkpoint is ranked by "
                f"monitor={self.monitor!r} (see the class docstring: ranking): the "
                "model keeps the last step's weights.",
                stacklevel=2,
            )
            return
        if self._best_weights is not None and self._best_weights[0] == best.name:
            weights = self._best_weights[1]  # saved by this fit: every instance holds it
        else:  # saved before a resume: read back, verified
            weights = load_checkpoint(best)["model"]
        loop.load_weights(weights)

    def on_exception(self, loop: LoopView) -> None:
        if not (self.save_on_exception and self._in_fit):
            return
        self._in_fit = False
        if isinstance(loop.state.exception, KeyboardInterrupt):
            return  # docs/reliability.md §1.8: no new checkpoint after Ctrl-C
        # Tainted: a non-finite loss, or a callback whose state the checkpoint holds failed
        # inside a hook (e.g. LRScheduler mid-update), so that state may be half-updated.
        source = loop.state.exception_source  # (a failed save restored its own)
        stateful = source not in (None, self) and overridden(source, "state_dict")
        error = loop.state.exception
        self.save(
            loop,
            exception=error,
            tainted=isinstance(error, NonFiniteLossError) or stateful,
            always=True,
        )

    # -- naming --------------------------------------------------------------------------------
    def _name(self, st: State, *, always: bool, exception: BaseException | None) -> str:
        """The folder name: ``filename`` formatted, ``-exception`` after an exception save's.
        ``always``: without the logs that are missing or belong to an earlier step's weights
        (a warning names them), rather than fail."""
        suffix = "-exception" if exception else ""
        values = {**st.logs, **st.counters()}
        fresh = self._ranking.fresh
        named = fields(self.filename)
        gone = {f for f in named if f not in values or (always and not fresh(f, st.step))}
        if not gone:
            return self._plain(self.filename.format(**values) + suffix)
        if not always:
            missing = sorted(f for f in gone if f not in values)[0]
            raise ValueError(
                f"ModelCheckpoint(filename={self.filename!r}): no log "
                f"{missing!r} at epoch {st.epoch}, step {st.step}. Available logs: "
                f"{sorted(st.logs)}."
            )
        name = without(self.filename, gone).format(**values)
        kind = "exception" if exception is not None else "preemption"
        warnings.warn(
            f"ModelCheckpoint: filename={self.filename!r} names "
            f"{', '.join(sorted(gone))}, not logged for the weights of epoch "
            f"{st.epoch}, step {st.step}: the {kind} checkpoint is saved without "
            f"{'it' if len(gone) == 1 else 'them'}, as {name + suffix!r}.",
            stacklevel=2,
        )
        return self._plain(name + suffix)

    def _plain(self, name: str) -> str:
        """``name``, checked to be a plain folder name inside ``dirpath``."""
        if not cio.plain_name(name):
            raise ValueError(
                f"ModelCheckpoint: filename={self.filename!r} gives {name!r}, not a "
                f"plain folder name inside {self.dirpath}."
            )
        return name

    # -- retention -----------------------------------------------------------------------------
    def _rotate(self, old: list[dict[str, Any]], folder: Path) -> None:
        """After ``folder``'s commit, delete the checkpoints of ``old`` no longer kept; the
        resumed-from one, and one that cannot be deleted, wait for the fit's end."""
        kept = {e["name"] for e in self.kept}
        for e in old:
            if e["name"] in kept:
                continue
            if e["name"] == self.resumed_from:
                self._deferred.append(e["name"])
                continue
            try:
                cio.remove(self.dirpath / e["name"])
            except OSError as err:  # the new checkpoint is committed: keep training
                self._deferred.append(e["name"])  # retried at fit end, recorded in saves
                warnings.warn(
                    f"ModelCheckpoint: could not rotate out "
                    f"{self.dirpath / e['name']} ({err}); {folder} is committed. "
                    "Retrying when the fit ends (or at a resume).",
                    stacklevel=3,
                )

    # -- writing -------------------------------------------------------------------------------
    def _write(
        self,
        loop: LoopView,
        folder: Path,
        entry: dict[str, Any],
        old: list[dict[str, Any]],
        *,
        exception: BaseException | None,
        tainted: bool,
    ) -> bool:
        """Write and commit the checkpoint ``entry`` names in ``folder`` (instance 0; the
        others only take the state); whether this instance wrote it. On a failure, ``kept``
        goes back to ``old`` and no partial checkpoint stays behind."""
        st = loop.state
        name = entry["name"]
        kept = {e["name"] for e in self.kept}
        self._saving = name  # both recorded in the checkpoint's own state
        self._rotating = self._deferred + [e["name"] for e in old if e["name"] not in kept]
        touched = False
        try:
            buf = _bytes.BytesIO()
            sd = loop.state_dict()  # fires on_save_checkpoint; reads the device's weights
            torch.save(sd, buf)
            best = self.best_path
            if self.load_best_at_end and not exception and best is not None and best.name == name:
                best_weights: tuple | None = (name, sd["model"])  # for the fit's end (a copy)
            else:
                best_weights = None
            if st.instance == 0:  # several processes: instance 0 writes
                touched = True  # from here on, the folder holds no committed checkpoint
                cio.write_checkpoint(
                    folder,
                    buf.getvalue(),
                    {
                        **st.counters(),
                        "tainted": tainted,
                        "exception": type(exception).__name__ if exception else None,
                        "monitor": self.monitor,
                        "score": entry["score"],
                    },
                )
        except BaseException:
            self.kept = old
            if touched:  # no partial checkpoint stays behind (the old ones are untouched)
                cio.remove(folder)
            raise
        finally:
            self._saving = None
            self._rotating = []
        self._last = tuple(st.counters().values())
        self._best_weights = best_weights or self._best_weights
        return touched

    def save(
        self,
        loop: LoopView,
        *,
        exception: BaseException | None = None,
        tainted: bool = False,
        at_step: bool = False,
        always: bool = False,
    ) -> Path | None:
        """Name, retain, write and commit, then rotate; returns the folder, or None when it is
        not kept.

        ``at_step``: a save between epoch ends, where the monitored log may not exist yet or
        belong to earlier weights (then the save is unranked). ``always`` (SIGTERM and
        exception saves): never fail for the filename's logs (see ``filename``).
        """
        st = loop.state
        if exception is not None and st.instance != 0:
            return None  # several processes: instance 0 saves what it has, alone
        name = self._name(st, always=always, exception=exception)
        if name == self.resumed_from:
            warnings.warn(
                f"Not overwriting {self.dirpath / name}: this fit resumed from it.", stacklevel=2
            )
            return None
        folder = self.dirpath / name
        if (
            self._last == tuple(st.counters().values())
            and name in {e["name"] for e in self.kept}
            and (folder / MANIFEST).is_file()
        ):
            return folder  # saved at this point already: rewriting it would only risk it
        if not self._cleaned:  # a save before any fit: a killed process's leftovers go first
            self._clean_up()
        old = self.kept
        entry = self._ranking.retain(
            st, name, at_step=at_step, always=always, apart=exception is not None
        )
        if entry is None:
            return None
        if self._write(loop, folder, entry, old, exception=exception, tainted=tainted):
            self._rotate(old, folder)
        return folder

    # -- finding -------------------------------------------------------------------------------
    def latest(self, *, include_tainted: bool = False) -> Path | None:
        """The newest valid checkpoint written in ``dirpath`` (``checkpoint_io.find_latest``)."""
        return cio.find_latest(self.dirpath, include_tainted=include_tainted)

    def resume_path(self) -> Path | None:
        """What ``fit(resume_from="last")`` loads: the newest checkpoint in ``dirpath`` (with
        several checkpointers, the newest any of them wrote: ``callbacks.base.resume_path``)."""
        return self.latest()
