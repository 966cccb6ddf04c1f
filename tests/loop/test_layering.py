"""Imports inside ``ipuloop`` point down the layers: no import circle, no forbidden edge.

Every import of every module is read with ``ast``, relative and function-local ones included.
The layers are read from the table in docs/layout.md (leaves < PopTorch and what every part
reads < parts < wiring < the loop < integrations < entry points): a module imports its own
layer or lower ones, with no exception. No two modules share a basename. So the kernel never
imports ``ipuloop.integrations`` (IPUConfig, the experiment loggers, plotting), a layer above
the loop, and importing ipuloop imports none of them. The loop reaches the emulator only
through ``backend``, and the emulator and its tools import of the rest only the leaves both
sides need (``SHARED``).

The kernel is two folders' files (``KERNEL``: the top of ``ipuloop/`` and ``ipuloop/callbacks/``);
every other folder stands beside it (``BESIDE``). Importing ipuloop loads the kernel and changes
nothing else. And at run time, a batch's way from the loader to the logged loss crosses few
modules and takes no detour (``batch_way``).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from batch_way import trace
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import ipuloop
from ipuloop import Loop, poptorch

ROOT = Path(ipuloop.__file__).parent
LAYOUT = ROOT.parent / "docs" / "layout.md"


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The ipuloop modules ``name`` (at ``path``) imports, anywhere in its body, with those it
    names to ``importlib.import_module`` as a string (``backend``'s emulator)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:  # ``from . import checkpoint_io``: that module
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, as the modules on it (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def inside(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` or one of its submodules (``ipuloop.emulator`` is not
    inside ``ipuloop.emulate``)."""
    return module == package or module.startswith(package + ".")


# The leaves both the loop and the emulator import: all the emulator imports of ipuloop.
SHARED = ("ipuloop.rules", "ipuloop.group_teardown", "ipuloop.mixed_float")


def forbidden(edges: dict[str, set[str]]) -> list[str]:
    """The edges the layering rules forbid, as "a -> b (why)"."""
    bad = []
    for a, targets in edges.items():
        for b in sorted(targets):
            emulator = inside(a, "ipuloop.emulator") or inside(a, "ipuloop.emulate")
            if inside(a, "ipuloop.emulate") and not (
                inside(b, "ipuloop.emulate") or inside(b, "ipuloop.emulator") or b in SHARED
            ):
                bad.append(
                    f"{a} -> {b} (the emulator's tools import only themselves, the emulator and "
                    "the leaves it imports)"
                )
            if inside(a, "ipuloop.emulator") and not (inside(b, "ipuloop.emulator") or b in SHARED):
                bad.append(
                    f"{a} -> {b} (the emulator imports nothing of ipuloop but rules, "
                    "group_teardown and mixed_float)"
                )
            if not emulator and inside(b, "ipuloop.emulator") and a != "ipuloop.backend":
                bad.append(f"{a} -> {b} (the loop reaches the emulator only through backend)")
            if a.startswith(("ipuloop.callbacks", "ipuloop.integrations")) and b in (
                "ipuloop.loop",
                "ipuloop.executors",
                "ipuloop.loop_options",
                "ipuloop.plan",
            ):
                bad.append(
                    f"{a} -> {b} (callbacks and integrations reach the loop only through "
                    "base.LoopView, or as what opts= accepts)"
                )
            if (
                a == "ipuloop.loop"
                and b.startswith("ipuloop.callbacks")
                and b != "ipuloop.callbacks.base"
            ):
                bad.append(f"{a} -> {b} (the loop names no concrete callback)")
            if (
                b == "ipuloop.loop"
                and not a.startswith(("ipuloop.callbacks", "ipuloop.integrations"))  # (said above)
                and (layer_of(a, layers()) or 0) < 7
            ):
                bad.append(f"{a} -> {b} (only the entry points import the loop)")
    return bad


def _names(annotation: ast.expr | None) -> set[str]:
    """The names an annotation spells (``Loop``, ``"Loop"``, ``x.Loop``, ``Loop | None``)."""
    if annotation is None:
        return set()
    out = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out |= _names(ast.parse(node.value, mode="eval").body)
    return out


def loop_readers(name: str, source: str) -> list[str]:
    """The functions of module ``name`` that take the loop itself: a parameter annotated
    ``Loop``, or named ``loop`` without the callbacks' view of it (``LoopView``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        every = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]
        for arg in every:
            names = _names(arg.annotation)
            if "Loop" in names or (arg.arg == "loop" and "LoopView" not in names):
                found.append(f"{name}.{node.name}({arg.arg})")
    return found


def test_no_import_circle():
    assert cycles(graph()) == []


def test_no_forbidden_edge():
    assert forbidden(graph()) == []


def test_the_loop_reaches_the_emulator_only_through_backend():
    """Outside the emulator and its tools, one module imports the emulator: ``backend``, which
    says which PopTorch is in use. A rule both sides need is a leaf both import (``SHARED``),
    not a module of the emulator the loop reads."""
    edges = graph()
    reaching = sorted(
        a
        for a, targets in edges.items()
        if not (inside(a, "ipuloop.emulator") or inside(a, "ipuloop.emulate"))
        and any(inside(b, "ipuloop.emulator") for b in targets)
    )
    assert reaching == ["ipuloop.backend"]


def test_no_lower_module_takes_the_loop():
    """Below the loop, no function is handed the loop itself (an upward dependency that no
    import shows): each part gets what it reads, and a callback the loop's ``LoopView``."""
    table = layers()
    found = [
        reader
        for name, path in module_names().items()
        if (layer_of(name, table) or 0) < 5
        for reader in loop_readers(name, path.read_text())
    ]
    assert found == []


@pytest.mark.parametrize(
    "source,found",
    [
        ("def f(loop): pass", 1),
        ("def f(loop: Any): pass", 1),
        ("def f(self, x, *, lp: Loop): pass", 1),
        ("def f(lp: 'Loop | None'): pass", 1),
        ("def f(lp: ipuloop.loop.Loop): pass", 1),
        ("def f(loop: LoopView): pass", 0),
        ("def f(loop: 'LoopView', plan: Plan): pass", 0),
    ],
)
def test_loop_reader_checker(source, found):
    assert len(loop_readers("m", source)) == found


def test_the_graph_is_read():  # the reader finds relative, aliased and function-local imports
    edges = graph()
    assert "ipuloop.rules" in edges["ipuloop.emulator.executor"]
    assert "ipuloop.mixed_float" in edges["ipuloop.emulator.executor"]
    assert "ipuloop.emulator" in edges["ipuloop.backend"]  # importlib.import_module("...")
    assert "ipuloop.checkpoint_io" in edges["ipuloop.callbacks.checkpoint"]  # from .. import x
    assert "ipuloop.backend" in edges["ipuloop.integrations.ipu_config"]  # inside a function
    assert "ipuloop.callbacks.base" in edges["ipuloop.loop"]
    assert "ipuloop.integrations.ipu_config" in edges["ipuloop"]  # inside ``__getattr__``
    assert "ipuloop.emulator._logging" in edges["ipuloop.emulator.optim"]  # from . import x
    assert "ipuloop.emulate" in edges["ipuloop.emulate.poprun"]  # from . import BINDING
    assert "ipuloop.emulate" in edges["ipuloop.emulate._binding.poptorch"]


@pytest.mark.parametrize(
    "edges,expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"a"}}, [["a"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_cycle_checker(edges, expected):
    assert cycles(edges) == expected


@pytest.mark.parametrize(
    "edge",
    [
        ("ipuloop.emulator.executor", "ipuloop.backend"),
        ("ipuloop.callbacks.lr", "ipuloop.loop"),
        ("ipuloop.callbacks.checkpoint", "ipuloop.executors"),
        ("ipuloop.callbacks.profile", "ipuloop.loop_options"),
        ("ipuloop.callbacks.progress", "ipuloop.plan"),
        ("ipuloop.integrations.tensorboard", "ipuloop.loop"),
        ("ipuloop.loop", "ipuloop.callbacks.progress"),
        ("ipuloop.loop", "ipuloop.callbacks"),
        ("ipuloop.processes", "ipuloop.loop"),
        ("ipuloop.resume", "ipuloop.loop"),
        ("ipuloop.emulate.poprun", "ipuloop.processes"),
        ("ipuloop.emulate", "ipuloop.backend"),
        ("ipuloop.mixed_advice", "ipuloop.emulator.device.precision"),
        ("ipuloop.integrations.ipu_config", "ipuloop.emulator"),
        ("ipuloop.emulator.device.precision", "ipuloop.mixed_advice"),
    ],
)
def test_forbidden_checker(edge):
    a, b = edge
    assert len(forbidden({a: {b}})) == 1
    assert forbidden({a: set()}) == []


def test_allowed_edges_pass():
    assert (
        forbidden(
            {
                "ipuloop.emulator.data": {"ipuloop.rules", "ipuloop.emulator.options"},
                "ipuloop.emulator.executor": {"ipuloop.mixed_float", "ipuloop.group_teardown"},
                "ipuloop.backend": {"ipuloop.emulator", "ipuloop.rules"},
                "ipuloop.mixed_advice": {"ipuloop.mixed_float"},
                "ipuloop.loop": {"ipuloop.callbacks.base"},
                "ipuloop.callbacks.checkpoint": {"ipuloop.checkpoint_io"},
                "ipuloop.emulate": {"ipuloop.emulator", "ipuloop.group_teardown"},
                "ipuloop.emulate.poprun": {"ipuloop.emulate", "ipuloop.rules"},
            }
        )
        == []
    )


# -- the layers of docs/layout.md ----------------------------------------------------------------
def layers() -> dict[str, int]:
    """docs/layout.md's table: each module's layer (a pattern ending in "/" or "/*" stands for
    the modules under it, "__init__.py" for the package), longest pattern first."""
    out: dict[str, int] = {}
    layer = 0
    text = LAYOUT.read_text()
    section = text[text.index("## Modules by layer") :]
    end = section.find("\n## ")
    if end != -1:  # the next section
        section = section[:end]
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if not row.startswith("|") or len(cells) < 3 or (cells[0] and set(cells[0]) <= set("-")):
            continue  # not a row, or the header's rule
        number = re.match(r"(\d+)\.", cells[0])
        if number:
            layer = int(number.group(1))
        for name in re.findall(r"`([\w/.*]+)`", cells[1]):
            name = name.rstrip("*")
            if name.endswith(".py"):
                name = name[:-3]
            key = "ipuloop" if name == "__init__" else "ipuloop." + name.replace("/", ".")
            out[key] = layer
    return dict(sorted(out.items(), key=lambda kv: -len(kv[0])))


def layer_of(module: str, table: dict[str, int]) -> int | None:
    for pattern, layer in table.items():
        if module == pattern.rstrip(".") or (pattern.endswith(".") and module.startswith(pattern)):
            return layer
    return None


def test_every_module_is_in_the_layout_and_imports_down():
    table = layers()
    assert table, "docs/layout.md has no layer table"
    edges = graph()
    unplaced = sorted(m for m in edges if layer_of(m, table) is None)
    assert unplaced == [], f"modules missing from docs/layout.md: {unplaced}"
    assert upward(edges, table) == []


def upward(edges: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    """The imports of a higher layer, as "a (layer i) -> b (layer j)"."""

    def layer(m: str) -> int:
        return layer_of(m, table) or 0

    return [
        f"{a} (layer {layer(a)}) -> {b} (layer {layer(b)})"
        for a, targets in edges.items()
        for b in sorted(targets)
        if layer(b) > layer(a)
    ]


@pytest.mark.parametrize(
    "a,b,up",
    [
        ("ipuloop.callbacks", "ipuloop.integrations.tensorboard", True),  # the kernel's callbacks
        ("ipuloop.loop", "ipuloop.integrations.ipu_config", True),  # the loop: below them
        ("ipuloop.callbacks.progress", "ipuloop.emulate.poprun", True),  # the emulator's tools
        ("ipuloop.loop", "ipuloop.emulate", True),
        ("ipuloop", "ipuloop.integrations.ipu_config", False),  # the public names, above them
        ("ipuloop.emulate", "ipuloop.emulator", False),
        ("ipuloop.integrations.scalars", "ipuloop.callbacks.base", False),
    ],
)
def test_upward_checker(a, b, up):
    assert len(upward({a: {b}}, layers())) == up


def test_the_layer_table_is_read():  # the table's patterns, as the test reads them
    table = layers()
    assert table["ipuloop.rules"] == 1 and table["ipuloop.loop"] == 5
    assert layer_of("ipuloop.emulator.executor", table) == 2
    assert layer_of("ipuloop.callbacks.base", table) == 2
    assert layer_of("ipuloop.callbacks.progress", table) == 3
    assert layer_of("ipuloop.integrations.tensorboard", table) == 6  # above the loop
    assert layer_of("ipuloop", table) == 7
    assert layer_of("ipuloop.examples.mnist", table) == 7
    assert layer_of("ipuloop.emulate", table) == 7  # the emulator's tools, a folder of their own
    assert layer_of("ipuloop.emulate.poprun", table) == 7
    assert layer_of("ipuloop.emulate._binding.popdist", table) == 7


def test_no_basename_twice():
    """``ipuloop/`` and its subpackages (the emulator's names follow PopTorch's own) name
    each module once: ``data.py`` is not both the loop's loaders and PopTorch's."""
    seen: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


# -- the kernel apart from its integrations ------------------------------------------------------
# The kernel: the loop's modules, each a file at the top of ipuloop/, and the built-in callbacks
# (ipuloop/callbacks/), subfolders of neither. Beside it, each a folder of its own: the emulator
# and its tools, the integrations and the examples (docs/layout.md).
KERNEL = (ROOT, ROOT / "callbacks")
BESIDE = ("emulator", "emulate", "integrations", "examples")


def kernel_modules() -> dict[str, Path]:
    """The kernel's modules by name: the files of the folders of ``KERNEL``."""
    return {name: path for name, path in module_names().items() if path.parent in KERNEL}


def test_importing_ipuloop_imports_no_integration(tmp_path):
    """A fit, with ipuloop and its callbacks imported, loads no integration, nor the emulator's
    tools; ``ipuloop.IPUConfig`` imports its integration on first use."""
    code = (
        "import sys, torch, ipuloop, ipuloop.callbacks as cb\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from ipuloop import Loop, WithLoss\n"
        "ds = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))\n"
        "loop = Loop(WithLoss(torch.nn.Linear(4, 2), torch.nn.CrossEntropyLoss()),\n"
        "            progress=False, callbacks=[cb.CSVLogger('log.csv')])\n"
        "loop.fit(DataLoader(ds, batch_size=4), epochs=1)\n"
        "outside = ('ipuloop.integrations', 'ipuloop.emulate')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(outside) and m != 'ipuloop.emulator'\n"
        "                and not m.startswith('ipuloop.emulator.'))\n"
        "assert loaded == [], loaded\n"
        "import ipuloop.integrations.ipu_config as ic\n"
        "assert ipuloop.IPUConfig is ic.IPUConfig\n"
        "assert all(hasattr(cb, n) for n in cb.__all__)\n"
        "assert all(hasattr(ipuloop, n) for n in ipuloop.__all__ if n != 'poptorch')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=tmp_path)


def outside_imports(paths: list[Path]) -> list[str]:
    """The import statements of ``paths`` that run when each is imported (at module level, in
    an ``if`` or ``try`` there, not under ``TYPE_CHECKING``) and name no ipuloop module."""
    found = set()
    for path in paths:
        source = path.read_text()
        todo = list(ast.parse(source).body)
        while todo:
            node = todo.pop(0)
            if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.dump(node.test):
                todo += node.body + node.orelse
            elif isinstance(node, ast.Try):
                todo += node.body + node.orelse + node.finalbody
                todo += [n for handler in node.handlers for n in handler.body]
            elif isinstance(node, ast.Import):
                if all(a.name.split(".")[0] != "ipuloop" for a in node.names):
                    found.add(ast.get_source_segment(source, node) or "")
            elif isinstance(node, ast.ImportFrom) and not node.level:
                if (node.module or "").split(".")[0] not in ("ipuloop", "__future__"):
                    found.add(ast.get_source_segment(source, node) or "")
    return sorted(found)


SIDE_EFFECTS = r"""
import json, logging, os, signal, sys, warnings
for statement in json.loads(sys.argv[1]):  # what ipuloop's modules import besides ipuloop
    try:
        exec(statement)
    except ImportError:  # (an optional package, imported in a ``try`` there)
        pass


def state():
    root = logging.getLogger()
    return {
        "sys.path": repr(sys.path), "sys.meta_path": repr(sys.meta_path),
        "sys.path_hooks": repr(sys.path_hooks), "os.environ": repr(dict(os.environ)),
        "warnings.filters": repr(warnings.filters), "sys.excepthook": repr(sys.excepthook),
        "signals": repr([signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]),
        "the root logger": repr((root.handlers, root.level)),
    }


modules, before = dict(sys.modules), state()
import ipuloop
after = state()
print(json.dumps({
    "changed": [k for k in before if before[k] != after[k]],
    "replaced": sorted(k for k, m in modules.items() if sys.modules.get(k) is not m),
    "added": {k: getattr(sys.modules[k], "__file__", None) for k in set(sys.modules) - set(modules)},
}))
"""


def test_importing_ipuloop_loads_the_kernel_and_changes_nothing_else(tmp_path):
    """A fresh interpreter that has imported what ipuloop's modules import from elsewhere
    (torch...) then imports ipuloop: the modules it adds are the kernel's, each loaded from its
    file (no module object made up, no other name bound in ``sys.modules``); no entry there is
    replaced; and the module path, the import hooks, the environment, the warning filters, the
    signal handlers and the root logger are as they were. So every file at the top of ipuloop/
    is one the loop runs, and importing ipuloop has no side effects."""
    kernel = kernel_modules()
    statements = outside_imports(list(kernel.values()))
    assert "import torch" in statements  # (the reader finds them)
    out = subprocess.run(
        [sys.executable, "-c", SIDE_EFFECTS, json.dumps(statements)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=True,
    )
    found = json.loads(out.stdout)
    assert found["changed"] == [] and found["replaced"] == []
    assert found["added"] == {name: str(path) for name, path in kernel.items()}


def statements(path: Path) -> int:
    """A file's statements: ``ast`` statements, docstrings left out (a formatter changes none)."""
    total = 0
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        total += isinstance(node, ast.stmt) and not docstring
    return total


def kernel_statements() -> int:
    """The kernel's statements: those of the files in the folders of ``KERNEL``."""
    return sum(statements(path) for path in kernel_modules().values())


def test_the_kernel_is_two_folders_and_the_rest_stands_beside_it():
    """``ipuloop/`` holds the kernel's files and folders: the callbacks (the kernel's too) and
    those beside it (``BESIDE``), each a product of its own. A new folder is one of them or
    changes this definition, and docs/layout.md's with it."""
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {"callbacks", *BESIDE}
    table = layers()
    kernel = kernel_modules()
    assert "ipuloop.loop" in kernel and "ipuloop.callbacks.base" in kernel
    assert all((layer_of(m, table) or 0) <= 5 or m == "ipuloop" for m in kernel)  # below
    beside = [m for m in module_names() if m not in kernel]
    assert all(any(inside(m, f"ipuloop.{f}") for f in BESIDE) for m in beside), beside


# How the kernel's size is stated: "<figure> statements" and the day it was counted, as
# "4,120 statements (counted 2026-11-28" or "of 4,120 statements, counted 2026-11-28".
STATED_SIZE = re.compile(r"([\d,]+)\s+statements,?\s+\(?counted\s+(\d{4}-\d{2}-\d{2})")


def test_the_stated_kernel_size():
    """Where ipuloop calls itself minimal, it gives its kernel's size as counted on a day
    (``kernel_statements``): the same figure and day everywhere, the figure within 10% of
    today's count (the README leaves it to the contributors' page). To update it, put
    ``kernel_statements()`` and the day in all five places."""
    measured = kernel_statements()
    repo = ROOT.parent
    stated_everywhere = set()
    for path in (
        "docs/contributing.md",
        "docs/index.md",
        "pyproject.toml",
        "mkdocs.yml",
        "ipuloop/__init__.py",
    ):
        text = (repo / path).read_text()
        assert "minimal" in text, path
        (stated,) = {(int(n.replace(",", "")), day) for n, day in STATED_SIZE.findall(text)}
        stated_everywhere.add(stated)
        assert abs(stated[0] - measured) <= 0.1 * measured, (path, stated, measured)
    assert len(stated_everywhere) == 1, stated_everywhere


# -- a batch's way -------------------------------------------------------------------------------
class _Net(torch.nn.Module):
    """A model-with-loss that may log a value beside its loss."""

    def __init__(self, log: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.log = log

    def forward(self, x, labels=None):
        out = self.lin(x)
        if labels is None:
            return out
        loss = torch.nn.functional.cross_entropy(out, labels)
        if self.log:
            return out, loss, {"hits": (out.argmax(-1) == labels).float().mean()}
        return out, loss


def _fit(kind: str):
    torchmetrics = pytest.importorskip("torchmetrics")
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(48, 4), torch.randint(0, 3, (48,)))
    val = DataLoader(ds, batch_size=4)
    if kind == "custom":  # a batch sampler of its own: host calls joined from its batches
        train = DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 4, drop_last=True))
    else:
        train = DataLoader(ds, batch_size=4, shuffle=True)
    if kind == "widest":
        loop = Loop(
            _Net(log=True),
            poptorch.Options().deviceIterations(2),
            progress=False,
            metrics={"acc": torchmetrics.Accuracy("multiclass", num_classes=3)},
        )
        way = trace(lambda: loop.fit(train, epochs=2, val_loader=val), [train, val])
    else:
        loop = Loop(_Net(), progress=False)
        way = trace(lambda: loop.fit(train, epochs=2), [train])
    return loop, way


# What carries a batch's values from the loader to the logs (docs/layout.md): loop.py, which
# calls each in turn, and state.py, whose logs they land in, are counted with them.
WAY = {"loop", "sources", "host_calls", "feed", "outputs", "accumulators", "processes", "state"}


@pytest.mark.parametrize("kind", ["plain", "custom", "widest"])
def test_a_batch_s_way(kind):
    """The modules that hand on what ends in the logged loss (and, in the widest fit, the
    logged value, the metric and val_loss) are those of docs/layout.md, at most 8, and none
    passes on what another module made for it (no detour: loop -> resume -> data -> resume)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loop, way = _fit(kind)
    logs = loop.state.logs
    logged = ["loss", "train_loss"] + (
        ["val_loss", "hits", "train_hits", "val_hits", "train_acc", "val_acc"]
        if kind == "widest"
        else []
    )
    assert set(logged) <= set(logs)
    modules = set(way.modules([logs[k] for k in logged])) | {"loop", "state"}
    assert {"host_calls", "outputs", "accumulators"} <= modules  # (the walk finds them)
    assert modules <= WAY and len(modules) <= 8, sorted(modules)
    assert way.relays == []


def test_the_way_finds_a_detour():  # a module passing on another's value is a detour
    import batch_way

    values = [object()]
    way = batch_way.Way(values)
    way.records = [("resume", "epoch_batches", (id(values[0]),)), ("plan", "epoch", ())]
    way.spans = [[1, 4], [2, 3]]
    result = [1, 2]
    way._follow(result, 1)
    way._check_relay(0, result)
    assert way.relays == ["resume.epoch_batches passes on plan.epoch's value"]
    way.relays = []
    way._check_relay(0, values[0])  # what it was given: no detour
    assert way.relays == []
