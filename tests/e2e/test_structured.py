"""Structured output and tool calls end to end: the real model on the shared deployment, real
HTTP, the ``openai`` SDK as the client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field

from router.structured import MAX_SCHEMA_BYTES
from tests.helpers.deployment import MODEL


class Company(BaseModel):
    name: str = Field(max_length=30)
    city: str = Field(max_length=20)


class Assignee(BaseModel):
    team: str = Field(max_length=12)
    owner: str = Field(max_length=12)


class Extraction(BaseModel):
    title: str = Field(max_length=40)
    keywords: list[str] = Field(max_length=3)
    company: Company


DOCS = [
    "Acme Corp of Berlin reported record revenue in Q3 thanks to strong cloud sales.",
    "Globex, based in Lyon, is hiring 200 engineers for its new battery plant.",
    "Initech from Austin paused all hiring after churn rose for two quarters.",
    "Umbrella Ltd (London) recalled a vaccine batch after a safety review.",
    "Stark Industries in Malibu unveiled a lighter armour suit at its annual expo.",
]


def parse_fn(client: OpenAI):
    beta = getattr(getattr(client, "beta", None), "chat", None)
    return (
        beta.completions.parse
        if beta is not None and hasattr(beta.completions, "parse")
        else client.chat.completions.parse
    )


def extract_messages(doc: str) -> list[dict]:
    return [
        {"role": "system", "content": "Extract the title, up to 3 keywords and the company as JSON."},
        {"role": "user", "content": doc},
    ]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 11)])
def test_sdk_parse_returns_an_object_and_stream_equals_non_stream(client, temperature, seed):
    parse = parse_fn(client)

    def one(doc: str) -> None:
        kw = {"model": MODEL, "messages": extract_messages(doc), "temperature": temperature, "max_tokens": 200}
        if seed is not None:
            kw["seed"] = seed
        reply = parse(response_format=Extraction, **kw)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Extraction)
        assert choice.message.refusal is None
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                stream=True,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "Extraction", "schema": Extraction.model_json_schema(), "strict": True},
                },
                **kw,
            )
            if c.choices
        )
        assert streamed == choice.message.content

    with ThreadPoolExecutor(len(DOCS)) as pool:
        list(pool.map(one, DOCS))  # re-raises the first failure


class Ticket(BaseModel):
    """Fields in an order that is not the alphabetical one (nor is ``Assignee``'s)."""

    reasoning: str = Field(max_length=40)
    priority: Literal["low", "high"]
    answer: str = Field(max_length=20)
    assignee: Assignee


def keys_in_order(content: str) -> tuple[list[str], list[str]]:
    """The keys of the generated object and of its ``assignee``, in the order they were written."""
    obj = json.loads(content)
    return list(obj), list(obj["assignee"])


@pytest.mark.timeout(600)  # five constrained generations, on a shared CPU
def test_keys_follow_the_schemas_order_not_the_alphabet(client):
    """OpenAI's structured outputs follow the schema's key order (a ``reasoning`` field placed
    before ``answer`` is written first): chat's ``parse`` with a Pydantic model, its stream,
    Responses' ``text.format`` and a forced tool call's arguments."""
    order = (["reasoning", "priority", "answer", "assignee"], ["team", "owner"])
    assert sorted(order[0]) != order[0] and sorted(order[1]) != order[1]
    messages = [{"role": "user", "content": "The login page is down for everyone. File a support ticket as JSON."}]
    kw = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 200}
    reply = parse_fn(client)(response_format=Ticket, **kw).choices[0]
    assert reply.finish_reason == "stop" and isinstance(reply.message.parsed, Ticket)
    assert keys_in_order(reply.message.content) == order
    with client.chat.completions.stream(response_format=Ticket, **kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert isinstance(final.message.parsed, Ticket) and keys_in_order(final.message.content) == order
    answer = client.responses.parse(
        model=MODEL, input=messages, text_format=Ticket, temperature=0, max_output_tokens=200
    )
    assert isinstance(answer.output_parsed, Ticket) and keys_in_order(answer.output_text) == order
    tool = {"type": "function", "function": {"name": "file_ticket", "parameters": Ticket.model_json_schema()}}
    call = client.chat.completions.create(tools=[tool], tool_choice="required", **kw).choices[0].message.tool_calls[0]
    assert keys_in_order(call.function.arguments) == order


def test_schema_at_response_format_schema_is_accepted(deployment):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    r = deployment.chat("What is 2 + 3?", max_tokens=30, response_format={"type": "json_schema", "schema": schema})
    assert r.status_code == 200, r.text
    body = r.json()["choices"][0]
    assert body["finish_reason"] == "stop" and isinstance(json.loads(body["message"]["content"])["answer"], int)


def test_json_object_always_parses_and_a_cut_is_length(client):
    def one(seed: int):
        return client.chat.completions.create(
            model=MODEL,
            temperature=0.8,
            seed=seed,
            max_tokens=120,
            response_format={"type": "json_object"},
            messages=[
                {"role": "user", "content": f"Describe fruit number {seed} as a JSON object with a name and a colour."}
            ],
        )

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(50)))
    stopped = [r.choices[0] for r in replies if r.choices[0].finish_reason == "stop"]
    assert len(stopped) >= 40, [r.choices[0].finish_reason for r in replies]
    for c in stopped:
        assert isinstance(json.loads(c.message.content), dict)
    cut = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=3,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
    )
    assert cut.choices[0].finish_reason == "length"


def deep(n: int) -> str:
    """A schema nested ``n`` levels deep, as JSON text (too deep for ``json.dumps``)."""
    return '{"type":"object","properties":{"a":' * n + '{"type":"string"}' + "}}" * n


HOSTILE = {
    "not-a-schema": {"type": "object", "properties": {"foo": "bar"}},
    "self-ref": {"$ref": "#"},
    "5000-deep": deep(5000),
    "100-deep": json.loads(deep(100)),
    "min-items": {"type": "array", "items": {"type": "integer"}, "minItems": 100000000},
    "bad-pattern": {"type": "string", "pattern": "foo**"},
    "megabyte": {
        "type": "object",
        "properties": {
            f"p{i}": {"type": "string", "description": "x" * 1000} for i in range(MAX_SCHEMA_BYTES // 1000 + 1000)
        },
    },
}


def test_hostile_schemas_are_400_and_the_workers_keep_serving(deployment):
    restarts = {w["id"]: w["restarts"] for w in deployment.workers()}
    for name, schema in HOSTILE.items():
        text = schema if isinstance(schema, str) else json.dumps(schema)
        body = (
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 5, '
            f'"response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": {text}}}}}}}'
        )
        r = httpx.post(
            f"{deployment.base_url}/chat/completions",
            content=body,
            timeout=60,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400, (name, r.text[:300])
        assert r.json()["error"]["param"] == "response_format", (name, r.json())
    r = deployment.chat("Say hi.", max_tokens=5, response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
    assert {w["id"]: w["restarts"] for w in deployment.workers()} == restarts
    assert deployment.chat("hi", response_format={"type": "yaml"}).json()["error"]["param"] == "response_format"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_plain_and_streamed(client, choice):
    kw = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER, ADD],
        "tool_choice": choice,
        "temperature": 0,
        "max_tokens": 80,
    }
    reply = client.chat.completions.create(**kw)
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema)

    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    scall = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls"
    assert (scall.function.name, json.loads(scall.function.arguments)) == (
        call.function.name,
        json.loads(call.function.arguments),
    )

    raw = [ch for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    deltas = [tc for ch in raw for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == call.function.name and deltas[0].index == 0
    assert all(d.id is None and d.function.name is None for d in deltas[1:])


def test_a_follow_up_turn_with_a_tool_message(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=40
    )
    c = second.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls


def test_auto_and_none_tool_choice_answer(client):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello."}],
            tools=[WEATHER],
            tool_choice=choice,
            temperature=0,
            max_tokens=20,
        )
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls")
        if c.finish_reason == "tool_calls":
            assert choice == "auto" and c.message.tool_calls[0].function.name == "get_weather"


def test_unsupported_fields_are_400_naming_them(client):
    for field, value in (("functions", [{"name": "f"}]), ("audio", {"voice": "alloy"})):
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, extra_body={field: value})
        assert e.value.body["param"] == field
