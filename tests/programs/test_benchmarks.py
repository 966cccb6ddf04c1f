"""Smoke tests of the benchmarks (overhead.py, async_data.py, step_profile.py): a tiny run of
each writes its JSON (and README table).

No timing is asserted here: timings belong to docs/performance.md, measured on purpose.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import warm

pytestmark = (
    pytest.mark.slow
)  # the benchmarks' tiny runs in subprocesses: about a minute and a half
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "overhead.py"


def test_overhead_tiny_run_writes_expected_keys(tmp_path):
    out, readme = tmp_path / "results.json", tmp_path / "README.md"
    readme.write_text(
        "# Benchmarks\n\nprose kept\n\n<!-- overhead:begin -->\nold\n"
        "<!-- overhead:end -->\n\nmore prose\n"
    )
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--workloads",
        "mlp",
        "--variants",
        "hand,raw,loop,loop_callbacks",
        "--no-lightning",
        "--repeats",
        "1",
        "--mlp-steps",
        "4",
        "--mlp-warmup",
        "1",
        "--check-steps",
        "2",
        "--sweep-workloads",
        "mlp",
        "--sweep-di",
        "1,2",
        "--sweep-ga",
        "1",
        "--sweep-variants",
        "hand,loop_sum",
        "--sweep-repeats",
        "1",
        "--sweep-samples-mlp",
        "64",
        "--sweep-min-steps",
        "3",
        "--out",
        str(out),
        "--readme",
        str(readme),
        "--plot",
        "",
    ]
    # the sweep's children get glibc's mmap threshold (read when a process starts) set unless it
    # is; set here already, they can start warm (tests/support/warm.py)
    env = {**os.environ, "IPULOOP_BACKEND": "emulator", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    proc = warm.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    res = json.loads(out.read_text())
    assert set(res) >= {"meta", "args", "workloads", "sweep", "targets", "checkpoint"}
    assert set(res["meta"]) >= {"python", "torch", "threads", "command", "date"}
    mlp = res["workloads"]["mlp"]
    assert set(mlp["variants"]) == {"hand", "raw", "loop", "loop_callbacks"}
    for v in mlp["variants"].values():
        assert set(v) >= {
            "step_s",
            "cpu_step_s",
            "step_s_repeats",
            "time_per_sample_us",
            "median_gap_s",
            "fit_s",
        }
        assert v["step_s"] > 0 and len(v["step_s_repeats"]) == 1
    assert {"raw/hand", "loop/hand", "loop_callbacks/hand", "loop/hand_cpu"} <= set(mlp["ratios"])
    # the variants computed the same thing before they were timed
    assert set(mlp["equivalence_max_abs_diff"]) == {"raw", "loop", "loop_callbacks"}
    assert mlp["equivalent"] is True
    rows = res["sweep"]["mlp"]
    assert {(r["di"], r["ga"], r["variant"]) for r in rows} == {
        (di, 1, v) for di in (1, 2) for v in ("hand", "loop_sum")
    }
    for row in rows:
        assert set(row) >= {
            "di",
            "ga",
            "variant",
            "time_per_sample_us",
            "cpu_per_sample_us",
            "peak_delta_mb",
            "host_batch_mb",
            "samples_per_step",
        }
        assert row["cpu_per_sample_us"] > 0
    grow = [t for t in res["targets"] if "(mlp, loop_sum, GA=1)" in t["target"]]
    assert len(grow) == 3 and all(isinstance(t["met"], bool) for t in grow)
    assert any(
        "Loop.fit (no callbacks) / hand-written, tiny MLP" in t["target"] for t in res["targets"]
    )
    assert all(set(t) >= {"target", "value", "limit", "met"} for t in res["targets"])

    text = readme.read_text()  # the table replaces the marked section only
    assert "prose kept" in text and "more prose" in text and "\nold\n" not in text
    assert text.count("<!-- overhead:begin -->") == 1
    assert "| (c) Loop.fit, no callbacks |" in text


def test_async_data_tiny_run_writes_its_json_and_table(tmp_path):
    out, readme = tmp_path / "async.json", tmp_path / "README.md"
    readme.write_text(
        "# Benchmarks\n\nprose kept\n\n<!-- async-mnist:begin -->\nold\n<!-- async-mnist:end -->\n"
    )
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "async_data.py"),
        "--synthetic",
        "600",
        "--batch-size",
        "4",
        "--device-iterations",
        "2",
        "--gradient-accumulation",
        "7",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--out",
        str(out),
        "--readme",
        str(readme),
    ]
    env = {**os.environ, "IPULOOP_BACKEND": "emulator", "OMP_NUM_THREADS": "1"}
    proc = warm.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())["results"]
    assert res["same_weights"] is True  # every variant trained on the same batches
    assert set(res["variants"]) == {"sync", "async", "batch_sampler"}
    for v in res["variants"].values():
        assert len(v["step_s_repeats"]) == 2 and v["step_s"] > 0 and v["cpu_step_s"] > 0
    assert set(res["ratios"]) == {"async", "batch_sampler"}
    assert len(res["ratios"]["async"]["paired wall"]) == 2
    text = readme.read_text()
    assert "prose kept" in text and "\nold\n" not in text and "| `async_data=True` |" in text


def test_step_profile_tiny_run_names_the_loops_extra_calls(tmp_path):
    out = tmp_path / "step_profile.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_profile.py")]
    cmd += ["--steps", "20", "--number", "20", "--repeat", "1", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    warm.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
    res = json.loads(out.read_text())
    extra = res["extra_calls_per_step"]
    # the step's own calls, one each per step; no optimizer comparison without hooks
    for name in ("feed.py", "outputs.py", "accumulators.py", "processes.py"):
        assert any(name in k and v == 1.0 for k, v in extra.items()), (name, extra)
    assert not any("push_optimizer" in k or "unchanged" in k for k in extra), extra
    assert set(res["per_call_us"]) >= {
        "Executors.push_optimizer (unchanged optimizer)",
        "raw loop's whole step: trainingModel call",
    }
    assert all(v > 0 for v in res["per_call_us"].values())
