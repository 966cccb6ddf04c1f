#!/usr/bin/env python
"""What ``Loop(async_data=True)`` buys, and what a custom batch sampler costs, per step.

    python benchmarks/async_data.py --mnist-dir ../shared/data/mnist   # the MNIST example
    python benchmarks/async_data.py --workload mlp                      # the host-bound tiny MLP

``--workload mnist``: the MNIST example's training (``ipuloop.examples.mnist``: its four
pipelined blocks, B=40, DI=10, GA=10, AdamW lr 1e-3, the accuracy metric) over a shuffled torch
``DataLoader`` with ``--workers`` worker processes (0 by default, as in the example); real MNIST
with ``--mnist-dir``, else ``--synthetic N`` random MNIST-shaped samples. ``--workload mlp``:
``overhead.py``'s tiny MLP (32-32-10, cross-entropy, SGD lr 0.01, B=32, DI=1, GA=1) on 16,000
random samples. ``--workload many``: the same MLP with 100 micro-batches of 8 a host call (DI=20,
GA=5), read by 2 loader workers (``--workers``): a host call joined from many micro-batches.

Variants, each a fit of ``--steps`` training steps in this process, from the same initial
weights and seed, in an order rotated every repeat: ``sync`` (the default reading),
``async`` (``async_data=True``) and ``batch_sampler`` (the same shuffled micro-batches given as
``batch_sampler=BatchSampler(RandomSampler(data), B, drop_last=True)``, read synchronously). A
step's time is taken at ``on_train_step_end``, the first ``--warmup`` steps left out. Per
variant and repeat: wall seconds per step (hence steps per second), the process's CPU seconds
per step (``time.process_time``: every thread of this process, the prefetching thread
included; loader worker processes are not counted), and the time the loop waited for the next
host batch (from a step's end to the next step's start: what reading ahead can hide). Every
variant must end with bitwise the weights of ``sync`` (same batches, same order), checked on
every repeat. Medians over repeats; ratios are variant / sync of the medians, and the
per-repeat paired ratios are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE.parent) not in sys.path:  # run as a file from a checkout without installing
    sys.path.insert(0, str(HERE.parent))
VARIANTS = ("sync", "async", "batch_sampler")
LABELS = {
    "sync": "synchronous (default)",
    "async": "`async_data=True`",
    "batch_sampler": "`batch_sampler=BatchSampler(...)`",
}
WORKLOADS = {  # batch size, device iterations, gradient accumulation, steps, warm-up steps
    "mnist": (40, 10, 10, 14, 2),
    "mlp": (32, 1, 1, 500, 50),
    "many": (8, 20, 5, 40, 4),  # 100 micro-batches a host call, read by loader workers
}


def markers(workload: str) -> tuple[str, str]:
    return f"<!-- async-{workload}:begin -->", f"<!-- async-{workload}:end -->"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mnist")
    p.add_argument("--mnist-dir", default=None, help="folder holding MNIST/raw (real MNIST)")
    p.add_argument(
        "--synthetic",
        type=int,
        default=60000,
        help="samples of random MNIST-shaped data when --mnist-dir is not given",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma list of {','.join(VARIANTS)} (sync always runs)",
    )
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--device-iterations", type=int, default=None)
    p.add_argument("--gradient-accumulation", type=int, default=None)
    p.add_argument(
        "--workers", type=int, default=None, help="torch loader worker processes (0; many: 2)"
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per fit")
    p.add_argument("--warmup", type=int, default=None, help="first steps left out of the timing")
    p.add_argument("--repeats", type=int, default=None, help="default: 9 (mnist), 7 (mlp)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default=None, help="default: benchmarks/async_data_<workload>.json")
    p.add_argument(
        "--readme",
        default=None,
        help="the page to write the table into (default: benchmarks/async_data_<workload>.md, "
        "beside the JSON); '' to leave it alone",
    )
    args = p.parse_args(argv)
    if args.readme is None:
        args.readme = str(HERE / f"async_data_{args.workload}.md")
    defaults = WORKLOADS[args.workload]
    for name, value in zip(
        ("batch_size", "device_iterations", "gradient_accumulation", "steps", "warmup"), defaults
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.repeats is None:
        args.repeats = 9 if args.workload == "mnist" else 7
    if args.workers is None:
        args.workers = 2 if args.workload == "many" else 0
    if args.out is None:
        args.out = str(HERE / f"async_data_{args.workload}.json")
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    args.variants = ["sync"] + [v for v in variants if v != "sync"]
    if args.steps <= args.warmup + 1:
        p.error("--steps must exceed --warmup + 1: at least two timed step ends")
    return args


def load_data(args: argparse.Namespace) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    if args.workload in ("mlp", "many"):
        return torch.utils.data.TensorDataset(
            torch.randn(16000, 32, generator=g), torch.randint(0, 10, (16000,), generator=g)
        )
    if args.mnist_dir:
        from ipuloop.examples.mnist import load_mnist

        return load_mnist(args.mnist_dir, train=True)
    return torch.utils.data.TensorDataset(
        torch.randn(args.synthetic, 1, 28, 28, generator=g),
        torch.randint(0, 10, (args.synthetic,), generator=g),
    )


def network(args: argparse.Namespace) -> Any:
    import torch.nn as nn

    if args.workload in ("mlp", "many"):
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    from ipuloop.examples.mnist import Network

    return Network()


def make_loop(args: argparse.Namespace, net: Any, callbacks: list, variant: str) -> Any:
    import torch.nn as nn
    import torchmetrics

    from ipuloop import Loop, poptorch

    opts = poptorch.Options().deviceIterations(args.device_iterations)
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    if args.workload in ("mlp", "many"):
        import torch

        return Loop(
            net,
            opts,
            loss_fn=nn.CrossEntropyLoss(),
            seed=args.seed,
            progress=False,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
            callbacks=callbacks,
            async_data=variant == "async",
        )
    from ipuloop.examples.mnist import TrainingModelWithLoss, _strategy

    opts.setExecutionStrategy(_strategy("pipelined"))
    return Loop(
        TrainingModelWithLoss(net),
        opts,
        seed=args.seed,
        progress=False,
        optimizer=poptorch.optim.AdamW(net.parameters(), lr=1e-3),
        metrics={"accuracy": torchmetrics.Accuracy(task="multiclass", num_classes=10)},
        callbacks=callbacks,
        async_data=variant == "async",
    )


def run_fit(args: argparse.Namespace, dataset: Any, init: dict, variant: str) -> dict:
    """One fit of ``args.steps`` steps; its clocks and final weights."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    from ipuloop import Callback

    class Clock(Callback):
        order = 1000  # after the other step-end hooks: they count as the step's work

        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []
            self.start: list[float] = []

        def on_train_step_start(self, loop: Any) -> None:  # the step's host batch is read
            self.start.append(time.perf_counter())

        def on_train_step_end(self, loop: Any) -> None:
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())

    net = network(args)
    net.load_state_dict(init)
    clock = Clock()
    loop = make_loop(args, net, [clock], variant)
    if variant == "batch_sampler":  # the shuffled micro-batches of the other variants
        loader = DataLoader(
            dataset,
            batch_sampler=BatchSampler(RandomSampler(dataset), args.batch_size, True),
            num_workers=args.workers,
        )
    else:
        loader = DataLoader(
            dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers
        )
    loop.fit(loader, epochs=10**6, max_steps=args.steps)
    w, c = clock.wall[args.warmup :], clock.cpu[args.warmup :]
    n = len(w) - 1
    # waiting for the next host batch: from one step's end to the next step's start
    wait = sum(s - e for s, e in zip(clock.start[args.warmup + 1 :], w)) / n
    return {
        "step_s": (w[-1] - w[0]) / n,
        "cpu_step_s": (c[-1] - c[0]) / n,
        "wait_s": wait,
        "weights": {k: v.detach().clone() for k, v in net.state_dict().items()},
    }


def measure(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)

    dataset = load_data(args)
    torch.manual_seed(args.seed)
    init = {k: v.clone() for k, v in network(args).state_dict().items()}
    names = args.variants
    runs: dict[str, list[dict]] = {v: [] for v in names}
    same: list[bool] = []
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        results = {}
        for variant in order:
            res = results[variant] = run_fit(args, dataset, init, variant)
            print(
                f"repeat {r + 1}/{args.repeats} {variant:13s}: {res['step_s'] * 1e3:8.3f} "
                f"ms/step, {res['cpu_step_s'] * 1e3:8.3f} CPU ms/step, "
                f"{res['wait_s'] * 1e3:7.3f} ms/step waiting for data",
                flush=True,
            )
        ref = results["sync"]["weights"]
        same.append(
            all(torch.equal(ref[k], res["weights"][k]) for res in results.values() for k in ref)
        )
        for variant in names:
            runs[variant].append(
                {k: results[variant][k] for k in ("step_s", "cpu_step_s", "wait_s")}
            )
    out: dict[str, Any] = {"variants": {}, "same_weights": all(same), "ratios": {}}
    per_step = args.batch_size * args.device_iterations * args.gradient_accumulation
    for variant in names:
        steps = [x["step_s"] for x in runs[variant]]
        cpus = [x["cpu_step_s"] for x in runs[variant]]
        waits = [x["wait_s"] for x in runs[variant]]
        out["variants"][variant] = {
            "step_s": statistics.median(steps),
            "cpu_step_s": statistics.median(cpus),
            "wait_s": statistics.median(waits),
            "steps_per_s": 1 / statistics.median(steps),
            "samples_per_s": per_step / statistics.median(steps),
            "step_s_repeats": steps,
            "cpu_step_s_repeats": cpus,
            "wait_s_repeats": waits,
        }
    s = out["variants"]["sync"]
    for variant in names[1:]:
        v = out["variants"][variant]
        out["ratios"][variant] = {
            "wall": v["step_s"] / s["step_s"],
            "cpu": v["cpu_step_s"] / s["cpu_step_s"],
            "paired wall": [x / y for x, y in zip(v["step_s_repeats"], s["step_s_repeats"])],
            "paired cpu": [x / y for x, y in zip(v["cpu_step_s_repeats"], s["cpu_step_s_repeats"])],
        }
    return out


def table(res: dict) -> str:
    meta, args, out = res["meta"], res["args"], res["results"]
    if args["workload"] in ("mlp", "many"):
        data = "the tiny MLP on 16,000 random samples"
    else:
        data = (
            "the MNIST example on real MNIST"
            if args["mnist_dir"]
            else f"the MNIST example on {args['synthetic']} random MNIST-shaped samples"
        )
    lines = [
        f"Measured {meta['date']} on {meta['machine']} ({meta['cpus']} CPUs, torch threads "
        f"{args['threads']}, load average at start {meta['load']}), Python {meta['python']}, "
        f"torch {meta['torch']}. Command: `{meta['command']}`; {data}, B={args['batch_size']}, "
        f"DI={args['device_iterations']}, GA={args['gradient_accumulation']}, "
        f"{args['workers']} loader worker(s), {args['steps']} steps per fit (first "
        f"{args['warmup']} left out), {args['repeats']} repeats in rotated order.",
        "",
        "| reading | ms / step | steps / s | samples / s | CPU ms / step | waiting for data, "
        "ms / step | wall / sync (paired: min-max) | CPU / sync |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in args["variants"]:
        x = out["variants"][name]
        r = out["ratios"].get(name)
        ratio = (
            (
                f"{r['wall']:.3f} ({min(r['paired wall']):.2f}-{max(r['paired wall']):.2f}) | "
                f"{r['cpu']:.3f}"
            )
            if r
            else "1 | 1"
        )
        lines.append(
            f"| {LABELS[name]} | {x['step_s'] * 1e3:.3f} | {x['steps_per_s']:,.2f} | "
            f"{x['samples_per_s']:,.0f} | {x['cpu_step_s'] * 1e3:.3f} | "
            f"{x['wait_s'] * 1e3:.3f} | {ratio} |"
        )
    lines += [
        "",
        f"Same weights as `sync` after every repeat: {'yes' if out['same_weights'] else 'NO'}.",
    ]
    return "\n".join(lines)


def _relative(value: Any) -> Any:
    """A path under the repository as it is relative to the repository; anything else as is."""
    if isinstance(value, str) and value.startswith(str(ROOT) + "/"):
        return value[len(str(ROOT)) + 1 :]
    return value


def write_readme(path: str, workload: str, text: str) -> None:
    p = Path(path)
    doc = p.read_text()
    begin, end = markers(workload)
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path} has no {begin} ... {end} section to fill")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    p.write_text(f"{head}{begin}\n\n{text}\n\n{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    start_load = (
        " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    )
    results = measure(args)
    res = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": f"{platform.machine()} {platform.system()}",
            "cpus": os.cpu_count(),
            "load": start_load,
            "command": "python benchmarks/async_data.py " + " ".join(sys.argv[1:]),
        },
        "args": {k: _relative(v) for k, v in vars(args).items()},  # no path of this host
        "results": results,
    }
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    text = table(res)
    print(text)
    if args.readme:
        write_readme(args.readme, args.workload, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
