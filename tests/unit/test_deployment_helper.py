"""tests/helpers/deployment.py's start(): a refusal for RAM the machine has not free now (another
pytest-xdist worker's deployment holds it) is retried; any other failure of ``up`` raises at once."""

from __future__ import annotations

import pytest

from tests.helpers import deployment as helper


class FakeUp:
    """Stands in for ``llamadeploy up``: writes ``line`` to its log and exits with ``code``, or (code
    None) keeps running with every worker ready."""

    def __init__(self, line: str, code: int | None, stdout):
        stdout.write(line.encode() + b"\n")
        stdout.flush()
        self.returncode, self.pid = code, 0

    def poll(self):
        return self.returncode


def run(monkeypatch, tmp_path, outcomes: list[tuple[str, int | None]]) -> tuple[helper.Deployment, list]:
    started = []

    def popen(cli, stdout, **kw):
        started.append(cli)
        return FakeUp(*outcomes[len(started) - 1], stdout)

    monkeypatch.setattr(helper.subprocess, "Popen", popen)
    monkeypatch.setattr(helper, "RAM_RETRY_S", 0.0)
    monkeypatch.setattr(helper.Deployment, "workers", lambda self: [{"state": "ready"}] * 2)
    return helper.Deployment(tmp_path), started


def test_a_refusal_for_ram_is_retried_until_up_starts(monkeypatch, tmp_path):
    refused = ("error: CPU workers need 4.53 GiB of RAM (...) but 3.39 GiB is available", 1)
    d, started = run(monkeypatch, tmp_path, [refused, refused, ("ready", None)])
    assert d.start(timeout=5) is d and len(started) == 3
    assert d.log().count("[tests] up refused for RAM") == 2


def test_another_failure_raises_at_once_even_after_a_refusal_for_ram(monkeypatch, tmp_path):
    refused = ("error: CPU workers need 4.53 GiB of RAM (...) but 3.39 GiB is available", 1)
    d, started = run(monkeypatch, tmp_path, [refused, ("error: model not found", 2)])
    with pytest.raises(RuntimeError, match="exited with 2"):
        d.start(timeout=5)
    assert len(started) == 2


def test_a_refusal_for_ram_past_the_wait_raises(monkeypatch, tmp_path):
    monkeypatch.setattr(helper, "RAM_WAIT_S", 0.0)
    d, started = run(monkeypatch, tmp_path, [("error: CPU workers need 9 GiB of RAM", 1)] * 2)
    with pytest.raises(RuntimeError, match="CPU workers need"):
        d.start(timeout=5)
    assert len(started) == 1
