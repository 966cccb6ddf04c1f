#!/usr/bin/env python
"""The Fashion-MNIST example written in plain torch, to compare accuracies and times.

    python benchmarks/fashion_mnist_torch.py --data-dir ../shared/data/fashion-mnist

The same program as ``python -m ipuloop.examples.fashion_mnist`` without ipuloop: the same
network (``ClassificationModel``), data preparation, seed, micro-batch, optimizer (SGD, one
update per micro-batch), epochs and NLL loss, with the usual ``zero_grad`` / ``backward`` /
``step`` loop, the test accuracy after every epoch (the example validates on the test set),
then the final test accuracy. Prints its output in the example's format.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn as nn

from ipuloop.examples.fashion_mnist import (
    ClassificationModel,
    MissingData,
    data_dir_arg,
    load_fashion_mnist,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data-dir", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max-steps", type=int, default=None, help="stop after N updates")
    args = p.parse_args(argv)
    data_dir = data_dir_arg(args.data_dir)
    try:
        train_set = load_fashion_mnist(data_dir, train=True)
        test_set = load_fashion_mnist(data_dir, train=False)
    except MissingData as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    model = ClassificationModel()
    torch.manual_seed(args.seed)
    loss_fn = nn.NLLLoss()
    opt = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, drop_last=True
    )
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.batch_size)

    def test_accuracy() -> float:
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(x) for x, _ in test_loader])
        return (logits.argmax(dim=1) == test_set.tensors[1]).double().mean().item() * 100

    print("backend: plain torch", flush=True)
    start = time.perf_counter()
    steps = 0
    for epoch in range(args.epochs):
        if steps == args.max_steps:
            break
        model.train()
        total, count = 0.0, 0
        for x, y in train_loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total, count, steps = total + loss.item(), count + 1, steps + 1
            if steps == args.max_steps:
                break
        # the example validates on the test set every epoch: so does this program
        print(
            f"epoch {epoch + 1}: train_loss {total / count:.4g}  "
            f"val_accuracy {test_accuracy() / 100:.4g}",
            flush=True,
        )
    train_time = time.perf_counter() - start
    acc = test_accuracy()
    print(f"trained {steps} updates ({steps * args.batch_size} samples) in {train_time:.1f}s")
    print(f"Accuracy on test set: {acc:0.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
