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
    if hasattr(config, "workerinput") and config.getoption("loadgroup", False):  # an xdist worker, --dist loadgroup
        for item in items:
            tag_group(item, groups[module_of(item)])
        # the workers' collection order is the order the groups are handed out in
        items.sort(key=lambda item: group_order(module_of(item), groups[module_of(item)]))


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def tag_group(item: pytest.Item, group: str) -> None:
    """Give ``item`` the nodeid ``<id>@<group>`` that pytest-xdist's loadgroup schedules by. xdist 3.8
    writes it to ``item._nodeid``, which pytest 9.2 no longer reads: it keeps a structured id
    (pytest-dev/pytest-xdist#1386), so without this every test would be scheduled alone."""
    from _pytest.nodeid import NodeId

    if "@" not in item.nodeid.rpartition("]")[2]:
        item._id = NodeId.parse(f"{item.nodeid}@{group}")


def session_starts(item: pytest.Item) -> set[str]:
    """The fixtures of ``STARTS`` that ``item`` uses as the session's (a module's own fixture of the
    same name, tests/ray's ``deployment``, is not the shared one)."""
    from tests.helpers.fixtures import STARTS  # here: pytest_plugins registers (and rewrites) it first

    defs = item._fixtureinfo.name2fixturedefs
    return {name for name in STARTS if name in defs and defs[name][-1].scope == "session"}
