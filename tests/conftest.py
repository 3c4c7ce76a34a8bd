"""Markers by folder, xdist groups, and the shared fixtures (``tests/helpers/fixtures.py``). Tests
under tests/e2e share one 2-replica CPU deployment (``deployment``); a test that must break or
reconfigure a deployment starts its own with ``tests.helpers.deployment.Deployment``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.xdist_groups import group_order, module_groups

ROOT = Path(__file__).parent
pytest_plugins = ["tests.helpers.fixtures"]  # shared fixtures: deployment, client, tokenizer


# tryfirst: pytest-xdist's worker reads the xdist_group marks in its own collection hook
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in ("unit", "integration", "e2e", "ray"):
            if (ROOT / marker) in Path(item.fspath).parents:
                item.add_marker(getattr(pytest.mark, marker))
    uses: dict[str, set[str]] = {}
    for item in items:
        uses.setdefault(module_of(item), set()).update(session_starts(item))
    groups = module_groups(uses)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[module_of(item)]))
    if hasattr(config, "workerinput"):  # an xdist worker: its collection's order is the order groups are handed out
        items.sort(key=lambda item: group_order(module_of(item), groups[module_of(item)]))


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def session_starts(item: pytest.Item) -> set[str]:
    """The fixtures of ``STARTS`` that ``item`` uses as the session's (a module's own fixture of the
    same name, tests/ray's ``deployment``, is not the shared one)."""
    from tests.helpers.fixtures import STARTS  # here: pytest_plugins registers (and rewrites) it first

    defs = item._fixtureinfo.name2fixturedefs
    return {name for name in STARTS if name in defs and defs[name][-1].scope == "session"}
