"""Horovod's host-side collectives as the emulator gives them (``ipuloop/emulator/horovod.py``)
for one instance: Horovod's values (the input's own), its argument rules and its errors. Two
instances over one process group: ``tests/emulate/test_emulate_poprun.py``."""

from __future__ import annotations

import pytest
import torch

from ipuloop.emulator import horovod as hvd

LAUNCHERS = ("POPDIST_NUM_TOTAL_REPLICAS", "OMPI_COMM_WORLD_SIZE", "RANK", "WORLD_SIZE")


@pytest.fixture
def alone(monkeypatch):
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hvd, "_initialized", False)
    hvd.init()
    return hvd


def test_before_init_the_rank_is_horovod_s_error(monkeypatch):
    monkeypatch.setattr(hvd, "_initialized", False)
    with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd\.init\(\)"):
        hvd.rank()


def test_alone_rank_size_and_locals(alone):
    assert (alone.rank(), alone.size(), alone.local_rank(), alone.local_size()) == (0, 1, 0, 1)
    assert alone.is_initialized()


def test_alone_the_reductions_return_a_copy_of_the_input(alone):
    x = torch.tensor([1.0, 4.0])
    for result in (
        alone.allreduce(x),  # Average
        alone.allreduce(x, op=alone.Sum),
        alone.allreduce(x, average=False),
        alone.allreduce(x, op=alone.Max),
        alone.broadcast(x, root_rank=0),
        alone.allgather(x),
    ):
        assert torch.equal(result, x) and result is not x
    assert [t.tolist() for t in alone.grouped_allreduce([x, 2 * x], op=alone.Sum)] == [
        [1.0, 4.0],
        [2.0, 8.0],
    ]
    scaled = alone.allreduce(x, op=alone.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert torch.equal(scaled, x)
    assert alone.allreduce(torch.tensor(3)).dtype == torch.int64  # the input's dtype


def test_op_and_average_together_are_horovod_s_error(alone):
    with pytest.raises(ValueError, match="The op parameter supersedes average"):
        alone.allreduce(torch.ones(1), average=True, op=alone.Sum)
    with pytest.raises(ValueError, match="Adasum is not emulated"):
        alone.allreduce(torch.ones(1), op=alone.Adasum)


def test_in_place_forms_and_parameters_keep_their_tensors(alone):
    x = torch.tensor([2.0])
    assert alone.allreduce_(x) is x and alone.broadcast_(x, 0) is x
    model = torch.nn.Linear(2, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    alone.broadcast_parameters(model.state_dict(), root_rank=0)
    alone.broadcast_parameters(model.named_parameters(), root_rank=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert alone.broadcast_object({"epoch": 3}) == {"epoch": 3}
    assert alone.allgather_object(7) == [7]
    alone.barrier()


def test_horovod_s_training_pieces_are_refused_with_a_reason(alone):
    with pytest.raises(
        AttributeError, match=r"horovod\.torch\.DistributedOptimizer is not emulated"
    ):
        getattr(alone, "DistributedOptimizer")  # noqa: B009 (the attribute's access is the test)


def test_several_instances_without_a_group_are_an_error(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setattr(hvd, "_initialized", True)  # as if init() had not joined
    with pytest.raises(ValueError, match="joined no process group"):
        hvd.allreduce(torch.ones(1))
