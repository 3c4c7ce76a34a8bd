"""The batch runner without a deployment (router/batch/runner.py): lines answered through a stand-in
for the endpoint handlers, a real store. It waits while no worker is ready (a batch never ends
with lines unanswered), retries what the deployment could not answer now, answers every line
once, and ends a cancelled batch with an error line for each line not run."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from router.batch import runner as runner_module
from router.batch.lines import Answer
from router.batch.objects import output_line
from router.batch.runner import Runner
from router.batch.store import Store
from router.settings import RouterSettings
from router.state import API

NOW = int(time.time())  # the runner expires a batch by the clock


class Pool:
    def __init__(self, ready: bool):
        self.accepting, self.ready = True, ready

    def ready_workers(self) -> list:
        return [object()] if self.ready else []


def setup(tmp_path, n: int, ready: bool = True, running: int = 2):
    store = Store(tmp_path)
    lines = [(f"c{i}", json.dumps({"i": i})) for i in range(n)]
    f = store.add_file("", "batch", "in.jsonl", b"x", NOW)
    bid = store.create_batch("", "/v1/chat/completions", f["id"], 24 * 3600, None, lines, NOW)["id"]
    cfg = RouterSettings.model_validate({"router": {"batch": {"running": running}}})
    app = {API: SimpleNamespace(cfg=cfg, pool=Pool(ready))}
    return store, bid, Runner(store, app, tmp_path / "runner.lock"), app


def fake_answers(monkeypatch, statuses: dict[int, list[int]], calls: list[int]):
    """Line ``idx`` answers the statuses in ``statuses[idx]`` in turn (200 once they run out)."""

    async def answer(app, endpoint, line):
        calls.append(line.idx)
        await asyncio.sleep(0.01)
        left = statuses.get(line.idx, [])
        status = left.pop(0) if left else 200
        return Answer(status == 200, status, output_line("r", line.custom_id, status, {"i": line.idx}))

    monkeypatch.setattr(runner_module, "answer", answer)


async def until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def until_ended(runner: Runner, store: Store, bid: str) -> None:
    """Run ``runner`` until batch ``bid`` is completed."""
    task = asyncio.create_task(runner.run())
    await until(lambda: store.batch("", bid)["status"] == "completed", 30)
    task.cancel()


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(runner_module, "TICK_S", 0.02)


def test_no_line_starts_and_the_batch_does_not_end_while_no_worker_is_ready(tmp_path, monkeypatch):
    calls: list[int] = []
    fake_answers(monkeypatch, {}, calls)
    store, bid, runner, app = setup(tmp_path, 3, ready=False)

    async def scenario():
        task = asyncio.create_task(runner.run())
        await asyncio.sleep(0.3)
        assert calls == [] and store.batch("", bid)["status"] == "in_progress"
        app[API].pool.ready = True  # a worker came back
        await until(lambda: store.batch("", bid)["status"] == "completed")
        task.cancel()

    run(scenario())
    assert sorted(calls) == [0, 1, 2]


def test_every_line_is_answered_once_and_a_transient_failure_is_tried_again(tmp_path, monkeypatch):
    calls: list[int] = []
    fake_answers(monkeypatch, {1: [503, 502], 2: [400]}, calls)
    monkeypatch.setattr(runner_module, "ATTEMPTS", 5)
    store, bid, runner, _ = setup(tmp_path, 4)

    run(until_ended(runner, store, bid))
    done = store.batch("", bid)
    assert (done["completed"], done["failed"]) == (3, 1) and sorted(calls) == [0, 1, 1, 1, 2, 3]
    out = store.file_content("", done["output_file_id"]).decode().splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == ["c0", "c1", "c3"]
    errors = store.file_content("", done["error_file_id"]).decode().splitlines()
    assert [json.loads(x)["response"]["status_code"] for x in errors] == [400]


def test_a_line_the_deployment_keeps_failing_is_answered_with_its_error_after_the_last_try(tmp_path, monkeypatch):
    calls: list[int] = []
    fake_answers(monkeypatch, {0: [503] * 10}, calls)
    monkeypatch.setattr(runner_module, "ATTEMPTS", 3)
    store, bid, runner, _ = setup(tmp_path, 1)

    run(until_ended(runner, store, bid))
    done = store.batch("", bid)
    assert calls == [0, 0, 0] and (done["completed"], done["failed"]) == (0, 1)


def test_a_cancelled_batch_answers_each_line_not_run_with_an_error_line(tmp_path, monkeypatch):
    calls: list[int] = []
    fake_answers(monkeypatch, {}, calls)
    store, bid, runner, _ = setup(tmp_path, 5, ready=False, running=1)

    async def scenario():
        task = asyncio.create_task(runner.run())
        await asyncio.sleep(0.1)
        store.request_cancel("", bid, NOW + 1)
        runner.wake()
        await until(lambda: store.batch("", bid)["status"] == "cancelled")
        task.cancel()

    run(scenario())
    done = store.batch("", bid)
    errors = [json.loads(x) for x in store.file_content("", done["error_file_id"]).decode().splitlines()]
    assert [e["custom_id"] for e in errors] == [f"c{i}" for i in range(5)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and done["failed"] == 5
