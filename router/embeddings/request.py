"""An embeddings request body, checked field by field with OpenAI's error shape.

``input`` takes OpenAI's four forms: a string, an array of strings, an array of token ids (one
input), or an array of token-id arrays; 1 to :data:`MAX_INPUTS` inputs, none empty. Token ids are
used as given (no special tokens added). ``encoding_format`` is ``float`` (default) or ``base64``;
``dimensions`` a positive integer (whether the model allows it is :mod:`router.embeddings.api`'s
call); ``user`` is accepted and only logged; ``truncate`` (ours, default false) cuts an input over
the model's limit instead of refusing it; ``stream: true`` is refused (the answer is one body).
Unknown fields are ignored, as for chat.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt

from router.errors import ApiError
from router.schemas import Body, Text

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


class EmbeddingRequest(Body):
    """An OpenAI embeddings request (`POST /v1/embeddings`)."""

    model: Text | None = None
    input: Any = Field(
        None,
        description="a string, an array of strings, an array of token ids, or an array of token-id arrays "
        f"(1 to {MAX_INPUTS} inputs, none empty)",
    )
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: StrictInt | None = Field(None, ge=1)
    user: Text | None = None
    truncate: StrictBool = Field(False, description="cut an input over the model's token limit instead of a 400")
    stream: StrictBool | None = Field(None, description="false or absent: embeddings are answered in one piece")


def refuse_stream(req: EmbeddingRequest) -> None:
    """A 400 for ``stream: true``: the answer is one JSON body, never Server-Sent Events, and a
    client that asked for a stream would not read it."""
    if req.stream:
        raise ApiError(
            400,
            "stream: /v1/embeddings does not stream; its answer is one JSON body (send stream: false or leave it out)",
            param="stream",
            code="invalid_value",
        )


def bad_input(message: str) -> ApiError:
    return ApiError(400, message, param="input", code="invalid_value")


def _kind(value: Any) -> str:
    """JSON's name for ``value``'s type, for error messages."""
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    names = {str: "a string", int: "an integer", float: "a number", list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def split_input(raw: Any) -> list[str] | list[list[int]]:
    """``input`` as a list of texts or a list of token-id lists; a 400 naming the problem (and the
    index) for anything else."""
    if isinstance(raw, str):
        if not raw:
            raise bad_input("input must not be an empty string")
        return _texts([raw])  # the same Unicode check as an array's texts
    if not isinstance(raw, list):
        raise bad_input(
            f"input must be a string, an array of strings, an array of token ids or an array of token-id "
            f"arrays, not {_kind(raw)}"
        )
    if not raw:
        raise bad_input("input must not be an empty array")
    first = raw[0]
    if _is_id(first):
        return [_ids(raw, "input")]  # one input: its length is tokens, bounded by the model's limit
    if len(raw) > MAX_INPUTS:
        raise bad_input(f"input has {len(raw)} items, over the limit of {MAX_INPUTS}")
    if isinstance(first, str):
        return _texts(raw)
    if isinstance(first, list):
        return [
            _ids(item, f"input[{i}]") if isinstance(item, list) else _mixed(i, item, "a token-id array")
            for i, item in enumerate(raw)
        ]
    raise bad_input(f"input[0] is {_kind(first)}: expected a string, a token id or a token-id array")


def _mixed(index: int, item: Any, expected: str):
    raise bad_input(f"input[{index}] is {_kind(item)}, expected {expected} like input[0] (inputs of one kind)")


def _texts(raw: list) -> list[str]:
    for i, item in enumerate(raw):
        if not isinstance(item, str):
            _mixed(i, item, "a string")
        if not item:
            raise bad_input(f"input[{i}] is an empty string")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_input(f"input[{i}] is not valid Unicode text (it contains a lone surrogate)") from None
    return raw


def _ids(items: list, where: str) -> list[int]:
    if not items:
        raise bad_input(f"{where} is an empty token-id array")
    for j, t in enumerate(items):
        if not _is_id(t):
            raise bad_input(f"{where}[{j}] is {_kind(t)}, expected a token id (an integer)")
    return items
