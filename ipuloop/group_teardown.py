"""How a process group is left: at exit, after the other instances, and without gloo's hang.

Both sides leave their groups so: the loop's instances (``processes.py``) and the emulator's
(``emulator/distributed.py``, ``emulator/horovod.py``), and a program ``emulate`` ran that
failed. A leaf: it imports only the standard library and torch, so the emulator (which
imports nothing else of ipuloop but ``rules``) and the loop share it.
"""

from __future__ import annotations

import datetime
import time

import torch

__all__ = ["GIL_HANDOVER_S", "keep_until_left", "destroy_group", "leave_process_group"]

_LEFT_KEY = "ipuloop/left_process_group"  # instances that destroyed their group

# Each caller's last collective tensor, kept until the process group is destroyed. Before
# torch 2.8, destroying a gloo group holds the GIL while it joins the group's worker threads,
# and a worker that drops the last reference to a tensor Python has let go of needs the GIL
# to free it: the two wait for each other (an instance failing right after a collective hung
# in ``destroy_process_group``). A tensor kept here never has its last reference in a worker.
_KEPT: dict[str, torch.Tensor] = {}
GIL_HANDOVER_S = 0.05  # a worker still freeing some other collective's tensor takes the GIL


def keep_until_left(key: str, tensor: torch.Tensor) -> None:
    """Keep ``tensor``, the input of the collective that ``key`` names (replacing the one
    kept before), until the process group is destroyed (``destroy_group``)."""
    _KEPT[key] = tensor


def destroy_group() -> None:
    """``destroy_process_group()`` with no gloo worker left waiting for the GIL: first a
    short sleep (the GIL free) for any worker finishing a collective whose tensors nobody
    keeps (``all_gather_object``'s), then the destroy, then the kept tensors are let go."""
    import torch.distributed as dist

    time.sleep(GIL_HANDOVER_S)
    try:
        dist.destroy_process_group()
    finally:
        _KEPT.clear()


def leave_process_group() -> None:
    """At exit, destroy the default process group a module of ipuloop created. Left to the
    interpreter's teardown, gloo can abort the process ("terminate called without an active
    exception") when another instance has gone first; and torch 2.0's gloo can hang in
    ``destroy_process_group`` on an instance whose peers have already exited. So gloo
    instances first meet (10 s at most), then each destroys its group and leaves only once
    every instance has destroyed its own (counted in the group's store, 10 s at most)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    store, size = None, dist.get_world_size()
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 (an instance has gone or hangs: leaving anyway)
            store = None
    try:
        destroy_group()
    except Exception:  # noqa: BLE001 (leaving anyway)
        pass
    if store is None:
        return
    try:
        left = store.add(_LEFT_KEY, 1)
        deadline = time.monotonic() + 10
        while left < size and time.monotonic() < deadline:
            time.sleep(0.01)
            left = store.add(_LEFT_KEY, 0)
    except Exception:  # noqa: BLE001 (the store's host has left: so may this instance)
        pass
