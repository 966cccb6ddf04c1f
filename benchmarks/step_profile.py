#!/usr/bin/env python
"""Where the loop's time per training step goes, call by call, on overhead.py's tiny MLP.

    python benchmarks/step_profile.py                 # table on stdout, step_profile.json
    python benchmarks/step_profile.py --steps 3000    # a longer profiled fit

Two views of the same step path (``Loop._train_epoch``'s body):

- calls: the Python calls per step of ``Loop.fit`` beyond those of the raw
  ``poptorch.trainingModel`` loop (overhead.py's variant (b)), from ``cProfile`` call counts
  of a fit of each of N and 2N steps, subtracted (deterministic: counts, not times);
- per call: each loop-side call of the step, timed alone on the fitted loop's own objects
  (``timeit``, the minimum of several repeats, in microseconds), next to what the raw loop
  does in their place (``float(loss.sum())``) and the whole step of the raw loop.

The calls' times are a lower bound of their cost inside a step: there, the model's work runs
between them and they start from colder caches. ``overhead.py`` measures the whole.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import sys
import timeit
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:  # run as a file from a checkout without installing
        sys.path.insert(0, p)

import overhead  # noqa: E402  (the workload and the variants the ratios are measured on)


def _counts(run: Callable[[], Any]) -> dict[str, int]:
    """``function -> calls`` of one ``run()``, profiled after a warm-up run."""
    run()
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    stats: Any = pstats.Stats(prof)
    return {
        f"{os.path.relpath(f, ROOT) if f.startswith(str(ROOT)) else os.path.basename(f)}"
        f":{line}({re.sub(r' at 0x[0-9a-f]+', '', name)})": v[0]  # (no addresses)
        for (f, line, name), v in stats.stats.items()
    }


def calls_per_step(variant: Callable[..., Any], steps: int) -> dict[str, float]:
    """``function -> calls per step`` of ``variant`` (overhead.py's): the calls of a fit of
    ``2 * steps`` steps less those of a fit of ``steps``, over ``steps``, so what a fit does
    once (building, compiling, an epoch's start and end) cancels out."""
    short, long = (
        _counts(lambda n=n: variant(overhead.make_workload("mlp", 1, 1, n), 1, overhead.Stamps()))
        for n in (steps, 2 * steps)
    )
    return {k: (long.get(k, 0) - short.get(k, 0)) / steps for k in set(short) | set(long)}


def extra_calls(loop_calls: dict[str, float], raw_calls: dict[str, float]) -> dict[str, float]:
    """The functions ``Loop.fit`` calls more often per step than the raw loop (>= 0.9)."""
    out = {}
    for k in set(loop_calls) | set(raw_calls):
        d = loop_calls.get(k, 0.0) - raw_calls.get(k, 0.0)
        if abs(d) >= 0.9:
            out[k] = round(d, 2)
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def per_call_us(number: int, repeat: int) -> dict[str, float]:
    """Each loop-side call of a training step, timed alone on a fitted loop's objects."""
    from ipuloop import Loop

    wl = overhead.make_workload("mlp", 1, 1, 50)
    net = wl.fresh()
    loop = Loop(net, wl.options(), optimizer=wl.poptorch_opt(net.parameters()), progress=False)
    loader = DataLoader(wl.dataset, batch_size=wl.micro)
    loop.fit(loader, epochs=1)
    plan: Any = loop._resume.plan
    executors, feed, epoch, st = loop.executors, loop._feed, loop._epoch, loop.state
    layout, model = plan.layout, executors.train
    batch = next(iter(loader))
    args, kwargs, _ = feed.split(batch, plan.name)
    result = model(*args, **kwargs)
    _, loss, _ = loop._returns.split(result)
    step = epoch.step_loss(loss, layout, check_finite=True)
    parts: dict[str, Callable[[], Any]] = {
        "Executors.push_optimizer (unchanged optimizer)": executors.push_optimizer,
        "Feed.split (a tuple batch)": lambda: feed.split(batch, plan.name),
        "Returns.split ((output, loss))": lambda: loop._returns.split(result),
        "TrainEpoch.step_loss (one instance)": lambda: epoch.step_loss(
            loss, layout, check_finite=True
        ),
        "TrainEpoch.add": lambda: epoch.add(step),
        "Processes.at_boundary": lambda: loop._processes.at_boundary(st),
        "Executor.isCompiled": model.isCompiled,
        "raw loop in their place: float(loss.sum())": lambda: float(loss.sum()),
        "raw loop's whole step: trainingModel call": lambda: model(*args, **kwargs),
    }
    return {
        name: round(min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6, 3)
        for name, fn in parts.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--steps", type=int, default=2000, help="N: the profiled fits run N and 2N steps"
    )
    ap.add_argument("--number", type=int, default=20000, help="timeit calls per repeat")
    ap.add_argument("--repeat", type=int, default=5, help="timeit repeats (the minimum is kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", default=str(HERE / "step_profile.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    extra = extra_calls(
        calls_per_step(overhead.run_loop, args.steps),
        calls_per_step(overhead.run_raw, args.steps),
    )
    timed = per_call_us(args.number, args.repeat)
    result = {
        "meta": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "threads": args.threads,
            "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "command": "python benchmarks/step_profile.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
        },
        "extra_calls_per_step": extra,
        "per_call_us": timed,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("Calls per step of Loop.fit beyond the raw trainingModel loop:")
    for k, v in extra.items():
        print(f"  {v:+6.2f}  {k}")
    print("Each call alone (us, min of repeats):")
    for k, v in timed.items():
        print(f"  {v:8.3f}  {k}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
