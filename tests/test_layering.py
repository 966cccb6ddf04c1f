"""Imports inside ``ipuloop`` point down: no import circle, and none of the forbidden edges.

Every import of every module is read with ``ast``, relative and function-local ones included.
The layers (docs: architecture): leaves (``rules``, ``errors``, ``state``, ``signals``,
``version``) < ``emulator`` (imports nothing of ipuloop but ``rules``), ``outputs``,
``checkpoint_io``, ``callbacks.base`` < ``backend``, ``config``, ``data``, ``metrics``,
``distributed``, the callbacks < ``options``, ``device``, ``resume``, ``plans``, ``events`` <
``loop`` < ``__init__``, ``emulate`` (docs/layout.md).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ipuloop

ROOT = Path(ipuloop.__file__).parent


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The ipuloop modules ``name`` (at ``path``) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
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


def forbidden(edges: dict[str, set[str]]) -> list[str]:
    """The edges the layering rules forbid, as "a -> b (why)"."""
    bad = []
    for a, targets in edges.items():
        for b in sorted(targets):
            if a.startswith("ipuloop.emulator") and not (
                    b.startswith("ipuloop.emulator") or b == "ipuloop.rules"):
                bad.append(f"{a} -> {b} (the emulator imports nothing of ipuloop but rules)")
            if a.startswith("ipuloop.callbacks") and b in (
                    "ipuloop.loop", "ipuloop.device", "ipuloop.options"):
                bad.append(f"{a} -> {b} (callbacks reach the loop only through base.Loop)")
            if a == "ipuloop.loop" and b.startswith("ipuloop.callbacks") \
                    and b != "ipuloop.callbacks.base":
                bad.append(f"{a} -> {b} (the loop names no concrete callback)")
    return bad


# Known edges that close a circle, each with its reason; removed when the code drops them.
KNOWN = {("ipuloop.emulator.options", "ipuloop.emulator"):
         "a function-local import of the package's public names while an options file is read"}


def test_no_import_circle():
    edges = graph()
    for a, b in KNOWN:
        assert b in edges[a], f"{a} -> {b} is gone: drop it from KNOWN"
        edges[a] = edges[a] - {b}
    assert cycles(edges) == []


def test_no_forbidden_edge():
    assert forbidden(graph()) == []


def test_the_graph_is_read():  # the reader finds relative, aliased and function-local imports
    edges = graph()
    assert "ipuloop.rules" in edges["ipuloop.emulator.executor"]
    assert "ipuloop.checkpoint_io" in edges["ipuloop.callbacks.checkpoint"]  # from .. import x
    assert "ipuloop.backend" in edges["ipuloop.config"]  # inside a function
    assert "ipuloop.callbacks.base" in edges["ipuloop.loop"]


@pytest.mark.parametrize("edges,expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"a"}}, [["a"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_cycle_checker(edges, expected):
    assert cycles(edges) == expected


@pytest.mark.parametrize("edge", [
    ("ipuloop.emulator.executor", "ipuloop.backend"),
    ("ipuloop.callbacks.lr", "ipuloop.loop"),
    ("ipuloop.callbacks.checkpoint", "ipuloop.device"),
    ("ipuloop.callbacks.profile", "ipuloop.options"),
    ("ipuloop.loop", "ipuloop.callbacks.progress"),
    ("ipuloop.loop", "ipuloop.callbacks"),
])
def test_forbidden_checker(edge):
    a, b = edge
    assert len(forbidden({a: {b}})) == 1
    assert forbidden({a: set()}) == []


def test_allowed_edges_pass():
    assert forbidden({"ipuloop.emulator.data": {"ipuloop.rules", "ipuloop.emulator.options"},
                      "ipuloop.loop": {"ipuloop.callbacks.base"},
                      "ipuloop.callbacks.checkpoint": {"ipuloop.checkpoint_io"}}) == []
