"""Markers by folder, xdist groups, and the shared fixtures (``tests/helpers/fixtures.py``). Tests
under tests/e2e share one 2-replica CPU deployment (``deployment``); a test that must break or
reconfigure a deployment starts its own with ``tests.helpers.deployment.Deployment``."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers.xdist_groups import group_order, last_users, module_groups
from worker.contract.env import TUNING_ENV

ROOT = Path(__file__).parent
pytest_plugins = ["tests.helpers.fixtures"]  # shared fixtures: deployment, client, tokenizer
RELEASE = pytest.StashKey[dict[str, set[str]]]()  # test id -> the session fixtures stopped after it
TUNING = pytest.StashKey[str]()  # the tuning folder this process made (and removes)

# Two pytest-xdist workers keep two deployments computing on two cores: OpenMP threads that spin
# between a step's parallel regions (the default) fight over them; passive ones sleep (tests/README.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config):
    """The workers' start-up timings (kernel tables, step costs: ``worker.start_cache``) go to a
    folder of this run's, shared by its pytest-xdist workers (they inherit the variable): the suite's
    first start of a model measures, later ones read, and nothing measured on a busy test machine
    is left for a later ``up``. Set the variable to use another folder (kept)."""
    if TUNING_ENV not in os.environ:
        config.stash[TUNING] = os.environ[TUNING_ENV] = tempfile.mkdtemp(prefix="llamadeploy-tuning-")


def pytest_unconfigure(config):
    if folder := config.stash.get(TUNING, None):
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(TUNING_ENV, None)


# tryfirst: pytest-xdist's worker reads the xdist_group marks in its own collection hook
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in ("unit", "integration", "e2e", "ray"):
            if (ROOT / marker) in Path(item.fspath).parents:
                item.add_marker(getattr(pytest.mark, marker))
    starts = {id(item): session_starts(item) for item in items}
    uses: dict[str, set[str]] = {}
    for item in items:
        uses.setdefault(module_of(item), set()).update(starts[id(item)])
    groups = module_groups(uses)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[module_of(item)]))
    if hasattr(config, "workerinput") and config.getoption("loadgroup", False):  # an xdist worker, --dist loadgroup
        for item in items:
            tag_group(item, groups[module_of(item)])
        # the workers' collection order is the order the groups are handed out in
        items.sort(key=lambda item: group_order(module_of(item), groups[module_of(item)], bool(uses[module_of(item)])))
    elif hasattr(config, "workerinput"):
        return  # another --dist mode: a group's tests may run on both workers, so none is stopped early
    config.stash[RELEASE] = last_users([(item.nodeid, starts[id(item)]) for item in items])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test that uses a session fixture of ``STARTS`` (in this process's order: a
    group runs whole on one worker), stop it: a deployment no later test needs gives its memory
    back to the modules still to run, instead of holding it to the end of the session."""
    result = yield
    for name in sorted(item.config.stash.get(RELEASE, {}).get(item.nodeid, ())):
        item._fixtureinfo.name2fixturedefs[name][-1].finish(item._request)
    return result


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
