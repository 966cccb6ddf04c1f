"""Checkpoint format stability: docs/reliability.md §2 item 8.

``fixtures/golden/v<format>/<config>/`` holds a checkpoint written by that format version
(``fixtures/make_golden.py``, run once per version) and what resuming it gives. Every one must
keep loading with ``weights_only=True`` and resume to the recorded weights. The fixtures were
written on one machine; another CPU of the same ISA level may still pick other float kernels
(seen: two AVX-512 hosts differing in the 7th digit of a loss), so weights and losses are compared
to float rounding and counters exactly. Bitwise resume parity on one machine is
``test_callbacks_checkpoint.py``'s job.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from torch_versions import newer_torch
import torch

import ipuloop.backend
from ipuloop import checkpoint_io as ck
from ipuloop.callbacks.checkpoint import CheckpointError, load_checkpoint, read_manifest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
import make_golden as G  # noqa: E402  (the golden setup: model, data, loop)

CASES = sorted(p for v in (FIXTURES / "golden").glob("v*") for p in v.iterdir() if p.is_dir())
IDS = [f"{p.parent.name}-{p.name}" for p in CASES]
pytestmark = pytest.mark.filterwarnings("ignore:.*samples are dropped each epoch")


@pytest.fixture(autouse=True, scope="module")
def _deterministic():
    n, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)  # the kernels make_golden.py used
    torch.use_deterministic_algorithms(True)
    yield
    torch.set_num_threads(n)
    torch.use_deterministic_algorithms(det)


@pytest.fixture
def copy(tmp_path):
    """A copy of a golden checkpoint: a test never touches the committed files."""

    def make(case: Path) -> Path:
        dst = tmp_path / case.name
        shutil.copytree(case / "checkpoint", dst)
        return dst

    return make


def rewrite_manifest(folder: Path, **fields) -> None:
    """Change manifest fields and re-sign it, as a writer of that version would have."""
    m = json.loads((folder / ck.MANIFEST).read_bytes())
    m.pop("manifest_sha256")
    m.update(fields)
    m["manifest_sha256"] = ck.sha256(ck.dump(m))
    (folder / ck.MANIFEST).write_bytes(ck.dump(m))


def assert_same(a, b, where="expected") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: tensors differ"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_the_current_format_has_a_golden():
    """Bumping FORMAT_VERSION without running make_golden.py fails here."""
    versions = {read_manifest(c / "checkpoint")["format_version"] for c in CASES}
    assert ck.FORMAT_VERSION in versions and len(CASES) >= 2
    total = sum(p.stat().st_size for p in (FIXTURES / "golden").rglob("*") if p.is_file())
    assert total < 200_000  # the fixtures stay small


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_golden_loads_with_weights_only(case, monkeypatch):
    real, calls = torch.load, []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    m = read_manifest(case / "checkpoint")  # the manifest and the state's SHA-256 verify
    sd = load_checkpoint(case / "checkpoint", backend="emulator")
    assert calls == [True]
    assert m["format_version"] == case.parent.name[1:] and m["backend"] == "emulator"
    assert {"model", "optimizer", "counters", "rng", "callbacks"} <= sd.keys()
    assert (
        sd["counters"]["step"]
        == m["step"]
        == json.loads((case / "config.json").read_text())["stop"]
    )
    torch.load(case / "expected.pt", weights_only=True)


@newer_torch(
    "the recorded losses and weights are torch 2.14's arithmetic; torch "
    "2.0's kernels round differently (loading is tested on every torch)"
)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_golden_resumes_to_the_recorded_weights(case, copy):
    """Each golden resumes to the counters, losses and weights its run recorded. A 1.0 one
    (ipuloop 0.1, which drew an epoch's order before its loader's base seed) resumes the rest
    of its running epoch exactly, in that epoch's order; the epochs after it draw their orders
    as torch's DataLoader does, so only the running epoch's losses are the recorded ones."""
    cfg = json.loads((case / "config.json").read_text())
    expected = torch.load(case / "expected.pt", weights_only=True)
    got = G.resume(cfg, copy(case))
    assert_same(got["counters"], expected["counters"], "counters")
    if case.parent.name == "v1.0":
        rest = -cfg["stop"] % G.STEPS_PER_EPOCH  # the running epoch's steps after the save
        assert rest and len(got["losses"]) == len(expected["losses"])
        torch.testing.assert_close(
            got["losses"][:rest], expected["losses"][:rest], rtol=1e-5, atol=1e-6
        )
        return
    for key in ("losses", "model", "optimizer"):
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_newer_major_version_is_rejected_naming_both(copy):
    folder = copy(CASES[0])
    major = int(ck.FORMAT_VERSION.split(".")[0])
    rewrite_manifest(folder, format_version=f"{major + 1}.0")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    assert f"format version {major + 1}.0" in str(e.value) and f"({ck.FORMAT_VERSION})" in str(
        e.value
    )
    assert e.value.path == str(folder / ck.MANIFEST)
    rewrite_manifest(folder, format_version=f"{major}.99")  # a newer minor: still readable
    load_checkpoint(folder)


def test_another_backend_cannot_resume_an_emulator_checkpoint(copy, monkeypatch):
    """Decision: weights load anywhere; an exact resume under another backend is refused."""
    case = CASES[0]
    folder = copy(case)
    cfg = json.loads((case / "config.json").read_text())
    emulator = ipuloop.backend.poptorch_module()
    monkeypatch.setattr(ipuloop.backend, "_resolved", ("poptorch", emulator))
    loop, loader = G.build(cfg)
    with pytest.raises(CheckpointError, match="backend mismatch") as e:
        loop.fit(loader, cfg["epochs"], resume_from=str(folder))
    assert "'emulator'" in str(e.value) and "'poptorch'" in str(e.value)
    assert "IPULOOP_BACKEND=emulator" in str(e.value)
    assert loop.state.step == 0  # refused before anything ran
    sd = load_checkpoint(folder)  # the weights alone still load, under any backend
    model = G.GoldenMLP()
    model.load_state_dict(sd["model"])
    assert torch.equal(model.net[0].weight, sd["model"]["net.0.weight"])


def test_a_poptorch_checkpoint_cannot_resume_on_the_emulator(copy):
    """The other direction: a checkpoint the poptorch backend wrote, resumed on the emulator."""
    case = CASES[0]
    folder = copy(case)
    rewrite_manifest(folder, backend="poptorch")
    cfg = json.loads((case / "config.json").read_text())
    loop, loader = G.build(cfg)
    with pytest.raises(CheckpointError, match="backend mismatch") as e:
        loop.fit(loader, cfg["epochs"], resume_from=str(folder))
    assert "'poptorch'" in str(e.value) and "'emulator'" in str(e.value)
    assert "IPULOOP_BACKEND=poptorch" in str(e.value)
    assert e.value.path == str(folder / ck.MANIFEST) and loop.state.step == 0
    assert load_checkpoint(folder)["counters"]["step"] == cfg["stop"]  # weights still load
