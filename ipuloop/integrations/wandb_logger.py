"""``WandbLogger``: the loop's logs, learning rate and throughput in a Weights & Biases run."""

from __future__ import annotations

import os
from typing import Any

from ..callbacks.base import LoopView
from .scalars import ScalarLogger, hyperparameters

__all__ = ["WandbLogger"]

INSTALL = 'pip install "ipuloop[wandb]"'


class WandbLogger(ScalarLogger):
    """Logs to a W&B run what ``TensorBoardLogger`` writes (see ``ScalarLogger``), with the W&B
    step = ``loop.state.update``, the optimizer updates completed.

    The run starts at the first ``fit`` (``wandb.init`` with the arguments below) and is
    finished when the fit ends (exit code 1 after an error, 143 when SIGTERM stopped it). With
    ``log_hparams``, the run's config also gets the options' factors (``device_iterations``,
    ``gradient_accumulation``, ``replicas``, ``instances``) and the optimizer (``optimizer``,
    ``optimizer.lr``, ...). Model files are not uploaded: log a checkpoint yourself with
    ``logger.run.log_artifact`` if you want it in W&B.

    Resuming: the run's id is in the checkpoint, so ``fit(resume_from=...)`` continues the same
    run (``wandb.init(id=..., resume="allow")``). W&B takes no step below the one it reports
    for the resumed run (``run.step``), so the logger sends none of the updates the
    interrupted fit had logged after its last checkpoint: the run keeps their first values,
    which the exact resume computes again (``samples_per_second`` aside). A W&B that does not
    resume offline runs (0.24 ignores ``resume`` offline) reports step 0: the resumed fit then
    writes from the checkpoint's update on, into a new offline folder of the same run.

    Args:
        project: the W&B project (None: W&B's default, ``WANDB_PROJECT``).
        name: the run's display name.
        id: the run's id: continue that run (None: a new one, or the checkpoint's).
        save_dir: the folder W&B writes its files under (None: W&B's, ``WANDB_DIR``).
        config: a dict of your own settings for the run's config.
        tags: the run's tags.
        offline: write the run locally only (``wandb sync`` uploads it later).
        experiment: a run you started (``wandb.init()``): logged to and not finished, as yours.
        log_hparams: add the loop's settings to the run's config.
        **init_kwargs: more ``wandb.init`` arguments (``entity``, ``group``, ``notes``, ...).

    Needs ``pip install "ipuloop[wandb]"``. Example::

        loop = Loop(model, opts, callbacks=[WandbLogger(project="mnist", name="di8")])
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        *,
        id: str | None = None,
        save_dir: str | os.PathLike | None = None,
        config: dict[str, Any] | None = None,
        tags: list[str] | None = None,
        offline: bool = False,
        experiment: Any = None,
        log_hparams: bool = True,
        **init_kwargs: Any,
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                f"WandbLogger needs the wandb package, which is not installed "
                f"({e}). Install it with: {INSTALL}"
            ) from e
        super().__init__()
        self._wandb = wandb
        self._init = {
            k: v
            for k, v in dict(
                project=project, name=name, config=config, tags=tags, **init_kwargs
            ).items()
            if v is not None
        }
        if offline:
            self._init["mode"] = "offline"
        self.save_dir = os.fspath(save_dir) if save_dir is not None else None
        self.log_hparams = log_hparams
        self.run: Any = experiment  # the wandb run: yours (experiment=) or started by fit
        self._owned = experiment is None  # finish it at the fit's end
        self.run_id: str | None = experiment.id if experiment is not None else id
        self._first = 0  # the first W&B step this fit may log: the run holds the ones below

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.run_id is None:  # an id or run given to the logger is the one to log to
            self.run_id = state.get("run_id")

    def on_fit_start(self, loop: LoopView) -> None:
        super().on_fit_start(loop)
        if self.run is None:
            kwargs = dict(self._init)
            if self.save_dir is not None:
                os.makedirs(self.save_dir, exist_ok=True)
                kwargs["dir"] = self.save_dir
            if self.run_id is not None:
                kwargs.update(id=self.run_id, resume="allow")
            self.run = self._wandb.init(**kwargs)
            self.run_id = self.run.id
        # W&B's next step: after a resume, one past the last step the run already has
        self._first = self.run.step
        if self.log_hparams:
            self.run.config.update(hyperparameters(loop), allow_val_change=True)

    def log_scalars(self, values: dict[str, float], update: int) -> None:
        if update >= self._first:  # W&B would drop a lower step, with a warning each time
            self.run.log(values, step=update)

    def _finish(self, exit_code: int) -> None:
        if self.run is not None and self._owned:
            self.run.finish(exit_code=exit_code)
            self.run = None

    def on_fit_end(self, loop: LoopView) -> None:
        super().on_fit_end(loop)
        self._finish(143 if loop.state.preempted else 0)

    def on_exception(self, loop: LoopView) -> None:
        super().on_exception(loop)
        self._finish(1)
