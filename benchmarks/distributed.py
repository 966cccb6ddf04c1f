#!/usr/bin/env python
"""Samples per second of the MNIST example's training on 1 and 2 processes (torchrun, gloo).

Run from the repository root (``docs/performance.md`` lists the commands behind the numbers):

    python benchmarks/distributed.py --mnist-dir ../shared/data/mnist

Configurations, written processes x replicas per process:

    1x1   one process, one replica: the baseline
    1xN   one process, N replicas: the same math as Nx1, one after another in one process
    Nx1   N processes (``python -m torch.distributed.run --nproc-per-node N``), one replica each

Each configuration runs in its own process group (a fresh interpreter per run), one torch
thread per process, the example's network and factors (micro-batch 40, 10 device iterations,
10 accumulation steps, pipelined over 4 stages, AdamW). A run trains ``--warmup`` steps, then
``--steps`` steps; instance 0 reads ``time.perf_counter()`` at the end of each step, and a
run's throughput is the samples of all instances over the timed steps divided by their time.
Repeats rotate the order of the configurations; a configuration's figure is the median.
Scaling efficiency is the N-process throughput over N times the 1x1 throughput; "speed-up
over 1xN" compares runs doing the same arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(cfg: dict) -> None:
    """One run: print one JSON line (instance 0) with the step times."""
    import torch

    sys.path.insert(0, str(ROOT))
    from ipuloop import Callback, Loop, poptorch
    from ipuloop.examples import mnist

    torch.set_num_threads(1)
    if cfg["mnist_dir"]:
        train = mnist.load_mnist(cfg["mnist_dir"], train=True)
    else:  # random images of MNIST's shape: throughput only
        g = torch.Generator().manual_seed(0)
        train = torch.utils.data.TensorDataset(
            torch.randn(cfg["samples"], 1, 28, 28, generator=g),
            torch.randint(0, 10, (cfg["samples"],), generator=g),
        )
    args = argparse.Namespace(
        device_iterations=cfg["di"],
        gradient_accumulation=cfg["ga"],
        replicas=cfg["replicas"],
        strategy="pipelined",
        offload_optimiser=False,
        inference_iterations=cfg["di"],
    )
    opts, _ = mnist.build_options(args)
    torch.manual_seed(0)
    model = mnist.Network()
    marks: list[float] = []

    class Clock(Callback):
        def on_train_step_end(self, loop):
            marks.append(time.perf_counter())

    loop = Loop(
        mnist.TrainingModelWithLoss(model),
        opts,
        seed=0,
        progress=False,
        optimizer=poptorch.optim.AdamW(model.parameters(), lr=1e-3),
        callbacks=[Clock()],
    )
    loader = torch.utils.data.DataLoader(train, batch_size=cfg["micro"], shuffle=True)
    steps = cfg["warmup"] + cfg["steps"]
    loop.fit(
        loader,
        epochs=-(-steps // max(Loop.num_updates(loader, opts) // cfg["di"], 1)),
        max_steps=steps,
    )
    from ipuloop.processes import is_main_process, num_processes

    if is_main_process():
        timed = marks[cfg["warmup"] :]
        per_step = cfg["micro"] * cfg["di"] * cfg["ga"] * cfg["replicas"] * num_processes()
        elapsed = marks[-1] - marks[cfg["warmup"] - 1] if cfg["warmup"] else None
        print(
            json.dumps(
                {
                    "step_s": elapsed / len(timed),
                    "samples_per_step": per_step,
                    "samples_per_s": per_step * len(timed) / elapsed,
                    "final_loss": loop.state.logs.get("loss"),
                }
            ),
            flush=True,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(config: str, cfg: dict, timeout: float) -> dict:
    procs, replicas = (int(v) for v in config.split("x"))
    job = json.dumps(dict(cfg, replicas=replicas))
    if procs == 1:
        cmd = [sys.executable, __file__, "--_child", job]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={procs}",
            f"--master_port={_free_port()}",
            "--monitor_interval=0.5",
            __file__,
            "--_child",
            job,
        ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        PYTHONWARNINGS="ignore",
    )
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(
            f"{config} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    return dict(json.loads(line), wall_s=time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", default="1,2", help="comma list of process counts (N)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (>= 1)")
    p.add_argument("--micro", type=int, default=40)
    p.add_argument("--di", type=int, default=10)
    p.add_argument("--ga", type=int, default=10)
    p.add_argument(
        "--mnist-dir",
        default=None,
        help="real MNIST (DIR/MNIST/raw); default: random images of its shape",
    )
    p.add_argument("--samples", type=int, default=60000, help="random images (no --mnist-dir)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "distributed.json"))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child is not None:
        _child(json.loads(args._child))
        return 0
    if args.warmup < 1:
        p.error("--warmup must be >= 1: the first step's end starts the clock")
    counts = [int(v) for v in args.processes.split(",")]
    configs = ["1x1"] + [c for n in counts if n > 1 for c in (f"1x{n}", f"{n}x1")]
    cfg = {
        "micro": args.micro,
        "di": args.di,
        "ga": args.ga,
        "warmup": args.warmup,
        "steps": args.steps,
        "mnist_dir": args.mnist_dir,
        "samples": args.samples,
    }
    load_start = os.getloadavg()
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(args.repeats):
        for c in configs[r % len(configs) :] + configs[: r % len(configs)]:
            runs[c].append(_run(c, cfg, args.timeout))
            print(
                f"repeat {r + 1} {c}: {runs[c][-1]['samples_per_s']:.0f} samples/s",
                file=sys.stderr,
                flush=True,
            )
    results = {}
    for c, rs in runs.items():
        results[c] = {
            "samples_per_s": statistics.median(x["samples_per_s"] for x in rs),
            "step_s": statistics.median(x["step_s"] for x in rs),
            "samples_per_step": rs[0]["samples_per_step"],
            "samples_per_s_repeats": [x["samples_per_s"] for x in rs],
            "wall_s_repeats": [x["wall_s"] for x in rs],
        }
    base = results["1x1"]["samples_per_s"]
    scaling = {}
    for n in counts:
        if n > 1:
            scaling[str(n)] = {
                "speedup_over_1x1": results[f"{n}x1"]["samples_per_s"] / base,
                "scaling_efficiency": results[f"{n}x1"]["samples_per_s"] / (n * base),
                "speedup_over_1x%d" % n: (
                    results[f"{n}x1"]["samples_per_s"] / results[f"1x{n}"]["samples_per_s"]
                ),
            }
    import torch

    out = {
        "meta": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "threads_per_process": 1,
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        },
        "args": {k: v for k, v in vars(args).items() if k != "_child"},
        "configs": results,
        "scaling": scaling,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for c, v in results.items():
        print(
            f"{c}: {v['samples_per_s']:8.0f} samples/s ({v['step_s'] * 1e3:.0f} ms per step "
            f"of {v['samples_per_step']} samples)"
        )
    for n, s in scaling.items():
        print(
            f"{n} processes: scaling efficiency {s['scaling_efficiency']:.2f}, speed-up "
            f"{s['speedup_over_1x%s' % n]:.2f} over 1 process with {n} replicas"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
