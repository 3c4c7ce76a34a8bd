"""Answering one batch line in process, through the very handler its ``url`` names over HTTP.

The handler gets a :class:`LineRequest` (what handlers read of a ``web.Request``: the app, no
headers, the request's keys) and the line's ``body``; it validates, tokenizes, dispatches and
shapes as for any client, so a line's answer is the one the endpoint gives. The line runs flex
(:data:`router.tiers.FORCED_TIER`); its answer is not streamed (a line asking to stream was
refused at upload).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from router import openai_api
from router.batch.objects import line_request_id, output_line
from router.batch.store import Line
from router.embeddings.api import create_embeddings
from router.errors import ApiError
from router.responses.api import create_response
from router.state import REQUEST_ID
from router.tiers import FLEX, FORCED_TIER

log = logging.getLogger(__name__)

HANDLERS = {
    "/v1/chat/completions": openai_api.chat_completions,
    "/v1/completions": openai_api.completions,
    "/v1/embeddings": create_embeddings,
    "/v1/responses": create_response,
}
TRANSIENT = frozenset({429, 502, 503, 504})  # the deployment could not answer now: the line runs again later


class LineRequest(dict):
    """The request a handler sees for a batch line: ``app``, empty ``headers`` and the
    request keys (``request[KEY]``, ``request.get(KEY)``) it sets and reads."""

    def __init__(self, app: web.Application, request_id: str):
        super().__init__()
        self.app = app
        self.headers = CIMultiDictProxy(CIMultiDict())
        self[REQUEST_ID] = request_id
        self[FORCED_TIER] = FLEX


@dataclass(frozen=True)
class Answer:
    """A line's answer: ``ok`` (2xx), ``status`` and its output-file line ``text``."""

    ok: bool
    status: int
    text: str

    @property
    def transient(self) -> bool:
        return self.status in TRANSIENT


async def answer(app: web.Application, endpoint: str, line: Line) -> Answer:
    """Run ``line`` of a batch to ``endpoint`` and shape its output line (an error of the
    handler, a 4xx or 5xx, is an answer too: it goes to the error file)."""
    request_id = line_request_id(line)
    try:
        response = await HANDLERS[endpoint](LineRequest(app, request_id), json.loads(line.body))
        status, body = response.status, json.loads(response.body)
    except ApiError as exc:
        status, body = exc.status, exc.body()
    except Exception:
        log.exception("batch %s line %d failed", line.batch_id, line.idx)
        status, body = 500, ApiError(500, "internal server error").body()
    return Answer(200 <= status < 300, status, output_line(request_id, line.custom_id, status, body))
