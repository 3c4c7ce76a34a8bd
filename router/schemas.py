"""OpenAI request bodies, validated strictly: wrong types are 400s, not silent coercions.

Fields OpenAI defines that we do not implement (``suffix``, ``best_of > 1``, the legacy
``functions``/``function_call``, non-text ``modalities``, ``audio``, ``prediction``,
``web_search_options``) are refused with a 400 naming them rather than ignored. Unknown extra
fields are ignored, as OpenAI-compatible servers (vLLM) do, so newer clients keep working.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from router.errors import ApiError

Number = Annotated[float, Field(strict=False)]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # vLLM's request priority
ServiceTier = Literal["auto", "default", "flex", "priority"]  # OpenAI's service_tier (router.tiers)
FIELD = re.compile(r"[a-z_]+")  # a field name in an error location (union members look like "list[int]")
TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _unicode(v: str) -> str:
    """JSON escapes can smuggle lone surrogates (``"\\ud800"``) that no tokenizer can encode."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it contains a lone surrogate)") from None
    return v


Text = Annotated[StrictStr, AfterValidator(_unicode)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(Body):
    type: Literal["text"]
    text: Text


class FunctionCall(Body):
    name: Text
    arguments: Text  # JSON, as a string (OpenAI's shape)


class ToolCall(Body):
    """An assistant message's earlier tool call, in the history."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: Text | None = None  # tool messages: the call this answers

    @model_validator(mode="after")
    def _tool_answers_a_call(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message must name the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDef(Body):
    name: Annotated[StrictStr, Field(pattern=FUNCTION_NAME)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; checked by router.structured
    strict: StrictBool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Body):
    name: Annotated[StrictStr, Field(pattern=FUNCTION_NAME)]


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Body):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: Text = "response"
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Body):
    """``text``; ``json_object`` (any JSON object); ``json_schema`` (the schema at
    ``json_schema.schema``, or at ``schema`` as some clients send it)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    def schema_and_strict(self) -> tuple[dict[str, Any] | None, bool]:
        js = self.json_schema
        schema = js.schema_ if js is not None and js.schema_ is not None else self.schema_
        return schema, bool(js.strict) if js is not None and js.strict is not None else False


MAX_N = 16  # choices per request
MAX_LOGIT_BIAS = 1024  # entries in logit_bias


class StreamOptions(Body):
    include_usage: StrictBool = False


class Sampling(Body):
    model: Text | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0, le=2**31 - 1)
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N, description=f"choices, at most {MAX_N}")

    @field_validator("n", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, v, info):
        """An explicit ``null`` means the default, as in OpenAI's API (Jackson-serialised Java clients send it)."""
        return cls.model_fields[info.field_name].default if v is None else v

    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0, description="HF semantics; 1 = off")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> -100..100")
    min_tokens: StrictInt | None = Field(None, ge=0)
    user: Text | None = None
    ignore_eos: StrictBool = False
    service_tier: ServiceTier | None = None
    priority: StrictInt = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX, description="vLLM's: lower is served first")

    @field_validator(
        "temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", mode="before"
    )
    @classmethod
    def _number(cls, v):
        if isinstance(v, bool) or (v is not None and not isinstance(v, (int, float))):
            raise ValueError("must be a number")
        return float(v) if v is not None else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        if not isinstance(v, dict):
            raise ValueError("must be an object of token id -> bias")
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        out = {}
        for k, b in v.items():
            if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 10):
                raise ValueError(f"keys must be token ids (got {str(k)[:20]!r})")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise ValueError("values must be numbers in [-100, 100]")
            out[k] = float(b)
        return out

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _refuse(what: str):
    def check(cls, v):
        if v is not None:
            raise ValueError(f"{what} is not supported")
        return v

    return check


class ChatRequest(Sampling):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @field_validator("parallel_tool_calls", mode="before")
    @classmethod
    def _null_is_true(cls, v):
        return True if v is None else v

    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    functions: Any = Field(None, description="not supported: use tools")
    function_call: Any = Field(None, description="not supported: use tool_choice")
    audio: Any = Field(None, description="not supported")
    prediction: Any = Field(None, description="not supported")
    web_search_options: Any = Field(None, description="not supported")
    modalities: list[Literal["text"]] | None = None

    _functions = field_validator("functions")(classmethod(_refuse("functions (legacy; use tools)")))
    _function_call = field_validator("function_call")(classmethod(_refuse("function_call (legacy; use tool_choice)")))
    _audio = field_validator("audio")(classmethod(_refuse("audio output")))
    _prediction = field_validator("prediction")(classmethod(_refuse("prediction")))
    _web = field_validator("web_search_options")(classmethod(_refuse("web_search_options")))

    @field_validator("response_format", mode="before")
    @classmethod
    def _format(cls, v):
        """Every problem is reported as ``param: "response_format"``, whatever part is wrong."""
        if v is None:
            return v
        if not isinstance(v, dict):
            raise ValueError("must be an object with a type")
        if v.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type must be text, json_object or json_schema (got {str(v.get('type'))[:40]!r})")
        try:
            fmt = ResponseFormat.model_validate(v)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"{where}: {err['msg']}" if where else err["msg"]) from None
        if fmt.type == "json_schema" and fmt.schema_and_strict()[0] is None:
            raise ValueError("json_schema needs json_schema.schema (a JSON schema object)")
        return fmt

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v, info: ValidationInfo):
        if v is not None and v != "none" and not info.data.get("tools"):
            raise ValueError("tool_choice needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in {t.function.name for t in info.data["tools"]}:
            raise ValueError(f"tool_choice names {v.function.name!r}, which is not in tools")
        return v


MAX_PROMPTS = 64  # prompts × n of one completions request (each is a generation of its own)


class CompletionRequest(Sampling):
    """``prompt`` is normalised to a list of prompts, each a string or token ids (OpenAI takes a
    string, a list of strings, token ids or a list of token-id lists). ``max_tokens: 0`` is allowed
    with ``echo`` only (the prompt alone, scored: :mod:`router.echo`)."""

    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(None, ge=0, description="0: with echo, the prompt alone")
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    suffix: Text | None = None
    best_of: StrictInt | None = Field(None, ge=1, le=1, description="only 1 (n > 1 gives several choices)")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            v = [v]
        if not v or any(not p for p in v):
            raise ValueError("prompt must not be empty")
        if len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts")
        return v

    @model_validator(mode="after")
    def _bounded(self):
        if len(self.prompt) * self.n > MAX_PROMPTS:
            raise ValueError(f"n: {len(self.prompt)} prompts × n={self.n} is over {MAX_PROMPTS} choices")
        return self


def parse(model: type[Body], data: object) -> Body:
    """Validate ``data`` against ``model``; raises a 400 :class:`ApiError` naming the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = (
            ".".join(str(p) for p in err["loc"] if isinstance(p, int) or (FIELD.fullmatch(p) and p not in TYPE_TAGS))
            or None
        )
        raise ApiError(
            400, f"{param}: {err['msg']}" if param else err["msg"], param=param, code="invalid_value"
        ) from None
