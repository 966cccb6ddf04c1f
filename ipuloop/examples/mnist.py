"""MNIST on four pipeline stages: ``python -m ipuloop.examples.mnist``.

The PopTorch pipelining tutorial's program (a four-block CNN, one ``Stage`` per IPU, device
iterations and gradient accumulation, AdamW, inference with options cloned from training)
written with ``ipuloop.Loop``. Runs on IPUs with poptorch installed, else on the emulator.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import logging
import math
import os
import shutil
import sys
import time

import torch
import torch.nn as nn

__all__ = [
    "Network",
    "TrainingModelWithLoss",
    "build_options",
    "strategy_for",
    "load_mnist",
    "main",
]

MEAN = 0.1307
STD = 0.3081  # the tutorial's Normalize((0.1307,), (0.3081,))
STAGES = 4  # blocks B1..B4, one IPU each
MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class ConvLayer(nn.Module):
    def __init__(self, in_channels: int, num_filters: int, kernel_size: int, pool_size: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.pool(self.conv(x)))


class Network(nn.Module):
    """The tutorial's CNN, split into blocks B1..B4 (one pipeline stage each)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Linear(320, 256)
        self.layer3_act = nn.ReLU()
        self.layer4 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ipuloop import poptorch

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
    """The model plus its loss, in the last block (B4), as the tutorial writes it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        from ipuloop import poptorch

        output = self.model(x)
        if labels is None:
            return output
        with poptorch.Block("B4"):
            loss = self.loss(output, labels)
        return output, loss


def build_options(args: argparse.Namespace):
    """Training options as the tutorial sets them, and inference options cloned from them."""
    from ipuloop import poptorch

    opts = poptorch.Options()
    opts.deviceIterations(args.device_iterations)
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    if args.replicas > 1:
        opts.replicationFactor(args.replicas)
    opts.setExecutionStrategy(_strategy(args.strategy))
    if args.offload_optimiser:
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False)  # noqa: FBT003 (PopTorch's API)
        )
    inference = opts.clone()
    inference.Training.gradientAccumulation(1)
    inference.deviceIterations(args.inference_iterations)
    return opts, inference


def strategy_for(gradient_accumulation: int) -> str:
    """The strategy the example's blocks can train with at this GA: "pipelined" where its
    STAGES stages allow it (PopTorch: GA >= 2 x stages - 1), else "sharded" (the same
    computation, one stage at a time)."""
    return "pipelined" if gradient_accumulation >= 2 * STAGES - 1 else "sharded"


def _strategy(name: str):
    """One stage per block, block ``Bi`` on IPU i-1, pipelined or sharded."""
    from ipuloop import poptorch

    strategy = poptorch.PipelinedExecution if name == "pipelined" else poptorch.ShardedExecution
    return strategy(*(poptorch.Stage(f"B{i + 1}").ipu(i) for i in range(STAGES)))


def check_factors(
    opts, inference, strategy: str, *, inference_pipelined: bool, names: dict[str, str]
) -> None:
    """The options' factors against the IPUs and the pipeline, before any data is read.

    ``names`` spells each factor as the user gave it (a flag, or an --ipu-config key).
    Raises ``ValueError`` naming the factor, its value and the fix.
    """
    rf = opts.replication_factor
    ga = opts.Training.gradient_accumulation
    ipus = rf * STAGES
    if not opts.auto_round_num_ipus and (ipus & (ipus - 1) or ipus > 64):
        raise ValueError(
            f"{names['replicas']} {rf}: {rf} replica(s) of {STAGES} IPUs is "
            f"{ipus} IPUs, but PopTorch reserves a power of 2 of IPUs, at most 64. "
            f"Use {names['replicas']} 1, 2, 4, 8 or 16."
        )
    if strategy == "pipelined" and ga < 2 * STAGES - 1:
        raise ValueError(
            f"{names['gradient_accumulation']} {ga} is too small for --strategy "
            f"pipelined: training {STAGES} pipeline stages needs at least "
            f"{2 * STAGES - 1}. Raise it, or use --strategy sharded."
        )
    di = inference.device_iterations
    if inference_pipelined and di < STAGES:
        raise ValueError(
            f"{names['inference_iterations']} {di} is too small for --strategy "
            f"pipelined: inference over {STAGES} pipeline stages needs at least "
            f"{STAGES} device iterations."
        )


def config_options(args: argparse.Namespace):
    """Training and inference options from ``--ipu-config`` and ``--ipu-config-overrides``.

    The file gives the replication, device iterations, accumulation, output mode, memory and
    optimizer settings; the placement stays the network's own (blocks B1..B4 on IPUs 0..3,
    ``--strategy`` for training, sharded for inference), so ``layers_per_ipu`` does not apply
    to this model, and inference uses the IPUs training uses.
    """
    from ipuloop import IPUConfig

    config = IPUConfig.load(args.ipu_config)
    if args.ipu_config_overrides:
        config.update_from_string(args.ipu_config_overrides)
    opts = config.to_options()
    opts.setExecutionStrategy(_strategy(args.strategy))
    inference = config.to_options(for_inference=True)
    inference.setExecutionStrategy(_strategy("sharded"))
    return config, opts, inference


def _data_dir(arg: str | None) -> str:
    if arg:
        return os.path.expanduser(arg)
    env = os.environ.get("IPULOOP_DATA_DIR")
    if env:
        return os.path.expanduser(env)
    return os.path.join(os.path.expanduser("~"), ".cache", "torchvision")


def _cache_dir() -> str:
    return os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "ipuloop",
        "mnist",
    )


def _mnist_root(data_dir: str) -> str:
    """A folder torchvision can read MNIST from without writing into ``data_dir``.

    ``data_dir`` itself when ``MNIST/raw`` holds the unpacked files (or not all four ``.gz``
    files: torchvision then downloads them). When it holds only the ``.gz`` files, they are
    unpacked once into ``$XDG_CACHE_HOME/ipuloop/mnist`` (default ``~/.cache``), keyed by
    their content, never beside them: the data folder may be read-only or shared.
    """
    raw = os.path.join(data_dir, "MNIST", "raw")
    if all(os.path.exists(os.path.join(raw, n)) for n in MNIST_FILES) or not all(
        os.path.exists(os.path.join(raw, n + ".gz")) for n in MNIST_FILES
    ):
        return data_dir
    key = hashlib.sha256()
    for n in MNIST_FILES:  # the content: copies of the same files share one unpacked set
        with open(os.path.join(raw, n + ".gz"), "rb") as f:
            key.update(hashlib.sha256(f.read()).digest())
    root = os.path.join(_cache_dir(), key.hexdigest()[:16])
    out = os.path.join(root, "MNIST", "raw")
    os.makedirs(out, exist_ok=True)
    for n in MNIST_FILES:
        dst = os.path.join(out, n)
        if os.path.exists(dst):
            continue
        tmp = f"{dst}.{os.getpid()}.tmp"  # renamed when whole: a crash leaves no half file
        with gzip.open(os.path.join(raw, n + ".gz"), "rb") as src, open(tmp, "wb") as f:
            shutil.copyfileobj(src, f)
        os.replace(tmp, dst)
    return root


class MissingData(RuntimeError):
    pass


def load_mnist(data_dir: str, *, train: bool):
    """Real MNIST through torchvision, normalised once (the tutorial's ToTensor + Normalize)."""
    import torchvision

    root = _mnist_root(data_dir)
    try:
        ds = torchvision.datasets.MNIST(root, train=train, download=True)
    except Exception as e:  # offline and not on disk
        raise MissingData(
            f"MNIST was not found in {os.path.join(data_dir, 'MNIST', 'raw')} and could not be "
            f"downloaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).\n"
            "To train without a download, put the four MNIST files, unpacked or .gz, in "
            f"DIR/MNIST/raw as torchvision lays them out ({', '.join(MNIST_FILES)}; this "
            "example run on a machine that is online downloads them into "
            "~/.cache/torchvision/MNIST/raw), then pass --data-dir DIR (or set "
            "IPULOOP_DATA_DIR=DIR)."
        ) from e
    # ToTensor scales to [0, 1]; Normalize subtracts the mean and divides by the std. Done once
    # for the whole set, so reading a sample is an index, not a PIL conversion.
    images = ((ds.data.float().div_(255) - MEAN) / STD).unsqueeze(1)
    return torch.utils.data.TensorDataset(images, ds.targets)


class Formatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and each option's default after its help: "(default: 40)",
    "(default: off)" for a switch, "(default: none)" where it is None and the help does not
    say what it is instead."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if "default" in text:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            default = "off"
        elif action.default is None:
            default = "none"
        else:
            default = "%(default)s"
        return f"{text} (default: {default})"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit status 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _default_threads() -> int:
    """Torch threads for this host: its cores less the ones busy (load average), at least 1.

    Small models slow down many times over when torch's threads outnumber the idle cores of
    a busy host.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(torch.get_num_threads(), (cores or 1) - busy))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(
        prog="python -m ipuloop.examples.mnist",
        description=(__doc__ or "").replace("``", ""),  # as text, not reStructuredText
        formatter_class=Formatter,
    )
    p.add_argument("--batch-size", type=int, default=40, help="micro-batch size for training")
    p.add_argument(
        "--device-iterations",
        type=int,
        default=10,
        help="optimizer updates per host call (poptorch deviceIterations)",
    )
    p.add_argument(
        "--gradient-accumulation",
        type=int,
        default=10,
        help="micro-batches per optimizer update; a 4-stage pipeline needs at least 7",
    )
    p.add_argument("--test-batch-size", type=int, default=8, help="micro-batch size for predict")
    p.add_argument(
        "--inference-iterations", type=int, default=100, help="device iterations for inference"
    )
    p.add_argument("--epochs", type=int, default=3, help="training epochs")
    p.add_argument("--learning-rate", type=float, default=0.001, help="AdamW's learning rate")
    p.add_argument(
        "--strategy",
        choices=("pipelined", "sharded"),
        default="pipelined",
        help="how the four stages run: pipelined, or sharded (one stage at a time)",
    )
    p.add_argument(
        "--offload-optimiser", action="store_true", help="keep the optimizer state off-chip"
    )
    p.add_argument("--profile", action="store_true", help="capture a profile of a few steps")
    p.add_argument("--profile-dir", default="./profile", help="where --profile writes")
    p.add_argument("--debug", action="store_true", help="debug logging")
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder holding MNIST/raw (default: $IPULOOP_DATA_DIR, else "
        "~/.cache/torchvision; downloaded when missing and online)",
    )
    p.add_argument(
        "--checkpoint-dir", default=None, help="save a checkpoint every epoch here (default: none)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir",
    )
    p.add_argument(
        "--csv",
        default=None,
        metavar="FILE",
        help="write the logs to this CSV file, a row per step and per epoch "
        "(draw them with python -m ipuloop.integrations.plotting FILE)",
    )
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas")
    p.add_argument(
        "--max-steps", type=int, default=None, help="stop after N training steps (default: all)"
    )
    p.add_argument("--seed", type=int, default=42, help="seeds the data order and the weights")
    p.add_argument("--workers", type=int, default=0, help="data loader worker processes")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: $OMP_NUM_THREADS, else the host's idle cores, at least 1)",
    )
    p.add_argument(
        "--ipu-config",
        default=None,
        metavar="FILE",
        help="an IPUConfig JSON file (or a folder holding ipu_config.json) giving "
        "the options instead of --device-iterations, --gradient-accumulation, "
        "--inference-iterations, --replicas and --offload-optimiser",
    )
    p.add_argument(
        "--ipu-config-overrides",
        default=None,
        metavar="K=V,...",
        help='changes to --ipu-config, e.g. "device_iterations=20,output_mode=all"',
    )
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.ipu_config_overrides and not args.ipu_config:
        p.error("--ipu-config-overrides changes an --ipu-config FILE: pass both")
    for name in (
        "batch_size",
        "device_iterations",
        "gradient_accumulation",
        "test_batch_size",
        "inference_iterations",
        "epochs",
        "replicas",
        "max_steps",
        "threads",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1. Received: {value}")
    if args.workers < 0:
        p.error(f"--workers must be >= 0 (0: load in the main process). Received: {args.workers}")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        p.error(f"--learning-rate must be a finite number > 0. Received: {args.learning_rate}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    import torchmetrics

    from ipuloop import Callback, Loop, backend_name, poptorch

    if args.ipu_config:
        try:
            config, opts, inference = config_options(args)
        except (OSError, ValueError, TypeError) as e:  # unreadable, or invalid values
            print(f"error: --ipu-config {args.ipu_config}: {e}", file=sys.stderr)
            return 2
        factors = (
            config.device_iterations,
            config.gradient_accumulation_steps,
            config.replication_factor,
        )
        names = {
            "replicas": "--ipu-config replication_factor",
            "gradient_accumulation": "--ipu-config gradient_accumulation_steps",
        }
    else:
        opts, inference = build_options(args)
        factors = (args.device_iterations, args.gradient_accumulation, args.replicas)
        names = {
            k: f"--{k.replace('_', '-')}"
            for k in ("replicas", "gradient_accumulation", "inference_iterations")
        }
    try:  # the config's inference options run sharded; the flags' run as training does
        check_factors(
            opts, inference, args.strategy, inference_pipelined=not args.ipu_config, names=names
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    threads = args.threads or (None if os.environ.get("OMP_NUM_THREADS") else _default_threads())
    if threads:
        torch.set_num_threads(threads)
    data_dir = _data_dir(args.data_dir)
    try:
        train_set = load_mnist(data_dir, train=True)
        test_set = load_mnist(data_dir, train=False)
    except MissingData as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    model = Network()
    callbacks: list[Callback] = []
    if args.checkpoint_dir:
        from ipuloop.callbacks.checkpoint import ModelCheckpoint

        callbacks.append(ModelCheckpoint(args.checkpoint_dir))
    if args.csv:
        from ipuloop.callbacks.csv_logger import CSVLogger

        callbacks.append(CSVLogger(args.csv, every_n_steps=1))
    if args.profile:
        from ipuloop.callbacks.profile import ProfileCapture

        callbacks.append(ProfileCapture(dirpath=args.profile_dir))
    accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)
    loop = Loop(
        TrainingModelWithLoss(model),
        opts,
        inference_opts=inference,
        optimizer=poptorch.optim.AdamW(model.parameters(), lr=args.learning_rate),
        metrics={"accuracy": accuracy},
        callbacks=callbacks,
        seed=args.seed,
    )
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers
    )
    from ipuloop.processes import is_main_process, num_processes

    say = print if is_main_process() else (lambda *a, **k: None)  # instance 0 speaks
    procs = num_processes()
    say(
        f"backend: {backend_name()}; strategy: {args.strategy}; micro-batch "
        f"{args.batch_size} x {factors[0]} device iterations x {factors[1]} accumulation x "
        f"{factors[2]} replica(s)"
        + (f" x {procs} processes" if procs > 1 else "")
        + f"; {torch.get_num_threads()} torch thread(s)",
        flush=True,
    )
    start = time.perf_counter()
    loop.fit(
        train_loader,
        epochs=args.epochs,
        max_steps=args.max_steps,
        resume_from="last" if args.resume else None,
    )
    train_time = time.perf_counter() - start

    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.test_batch_size)
    logits = loop.predict(test_loader)  # every test sample, in order
    acc = (logits.argmax(dim=1) == test_set.tensors[1]).double().mean().item() * 100
    st = loop.state
    # (on the emulator a compilation is a trace of one micro-batch: no time worth telling)
    compiled = sum(st.compile_time.values())
    compile_time = f"; compile {compiled:.1f}s" if backend_name() == "poptorch" else ""
    say(
        f"trained {st.step} steps ({st.update} updates, {st.samples} samples) in "
        f"{train_time:.1f}s{compile_time}"
    )
    say(f"Accuracy on test set: {acc:0.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
