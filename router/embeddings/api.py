"""The ``POST /v1/embeddings`` handler: check, tokenize here, embed on a worker, answer.

The answer is OpenAI's: ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
"model", "usage": {"prompt_tokens", "total_tokens"}}``, each ``embedding`` a list of floats or, with
``encoding_format: base64``, the base64 of its little-endian float32 bytes (as OpenAI's SDKs
decode it). ``dimensions`` below the model's width cuts each vector to its first ``dimensions``
values and renormalises it, for a model trained for that (its ``truncate_dim``, Matryoshka); any
other model answers 400 unless ``dimensions`` is its own width. An input over the model's token
limit is a 400 naming its index and both lengths, unless ``truncate: true`` asks to cut it.
"""

from __future__ import annotations

import asyncio
import base64

import msgspec
import numpy as np
from aiohttp import web

from router.bodies import read_json, request_timeout, timeout_error
from router.embeddings.dispatch import embed
from router.embeddings.request import EmbeddingRequest, bad_input, refuse_stream, split_input
from router.errors import ApiError
from router.schemas import parse
from router.state import API, EMBED, REQUEST_ID
from worker.contract.embed_spec import EmbedSpec

# characters (or token ids) up to which inputs are tokenized on the event loop: a sentence takes ~0.05 ms
# there, while a hop to the thread pool costs ~0.4 ms and, when the loop is busy, waits for the GIL
INLINE_TOKENIZE = 2048


def check_dimensions(spec: EmbedSpec, dimensions: int | None) -> int | None:
    """The width to cut to (None: the model's own); 400 when the model cannot honour it."""
    if dimensions is None or dimensions == spec.dim:
        return None
    if not spec.matryoshka:
        raise ApiError(
            400,
            f"dimensions={dimensions}: this model returns {spec.dim} dimensions and was not trained for "
            "shorter ones (no truncate_dim in its config_sentence_transformers.json)",
            param="dimensions",
            code="invalid_value",
        )
    if dimensions > spec.dim:
        raise ApiError(
            400, f"dimensions={dimensions} is over this model's {spec.dim}", param="dimensions", code="invalid_value"
        )
    return dimensions


def tokenize(tokenizer, spec: EmbedSpec, inputs: list, truncate: bool) -> list[list[int]]:
    """Token ids of each input (texts with the model's special tokens; id arrays as given), each
    within the model's limit (cut with ``truncate``, else 400 naming the input)."""
    limit, vocab = spec.max_tokens, len(tokenizer)
    if isinstance(inputs[0], str):
        kwargs = {"truncation": True, "max_length": limit} if truncate else {}
        ids = tokenizer(inputs, **kwargs)["input_ids"]
    else:
        ids = [seq[:limit] if truncate else seq for seq in inputs]
        for i, seq in enumerate(ids):
            if min(seq) < 0 or max(seq) >= vocab:
                raise bad_input(f"input[{i}]: token ids must be in [0, {vocab}) (this model's vocabulary)")
    for i, seq in enumerate(ids):
        if len(seq) > limit:
            raise ApiError(
                400,
                f"input[{i}] has {len(seq)} tokens, over this model's maximum of {limit} tokens per input "
                "(send truncate: true to cut it)",
                param="input",
                code="context_length_exceeded",
            )
        if not seq:
            raise bad_input(f"input[{i}] is empty after tokenization")
    return ids


def shape(raw: list[bytes], dimensions: int | None, encoding: str) -> list:
    """Each vector cut to ``dimensions`` and renormalised (when set), as floats or base64."""
    out = []
    for data in raw:
        vector = np.frombuffer(data, dtype="<f4")
        if dimensions is not None:
            vector = vector[:dimensions]
            vector = (vector / max(float(np.linalg.norm(vector)), 1e-12)).astype("<f4")
        out.append(base64.b64encode(vector.tobytes()).decode() if encoding == "base64" else vector.tolist())
    return out


async def create_embeddings(request: web.Request, body: dict | None = None) -> web.Response:
    """``POST /v1/embeddings`` (module docstring); ``body``: the JSON already read (a batch line), None: read it."""
    req = parse(EmbeddingRequest, await read_json(request) if body is None else body)
    refuse_stream(req)
    view = request.app[API].for_request(req.model, "/v1/embeddings", EMBED)  # 404 / 400 wrong_endpoint
    if req.input is None:
        raise bad_input("input is required")
    inputs = split_input(req.input)
    spec = view.model.embed_spec
    dimensions = check_dimensions(spec, req.dimensions)
    if sum(map(len, inputs)) <= INLINE_TOKENIZE:
        ids = tokenize(view.tokenizer, spec, inputs, req.truncate)
    else:
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(None, tokenize, view.tokenizer, spec, inputs, req.truncate)
    timeout = request_timeout(request, view)
    tag = request.get(REQUEST_ID, "")
    try:
        async with asyncio.timeout(timeout):
            result = await embed(view.pool, ids, view.cfg.router.max_retries, tag, model=view.pick_model)
    except TimeoutError:
        raise timeout_error(timeout) from None
    encoding = req.encoding_format or "float"
    data = [
        {"object": "embedding", "index": i, "embedding": v}
        for i, v in enumerate(shape(result.vectors, dimensions, encoding))
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    body = {"object": "list", "data": data, "model": view.model_name, "usage": usage}
    # msgspec writes float lists ~15x faster than json.dumps (512 vectors of 384: 19 ms against 340 ms)
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")
