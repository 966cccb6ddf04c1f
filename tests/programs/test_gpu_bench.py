"""benchmarks/gpu.py and benchmarks/gpu_check.sh at tiny sizes on the CPU, so that the GPU
check cannot rot while no GPU is at hand. No timing is asserted: timings belong to
docs/performance.md, measured on purpose."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import warm

pytestmark = pytest.mark.slow  # subprocesses that train: about a minute in all

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
VARIANTS = {"native", "poptorch", "loop"}


def _env() -> dict:
    return {
        **os.environ,
        "IPULOOP_BACKEND": "emulator",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--preset", "tiny", "--out", str(out)]
    proc = warm.run(
        [*cmd, *args], capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _check_entry(entry: dict) -> None:
    assert set(entry["variants"]) == VARIANTS
    # the three ways compute the same thing: bitwise on the CPU
    assert entry["same_math"] is True
    assert entry["max_abs_diff_to_native"] == {"poptorch": 0.0, "loop": 0.0}
    for v in entry["variants"].values():
        assert v["step_s"] > 0 and v["samples_per_s"] > 0 and len(v["step_s_repeats"]) == 2
        assert v["peak_mb"] is None and v["syncs_per_step"] is None  # CUDA only
        assert v["ops_per_step"] > 0 and len(v["paired_ratios"]) == 2
    assert entry["variants"]["native"]["ratio_to_native"] == 1.0
    ops = {k: v["ops_per_step"] for k, v in entry["variants"].items()}
    # the emulator launches what native torch launches, give or take its output reduction
    assert ops["poptorch"] <= ops["native"] * 1.05, ops
    assert ops["loop"] <= ops["native"] * 1.05, ops


def test_gpu_benchmark_tiny_run_writes_json_and_table(tmp_path):
    readme = tmp_path / "performance.md"
    readme.write_text(
        "prose kept\n\n<!-- gpu-cpu:begin -->\nold\n<!-- gpu-cpu:end -->\n\n"
        "<!-- gpu-cuda:begin -->\nNot measured.\n<!-- gpu-cuda:end -->\nmore prose\n"
    )
    res = _run(
        tmp_path,
        "--workloads",
        "mnist,bert",
        "--skip",
        "mnist:float16",
        "--readme",
        str(readme),
    )
    assert set(res) == {"meta", "sizes", "workloads"}
    assert res["meta"]["device"] == "cpu" and res["meta"]["preset"] == "tiny"
    assert set(res["meta"]) >= {"torch", "python", "command", "date", "cpus", "wall_s"}
    assert res["workloads"]["mnist"]["float16"] == {"skipped": "--skip"}
    half = res["workloads"]["bert"]["float16"]
    if "skipped" in half:  # torch 2.0's CPU: no float16 matmul
        assert "no float16 matmul" in half["skipped"]
    else:
        _check_entry(half)
    for entry in (res["workloads"]["mnist"]["float32"], res["workloads"]["bert"]["float32"]):
        _check_entry(entry)
    text = readme.read_text()  # the CPU table replaces its marked section only
    assert "prose kept" in text and "more prose" in text and "\nold\n" not in text
    assert "| bert | float16 |" in text and "| bert | float32 | loop |" in text
    assert "<!-- gpu-cuda:begin -->\nNot measured.\n<!-- gpu-cuda:end -->" in text
    # --from-json writes the same table again from the results alone
    readme.write_text("<!-- gpu-cpu:begin -->\n<!-- gpu-cpu:end -->\n")
    cmd = [sys.executable, str(SCRIPT), "--from-json", str(tmp_path / "gpu.json")]
    proc = warm.run(
        [*cmd, "--readme", str(readme)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _section(readme.read_text()) == _section(text)


def _section(page: str) -> str:
    return page.split("<!-- gpu-cpu:begin -->")[1].split("<!-- gpu-cpu:end -->")[0].strip()


def test_gpu_benchmark_resnet_tiny(tmp_path):
    pytest.importorskip("torchvision")
    res = _run(
        tmp_path,
        "--workloads",
        "resnet",
        "--dtypes",
        "float32",
        "--no-counts",
        "--readme",
        "",
    )
    entry = res["workloads"]["resnet"]["float32"]
    assert "resnet18" in entry["description"]
    assert set(entry["variants"]) == VARIANTS and entry["same_math"] is True


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_script_runs_on_the_cpu(tmp_path):
    # the script a GPU machine runs as it is, here on the CPU at tiny sizes (its CUDA tests
    # skip), so that a renamed flag or file fails here first
    out = tmp_path / "check.json"
    env = {
        **_env(),
        "PYTHON": sys.executable,
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_PRESET": "tiny",
        "GPU_CHECK_OUT": str(out),
        "GPU_CHECK_ARGS": "--workloads bert --dtypes float32 --repeats 1 --readme none",
    }
    proc = warm.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["workloads"]["bert"]["float32"]["variants"]) == VARIANTS
