"""Paths a careful user takes first, each against a plain reference: a custom batch sampler read
by loader workers (and ahead, ``async_data``), two unnamed checkpointers, float32 parameters
under ``precision="16-mixed"``, a ``val_every_n_steps`` longer than the fit, and a dict batch
whose labels a Transformers-style model never receives."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from ipuloop import Loop, poptorch
from ipuloop.callbacks.checkpoint import ModelCheckpoint

N, MICRO, FEATURES = 32, 2, 3  # 16 micro-batches: 16 steps of DI 1


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- 1. a custom batch sampler read by loader workers ---------------------------------------------
class Rows(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, FEATURES, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1 * torch.randn(
            N, 1, generator=g
        )

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Shuffled(Sampler):
    """Batches of ``MICRO`` indices in a new order each time it is iterated (global RNG)."""

    def __init__(self) -> None:
        self.batch_size = MICRO

    def __iter__(self):
        order = torch.randperm(N).tolist()
        return iter([order[i : i + MICRO] for i in range(0, N, MICRO)])

    def __len__(self) -> int:
        return N // MICRO


def _sampler_loop(async_data: bool = False) -> Loop:
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    return Loop(
        model,
        poptorch.Options(),
        loss_fn=nn.MSELoss(),
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.05),
        seed=1,
        progress=False,
        async_data=async_data,
    )


def _sampler_loader(workers: int) -> DataLoader:
    return DataLoader(Rows(), batch_sampler=Shuffled(), num_workers=workers)


def _reference(workers: int = 0, epochs: int = 2) -> nn.Module:
    """The uninterrupted fit (itself checked against a plain-torch loop below)."""
    loop = _sampler_loop()
    loop.fit(_sampler_loader(workers), epochs)
    return loop.model  # (the Linear: the loss the loop gave it is loop.model_with_loss)


def _plain(workers: int, epochs: int) -> nn.Module:
    """Plain torch: each epoch ``for x, y in loader``, SGD on the mean squared error of each
    micro-batch, from the loop's seeds."""
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1)
    random.seed(1)
    loader = _sampler_loader(workers)
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return model


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_sampler_fit_is_the_plain_torch_loop(workers):
    """The loop reads the loader as torch does: without workers each epoch draws one order
    from the global RNG; with workers torch calls ``iter()`` on the batch sampler twice as its
    iterator starts (once as it is built, once as it resets), so a sampler drawing as it is
    iterated draws twice, and the order read is the second."""
    ours = _reference(workers, epochs=2)
    torch.testing.assert_close(ours.weight, _plain(workers, 2).weight)
    if workers:
        assert not torch.equal(ours.weight, _reference(0, epochs=2).weight)


@pytest.mark.parametrize(
    "async_data", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "async"]
)
def test_a_batch_sampler_with_workers_resumes_exactly(async_data):
    """With loader workers (and read ahead), a fit resumed at step 3 runs the 13 steps left of
    its epoch and the next, ending bitwise where the uninterrupted fit ends."""
    want = _reference(workers=2)
    loop = _sampler_loop(async_data)
    loop.fit(_sampler_loader(2), 2)
    assert loop.state.step == 32
    assert torch.equal(loop.model.weight, want.weight)
    assert torch.equal(loop.model.bias, want.bias)

    first = _sampler_loop(async_data)
    first.fit(_sampler_loader(2), 2, max_steps=3)
    sd = first.state_dict()
    resumed = _sampler_loop(async_data)
    resumed.load_state_dict(sd)
    resumed.fit(_sampler_loader(2), 2)
    assert resumed.state.step == 32 and resumed.state.epoch == 2
    assert torch.equal(resumed.model.weight, want.weight)
    assert torch.equal(resumed.model.bias, want.bias)


def test_a_stop_late_in_a_resumed_epoch_leaves_it_incomplete():
    """A plain shuffled loader resumed at step 3, stopped at step 15 of its 16: the epoch is
    not complete (its length is the whole epoch's, not what the resume had left to read), and
    the fit finished from there ends bitwise as the uninterrupted one."""

    def loop_and_loader():
        return _sampler_loop(), DataLoader(Rows(), batch_size=MICRO, shuffle=True)

    want, loader = loop_and_loader()
    want.fit(loader, 1)
    first, loader = loop_and_loader()
    first.fit(loader, 1, max_steps=3)
    second, loader = loop_and_loader()
    second.load_state_dict(first.state_dict())
    second.fit(loader, 1, max_steps=15)
    assert (second.state.epoch, second.state.epoch_step) == (0, 15)
    third, loader = loop_and_loader()
    third.load_state_dict(second.state_dict())
    third.fit(loader, 1)
    assert (third.state.epoch, third.state.step) == (1, 16)
    assert torch.equal(third.model.weight, want.model.weight)


# -- 2. two checkpointers without name= -----------------------------------------------------------
def _ckpt_fit(callbacks, epochs=2, resume_from=None) -> Loop:
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    loop = Loop(
        model,
        poptorch.Options(),
        loss_fn=nn.MSELoss(),
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.05),
        seed=1,
        progress=False,
        callbacks=callbacks,
    )
    val = DataLoader(Rows(), batch_size=8)
    loop.fit(
        DataLoader(Rows(), batch_size=MICRO, shuffle=True),
        epochs,
        val_loader=val,
        resume_from=resume_from,
    )
    return loop


def _pair(root):
    return [
        ModelCheckpoint(root / "best", monitor="val_loss", save_top_k=2),
        ModelCheckpoint(root / "steps", every_n_steps=5, filename="s{step}"),
    ]


def test_two_unnamed_checkpointers_with_other_settings_each_resume_their_own(tmp_path):
    """``ModelCheckpoint("ck/best", monitor="val_loss", save_top_k=2)`` beside
    ``ModelCheckpoint("ck/steps", every_n_steps=5)``, as Lightning users write them: accepted,
    keyed by their settings, and a resume restores each one's kept list and best."""
    best, steps = _pair(tmp_path)
    _ckpt_fit([best, steps], epochs=2)
    assert best.state_key != steps.state_key
    assert best.state_key.startswith("ModelCheckpoint{") and "monitor='val_loss'" in best.state_key
    assert len(best.kept) == 2 and best.best_score is not None
    assert [e["step"] for e in steps.kept] == [32]  # (its epoch-end save: every_n_epochs=1)
    best2, steps2 = _pair(tmp_path)
    with pytest.warns(UserWarning, match="no epoch to run"):
        _ckpt_fit([best2, steps2], epochs=2, resume_from="last")
    assert best2.kept == best.kept and best2.best_score == best.best_score
    assert steps2.kept == steps.kept
    best3, steps3 = _pair(tmp_path)
    _ckpt_fit([best3, steps3], epochs=3, resume_from="last")
    assert [e["step"] for e in steps3.kept] == [48]  # its own kept list rotated on
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["s48"]


def test_unnamed_checkpointers_that_cannot_be_told_apart_are_refused(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"state_key \"ModelCheckpoint\{dirpath="):
        Loop(
            model,
            loss_fn=nn.MSELoss(),
            callbacks=[ModelCheckpoint(tmp_path / "a"), ModelCheckpoint(tmp_path / "a")],
            progress=False,
        )
    with pytest.raises(ValueError, match=r"differ in folder, filename, when they save"):
        Loop(  # the error says which settings tell checkpointers apart
            model,
            loss_fn=nn.MSELoss(),
            callbacks=[ModelCheckpoint(tmp_path / "a"), ModelCheckpoint(tmp_path / "a")],
            progress=False,
        )


def test_a_checkpoint_keyed_by_the_class_name_still_loads(tmp_path):
    """A checkpoint written when an unnamed checkpointer was keyed ``ModelCheckpoint`` (its
    class) restores that checkpointer's state: a loop with one unnamed ModelCheckpoint takes
    it; one with two that could each have written it restores neither, with a warning."""
    ckpt = ModelCheckpoint(tmp_path / "a", monitor="val_loss", save_top_k=2)
    loop = _ckpt_fit([ckpt], epochs=2)
    sd = loop.state_dict()
    sd["callbacks"] = {"ModelCheckpoint": sd["callbacks"].pop(ckpt.state_key)}
    again = ModelCheckpoint(tmp_path / "a", monitor="val_loss", save_top_k=2)
    fresh = Loop(nn.Linear(FEATURES, 1), loss_fn=nn.MSELoss(), callbacks=[again], progress=False)
    fresh.load_state_dict(sd)
    assert again.kept == ckpt.kept and again.best_score == ckpt.best_score
    a, b = _pair(tmp_path)
    two = Loop(nn.Linear(FEATURES, 1), loss_fn=nn.MSELoss(), callbacks=[a, b], progress=False)
    with pytest.warns(UserWarning, match="none restores it"):
        two.load_state_dict(sd)
    assert a.kept == [] and b.kept == []


# -- 4. val_every_n_steps longer than the fit -----------------------------------------------------
def test_val_every_n_steps_beyond_the_fit_warns_naming_its_steps():
    """``val_every_n_steps=1000`` in a fit of 8 steps never validates mid-fit: a warning at
    fit start names the fit's 8 steps; a period within the fit gives none."""
    loader = DataLoader(Rows(), batch_size=MICRO * 2, shuffle=True)  # 8 steps
    val = DataLoader(Rows(), batch_size=8)
    with pytest.warns(UserWarning, match=r"val_every_n_steps=1000 is more than the 8 steps"):
        _sampler_loop().fit(loader, 1, val_loader=val, val_every_n_steps=1000)
    with pytest.warns(UserWarning, match=r"more than the 5 steps .*max_steps=5"):
        _sampler_loop().fit(loader, 2, val_loader=val, val_every_n_steps=6, max_steps=5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="val_every_n_steps")
        _sampler_loop().fit(loader, 2, val_loader=val, val_every_n_steps=16)


# -- 5. a "label" column and a Transformers-style model -------------------------------------------
class Examples(Dataset):
    """Dict samples with the labels under "label", as a Hugging Face dataset has them."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.full((4,), float(i)), "label": torch.tensor(i % 2)}


class TransformersLike(nn.Module):
    """``forward(input_ids, labels=None, **kwargs)`` returning a dict whose loss is None
    without ``labels=``, as a Transformers model does."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)
        if strict:  # no **kwargs: an unknown keyword is a TypeError
            self.forward = self._strict  # type: ignore[method-assign]

    def forward(self, input_ids, labels=None, **kwargs):
        logits = self.head(input_ids)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}

    def _strict(self, input_ids, labels=None):
        return TransformersLike.forward(self, input_ids, labels)


@pytest.mark.parametrize("strict", [False, True], ids=["kwargs", "no-kwargs"])
def test_labels_fed_under_another_key_name_labels_and_the_fix(strict):
    """``label_key="label"``: the batch is fed as ``label=``, which forward's ``**kwargs``
    takes in (or forward refuses); the refusal says forward received no ``labels=`` and how
    to map the key, before anything compiles. Renamed, the same data trains."""
    model = TransformersLike(strict)
    loop = Loop(model, label_key="label", progress=False)
    with pytest.raises(ValueError) as e:
        loop.fit(DataLoader(Examples(), batch_size=2), 1)
    message = str(e.value)
    if not strict:
        assert "forward received no labels=" in message
        assert "must return" not in message
    assert "rename_column('label', 'labels')" in message
    assert loop.train_model is None  # refused before compiling

    def renamed(batch):
        batch = torch.utils.data.default_collate(batch)
        batch["labels"] = batch.pop("label")
        return batch

    loop = Loop(TransformersLike(strict), progress=False)
    loop.fit(DataLoader(Examples(), batch_size=2, collate_fn=renamed), 1)
    assert loop.state.step == 4


# -- 3. a float32 parameter in float16 activations under "16-mixed" -------------------------------
class Tokens(nn.Module):
    """A vision transformer in miniature: two patches embedded, a class token put before them
    and a position embedding added (float32 parameters, as timm's ``cls_token`` and
    ``pos_embed``), then four matmuls; ``cast``: forward casts them to the activations'
    dtype."""

    def __init__(self, cast: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cast = cast
        self.patch_embed = nn.Linear(4, 8)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 3, 8) * 0.02)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch_embed(x)
        cls, pos = self.cls_token, self.pos_embed
        if self.cast:
            cls, pos = cls.to(t.dtype), pos.to(t.dtype)
        t = torch.cat([cls.expand(x.shape[0], -1, -1), t], dim=1) + pos
        return self.head(self.blocks(t)[:, 0])


def _patches() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 4, generator=g)
    y = (x[:, 0, 0] > 0).long()
    ds = torch.utils.data.TensorDataset(x, y)
    return DataLoader(ds, batch_size=4), DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def _mixed_fit(model: nn.Module, precision: str = "16-mixed") -> Loop:
    loop = Loop(
        model,
        loss_fn=nn.CrossEntropyLoss(),
        precision=precision,
        progress=False,
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.01),
    )
    train, _ = _patches()
    loop.fit(train, 1)
    return loop


def test_a_float32_class_token_under_16_mixed_warns_naming_it():
    """The class token (float32) joins the float16 patch embeddings in ``cat``: everything
    after it computes in float32, so 4 of the 5 matmuls do, and predict returns float32. A
    warning at fit start says so, names ``cat`` and ``cls_token``, and the fixes."""
    with pytest.warns(UserWarning, match="16-mixed") as caught:
        loop = _mixed_fit(Tokens())
    message = " ".join(str(w.message) for w in caught if "16-mixed" in str(w.message))
    assert "4 of the model's 5 matmuls and convolutions compute in float32" in message
    assert "'cat'" in message and "'cls_token'" in message
    assert "16-true" in message and ".to(x.dtype)" in message
    _, inputs = _patches()
    assert loop.predict(inputs).dtype == torch.float32  # as the docs say: promoted


def test_16_mixed_without_float32_operands_computes_in_float16_and_gives_no_warning():
    """Cast to the activations' dtype in forward, the same model computes every matmul in
    float16 and predict returns float16; under "32" and "16-true" nothing is checked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*16-mixed")
        loop = _mixed_fit(Tokens(cast=True))
        _mixed_fit(Tokens(), precision="32")
        _mixed_fit(Tokens(), precision="16-true")
    _, inputs = _patches()
    assert loop.predict(inputs).dtype == torch.float16


class LayerScale(nn.Module):
    """A float32 per-channel scale (layer scale) multiplied into float16 activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(8, 8)
        self.gamma = nn.Parameter(torch.ones(8))
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.inner(x) * self.gamma)


class Embedded(nn.Module):
    """Integer inputs embedded: float32 activations from the first op, no float16 input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


@pytest.mark.parametrize(
    "model, x, names",
    [
        (LayerScale, torch.randn(8, 8), ("3 of the model's 4", "'mul'", "'gamma'")),
        (Embedded, torch.randint(0, 10, (8, 5)), ("1 of the model's 1", "embedding")),
    ],
    ids=["layer-scale", "embedding"],
)
def test_16_mixed_names_a_layer_scale_or_an_embedding(model, x, names):
    """Each warning says why the matmuls compute in float32, as the device runs them (predict
    returns float32)."""
    loop = Loop(model(), loss_fn=nn.CrossEntropyLoss(), precision="16-mixed", progress=False)
    data = torch.utils.data.TensorDataset(x, torch.randint(0, 2, (8,)))
    with pytest.warns(UserWarning, match="16-mixed") as caught:
        loop.fit(DataLoader(data, batch_size=4), 1)
    message = " ".join(str(w.message) for w in caught)
    assert all(n in message for n in names), message
    assert loop.predict(DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)).dtype == (
        torch.float32
    )
