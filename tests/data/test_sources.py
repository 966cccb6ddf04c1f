"""``ipuloop/sources.py``: a torch ``DataLoader`` read as torch reads it, case by case as users
met it: its ``collate_fn`` on each micro-batch, its ``worker_init_fn`` on its own dataset (in
validation and predict too), the order a seeded generator or global seed gives, persistent
workers' base seed drawn once, and an ``Order``'s selections."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, get_worker_info

from ipuloop import Loop, poptorch
from ipuloop.sources import Order, Selection

N, B, IN = 48, 4, 3


class Rows(Dataset):
    """``N`` fixed samples; ``scale`` is what a ``worker_init_fn`` sets in its worker."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, IN, generator=g)
        self.y = (self.x.sum(1) > 0).long()
        self.scale = 1.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] * self.scale, self.y[i]


def configure(worker: int) -> None:
    get_worker_info().dataset.scale = 3.0


SEEN: list[int] = []


def centred(samples):
    """A collate function using batch statistics: each batch centred on its own mean."""
    x = torch.stack([s[0] for s in samples])
    SEEN.append(len(samples))
    return x - x.mean(0, keepdim=True), torch.stack([s[1] for s in samples])


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(IN, 2)


def loop(net: nn.Module, di: int = 2, ga: int = 2) -> Loop:
    opts = poptorch.Options().deviceIterations(di)
    opts.Training.gradientAccumulation(ga)
    return Loop(
        net,
        opts,
        loss_fn=nn.CrossEntropyLoss(),
        progress=False,
        optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1),
    )


def plain(net: nn.Module, loader: DataLoader, epochs: int, per_call: int, ga: int) -> None:
    """Plain torch: each epoch's micro-batches as the loader yields them, ``per_call`` a host
    call (its remainder dropped), an SGD step on the mean of each ``ga``."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(epochs):
        micro = list(loader)
        for c in range(len(micro) // per_call):
            for k, (x, y) in enumerate(micro[c * per_call : (c + 1) * per_call]):
                (F.cross_entropy(net(x), y) / ga).backward()
                if (k + 1) % ga == 0:
                    opt.step()
                    opt.zero_grad()


def test_the_collate_function_sees_each_micro_batch_and_trains_as_plain_torch():
    """A collate using batch statistics runs on each micro-batch of 4, not on the host call of
    16, so the fit trains what plain torch trains."""
    SEEN.clear()
    ours = model()
    loop(ours).fit(
        DataLoader(
            Rows(),
            batch_size=B,
            shuffle=True,
            generator=torch.Generator().manual_seed(5),
            collate_fn=centred,
        ),
        epochs=2,
    )
    assert SEEN and set(SEEN) == {B}
    ref = model()
    plain(
        ref,
        DataLoader(
            Rows(),
            batch_size=B,
            shuffle=True,
            generator=torch.Generator().manual_seed(5),
            collate_fn=centred,
        ),
        2,
        4,
        2,
    )
    torch.testing.assert_close(ours.weight, ref.weight, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_worker_init_fn_configures_the_loaders_dataset_in_fit_validate_and_predict(persistent):
    """Its workers get the loader's own dataset (``get_worker_info().dataset``), in validation
    and predict too, where samples a host call lacks are padded after reading, not by a
    wrapper of the dataset: the predictions are those of plain torch's configured samples."""

    def make():
        return DataLoader(
            Rows(10),
            batch_size=B,
            num_workers=2,
            worker_init_fn=configure,
            persistent_workers=persistent,
        )

    net = model()
    lp = loop(net, di=2, ga=1)
    lp.fit(make(), epochs=1)
    out = lp.predict(make())
    logs = lp.validate(make())
    with torch.no_grad():
        x = torch.cat([x for x, _ in make()])
        assert torch.allclose(x, Rows(10).x * 3.0)  # (configured in the workers)
        want = net(x)
        torch.testing.assert_close(out, want)
        loss = F.cross_entropy(want, Rows(10).y).item()
    assert logs["val_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("how", ["generator", "global_seed"])
def test_the_order_is_the_one_torch_draws(how):
    """A seeded ``generator=``, or ``torch.manual_seed`` before the fit: each epoch's order is
    the one torch's own iterator gives (it draws its workers' base seed, then the order)."""

    class Logged(Rows):
        def __init__(self):
            super().__init__()
            self.log: list[int] = []

        def __getitem__(self, i):
            self.log.append(int(i))
            return super().__getitem__(i)

    def make(ds):
        g = torch.Generator().manual_seed(7) if how == "generator" else None
        return DataLoader(ds, batch_size=B, shuffle=True, generator=g)

    ds = Logged()
    lp = loop(model())
    torch.manual_seed(11)
    lp.fit(make(ds), epochs=2)
    torch.manual_seed(11)
    ref = make(range(N))
    torch_order = [int(i) for _ in range(2) for batch in ref for i in batch]
    assert ds.log[-2 * N :] == torch_order


def test_persistent_workers_draw_their_base_seed_once():
    """With persistent workers torch draws the workers' base seed as the first epoch starts
    only: the later epochs' orders drawn from the global seed are torch's, and a fit resumed in
    a new loop at epoch 2 starts its workers without drawing it."""

    def make():
        return DataLoader(
            Rows(), batch_size=B, shuffle=True, num_workers=1, persistent_workers=True
        )

    ours = model()
    lp = loop(ours)
    torch.manual_seed(3)
    lp.fit(make(), epochs=3)
    ref = model()
    torch.manual_seed(3)
    plain(ref, make(), 3, 4, 2)
    torch.testing.assert_close(ours.weight, ref.weight, rtol=2e-5, atol=1e-7)
    first = loop(model())
    torch.manual_seed(3)
    first.fit(make(), epochs=3, max_steps=4)  # stopped in epoch 2 (3 steps an epoch)
    sd = first.state_dict()
    resumed_model = model()
    resumed = loop(resumed_model)
    resumed.load_state_dict(sd)
    resumed.fit(make(), epochs=3)
    assert torch.equal(resumed_model.weight, ours.weight)


def test_an_order_reads_an_epoch_as_its_selection_says():
    """An epoch's batches of indices after a skip, up to a stop, this instance's share; the
    rest of the order drawn as a whole epoch draws it; ``started`` once the skip is drawn."""
    g = torch.Generator().manual_seed(0)
    inner = BatchSampler(RandomSampler(range(12), generator=g), 2, drop_last=False)
    g.manual_seed(0)
    whole = list(inner)
    state_after_epoch = g.get_state()
    order = Order(inner)
    started = []
    g.manual_seed(0)
    order.selection = Selection(
        skip=1, stop=5, share=1, size=2, rank=1, started=lambda: started.append(1)
    )
    assert list(order) == [whole[1], whole[3]]  # units 1..4, every other one (rank 1 of 2)
    assert started == [1] and torch.equal(g.get_state(), state_after_epoch)  # (drawn whole)
    order.selection = Selection(span=(2, 4))
    g.manual_seed(0)
    assert list(order) == whole[2:4]


def test_dynamic_padding_is_refused_before_compiling_naming_the_shapes_and_the_fix():
    """A collate padding each batch to its longest sequence: the host check reads the first
    micro-batches before anything compiles and refuses, naming padding, both shapes and the
    fix, instead of PopTorch's shape mismatch after some steps."""

    class Sequences(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return torch.ones(1 + i % 5), torch.tensor(i % 2)

    def pad_each(samples):
        longest = max(len(s[0]) for s in samples)
        return (
            torch.stack([F.pad(s[0], (0, longest - len(s[0]))) for s in samples]),
            torch.stack([s[1] for s in samples]),
        )

    class Mean(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(1, 2)

        def forward(self, x):
            return self.lin(x.mean(1, keepdim=True))

    lp = Loop(Mean(), loss_fn=nn.CrossEntropyLoss(), progress=False)
    # batches of 2: lengths 1,2 -> 2; 3,4 -> 4: the second micro-batch differs
    with pytest.raises(ValueError) as e:
        lp.fit(DataLoader(Sequences(), batch_size=2, collate_fn=pad_each))
    text = str(e.value)
    assert "dynamic padding" in text and "collate_fn" in text and "fixed" in text
    assert "[[2, 4], [2]]" in text and "[[2, 2], [2]]" in text
    assert lp.train_model is None  # before anything compiled
