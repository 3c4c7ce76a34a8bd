"""No function of the product code (``launcher/``, ``router/``, ``worker/``) is longer than 60 lines,
from its ``def`` to its last line (decorators aside, docstring and comments included): a longer
one is split into steps that each have a name. ruff's C90 (``max-complexity`` in pyproject.toml)
bounds branching; this bounds length, which ruff's statement count does not."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("launcher", "router", "worker")
MAX_LINES = 60


def long_functions(root: Path = ROOT, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` for every function or method over ``limit`` lines."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_60_lines():
    assert long_functions() == [], f"split these into named steps of at most {MAX_LINES} lines"


def test_the_scan_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "long.py").write_text(f"def too_long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert long_functions(tmp_path) == [f"router/long.py:1 too_long ({MAX_LINES + 1} lines)"]
