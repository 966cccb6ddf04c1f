"""A plain PyTorch model (no PopTorch annotations) trained with ``Loop(..., loss_fn=...)``.

    python examples/plain_model_loss_fn.py

The model is an ordinary ``nn.Sequential``: no ``poptorch.Block``, no loss inside
``forward``. ``loss_fn`` makes it a model-with-loss for the device; ``fit`` validates every
epoch and ``predict`` returns the outputs for every sample in dataset order. Runs on the
emulator when poptorch is not installed, in a few seconds.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
import torchmetrics

from ipuloop import Loop, poptorch


def spirals(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """Three interleaved spiral arms in 2-D, one class per arm, with a little noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=g)
    r = torch.rand(n, generator=g)
    angle = 3 * math.pi * r + labels * (2 * math.pi / 3) + 0.2 * torch.randn(n, generator=g)
    x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1)
    return torch.utils.data.TensorDataset(x, labels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    args = p.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 3)
    )
    # 8 device iterations x 2 accumulated micro-batches of 32: 8 updates per host call,
    # each on the mean gradient of 64 samples.
    opts = poptorch.Options().deviceIterations(8)
    opts.Training.gradientAccumulation(2)
    loop = Loop(
        model,
        opts,
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=torch.optim.AdamW(model.parameters(), lr=5e-3),
        metrics={"acc": torchmetrics.Accuracy(task="multiclass", num_classes=3)},
        progress=16,
        seed=0,
    )  # a progress line every 16 steps

    loader = torch.utils.data.DataLoader
    train = loader(spirals(8192, seed=1), batch_size=32, shuffle=True)
    val = loader(spirals(1024, seed=2), batch_size=32)
    test_set = spirals(1000, seed=3)
    loop.fit(train, epochs=args.epochs, val_loader=val)

    # predict: every sample in order (the last host batch is padded, the padding dropped).
    logits = loop.predict(loader(test_set, batch_size=32))
    x, y = test_set.tensors
    acc = (logits.argmax(dim=1) == y).float().mean().item() * 100
    print(f"predict: {tuple(logits.shape)} logits; test accuracy {acc:.2f}%")

    # The model is still a plain torch module holding the trained weights: run it on the host.
    with torch.no_grad():
        host = model(x)
    print(
        f"host model agrees with predict: max |difference| = "
        f"{(host - logits).abs().max().item():.2e}"
    )


if __name__ == "__main__":
    main()
