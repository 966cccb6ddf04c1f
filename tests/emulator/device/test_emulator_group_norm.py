"""device/group_norm.py: PopART's strided channel grouping of group norms, in closed form:
group g normalises channels g, g + G, g + 2G, ... together (PopLibs' popnn/GroupNorm.hpp),
where torch's group g holds channels g * C/G to (g + 1) * C/G - 1."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ipuloop.emulator as poptorch
from ipuloop.emulator.device.group_norm import StridedGroupNorm, strided


def _by_hand(x: torch.Tensor, groups: list[list[int]], eps: float) -> torch.Tensor:
    """Each channel normalised over the samples' channels of its group (biased variance)."""
    out = torch.empty_like(x)
    for members in groups:
        part = x[:, members]
        dims = tuple(range(1, x.dim()))
        mean = part.mean(dim=dims, keepdim=True)
        var = part.var(dim=dims, unbiased=False, keepdim=True)
        out[:, members] = (part - mean) / torch.sqrt(var + eps)
    return out


def test_strided_groups_hold_every_g_th_channel():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    with StridedGroupNorm():
        got = F.group_norm(x, 2, eps=1e-5)
    strided_groups = [[0, 2, 4], [1, 3, 5]]
    assert torch.allclose(got, _by_hand(x, strided_groups, 1e-5), atol=1e-12)
    # torch's own grouping (outside the mode) is the contiguous one, and differs
    plain = F.group_norm(x, 2, eps=1e-5)
    assert torch.allclose(plain, _by_hand(x, [[0, 1, 2], [3, 4, 5]], 1e-5), atol=1e-12)
    assert not torch.allclose(plain, got)


def test_weight_and_bias_stay_per_channel():
    torch.manual_seed(1)
    x = torch.randn(3, 4, 2, 2, dtype=torch.float64)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    b = torch.tensor([0.5, -0.5, 0.0, 1.0], dtype=torch.float64)
    with StridedGroupNorm():
        got = F.group_norm(x, 2, w, b, 1e-5)
    want = _by_hand(x, [[0, 2], [1, 3]], 1e-5) * w.reshape(1, 4, 1, 1) + b.reshape(1, 4, 1, 1)
    assert torch.allclose(got, want, atol=1e-12)


def test_one_group_or_one_channel_per_group_is_torch_s():
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    for groups in (1, 4):
        with StridedGroupNorm():
            got = F.group_norm(x, groups)
        assert torch.allclose(got, F.group_norm(x, groups), atol=1e-12)


def test_other_ops_pass_through():
    with StridedGroupNorm():
        assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))


def test_strided_reads_the_popart_option():
    opts = poptorch.Options()
    assert not strided(opts)
    opts._Popart.set("groupNormStridedChannelGrouping", True)
    assert strided(opts)
