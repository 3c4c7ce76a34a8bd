"""Markers by folder, and the shared fixtures (``tests/helpers/fixtures.py``). Tests under tests/e2e
share one 2-replica CPU deployment (``deployment``); a test that must break or reconfigure a
deployment starts its own with ``tests.helpers.deployment.Deployment``."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).parent
pytest_plugins = ["tests.helpers.fixtures"]  # shared fixtures: deployment, client, tokenizer


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in ("unit", "integration", "e2e", "ray"):
            if (ROOT / marker) in Path(item.fspath).parents:
                item.add_marker(getattr(pytest.mark, marker))
