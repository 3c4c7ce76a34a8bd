"""The OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

A request's life: validate the body (:mod:`router.schemas`), template and tokenize it here (the
router owns the tokenizer, so length errors are 400s that never reach a worker), check the limits,
then relay the worker's token deltas (:mod:`router.generation`) as one JSON body or as
Server-Sent Events in OpenAI's chunk format ending with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import msgspec
from aiohttp import web
from jinja2 import TemplateError

from router.bodies import check_prompt_chars, read_json, request_timeout, timeout_error
from router.echo import EchoChoice
from router.errors import ApiError
from router.generation import stream_tokens
from router.metrics import request_timer
from router.schemas import ChatRequest, CompletionRequest, Sampling, parse
from router.shaping import Choice, Shaper, total_usage
from router.sse import merge_events, respond_stream
from router.state import API, REQUEST_ID, RequestView
from router.structured import check_schema
from router.tiers import Urgency, urgency_of
from router.tools import ToolMode, chat_messages, tool_grammar, tool_mode
from router.workers import WorkerPool
from worker.contract.protocol import Grammar, SamplingParams


def sampling_params(view: RequestView, req: Sampling, prompt_len: int, max_tokens: int | None) -> SamplingParams:
    """Apply the limits and the context length; build the worker's parameters."""
    lim, max_len = view.cfg.limits, view.max_model_len
    _check_lengths(view, req, prompt_len, max_tokens)
    stops = _checked_stops(req, lim)
    bias = req.logit_bias_ids()
    vocab = len(view.tokenizer)
    if any(t >= vocab for t in bias):
        raise ApiError(400, f"logit_bias: token ids must be in [0, {vocab})", param="logit_bias", code="invalid_value")
    max_new = max_tokens if max_tokens is not None else min(lim.max_tokens, max_len - prompt_len)
    if req.min_tokens and req.min_tokens > max_new:
        raise ApiError(
            400, f"min_tokens={req.min_tokens} is over max_tokens={max_new}", param="min_tokens", code="invalid_value"
        )
    if isinstance(req, ChatRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    return SamplingParams(
        max_tokens=max_new,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        stop=stops,
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=bias,
        min_tokens=req.min_tokens or 0,
        logprobs=logprobs,
    )


def _check_lengths(view: RequestView, req: Sampling, prompt_len: int, max_tokens: int | None) -> None:
    """The prompt within ``limits.max_prompt_tokens``, ``max_tokens`` within ``limits.max_tokens``
    and both within the model's context; else 400 as OpenAI words it."""
    lim, max_len = view.cfg.limits, view.max_model_len
    max_prompt = view.max_prompt_tokens
    if prompt_len > max_prompt:
        raise ApiError(
            400,
            f"prompt has {prompt_len} tokens, over the limit of {max_prompt} (limits.max_prompt_tokens)",
            param="messages" if isinstance(req, ChatRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and max_tokens > lim.max_tokens:
        raise ApiError(
            400,
            f"max_tokens={max_tokens} is over this server's ceiling of {lim.max_tokens} (limits.max_tokens)",
            param="max_tokens",
            code="max_tokens_exceeded",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )


def _checked_stops(req: Sampling, lim) -> list[str]:
    """The request's stop strings, within ``limits.max_stop_strings`` and ``limits.max_stop_length``."""
    stops = req.stop_list()
    if len(stops) > lim.max_stop_strings:
        raise ApiError(
            400,
            f"{len(stops)} stop strings, over the limit of {lim.max_stop_strings} (limits.max_stop_strings)",
            param="stop",
            code="too_many_stop_strings",
        )
    if any(len(s) > lim.max_stop_length for s in stops):
        raise ApiError(
            400,
            f"a stop string is longer than {lim.max_stop_length} characters (limits.max_stop_length)",
            param="stop",
            code="stop_too_long",
        )
    return stops


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index`` of an ``n > 1`` request samples with ``seed + index`` (wrapped into int64),
    so a seeded ``n`` is reproducible and choice 0 equals the ``n = 1`` answer."""
    if seed is None:
        return None
    return ((seed + index + 2**63) % 2**64) - 2**63


async def request_grammar(view: RequestView, req: ChatRequest, tools: ToolMode | None) -> Grammar | None:
    """The decoding constraint of a chat request, compiled once here (400 before dispatch if it
    cannot be): a forced tool call's, or ``response_format``'s."""
    grammar, param = None, "response_format"
    if tools is not None and tools.forced:
        if req.response_format is not None and req.response_format.type != "text":
            raise ApiError(
                400,
                "response_format cannot be combined with a forced tool_choice",
                param="response_format",
                code="invalid_value",
            )
        grammar, param = tool_grammar(req, tools), "tools"
    elif req.response_format is not None and req.response_format.type == "json_object":
        grammar = Grammar(kind="json_object")
    elif req.response_format is not None and req.response_format.type == "json_schema":
        schema, strict = req.response_format.schema_and_strict()
        grammar = Grammar(kind="json_schema", source=check_schema(schema), strict=strict)
    if grammar is None:
        return None
    if req.ignore_eos:
        raise ApiError(
            400, "ignore_eos cannot be combined with constrained output", param="ignore_eos", code="invalid_value"
        )
    await view.grammar_checker.check(grammar, param)
    return grammar


async def tokenize_chat(view: RequestView, req: ChatRequest) -> list[int]:
    messages, extra = chat_messages(req, view.native_tools)

    check_prompt_chars(view, "".join(m["content"] for m in messages), "messages")

    def run() -> list[int]:
        try:
            text = view.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except TemplateError as exc:  # e.g. a template that requires alternating roles
            raise ApiError(
                400, f"messages: the model's chat template refused them: {exc}", param="messages", code="invalid_value"
            ) from None
        check_prompt_chars(view, text, "messages")
        return view.tokenizer(text, add_special_tokens=False)["input_ids"]

    return await asyncio.get_running_loop().run_in_executor(None, run)


async def tokenize_prompt(view: RequestView, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        if len(prompt) > view.max_prompt_tokens:
            raise ApiError(
                400,
                f"prompt has {len(prompt)} tokens, over the limit of {view.max_prompt_tokens} "
                "(limits.max_prompt_tokens)",
                param="prompt",
                code="context_length_exceeded",
            )
        vocab = len(view.tokenizer)
        if any(t < 0 or t >= vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
        return prompt
    check_prompt_chars(view, prompt, "prompt")
    return await asyncio.get_running_loop().run_in_executor(None, lambda: view.tokenizer(prompt)["input_ids"])


async def chat_completions(request: web.Request, body: dict | None = None) -> web.StreamResponse:
    """``body``: the request's JSON already read (a batch line, :mod:`router.batch.lines`); None: read it."""
    req = parse(ChatRequest, await read_json(request) if body is None else body)
    view = request.app[API].for_request(req.model, "/v1/chat/completions")
    tools = tool_mode(req)
    grammar = await request_grammar(view, req, tools)
    prompt = await tokenize_chat(view, req)
    params = sampling_params(view, req, len(prompt), req.max_completion_tokens or req.max_tokens)
    params.grammar = grammar
    return await respond(request, view, req, [prompt], [params], chat=True, tools=tools)


async def completions(request: web.Request, body: dict | None = None) -> web.StreamResponse:
    """Each prompt gets ``n`` choices (indices prompt × n + i, as OpenAI numbers them); ``echo``
    and ``max_tokens: 0`` as :mod:`router.echo` says. ``body`` as for :func:`chat_completions`."""
    req = parse(CompletionRequest, await read_json(request) if body is None else body)
    view = request.app[API].for_request(req.model, "/v1/completions")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens: 0 is only allowed with echo: true (the prompt alone)", param="max_tokens")
    prompts = [await tokenize_prompt(view, p) for p in req.prompt]
    if not all(prompts):
        raise ApiError(400, "prompt is empty after tokenization", param="prompt")
    asked = 1 if req.max_tokens == 0 else req.max_tokens  # max_tokens 0: one token, dropped
    params = [sampling_params(view, req, len(p), asked) for p in prompts]
    make_choice = None
    if req.echo:
        for p in params:
            p.prompt_logprobs = req.logprobs
        loop = asyncio.get_running_loop()
        shown = [
            p if isinstance(p, str) else await loop.run_in_executor(None, view.tokenizer.decode, p) for p in req.prompt
        ]

        def make_choice(k: int, texts, top) -> Choice:
            return EchoChoice(k, texts, top, shown[k // req.n], prompts[k // req.n], req.max_tokens != 0)

    return await respond(request, view, req, prompts, params, chat=False, make_choice=make_choice)


async def models(request: web.Request) -> web.Response:
    """Every served model, in deploy.yaml's order, with its context length, task and state."""
    api = request.app[API]
    states = api.model_states()
    data = [_model_card(m, api.started, states[name]) for name, m in api.models.items()]
    return web.json_response({"object": "list", "data": data})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: one served model's entry (as in the list), else 404 ``model_not_found``."""
    api = request.app[API]
    chosen = api.named(request.match_info["model"])
    return web.json_response(_model_card(chosen, api.started, api.model_states()[chosen.name]))


def _model_card(m, created: int, state: str) -> dict:
    """OpenAI's model object for a served model, with its context length, task and ``state``
    (:meth:`router.state.Api.model_states`: ``ready``, ``loading``, ``unavailable``); ``created``:
    the Unix seconds its deployment started (:attr:`router.state.Api.started`), as vLLM gives."""
    return {
        "id": m.name,
        "object": "model",
        "created": created,
        "owned_by": "llamadeploy",
        "max_model_len": m.config.max_model_len,
        "task": m.task,
        "state": state,
    }


def _envelope(request: web.Request, view: RequestView, req: Sampling, chat: bool) -> tuple[Shaper, Urgency]:
    """The answer's envelope, echoing the ``service_tier`` used when one was asked, with a ready
    replica's ``system_fingerprint`` until the serving worker's is known (:meth:`Shaper.served_by`),
    and the urgency its generations carry (:mod:`router.tiers`)."""
    shaper = Shaper(
        WorkerPool.new_request_id()[4:],
        view.model_name,
        chat,
        include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
        fingerprint=view.pool.fingerprint(model=view.pick_model),
    )
    urgency = urgency_of(request, req.service_tier, req.priority)
    if urgency.echoed is not None:
        shaper.base["service_tier"] = urgency.echoed
    return shaper, urgency


async def respond(
    request: web.Request,
    view: RequestView,
    req: Sampling,
    prompts: list[list[int]],
    params: list[SamplingParams],
    chat: bool,
    tools: ToolMode | None = None,
    make_choice=None,
) -> web.StreamResponse:
    """Fan out ``req.n`` generations per prompt (choice ``k`` = prompt ``k // n``'s ``i = k % n``-th,
    seeded with :func:`choice_seed`) and answer with one JSON body or one SSE stream whose chunks
    carry each choice's ``index``. ``make_choice(k, texts, top)`` builds a choice other than the
    plain :class:`Choice` (echo)."""
    shaper, urgency = _envelope(request, view, req, chat)
    timeout = request_timeout(request, view)
    timer = request_timer(request)
    top = params[0].logprobs
    if top is not None:
        await view.grammar_checker.ready()
    texts = view.token_texts if top is not None else None
    count = len(prompts) * req.n
    make = make_choice or (lambda k, texts, top: Choice(k, chat, tools, texts, top))
    choices = [make(k, texts, top) for k in range(count)]
    prompt_tokens = sum(len(p) for p in prompts)  # each prompt counted once, whatever n

    def on_tokens(worker_id: int, tok) -> None:
        shaper.served_by(view.pool.fingerprint(worker_id))
        timer.on_tokens(worker_id, tok)

    def events(k: int):
        base, i = params[k // req.n], k % req.n
        p = base if i == 0 else msgspec.structs.replace(base, seed=choice_seed(base.seed, i))
        return stream_tokens(
            view.pool,
            prompts[k // req.n],
            p,
            view.cfg.router.max_retries,
            request.get(REQUEST_ID, ""),
            buffered=not req.stream,
            on_tokens=on_tokens,
            max_migrations=view.cfg.router.max_migrations,
            on_migration=timer.on_migration,
            model=view.pick_model,
            urgency=urgency,
            exact=view.cfg.workers_for(view.model_name).deterministic,
        )

    merged = timer.wrap(merge_events([events(k) for k in range(count)]))  # one request in the gauges
    if req.stream:
        return await respond_stream(request, shaper, choices, merged, timeout, prompt_tokens)
    try:
        async with asyncio.timeout(timeout):
            async with aclosing(merged) as stream:
                async for i, tok in stream:
                    choices[i].feed(tok)
    except TimeoutError:
        raise timeout_error(timeout) from None
    return web.json_response(shaper.whole([c.whole() for c in choices], total_usage(prompt_tokens, choices)))
