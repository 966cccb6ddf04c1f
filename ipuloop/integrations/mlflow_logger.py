"""``MLFlowLogger``: the loop's logs, learning rate and throughput as MLflow metrics."""

from __future__ import annotations

import time
import warnings
from typing import Any

from ..callbacks.base import LoopView
from .scalars import ScalarLogger, hyperparameters

__all__ = ["MLFlowLogger"]

INSTALL = 'pip install "ipuloop[mlflow]"'


class MLFlowLogger(ScalarLogger):
    """Logs to an MLflow run what ``TensorBoardLogger`` writes (see ``ScalarLogger``), each
    metric point with step = ``loop.state.update``, the optimizer updates completed.

    The first ``fit`` creates the run in ``experiment_name`` (created if missing), or logs to
    ``run_id``; the run ends when the fit does: FINISHED, FAILED after an error, KILLED when
    SIGTERM stopped it. With ``log_hparams``, the run's parameters get the options' factors
    (``device_iterations``, ``gradient_accumulation``, ``replicas``, ``instances``) and the
    optimizer (``optimizer``, ``optimizer.lr``, ...); MLflow never changes a parameter, so a
    later fit adds only the new ones and warns about those it would change. Model files are
    not logged.

    Resuming: the run's id is in the checkpoint, so ``fit(resume_from=...)`` continues the same
    run (set RUNNING again). MLflow keeps every point it is sent and cannot delete one, so the
    resumed fit reads each metric's history once and does not send a point at an update the
    run already has for that metric: the points the interrupted fit logged between its last
    checkpoint and the interruption stay (the exact resume gives them the same values;
    ``samples_per_second`` keeps the first measurement) and appear once.

    Args:
        experiment_name: the MLflow experiment of a new run.
        run_name: a new run's name (None: MLflow picks one).
        tracking_uri: where MLflow stores runs: a server (``http://...``), ``databricks``, or a
            local store (``sqlite:///mlflow.db``, which needs the ``mlflow`` package or
            SQLAlchemy and Alembic). None: MLflow's default (``MLFLOW_TRACKING_URI``).
        tags: a new run's tags.
        run_id: an existing run to log to (None: a new one, or the checkpoint's).
        log_hparams: log the loop's settings as the run's parameters.
        synchronous: False (default) queues each step's points for a thread of MLflow's
            that sends them, so the step does not wait for the store (the queue is flushed
            when the fit ends, or raises); True waits for each request; None: MLflow's
            default (``MLFLOW_ENABLE_ASYNC_LOGGING``).

    Needs ``pip install "ipuloop[mlflow]"`` (``mlflow-skinny``, MLflow's client). Example::

        loop = Loop(model, opts, callbacks=[MLFlowLogger("mnist", tracking_uri="http://host:5000")])
    """

    def __init__(
        self,
        experiment_name: str = "ipuloop",
        run_name: str | None = None,
        *,
        tracking_uri: str | None = None,
        tags: dict[str, Any] | None = None,
        run_id: str | None = None,
        log_hparams: bool = True,
        synchronous: bool | None = False,
    ) -> None:
        try:
            import mlflow  # noqa: F401  (the package itself: its submodules may be cached)
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError(
                f"MLFlowLogger needs MLflow, which is not installed ({e}). "
                f"Install it with: {INSTALL}"
            ) from e
        super().__init__()
        self._metric = Metric
        self._param = Param
        self._client_type = MlflowClient
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.tags = dict(tags or {})
        self.run_id = run_id
        self.log_hparams = log_hparams
        self.synchronous = synchronous
        self.client: Any = None  # the MlflowClient, from the first fit on
        self._resumed = False  # load_state_dict ran: this fit continues the run's metrics
        self._last: dict[str, int] = {}  # per metric, the last step the run has (resumed fit)
        self._open = False  # the run is RUNNING for this fit
        self._pending: list = []  # metric points not sent yet
        self._queued: list = []  # the queued requests (RunOperations) not yet waited for

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.run_id is None:  # a run_id given to the logger is the one to log to
            self.run_id = state.get("run_id")
        self._resumed = self.run_id is not None

    def on_fit_start(self, loop: LoopView) -> None:
        super().on_fit_start(loop)
        if self.client is None:
            self.client = self._client_type(tracking_uri=self.tracking_uri)
        c = self.client
        if self.run_id is None:
            exp = c.get_experiment_by_name(self.experiment_name)
            exp_id = (
                exp.experiment_id if exp is not None else c.create_experiment(self.experiment_name)
            )
            run = c.create_run(exp_id, run_name=self.run_name, tags=self.tags)
            self.run_id = run.info.run_id
        else:
            run = c.get_run(self.run_id)
            if run.info.status != "RUNNING":
                c.update_run(self.run_id, status="RUNNING")
        self._open = True
        self._last = {}
        self._pending = []
        if self._resumed:  # the points the run has from the interrupted fit are not sent again
            self._last = {
                key: max(m.step for m in c.get_metric_history(self.run_id, key))
                for key in run.data.metrics
            }
            self._resumed = False
        if self.log_hparams:
            self._log_params(run.data.params, hyperparameters(loop))

    def _log_params(self, logged: dict[str, str], params: dict[str, Any]) -> None:
        new = {k: str(v) for k, v in params.items() if k not in logged}
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != str(v))
        if changed:
            warnings.warn(
                f"MLFlowLogger: run {self.run_id} keeps its parameters "
                + ", ".join(f"{k}={logged[k]}" for k in changed)
                + " (MLflow never "
                "changes a parameter); this fit runs "
                + ", ".join(f"{k}={params[k]}" for k in changed)
                + ".",
                stacklevel=2,
            )
        if new:
            self.client.log_batch(self.run_id, params=[self._param(k, v) for k, v in new.items()])

    def log_scalars(self, values: dict[str, float], update: int) -> None:
        now = int(time.time() * 1000)
        last = self._last
        self._pending += [
            self._metric(k, v, now, update) for k, v in values.items() if update > last.get(k, -1)
        ]

    def _send(self) -> None:
        """One request for the points gathered: a step's LR goes with the step's end values."""
        if self._pending:
            points = self._pending
            self._pending = []
            queued = self.client.log_batch(
                self.run_id, metrics=points, synchronous=self.synchronous
            )
            if queued is not None:
                self._queued.append(queued)

    def _wait(self) -> None:
        """Wait for the queued requests. (Through each request: ``mlflow.flush_async_logging``
        would open MLflow's default store, a ``mlflow.db`` in the working directory.)"""
        queued = self._queued
        self._queued = []
        for operations in queued:
            operations.wait()

    def on_train_step_end(self, loop: LoopView) -> None:
        super().on_train_step_end(loop)
        self._send()

    def on_epoch_end(self, loop: LoopView) -> None:
        super().on_epoch_end(loop)
        self._send()
        self._wait()  # the epoch's queued requests are done: the queue stays short

    def _end(self, status: str) -> None:
        if self._open:
            self._open = False
            self._send()
            self._wait()  # the queued points first (if any)
            self.client.set_terminated(self.run_id, status=status)

    def on_fit_end(self, loop: LoopView) -> None:
        super().on_fit_end(loop)
        self._end("KILLED" if loop.state.preempted else "FINISHED")

    def on_exception(self, loop: LoopView) -> None:
        super().on_exception(loop)
        self._end("FAILED")
