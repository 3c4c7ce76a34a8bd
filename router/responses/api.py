"""``POST /v1/responses``: validate, translate to the chat request, dispatch, shape.

The chat path's pieces do the work (:mod:`router.openai_api`: model check, grammar, template and
tokenizer, limits; :mod:`router.generation`: dispatch, retries, migration); errors they raise
name chat's fields, which are renamed here to the Responses ones (``messages`` -> ``input``,
``max_tokens`` -> ``max_output_tokens``, ``response_format`` -> ``text.format``).
"""

from __future__ import annotations

import asyncio
import re
from contextlib import aclosing, contextmanager

from aiohttp import web

from router.bodies import read_json, request_timeout, timeout_error
from router.errors import ApiError
from router.generation import stream_tokens
from router.metrics import request_timer
from router.openai_api import request_grammar, sampling_params, tokenize_chat
from router.responses.output import OutputBuilder
from router.responses.request import ResponsesRequest, refuse_stateful, to_chat
from router.responses.shaping import ResponseShaper
from router.responses.stream import stream_response
from router.schemas import ChatRequest, parse
from router.shaping import Choice
from router.state import API, REQUEST_ID, RequestView
from router.tiers import urgency_of
from router.tools import ToolMode, tool_mode
from worker.contract.protocol import SamplingParams

RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
_CHAT_WORDS = re.compile(r"\b(messages|max_tokens|response_format)\b")


@contextmanager
def responses_names():
    """Re-raise the chat path's 400s with the Responses API's field names."""
    try:
        yield
    except ApiError as exc:
        if exc.param in RENAMED:
            exc.param = RENAMED[exc.param]
            exc.message = _CHAT_WORDS.sub(lambda m: RENAMED[m.group(1)], exc.message)
        raise


async def create_response(request: web.Request, body: dict | None = None) -> web.StreamResponse:
    """``body``: the request's JSON already read (a batch line, :mod:`router.batch.lines`); None: read it."""
    req = parse(ResponsesRequest, await read_json(request) if body is None else body)
    refuse_stateful(req)
    view = request.app[API].for_request(req.model, "/v1/responses")
    chat = to_chat(req)
    with responses_names():
        tools = tool_mode(chat)
        grammar = await request_grammar(view, chat, tools)
        prompt = await tokenize_chat(view, chat)
        params = sampling_params(view, chat, len(prompt), output_bound(view, chat.max_completion_tokens, len(prompt)))
    params.grammar = grammar
    return await respond(request, view, req, chat, tools, prompt, params)


def output_bound(view: RequestView, asked: int | None, prompt_len: int) -> int | None:
    """``max_output_tokens`` as OpenAI documents it: an upper bound on the tokens generated, so
    it is cut to the context left after the prompt (and to ``limits.max_tokens``) rather than
    refused; the answer then ends ``incomplete`` (``max_output_tokens``) where the context does.
    Chat's and completions' ``max_tokens`` keep their 400 (``context_length_exceeded``), as OpenAI's
    and vLLM's do. A prompt that leaves no room is still refused by the length checks."""
    if asked is None:
        return None
    return max(1, min(asked, view.cfg.limits.max_tokens, view.max_model_len - prompt_len))


async def respond(
    request: web.Request,
    view: RequestView,
    req: ResponsesRequest,
    chat: ChatRequest,
    tools: ToolMode | None,
    prompt: list[int],
    params: SamplingParams,
) -> web.StreamResponse:
    """Generate one answer and send it as a ``response`` object or a Responses event stream."""
    shaper = ResponseShaper(req, chat, view.model_name)
    urgency = urgency_of(request, req.service_tier, req.priority)
    if urgency.echoed is not None:
        shaper.settings["service_tier"] = urgency.echoed
    timeout = request_timeout(request, view)
    timer = request_timer(request)
    top = params.logprobs
    if top is not None:
        await view.grammar_checker.ready()
    choice = Choice(0, True, tools, view.token_texts if top is not None else None, top)
    events = timer.wrap(
        stream_tokens(
            view.pool,
            prompt,
            params,
            view.cfg.router.max_retries,
            request.get(REQUEST_ID, ""),
            buffered=not chat.stream,
            on_tokens=timer.on_tokens,
            max_migrations=view.cfg.router.max_migrations,
            on_migration=timer.on_migration,
            model=view.pick_model,
            urgency=urgency,
            exact=view.cfg.workers_for(view.model_name).deterministic,
        )
    )
    if chat.stream:
        return await stream_response(request, shaper, choice, events, timeout, len(prompt))
    out = OutputBuilder()
    try:
        async with asyncio.timeout(timeout):
            async with aclosing(events) as stream:
                async for tok in stream:
                    out.feed(choice.feed(tok))
    except TimeoutError:
        raise timeout_error(timeout) from None
    return web.json_response(shaper.finished(choice, out.items, len(prompt)))
