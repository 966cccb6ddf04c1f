"""MNIST on four pipelined IPUs, written directly against the PopTorch API.

This is the program from PopTorch's pipelining tutorial: ``import poptorch`` and nothing from
ipuloop. On an IPU system run it with ``python poptorch_mnist_pipeline.py``. Without one, run
it unchanged on ipuloop's emulator:

    python -m ipuloop.emulate examples/poptorch_mnist_pipeline.py --data-dir DIR

where DIR/MNIST/raw holds the MNIST files (torchvision's layout; downloaded when missing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torchvision
from tqdm import tqdm

import poptorch

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class ConvLayer(nn.Module):
    def __init__(self, in_channels, num_filters, kernel_size, pool_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.conv(x)
        x = self.pool(x)
        x = self.relu(x)
        return x


class Network(nn.Module):
    """Four blocks, B1..B4: the pipeline stages are built from these names."""

    def __init__(self):
        super().__init__()
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Linear(320, 256)
        self.layer3_act = nn.ReLU()
        self.layer4 = nn.Linear(256, 10)

    def forward(self, x):
        with poptorch.Block("B1"):
            x = self.layer1(x)
        with poptorch.Block("B2"):
            x = self.layer2(x)
        with poptorch.Block("B3"):
            x = x.view(-1, 320)
            x = self.layer3_act(self.layer3(x))
        with poptorch.Block("B4"):
            x = self.layer4(x)
        return x


class TrainingModelWithLoss(nn.Module):
    """The network plus its loss; the loss joins the last block, B4."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, args, labels=None):
        output = self.model(args)
        if labels is None:
            return output
        with poptorch.Block("B4"):
            loss = self.loss(output, labels)
        return output, loss


def accuracy(predictions, labels):
    _, ind = torch.max(predictions, 1)
    labels = labels[-predictions.size()[0] :]  # Final mode returns only the last micro-batch
    return torch.sum(torch.eq(ind, labels)).item() / labels.size()[0] * 100.0


def mnist_root(data_dir):
    """``data_dir``, or a temporary copy when it is read-only and holds only the .gz files."""
    raw = os.path.join(data_dir, "MNIST", "raw")
    unpacked = all(os.path.exists(os.path.join(raw, f)) for f in MNIST_FILES)
    packed = all(os.path.exists(os.path.join(raw, f + ".gz")) for f in MNIST_FILES)
    if unpacked or not packed or os.access(raw, os.W_OK):
        return data_dir  # torchvision reads it, unpacks in place, or downloads into it
    root = tempfile.mkdtemp(prefix="mnist_")
    os.makedirs(os.path.join(root, "MNIST", "raw"))
    for f in MNIST_FILES:
        shutil.copy(os.path.join(raw, f + ".gz"), os.path.join(root, "MNIST", "raw"))
    return root


def get_datasets(data_dir):
    transform = torchvision.transforms.Compose(
        [
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize((0.1307,), (0.3081,)),
        ]
    )
    root = mnist_root(data_dir)
    try:
        train_dataset = torchvision.datasets.MNIST(
            root, train=True, download=True, transform=transform
        )
        test_dataset = torchvision.datasets.MNIST(
            root, train=False, download=True, transform=transform
        )
    except RuntimeError as e:  # offline and not on disk
        sys.exit(
            f"error: MNIST is not in {os.path.join(data_dir, 'MNIST', 'raw')} and could not "
            f"be downloaded ({str(e).splitlines()[0]}). Pass --data-dir DIR with the MNIST "
            "files in DIR/MNIST/raw."
        )
    finally:
        if root != data_dir:  # the datasets hold their images in memory: drop the copy
            shutil.rmtree(root, ignore_errors=True)
    return train_dataset, test_dataset


def train(training_model, training_data, epochs, max_steps=None):
    nr_steps = len(training_data)
    step = 0
    for epoch in range(1, epochs + 1):
        print(f"Epoch {epoch}/{epochs}")
        bar = tqdm(training_data, total=nr_steps, disable=None)
        total_loss, total_acc, n = 0.0, 0.0, 0
        for data, labels in bar:
            preds, losses = training_model(data, labels)
            mean_loss = torch.mean(losses).item()
            acc = accuracy(preds, labels)
            bar.set_description(f"Loss:{mean_loss:0.4f} | Accuracy:{acc:0.2f}%")
            total_loss, total_acc, n = total_loss + mean_loss, total_acc + acc, n + 1
            step += 1
            if max_steps is not None and step >= max_steps:
                break
        print(
            f"Epoch {epoch}/{epochs}: loss {total_loss / n:0.4f}, "
            f"train accuracy {total_acc / n:0.2f}%",
            flush=True,
        )
        if max_steps is not None and step >= max_steps:
            break


def test(inference_model, test_data):
    nr_steps = len(test_data)
    sum_acc = 0.0
    for data, labels in tqdm(test_data, total=nr_steps, disable=None):
        output = inference_model(data)
        sum_acc += accuracy(output, labels)
    print(f"Accuracy on test set: {sum_acc / nr_steps:0.2f}%")


def parse_args():
    parser = argparse.ArgumentParser(description="MNIST training on four pipelined IPUs")
    parser.add_argument("--batch-size", type=int, default=40, help="training micro-batch size")
    parser.add_argument("--device-iterations", type=int, default=10)
    parser.add_argument("--gradient-accumulation", type=int, default=10)
    parser.add_argument("--test-batch-size", type=int, default=8)
    parser.add_argument("--inference-iterations", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=0.001)
    parser.add_argument("--strategy", choices=["pipelined", "sharded"], default="pipelined")
    parser.add_argument(
        "--offload-optimiser", action="store_true", help="keep the optimiser state in host memory"
    )
    parser.add_argument(
        "--data-dir",
        default="mnist_data/",
        help="torchvision root: DIR/MNIST/raw holds the MNIST files",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=min(16, os.cpu_count() or 1),
        help="data loader worker processes",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop training after this many model calls (smoke runs)",
    )
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def main():
    args = parse_args()
    train_dataset, test_dataset = get_datasets(args.data_dir)

    train_opts = poptorch.Options()
    train_opts.randomSeed(args.seed)
    train_opts.deviceIterations(args.device_iterations)
    train_opts.Training.gradientAccumulation(args.gradient_accumulation)
    stages = [poptorch.Stage(f"B{i}").ipu(i - 1) for i in range(1, 5)]
    if args.strategy == "pipelined":
        train_opts.setExecutionStrategy(poptorch.PipelinedExecution(*stages))
    else:
        train_opts.setExecutionStrategy(poptorch.ShardedExecution(*stages))
    if args.offload_optimiser:
        train_opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False)
        )
    # Return every micro-batch's loss and predictions (costs host transfers; Final is faster).
    train_opts.outputMode(poptorch.OutputMode.All)

    training_data = poptorch.DataLoader(
        train_opts,
        train_dataset,
        batch_size=args.batch_size,
        shuffle=True,
        mode=poptorch.DataLoaderMode.Async,
        num_workers=args.workers,
    )
    test_data = poptorch.DataLoader(
        poptorch.Options().deviceIterations(args.inference_iterations),
        test_dataset,
        batch_size=args.test_batch_size,
        shuffle=True,
        drop_last=True,
        mode=poptorch.DataLoaderMode.Async,
        num_workers=args.workers,
    )

    model = Network()
    model_with_loss = TrainingModelWithLoss(model)
    training_model = poptorch.trainingModel(
        model_with_loss,
        train_opts,
        optimizer=poptorch.optim.AdamW(model.parameters(), lr=args.learning_rate),
    )

    start = time.perf_counter()
    train(training_model, training_data, args.epochs, args.max_steps)
    print(f"Training took {time.perf_counter() - start:0.1f}s")
    training_data.terminate()
    # Free the IPUs for the inference model (this also copies the trained weights to the host).
    training_model.detachFromDevice()

    inf_options = train_opts.clone()
    inf_options.Training.gradientAccumulation(1)
    inf_options.deviceIterations(args.inference_iterations)
    inference_model = poptorch.inferenceModel(model, inf_options)
    test(inference_model, test_data)
    test_data.terminate()
    inference_model.detachFromDevice()


if __name__ == "__main__":
    main()
