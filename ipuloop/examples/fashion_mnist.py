"""Fashion-MNIST with a small CNN: ``python -m ipuloop.examples.fashion_mnist``.

Graphcore's "Getting Started with PyTorch Lightning for the IPU" trains a LightningModule on
torchvision's FashionMNIST: the classification CNN of the PopTorch basics tutorial (conv 3x3,
max-pool, conv 5x5, GroupNorm, two linear layers, log-softmax), an NLL loss in
``training_step`` and SGD from ``configure_optimizers``. This is that program written with
``ipuloop.Loop``: the network is a plain ``nn.Module``, the loss is ``loss_fn=``, the optimizer
is passed in, and accuracy is a torchmetrics metric, computed on the training and the test
set every epoch. Runs on IPUs with poptorch installed, else on the emulator.
``benchmarks/fashion_mnist_torch.py`` is the same program written in plain torch.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import time

import torch
import torch.nn as nn

__all__ = ["ClassificationModel", "load_fashion_mnist", "main"]

FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class ClassificationModel(nn.Module):
    """The PopTorch basics tutorial's CNN for 28x28 greyscale images; returns log-probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 5, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(5, 12, 5)
        self.norm = nn.GroupNorm(3, 12)
        self.fc1 = nn.Linear(972, 100)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(100, 10)
        self.log_softmax = nn.LogSoftmax(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.conv1(x)))
        x = self.norm(self.relu(self.conv2(x)))
        x = torch.flatten(x, start_dim=1)
        x = self.relu(self.fc1(x))
        return self.log_softmax(self.fc2(x))


class MissingData(RuntimeError):
    pass


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ipuloop", "fashion-mnist")


def _root(data_dir: str) -> str:
    """A torchvision root holding ``FashionMNIST/raw/<file>`` uncompressed.

    ``data_dir`` when its files are uncompressed already. When it holds only the ``.gz`` files,
    they are decompressed into ``$XDG_CACHE_HOME/ipuloop/fashion-mnist`` (default ``~/.cache``),
    never beside them: the data folder may be read-only, and torchvision would check the
    ``.gz`` files against its own checksums and download again when they differ.
    """
    raw = os.path.join(data_dir, "FashionMNIST", "raw")
    if all(os.path.exists(os.path.join(raw, n)) for n in FILES) or not all(
        os.path.exists(os.path.join(raw, n + ".gz")) for n in FILES
    ):
        return data_dir  # complete, or nothing to decompress: torchvision reads or downloads
    cache = _cache_dir()
    out = os.path.join(cache, "FashionMNIST", "raw")
    os.makedirs(out, exist_ok=True)
    for n in FILES:
        dst = os.path.join(out, n)
        if not os.path.exists(dst):
            with gzip.open(os.path.join(raw, n + ".gz")) as src, open(dst + ".tmp", "wb") as f:
                shutil.copyfileobj(src, f)
            os.replace(dst + ".tmp", dst)  # never a half file under the final name
    return cache


def load_fashion_mnist(data_dir: str, *, train: bool) -> torch.utils.data.TensorDataset:
    """Fashion-MNIST through torchvision, normalised once (ToTensor + Normalize((0.5,), (0.5,)))."""
    import torchvision

    try:
        ds = torchvision.datasets.FashionMNIST(_root(data_dir), train=train, download=True)
    except Exception as e:  # offline and not on disk
        raise MissingData(
            f"Fashion-MNIST was not found in {os.path.join(data_dir, 'FashionMNIST', 'raw')} and "
            f"could not be downloaded ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}).\nPass --data-dir DIR (or set "
            "IPULOOP_DATA_DIR) where DIR/FashionMNIST/raw holds the four Fashion-MNIST files "
            "(train-images-idx3-ubyte.gz, ...), as torchvision lays them out."
        ) from e
    images = ((ds.data.float().div_(255) - 0.5) / 0.5).unsqueeze(1)
    return torch.utils.data.TensorDataset(images, ds.targets)


def data_dir_arg(arg: str | None) -> str:
    """``--data-dir``, else ``$IPULOOP_DATA_DIR``, else ``~/.cache/torchvision``."""
    path = arg or os.environ.get("IPULOOP_DATA_DIR") or os.path.join("~", ".cache", "torchvision")
    return os.path.expanduser(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ipuloop.examples.fashion_mnist",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder holding FashionMNIST/raw (default: $IPULOOP_DATA_DIR, else "
        "~/.cache/torchvision; downloaded when missing and online)",
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="micro-batch size")
    p.add_argument(
        "--device-iterations", type=int, default=10, help="optimizer updates per host call"
    )
    p.add_argument("--learning-rate", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max-steps", type=int, default=None, help="stop after N training steps")
    p.add_argument(
        "--csv",
        default=None,
        metavar="FILE",
        help="write the logs to this CSV file (plot with python -m ipuloop.integrations.plotting)",
    )
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write TensorBoard scalars to this folder",
    )
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "device_iterations"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torchmetrics

    from ipuloop import Callback, Loop, backend_name, poptorch
    from ipuloop.callbacks import CSVLogger
    from ipuloop.integrations.tensorboard import TensorBoardLogger

    data_dir = data_dir_arg(args.data_dir)
    try:
        train_set = load_fashion_mnist(data_dir, train=True)
        test_set = load_fashion_mnist(data_dir, train=False)
    except MissingData as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    callbacks: list[Callback] = []
    if args.csv:
        callbacks.append(CSVLogger(args.csv, every_n_steps=1))
    if args.tensorboard:
        callbacks.append(TensorBoardLogger(args.tensorboard))
    torch.manual_seed(args.seed)
    model = ClassificationModel()
    opts = poptorch.Options().deviceIterations(args.device_iterations)
    loop = Loop(
        model,
        opts,
        loss_fn=nn.NLLLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=args.learning_rate),
        metrics={"accuracy": torchmetrics.Accuracy(task="multiclass", num_classes=10)},
        callbacks=callbacks,
        seed=args.seed,
    )
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.batch_size)
    print(
        f"backend: {backend_name()}; micro-batch {args.batch_size} x "
        f"{args.device_iterations} device iterations",
        flush=True,
    )
    start = time.perf_counter()
    loop.fit(train_loader, epochs=args.epochs, val_loader=test_loader, max_steps=args.max_steps)
    train_time = time.perf_counter() - start
    logits = loop.predict(test_loader)  # every test sample, in order
    acc = (logits.argmax(dim=1) == test_set.tensors[1]).double().mean().item() * 100
    st = loop.state
    print(
        f"trained {st.step} steps ({st.update} updates, {st.samples} samples) in {train_time:.1f}s"
    )
    print(f"Accuracy on test set: {acc:0.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
