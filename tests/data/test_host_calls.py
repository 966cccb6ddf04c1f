"""``ipuloop/host_calls.py``: host calls joined from micro-batches (training) or cut from rows
(validation, predict), and the one-shape rule a compiled model needs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ipuloop import Loop
from ipuloop.callbacks import ModelCheckpoint
from ipuloop.callbacks.checkpoint import load_checkpoint
from ipuloop.host_calls import OneShape, cut, joined


def batch(ids, width: int = 2):
    ids = torch.tensor(ids)
    return ids[:, None].float().expand(-1, width).clone(), ids


def test_joined_takes_micro_batches_in_order_and_drops_the_incomplete_last_call():
    units = [batch([0, 1]), batch([2, 3]), batch([4, 5]), batch([6, 7]), batch([8, 9])]
    calls = list(joined(iter(units), 2, OneShape("loader", 2, "last")))
    assert [c[1].tolist() for c in calls] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_short_last_batch_ends_the_remainder_and_one_a_call_would_read_is_refused():
    last = [batch([0, 1]), batch([2, 3]), batch([4])]  # the loader's own: the remainder
    assert len(list(joined(iter(last), 2, OneShape("loader", 2, "last")))) == 1
    whole = [batch([0, 1]), batch([2])]  # a custom batch sampler's, completing a call
    with pytest.raises(ValueError, match=r"batch 1 of this epoch has shapes \[\[1, 2\], \[1\]\]"):
        list(joined(iter(whole), 2, OneShape("loader", 2, "refuse", "Buckets")))
    middle = [batch([0, 1]), batch([2]), batch([3, 4]), batch([5, 6])]
    with pytest.raises(ValueError, match="batch 1 of this epoch"):
        list(joined(iter(middle), 2, OneShape("loader", 2, "last")))


def test_a_streams_short_batches_are_dropped_with_a_warning_once():
    units = [batch([0, 1]), batch([2]), batch([4, 5]), batch([6]), batch([7, 8]), batch([9, 10])]
    shape = OneShape("train_loader", 2, "drop")
    with pytest.warns(UserWarning, match="batch 1 of this epoch holds 1 samples, not 2"):
        calls = list(joined(iter(units), 2, shape))
    assert [c[1].tolist() for c in calls] == [[0, 1, 4, 5], [7, 8, 9, 10]]
    assert shape.dropped == 2


def test_cut_counts_every_row_and_pads_the_last_call():
    units = [batch([0, 1, 2]), batch([3]), batch([4, 5])]
    calls = list(cut(iter(units), 4, OneShape("loader", 3, "keep"), pad=True, calls=3))
    assert [(c[1].tolist(), real) for c, real in calls] == [
        ([0, 1, 2, 3], 4),
        ([4, 5, 5, 5], 2),  # copies of the last sample fill the call
        ([4, 5, 5, 5], 0),  # another instance has samples left: a call of none
    ]
    with pytest.raises(ValueError, match=r"beyond dim 0"):
        list(
            cut(
                iter([batch([0, 1]), batch([2, 3], width=3)]),
                4,
                OneShape("loader", 2, "keep"),
                pad=True,
            )
        )


class Sequences(Dataset):
    """Sequences of length 2, but 3 from sample 20 on: batches padded to their longest
    differ only from the sixth micro-batch of 4, after the host check's first ones."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.ones(3 if i >= 20 else 2) * (i % 3), torch.tensor(i % 2)


def pad_to_longest(samples):
    longest = max(len(s[0]) for s in samples)
    x = torch.stack([F.pad(s[0], (0, longest - len(s[0]))) for s in samples])
    return x, torch.stack([s[1] for s in samples])


class Mean(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(1, 2)

    def forward(self, x):
        return self.lin(x.mean(1, keepdim=True))


def test_dynamic_padding_found_mid_epoch_is_refused_and_the_last_checkpoint_resumes(tmp_path):
    """The first micro-batch of another shape is refused before it runs, naming padding, both
    shapes and the fix, not PopTorch's "Shape mismatch"; the checkpoints taken before it are
    whole and resume."""
    loader = DataLoader(Sequences(), batch_size=4, collate_fn=pad_to_longest)
    ckpt = ModelCheckpoint(tmp_path, every_n_steps=1, every_n_epochs=None, save_top_k=-1)
    loop = Loop(Mean(), loss_fn=nn.CrossEntropyLoss(), progress=False, callbacks=[ckpt])
    with pytest.raises(ValueError) as e:
        loop.fit(loader)
    text = str(e.value)
    assert "batch 5 of this epoch has shapes [[4, 3], [4]]" in text and "[[4, 2], [4]]" in text
    assert "dynamic padding" in text and "fixed" in text
    assert loop.state.step == 5
    again = Loop(Mean(), loss_fn=nn.CrossEntropyLoss(), progress=False)
    again.load_state_dict(load_checkpoint(ckpt.latest()))  # whole: it verifies and loads
    assert again.state.step == 5 and again.state.epoch_step == 5
