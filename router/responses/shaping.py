"""The ``response`` object of the Responses API, with every field OpenAI's published OpenAPI
document marks required (``id``, ``object``, ``created_at``, ``error``, ``incomplete_details``,
``instructions``, ``model``, ``tools``, ``output``, ``parallel_tool_calls``, ``metadata``,
``tool_choice``, ``temperature``, ``top_p``), ``null`` where empty, and the request's settings
echoed as the effective ones (``temperature`` 1 and ``top_p`` 1 when not sent).

``usage`` (on finished responses): ``input_tokens`` (the prompt after the chat template),
``input_tokens_details.cached_tokens`` (prompt tokens the worker found in its prefix cache),
``cache_write_tokens: 0`` (there are no billed cache writes here), ``output_tokens``,
``output_tokens_details.reasoning_tokens: 0``, ``total_tokens``.
"""

from __future__ import annotations

import time
import uuid

from router.errors import ApiError
from router.responses.request import ResponsesRequest
from router.schemas import ChatRequest
from router.shaping import Choice

ERROR_CODES = {429: "rate_limit_exceeded"}  # others: "server_error" (the codes OpenAI's schema allows)


def text_format(chat: ChatRequest) -> dict:
    """``text.format`` as the response echoes it."""
    fmt = chat.response_format
    if fmt is None or fmt.type != "json_schema":
        return {"type": fmt.type if fmt is not None else "text"}
    schema, strict = fmt.schema_and_strict()
    out = {"type": "json_schema", "name": fmt.json_schema.name if fmt.json_schema else "response", "schema": schema}
    if fmt.json_schema is not None and fmt.json_schema.description is not None:
        out["description"] = fmt.json_schema.description
    return {**out, "strict": strict}


def echoed_tools(chat: ChatRequest) -> list[dict]:
    return [
        {
            "type": "function",
            "name": t.function.name,
            "description": t.function.description,
            "parameters": t.function.parameters,
            "strict": t.function.strict,
        }
        for t in chat.tools or ()
    ]


def usage(prompt_tokens: int, choice: Choice) -> dict:
    u = choice.usage
    output = u.completion_tokens if u is not None else 0
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens if u is not None else 0, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output,
    }


class ResponseShaper:
    """One response's envelope: made once per request, asked for the object at each stage."""

    def __init__(self, req: ResponsesRequest, chat: ChatRequest, model: str):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.settings = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "metadata": req.metadata or {},
            "model": model,
            "parallel_tool_calls": chat.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": text_format(chat)},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": echoed_tools(chat),
            "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
        }
        if req.user is not None:  # a string when present (OpenAI's schema)
            self.settings["user"] = req.user

    def response(
        self,
        status: str,
        output: list[dict],
        usage: dict | None = None,
        error: dict | None = None,
        incomplete: str | None = None,
    ) -> dict:
        """The object at ``status`` (``in_progress``, ``completed``, ``incomplete``, ``failed``);
        ``usage`` only once counted (OpenAI's schema has it an object when present)."""
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "output": output,
            **self.settings,
        }
        if usage is not None:
            out["usage"] = usage
        return out

    def finished(self, choice: Choice, output: list[dict], prompt_tokens: int) -> dict:
        """The final object of an answer that ended: ``completed``, or ``incomplete`` when cut by
        ``max_output_tokens`` (or the context length)."""
        cut = choice.finish_reason == "length"
        return self.response(
            "incomplete" if cut else "completed",
            output,
            usage(prompt_tokens, choice),
            incomplete="max_output_tokens" if cut else None,
        )

    def failed(self, output: list[dict], err: ApiError) -> dict:
        return self.response(
            "failed", output, error={"code": ERROR_CODES.get(err.status, "server_error"), "message": err.message}
        )
