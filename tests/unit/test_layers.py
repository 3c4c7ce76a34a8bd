"""The packages' layers: imports point down only (launcher → router → worker), worker/contract
imports nothing of the project outside itself, and no two modules import each other, directly or
round a longer loop. Inside launcher/ the sub-packages layer too (:data:`LAUNCHER_LAYERS`): the base
(config, models, console) ← ``plan`` ← ``supervise`` ← ``ray`` | ``rollout`` | ``bench`` ← ``cli``.
Every import counts, a function's own included, and counts as Python runs it: importing
``pkg.mod`` (or ``from pkg import mod``) runs ``pkg/__init__.py`` first, so the package is imported too."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("launcher", "router", "worker")
CONTRACT = "worker.contract"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(source: str, modules: set[str]) -> set[str]:
    """The project modules an import of ``source`` runs: each package on the way (``import a.b.c``
    runs ``a``, ``a.b``, ``a.b.c``), and for ``from a.b import c`` also ``a.b.c`` when that is a module."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
    with_packages = {".".join(m.split(".")[:k]) for m in found for k in range(1, m.count(".") + 2)}
    return {m for m in with_packages if m.split(".")[0] in PACKAGES}


def _imports(path: Path, modules: set[str]) -> set[str]:
    return _imported(path.read_text(), modules)


@functools.cache
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


def _through_packages(graph: dict[str, set[str]], src: str) -> set[str]:
    """What ``src`` imports, with each package it passes through (one that holds ``src`` itself, or
    one an import merely runs on the way to its module) replaced by what its ``__init__`` imports."""
    packages = {m.rsplit(".", 1)[0] for m in graph if "." in m}
    out, todo, seen = set(), list(graph[src]), set()
    while todo:
        dst = todo.pop()
        if dst in seen:
            continue
        seen.add(dst)
        if dst in packages:
            todo.extend(graph.get(dst, ()))
        else:
            out.add(dst)
    return out


def test_imports_point_down_only():
    graph = _graph()
    bad = sorted(f"{src} imports {dst}" for src in graph for dst in _through_packages(graph, src) if _upward(src, dst))
    assert not bad, "upward imports:\n" + "\n".join(bad)


# launcher's sub-packages, lowest first; a module of launcher/ not listed is its base (config,
# models, console): it may import none of them. A sub-package imports only lower layers (and itself).
LAUNCHER_LAYERS = {
    "launcher.plan": 1,  # what a deployment needs and where it goes (plan, doctor, admission)
    "launcher.supervise": 2,  # the processes: spawn, watch, restart (SlotControl for what is above)
    "launcher.ray": 3,  # the Ray backend the cli hands the supervisor
    "launcher.rollout": 3,  # an apply, stepped by the supervisor through the hook the cli registers
    "launcher.bench": 3,  # llamadeploy bench
    "launcher.cli": 4,  # the commands
}


def _launcher_layer(module: str) -> tuple[int, str]:
    for package, layer in LAUNCHER_LAYERS.items():
        if _within(module, package):
            return layer, package
    return 0, "launcher"


def test_launcher_sub_packages_layer():
    graph = _graph()
    bad = []
    for src in graph:
        if not _within(src, "launcher"):
            continue
        layer, package = _launcher_layer(src)
        for dst in _through_packages(graph, src):
            to_layer, to_package = _launcher_layer(dst) if _within(dst, "launcher") else (-1, "")
            if to_package != package and to_layer >= layer:
                bad.append(f"{src} (layer {layer}) imports {dst} (layer {to_layer})")
    assert not bad, "imports against launcher's sub-package order:\n" + "\n".join(sorted(bad))


def test_a_package_import_runs_its_init():
    modules = {"launcher.bench", "launcher.bench.load", "launcher"}
    assert _imported("from launcher.bench import load", modules) == modules
    assert _imported("import launcher.bench.load", modules) == modules
    assert _imported("from launcher.bench.load import run", modules) == modules
    assert _imported("from launcher.bench import no_module", modules) == {"launcher", "launcher.bench"}


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
