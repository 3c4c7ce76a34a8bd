"""``GET /v1/models/{id}`` with an id that holds a slash (a served name in Hugging Face's
``org/name`` form), sent raw as curl and some clients do, or encoded as the openai SDK does."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from router.app import create_app
from router.settings import RouterSettings
from router.state import Api
from router.workers import WorkerPool

NAME = "acme/tiny-chat"


def _get(path: str) -> tuple[int, dict]:
    settings = RouterSettings.model_validate({"model": {"name": "smollm2-135m-instruct", "served_name": NAME}})

    async def main():
        pool = WorkerPool("inproc://model-ids", "least_loaded", heartbeat_timeout_s=10)
        client = TestClient(TestServer(create_app(Api(settings, pool))))
        await client.start_server()
        try:
            r = await client.get(path)
            return r.status, await r.json()
        finally:
            await client.close()

    return asyncio.run(main())


def test_a_served_name_with_a_slash_is_retrieved_raw_and_encoded():
    for path in (f"/v1/models/{NAME}", "/v1/models/acme%2Ftiny-chat"):
        status, body = _get(path)
        assert status == 200 and body["id"] == NAME, (path, body)


def test_an_unknown_id_with_a_slash_is_model_not_found():
    status, body = _get("/v1/models/no/such")
    assert status == 404 and body["error"]["code"] == "model_not_found", body
