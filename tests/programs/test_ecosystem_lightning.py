"""Lightning's IPU strategy (lightning-graphcore 0.1.0, pytorch-lightning 2.0.x) on the
emulator: programs written as the library's documentation shows them, run unmodified with
``python -m ipuloop.emulate``, give plain torch's numbers (weights after ``fit``, the losses
each step returns, ``validate``'s, ``test``'s and ``predict``'s outputs).

The programs run in one subprocess (Lightning patches its own modules while it runs; a
process of their own leaves this one as it was) and report their numbers as JSON; plain
torch's reference is computed here. The library needs Python 3.8 and torch 2.0: elsewhere
the module is skipped, unless ``IPULOOP_REQUIRE_ECOSYSTEM=1`` asks for it (CI sets it in its
Python 3.8 environment, which installs the ``lightning-graphcore`` extra).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("IPULOOP_REQUIRE_ECOSYSTEM") == "1":
    import lightning_graphcore  # noqa: F401  # required: a missing install fails
else:
    pytest.importorskip("lightning_graphcore")

pytestmark = pytest.mark.slow  # a library's programs in subprocesses
REPO = Path(__file__).resolve().parents[2]

# The data both sides use: 64 samples of y = x @ w + noise, no random generator involved.
DATA = """
N, F_IN = 64, 3
X = torch.sin(torch.arange(N * F_IN, dtype=torch.float32).view(N, F_IN) * 0.7)
Y = X @ torch.tensor([[0.5], [-1.0], [2.0]]) + 0.1 * torch.cos(torch.arange(N * 1.0)).view(N, 1)
"""
LR = 0.1
BATCH = 4  # the DataLoaders' batch size: a micro-batch

PROGRAM = (
    """
import json, sys, traceback
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import poptorch
import pytorch_lightning as pl
from lightning_graphcore import IPUAccelerator, IPUPrecision, IPUStrategy
"""
    + DATA
    + f"""
LR, BATCH = {LR}, {BATCH}
"""
    + """

class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(F_IN, 1)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.zero_()

    def forward(self, x):
        return self.fc(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        return F.l1_loss(self(x), y)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def loader(self):
        return DataLoader(TensorDataset(X, Y), batch_size=BATCH)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = loader


class Pipelined(Regression):
    # the documentation's model parallelism: a block per IPU
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hidden = poptorch.BeginBlock(torch.nn.Linear(F_IN, 4), ipu_id=0)
        self.fc = poptorch.BeginBlock(torch.nn.Linear(4, 1), ipu_id=1)

    def forward(self, x):
        return self.fc(torch.relu(self.hidden(x)))


class Outputs(pl.Callback):
    def __init__(self):
        self.train, self.val, self.test = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, *_):
        self.train.append(outputs["loss"].float().tolist())

    def on_validation_batch_end(self, trainer, module, outputs, *_):
        self.val.append(outputs.float().tolist())

    def on_test_batch_end(self, trainer, module, outputs, *_):
        self.test.append(outputs.float().tolist())


def run(model, **trainer_kwargs):
    try:
        return fit_and_infer(model, **trainer_kwargs)
    except Exception:  # reported by the scenario's test; the others run
        return dict(error=traceback.format_exc())


def fit_and_infer(model, **trainer_kwargs):
    outputs = Outputs()
    trainer = pl.Trainer(
        max_epochs=1, num_sanity_val_steps=0, callbacks=[outputs],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **trainer_kwargs,
    )
    trainer.fit(model)
    weights = {n: p.detach().float().tolist() for n, p in model.named_parameters()}
    outputs.val = []  # fit's own validation, at the same weights: validate's only
    trainer.validate(model, verbose=False)
    trainer.test(model, verbose=False)
    predictions = torch.cat(trainer.predict(model)).float().tolist()
    return dict(weights=weights, train=outputs.train, val=outputs.val, test=outputs.test,
                predictions=predictions, strategy=type(trainer.strategy).__module__)


results = {}
for d, a, r in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]:
    results[f"d{d}a{a}r{r}"] = run(
        Regression(), accelerator="ipu", devices=r, accumulate_grad_batches=a,
        strategy=IPUStrategy(device_iterations=d),
    )
results["strategy_only"] = run(Regression(), strategy=IPUStrategy(device_iterations=2), devices=2)
results["accelerator_instance"] = run(
    Regression(), accelerator=IPUAccelerator(), devices=1,
    strategy=IPUStrategy(precision_plugin=IPUPrecision("32-true")),
)
training_opts = poptorch.Options()
training_opts.outputMode(poptorch.OutputMode.All)
training_opts.deviceIterations(4)
inference_opts = poptorch.Options()
inference_opts.deviceIterations(4)
results["options"] = run(
    Regression(), accelerator="ipu", devices=1,
    strategy=IPUStrategy(training_opts=training_opts, inference_opts=inference_opts),
)
results["pipelined"] = run(
    Pipelined(), accelerator="ipu", devices=1, accumulate_grad_batches=4,
    strategy=IPUStrategy(device_iterations=2),
)
results["mixed16"] = run(
    Regression(), accelerator="ipu", devices=2, precision=16, strategy=IPUStrategy()
)
json.dump(results, open(sys.argv[1], "w"))
"""
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lightning")
    (folder / "train.py").write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("IPULOOP_EMULATOR_IPUS", None)  # the default system of python -m ipuloop.emulate
    done = subprocess.run(
        [sys.executable, "-m", "ipuloop.emulate", "train.py", "results.json"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads((folder / "results.json").read_text())


def data():
    scope = {"torch": torch}
    exec(DATA, scope)
    return scope["X"], scope["Y"]


class Regression(torch.nn.Module):
    """The program's model in plain torch: zero weights, or a seeded two-layer one."""

    def __init__(self, pipelined=False):
        super().__init__()
        if pipelined:
            with torch.random.fork_rng():  # the program's seed, this process's generator kept
                torch.manual_seed(0)
                self.hidden = torch.nn.Linear(3, 4)
                self.fc = torch.nn.Linear(4, 1)
        else:
            self.hidden = None
            self.fc = torch.nn.Linear(3, 1)
            with torch.no_grad():
                self.fc.weight.zero_()
                self.fc.bias.zero_()

    def forward(self, x):
        return self.fc(x if self.hidden is None else torch.relu(self.hidden(x)))


def reference(step, pipelined=False):
    """SGD on consecutive batches of ``step`` samples, the loss their mean: what replicas
    and gradient accumulation with mean reduction (PopTorch's default) compute. Returns the
    model and the loss of each BATCH-sample micro-batch at the weights of its step."""
    x, y = data()
    model = Regression(pipelined)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    micro = []
    for i in range(0, len(x), step):
        with torch.no_grad():
            micro += [
                F.mse_loss(model(x[j : j + BATCH]), y[j : j + BATCH]).item()
                for j in range(i, i + step, BATCH)
            ]
        optimizer.zero_grad()
        F.mse_loss(model(x[i : i + step]), y[i : i + step]).backward()
        optimizer.step()
    return model, micro


def close(got, want, tol=1e-6):
    torch.testing.assert_close(torch.tensor(got), torch.as_tensor(want), atol=tol, rtol=tol)


def check_inference(result, model, tol=1e-6, iterations=1, replicas=1):
    """validate's and test's step outputs (each micro-batch's loss, in order) and predict's
    outputs, at the weights ``fit`` left."""
    x, y = data()
    with torch.no_grad():
        mse = [
            F.mse_loss(model(x[j : j + BATCH]), y[j : j + BATCH]).item() for j in range(0, 64, 4)
        ]
        l1 = [F.l1_loss(model(x[j : j + BATCH]), y[j : j + BATCH]).item() for j in range(0, 64, 4)]
        close(result["predictions"], model(x), tol)
    per_call = iterations * replicas
    if per_call == 1:
        close(result["val"], mse, tol)
        close(result["test"], l1, tol)
    else:
        close([v for call in result["val"] for v in call], mse, tol)
        close([v for call in result["test"] for v in call], l1, tol)
        assert len(result["val"]) == 64 // (BATCH * per_call)


def check_weights(result, model, tol=1e-6):
    assert "error" not in result, result["error"]
    assert result["strategy"] == "lightning_graphcore.strategy"
    want = dict(model.named_parameters())
    assert set(result["weights"]) == set(want)
    for name, got in result["weights"].items():
        close(got, want[name].detach(), tol)


def test_fit_validate_test_predict_on_one_ipu(results):
    model, micro = reference(BATCH)
    check_weights(results["d1a1r1"], model)
    close(results["d1a1r1"]["train"], micro)
    check_inference(results["d1a1r1"], model)


def test_device_iterations_step_as_many_times_per_call(results):
    """device_iterations=2: two optimizer steps a call, the last one's loss returned
    (training's default OutputMode.Final); inference returns each iteration's."""
    model, micro = reference(BATCH)
    check_weights(results["d2a1r1"], model)
    close(results["d2a1r1"]["train"], micro[1::2])
    check_inference(results["d2a1r1"], model, iterations=2)


def test_gradient_accumulation_steps_on_the_mean_of_its_micro_batches(results):
    model, micro = reference(2 * BATCH)
    check_weights(results["d1a2r1"], model)
    # the last micro-batch's loss, which Lightning divides by accumulate_grad_batches
    close(results["d1a2r1"]["train"], [m / 2 for m in micro[1::2]])
    check_inference(results["d1a2r1"], model)


def test_replicas_step_on_the_mean_of_their_micro_batches(results):
    """devices=2: two replicas, each on its BATCH samples, each returning its loss."""
    model, micro = reference(2 * BATCH)
    check_weights(results["d1a1r2"], model)
    close(results["d1a1r2"]["train"], [micro[i : i + 2] for i in range(0, len(micro), 2)])
    check_inference(results["d1a1r2"], model, replicas=2)


def test_device_iterations_replicas_and_accumulation_together(results):
    model, _ = reference(2 * 2 * BATCH)
    check_weights(results["d2a2r2"], model)
    assert len(results["d2a2r2"]["train"]) == 64 // (BATCH * 8)
    check_inference(results["d2a2r2"], model, iterations=2, replicas=2)


def test_the_strategy_alone_picks_the_ipus(results):
    """Trainer(strategy=IPUStrategy(...), devices=2): the IPU accelerator is found."""
    model, _ = reference(2 * BATCH)
    check_weights(results["strategy_only"], model)
    check_inference(results["strategy_only"], model, iterations=2, replicas=2)


def test_an_ipu_accelerator_instance_with_the_ipu_precision(results):
    model, micro = reference(BATCH)
    check_weights(results["accelerator_instance"], model)
    close(results["accelerator_instance"]["train"], micro)
    check_inference(results["accelerator_instance"], model)


def test_poptorch_options_of_ones_own(results):
    """training_opts and inference_opts given: four steps a call, every step's loss returned
    (OutputMode.All), inference four micro-batches a call."""
    model, micro = reference(BATCH)
    check_weights(results["options"], model)
    close(results["options"]["train"], [micro[i : i + 4] for i in range(0, len(micro), 4)])
    check_inference(results["options"], model, iterations=4)


def test_a_model_pipelined_over_two_ipus(results):
    """poptorch.BeginBlock in the LightningModule: two stages, gradient accumulation of 4."""
    model, _ = reference(4 * BATCH, pipelined=True)
    check_weights(results["pipelined"], model)
    check_inference(results["pipelined"], model, iterations=2)


def test_16_bit_mixed_precision_trains_the_float32_weights(results):
    """precision=16: the batch in float16, the weights float32, on two replicas: float32's
    numbers to float16's precision."""
    model, _ = reference(2 * BATCH)
    check_weights(results["mixed16"], model, tol=2e-3)
    check_inference(results["mixed16"], model, tol=5e-3, replicas=2)
