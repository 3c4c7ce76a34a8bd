"""The body of ``POST /v1/responses``, validated, and its translation into a chat request.

Accepted as OpenAI documents it and as clients send it in practice: message items without
``"type"`` (openai-java's ``EasyInputMessage``), assistant turns echoed back as ``output_text``
parts with or without ``id``/``status``, ``function_call`` items without ``id`` (LangChain4j),
function tools without ``strict``, schemas carrying ``"$schema"``.

Refused with a 400 naming the field, because they change the answer and this server cannot honour
them: ``previous_response_id``, ``conversation``, ``prompt`` (stored prompts), ``background:
true`` and ``item_reference`` items (nothing is stored); built-in tools (``web_search``,
``file_search``, ``code_interpreter``, ...) and tool choices naming them (this server runs no
tools); ``input_image``/``input_file``/``input_audio`` parts (the model reads text only).

Accepted and ignored, since they do not change the answer here: ``store``, ``reasoning``,
``truncation``, ``service_tier``, ``prompt_cache_key``, ``prompt_cache_retention``,
``safety_identifier``, ``max_tool_calls`` (built-in tools only), ``stream_options``, ``include``
(except ``message.output_text.logprobs``, which turns logprobs on), ``text.verbosity``, reasoning
items in ``input``, and any field this server does not know.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, ValidationError, field_validator

from router.errors import ApiError
from router.schemas import PRIORITY_MAX, PRIORITY_MIN, Body, ChatRequest, ServiceTier, Text

LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text"})
NON_TEXT_PARTS = frozenset({"input_image", "input_file", "input_audio"})
MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})
IGNORED_ITEMS = frozenset({"reasoning"})  # nothing in them changes what this model answers


class ResponsesRequest(Body):
    """``POST /v1/responses`` as this server reads it (see the module docstring)."""

    model: Text | None = None
    input: Text | list[Any]
    instructions: Text | None = None
    stream: StrictBool | None = None
    store: StrictBool | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    include: list[Text] | None = None
    background: StrictBool | None = None
    service_tier: ServiceTier | None = None
    priority: StrictInt = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX, description="vLLM's: lower is served first")
    previous_response_id: Any = Field(None, description="not supported: this server stores nothing")
    conversation: Any = Field(None, description="not supported: this server stores nothing")
    prompt: Any = Field(None, description="not supported: stored prompts")

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _number(cls, v):
        if isinstance(v, bool) or (v is not None and not isinstance(v, (int, float))):
            raise ValueError("must be a number")
        return float(v) if v is not None else v

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


def refuse_stateful(req: ResponsesRequest) -> None:
    """400 for what would need stored state (this server stores nothing)."""
    for name in ("previous_response_id", "conversation"):
        if getattr(req, name) is not None:
            raise bad(
                name,
                f"{name} is not supported: this server is stateless and stores no responses; "
                "send the whole conversation in input",
                "unsupported_parameter",
            )
    if req.prompt is not None:
        raise bad("prompt", "prompt (stored prompt templates) is not supported", "unsupported_parameter")
    if req.background:
        raise bad("background", "background responses are not supported (nothing is stored)", "unsupported_parameter")


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def _text_of(content: Any, where: str) -> str:
    """The text of a message's or a tool output's ``content``: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in NON_TEXT_PARTS:
            raise bad(at, f"{kind} is not supported: this model reads text only", "unsupported_content")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise bad(at, "must be a text part ({'type': 'input_text', 'text': ...})")
    return "".join(texts)


def _function_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad(f"{where}.{key}", "must be a string")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def input_messages(req: ResponsesRequest) -> list[dict]:
    """``instructions`` and ``input`` as chat messages: ``function_call`` items join the assistant
    turn before them (or make one), ``function_call_output`` items become ``role: "tool"``."""
    out: list[dict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    if not req.input:
        raise bad("input", "must not be empty")
    for i, item in enumerate(req.input):
        _add_item(out, item, f"input[{i}]")
    return out


def _add_item(out: list[dict], item: Any, where: str) -> None:
    """Append input item ``item`` (at ``where``) to the chat messages ``out``."""
    if not isinstance(item, dict):
        raise bad(where, "must be an input item object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise bad(f"{where}.role", "must be one of user, system, developer, assistant")
        out.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = _function_call(item, where)
        if out and out[-1]["role"] == "assistant":
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise bad(f"{where}.call_id", "must be a string")
        output = _text_of(item.get("output"), f"{where}.output")
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    elif kind == "item_reference":
        raise bad(where, "item_reference is not supported: this server stores no items", "unsupported_parameter")
    elif kind not in IGNORED_ITEMS:
        raise bad(f"{where}.type", f"{str(kind)[:60]!r} items are not supported", "unsupported_parameter")


def chat_tools(req: ResponsesRequest) -> list[dict] | None:
    """The flat function tools as chat tools; a built-in tool is a 400 naming it."""
    if req.tools is None:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad(
                f"tools[{i}].type",
                f"{str(kind)[:60]!r} tools are not supported: this server runs no built-in tools, "
                "only function tools that the client executes",
                "unsupported_parameter",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(req: ResponsesRequest) -> str | dict | None:
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad(
                "tool_choice",
                f"tool_choice of type {str(choice.get('type'))[:60]!r} is not supported (only function tools)",
                "unsupported_parameter",
            )
        if not isinstance(choice.get("name"), str):
            raise bad("tool_choice.name", "must be the name of one of tools (a string)")
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice in ("auto", "none") and not req.tools:
        return None  # nothing to choose from: the same answer
    return choice


def chat_format(req: ResponsesRequest) -> dict | None:
    """``text.format`` as chat's ``response_format`` (``json_schema`` fields flattened there)."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad("text.format", "must be an object with a type")
    if fmt.get("type") != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
    if not isinstance(spec.get("schema"), dict):
        raise bad("text.format.schema", "json_schema needs a schema (a JSON schema object)")
    return {"type": "json_schema", "json_schema": spec}


CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "top_logprobs": "top_logprobs",
}


def to_chat(req: ResponsesRequest) -> ChatRequest:
    """The chat request that answers ``req``; 400s name the Responses field."""
    body = {
        "model": req.model,
        "messages": input_messages(req),
        "stream": bool(req.stream),
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_completion_tokens": req.max_output_tokens,
        "tools": chat_tools(req),
        "tool_choice": chat_tool_choice(req),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": chat_format(req),
        "user": req.user,
        "logprobs": req.logprobs or None,
        "top_logprobs": req.top_logprobs if req.logprobs else None,
    }
    try:
        return ChatRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        param = CHAT_TO_RESPONSES.get(loc[0], loc[0]) if loc else None
        raise ApiError(
            400, f"{param}: {err['msg']}" if param else err["msg"], param=param, code="invalid_value"
        ) from None
