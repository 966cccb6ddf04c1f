"""``State``: the loop's counters and logs, owned by the ``Loop`` and read by callbacks.

The running epoch's sums (its loss, the values the model logs) are the training epoch's
accumulator's (``accumulators.TrainEpoch``); ``logs`` holds what they give.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["State", "ESTIMATED", "COUNTERS", "GROWING", "CSV_COUNTERS"]

# The logs' key that names, space-separated, the training values the logs hold that are
# estimates: under an output mode that returns only some micro-batches (Final, EveryN), the
# step's loss, the values the model logs and every train_ value are computed from those alone.
ESTIMATED = "estimated"

# The counters, by name: ``State``'s attributes that count what has completed, as a checkpoint
# holds them and a checkpoint's filename may name them; those larger at every training step;
# those a CSV log's rows begin with.
COUNTERS = ("epoch", "step", "update", "micro_batch", "samples", "epoch_step")
GROWING = ("step", "update", "micro_batch", "samples")
CSV_COUNTERS = ("epoch", "step", "update")


@dataclass
class State:
    """Counters start at 0 and count what has *completed*.

    A step is one host call (DI*GA*RF micro-batches); an update is one optimizer update
    (DI per training step).
    """

    epoch: int = 0  # training epochs completed; the running epoch's index while it runs
    step: int = 0  # training host calls completed, over the whole fit
    update: int = 0  # optimizer updates completed (step * device_iterations)
    micro_batch: int = 0  # training micro-batches completed, all replicas together
    samples: int = 0  # training samples read from the loader (micro_batch * micro-batch
    # size; with input replica grouping, the replicas of a group share theirs)
    epoch_step: int = 0  # host batches the running epoch has read: its steps, and those a
    # hook cancelled (CancelStep: read, never run); where a resume continues the epoch
    # latest step and epoch values (numbers; under Final or EveryN also "estimated", the names
    # of those that are estimates, space-separated: ``accumulators.ESTIMATED``)
    logs: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # one dict per epoch
    compile_time: dict[str, float] = field(default_factory=dict)  # seconds, per executor
    # Several processes (torchrun, mpirun, poprun): this instance's index and their count.
    # Instance 0 alone shows progress, writes logs and checkpoints.
    instance: int = 0
    instances: int = 1
    # The running fit (set when it starts; read by callbacks):
    steps_per_epoch: int | None = None  # training host calls in an epoch; None: length unknown
    max_steps: int | None = None  # fit(max_steps=): the fit ends when ``step`` reaches it
    validates: bool = False  # the fit has a val_loader: val_ logs are written at epoch ends
    val_sets: tuple[str, ...] = ()  # several validation sets: each one's log suffix (its logs
    # are val_loss/<suffix>...); one val_loader: none (val_loss...)
    val_every_n_steps: int | None = None  # fit(val_every_n_steps=): also a validation at each
    # step that is a multiple of it, before that step's on_train_step_end
    summary: str = ""  # what the fit runs (``Loop.summary``), and where a resumed one goes on
    # Flags, read at step boundaries:
    stop_requested: bool = False  # set by Loop.stop(); the fit ends after the current step
    preempted: bool = False  # set by SIGTERM; the fit ends after the current step, exit 143
    # The error being handled (on_exception), and the callback whose hook raised it, if any:
    exception: BaseException | None = None
    exception_source: Any = None

    def start_call(self) -> None:
        """A fit, validation or predict starts: no error is being handled."""
        self.exception = None
        self.exception_source = None

    def start_fit(
        self,
        *,
        steps_per_epoch: int | None,
        max_steps: int | None,
        validates: bool,
        val_sets: tuple[str, ...] = (),
        summary: str = "",
    ) -> None:
        """A fit starts: its settings, no stop flag and no error yet."""
        self.start_call()
        self.summary = summary
        self.stop_requested = False
        self.preempted = False
        self.steps_per_epoch = steps_per_epoch
        self.max_steps = max_steps
        self.validates = validates
        self.val_sets = val_sets

    def should_stop(self) -> bool:
        """Whether the fit ends after this step: ``stop()`` was called or ``max_steps`` is
        reached (SIGTERM is ``preempted``)."""
        return self.stop_requested or (self.max_steps is not None and self.step >= self.max_steps)

    def drop_logs(self, prefix: str, names: Iterable[str]) -> None:
        """Remove the logs ``<prefix><name>`` (and ``<prefix><name>_<part>``, and each
        validation set's ``.../<set>``) of ``names``."""
        for name in names:
            key = prefix + name
            for k in [k for k in self.logs if k == key or k.startswith((key + "_", key + "/"))]:
                del self.logs[k]

    def log_validation(self, logs: dict[str, float], suffix: str) -> None:
        """A validation set's ``logs`` (``suffix``: its name, "" for one set) into the logs: a
        val_loss it has none of this time is dropped, not left stale."""
        if not suffix and "val_loss" not in logs:
            self.drop_logs("val_", ("loss",))
        elif suffix and f"val_loss/{suffix}" not in logs:
            self.logs.pop(f"val_loss/{suffix}", None)
        self.logs.update(logs)

    def counters(self) -> dict[str, int]:
        """The counters by name, as a checkpoint holds them."""
        return {k: getattr(self, k) for k in COUNTERS}

    def load_counters(self, counters: dict[str, Any]) -> None:
        """Set the counters a checkpoint holds (``counters``)."""
        for k, v in counters.items():
            setattr(self, k, int(v))
