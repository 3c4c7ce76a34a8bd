"""``/v1/models``' ``created``: the Unix seconds the deployment started (the supervisor's start,
handed to every router it starts), the same in the list and per model and across calls."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from launcher.config import parse_config
from launcher.supervise.supervisor import Supervisor
from router import openai_api
from router.settings import RouterSettings
from router.state import API, Api, ServedModel
from tests.helpers.router_pool import RecordingPool
from worker.contract.settings import ModelConfig


def call(app: web.Application, handler, path: str, **match) -> dict:
    request = make_mocked_request("GET", path, app=app, match_info=match)
    return json.loads(asyncio.run(handler(request)).body)


def test_each_model_is_created_when_its_deployment_started_in_every_answer():
    served = [ServedModel(ModelConfig(name=n), tokenizer=None) for n in ("a", "b")]
    app = web.Application()
    app[API] = Api(RouterSettings(), RecordingPool(), models={m.name: m for m in served}, started=1_764_650_000)
    listed = [call(app, openai_api.models, "/v1/models")["data"] for _ in range(2)]
    assert [[m["created"] for m in data] for data in listed] == [[1_764_650_000] * 2] * 2
    assert call(app, openai_api.model, "/v1/models/b", model="b")["created"] == 1_764_650_000


def test_a_router_on_its_own_says_its_own_start_in_whole_seconds():
    before = int(time.time())
    started = Api(RouterSettings(), RecordingPool()).started
    assert isinstance(started, int) and before <= started <= time.time()


def test_the_supervisor_hands_its_start_to_every_router_it_starts(tmp_path):
    before = int(time.time())
    sup = Supervisor(parse_config({}), [], Path("/model"), tmp_path, "ipc:///unused")
    args = sup._router_args()  # the same for the first router, a restarted one and the standby
    assert args[args.index("--started") + 1] == str(sup.started) and before <= sup.started <= time.time()
