"""The router's apply endpoints over aiohttp's in-process test client (no process): the 409 while
a rollout runs, and live settings — a rotated admin token (the old one kept for its grace
period), the policy, API keys — applied without a restart."""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp.test_utils import TestClient, TestServer

from router.app import create_admin_app
from router.rollout_protocol import ApplyRequest, LiveSettings, RolloutStatus
from router.settings import RouterSettings
from router.state import Api
from router.workers import WorkerPool

OLD, NEW = {"Authorization": "Bearer old-token"}, {"Authorization": "Bearer new-token"}


def settings(**router) -> RouterSettings:
    return RouterSettings.model_validate({"router": {"admin_token": "old-token", **router}})


def admin_client(events: list) -> TestClient:
    pool = WorkerPool("inproc://unused", "least_loaded", heartbeat_timeout_s=10)
    pool.tell_supervisor = events.append
    api = Api(settings(), pool)
    return TestClient(TestServer(create_admin_app(api)))


def test_live_settings_rotate_the_admin_token_and_switch_the_policy():
    async def run():
        async with admin_client([]) as client:
            assert (await client.get("/admin/workers")).status == 401
            new = settings(admin_token="new-token", policy="round_robin", api_keys=["k"])
            body = msgspec.to_builtins(LiveSettings(settings=new.model_dump(mode="json")))
            r = await client.post("/admin/settings", json=body, headers=OLD)
            assert r.status == 200, await r.text()
            table = await client.get("/admin/workers", headers=NEW)
            assert table.status == 200 and (await table.json())["policy"] == "round_robin"
            assert (await client.get("/admin/workers", headers=OLD)).status == 200  # within its grace period
            assert (await client.get("/admin/workers")).status == 401

    asyncio.run(run())


def test_a_second_apply_while_one_runs_is_refused_with_what_is_in_progress():
    async def run():
        events: list = []
        async with admin_client(events) as client:
            request = msgspec.to_builtins(ApplyRequest(config={}, dry_run=True))
            first = await client.post("/admin/apply", json=request, headers=OLD)
            assert first.status == 202 and len(events) == 1 and events[0].request.dry_run
            rid = (await first.json())["id"]
            running = RolloutStatus(id=rid, state="running", revision=2, progress=["worker 0: draining"])
            await client.post("/admin/rollout", json=msgspec.to_builtins(running), headers=OLD)
            second = await client.post("/admin/apply", json=request, headers=OLD)
            assert second.status == 409
            message = (await second.json())["error"]["message"]
            assert "in progress" in message and "revision 2" in message and "worker 0: draining" in message
            done = RolloutStatus(id=rid, state="done", revision=2)
            await client.post("/admin/rollout", json=msgspec.to_builtins(done), headers=OLD)
            assert (await client.post("/admin/apply", json=request, headers=OLD)).status == 202
            status = await client.get("/admin/rollout", headers=OLD)
            assert (await status.json())["state"] == "planning"

    asyncio.run(run())
