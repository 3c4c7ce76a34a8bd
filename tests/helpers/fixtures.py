"""Fixtures shared across test folders (registered for all tests by ``tests/conftest.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from tests.helpers.browser import Browser, chromium_paths
from tests.helpers.deployment import MODEL, STANDBY, Deployment, free_port
from tests.helpers.keyed import SecuredDeployment

MODEL_DIR = Path.home() / ".cache/llamadeploy/models" / MODEL  # the embedded default, once converted

# The session fixtures below that start a deployment or load a model: each pytest-xdist worker that
# asks for one makes its own, so tests/helpers/xdist_groups.py sends all their users to one worker.
STARTS = ("deployment", "keyed_session", "curve_busy", "loaded")


@pytest.fixture(scope="session")
def deployment(tmp_path_factory) -> Deployment:
    """The shared deployment: 2 CPU replicas of the embedded default model, least_loaded."""
    d = Deployment(tmp_path_factory.mktemp("shared"), {"router": {"policy": "least_loaded"}})
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def curve_busy(tmp_path_factory) -> Deployment:
    """One replica whose worker connects over ``tcp://127.0.0.1`` with CURVE, a small queue (8 running
    + 8 waiting) and debug logs: test_batching's ``busy`` tests and test_zmq_curve share it (neither
    needs the other's settings off). Started on first use; ``zmq_address`` is its router's endpoint."""
    address = f"tcp://127.0.0.1:{free_port()}"
    d = Deployment(
        tmp_path_factory.mktemp("curve-busy"),
        {
            # 16 requests of 60 tokens go through 8 rows in two rounds: on a loaded 2-core box the
            # second round waits and ends later than the 120 s defaults (no test here is about those
            # limits); 300 s is what test_batching's clients wait
            "workers": {"replicas": 1, "max_num_seqs": 8, "max_waiting": 8, "max_queue_wait_s": 300},
            "router": {"zmq_address": address, "request_timeout_s": 300},
            "logging": {"level": "debug"},
            **STANDBY,  # test_zmq_curve kills its router: the standby takes over
        },
    )
    d.zmq_address = address
    try:
        d.start(timeout=420)  # it may start while the shared deployment runs: on 2 cores, give it time
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="session")
def keyed_session(tmp_path_factory) -> SecuredDeployment:
    """The session's keyed deployment (``tests/helpers/keyed.py``), started on first use."""
    d = SecuredDeployment(tmp_path_factory.mktemp("keyed"))
    try:
        d.start(timeout=420)  # it starts while the shared deployment runs: on 2 cores, give it time
        yield d
    finally:
        d.stop()  # also when it never became ready: nothing of it is left running


@pytest.fixture(scope="module")
def secured(keyed_session) -> SecuredDeployment:
    """The keyed deployment with its worker ready (a module before may have killed or drained it)."""
    keyed_session.wait_ready(240)
    return keyed_session


@pytest.fixture(scope="module")
def client(deployment) -> OpenAI:
    """The ``openai`` SDK pointed at the shared deployment (no retries: a failure shows as it is)."""
    return OpenAI(base_url=deployment.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def loaded():
    """The embedded default in process, float32 on CPU (``tests/helpers/engine_run.py``), loaded
    once for every integration module that drives an engine."""
    from tests.helpers.engine_run import load_float32

    return load_float32()


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded default model's tokenizer; the test is skipped when the model is not cached."""
    if not MODEL_DIR.exists():
        pytest.skip("the embedded model is not cached")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def browser() -> Browser:
    """One headless Chromium per module (the pages' and the docs' browser tests); skips before
    starting anything when there is no browser."""
    chromium_paths()
    b = Browser()
    yield b
    b.quit()
