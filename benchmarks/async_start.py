#!/usr/bin/env python
"""How long an Async ``poptorch.DataLoader`` takes to give its first batch, loader by loader.

    python benchmarks/async_start.py                  # 3 loaders, async_start.json
    python benchmarks/async_start.py --loaders 5 --out /tmp/a.json

Each loader reads a tiny tensor dataset in ``DataLoaderMode.Async`` with the default
``SharingStrategy.ForkServer``: its worker process is started by the forkserver. The first
loader of a program starts the forkserver itself; later ones only ask it for a child. The
seconds from building each loader to its first batch are written as JSON, with the mean of
the later loaders beside the first's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a file from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from ipuloop import poptorch  # noqa: E402


def first_batch_seconds(opts: object) -> float:
    data = TensorDataset(torch.arange(64.0).reshape(32, 2), torch.arange(32))
    start = time.perf_counter()
    loader = poptorch.DataLoader(opts, data, batch_size=4, mode=poptorch.DataLoaderMode.Async)
    next(iter(loader))
    seconds = time.perf_counter() - start
    loader.terminate()
    return seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loaders", type=int, default=3, help="loaders built in turn")
    parser.add_argument("--out", default=str(HERE / "async_start.json"), help="JSON output")
    args = parser.parse_args(argv)
    opts = poptorch.Options()
    seconds = [first_batch_seconds(opts) for _ in range(args.loaders)]
    later = seconds[1:]
    result = {
        "what": "seconds from building an Async poptorch.DataLoader to its first batch",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "loaders": seconds,
        "first": seconds[0],
        "later_mean": sum(later) / len(later) if later else None,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
