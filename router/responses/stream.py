"""A streamed response: Server-Sent Events whose ``event:`` line is the JSON ``type``, each with a
``sequence_number`` counting from 0, in OpenAI's order::

    response.created -> response.in_progress -> (output item events, see router.responses.output)
    -> response.completed | response.incomplete (the whole response, with usage)

No event carries a top-level ``"error"`` key (openai-java's SSE reader throws on one, even
``null``). A failure after the stream started (the worker lost past retries and migrations, the
request's timeout) sends an ``error`` event (``code``, ``message``, ``param``) then
``response.failed`` carrying the error; before it started, the HTTP error itself. The stream
starts with the first token event, so a refusal by the workers (429, 503) is an HTTP status. No
``data: [DONE]`` follows: OpenAI's Responses streams end with the connection.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

from aiohttp import web

from router.bodies import timeout_error
from router.errors import ApiError
from router.responses.output import OutputBuilder
from router.responses.shaping import ResponseShaper
from router.shaping import Choice


class EventWriter:
    """Writes Responses events on one prepared SSE response, numbering them."""

    def __init__(self, resp: web.StreamResponse):
        self.resp = resp
        self.sequence = 0

    @classmethod
    async def start(cls, request: web.Request) -> EventWriter:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return cls(resp)

    async def send(self, event: dict) -> None:
        body = {"type": event["type"], "sequence_number": self.sequence, **event}
        self.sequence += 1
        await self.resp.write(f"event: {event['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode())


async def stream_response(
    request: web.Request,
    shaper: ResponseShaper,
    choice: Choice,
    events,
    timeout: float,
    prompt_tokens: int,
) -> web.StreamResponse:
    """Relay the worker's token ``events`` (of one choice) as a Responses event stream."""
    out = OutputBuilder()
    writer: EventWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            async with aclosing(events) as stream:
                async for tok in stream:
                    if writer is None:
                        writer = await EventWriter.start(request)
                        for kind in ("response.created", "response.in_progress"):
                            await writer.send({"type": kind, "response": shaper.response("in_progress", [])})
                    for event in out.feed(choice.feed(tok)):
                        await writer.send(event)
        final = shaper.finished(choice, out.items, prompt_tokens)
        await writer.send({"type": f"response.{final['status']}", "response": final})
    except (ApiError, TimeoutError) as exc:
        err = exc if isinstance(exc, ApiError) else timeout_error(timeout)
        if writer is None:
            raise err from None
        await writer.send({"type": "error", "code": err.code, "message": err.message, "param": err.param})
        await writer.send({"type": "response.failed", "response": shaper.failed(out.items, err)})
    await writer.resp.write_eof()
    return writer.resp
