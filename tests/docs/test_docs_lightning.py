"""docs/from-lightning.md: every ``python`` block runs, in order, in one namespace.

The blocks are one program read top to bottom (later blocks use the data and imports of the
first). Lightning code is in ``py`` blocks, shown for comparison, and is not run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "from-lightning.md"

pytest.importorskip("tensorboard")


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), re.S | re.M)


def test_the_guide_is_linked_from_the_readme():
    assert "(docs/from-lightning.md)" in (DOC.parents[1] / "README.md").read_text()


def test_every_python_block_runs(tmp_path, monkeypatch, capsys):
    code = blocks("python")
    assert len(code) >= 8 and len(blocks("py")) >= 3
    monkeypatch.chdir(tmp_path)  # the blocks write ckpt/, logs.csv, tb_logs/, report_dir/, ...
    ns: dict = {}
    for i, block in enumerate(code):
        exec(compile(block, f"{DOC.name} block {i + 1}", "exec"), ns)
    out = capsys.readouterr().out
    # the first block's fit learnt the task and printed its logs
    assert ns["history"][-1]["val_acc"] > 0.9 and "'val_acc'" in out
    assert ns["predictions"].shape == (512, 2) and ns["val_logs"]["val_loss"] < 0.5
    # the files the callbacks and the profile wrote
    assert (tmp_path / "report_dir" / "trace.json").exists()
    assert (tmp_path / "ckpt").is_dir() and any((tmp_path / "ckpt").iterdir())
    assert list((tmp_path / "tb_logs").glob("events.out.tfevents.*"))
    header = (tmp_path / "logs.csv").read_text().splitlines()[0].split(",")
    assert "learning_rate" in header and "val_loss" in header
    assert json.loads((tmp_path / "ipu_config" / "ipu_config.json").read_text())[
        "layers_per_ipu"
    ] == [1, 1]
