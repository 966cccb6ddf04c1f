#!/usr/bin/env python
"""PopTorch programs on a GPU (or the CPU): the same training written three ways, side by side.

Run from the repository root; ``docs/performance.md`` has the commands and what the runs
conclude, ``benchmarks/gpu_<device>.md`` the last run's table.

    python benchmarks/gpu.py                          # CUDA if torch sees one, else the CPU
    python benchmarks/gpu.py --device cuda --preset gpu   # the sizes benchmarks/gpu_check.sh runs

Variants, timed in ONE process, interleaved (the order rotates every repeat), medians:

    native    eager torch on the device: each host batch copied to the device, split into
              micro-batches in [DI, GA, B] order, loss * loss_scaling/GA before backward, one
              optimizer update per device iteration, the step's loss read on the host. The
              limit the other two are measured against.
    poptorch  the emulated PopTorch program: ``poptorch.trainingModel`` called over a
              ``poptorch.DataLoader`` (IPULOOP_EMULATOR_DEVICE picks the device)
    loop      ``Loop.fit`` (no callbacks, no metrics)

Workloads (``--preset``: gpu, cpu or tiny sizes; each also in float16):

    mnist     the MNIST example's CNN and options (4 pipelined blocks), AdamW, B 40, DI 10, GA 10
    resnet    torchvision's ResNet-50 on synthetic 224x224 images (``--resnet resnet18-32``:
              ResNet-18 on 32x32 images, where memory is short), SGD with momentum
    bert      a BERT-base-sized encoder (12 layers, hidden 768, 12 heads, FFN 3072, vocabulary
              30522, sequence 128) and a classifier on its first token, AdamW; built from
              ``torch.nn.TransformerEncoder`` (``--bert-impl transformers``: transformers' BERT
              from a BertConfig of the same sizes, where transformers is installed). Dropout
              0: the device's random generator is its own, so dropout would draw other masks
              in each variant.

float16 is PopTorch's way: ``model.half()``, float16 inputs, a static loss scale (128), the
update computed in float32 and rounded to float16 (what ``poptorch.optim`` does on an IPU, and
the native variant writes by hand), the loss computed in float32.

How it measures. Before any timing, each variant trains ``--check-steps`` steps from the same
initial weights on the same data (deterministic kernels on CUDA) and its weights are compared
with native's (max |difference|). A timed fit runs ``--warmup`` steps (compile, first
allocations) then ``--steps`` timed ones; the clock is read at the end of each step after the
step's loss reached the host (every variant reads it, as a loop logs it) and, on CUDA, a
``torch.cuda.synchronize()``. Peak device memory is ``torch.cuda.max_memory_allocated`` during
the fit. A last, untimed pass counts per step: the host syncs (on CUDA,
``torch.cuda.set_sync_debug_mode``'s warnings) and the aten operations dispatched (a
``TorchDispatchMode``; on a GPU each is about one kernel launch, views aside).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a file from a checkout without installing
    sys.path.insert(0, str(ROOT))

VARIANTS = ("native", "poptorch", "loop")
WORKLOADS = ("mnist", "resnet", "bert")
DTYPES = ("float32", "float16")
LOSS_SCALING = {"float32": 1.0, "float16": 128.0}
# BatchNorm over few samples makes large gradients: a smaller scale keeps them in float16
RESNET_LOSS_SCALING = {"float32": 1.0, "float16": 8.0}
# max |weight - native's| after the check steps for "the same math"
TOL = {"float32": 1e-5, "float16": 1e-3}
# aten operations that copy a tensor's data (host to device included)
COPIES = frozenset({"copy_", "_to_copy", "clone", "_copy_from"})
NO_KERNEL = frozenset(
    {"detach", "view", "t", "split", "select", "slice", "_unsafe_view", "alias", "expand"}
)

PRESETS: dict[str, dict[str, Any]] = {
    # the sizes of the issue: real workloads, on a GPU
    "gpu": {
        "mnist": {"micro": 40, "di": 10, "ga": 10},
        "resnet": {
            "arch": "resnet50",
            "image": 224,
            "classes": 1000,
            "micro": 32,
            "di": 4,
            "ga": 2,
        },
        "bert": {
            "layers": 12,
            "hidden": 768,
            "heads": 12,
            "ffn": 3072,
            "vocab": 30522,
            "seq": 128,
            "micro": 16,
            "di": 4,
            "ga": 2,
        },
        "steps": 5,
        "warmup": 2,
        "repeats": 3,
    },
    # what a 2-core CPU host runs in minutes
    "cpu": {
        "mnist": {"micro": 40, "di": 10, "ga": 10},
        "resnet": {"arch": "resnet18", "image": 32, "classes": 10, "micro": 8, "di": 2, "ga": 2},
        "bert": {
            "layers": 2,
            "hidden": 256,
            "heads": 4,
            "ffn": 1024,
            "vocab": 30522,
            "seq": 128,
            "micro": 4,
            "di": 2,
            "ga": 2,
        },
        "steps": 3,
        "warmup": 1,
        "repeats": 3,
    },
    # CI: seconds, every code path
    "tiny": {
        "mnist": {"micro": 4, "di": 2, "ga": 2},
        "resnet": {"arch": "resnet18", "image": 32, "classes": 10, "micro": 2, "di": 1, "ga": 2},
        "bert": {
            "layers": 1,
            "hidden": 32,
            "heads": 2,
            "ffn": 64,
            "vocab": 100,
            "seq": 16,
            "micro": 2,
            "di": 2,
            "ga": 1,
        },
        "steps": 2,
        "warmup": 1,
        "repeats": 2,
    },
}
README_MARKERS = {"cuda": "gpu-cuda", "cpu": "gpu-cpu"}


# ---------------------------------------------------------------------------------------------
# Data: host batches sliced from a pool, no per-sample reads


class _Rows(tuple):
    """A host batch already cut by ``Pool.__getitems__``."""


def collate(batch: Any) -> Any:
    """default_collate, passing a batch cut by ``Pool`` through."""
    return list(batch) if isinstance(batch, _Rows) else default_collate(batch)


class Pool(Dataset):
    """``length`` samples cycling over ``tensors`` (a pool of distinct samples). A DataLoader
    reads a host batch through ``__getitems__``: consecutive indices within the pool are a
    slice (no copy), so the host's reading costs the same in every variant and next to
    nothing."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], length: int) -> None:
        self.tensors = tensors
        self.pool = len(tensors[0])
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple:
        return tuple(t[i % self.pool] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> _Rows:
        start, n = indices[0] % self.pool, len(indices)
        if start + n <= self.pool and indices[-1] - indices[0] == n - 1:
            return _Rows(t[start : start + n] for t in self.tensors)
        idx = torch.as_tensor(indices) % self.pool
        return _Rows(t[idx] for t in self.tensors)


# ---------------------------------------------------------------------------------------------
# Workloads: each a model-with-loss, forward(x, labels) -> (output, loss)


class WithLoss(nn.Module):
    """``net``'s output and its cross-entropy with ``labels``, computed in float32."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        return out, F.cross_entropy(out.float(), labels)


class TorchEncoder(nn.Module):
    """A BERT-shaped encoder from plain torch: token and position embeddings, LayerNorm,
    ``nn.TransformerEncoder`` (post-norm, GELU), a classifier on the first token."""

    def __init__(self, c: dict, classes: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(c["vocab"], c["hidden"])
        self.positions = nn.Embedding(c["seq"], c["hidden"])
        self.norm = nn.LayerNorm(c["hidden"])
        layer = nn.TransformerEncoderLayer(
            c["hidden"], c["heads"], c["ffn"], dropout=0.0, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, c["layers"], enable_nested_tensor=False)
        self.classifier = nn.Linear(c["hidden"], classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.norm(self.tokens(ids) + self.positions(pos))
        return self.classifier(self.encoder(h)[:, 0])


class HFEncoder(nn.Module):
    """``transformers``' BertForSequenceClassification from a BertConfig of the same sizes."""

    def __init__(self, c: dict, classes: int = 2) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=c["vocab"],
            hidden_size=c["hidden"],
            num_hidden_layers=c["layers"],
            num_attention_heads=c["heads"],
            intermediate_size=c["ffn"],
            max_position_embeddings=max(512, c["seq"]),
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=classes,
            attn_implementation="eager",  # the same kernels on every device
        )
        self.bert = BertForSequenceClassification(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids).logits


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401

        return True
    except ImportError:
        return False


@dataclass
class Workload:
    name: str
    dtype: str
    micro: int
    di: int
    ga: int
    make_net: Callable[[], nn.Module]
    inputs: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]  # n -> (x, y)
    optimizer: str  # "adamw" or "sgd"
    options: Callable[[], Any]
    description: str
    init_state: dict = field(default_factory=dict)
    pool: tuple = ()

    @property
    def combined(self) -> int:  # samples per host call
        return self.micro * self.di * self.ga

    @property
    def half(self) -> bool:
        return self.dtype == "float16"

    @property
    def loss_scaling(self) -> float:
        return (
            LOSS_SCALING[self.dtype] if self.name != "resnet" else RESNET_LOSS_SCALING[self.dtype]
        )

    def prepare(self) -> None:
        torch.manual_seed(0)
        net = self.make_net()
        self.init_state = copy.deepcopy(net.state_dict())
        x, y = self.inputs(2 * self.combined, torch.Generator().manual_seed(1))
        self.pool = (x.half() if self.half and x.is_floating_point() else x, y)

    def fresh(self) -> nn.Module:
        net = self.make_net()
        net.load_state_dict(self.init_state)
        return (net.half() if self.half else net).train()

    def data(self, steps: int) -> Pool:
        return Pool(self.pool, steps * self.combined)

    def torch_optimizer(self, params: list) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.01, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-4)

    def poptorch_optimizer(self, params: Any) -> torch.optim.Optimizer:
        from ipuloop import poptorch

        ls = self.loss_scaling
        if self.optimizer == "sgd":
            return poptorch.optim.SGD(params, lr=0.01, momentum=0.9, loss_scaling=ls)
        return poptorch.optim.AdamW(params, lr=1e-4, loss_scaling=ls)


def _plain_options(di: int, ga: int) -> Callable[[], Any]:
    def options() -> Any:
        from ipuloop import poptorch

        o = poptorch.Options().deviceIterations(di)
        o.Training.gradientAccumulation(ga)
        return o

    return options


def make_workload(name: str, dtype: str, sizes: dict, args: argparse.Namespace) -> Workload:
    c = dict(sizes[name])
    b, di, ga = c["micro"], c["di"], c["ga"]
    if name == "mnist":
        from ipuloop.examples.mnist import (
            Network,
            TrainingModelWithLoss,
            build_options,
            strategy_for,
        )

        strategy = strategy_for(ga)

        def options() -> Any:
            ns = argparse.Namespace(
                device_iterations=di,
                gradient_accumulation=ga,
                replicas=1,
                strategy=strategy,
                offload_optimiser=False,
                inference_iterations=10,
            )
            return build_options(ns)[0]

        def mnist_inputs(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)

        return Workload(
            name,
            dtype,
            b,
            di,
            ga,
            lambda: TrainingModelWithLoss(Network()),
            mnist_inputs,
            "adamw",
            options,
            f"MNIST example's CNN (4 {strategy} blocks), AdamW, B={b}, DI={di}, GA={ga}",
        )
    if name == "resnet":
        import torchvision

        arch = "resnet18" if args.resnet == "resnet18-32" else c["arch"]
        image = 32 if args.resnet == "resnet18-32" else c["image"]
        classes = c["classes"]

        def resnet_inputs(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randn(n, 3, image, image, generator=g)
            return x, torch.randint(0, classes, (n,), generator=g)

        return Workload(
            name,
            dtype,
            b,
            di,
            ga,
            lambda: WithLoss(getattr(torchvision.models, arch)(num_classes=classes)),
            resnet_inputs,
            "sgd",
            _plain_options(di, ga),
            f"torchvision {arch}, {image}x{image} synthetic images, {classes} classes, "
            f"SGD momentum 0.9, B={b}, DI={di}, GA={ga}",
        )
    if name == "bert":
        impl = args.bert_impl
        if impl == "auto":
            impl = "transformers" if transformers_available() else "torch"
        cls = HFEncoder if impl == "transformers" else TorchEncoder

        def bert_inputs(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            ids = torch.randint(0, c["vocab"], (n, c["seq"]), generator=g)
            return ids, torch.randint(0, 2, (n,), generator=g)

        what = (
            "transformers BertForSequenceClassification from a BertConfig"
            if impl == "transformers"
            else "torch.nn.TransformerEncoder"
        )
        return Workload(
            name,
            dtype,
            b,
            di,
            ga,
            lambda: WithLoss(cls(c)),
            bert_inputs,
            "adamw",
            _plain_options(di, ga),
            f"BERT-shaped encoder ({what}): {c['layers']} layers, hidden {c['hidden']}, "
            f"{c['heads']} heads, FFN {c['ffn']}, vocabulary {c['vocab']}, sequence "
            f"{c['seq']}, AdamW, B={b}, DI={di}, GA={ga}",
        )
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


# ---------------------------------------------------------------------------------------------
# The clock, and what a window of steps counts


class Clock:
    """Read at the end of each step: ``on_start`` runs at the end of step ``start`` (the last
    warm-up step), ``on_stop`` at the end of step ``start + steps``."""

    def __init__(
        self,
        device: torch.device,
        start: int,
        steps: int,
        on_start: Callable[[], Any] | None = None,
        on_stop: Callable[[], Any] | None = None,
        sync: bool = True,
    ) -> None:
        self.cuda = sync and device.type == "cuda"  # the count pass counts no sync of its own
        self.start, self.stop = start, start + steps
        self.on_start, self.on_stop = on_start, on_stop
        self.n = 0
        self.t: list[float] = []
        self.cpu: list[float] = []

    def step(self) -> None:
        self.n += 1
        if self.n == self.stop and self.on_stop is not None:
            self.on_stop()
        if self.cuda:
            torch.cuda.synchronize()
        if self.n in (self.start, self.stop):
            self.t.append(time.perf_counter())
            self.cpu.append(time.process_time())
        if self.n == self.start and self.on_start is not None:
            self.on_start()

    def per_step(self) -> tuple[float, float]:
        steps = self.stop - self.start
        return (self.t[1] - self.t[0]) / steps, (self.cpu[1] - self.cpu[0]) / steps


# ---------------------------------------------------------------------------------------------
# Variants: each trains ``steps`` host calls from the workload's initial weights and returns the
# trained model-with-loss (weights readable on the host)


def run_native(wl: Workload, steps: int, clock: Clock, device: torch.device) -> nn.Module:
    net = wl.fresh().to(device)
    params = list(net.parameters())
    if wl.half:  # the update in float32, rounded to float16: poptorch.optim's on an IPU
        master = [nn.Parameter(p.detach().float()) for p in params]
        opt = wl.torch_optimizer(master)
    else:
        opt = wl.torch_optimizer(params)
    ls = wl.loss_scaling
    scale = ls / wl.ga  # Mean over GA micro-batches, times the loss scale
    b, di, ga = wl.micro, wl.di, wl.ga
    loader = DataLoader(wl.data(steps), batch_size=wl.combined, collate_fn=collate)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            xs, ys = x.split(b), y.split(b)
            total = None
            for d in range(di):
                for a in range(ga):
                    with torch.enable_grad():
                        _, loss = net(xs[d * ga + a], ys[d * ga + a])
                        (loss * scale if scale != 1.0 else loss).backward()
                    loss = loss.detach()
                    total = loss if total is None else total + loss
                if wl.half:
                    grads = [p.grad for p in params if p.grad is not None]
                    if ls != 1.0:
                        torch._foreach_div_(grads, ls)
                    for p, m in zip(params, master):
                        m.copy_(p)
                        m.grad = None if p.grad is None else p.grad.float()
                    opt.step()
                    for p, m in zip(params, master):
                        p.copy_(m)
                        m.grad = None
                else:
                    opt.step()
                for p in params:
                    p.grad = None
            float(total)  # the step's loss on the host, as every loop reads it
            clock.step()
    return net


def run_poptorch(wl: Workload, steps: int, clock: Clock, device: torch.device) -> nn.Module:
    from ipuloop import poptorch

    net = wl.fresh()
    opts = wl.options()
    model = poptorch.trainingModel(net, opts, optimizer=wl.poptorch_optimizer(net.parameters()))
    loader = poptorch.DataLoader(opts, wl.data(steps), batch_size=wl.micro, collate_fn=collate)
    for x, y in loader:
        _, loss = model(x, y)
        float(loss.sum())  # the step's loss on the host (default output mode: Final)
        clock.step()
    return net  # reading it copies the device's weights back


def run_loop(wl: Workload, steps: int, clock: Clock, device: torch.device) -> nn.Module:
    from ipuloop import Callback, Loop

    class Tick(Callback):
        def on_train_step_end(self, loop: Any) -> None:
            clock.step()

    net = wl.fresh()
    loop = Loop(
        net,
        wl.options(),
        optimizer=wl.poptorch_optimizer(net.parameters()),
        progress=False,
        callbacks=[Tick()],
    )
    loop.fit(DataLoader(wl.data(steps), batch_size=wl.micro, collate_fn=collate), epochs=1)
    return loop.model


RUNS = {"native": run_native, "poptorch": run_poptorch, "loop": run_loop}


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(
        (
            float((sa[k].float().cpu() - sb[k].float().cpu()).abs().max())
            for k in sa
            if sa[k].numel()
        ),
        default=0.0,
    )


@contextlib.contextmanager
def deterministic(device: torch.device):
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Ops:
    """Counts the aten operations dispatched while active (a ``TorchDispatchMode``)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: collections.Counter = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        self.counts = counts
        self.mode = Mode()

    def kernels(self) -> int:
        return sum(v for k, v in self.counts.items() if k not in NO_KERNEL)


def count_per_step(variant: str, wl: Workload, device: torch.device, steps: int) -> dict:
    """Host syncs (CUDA) and aten operations per step, over ``steps`` steps after one."""
    ops = Ops()
    syncs: list[Any] = []
    cuda = device.type == "cuda"

    def start() -> None:
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        ops.mode.__enter__()

    def stop() -> None:
        ops.mode.__exit__(None, None, None)
        if cuda:
            torch.cuda.set_sync_debug_mode("default")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clock = Clock(device, 1, steps, start, stop, sync=False)
        try:
            RUNS[variant](wl, 1 + steps, clock, device)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
    release(device)
    copies = sum(v for k, v in ops.counts.items() if k in COPIES)
    return {
        "syncs_per_step": len(syncs) / steps if cuda else None,
        "ops_per_step": ops.kernels() / steps,
        "copies_per_step": copies / steps,
        "ops_by_name": {k: v / steps for k, v in sorted(ops.counts.items())},
    }


def timed(variant: str, wl: Workload, device: torch.device, warmup: int, steps: int) -> dict:
    release(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    clock = Clock(device, warmup, steps)
    RUNS[variant](wl, warmup + steps, clock, device)
    step_s, cpu_s = clock.per_step()
    peak = None
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    release(device)
    return {"step_s": step_s, "cpu_step_s": cpu_s, "peak_mb": peak}


def measure(wl: Workload, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    variants = [v for v in VARIANTS if v in args.variants]
    print(f"\n== {wl.name} {wl.dtype}: {wl.description}", flush=True)
    wl.prepare()
    out: dict[str, Any] = {"description": wl.description, "samples_per_step": wl.combined}
    # the same math first
    with deterministic(device):
        trained = {v: RUNS[v](wl, args.check_steps, Clock(device, 0, 0), device) for v in variants}
    diffs = {v: max_diff(trained[v], trained["native"]) for v in variants if v != "native"}
    del trained
    release(device)
    out["max_abs_diff_to_native"] = diffs
    out["same_math"] = all(d <= TOL[wl.dtype] for d in diffs.values())
    print(f"   max |w - w_native| after {args.check_steps} steps: {diffs}", flush=True)
    reps: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.repeats):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            reps[v].append(timed(v, wl, device, args.warmup, args.steps))
        print(
            f"   repeat {r + 1}: "
            + ", ".join(f"{v} {reps[v][-1]['step_s'] * 1e3:.1f} ms" for v in variants),
            flush=True,
        )
    res: dict[str, Any] = {}
    for v in variants:
        steps_s = [x["step_s"] for x in reps[v]]
        med = statistics.median(steps_s)
        peaks = [x["peak_mb"] for x in reps[v] if x["peak_mb"] is not None]
        res[v] = {
            "step_s": med,
            "step_s_repeats": steps_s,
            "cpu_step_s": statistics.median(x["cpu_step_s"] for x in reps[v]),
            "samples_per_s": wl.combined / med,
            "peak_mb": max(peaks) if peaks else None,
        }
    if not args.no_counts:
        for v in variants:
            res[v].update(count_per_step(v, wl, device, args.count_steps))
    native, native_cpu = res["native"]["step_s"], res["native"]["cpu_step_s"]
    for v in variants:
        res[v]["ratio_to_native"] = res[v]["step_s"] / native
        res[v]["cpu_ratio_to_native"] = res[v]["cpu_step_s"] / native_cpu
        res[v]["paired_ratios"] = [
            a["step_s"] / n["step_s"] for a, n in zip(reps[v], reps["native"])
        ]
    out["variants"] = res
    return out


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def table(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"Measured {meta['date']} on {meta['device_name']} ({meta['machine']}, {meta['cpus']} "
        f"CPUs, torch threads {meta['threads']}, load average at start {meta['loadavg']}), "
        f"Python {meta['python']}, torch "
        f"{meta['torch']}. Command: `{meta['command']}`; {meta['steps']} timed steps after "
        f"{meta['warmup']} warm-up, {meta['repeats']} repeats in rotated order, medians.",
        "",
        "| workload | dtype | variant | ms / step | samples / s | / native | CPU ms / step | "
        "CPU / native | peak MB | host syncs / step | ops / step | copies / step | "
        "same weights (max diff) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, by_dtype in results["workloads"].items():
        for dtype, w in by_dtype.items():
            if "skipped" in w:
                lines.append(f"| {name} | {dtype} | skipped: {w['skipped']} |" + " |" * 10)
                continue
            for v, r in w["variants"].items():
                diff = w["max_abs_diff_to_native"].get(v)
                same = (
                    "" if diff is None else f"{'yes' if diff <= TOL[dtype] else 'NO'} ({diff:.1e})"
                )
                lines.append(
                    f"| {name} | {dtype} | {v} | {r['step_s'] * 1e3:.1f} | "
                    f"{r['samples_per_s']:,.0f} | {r['ratio_to_native']:.3f} | "
                    f"{r['cpu_step_s'] * 1e3:.1f} | {r['cpu_ratio_to_native']:.3f} | "
                    f"{_fmt(r['peak_mb'], ',.0f')} | {_fmt(r.get('syncs_per_step'), '.1f')} | "
                    f"{_fmt(r.get('ops_per_step'), ',.0f')} | "
                    f"{_fmt(r.get('copies_per_step'), ',.0f')} | {same} |"
                )
    lines.append("")
    for name, by_dtype in results["workloads"].items():
        descr = next((w["description"] for w in by_dtype.values() if "description" in w), None)
        if descr:
            lines.append(f"- **{name}**: {descr}.")
    return "\n".join(lines) + "\n"


def readme_page(readme: str | None, device_type: str) -> Path:
    """The page a run's table goes into: ``--readme``, else the one beside its JSON."""
    return Path(readme) if readme else HERE / f"gpu_{device_type}.md"


def write_readme(path: Path, marker: str, text: str) -> None:
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    page = path.read_text()
    if begin not in page or end not in page:
        print(f"note: {path} has no {begin} ... {end} markers: table not written", flush=True)
        return
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n\n{text}\n{end}{tail}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="default: gpu on CUDA")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--skip",
        default="",
        help="workload:dtype pairs to leave out, e.g. resnet:float16 (float16 convolutions are "
        "slow on CPUs)",
    )
    p.add_argument("--resnet", default="preset", choices=("preset", "resnet18-32"))
    p.add_argument(
        "--bert-impl",
        default="torch",
        choices=("torch", "transformers", "auto"),
        help="the encoder's code: torch.nn.TransformerEncoder (default), transformers' BERT "
        "from a BertConfig, or auto (transformers when it imports)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per fit")
    p.add_argument("--warmup", type=int, default=None, help="steps before the clock starts")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--check-steps", type=int, default=2, help="steps of the same-math check")
    p.add_argument("--count-steps", type=int, default=2, help="steps of the syncs/ops count")
    p.add_argument("--no-counts", action="store_true", help="skip the syncs/ops count")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new workload after this many seconds (what is left is marked skipped)",
    )
    p.add_argument("--out", default=None, help="default: benchmarks/gpu_<device>.json")
    p.add_argument(
        "--readme",
        default=None,
        help="the page to write the table into (default: benchmarks/gpu_<device>.md, beside "
        "the JSON); '' or none to leave it alone",
    )
    p.add_argument(
        "--from-json",
        default=None,
        metavar="RESULTS_JSON",
        help="only write the table of an earlier run's results",
    )
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.preset = args.preset or ("gpu" if args.device == "cuda" else "cpu")
    preset = PRESETS[args.preset]
    for k in ("steps", "warmup", "repeats"):
        if getattr(args, k) is None:
            setattr(args, k, preset[k])
    if args.warmup < 1:
        p.error("--warmup must be >= 1: the first step compiles")
    args.variants = [v for v in args.variants.split(",") if v]
    if "native" not in args.variants:
        args.variants.insert(0, "native")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:  # only the table, from an earlier run's results
        results = json.loads(Path(args.from_json).read_text())
        text = table(results)
        print(text, flush=True)
        device_type = results["meta"]["device"]
        if args.readme != "" and args.readme != "none":
            write_readme(readme_page(args.readme, device_type), README_MARKERS[device_type], text)
        return 0
    started = time.perf_counter()
    os.environ["IPULOOP_EMULATOR_DEVICE"] = args.device  # read when a model is wrapped
    os.environ.setdefault("IPULOOP_BACKEND", "emulator")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("poptorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*samples are dropped.*")
    sizes = PRESETS[args.preset]
    command = "python benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": args.device,
            "device_name": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"the CPU ({cpu_name()})",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "machine": f"{platform.machine()} {platform.system()}",
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "preset": args.preset,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "command": command.strip(),
        },
        "sizes": sizes,
        "workloads": {},
    }
    out = Path(args.out or HERE / f"gpu_{device.type}.json")
    for name in [w for w in args.workloads.split(",") if w]:
        results["workloads"][name] = {}
        for dtype in [d for d in args.dtypes.split(",") if d]:
            entry: dict[str, Any]
            if f"{name}:{dtype}" in args.skip.split(","):
                entry = {"skipped": "--skip"}
            elif args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                entry = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
            elif dtype == "float16" and not float16_kernels(device):
                entry = {"skipped": f"this torch has no float16 matmul on {device.type}"}
            elif name == "resnet" and not _importable("torchvision"):
                entry = {"skipped": "torchvision is not installed"}
            elif (
                name == "bert" and args.bert_impl == "transformers" and not transformers_available()
            ):
                entry = {"skipped": "transformers is not installed"}
            else:
                entry = measure(make_workload(name, dtype, sizes, args), args, device)
            results["workloads"][name][dtype] = entry
            out.write_text(json.dumps(results, indent=1) + "\n")
    results["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(results, indent=1) + "\n")
    text = table(results)
    print("\n" + text, flush=True)
    print(f"wrote {out}", flush=True)
    if args.readme != "" and args.readme != "none":
        write_readme(readme_page(args.readme, device.type), README_MARKERS[device.type], text)
    return 0


def cpu_name() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def float16_kernels(device: torch.device) -> bool:
    """Whether torch computes float16 matmuls on ``device`` (torch 2.0's CPU does not)."""
    try:
        one = torch.ones(2, 2, dtype=torch.float16, device=device)
        one @ one
        return True
    except RuntimeError:
        return False


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
