"""OpenAI request bodies, validated strictly: wrong types are 400s, not silent coercions.

Fields OpenAI defines that we do not implement (``n > 1``, ``logprobs``, ``tools``, penalties)
are refused with a 400 naming them rather than ignored. Unknown extra fields are ignored, as
OpenAI-compatible servers (vLLM) do, so newer clients keep working.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from router.errors import ApiError

Number = Annotated[float, Field(strict=False)]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
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


class Message(Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


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
    n: StrictInt = Field(1, ge=1, le=1, description="only n=1 is supported")
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0, description="not supported (must be 0)")
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0, description="not supported (must be 0)")
    logprobs: StrictBool | StrictInt | None = Field(None, description="not supported")
    user: Text | None = None
    ignore_eos: StrictBool = False

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _number(cls, v):
        if isinstance(v, bool) or (v is not None and not isinstance(v, (int, float))):
            raise ValueError("must be a number")
        return float(v) if v is not None else v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(Sampling):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tool calling is not supported")
        return v


class CompletionRequest(Sampling):
    prompt: Text | list[Text] | list[StrictInt]
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, str):
            if not v:
                raise ValueError("prompt must not be empty")
            return v
        if not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v[0], str):
            if len(v) != 1 or not v[0]:
                raise ValueError("exactly one non-empty prompt string is supported")
            return v[0]
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v


def parse(model: type[Body], data: object) -> Body:
    """Validate ``data`` against ``model``; raises a 400 :class:`ApiError` naming the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]
                         if isinstance(p, int) or (FIELD.fullmatch(p) and p not in TYPE_TAGS)) or None
        raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param,
                       code="invalid_value") from None
