#!/usr/bin/env python
"""The MNIST example against a hand-written torch loop doing the same math, in one run.

    python benchmarks/mnist_vs_torch.py --data-dir ../shared/data/mnist

A = ``python -m ipuloop.examples.mnist --data-dir DIR --epochs E`` (the example, its defaults:
B=40, DI=10, GA=10, AdamW lr 1e-3, 3 epochs, test micro-batch 8 x 100 device iterations).
B = this file's ``--_hand`` mode: the same program written directly against torch: the same
data preparation (``ipuloop.examples.mnist.load_mnist``), the same seeds and therefore the
same initial weights, the training set read as a plain ``DataLoader(batch_size=40,
shuffle=True)`` yields it (the micro-batches the Loop reads, 100 to a host call), loss * 1/GA
before backward, an AdamW step every 10 micro-batches; then the test set in micro-batches of 8. Both are run as whole processes
(interpreter start, imports, data loading, training, test), alternately A B A B ..., and the
wall time of each process is compared (median over repeats). Both use the same number of
torch threads (``--threads``, passed as OMP_NUM_THREADS).

Then one more run of the example, in this process with a timing callback added, splits its
training time into data (from the end of one step to the start of the next: reading and
collating the next host batch) and compute (the training model's call and the loop's
per-step work).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
README_BEGIN, README_END = "<!-- mnist:begin -->", "<!-- mnist:end -->"
ACC = re.compile(r"Accuracy on test set: ([0-9.]+)%")


# ---------------------------------------------------------------------------------------------
# B: the hand-written program


def hand(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    import torch
    from torch.utils.data import DataLoader

    from ipuloop.examples.mnist import Network, TrainingModelWithLoss, _data_dir, load_mnist

    data_dir = _data_dir(args.data_dir)
    train_set = load_mnist(data_dir, train=True)
    test_set = load_mnist(data_dir, train=False)
    b, di, ga = args.batch_size, args.device_iterations, args.gradient_accumulation
    torch.manual_seed(args.seed)
    model = TrainingModelWithLoss(Network())
    torch.manual_seed(args.seed)  # the Loop's seed= reseeds torch before the first epoch
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    loader = DataLoader(train_set, batch_size=b, shuffle=True)  # the example's loader
    per_call = di * ga  # micro-batches in one host call; an epoch's remainder is not trained
    t_loaded = time.perf_counter()
    data_s = compute_s = 0.0
    model.train()
    for epoch in range(args.epochs):
        total, count, correct = 0.0, 0, 0
        calls = len(loader) // per_call
        t = time.perf_counter()
        for i, (x, y) in enumerate(loader):
            t1 = time.perf_counter()
            data_s += t1 - t
            if i < calls * per_call:
                out, loss = model(x, y)
                (loss * (1.0 / ga)).backward()
                total += float(loss.detach().double())
                count += 1
                correct += int((out.detach().argmax(1) == y).sum())
                if (i + 1) % ga == 0:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            t = time.perf_counter()
            compute_s += t - t1
        print(
            f"epoch {epoch + 1}: train_loss {total / count:.4g}  train_accuracy "
            f"{correct / (count * b):.4g}",
            flush=True,
        )
    t_trained = time.perf_counter()
    model.eval()
    preds = []
    with torch.no_grad():
        for x, _ in DataLoader(test_set, batch_size=args.test_batch_size):
            preds.append(model(x).argmax(1))
    acc = (torch.cat(preds) == test_set.tensors[1]).double().mean().item() * 100
    t_end = time.perf_counter()
    print(
        json.dumps(
            {
                "setup_s": t_loaded - t0,
                "train_s": t_trained - t_loaded,
                "data_s": data_s,
                "compute_s": compute_s,
                "test_s": t_end - t_trained,
            }
        )
    )
    print(f"Accuracy on test set: {acc:0.2f}%")
    return 0


# ---------------------------------------------------------------------------------------------
# The example, in this process, with a timing callback (data vs compute)


def breakdown(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    import ipuloop.loop
    from ipuloop import Callback
    from ipuloop.examples import mnist

    class Timer(Callback):
        order = 1000  # last at step end: the progress display's per-step work counts as compute

        def __init__(self) -> None:
            self.data = self.compute = 0.0
            self.steps = 0
            self.fit = [0.0, 0.0]
            self._end: float | None = None
            self._start = 0.0

        def on_fit_start(self, loop: Any) -> None:
            self.fit[0] = time.perf_counter()

        def on_epoch_start(self, loop: Any) -> None:
            self._end = time.perf_counter()

        def on_train_step_start(self, loop: Any) -> None:
            self._start = now = time.perf_counter()
            if self._end is not None:
                gap = now - self._end
                if self.steps == 0:  # the first step compiles before it starts
                    gap -= loop.state.compile_time.get("train", 0.0)
                self.data += gap

        def on_train_step_end(self, loop: Any) -> None:
            self._end = now = time.perf_counter()
            self.compute += now - self._start
            self.steps += 1

        def on_fit_end(self, loop: Any) -> None:
            self.fit[1] = time.perf_counter()
            self.compile_s = sum(loop.state.compile_time.values())

    timer = Timer()
    init = ipuloop.loop.Loop.__init__

    def patched(self: Any, *a: Any, callbacks: Any = (), **k: Any) -> None:
        init(self, *a, callbacks=[*callbacks, timer], **k)

    ipuloop.loop.Loop.__init__ = patched  # type: ignore[method-assign]
    rc = mnist.main(["--data-dir", args.data_dir, "--epochs", str(args.epochs), *args.example_args])
    t_end = time.perf_counter()
    fit_s = timer.fit[1] - timer.fit[0]
    print(
        json.dumps(
            {
                "rc": rc,
                "setup_s": timer.fit[0] - t0,
                "fit_s": fit_s,
                "data_s": timer.data,
                "compute_s": timer.compute,
                "compile_s": timer.compile_s,
                "steps": timer.steps,
                "other_fit_s": fit_s - timer.data - timer.compute - timer.compile_s,
                "after_fit_s": t_end - timer.fit[1],
            }
        )
    )
    return rc


# ---------------------------------------------------------------------------------------------


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(
            f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n"
            f"{proc.stderr[-4000:]}"
        )
    return wall, proc.stdout


def _last_json(out: str) -> dict[str, Any]:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def _accuracy(out: str) -> float:
    m = ACC.search(out)
    if m is None:
        raise ValueError("no 'Accuracy on test set' line in the output:\n" + out[-2000:])
    return float(m.group(1))


def readme_section(res: dict[str, Any]) -> str:
    m, a, b = res["meta"], res["example"], res["hand"]
    bd = res.get("breakdown")
    lines = [
        README_BEGIN,
        "",
        f"Measured {m['date']} on {m['machine']} ({m['cpus']} CPUs, OMP_NUM_THREADS="
        f"{m['threads']}, load average at start {m['loadavg']}), torch {m['torch']}. "
        f"Command: `{m['command']}`; {res['epochs']} epochs, runs in the order "
        f"{' '.join(res['order'])} after a dropped warm-up pair A B "
        f"({res['warmup_s']['A']:.1f} s, {res['warmup_s']['B']:.1f} s).",
        "",
        "| program | wall time per run (s) | median (s) | test accuracy (%) |",
        "| --- | --- | ---: | --- |",
        f"| A: `python -m ipuloop.examples.mnist` | "
        f"{', '.join(f'{x:.1f}' for x in a['wall_s'])} | {a['median_s']:.1f} | "
        f"{', '.join(f'{x:.2f}' for x in a['accuracy'])} |",
        f"| B: hand-written torch loop, same math | "
        f"{', '.join(f'{x:.1f}' for x in b['wall_s'])} | {b['median_s']:.1f} | "
        f"{', '.join(f'{x:.2f}' for x in b['accuracy'])} |",
        "",
        f"**Wall-time ratio A / B = {res['ratio']:.3f}** (target <= 1.10: "
        f"{'met' if res['ratio'] <= 1.10 else '**missed**'}); paired per repeat: "
        f"{', '.join(f'{x:.3f}' for x in res['paired_ratios'])}.",
        "",
    ]
    if b.get("phases"):
        p = b["phases"]
        lines += [
            f"B's own split (median run): setup {p['setup_s']:.1f} s, training "
            f"{p['train_s']:.1f} s (data {p['data_s']:.2f} s, compute {p['compute_s']:.1f}"
            f" s), test {p['test_s']:.1f} s.",
            "",
        ]
    if bd:
        share = bd["data_s"] / max(bd["data_s"] + bd["compute_s"], 1e-9) * 100
        lines += [
            "Data time against compute time in the example (one more run, a timing "
            "callback added):",
            "",
            "| phase | seconds |",
            "| --- | ---: |",
            f"| imports, data loading, model and loop setup | {bd['setup_s']:.1f} |",
            f"| fit: data (reading and collating host batches) | {bd['data_s']:.2f} |",
            f"| fit: compute ({bd['steps']} training-model calls and per-step work) "
            f"| {bd['compute_s']:.1f} |",
            f"| fit: compile | {bd['compile_s']:.2f} |",
            f"| fit: other (epoch ends, progress lines) | {bd['other_fit_s']:.2f} |",
            f"| after fit: predict on the test set, printing | {bd['after_fit_s']:.1f} |",
            "",
            f"Data is {share:.1f}% of data + compute during the fit.",
            "",
        ]
    lines.append(README_END)
    return "\n".join(lines)


def write_readme(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        text = head + section + rest.split(README_END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "mnist"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument(
        "--repeats",
        type=int,
        default=4,
        help="A B pairs, alternated, after one warm-up pair that is dropped",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS for both programs (0: leave torch's default)",
    )
    p.add_argument("--no-breakdown", action="store_true", help="skip the data/compute run")
    p.add_argument("--out", default=str(HERE / "mnist_vs_torch.json"))
    p.add_argument(
        "--readme",
        default=str(HERE / "mnist_vs_torch.md"),
        help="the page to write the table into (beside the JSON); '' to leave it alone",
    )
    p.add_argument("--_hand", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_breakdown", action="store_true", help=argparse.SUPPRESS)
    # the example's defaults, for the hand-written program
    p.add_argument("--batch-size", type=int, default=40)
    p.add_argument("--device-iterations", type=int, default=10)
    p.add_argument("--gradient-accumulation", type=int, default=10)
    p.add_argument("--test-batch-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=0.001)
    p.add_argument("--seed", type=int, default=42)
    args, extra = p.parse_known_args(argv)
    args.example_args = extra  # anything else is passed to the example (e.g. --max-steps 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._hand:
        return hand(args)
    if args._breakdown:
        return breakdown(args)
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    example = [
        sys.executable,
        "-m",
        "ipuloop.examples.mnist",
        "--data-dir",
        args.data_dir,
        "--epochs",
        str(args.epochs),
        *args.example_args,
    ]
    hand_cmd = [
        sys.executable,
        __file__,
        "--_hand",
        "--data-dir",
        args.data_dir,
        "--epochs",
        str(args.epochs),
    ]
    import torch

    res: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine() + " " + platform.system(),
            "cpus": os.cpu_count(),
            "threads": args.threads or "torch default",
            "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "command": "python benchmarks/mnist_vs_torch.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
        },
        "epochs": args.epochs,
        "commands": {
            "A": " ".join(example[1:]),
            "B": " ".join(hand_cmd[1:]).replace(str(ROOT) + "/", ""),
        },
        "order": [],
        "example": {"wall_s": [], "accuracy": []},
        "hand": {"wall_s": [], "accuracy": [], "phases_runs": []},
    }
    for name, cmd in (("A", example), ("B", hand_cmd)):  # warm-up pair: file caches, .pyc
        wall, out = _run(cmd, env)
        res.setdefault("warmup_s", {})[name] = wall
        print(f"warm-up {name}: {wall:.1f} s (dropped)", flush=True)
    for r in range(args.repeats):
        for name, cmd in (("A", example), ("B", hand_cmd)):
            wall, out = _run(cmd, env)
            key = "example" if name == "A" else "hand"
            res[key]["wall_s"].append(wall)
            res[key]["accuracy"].append(_accuracy(out))
            if name == "B":
                res["hand"]["phases_runs"].append(_last_json(out))
            res["order"].append(name)
            print(
                f"run {r + 1}/{args.repeats} {name}: {wall:.1f} s, accuracy "
                f"{res[key]['accuracy'][-1]:.2f}%",
                flush=True,
            )
    for key in ("example", "hand"):
        res[key]["median_s"] = statistics.median(res[key]["wall_s"])
    runs = res["hand"]["phases_runs"]
    res["hand"]["phases"] = sorted(runs, key=lambda p: p["train_s"])[len(runs) // 2]
    res["ratio"] = res["example"]["median_s"] / res["hand"]["median_s"]
    res["paired_ratios"] = [a / b for a, b in zip(res["example"]["wall_s"], res["hand"]["wall_s"])]
    print(f"wall-time ratio example / hand-written = {res['ratio']:.3f} (target <= 1.10)")
    if not args.no_breakdown:
        _, out = _run(
            [
                sys.executable,
                __file__,
                "--_breakdown",
                "--data-dir",
                args.data_dir,
                "--epochs",
                str(args.epochs),
                *args.example_args,
            ],
            env,
        )
        res["breakdown"] = bd = _last_json(out)
        print(
            f"example: data {bd['data_s']:.2f} s, compute {bd['compute_s']:.1f} s, compile "
            f"{bd['compile_s']:.2f} s, setup {bd['setup_s']:.1f} s, after fit "
            f"{bd['after_fit_s']:.1f} s",
            flush=True,
        )
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    if args.readme:
        write_readme(Path(args.readme), readme_section(res))
        print(f"wrote the table into {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
