"""OpenAI's published contract for the Responses API, for the tests: the response and stream-event
schemas from OpenAI's OpenAPI document (``responses.json``, made by
``scripts/openai_responses_schema.py``) and the ``openai`` SDK's pydantic types.

The SDK's client builds its objects without validation (``construct``), so a missing field would
pass unnoticed there; :func:`check_response` and :func:`check_event` validate with
``model_validate`` (every field the SDK annotates as required must be present, at every level)
and against the published JSON schema (every field the document marks required, ``null`` where
allowed, enums, types)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

SCHEMA = Path(__file__).with_name("responses.json")


@functools.cache
def _document() -> dict:
    return json.loads(SCHEMA.read_text())


@functools.cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    doc = _document()
    return jsonschema.Draft202012Validator({**doc, "$ref": f"#/components/schemas/{name}"})


@functools.cache
def _event_schemas() -> dict[str, str]:
    """Event ``type`` -> the name of its schema in the document."""
    out = {}
    schemas = _document()["components"]["schemas"]
    for option in schemas["ResponseStreamEvent"]["anyOf"]:
        name = option["$ref"].rsplit("/", 1)[-1]
        kind = schemas[name]["properties"]["type"]
        out[kind.get("const") or kind["enum"][0]] = name
    return out


def _schema_errors(name: str, obj: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in _validator(name).iter_errors(obj)]


def check_response(obj: dict) -> Response:
    """``obj`` (a ``response`` object as sent) against the document and the SDK; returns the SDK object."""
    errors = _schema_errors("Response", obj)
    assert not errors, errors
    return Response.model_validate(obj)


def check_event(obj: dict, event_line: str | None = None) -> object:
    """One stream event (its JSON, and the ``event:`` line it came with) against the document and the
    SDK; also: no top-level ``error`` key but on ``error`` events' own fields (openai-java throws)."""
    kind = obj.get("type")
    assert event_line is None or event_line == kind, (event_line, kind)
    assert "error" not in obj, obj  # openai-java's SSE reader throws on any top-level "error", even null
    assert kind in _event_schemas(), kind
    errors = _schema_errors(_event_schemas()[kind], obj)
    assert not errors, (kind, errors)
    event = TypeAdapter(ResponseStreamEvent).validate_python(obj)
    assert event.type == kind
    if hasattr(event, "response"):
        check_response(obj["response"])
    return event
