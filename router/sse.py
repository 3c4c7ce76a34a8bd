"""Writing a streamed answer: Server-Sent Events in OpenAI's chunk format, ending with
``data: [DONE]``, merged from the ``n`` choices' event streams as they arrive; an error after the
stream started is an error event, before it the HTTP error itself."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

from aiohttp import web

from router.bodies import timeout_error
from router.errors import ApiError
from router.shaping import Choice, Shaper, total_usage


async def merge_events(streams: list):
    """``(choice index, event)`` from several event streams as they arrive. The first error ends
    the whole and closes every stream (each cancels its own worker request)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for tok in only:
                yield 0, tok
        return
    queue: asyncio.Queue = asyncio.Queue()
    DONE = object()

    async def pump(i: int, stream) -> None:
        try:
            async with aclosing(stream) as it:
                async for tok in it:
                    await queue.put((i, tok))
            await queue.put((i, DONE))
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer, re-raised there)
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is DONE:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def respond_stream(
    request: web.Request, shaper: Shaper, choices: list[Choice], events, timeout: float, prompt_tokens: int
) -> web.StreamResponse:
    resp: web.StreamResponse | None = None

    async def send(obj: dict | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        await resp.write(f"data: {data}\n\n".encode())

    try:
        async with asyncio.timeout(timeout):
            async with aclosing(events) as stream:
                async for i, tok in stream:
                    if resp is None:
                        resp = web.StreamResponse(
                            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                        )
                        await resp.prepare(request)
                    for part in choices[i].feed(tok):
                        await send(shaper.chunk([part]))
        if shaper.include_usage:
            await send(shaper.usage_chunk(total_usage(prompt_tokens, choices)))
    except (ApiError, TimeoutError) as exc:
        err = exc if isinstance(exc, ApiError) else timeout_error(timeout)
        if resp is None:
            raise err from None
        await send(err.body())
    await send("[DONE]")
    await resp.write_eof()
    return resp
