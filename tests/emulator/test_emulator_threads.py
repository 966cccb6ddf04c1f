"""The data path with torch's default thread count: docs/reliability.md §2.18.

A process whose OpenMP thread pool is running cannot be forked safely: the child inherits the
pool's state without its threads, and its first parallel op waits for them for ever. These
tests run each program in a child process with ``OMP_NUM_THREADS`` unset (torch's default
thread count, at least two threads), after a parallel op has started the pool, and with a
timeout: a deadlock fails the test instead of hanging the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import warm

import ipuloop.emulator as poptorch

pytestmark = pytest.mark.threads

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parents[1] / "support"
TIMEOUT = 300  # seconds: a few for a run, on a loaded host; a deadlock never ends

PRELUDE = f"""
import os, sys
sys.path[:0] = [{str(ROOT)!r}, {str(SUPPORT)!r}]
import torch
if torch.get_num_threads() < 2:  # a one-core host: a pool of two threads all the same
    torch.set_num_threads(2)
a = torch.randn(512, 512)
for _ in range(8):  # parallel ops: the thread pool is running
    a = torch.tanh(a @ a)
"""


def run_program(tmp_path: Path, body: str) -> str:
    """Run ``body`` as a script (``__main__``, as a user's program) after ``PRELUDE``, with
    torch's default thread count; its stdout. Fails if it fails or does not end."""
    script = tmp_path / "program.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    try:
        done = warm.run(
            [sys.executable, str(script)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as e:
        # (its children end with it: each worker sees the end of its pipe)
        pytest.fail(f"no end in {TIMEOUT} s (a deadlock); its output: {e.stdout!r} {e.stderr!r}")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize(
    "strategy",  # the quick suite: the default (ForkServer) and Fork; CI every one
    [
        s
        if s in (poptorch.SharingStrategy.ForkServer, poptorch.SharingStrategy.Fork)
        else pytest.param(s, marks=pytest.mark.slow)
        for s in poptorch.SharingStrategy
    ],
    ids=lambda s: s.name,
)
def test_async_loader_with_the_thread_pool_running(tmp_path, strategy):
    """A shuffled ``DataLoader`` in Async mode with two loader workers, created after a
    parallel op, reads every sample of each epoch, whatever the ``sharing_strategy``."""
    out = run_program(
        tmp_path,
        f"""
        import ipuloop.emulator as poptorch

        def read(**kwargs):
            # (a shuffle of 60000 samples, as MNIST's: torch draws the order in parallel)
            data = torch.utils.data.TensorDataset(torch.arange(60000.0))
            loader = poptorch.DataLoader(poptorch.Options(), data, batch_size=1000,
                                         shuffle=True, num_workers=2,
                                         mode=poptorch.DataLoaderMode.Async, **kwargs)
            epochs = [torch.cat([b for (b,) in loader]) for _ in range(2)]
            loader.terminate()
            return epochs

        if __name__ == "__main__":
            strategy = poptorch.SharingStrategy({int(strategy)})
            epochs = read(async_options={{"sharing_strategy": strategy}})
            assert all(torch.equal(e.sort().values, torch.arange(60000.0)) for e in epochs)
            assert not torch.equal(*epochs)  # each epoch shuffled anew
            print("read", len(epochs), torch.get_num_threads())
        """,
    )
    assert out.startswith("read 2 "), out
    assert int(out.split()[-1]) >= 2  # the program ran with a thread pool


@pytest.mark.slow  # (a Loop in a child process, its worker processes started twice)
def test_loop_fed_an_async_loader_with_the_thread_pool_running(tmp_path):
    """``Loop.fit`` fed a shuffled ``poptorch.DataLoader`` in Async mode whose samples are
    computed by parallel ops (each epoch reads through an accessor of its own), with the
    thread pool running: the weights of the same fit whose worker is forked."""
    out = run_program(
        tmp_path,
        """
        import ipuloop.emulator as poptorch
        import ipuloop
        from helpers_train import TinyMLP, IndexedData

        class Computed(IndexedData):  # each sample read after a parallel op

            def __getitem__(self, i):
                x, y = super().__getitem__(i)
                return x + torch.zeros(1 << 17).exp().sum() * 0, y

        def fit(strategy):
            torch.manual_seed(0)
            model = TinyMLP()
            opts = poptorch.Options().deviceIterations(2)
            loader = poptorch.DataLoader(opts, Computed(40), batch_size=2, shuffle=True,
                                         mode=poptorch.DataLoaderMode.Async,
                                         async_options={"sharing_strategy": strategy})
            loop = ipuloop.Loop(model, opts, optimizer=poptorch.optim.AdamW(
                model.parameters(), lr=0.02), seed=1, progress=False)
            loop.fit(loader, epochs=2)
            return {k: v.clone() for k, v in model.state_dict().items()}, loop.state.step

        if __name__ == "__main__":
            got, steps = fit(poptorch.SharingStrategy.ForkServer)  # PopTorch's default
            forked, _ = fit(poptorch.SharingStrategy.Fork)
            assert all(torch.equal(got[k], forked[k]) for k in got)
            print("steps", steps)
        """,
    )
    assert out.split()[:2] == ["steps", "20"], out
