"""A differential search over the data path: ``Loop.fit`` reading a drawn torch ``DataLoader``
against plain torch iterating an identical ``DataLoader`` (built by the same function, from the
same seeds), each doing the same math.

What is drawn (``configs``):

- the dataset: map-style, or an ``IterableDataset`` with or without ``__len__``, sharded by
  worker (in ``__iter__`` with ``get_worker_info()``, or by a ``worker_init_fn`` that configures
  ``get_worker_info().dataset``) or not; samples with noise drawn as they are read, or none;
- loader workers 0-3 (0-1 in the quick suite), a ``worker_init_fn`` that configures the
  worker's dataset, ``persistent_workers``;
- the ``collate_fn``: torch's default, a dict, batch statistics (each micro-batch centred on its
  own mean), or sequences of varying length padded to one fixed length;
- the order (map-style): sequential, shuffled with a seeded generator, shuffled from the global
  seed, weighted, a subset, a custom batch sampler, a ``DistributedSampler`` of one process;
- ``drop_last``, a micro-batch size (1-3) and dataset lengths that do not divide;
- device iterations and gradient accumulation (1-2), replicas (1-2), epochs (1-2);
- ``loop.validate(...)`` and ``loop.predict(...)`` called from ``on_epoch_end`` on a test set
  read as the training set is, beside the fit's own validation;
- a parameter ``forward`` writes in place under ``no_grad`` in training (an EMA of its outputs);
- an interruption: none, a ``state_dict`` at step k loaded into a new loop with a new loader
  (its generator seeded otherwise: the checkpoint's state must win), or a continued fit.

The reference (``reference``): each epoch ``for batch in loader`` (``set_epoch`` first for a
``DistributedSampler``, as a DDP loop does), training micro-batches of the loader's batch size
only (a stream's short batch is dropped), ``DI x GA x RF`` of them a host call in the order torch
yields them, the epoch's remainder read and dropped: each of the DI updates of a host call is
an SGD step on the mean of its ``GA x RF`` micro-batch losses. Validation and predict read every
sample in the loader's order, in eval mode, micro-batches of ``B`` rows cut from the loader's
batches in order. Checked: the weights (within 2e-5), each step's loss and the mean sample id of
each step (which samples a step trained), the fit's history (``val_loss`` the fit's own),
the nested calls' results and ``Loop.num_updates``.

Replaying a failure: Hypothesis prints the falsifying ``Config(...)`` (and a
``@reproduce_failure`` blob); ``check(Config(...))`` runs one configuration alone:
``python -c "import sys; sys.path.insert(0, 'tests'); from test_differential_data import *;
check(Config(...))"``.
"""

from __future__ import annotations

import copy
import math
import random
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

from ipuloop import Callback, Loop, poptorch

FEATURES, CLASSES, LENGTH, LR = 5, 3, 5, 0.2
WEIGHTS_TOL = {"rtol": 2e-5, "atol": 2e-6}


# -- data ---------------------------------------------------------------------------------------
def sample(i: int, n: int, cfg: Config, scale: float) -> tuple[torch.Tensor, int]:
    """Sample ``i`` of ``n``: features (a sequence of ``1 + i % 4`` of them with ``seq``), with
    noise drawn from the generator of the process reading it; its label."""
    x = torch.linspace(-1, 1, FEATURES) * ((i % 7) - 3) / 3 + i / n
    if cfg.noise:
        x = x + 0.05 * torch.randn(FEATURES)
    x = x * scale
    if cfg.collate == "padded":
        x = x[: 1 + i % 4]
    return x, i % CLASSES


class Items(Dataset):
    def __init__(self, n: int, cfg: Config) -> None:
        self.n, self.cfg, self.scale = n, cfg, 1.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple:
        x, y = sample(int(i), self.n, self.cfg, self.scale)
        return x, int(i), y


class Stream(IterableDataset):
    def __init__(self, n: int, cfg: Config) -> None:
        self.n, self.cfg, self.scale = n, cfg, 1.0
        self.start, self.end = 0, n  # (a worker_init_fn narrows them: its worker's share)

    def __iter__(self):
        ids = range(self.start, self.end)
        info = get_worker_info()
        if self.cfg.shard == "in_iter" and info is not None:
            ids = range(info.id, self.n, info.num_workers)
        for i in ids:
            x, y = sample(i, self.n, self.cfg, self.scale)
            yield x, i, y


class SizedStream(Stream):
    def __len__(self) -> int:
        return self.n


def configure_worker(worker: int) -> None:
    """A ``worker_init_fn`` configuring the worker's own dataset: its scale, and (``init_fn``
    sharding) its share of a stream, as torch's documentation shows."""
    info = get_worker_info()
    ds = info.dataset
    ds.scale = 1.5
    if isinstance(ds, Stream) and ds.cfg.shard == "init_fn":
        per = math.ceil(ds.n / info.num_workers)
        ds.start, ds.end = worker * per, min(ds.n, (worker + 1) * per)


def collate(cfg: Config):
    def tensors(samples: list[tuple]) -> tuple:
        if cfg.collate == "padded":  # every sequence padded to one fixed length
            x = torch.stack([F.pad(s[0], (0, LENGTH - len(s[0]))) for s in samples])
        else:
            x = torch.stack([s[0] for s in samples])
        ids = torch.tensor([s[1] for s in samples])
        y = torch.tensor([s[2] for s in samples])
        if cfg.collate == "stats":  # each micro-batch centred on its own mean
            x = x - x.mean(0, keepdim=True)
        return x, ids, y

    def as_dict(samples: list[tuple]) -> dict:
        x, ids, y = tensors(samples)
        return {"x": x, "ids": ids, "labels": y}

    if cfg.collate == "default":
        return None
    return as_dict if cfg.collate == "dict" else tensors


class Batches:
    """A custom batch sampler: batches of ``b`` in a shuffled order of its own generator."""

    def __init__(self, n: int, b: int, generator: torch.Generator) -> None:
        self.inner = BatchSampler(RandomSampler(range(n), generator=generator), b, drop_last=False)
        self.batch_size = b
        self.generator = generator

    def __iter__(self):
        return (batch for batch in self.inner if len(batch) == self.batch_size)

    def __len__(self) -> int:
        return len(self.inner.sampler) // self.batch_size


def make_loader(cfg: Config, n: int, seed: int) -> DataLoader:
    """The loader of ``cfg`` over ``n`` samples, its generators seeded from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    if cfg.dataset == "map":
        ds: Any = Items(n, cfg)
    else:
        ds = (SizedStream if cfg.dataset == "iter_sized" else Stream)(n, cfg)
    kw: dict[str, Any] = {"num_workers": cfg.workers, "collate_fn": collate(cfg)}
    if cfg.workers:
        kw["persistent_workers"] = cfg.persistent
        if cfg.init_fn:
            kw["worker_init_fn"] = configure_worker
    if cfg.dataset != "map":
        return DataLoader(ds, batch_size=cfg.micro, drop_last=cfg.drop_last, generator=g, **kw)
    b, order = cfg.micro, cfg.order
    if order == "batch_sampler":
        return DataLoader(ds, batch_sampler=Batches(n, b, g), **kw)
    if order == "sequential":
        kw["sampler"] = None
    elif order == "random":
        kw.update(shuffle=True, generator=g)
    elif order == "global":
        kw["shuffle"] = True
    elif order == "weighted":
        weights = torch.linspace(0.5, 2.0, n)
        kw["sampler"] = WeightedRandomSampler(weights, n, replacement=True, generator=g)
    elif order == "subset":
        kw["sampler"] = SubsetRandomSampler(range(1, n), generator=g)
    elif order == "distributed":
        # (its order is its seed's and the epoch's: the same seed in a resumed run, as a
        # user's program builds it)
        kw["sampler"] = DistributedSampler(ds, num_replicas=1, rank=0, seed=cfg.seed)
    return DataLoader(ds, batch_size=b, drop_last=cfg.drop_last, **kw)


# -- the model ----------------------------------------------------------------------------------
class Net(nn.Module):
    """A linear classifier with a model-with-loss's return; it logs the mean sample id of each
    micro-batch (which samples it was given) and, with ``ema``, keeps a running sum of its
    outputs in training as a parameter written in place in ``forward`` (summed, so that a write
    too many stays)."""

    def __init__(self, ema: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(FEATURES, CLASSES)
        self.ema = ema
        self.avg = nn.Parameter(torch.zeros(CLASSES), requires_grad=False)

    def forward(self, x, ids, labels=None):
        out = self.lin(x)
        if self.ema and self.training:
            with torch.no_grad():
                self.avg.add_(0.1 * out.mean(0))  # (a running sum: an extra write stays)
        if labels is None:
            return out
        return out, F.cross_entropy(out, labels), {"ids": ids.float().mean()}


def call(model: Net, batch: Any, labels: bool = True) -> Any:
    if isinstance(batch, dict):
        return model(batch["x"], batch["ids"], batch["labels"] if labels else None)
    x, ids, y = batch
    return model(x, ids, y if labels else None)


def rows(batch: Any) -> int:
    return len(batch["ids"] if isinstance(batch, dict) else batch[1])


def cut_rows(batches: list[Any], b: int) -> list[Any]:
    """The loader's batches' rows, in order, cut into micro-batches of ``b`` (the last short)."""
    if not batches:
        return []
    if isinstance(batches[0], dict):
        whole = {k: torch.cat([bt[k] for bt in batches]) for k in batches[0]}
        n = len(whole["ids"])
        return [{k: v[i : i + b] for k, v in whole.items()} for i in range(0, n, b)]
    whole = [torch.cat(parts) for parts in zip(*batches)]
    n = len(whole[1])
    return [tuple(t[i : i + b] for t in whole) for i in range(0, n, b)]


# -- the configuration --------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    dataset: str  # map, iter_sized, iter_unsized
    shard: str  # none, in_iter, init_fn (streams)
    noise: bool
    workers: int
    init_fn: bool
    persistent: bool
    collate: str  # default, dict, stats, padded
    order: str  # sequential, random, global, weighted, subset, batch_sampler, distributed
    drop_last: bool
    micro: int
    n: int
    di: int
    ga: int
    rf: int
    epochs: int
    nested: bool  # validate() and predict() from on_epoch_end
    ema: bool
    interrupt: str  # none, resume, continue
    at: int  # the interruption's step (1-based)
    seed: int

    @property
    def per_call(self) -> int:
        return self.di * self.ga * self.rf


@st.composite
def configs(draw: st.DrawFn, workers: tuple[int, ...] = (0, 0, 1)) -> Config:
    dataset = draw(st.sampled_from(["map", "map", "iter_sized", "iter_unsized"]))
    n_workers = draw(st.sampled_from(workers))
    shard = "none" if dataset == "map" else draw(st.sampled_from(["none", "in_iter", "init_fn"]))
    init_fn = shard == "init_fn" or (n_workers > 0 and draw(st.booleans()))
    interrupt = draw(st.sampled_from(["none", "resume", "continue"]))
    di, ga, rf = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    micro = draw(st.integers(1, 3))
    calls = draw(st.integers(1, 4))
    n = calls * di * ga * rf * micro + draw(st.integers(0, 2 * micro + 1))
    nested = draw(st.sampled_from([False, False, True]))  # (it reads two loaders more)
    persistent = n_workers > 0 and draw(st.booleans())
    # (workers' own random streams restart when a fit is resumed or continued, and persistent
    # workers' when a call ends: docs/loop.md)
    restarted = (interrupt != "none" and n_workers > 0) or (persistent and nested)
    noise = draw(st.booleans()) and not restarted
    return Config(
        dataset=dataset,
        shard=shard,
        noise=noise,
        workers=n_workers,
        init_fn=init_fn and n_workers > 0,
        persistent=persistent,
        collate=draw(st.sampled_from(["default", "dict", "stats", "padded"])),
        order="sequential"
        if dataset != "map"
        else draw(
            st.sampled_from(
                [
                    "sequential",
                    "random",
                    "global",
                    "weighted",
                    "subset",
                    "batch_sampler",
                    "distributed",
                ]
            )
        ),
        drop_last=draw(st.booleans()),
        micro=micro,
        n=n,
        di=di,
        ga=ga,
        rf=rf,
        epochs=draw(st.integers(1, 2)),
        nested=nested,
        ema=rf == 1 and draw(st.booleans()),  # (PopTorch refuses in-place writes with replicas)
        interrupt=interrupt,
        at=draw(st.integers(1, 8)),
        seed=draw(st.integers(0, 2**16)),
    )


VAL, TEST = 7, 9  # samples of the fit's validation set and of the test set the hooks read


def seed_everything(seed: int) -> None:
    """What ``Loop(seed=)`` seeds: python's, numpy's and torch's global generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


# -- the reference: plain torch -----------------------------------------------------------------
def evaluate(cfg: Config, model: Net, loader: DataLoader) -> dict[str, Any]:
    """val_loss over the whole micro-batches of ``B`` rows (a model-with-loss leaves the padded
    one out) and the outputs of every sample, in the loader's order, in eval mode."""
    model.eval()
    with torch.no_grad():
        micro = cut_rows(list(loader), cfg.micro)
        outs, losses = [], []
        for batch in micro:
            out, loss, _ = call(model, batch)
            outs.append(out)
            if rows(batch) == cfg.micro:
                losses.append(loss.item())
    model.train()
    logs = {"val_loss": math.fsum(losses) / len(losses)} if losses else {}
    return {"logs": logs, "outputs": torch.cat(outs)}


def reference(cfg: Config) -> dict[str, Any]:
    model = Net(cfg.ema, cfg.seed)
    opt = torch.optim.SGD([model.lin.weight, model.lin.bias], lr=LR)
    seed_everything(cfg.seed)
    loader = make_loader(cfg, cfg.n, cfg.seed)
    val = make_loader(cfg, VAL, cfg.seed + 1)
    test = make_loader(cfg, TEST, cfg.seed + 2)
    losses, ids, history, nested = [], [], [], []
    for epoch in range(cfg.epochs):
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        micro = [b for b in loader if rows(b) == cfg.micro]  # (a stream's short batch: dropped)
        calls = len(micro) // cfg.per_call
        for c in range(calls):
            host = micro[c * cfg.per_call : (c + 1) * cfg.per_call]
            step_losses, step_ids = [], []
            for d in range(cfg.di):
                for m in host[d * cfg.ga * cfg.rf : (d + 1) * cfg.ga * cfg.rf]:
                    _, loss, logs = call(model, m)
                    (loss / (cfg.ga * cfg.rf)).backward()
                    step_losses.append(loss.item())
                    step_ids.append(logs["ids"].item())
                opt.step()
                opt.zero_grad()
            losses.append(math.fsum(step_losses) / len(step_losses))
            ids.append(math.fsum(step_ids) / len(step_ids))
        row = evaluate(cfg, model, val)["logs"]
        history.append(row)
        if cfg.nested:  # validate(test), then predict(test): the test loader read twice
            logs = evaluate(cfg, model, test)["logs"]
            nested.append({"logs": logs, "outputs": evaluate(cfg, model, test)["outputs"]})
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "losses": losses,
        "ids": ids,
        "history": history,
        "nested": nested,
        "steps": len(losses),
    }


# -- the loop -----------------------------------------------------------------------------------
class Recorder(Callback):
    """Each step's loss and mean sample id; with ``test``, validate() and predict() at each
    epoch end, on a test loader."""

    def __init__(self, cfg: Config, test: DataLoader | None) -> None:
        self.cfg, self.test = cfg, test
        self.losses: list[float] = []
        self.ids: list[float] = []
        self.nested: list[dict[str, Any]] = []

    def on_train_step_end(self, loop: Loop) -> None:
        self.losses.append(loop.state.logs["loss"])
        self.ids.append(loop.state.logs["ids"])

    def on_epoch_end(self, loop: Loop) -> None:
        if self.test is not None:
            logs = loop.validate(self.test)
            self.nested.append({"logs": logs, "outputs": loop.predict(self.test)})


def make_loop(cfg: Config, model: Net, recorder: Recorder, seed: int) -> Loop:
    opts = poptorch.Options().deviceIterations(cfg.di).replicationFactor(cfg.rf)
    opts.Training.gradientAccumulation(cfg.ga)
    return Loop(
        model,
        opts,
        optimizer=poptorch.optim.SGD([model.lin.weight, model.lin.bias], lr=LR),
        callbacks=[recorder],
        seed=seed,
        progress=False,
    )


@dataclass
class Run:
    name: str
    weights: dict[str, torch.Tensor]
    losses: list[float]
    ids: list[float]
    first: int  # the step the recorded losses start at (0-based)
    history: list[dict[str, Any]]
    nested: list[dict[str, Any]]


def run_loop(cfg: Config, steps: int) -> list[Run]:
    model = Net(cfg.ema, cfg.seed)
    test = make_loader(cfg, TEST, cfg.seed + 2) if cfg.nested else None
    rec = Recorder(cfg, test)
    loop = make_loop(cfg, model, rec, cfg.seed)
    fit = {"epochs": cfg.epochs, "val_loader": make_loader(cfg, VAL, cfg.seed + 1)}
    loader = make_loader(cfg, cfg.n, cfg.seed)
    at = min(cfg.at, steps - 1)
    runs = []
    if cfg.interrupt == "none" or at < 1:
        history = loop.fit(loader, **fit)
        return [Run("loop", weights(model), rec.losses, rec.ids, 0, history, rec.nested)]
    loop.fit(loader, max_steps=at, **fit)
    assert loop.state.step == at
    if cfg.interrupt == "continue":
        history = loop.fit(loader, **fit)
        runs.append(Run("continued", weights(model), rec.losses, rec.ids, 0, history, rec.nested))
        return runs
    sd = loop.state_dict()
    fresh = Net(cfg.ema, cfg.seed + 1)  # other weights, overwritten by the state
    rec2 = Recorder(cfg, make_loader(cfg, TEST, cfg.seed + 2) if cfg.nested else None)
    rec2.nested = list(rec.nested)
    loop2 = make_loop(cfg, fresh, rec2, cfg.seed + 5)
    loop2.load_state_dict(sd)
    # a new loader whose generators are seeded otherwise: the checkpoint's state must win
    history = loop2.fit(make_loader(cfg, cfg.n, cfg.seed + 7), **fit)
    runs.append(
        Run(
            "resumed",
            weights(fresh),
            rec.losses + rec2.losses,
            rec.ids + rec2.ids,
            0,
            history,
            rec2.nested,
        )
    )
    return runs


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- the checks ---------------------------------------------------------------------------------
def check(cfg: Config) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference(cfg)
        assume(expected["steps"] >= 1)  # (a fit of no whole host call is refused: elsewhere)
        sized = cfg.dataset != "iter_unsized"
        if sized:
            opts = poptorch.Options().deviceIterations(cfg.di).replicationFactor(cfg.rf)
            opts.Training.gradientAccumulation(cfg.ga)
            counted = Loop.num_updates(make_loader(cfg, cfg.n, cfg.seed), opts, cfg.epochs)
            trained = expected["steps"] * cfg.di
            several = cfg.dataset != "map" and cfg.workers > 1
            if not several:
                assert counted == trained, "num_updates"
            elif cfg.shard != "none":  # (workers ending their shares with short batches)
                assert counted >= trained, "num_updates"
            # (else each worker yields the whole stream, as torch documents: its length
            # says nothing of what is read, and the fit warns)
        runs = run_loop(cfg, expected["steps"] // cfg.epochs)
    for run in runs:
        where = f"{run.name} loop"
        for name, want in expected["weights"].items():
            torch.testing.assert_close(
                run.weights[name],
                want,
                **WEIGHTS_TOL,
                msg=lambda m, w=f"{where}, {name}": f"{w}: {m}",
            )
        assert run.ids == pytest.approx(expected["ids"], rel=1e-6), f"{where}: samples per step"
        assert run.losses == pytest.approx(expected["losses"], rel=1e-5), f"{where}: step losses"
        assert len(run.history) == cfg.epochs, f"{where}: history rows"
        for e, (row, want) in enumerate(zip(run.history, expected["history"])):
            got = {k: row[k] for k in want}
            assert got == pytest.approx(want, rel=1e-5), f"{where}: epoch {e}'s validation"
        assert len(run.nested) == len(expected["nested"]), f"{where}: nested calls"
        for got, want in zip(run.nested, expected["nested"]):
            logs = {k: got["logs"][k] for k in want["logs"]}
            assert logs == pytest.approx(want["logs"], rel=1e-5), f"{where}: validate()"
            torch.testing.assert_close(got["outputs"], want["outputs"], rtol=2e-5, atol=2e-6)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.threads  # loader workers are drawn
@settings(
    max_examples=16,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(configs())
def test_fit_reads_the_loader_as_plain_torch(cfg: Config) -> None:
    note(repr(cfg))  # one line to paste into check(...)
    check(cfg)


@pytest.mark.slow
@pytest.mark.threads
@settings(
    max_examples=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(configs(workers=(0, 0, 0, 1, 1, 2, 3)))
def test_fit_reads_the_loader_as_plain_torch_many(cfg: Config) -> None:
    note(repr(cfg))
    check(cfg)
