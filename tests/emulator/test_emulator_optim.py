"""poptorch.optim emulation: equal to torch at defaults, real loss scaling / clipping math,
PopART variants against hand-written formulas, and the executor's snapshot helpers."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

import ipuloop.emulator as poptorch
from ipuloop.emulator import optim as popt

STEPS = 4

# torch 2.0's CPU has no float16 kernels for many backward and optimizer ops
# ("mse_backward_cpu_out" not implemented for 'Half'): the emulator computes float16 forward
# ops it lacks in float32, but not autograd's backward, so 16-bit training needs torch >= 2.1.
NEEDS_CPU_HALF_BACKWARD = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 1),
    reason="torch < 2.1 has no float16 CPU kernels for backward and optimizer ops",
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _groups(model: torch.nn.Module) -> list[dict]:
    # two groups so that clipping / snapshots must span all of them
    return [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), "lr": 0.05},
    ]


def _train(
    make_opt,
    steps: int = STEPS,
    scale: float = 1.0,
    clip: float | None = None,
    groups: bool = False,
) -> list[torch.Tensor]:
    model = _model()
    opt = make_opt(_groups(model) if groups else model.parameters())
    for step in range(steps):
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss * scale).backward()  # what the executor does with loss_scaling
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


PAIRS = [  # (ours, torch, kwargs)
    (popt.SGD, torch.optim.SGD, dict(lr=0.1)),
    (popt.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (popt.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (popt.Adam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    (popt.AdamW, torch.optim.AdamW, dict(lr=0.01)),
    (popt.RMSprop, torch.optim.RMSprop, dict(lr=0.01)),
    (popt.RMSprop, torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
]


@pytest.mark.parametrize("ours,theirs,kw", PAIRS, ids=lambda v: getattr(v, "__name__", None))
def test_defaults_equal_torch_bitwise(ours, theirs, kw):
    a = _train(lambda p: ours(p, **kw), groups=True)
    b = _train(lambda p: theirs(p, **kw), groups=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


ALL = [
    (popt.SGD, dict(lr=0.1, momentum=0.9)),
    (popt.Adam, dict(lr=0.01)),
    (popt.AdamW, dict(lr=0.01)),
    (popt.RMSprop, dict(lr=0.01)),
    (popt.LAMB, dict(lr=0.01)),
]


@pytest.mark.parametrize("cls,kw", ALL, ids=lambda v: getattr(v, "__name__", None))
def test_loss_scaling_is_undone_in_step(cls, kw):
    ref = _train(lambda p: cls(p, **kw))
    for scale in (1024.0, 3.0):
        out = _train(lambda p: cls(p, loss_scaling=scale, **kw), scale=scale)
        assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-6) for x, y in zip(out, ref))
    # the gradients themselves are unscaled (Adam-like updates hide a scale up to eps)
    model = _model()
    opt = cls(model.parameters(), loss_scaling=1024.0, **kw)
    x, y = _batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    (torch.nn.functional.mse_loss(model(x), y) * 1024.0).backward()
    opt.step()
    assert all(torch.allclose(p.grad, e, atol=1e-7) for p, e in zip(model.parameters(), expected))


@pytest.mark.parametrize(
    "ours,theirs,kw",
    [
        (popt.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
        (popt.Adam, torch.optim.Adam, dict(lr=0.01)),
        (popt.AdamW, torch.optim.AdamW, dict(lr=0.01)),
    ],
    ids=["SGD", "Adam", "AdamW"],
)
def test_max_grad_norm_clips_globally_like_clip_grad_norm(ours, theirs, kw):
    out = _train(lambda p: ours(p, max_grad_norm=0.05, **kw), groups=True)
    ref = _train(lambda p: theirs(p, **kw), clip=0.05, groups=True)
    assert all(torch.equal(x, y) for x, y in zip(out, ref))
    unclipped = _train(lambda p: theirs(p, **kw), groups=True)
    assert not all(torch.allclose(x, y) for x, y in zip(out, unclipped))
    # unscale happens before clipping
    scaled = _train(
        lambda p: ours(p, max_grad_norm=0.05, loss_scaling=512.0, **kw), scale=512.0, groups=True
    )
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(scaled, ref))


def _grads_and_params(steps: int = STEPS):
    """Replays the training of _train with a hand-written update; yields (params, grads)."""
    model = _model()
    params = list(model.parameters())
    for step in range(steps):
        x, y = _batch(step)
        with torch.enable_grad():  # the caller iterates inside no_grad
            torch.nn.functional.mse_loss(model(x), y).backward()
        yield params, [p.grad.clone() for p in params]
        for p in params:
            p.grad = None


def test_adamw_without_bias_correction_matches_formula():
    lr, b1, b2, eps, wd = 0.01, 0.8, 0.9, 1e-6, 0.1
    out = _train(
        lambda p: popt.AdamW(
            p, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, bias_correction=False
        )
    )
    ms = vs = None
    with torch.no_grad():
        for params, grads in _grads_and_params():
            ms = ms or [torch.zeros_like(p) for p in params]
            vs = vs or [torch.zeros_like(p) for p in params]
            for p, g, m, v in zip(params, grads, ms, vs):
                m.copy_(b1 * m + (1 - b1) * g)
                v.copy_(b2 * v + (1 - b2) * g * g)
                p.copy_(p * (1 - lr * wd) - lr * m / (v.sqrt() + eps))
        ref = [p.detach().clone() for p in params]
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(out, ref))
    biased = _train(lambda p: popt.AdamW(p, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd))
    assert not all(torch.allclose(x, y, atol=1e-6) for x, y in zip(biased, ref))


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("max_weight_norm", [None, 0.3])
def test_lamb_matches_reference(bias_correction, max_weight_norm):
    lr, b1, b2, eps, wd = 0.02, 0.9, 0.99, 1e-6, 0.01
    out = _train(
        lambda p: popt.LAMB(
            p,
            lr=lr,
            betas=(b1, b2),
            eps=eps,
            weight_decay=wd,
            bias_correction=bias_correction,
            max_weight_norm=max_weight_norm,
        )
    )
    cap = 65500.0 if max_weight_norm is None else max_weight_norm
    ms = vs = None
    with torch.no_grad():
        for t, (params, grads) in enumerate(_grads_and_params(), start=1):
            ms = ms or [torch.zeros_like(p) for p in params]
            vs = vs or [torch.zeros_like(p) for p in params]
            for p, g, m, v in zip(params, grads, ms, vs):
                m.copy_(b1 * m + (1 - b1) * g)
                v.copy_(b2 * v + (1 - b2) * g * g)
                m_hat = m / (1 - b1**t) if bias_correction else m
                v_hat = v / (1 - b2**t) if bias_correction else v
                r = m_hat / (v_hat.sqrt() + eps) + wd * p
                w_norm = min(float(p.norm()), cap)
                r_norm = float(r.norm())
                ratio = 1.0 if w_norm == 0 or r_norm == 0 else w_norm / r_norm
                p.copy_(p - lr * ratio * r)
        ref = [p.detach().clone() for p in params]
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(out, ref))


def test_lamb_trust_ratio_is_one_for_zero_weights():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = popt.LAMB([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.tensor([1.0, -2.0, 0.5])
    opt.step()
    # m_hat = g, v_hat = g^2 -> r = sign(g) (up to eps); ratio 1
    assert torch.allclose(p.detach(), -0.1 * torch.sign(p.grad), atol=1e-6)


def test_rmsprop_tf_variant_matches_formula():
    lr, alpha, eps, mom = 0.01, 0.9, 1e-3, 0.5
    out = _train(
        lambda p: popt.RMSprop(p, lr=lr, alpha=alpha, eps=eps, momentum=mom, use_tf_variant=True)
    )
    ms = bufs = None
    with torch.no_grad():
        for params, grads in _grads_and_params():
            ms = ms or [torch.ones_like(p) for p in params]  # TF initialises to ones
            bufs = bufs or [torch.zeros_like(p) for p in params]
            for p, g, s, b in zip(params, grads, ms, bufs):
                s.copy_(alpha * s + (1 - alpha) * g * g)
                b.copy_(mom * b + lr * g / torch.sqrt(s + eps))
                p.copy_(p - b)
        ref = [p.detach().clone() for p in params]
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(out, ref))
    torch_like = _train(lambda p: popt.RMSprop(p, lr=lr, alpha=alpha, eps=eps, momentum=mom))
    assert not all(torch.allclose(x, y, atol=1e-6) for x, y in zip(torch_like, ref))


def test_velocity_scaling_is_neutral_and_stored_scaled(caplog):
    kw = dict(lr=0.1, momentum=0.9)
    ref = _train(lambda p: torch.optim.SGD(p, **kw))
    out = _train(lambda p: popt.SGD(p, velocity_scaling=8.0, use_combined_accum=True, **kw))
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(out, ref))
    p = torch.nn.Parameter(torch.ones(2))
    opt = popt.SGD([p], velocity_scaling=8.0, use_combined_accum=True, **kw)
    p.grad = torch.ones(2)
    opt.step()
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.full((2,), 8.0))
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        popt.SGD([p], lr=0.1, velocity_scaling=2.0)
    assert "velocity_scaling value ignored" in caplog.text


def test_constructor_errors():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="non-amsgrad"):
        popt.Adam(p, amsgrad=True)
    with pytest.raises(ValueError, match="non-amsgrad"):
        popt.AdamW(p, amsgrad=True)
    with pytest.raises(TypeError):
        popt.LAMB(p, max_grad_norm=1.0)  # LAMB has no max_grad_norm, as in PopTorch
    with pytest.raises(TypeError):
        popt.RMSprop(
            p, max_grad_norm=1.0
        )  # RMSprop has no clipping at all (docs/poptorch-semantics.md §9)
    with pytest.raises(ValueError, match="first_order_momentum_accum_type=torch.bfloat16"):
        popt.Adam(p, first_order_momentum_accum_type=torch.bfloat16)
    opt = popt.SGD(p, lr=0.1, accum_type=torch.float16)
    assert opt.accum_type is torch.float16 and opt.velocity_accum_type is torch.float32


def test_effective_defaults():
    p = [torch.nn.Parameter(torch.ones(2))]
    lamb = popt.LAMB(p)
    assert (lamb.loss_scaling, lamb.max_weight_norm, lamb.bias_correction) == (1.0, 65500.0, True)
    g = lamb.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 1e-2)
    sgd = popt.default_optimizer(p)
    assert isinstance(sgd, popt.SGD) and sgd.param_groups[0]["lr"] == popt.DEFAULT_SGD_LR == 0.01
    assert sgd.max_grad_norm == math.inf and sgd.param_groups[0]["velocity_scaling"] == 1.0
    assert popt.AdamW(p).param_groups[0]["weight_decay"] == 1e-2
    assert popt.loss_scaling(popt.Adam(p, loss_scaling=64.0)) == 64.0
    assert popt.loss_scaling(torch.optim.Adam(p)) == 1.0


def _supported(params):
    return [
        popt.SGD(params, lr=0.1),
        popt.Adam(params),
        popt.AdamW(params),
        popt.RMSprop(params),
        popt.LAMB(params),
        torch.optim.SGD(params, lr=0.1),
        torch.optim.Adam(params),
        torch.optim.AdamW(params),
        torch.optim.RMSprop(params),
    ]


def test_check_supported(caplog):
    p = [torch.nn.Parameter(torch.ones(2))]
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        for opt in _supported(p):
            popt.check_supported(opt)
    assert caplog.text == ""
    for bad in (torch.optim.LBFGS(p), torch.optim.Adagrad(p)):
        with pytest.raises(AssertionError, match="Unsupported optimizer type") as err:
            popt.check_supported(bad)
        assert type(bad).__name__ in str(err.value) and "poptorch.optim.LAMB" in str(err.value)

    class MySGD(torch.optim.SGD):
        pass

    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        popt.check_supported(MySGD(p, lr=0.1))
        popt.check_supported(MySGD(p, lr=0.1))
    assert caplog.text.count("Poptorch does not run Python optimizer code directly") == 1  # once
    assert "Optimizer `MySGD` subclassed from classes in poptorch.optim" in caplog.text
    with pytest.raises(ValueError, match="non-amsgrad"):
        popt.check_supported(torch.optim.Adam(p, amsgrad=True))
    q = [torch.nn.Parameter(torch.ones(2))]
    mixed = popt.RMSprop([{"params": p}, {"params": q, "centered": True}])
    with pytest.raises(AssertionError, match="same value for the 'centered' attribute"):
        popt.check_supported(mixed)


@pytest.mark.parametrize(
    "make,constant,variable",
    [
        (
            lambda p: popt.SGD(p, lr=0.1),
            {
                "momentum",
                "dampening",
                "weight_decay",
                "nesterov",
                "loss_scaling",
                "velocity_scaling",
                "max_grad_norm",
                "accum_type",
                "use_combined_accum",
            },
            {"lr"},
        ),
        (
            lambda p: popt.SGD(
                p,
                lr=0.1,
                momentum=0.0,
                loss_scaling=1.0,
                max_grad_norm=5.0,
                accum_type=torch.float32,
            ),
            {"dampening", "weight_decay", "accum_type"},
            {"lr", "momentum", "loss_scaling", "max_grad_norm"},
        ),
        (
            lambda p: popt.Adam(p, betas=(0.9, 0.99)),
            {"eps", "weight_decay", "loss_scaling"},
            {"lr", "betas"},
        ),
        (lambda p: popt.AdamW(p, bias_correction=True), {"bias_correction", "betas"}, {"lr"}),
        (
            lambda p: popt.RMSprop(p, alpha=0.9, use_tf_variant=False),
            {"eps", "momentum", "use_tf_variant"},
            {"lr", "alpha"},
        ),
        (
            lambda p: popt.LAMB(p, max_weight_norm=10.0),
            {"betas", "loss_scaling"},
            {"lr", "max_weight_norm"},
        ),
        (
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            {"dampening", "weight_decay", "nesterov", "loss_scaling"},
            {"lr", "momentum"},
        ),
        (
            lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.01, betas=(0.5, 0.6)),
            {"weight_decay", "eps", "betas"},
            {"lr"},
        ),  # betas always constant for torch.optim
        (lambda p: torch.optim.AdamW(p, weight_decay=0.1), {"eps"}, {"lr", "weight_decay"}),
        (
            lambda p: torch.optim.RMSprop(p, alpha=0.5, eps=1e-3),
            {"alpha", "momentum"},
            {"lr", "eps"},
        ),  # alpha always constant for torch.optim
    ],
)
def test_constant_attributes(make, constant, variable):
    consts = popt.constant_attributes(make([torch.nn.Parameter(torch.ones(2))]))
    assert constant <= consts
    assert not variable & consts


def test_mark_as_variable_or_constant():
    opt = popt.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    opt.variable_attrs.markAsVariable("loss_scaling")
    opt.variable_attrs.markAsConstant("momentum")
    consts = popt.constant_attributes(opt)
    assert "momentum" in consts and "loss_scaling" not in consts
    with pytest.raises(AssertionError, match="Unknown attribute"):
        opt.variable_attrs.markAsVariable("nonsense")


def test_snapshots_and_changed_constants():
    model = _model()
    opt = popt.SGD(_groups(model), lr=0.1, momentum=0.9, loss_scaling=4.0)
    snap = popt.hyperparameters(opt)
    assert snap == popt.hyperparameters(opt)
    assert snap["global"]["loss_scaling"] == 4.0 and snap["global"]["max_grad_norm"] == math.inf
    assert [g["lr"] for g in snap["groups"]] == [0.1, 0.05]
    consts = popt.constant_attributes(opt)
    opt.param_groups[1]["lr"] = 0.01
    opt.loss_scaling = 8.0
    new = popt.hyperparameters(opt)
    assert new != snap and popt.changed_constants(snap, new, consts) == []
    opt.param_groups[0]["weight_decay"] = 0.1
    assert popt.changed_constants(snap, popt.hyperparameters(opt), consts) == ["weight_decay"]
    t = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    assert popt.hyperparameters(t)["groups"][0]["lr"] == pytest.approx(0.01)
    assert popt.hyperparameters(t)["global"] == {}


def test_apply_hyperparameters_updates_device_copy():
    model, dev_model = _model(), _model()
    opt = popt.Adam(model.parameters(), lr=0.01, loss_scaling=2.0, max_grad_norm=1.0)
    memo = {id(h): d for h, d in zip(model.parameters(), dev_model.parameters())}
    dev = copy.deepcopy(opt, memo)
    opt.param_groups[0]["lr"] = 0.5
    opt.param_groups[0]["betas"] = (0.5, 0.6)
    opt.loss_scaling, opt.max_grad_norm = 16.0, 3.0
    popt.apply_hyperparameters(dev, popt.hyperparameters(opt))
    assert dev.param_groups[0]["lr"] == 0.5 and dev.param_groups[0]["betas"] == (0.5, 0.6)
    assert (dev.loss_scaling, dev.max_grad_norm) == (16.0, 3.0)
    assert popt.hyperparameters(dev) == popt.hyperparameters(opt)
    tlr = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
    dev_t = copy.deepcopy(tlr, memo)
    tlr.param_groups[0]["lr"] = 0.2
    popt.apply_hyperparameters(dev_t, popt.hyperparameters(tlr))
    assert isinstance(dev_t.param_groups[0]["lr"], torch.Tensor)  # stays a tensor
    assert float(dev_t.param_groups[0]["lr"]) == pytest.approx(0.2)


@pytest.mark.parametrize(
    "cls,kw",
    ALL + [(popt.AdamW, dict(bias_correction=False)), (popt.RMSprop, dict(use_tf_variant=True))],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_deepcopy_with_param_memo(cls, kw):
    host, dev_model = _model(), _model()
    opt = cls(host.parameters(), loss_scaling=2.0, **kw)
    x, y = _batch(0)
    (torch.nn.functional.mse_loss(host(x), y) * 2.0).backward()
    opt.step()
    dev_params = list(dev_model.parameters())
    with torch.no_grad():
        for h, d in zip(host.parameters(), dev_params):
            d.copy_(h)
    dev = copy.deepcopy(opt, memo={id(h): d for h, d in zip(host.parameters(), dev_params)})
    assert type(dev) is cls and dev.variable_attrs.isConstant("eps")
    assert popt.hyperparameters(dev) == popt.hyperparameters(opt)
    assert all(a is b for a, b in zip(dev.param_groups[0]["params"], dev_params))
    assert set(dev.state) == set(dev_params)
    for h, d in zip(host.parameters(), dev_params):  # state copied, not shared
        for k, v in opt.state[h].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, dev.state[d][k]) and v is not dev.state[d][k]
    for model, o in ((host, opt), (dev_model, dev)):  # same next step on both
        o.zero_grad(set_to_none=True)
        x, y = _batch(1)
        (torch.nn.functional.mse_loss(model(x), y) * 2.0).backward()
        o.step()
    assert all(torch.equal(h, d) for h, d in zip(host.parameters(), dev_params))


def test_step_hooks_run_once_and_closure_works():
    p = torch.nn.Parameter(torch.ones(2))
    torch.optim.SGD([p], lr=0.1)  # hooks torch.optim.SGD.step (torch patches it lazily)
    opt = popt.SGD([p], lr=0.1, loss_scaling=2.0)
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))

    def closure():
        opt.zero_grad()
        loss = (p * 2.0).sum()  # scaled by 2 -> unscaled grad 1
        loss.backward()
        return loss

    opt.step(closure)
    assert len(calls) == 1
    assert torch.allclose(p.detach(), torch.full((2,), 0.9))


# -- 16-bit parameters (model.half()): float32 update math, float32 state ---------------------


@pytest.mark.parametrize(
    "cls, kw",
    [
        (popt.Adam, {}),
        (popt.AdamW, {"weight_decay": 0.01}),
        (popt.SGD, {"momentum": 0.9}),
        (popt.LAMB, {}),
        (popt.RMSprop, {"use_tf_variant": True}),
    ],
)
def test_half_parameters_update_in_float32_then_round(cls, kw):
    grads = [torch.tensor([0.0, 1e-3, 1.0, -2e-4]), torch.tensor([0.0, -1e-3, 0.5, 3e-4])]
    half = torch.nn.Parameter(torch.tensor([1.0, -0.5, 0.25, 2.0]).half())
    full = torch.nn.Parameter(half.detach().float())
    opt_half = cls([half], lr=1e-2, loss_scaling=1024.0, **kw)
    opt_full = cls([full], lr=1e-2, loss_scaling=1024.0, **kw)
    for g in grads:
        half.grad, full.grad = (g * 1024).half(), (g * 1024).half().float()
        opt_half.step()
        opt_full.step()
        full.data = full.data.half().float()  # the IPU stores the new value as float16
    assert half.dtype == torch.float16 and torch.isfinite(half).all()
    assert torch.equal(half.detach().float(), full.detach())
    assert all(
        v.dtype == torch.float32
        for v in opt_half.state[half].values()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim()
    )


@NEEDS_CPU_HALF_BACKWARD
def test_torch_optimizer_on_a_half_model_updates_in_float32_on_the_device():
    p = torch.nn.Parameter(torch.ones(2).half())
    torch_opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.tensor([0.0, 1e-3]).half()
    torch_opt.step()
    assert not torch.isfinite(p).all()  # why the emulator does not run torch's 16-bit math

    class Half(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2).half()
            self.unused = torch.nn.Linear(2, 2).half()  # gets a zero gradient below

        def forward(self, x, y):
            out = self.fc(x) + 0 * self.unused(x)
            return out, torch.nn.functional.mse_loss(out.float(), y)

    model = Half()
    training = poptorch.trainingModel(
        model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    for _ in range(3):
        training(torch.randn(4, 2).half(), torch.randn(4, 2))
    assert all(torch.isfinite(q).all() and q.dtype == torch.float16 for q in model.parameters())
