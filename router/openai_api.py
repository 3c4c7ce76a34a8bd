"""The OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

A request's life: validate the body (:mod:`router.schemas`), template and tokenize it here (the
router owns the tokenizer, so length errors are 400s that never reach a worker), check the limits,
then relay the worker's token deltas (:mod:`router.generation`) as one JSON body or as
Server-Sent Events in OpenAI's chunk format ending with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from aiohttp import web
from jinja2 import TemplateError

from launcher.config import DeployConfig
from router.errors import ApiError
from router.generation import stream_tokens
from router.metrics import request_timer
from router.schemas import ChatRequest, CompletionRequest, Sampling, parse
from router.workers import WorkerPool
from worker.protocol import SamplingParams, Tokens


@dataclass
class Api:
    """What the handlers share: config, worker pool and the model's tokenizer."""

    cfg: DeployConfig
    pool: WorkerPool
    tokenizer: Any
    metrics: Any = None  # router.metrics.Metrics, made by the app factory

    @property
    def model_name(self) -> str:
        return self.cfg.model.public_name

    @property
    def max_prompt_tokens(self) -> int:
        return self.cfg.limits.max_prompt_tokens or self.cfg.model.max_model_len - 1

    @cached_property
    def longest_token_chars(self) -> int:
        """Characters in the vocabulary's longest token: a text longer than ``n`` times this has
        more than ``n`` tokens, so it can be refused without tokenizing it."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)


def check_prompt_chars(api: Api, text: str, param: str) -> None:
    """400 at once for a text that must be over ``max_prompt_tokens``, however it tokenizes."""
    ceiling = api.max_prompt_tokens * api.longest_token_chars
    if len(text) > ceiling:
        raise ApiError(400, f"prompt of {len(text)} characters is over the limit of {api.max_prompt_tokens} tokens "
                            "(limits.max_prompt_tokens)", param=param, code="context_length_exceeded")


API = web.AppKey("api", Api)


async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:
    """The raw body, never more than ``limit`` bytes of it in memory: 413 beyond (at once when
    Content-Length says so), 408 when it does not arrive within ``timeout`` seconds."""
    too_large = ApiError(413, f"request body exceeds limits.max_body_bytes={limit}", param="body", code="body_too_large")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.read(65536):
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g}s (router.request_timeout_s)",
                       code="timeout") from None
    return b"".join(chunks)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: web.Request) -> Any:
    """The body as JSON; 413 over the size limit, 400 for invalid UTF-8 or malformed JSON."""
    cfg = request.app[API].cfg
    raw = await read_body(request, cfg.limits.max_body_bytes, cfg.router.request_timeout_s)
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not valid UTF-8", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, integers of more than 4300 digits
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None


def check_model(api: Api, name: str | None) -> None:
    if name is not None and name != api.model_name:
        raise ApiError(404, f"The model '{name}' does not exist; this server serves '{api.model_name}'",
                       param="model", code="model_not_found")


def sampling_params(api: Api, req: Sampling, prompt_len: int, max_tokens: int | None) -> SamplingParams:
    """Apply the limits and the context length; build the worker's parameters."""
    lim, max_len = api.cfg.limits, api.cfg.model.max_model_len
    max_prompt = api.max_prompt_tokens
    if prompt_len > max_prompt:
        raise ApiError(400, f"prompt has {prompt_len} tokens, over the limit of {max_prompt} (limits.max_prompt_tokens)",
                       param="messages" if isinstance(req, ChatRequest) else "prompt", code="context_length_exceeded")
    if max_tokens is not None and max_tokens > lim.max_tokens:
        raise ApiError(400, f"max_tokens={max_tokens} is over this server's ceiling of {lim.max_tokens} (limits.max_tokens)",
                       param="max_tokens", code="max_tokens_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > max_len:
        raise ApiError(400, f"This model's maximum context length is {max_len} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                            "completion). Please reduce the prompt or max_tokens.",
                       param="max_tokens", code="context_length_exceeded")
    stops = req.stop_list()
    if len(stops) > lim.max_stop_strings:
        raise ApiError(400, f"{len(stops)} stop strings, over the limit of {lim.max_stop_strings} (limits.max_stop_strings)",
                       param="stop", code="too_many_stop_strings")
    if any(len(s) > lim.max_stop_length for s in stops):
        raise ApiError(400, f"a stop string is longer than {lim.max_stop_length} characters (limits.max_stop_length)",
                       param="stop", code="stop_too_long")
    temperature = 1.0 if req.temperature is None else req.temperature
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else min(lim.max_tokens, max_len - prompt_len),
        temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
        seed=req.seed, stop=stops, ignore_eos=req.ignore_eos)


async def tokenize_chat(api: Api, req: ChatRequest) -> list[int]:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]

    check_prompt_chars(api, "".join(m["content"] for m in messages), "messages")

    def run() -> list[int]:
        try:
            text = api.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:  # e.g. a template that requires alternating roles
            raise ApiError(400, f"messages: the model's chat template refused them: {exc}", param="messages",
                           code="invalid_value") from None
        check_prompt_chars(api, text, "messages")
        return api.tokenizer(text, add_special_tokens=False)["input_ids"]

    return await asyncio.get_running_loop().run_in_executor(None, run)


async def tokenize_prompt(api: Api, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        if len(prompt) > api.max_prompt_tokens:
            raise ApiError(400, f"prompt has {len(prompt)} tokens, over the limit of {api.max_prompt_tokens} "
                                "(limits.max_prompt_tokens)", param="prompt", code="context_length_exceeded")
        vocab = len(api.tokenizer)
        if any(t < 0 or t >= vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
        return prompt
    check_prompt_chars(api, prompt, "prompt")
    return await asyncio.get_running_loop().run_in_executor(None, lambda: api.tokenizer(prompt)["input_ids"])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    api = request.app[API]
    req = parse(ChatRequest, await read_json(request))
    check_model(api, req.model)
    prompt = await tokenize_chat(api, req)
    params = sampling_params(api, req, len(prompt), req.max_completion_tokens or req.max_tokens)
    return await respond(request, api, req, prompt, params, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    api = request.app[API]
    req = parse(CompletionRequest, await read_json(request))
    check_model(api, req.model)
    prompt = await tokenize_prompt(api, req.prompt)
    if not prompt:
        raise ApiError(400, "prompt is empty after tokenization", param="prompt")
    params = sampling_params(api, req, len(prompt), req.max_tokens)
    return await respond(request, api, req, prompt, params, chat=False)


async def models(request: web.Request) -> web.Response:
    api = request.app[API]
    return web.json_response({"object": "list", "data": [
        {"id": api.model_name, "object": "model", "created": 0, "owned_by": "llamadeploy",
         "max_model_len": api.cfg.model.max_model_len}]})


class Shaper:
    """Builds OpenAI response objects for chat (``chat.completion``) or completions (``text_completion``)."""

    def __init__(self, model: str, chat: bool):
        self.chat = chat
        self.base = {"id": ("chatcmpl-" if chat else "cmpl-") + WorkerPool.new_request_id()[4:],
                     "created": int(time.time()), "model": model}

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
        if self.chat:
            delta: dict = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return {**self.base, "object": "chat.completion.chunk", "choices": [choice]}
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return {**self.base, "object": "text_completion", "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self.base, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [], "usage": usage}

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish_reason, "logprobs": None}
            return {**self.base, "object": "chat.completion", "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return {**self.base, "object": "text_completion", "choices": [choice], "usage": usage}


TIMEOUT_HEADER = "X-Request-Timeout"


def request_timeout(request: web.Request, api: Api) -> float:
    """Seconds this request may take: ``router.request_timeout_s``, or less when the client's
    ``X-Request-Timeout`` header asks for less. Past it: 504, and the work is cancelled."""
    limit = api.cfg.router.request_timeout_s
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return limit
    try:
        asked = float(raw)
    except ValueError:
        asked = -1.0
    if not 0 < asked < float("inf"):
        raise ApiError(400, f"{TIMEOUT_HEADER} must be a positive number of seconds (got {raw[:32]!r})",
                       param=TIMEOUT_HEADER, code="invalid_value")
    return min(asked, limit)


def timeout_error(seconds: float) -> ApiError:
    return ApiError(504, f"request timed out after {seconds:g}s (router.request_timeout_s or {TIMEOUT_HEADER})",
                    code="timeout")


def usage_dict(tok: Tokens) -> dict:
    u = tok.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens} if u else {}


async def respond(request: web.Request, api: Api, req: Sampling, prompt: list[int], params: SamplingParams,
                  chat: bool) -> web.StreamResponse:
    shaper = Shaper(api.model_name, chat)
    timeout = request_timeout(request, api)
    timer = request_timer(request)
    events = timer.wrap(stream_tokens(api.pool, prompt, params, api.cfg.router.max_retries,
                                      request.get("request_id", ""), buffered=not req.stream,
                                      on_tokens=timer.on_tokens, max_migrations=api.cfg.router.max_migrations,
                                      on_migration=timer.on_migration))
    if req.stream:
        return await respond_stream(request, req, shaper, events, timeout)
    parts: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            async with aclosing(events) as stream:
                async for tok in stream:
                    parts.append(tok.text_delta)
                    last = tok
    except TimeoutError:
        raise timeout_error(timeout) from None
    return web.json_response(shaper.whole("".join(parts), last.finish_reason, usage_dict(last)))


async def respond_stream(request: web.Request, req: Sampling, shaper: Shaper, events,
                         timeout: float) -> web.StreamResponse:
    resp: web.StreamResponse | None = None

    async def send(obj: dict | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        await resp.write(f"data: {data}\n\n".encode())

    try:
        async with asyncio.timeout(timeout):
            async with aclosing(events) as stream:
                async for tok in stream:
                    if resp is None:
                        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                        await resp.prepare(request)
                        if shaper.chat:
                            await send(shaper.chunk("", None, first=True))
                    if tok.text_delta:
                        await send(shaper.chunk(tok.text_delta, None))
                    if tok.finish_reason:
                        await send(shaper.chunk(None, tok.finish_reason))
                        if req.stream_options and req.stream_options.include_usage:
                            await send(shaper.usage_chunk(usage_dict(tok)))
    except (ApiError, TimeoutError) as exc:
        err = exc if isinstance(exc, ApiError) else timeout_error(timeout)
        if resp is None:
            raise err from None
        await send(err.body())
    await send("[DONE]")
    await resp.write_eof()
    return resp
