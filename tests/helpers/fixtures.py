"""Fixtures shared across test folders (registered for all tests by ``tests/conftest.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from tests.helpers.deployment import MODEL, Deployment

MODEL_DIR = Path.home() / ".cache/llamadeploy/models" / MODEL  # the embedded default, once converted


@pytest.fixture(scope="session")
def deployment(tmp_path_factory) -> Deployment:
    """The shared deployment: 2 CPU replicas of the embedded default model, least_loaded."""
    d = Deployment(tmp_path_factory.mktemp("shared"), {"router": {"policy": "least_loaded"}})
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(deployment) -> OpenAI:
    """The ``openai`` SDK pointed at the shared deployment (no retries: a failure shows as it is)."""
    return OpenAI(base_url=deployment.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded default model's tokenizer; the test is skipped when the model is not cached."""
    if not MODEL_DIR.exists():
        pytest.skip("the embedded model is not cached")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)
