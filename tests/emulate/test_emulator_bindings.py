"""What a program sees of PopTorch's installation besides ``poptorch``'s public API, with
``poptorch`` bound to the emulator: ``poptorch._impl``'s unwrapping and rewrapping of a training
model, a ``poptorch`` distribution (for version checks through ``importlib.metadata``) and
``popart``'s enums that programs pass to ``Options._Popart``."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from ipuloop import emulator as poptorch

REPO = Path(__file__).resolve().parents[2]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x, y):
        out = self.fc(x)
        return out, torch.nn.functional.mse_loss(out, y)


def _trained(steps=1):
    torch.manual_seed(0)
    model = Net()
    before = model.fc.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    training = poptorch.trainingModel(model, optimizer=opt)
    for _ in range(steps):
        training(torch.ones(1, 2), torch.zeros(1, 1))
    return model, training, before


def test_unwrap_gives_the_model_and_its_parameters_their_own_classes_and_rewrap_restores():
    model, training, _ = _trained()
    wrapped_model, wrapped_param = type(model), type(model.fc.weight)
    assert wrapped_model is not Net and poptorch._impl.isWrapped(model)
    assert wrapped_param is not torch.nn.Parameter and poptorch._impl.isWrapped(model.fc.weight)

    poptorch._impl.unwrapModelIfNecessary(model)
    assert type(model) is Net and not poptorch._impl.isWrapped(model)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert all(type(b) is torch.Tensor for b in model.buffers())
    # a plain module: deep copies and inference models of it are of the user's class
    assert type(poptorch.inferenceModel(model).model) is Net

    poptorch._impl.rewrapModelIfNecessary(model)
    assert type(model) is wrapped_model and type(model.fc.weight) is wrapped_param
    training.destroy()  # unwraps, as before
    assert type(model) is Net and type(model.fc.weight) is torch.nn.Parameter


def test_unwrap_copies_trained_weights_back_first_and_reading_an_unwrapped_model_does_not():
    model, training, before = _trained()
    poptorch._impl.unwrapModelIfNecessary(model)  # reads the module: the trained weights come back
    once = model.fc.weight.detach().clone()
    assert not torch.equal(once, before)

    training(torch.ones(1, 2), torch.zeros(1, 1))  # the executor runs an unwrapped module too
    assert torch.equal(model.fc.weight.detach(), once)  # no copy back while unwrapped
    poptorch._impl.rewrapModelIfNecessary(model)
    twice = model.fc.weight.detach().clone()  # wrapped again: reading copies back
    assert not torch.equal(twice, once)

    torch.manual_seed(0)  # the same two steps in plain torch
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        ref(torch.ones(1, 2), torch.zeros(1, 1))[1].backward()
        opt.step()
    torch.testing.assert_close(twice, ref.fc.weight.detach())


def test_unwrapping_a_plain_model_or_rewrapping_one_never_unwrapped_changes_nothing():
    model = Net()
    poptorch._impl.unwrapModelIfNecessary(model)
    poptorch._impl.rewrapModelIfNecessary(model)
    assert type(model) is Net and type(model.fc.weight) is torch.nn.Parameter


def test_destroying_a_training_model_left_unwrapped_frees_it_and_says_so():
    model, training, _ = _trained()
    poptorch._impl.unwrapModelIfNecessary(model)
    with pytest.raises(poptorch.Error, match="model was never wrapped"):
        training.destroy()
    assert not training.isCompiled()
    assert type(model) is Net and type(model.fc.weight) is torch.nn.Parameter


PROGRAM = textwrap.dedent("""
    import importlib.metadata, json
    import poptorch

    out = {}
    try:
        from poptorch._impl import rewrapModelIfNecessary, unwrapModelIfNecessary
        import poptorch._impl
        out["impl"] = unwrapModelIfNecessary is poptorch._impl.unwrapModelIfNecessary
    except ImportError as e:
        out["impl"] = repr(e)
    try:
        out["version"] = importlib.metadata.version("poptorch")
    except importlib.metadata.PackageNotFoundError as e:
        out["version"] = repr(e)
    try:
        import popart
        out["popart"] = {
            "schedule": int(popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized),
            "copying": int(popart.SubgraphCopyingStrategy.JustInTime),
            "names": [s.name for s in popart.AccumulateOuterFragmentSchedule],
            "enums": {
                e: {m.name: int(m) for m in getattr(popart, e)}
                for e in (
                    "VirtualGraphMode",
                    "RecomputationType",
                    "BatchSerializationBatchSchedule",
                    "SyntheticDataMode",
                )
            },
        }
        opts = poptorch.Options()
        opts._Popart.set("subgraphCopyingStrategy", int(popart.SubgraphCopyingStrategy.JustInTime))
        try:
            popart.InferenceSession
        except AttributeError as e:
            out["popart"]["session"] = str(e)
    except ImportError as e:
        out["popart"] = repr(e)
    import popdist, popdist.poptorch, horovod.torch as hvd
    out["popdist"] = [popdist.isPopdistEnvSet(), popdist.getNumInstances()]
    out["popdist.poptorch.Options"] = issubclass(popdist.poptorch.Options, poptorch.Options)
    hvd.init()
    out["hvd"] = [hvd.rank(), hvd.size(), hvd.allreduce(__import__("torch").tensor(3.0)).item()]
    try:
        import poptorch_geometric
    except ModuleNotFoundError as e:
        out["poptorch_geometric"] = [e.name, str(e)]
    from examples_utils import load_lib
    try:
        load_lib("custom_ops/remap_tensor_ce.cpp")
    except poptorch.Error as e:
        out["examples_utils"] = str(e)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def under_emulate(tmp_path_factory):
    """What ``PROGRAM`` finds, run under ``python -m ipuloop.emulate``."""
    folder = tmp_path_factory.mktemp("prog")
    (folder / "prog.py").write_text(PROGRAM)
    p = subprocess.run(
        [sys.executable, "-m", "ipuloop.emulate", "prog.py"],
        cwd=str(folder),
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_under_emulate_poptorch_impl_is_importable(under_emulate):
    assert under_emulate["impl"] is True


def test_under_emulate_a_poptorch_distribution_of_the_emulated_version_is_installed(
    under_emulate,
):
    # so that transformers.utils.versions.require_version("poptorch>=3.3") passes
    assert under_emulate["version"] == poptorch.__version__


def test_under_emulate_popart_offers_popart_3_4_enums_and_nothing_else(under_emulate):
    popart = under_emulate["popart"]
    assert isinstance(popart, dict), popart
    # PopART 3.4's values (sessionoptions.hpp)
    assert (popart["schedule"], popart["copying"]) == (3, 1)
    assert popart["names"] == [
        "Scheduler",
        "Serial",
        "OverlapCycleOptimized",
        "OverlapMemoryOptimized",
    ]
    assert "popart.InferenceSession is not emulated" in popart["session"]


def test_under_emulate_popart_has_popart_3_4_s_option_enums(under_emulate):
    # PopART 3.4's python/popart/popart_core/popart.cpp names, sessionoptions.hpp values
    assert under_emulate["popart"]["enums"] == {
        "VirtualGraphMode": {"Off": 0, "Manual": 1, "Auto": 2, "ExecutionPhases": 3},
        "RecomputationType": {
            "NoRecompute": 0,
            "Standard": 1,
            "NormOnly": 2,
            "Pipeline": 3,
            "RecomputeAll": 4,
        },
        "BatchSerializationBatchSchedule": {
            "Scheduler": 0,
            "Isomorphic": 1,
            "OverlapOnIo": 2,
            "OverlapOnCompute": 3,
        },
        "SyntheticDataMode": {"Off": 0, "Zeros": 1, "RandomNormal": 2, "RandomUniform": 3},
    }


def test_under_emulate_popdist_and_horovod_answer_for_one_process(under_emulate):
    assert under_emulate["popdist"] == [False, 1]
    assert under_emulate["popdist.poptorch.Options"] is True
    assert under_emulate["hvd"] == [0, 1, 3.0]


def test_under_emulate_poptorch_geometric_is_refused_saying_why(under_emulate):
    name, message = under_emulate["poptorch_geometric"]
    assert name == "poptorch_geometric"
    assert message.startswith("poptorch_geometric is not emulated: PopTorch Geometric ships")


def test_under_emulate_examples_utils_refuses_a_custom_op_saying_what_to_run(under_emulate):
    message = under_emulate["examples_utils"]
    assert message.startswith("examples_utils.load_lib('remap_tensor_ce.cpp'): C++ custom ops")
    assert "--custom-ops False" in message


def test_under_emulate_an_installed_popdist_and_horovod_are_imported_not_the_stand_ins(tmp_path):
    site = tmp_path / "site"
    for name in ("popdist", "horovod", "poptorch_geometric", "examples_utils"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"REAL = {name!r}\n")
    (site / "horovod" / "torch.py").write_text("REAL = 'horovod.torch'\n")
    (tmp_path / "prog.py").write_text(
        "import popdist, horovod.torch as hvd, poptorch_geometric as pg, examples_utils as eu\n"
        "print(popdist.REAL, hvd.REAL, pg.REAL, eu.REAL)\n"
    )
    p = subprocess.run(
        [sys.executable, "-m", "ipuloop.emulate", "prog.py"],
        cwd=str(tmp_path),
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(site)])),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["popdist", "horovod.torch", "poptorch_geometric", "examples_utils"]


@pytest.mark.parametrize(
    "name",
    [
        "poptorch.py",
        "popdist/__init__.py",
        "horovod/__init__.py",
        "examples_utils/__init__.py",
        "poptorch_geometric/__init__.py",
    ],
)
def test_a_binding_module_finds_ipuloop_where_it_is_not_installed(name, monkeypatch):
    """A Python child whose environment has no ipuloop (a subprocess started with another
    interpreter, in another folder) reaches the binding folder through PYTHONPATH: each binding
    module puts the folder that holds the ipuloop package on the module path before it imports
    ipuloop. Its lines before that import run here with ipuloop not found."""
    path = REPO / "ipuloop" / "emulate" / "_binding" / name
    source = path.read_text()
    head = source[: source.index("from ipuloop")]
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "ipuloop" else found(n, *a)
    )
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = len(sys.path)
    exec(compile(head, str(path), "exec"), {"__file__": str(path), "__name__": "probe"})
    assert len(sys.path) == before + 1
    assert Path(sys.path[-1]) == REPO and (REPO / "ipuloop" / "__init__.py").is_file()


def test_without_emulate_no_poptorch_distribution_is_seen():
    import importlib.metadata

    binding = str(REPO / "ipuloop" / "emulate" / "_binding")
    if binding in sys.path:
        pytest.skip("this process runs under ipuloop.emulate")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("poptorch")


def test_the_emulated_distribution_is_the_emulated_version():
    dist = REPO / "ipuloop" / "emulate" / "_binding" / f"poptorch-{poptorch.__version__}.dist-info"
    metadata = (dist / "METADATA").read_text()
    assert "Name: poptorch\n" in metadata
    assert f"Version: {poptorch.__version__}\n" in metadata


def test_a_wheel_of_ipuloop_carries_the_binding_folder(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "ipuloop", src / "ipuloop", ignore=shutil.ignore_patterns("__pycache__"))
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if p.returncode != 0 and "No module named pip" in p.stderr:
        pytest.skip("pip is not installed")
    assert p.returncode == 0, p.stderr
    (wheel,) = (tmp_path / "dist").glob("ipuloop-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    dist = f"ipuloop/emulate/_binding/poptorch-{poptorch.__version__}.dist-info"
    assert {f"{dist}/METADATA", f"{dist}/top_level.txt"} <= names
    assert {"ipuloop/emulate/_binding/poptorch.py", "ipuloop/emulate/_binding/popart.py"} <= names
    assert {
        "ipuloop/emulate/_binding/popdist/__init__.py",
        "ipuloop/emulate/_binding/horovod/__init__.py",
    } <= names
