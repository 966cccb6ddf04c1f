"""How a process group is left (``ipuloop.group_teardown``)."""

from __future__ import annotations

import torch

from ipuloop import group_teardown


def test_collective_tensors_are_kept_until_the_group_is_destroyed(tmp_path):
    """The loop's sums and the emulator's gradient all-reduce keep their tensor until
    ``destroy_group``, so no gloo worker drops a last reference that needs the GIL while a
    destroy holds it (the hang of torch before 2.8)."""
    import torch.distributed as dist

    from ipuloop.processes import ProcessGroup, _leave_group

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = ProcessGroup(0, 1, "torchrun")
        assert group.sum([1.5, 2.0], "a test") == [1.5, 2.0]
        kept = group_teardown._KEPT["ipuloop.processes.sum"]
        assert kept.tolist() == [1.5, 2.0]
        t = torch.ones(3)
        group_teardown.keep_until_left("k", t)
        dist.all_reduce(t)
        assert group_teardown._KEPT["k"] is t
        _leave_group()  # (what a failing instance calls)
        assert not dist.is_initialized() and group_teardown._KEPT == {}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        group_teardown._KEPT.clear()
