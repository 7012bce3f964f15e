"""The package's shape: no import cycles between nanoqwen's modules (imports inside
functions count), and each layer imports only from the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "nanoqwen"

# Top to bottom; a package may import from its own layer and the ones below. The package
# root (nanoqwen/__init__.py, __main__.py) is the public face and may import anything.
LAYERS = [
    {"cli"},
    {"bench"},
    {"serve"},
    {"runtime"},
    {"model"},
    {"attention"},
    {"weights", "quant"},
    {"kernels"},
    {"errors", "validation"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The module (of MODULES) that an imported dotted name lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of the imports under `if TYPE_CHECKING:`, which never run."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        lines.add(sub.lineno)
    return lines


def imports_of(module: str) -> set[str]:
    """Every nanoqwen module that `module` imports, at any depth of its code."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names if a.name.startswith("nanoqwen"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "nanoqwen":
                continue
            for alias in node.names:
                target = _resolve(f"{source}.{alias.name}")
                found.add(target if target == f"{source}.{alias.name}" else _resolve(source))
    found.discard(None)
    found.discard(module)
    return found  # type: ignore[return-value]


GRAPH = {m: imports_of(m) for m in MODULES}


def _cycle_through(start: str) -> list[str] | None:
    """A shortest import path from start back to itself, or None."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for dep in sorted(GRAPH[m]):
                if dep == start:
                    return paths[m] + [start]
                if dep not in paths:
                    paths[dep] = paths[m] + [dep]
                    nxt.append(dep)
        frontier = nxt
    return None


def test_the_graph_is_read():
    # A check that read no imports would pass whatever the code did.
    assert len(MODULES) > 100
    assert "nanoqwen.runtime.engine" in GRAPH["nanoqwen.runtime.builder"] | {
        m for deps in GRAPH.values() for m in deps
    }
    assert "nanoqwen.runtime.config" in GRAPH["nanoqwen.runtime.builder"]


def test_no_import_cycles():
    cycles = {" -> ".join(c) for m in MODULES if (c := _cycle_through(m))}
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] in ("__main__",):
        return None
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    pytest.fail(f"{module} is in no layer: add its package to LAYERS")


def test_layers_import_only_downwards():
    upward = []
    for module, deps in GRAPH.items():
        mine = _layer(module)
        if mine is None:
            continue
        for dep in deps:
            theirs = _layer(dep)
            if theirs is not None and theirs < mine:
                upward.append(f"{module} imports {dep}")
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))
