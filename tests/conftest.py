"""Shared fixtures. Tests under tests/e2e share one 2-replica CPU deployment (``deployment``);
a test that must break or reconfigure a deployment starts its own with ``Deployment``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deployment import Deployment

ROOT = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in ("unit", "integration", "e2e", "ray"):
            if (ROOT / marker) in Path(item.fspath).parents:
                item.add_marker(getattr(pytest.mark, marker))


@pytest.fixture(scope="session")
def deployment(tmp_path_factory) -> Deployment:
    """The shared deployment: 2 CPU replicas of the embedded default model, least_loaded."""
    d = Deployment(tmp_path_factory.mktemp("shared"), {"router": {"policy": "least_loaded"}})
    d.start()
    yield d
    d.stop()
