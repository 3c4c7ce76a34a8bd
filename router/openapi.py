"""The router's OpenAPI 3.1 document (``GET /openapi.json``).

Request bodies come from the same pydantic models that validate them (:mod:`router.schemas`), so
the document cannot drift from what the server accepts. Responses are described loosely (the
OpenAI objects are documented by OpenAI); every error is the OpenAI error object.
"""

from __future__ import annotations

import functools
import json
from importlib import metadata

from aiohttp import web
from pydantic import BaseModel

from router.embeddings.request import EmbeddingRequest
from router.responses.request import ResponsesRequest
from router.schemas import ChatRequest, CompletionRequest
from router.settings import RouterSettings
from router.state import API

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
REQUEST_ID_HEADER = {
    "name": "X-Request-ID",
    "in": "header",
    "required": False,
    "description": "Echoed on the response and carried in router and worker logs; a new one is made when "
    "absent or not matching the pattern.",
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
}
JSON_OBJECT = {"type": "object"}


def _completion_object(kinds: list[str]) -> dict:
    """The envelope of a (chat) completion (its stream chunks share it), typed as in OpenAI's document
    (``system_fingerprint`` a string: :mod:`worker.contract.fingerprint`); choices and usage loosely."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "system_fingerprint"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": kinds},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "system_fingerprint": {
                "type": "string",
                "description": "the backend configuration that produced the tokens (model files, dtype, "
                "quantization, kernel table, engine version); the same on every replica of one revision",
            },
            "choices": {"type": "array", "items": JSON_OBJECT},
            "usage": {"anyOf": [JSON_OBJECT, {"type": "null"}]},
        },
    }


def _version() -> str:
    try:
        return metadata.version("llamadeploy")
    except metadata.PackageNotFoundError:
        return "0"


def _errors(*statuses: int) -> dict:
    return {
        str(s): {
            "description": "error",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for s in statuses
    }


def _get(
    summary: str,
    content_type: str = "application/json",
    schema: dict = JSON_OBJECT,
    open_: bool = False,
    errors: tuple[int, ...] = (401,),
) -> dict:
    op = {
        "summary": summary,
        "parameters": [REQUEST_ID_HEADER],
        "responses": {
            "200": {"description": "OK", "content": {content_type: {"schema": schema}}},
            **_errors(*((503,) if open_ else errors)),
        },
    }
    if open_:
        op["security"] = []
    return {"get": op}


def _with_path_parameter(path_item: dict, name: str, description: str) -> dict:
    """``path_item`` (from :func:`_get`) with its operation taking the string path parameter ``name``."""
    for op in path_item.values():
        op["parameters"] = [
            {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}},
            *op["parameters"],
        ]
    return path_item


def _post(
    summary: str,
    body_schema: str,
    answer: str = "The completion; with `stream: true`, Server-Sent Events ending in `data: [DONE]`",
    answer_schema: str | None = None,
) -> dict:
    return {
        "post": {
            "summary": summary,
            "parameters": [REQUEST_ID_HEADER],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body_schema}"}}},
            },
            "responses": {
                "200": {
                    "description": answer,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": f"#/components/schemas/{answer_schema}"}
                            if answer_schema
                            else JSON_OBJECT
                        },
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 404, 408, 413, 429, 502, 503, 504),
            },
        }
    }


def _model_schemas(*models: tuple[type[BaseModel], str]) -> dict:
    out: dict = {}
    for model, name in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[name] = schema
    return out


def _components() -> dict:
    """The request bodies (from the validators), the completion envelopes and the error object."""
    return {
        **_model_schemas(
            (ChatRequest, "ChatCompletionRequest"),
            (CompletionRequest, "CompletionRequest"),
            (ResponsesRequest, "ResponsesRequest"),
            (EmbeddingRequest, "EmbeddingRequest"),
        ),
        "CreateChatCompletionResponse": _completion_object(["chat.completion"]),
        "CreateCompletionResponse": _completion_object(["text_completion"]),
        "Error": ERROR,
    }


def build_openapi(cfg: RouterSettings) -> dict:
    """The document for a router running ``cfg`` (its limits and whether API keys are required)."""
    lim = cfg.limits
    description = (
        f"OpenAI-compatible API serving `{'`, `'.join(m.public_name for m in cfg.models or [cfg.model])}`. "
        "Limits: request body "
        f"{lim.max_body_bytes} bytes (limits.max_body_bytes), prompt {lim.max_prompt_tokens or cfg.model.max_model_len - 1} "
        f"tokens (limits.max_prompt_tokens), max_tokens {lim.max_tokens} (limits.max_tokens), "
        f"{lim.max_stop_strings} stop strings of {lim.max_stop_length} characters (limits.max_stop_strings, "
        f"limits.max_stop_length), {cfg.router.request_timeout_s:g} s per request (router.request_timeout_s)."
    )
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "llamadeploy router", "version": _version(), "description": description},
        "paths": {
            "/v1/chat/completions": _post(
                "Create a chat completion", "ChatCompletionRequest", answer_schema="CreateChatCompletionResponse"
            ),
            "/v1/completions": _post(
                "Create a text completion", "CompletionRequest", answer_schema="CreateCompletionResponse"
            ),
            "/v1/responses": _post(
                "Create a model response (stateless: nothing is stored)",
                "ResponsesRequest",
                "The `response` object; with `stream: true`, Server-Sent Events whose `event:` is each JSON "
                "`type`, ending with `response.completed`, `response.incomplete` or `response.failed`",
            ),
            "/v1/embeddings": _post(
                "Create embeddings (with an embedding model)",
                "EmbeddingRequest",
                "The vectors: `data[i].embedding` floats, or base64 of little-endian float32 with "
                "`encoding_format: base64`",
            ),
            "/v1/models": _get("List the served models"),
            "/v1/models/{model}": _with_path_parameter(
                _get("One served model (404 model_not_found when it is not served)", errors=(401, 404)),
                "model",
                "a served model's id, as GET /v1/models lists it",
            ),
            "/health": _get("Ready to serve (200) or not (503)", open_=True),
            "/health/ready": _get("Same as /health", open_=True),
            "/health/live": _get("The router process is up", open_=True),
            "/workers": _get("The worker table"),
            "/metrics": _get("Prometheus metrics", "text/plain", {"type": "string"}),
            "/openapi.json": _get("This document"),
        },
        "components": {"schemas": _components()},
    }
    if cfg.router.api_keys:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


@functools.lru_cache(maxsize=8)
def _cached(cfg_json: str) -> bytes:
    return json.dumps(build_openapi(RouterSettings.model_validate_json(cfg_json))).encode()


async def openapi_handler(request: web.Request) -> web.Response:
    body = _cached(request.app[API].cfg.model_dump_json())
    return web.Response(body=body, content_type="application/json")
