"""A checkpoint's ``model`` is the user's module's ``state_dict``, also with ``loss_fn=``.

``loop.model`` is the module given; the ``WithLoss`` the loop wraps it in is
``loop.model_with_loss``. Checkpoints load into the plain module with ``load_state_dict``;
those written with the wrapper's ``model.``-prefixed keys still resume and load.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from ipuloop import Loop, WithLoss, poptorch
from ipuloop.callbacks import ModelCheckpoint
from ipuloop.checkpoint_io import load_checkpoint

IN, CLASSES = 4, 3


def _loader(n: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, IN, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=g)), 2)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 8), nn.ReLU(), nn.Linear(8, CLASSES))


def _loop(model: nn.Module | None = None, weight: torch.Tensor | None = None, **kwargs) -> Loop:
    model = _net() if model is None else model
    return Loop(
        model,
        poptorch.Options().deviceIterations(2),
        loss_fn=nn.CrossEntropyLoss(weight=weight),
        optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        progress=False,
        **kwargs,
    )


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_checkpoint_holds_the_users_module_and_loads_into_plain_torch(tmp_path):
    net = _net()
    loop = _loop(net, callbacks=[ModelCheckpoint(tmp_path)])
    assert loop.model is net
    assert isinstance(loop.model_with_loss, WithLoss) and loop.model_with_loss.model is net
    loop.fit(_loader(), epochs=1)
    saved = torch.load(loop.callbacks[0].last_path / "state.pt", weights_only=True)["model"]
    assert sorted(saved) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    plain = _net()
    plain.load_state_dict(saved)  # strict: the same keys
    assert _same(plain.state_dict(), net.state_dict())
    assert _same(load_checkpoint(loop.callbacks[0].last_path)["model"], saved)


def test_an_older_checkpoint_with_the_wrappers_keys_still_resumes_exactly():
    whole = _loop()
    whole.fit(_loader(), epochs=2)

    first = _loop()
    first.fit(_loader(), epochs=1)
    sd = first.state_dict()
    old = dict(sd, model={f"model.{k}": v for k, v in sd["model"].items()})
    del old["loss_fn"]  # (not written then)
    for saved in (sd, old):
        resumed = _loop()
        resumed.load_state_dict(saved)
        resumed.fit(_loader(), epochs=2)
        assert _same(resumed.model.state_dict(), whole.model.state_dict())


def test_load_weights_takes_the_users_keys_and_the_wrappers():
    trained = _loop()
    trained.fit(_loader(), epochs=1)
    weights = trained.state_dict()["model"]
    x = _loader().dataset.tensors[0]
    for given in (weights, {f"model.{k}": v for k, v in weights.items()}):
        loop = _loop()
        loop.fit(_loader(16), epochs=1)  # (a compiled training model: loaded into it)
        loop.load_weights(given)
        assert _same(loop.model.state_dict(), weights)
        out = loop.predict(DataLoader(TensorDataset(x), batch_size=2))
        assert torch.allclose(out, trained.predict(DataLoader(TensorDataset(x), batch_size=2)))


def test_the_loss_functions_state_travels_beside_the_model():
    weight = torch.tensor([1.0, 2.0, 0.5])
    loop = _loop(weight=weight)
    loop.fit(_loader(), epochs=1)
    sd = loop.state_dict()
    assert "weight" not in sd["model"] and torch.equal(sd["loss_fn"]["weight"], weight)
    other = _loop(weight=torch.ones(3))
    other.load_state_dict(sd)
    assert torch.equal(other.model_with_loss.loss_fn.weight, weight)


def test_load_best_at_end_loads_the_users_keys(tmp_path):
    ckpt = ModelCheckpoint(tmp_path, monitor="val_loss", load_best_at_end=True, save_top_k=1)
    loop = _loop(callbacks=[ckpt])
    loop.fit(_loader(), epochs=3, val_loader=_loader(8))
    assert _same(loop.model.state_dict(), load_checkpoint(ckpt.best_path)["model"])
