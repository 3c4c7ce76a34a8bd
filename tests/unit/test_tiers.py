"""Request urgency (router/tiers.py): ``service_tier`` and ``priority`` resolved from the body, the
API key's configured tier and the batch runner's forced flex; and every attempt's ``Generate``
carrying them, a migrated one too (frames through the pool's real decode path, sends recorded)."""

from __future__ import annotations

import asyncio

import pytest

from router.generation import stream_tokens
from router.settings import ApiKey, RouterConfig, RouterSettings
from router.state import API
from router.tiers import FLEX, FORCED_TIER, Urgency, urgency_of
from tests.helpers.router_pool import PARAMS, collect, run, say, step, two_workers


class FakeApi:
    def __init__(self, keys: list):
        self.cfg = RouterSettings(router=RouterConfig(api_keys=keys))


class FakeRequest(dict):
    """What urgency_of reads: ``app[API]``, the Authorization header and the request's keys."""

    def __init__(self, key: str = "", keys: list | None = None):
        super().__init__()
        self.app = {API: FakeApi(keys or [])}
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}


KEYS = ["chat-key", ApiKey(key="batch-key", service_tier="flex"), ApiKey(key="vip", service_tier="priority")]


@pytest.mark.parametrize(
    ("key", "asked", "want"),
    [
        ("chat-key", None, Urgency()),  # nothing asked, a plain key: interactive, nothing echoed
        ("chat-key", "flex", Urgency(flex=True, echoed="flex")),
        ("chat-key", "auto", Urgency(echoed="default")),  # OpenAI echoes the tier used
        ("batch-key", None, Urgency(flex=True, echoed="flex")),  # the key's own default
        ("batch-key", "default", Urgency(echoed="default")),  # the body wins over the key
        ("vip", None, Urgency(echoed="priority")),
        ("unknown", None, Urgency()),
    ],
)
def test_the_body_then_the_key_decide_the_tier(key, asked, want):
    assert urgency_of(FakeRequest(key, KEYS), asked) == want


def test_a_batch_line_runs_flex_whatever_it_asks_and_keeps_its_priority():
    request = FakeRequest("vip", KEYS)
    request[FORCED_TIER] = FLEX
    assert urgency_of(request, "priority", priority=-3) == Urgency(priority=-3, flex=True, echoed="flex")


def test_a_plain_key_list_still_validates_and_the_secrets_are_every_key():
    cfg = RouterConfig(api_keys=KEYS)
    assert cfg.key_secrets() == ["chat-key", "batch-key", "vip"]
    assert cfg.key_tier("batch-key") == "flex" and cfg.key_tier("chat-key") is None
    with pytest.raises(ValueError):
        RouterConfig(api_keys=[ApiKey(key="k", service_tier="scale")])


def test_every_attempt_carries_priority_and_flex_a_migrated_one_too():
    async def scenario():
        pool = two_workers()
        task = asyncio.create_task(
            collect(stream_tokens(pool, [1], PARAMS, 1, max_migrations=1, urgency=Urgency(priority=7, flex=True)))
        )
        await step()
        say(pool, "half", [5])
        await step()
        pool.mark_lost(pool.generates()[0][0], "killed by SIGKILL")
        await step()
        say(pool, " done", [6], finish="stop", total=2)
        await task
        assert [(g.priority, g.flex) for _, g in pool.generates()] == [(7, True), (7, True)]

    run(scenario())
