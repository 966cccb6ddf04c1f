"""A callback of your own: record the LR and loss of every step, stop when the loss plateaus.

    python examples/custom_callback.py

A callback subclasses ``ipuloop.Callback`` and overrides the hooks it needs; every hook takes
the loop. Hooks fire once per step (one host call = DI optimizer updates on the device), never
per micro-batch. Runs on the emulator when poptorch is not installed, in a few seconds.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import torch.nn as nn

from ipuloop import Callback, Loop, poptorch
from ipuloop.callbacks.lr import LRScheduler


class PlateauRecorder(Callback):
    """Records (step, lr, loss) per step; stops the fit when the loss stops improving.

    A step's loss is noisy, so the callback watches its moving average (``smooth`` weight
    on the past). The average "improves" when it drops below ``best * (1 - rel_delta)``;
    after ``patience`` steps in a row without that, the callback calls ``loop.stop()`` and
    the fit ends after the current step.
    """

    def __init__(self, patience: int = 30, rel_delta: float = 0.01, smooth: float = 0.9) -> None:
        self.patience, self.rel_delta, self.smooth = patience, rel_delta, smooth
        self.history: list[dict[str, float]] = []
        self.avg = math.nan
        self.best = math.inf
        self.bad_steps = 0
        self.stopped_at: int | None = None
        self._lr = math.nan

    def on_train_step_start(self, loop: Loop) -> None:
        # Read the LR here: the loop pushes it to the device (setOptimizer) right after this
        # hook, and the step runs it. By on_train_step_end an LRScheduler has moved it on.
        self._lr = float(loop.optimizer.param_groups[0]["lr"])

    def on_train_step_end(self, loop: Loop) -> None:
        st = loop.state
        loss = st.logs["loss"]  # this step's mean loss, already on the host
        a = self.smooth
        self.avg = loss if math.isnan(self.avg) else a * self.avg + (1 - a) * loss
        self.history.append(
            {"step": st.step, "update": st.update, "lr": self._lr, "loss": loss, "avg": self.avg}
        )
        if self.avg < self.best * (1 - self.rel_delta):
            self.best, self.bad_steps = self.avg, 0
        else:
            self.bad_steps += 1
        if self.bad_steps >= self.patience:
            self.stopped_at = st.step
            loop.stop()

    # Saved in checkpoints (ModelCheckpoint), so a resumed fit keeps its patience count.
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "avg": self.avg,
            "best": self.best,
            "bad_steps": self.bad_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history, self.avg, self.best = list(state["history"]), state["avg"], state["best"]
        self.bad_steps = state["bad_steps"]


def make_data(n: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """y = sin(3 x0) + x1 * x2 + noise (std 0.1, so the best MSE is about 0.01)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=g) * 2 - 1
    y = torch.sin(3 * x[:, :1]) + x[:, 1:2] * x[:, 2:3] + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=50, help="upper bound; the callback stops earlier")
    p.add_argument("--patience", type=int, default=30)
    args = p.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # Halve the LR every 200 optimizer updates (= 50 steps of 4 device iterations).
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=200, gamma=0.5)
    recorder = PlateauRecorder(patience=args.patience)

    opts = poptorch.Options().deviceIterations(4)  # 4 updates per host call
    loop = Loop(
        model,
        opts,
        loss_fn=nn.MSELoss(),
        optimizer=optimizer,
        callbacks=[LRScheduler(schedule), recorder],
        progress=False,
        seed=0,
    )
    print(loop.describe())
    train = torch.utils.data.DataLoader(make_data(4096), batch_size=32, shuffle=True)
    loop.fit(train, epochs=args.epochs)

    print(f"{'step':>5} {'update':>6} {'lr':>8} {'loss':>8} {'average':>8}")
    for h in recorder.history[::25] + recorder.history[-1:]:
        print(f"{h['step']:5d} {h['update']:6d} {h['lr']:8.4f} {h['loss']:8.4f} {h['avg']:8.4f}")
    if recorder.stopped_at is not None:
        print(
            f"Stopped at step {recorder.stopped_at} (epoch {loop.state.epoch + 1}): the average "
            f"loss made no 1% improvement on its best, {recorder.best:.4f}, in "
            f"{recorder.patience} steps."
        )
    else:
        print(f"Ran all {args.epochs} epochs; best average loss {recorder.best:.4f}.")


if __name__ == "__main__":
    main()
