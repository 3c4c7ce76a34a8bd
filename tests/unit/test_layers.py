"""The packages' layers: imports point down only (launcher → router → worker), worker/contract
imports nothing of the project outside itself, and no two modules import each other, directly or
round a longer loop. Every import counts, a function's own included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("launcher", "router", "worker")
CONTRACT = "worker.contract"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from a.b import c`` counts ``a.b.c`` when that is a
    module, else ``a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            )
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {m: _imports(p, set(files)) - {m} for m, p in files.items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _upward(src: str, dst: str) -> bool:
    if _within(src, CONTRACT):
        return not _within(dst, CONTRACT)
    top, to = src.split(".")[0], dst.split(".")[0]
    if top == "worker":
        return to != "worker"
    if top == "router":
        return to == "launcher" or (to == "worker" and not _within(dst, CONTRACT))
    return False


def test_imports_point_down_only():
    graph = _graph()
    bad = sorted(f"{src} imports {dst}" for src, dsts in graph.items() for dst in dsts if _upward(src, dst))
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" → ".join([*path[path.index(nxt) :], nxt]))
            elif nxt in graph and not state.get(nxt):
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if not state.get(start):
            visit(start, [start])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_scan_sees_function_level_imports():
    graph = _graph()
    assert "launcher.plan.shape" in graph["launcher.plan.plan"]  # imported inside preflight()


def test_every_package_is_installed():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert listed == found, "pyproject.toml [tool.setuptools] packages must list every package folder"


def test_the_contract_is_torch_free():
    heavy = {"torch", "transformers", "safetensors", "accelerate"}
    found = []
    for path in (ROOT / "worker" / "contract").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{_module(path)} imports {n}" for n in names if n.split(".")[0] in heavy]
    assert not found, found
