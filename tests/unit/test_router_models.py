"""The router's served models: the one function that takes a request's model, and dispatch that
chooses only among that model's replicas, each model under its own rotation."""

from __future__ import annotations

import pytest

from router.errors import ApiError
from router.settings import RouterSettings
from router.state import Api, ServedModel
from router.workers import NoWorker, State
from tests.helpers.router_pool import RecordingPool
from worker.contract.settings import ModelConfig


def pool_of(models: dict[int, str]) -> RecordingPool:
    pool = RecordingPool()
    for wid, model in models.items():
        pool.boot(wid, pid=100 + wid, model=model)
    return pool


def test_pick_chooses_only_the_models_replicas_each_in_its_own_rotation():
    pool = pool_of({0: "a", 1: "a", 2: "b", 3: "b"})
    picks = [(m, pool.pick(model=m).worker_id) for m in ["a", "b"] * 3]
    assert picks == [("a", 0), ("b", 2), ("a", 1), ("b", 3), ("a", 0), ("b", 2)]
    assert {pool.pick().worker_id for _ in range(4)} == {0, 1, 2, 3}  # no model: any worker


def test_a_model_without_a_ready_replica_is_503_even_when_another_model_has_one():
    pool = pool_of({0: "a", 1: "b"})
    pool.mark_lost(1, "killed by SIGKILL")
    with pytest.raises(NoWorker) as e:
        pool.pick(model="b")
    assert e.value.status == 503 and "'b'" in e.value.message
    assert pool.pick(model="a").worker_id == 0


def test_the_supervisors_start_report_names_the_model_before_hello():
    pool = RecordingPool()
    pool.on_started(4, 200, 0, "cpu[4]", "embed")
    (row,) = pool.table().workers
    assert (row.id, row.model, row.state) == (4, "embed", State.STARTING)


def api_of(*configs: ModelConfig) -> Api:
    served = [ServedModel(c, tokenizer=None) for c in configs]
    return Api(RouterSettings(), RecordingPool(), models={m.name: m for m in served})


def test_a_request_without_model_goes_to_the_first_generate_model():
    api = api_of(ModelConfig(name="e", task="embed"), ModelConfig(name="c1"), ModelConfig(name="c2"))
    assert api.for_request(None, "/v1/completions").model_name == "c1"
    chosen = api.for_request("c2", "/v1/completions")
    assert (chosen.model_name, chosen.pick_model, chosen.pool) == ("c2", "c2", api.pool)


def test_an_unknown_model_is_404_listing_the_served_ones():
    with pytest.raises(ApiError) as e:
        api_of(ModelConfig(name="c1"), ModelConfig(name="c2")).for_request("gpt-4", "/v1/chat/completions")
    assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")
    assert "'gpt-4'" in e.value.message and "'c1', 'c2'" in e.value.message


def test_an_unknown_model_of_5000_characters_is_quoted_short():
    with pytest.raises(ApiError) as e:
        api_of(ModelConfig(name="c1")).for_request("x" * 5000, "/v1/chat/completions")
    assert e.value.status == 404 and "x" * 200 + "... (5000 characters)" in e.value.message
    assert len(e.value.message) < 400, len(e.value.message)


def test_an_endpoint_of_the_other_task_is_400_naming_the_model_and_the_endpoint_to_use():
    api = api_of(ModelConfig(name="c"), ModelConfig(name="e", task="embed"))
    with pytest.raises(ApiError) as e:
        api.for_request("e", "/v1/chat/completions")
    assert (e.value.status, e.value.code, e.value.param) == (400, "wrong_endpoint", "model")
    assert all(word in e.value.message for word in ("'e'", "/v1/chat/completions", "use /v1/embeddings"))
    with pytest.raises(ApiError, match=r"'c' is a generative \(chat\) model.*use /v1/chat/completions"):
        api.for_request("c", "/v1/embeddings", "embed")
    assert api.for_request(None, "/v1/embeddings", "embed").model_name == "e"  # the first embed model


def test_the_one_model_form_serves_its_one_model_from_the_shared_state_and_picks_without_a_filter():
    api = Api(RouterSettings(model=ModelConfig(name="m", max_model_len=512)), RecordingPool())
    for view in (api.for_request("m", "/v1/completions"), api.for_request(None, "/v1/completions")):
        assert view.model is api.models["m"] is api.default_model  # the one served model, not a copy
        assert view.pool is api.pool and view.cfg is api.cfg
        assert (view.pick_model, view.max_prompt_tokens) == (None, 511)


def test_a_request_view_is_made_per_request_and_leaves_the_shared_state_as_it_was():
    import dataclasses

    api = api_of(ModelConfig(name="c1"), ModelConfig(name="c2", max_model_len=256))
    served, cfg = dict(api.models), api.cfg
    first, second = api.for_request("c2", "/v1/completions"), api.for_request("c2", "/v1/completions")
    assert first is not second and first == second  # one per request, equal for the same model
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.model = api.models["c1"]
    assert api.models == served and api.cfg is cfg and api.default_model.name == "c1"
    assert api.for_request(None, "/v1/completions").model_name == "c1"  # another request's choice is its own


def test_a_request_keeps_the_settings_it_was_resolved_under_when_a_live_apply_replaces_them():
    from router.settings import LimitsConfig

    api = api_of(ModelConfig(name="c1", max_model_len=512))
    view = api.for_request(None, "/v1/completions")
    api.cfg = RouterSettings(limits=LimitsConfig(max_prompt_tokens=100))  # what router.rollout.apply_live does
    assert view.max_prompt_tokens == 511 and api.for_request(None, "/v1/completions").max_prompt_tokens == 100


def test_each_worker_is_judged_by_its_own_models_heartbeat_and_stall_timeouts():
    from launcher.config import parse_config

    cfg = parse_config(
        {
            "workers": {"heartbeat_timeout_s": 10, "stall_timeout_s": 30},
            "models": [{"name": "a"}, {"name": "b", "workers": {"heartbeat_timeout_s": 100, "stall_timeout_s": 300}}],
        }
    ).router_settings()
    cfg = RouterSettings.model_validate_json(cfg.model_dump_json())  # what the router reads from router.json
    assert (cfg.workers_for("b").heartbeat_timeout_s, cfg.workers_for("a").heartbeat_timeout_s) == (100, 10)
    pool = pool_of({0: "a", 1: "b"})
    pool.model_timeouts = cfg.model_timeouts()  # as router.serve builds its pool
    assert pool.timeouts("b") == (100, 300) and pool.timeouts("a") == (10, 30)
    seen = {w: pool.workers[w].last_seen for w in (0, 1)}
    pool.check_workers(max(seen.values()) + 50)  # silent 50 s: past a's 10 s, within b's 100 s
    assert (pool.workers[0].state, pool.workers[1].state) == (State.DEAD, State.READY)
    pool.check_workers(seen[1] + 101)
    assert pool.workers[1].state == State.DEAD


def test_the_one_model_form_judges_every_worker_by_the_top_level_workers_section():
    cfg = RouterSettings(workers={"heartbeat_timeout_s": 7})
    assert cfg.model_workers == {} and cfg.workers_for("anything").heartbeat_timeout_s == 7
    assert pool_of({0: "m"}).timeouts("m") == (10, 30.0)  # the pool's own values, as main builds it


def test_the_status_pages_feed_names_every_served_model():
    import asyncio
    import json

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from router import ui
    from router.state import API

    app = web.Application()
    app[API] = api_of(ModelConfig(name="e", task="embed"), ModelConfig(name="c1"), ModelConfig(name="c2"))
    body = json.loads(asyncio.run(ui.activity(make_mocked_request("GET", "/activity", app=app))).body)
    assert (body["model"], body["models"]) == ("c1", ["e", "c1", "c2"])
