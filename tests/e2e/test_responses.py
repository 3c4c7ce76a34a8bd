"""The Responses API end to end: the real model on the shared deployment, real HTTP, the ``openai``
SDK as the client, and raw bodies as openai-java and LangChain4j send them. Every response and
every stream event is checked against OpenAI's published schema and the SDK's types
(tests/openai_schema)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError
from pydantic import BaseModel, Field

from tests.helpers.deployment import MODEL
from tests.openai_schema import check_event, check_response

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
QUESTION = "What is the capital of France?"
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def post(deployment, body: dict) -> httpx.Response:
    return httpx.post(f"{deployment.base_url}/responses", json=body, timeout=300)


def create(deployment, body: dict) -> dict:
    """A non-streamed response, as sent, checked against the schema and the SDK."""
    got = post(deployment, body)
    assert got.status_code == 200, got.text
    answer = got.json()
    check_response(answer)
    return answer


def stream(deployment, body: dict) -> list[dict]:
    """Every event of a streamed response, as sent, each checked (``event:`` line = ``type``,
    ``sequence_number`` counting from 0, schema, SDK types)."""
    events, kind = [], None
    with httpx.stream("POST", f"{deployment.base_url}/responses", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                check_event(event, kind)
                assert event["sequence_number"] == len(events)
                events.append(event)
                kind = None
    return events


def collapsed(kinds: list[str]) -> list[str]:
    """Event types with runs of the same type collapsed to one."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def test_a_string_input(client):
    reply = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=30)
    assert reply.object == "response" and reply.status == "completed"
    assert "Paris" in reply.output_text
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens > 0
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.usage.output_tokens_details.reasoning_tokens == 0


def test_message_items_and_instructions_as_sent(deployment):
    answer = create(
        deployment,
        {
            "model": MODEL,
            "instructions": "You are a geography teacher. Answer in one sentence.",
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
            ],
            "temperature": 0,
            "max_output_tokens": 40,
            "metadata": {"ticket": "42"},
            "store": False,
        },
    )
    message = answer["output"][0]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"][0]["annotations"] == [] and message["content"][0]["text"].strip()
    assert answer["instructions"].startswith("You are a geography teacher")
    assert answer["metadata"] == {"ticket": "42"} and answer["temperature"] == 0
    assert answer["tools"] == [] and answer["tool_choice"] == "auto" and answer["parallel_tool_calls"] is True


def test_the_stream_follows_the_documented_order_and_equals_the_whole_answer(deployment, client):
    body = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 40}
    whole = create(deployment, body)
    events = stream(deployment, body)
    assert collapsed([e["type"] for e in events]) == TEXT_EVENTS
    final = events[-1]["response"]
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert final["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == whole["output"][0]["content"][0]["text"]
    item_id = events[2]["item"]["id"]
    assert {e["item_id"] for e in events if "item_id" in e} == {item_id} == {final["output"][0]["id"]}
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1

    with client.responses.stream(**body) as sdk_stream:
        for _ in sdk_stream:
            pass
        got = sdk_stream.get_final_response()
    assert got.output_text == whole["output"][0]["content"][0]["text"]


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


def test_parse_returns_a_parsed_object(client):
    reply = client.responses.parse(
        model=MODEL,
        input="Paris is the capital of France. Extract the city and its country.",
        text_format=City,
        temperature=0,
        max_output_tokens=60,
    )
    assert isinstance(reply.output_parsed, City) and reply.output_parsed.name


def test_a_required_tool_call_and_the_conversation_after_it(deployment):
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    first = create(
        deployment,
        {"model": MODEL, "input": [ask], "tools": [WEATHER], "tool_choice": "required", "temperature": 0},
    )
    assert [i["type"] for i in first["output"]] == ["function_call"]
    call = first["output"][0]
    assert call["name"] == "get_weather" and call["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])
    assert first["status"] == "completed" and first["tool_choice"] == "required"

    second = create(
        deployment,
        {
            "model": MODEL,
            "input": [ask, call, {"type": "function_call_output", "call_id": call["call_id"], "output": "18 C, sunny"}],
            "tools": [WEATHER],
            "temperature": 0,
            "max_output_tokens": 60,
        },
    )
    assert second["status"] in ("completed", "incomplete") and second["output"]


def test_a_streamed_tool_call(deployment):
    body = {
        "model": MODEL,
        "input": "What is the weather in Berlin?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0,
    }
    events = stream(deployment, body)
    kinds = collapsed([e["type"] for e in events])
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = events[2]["item"]
    fragments = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(fragments) > 1  # the arguments stream as they are generated, not at the end
    args = "".join(fragments)
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["item_id"] == added["id"] and done["arguments"] == args and done["name"] == "get_weather"
    final = events[-1]["response"]["output"][0]
    assert final["id"] == added["id"] and final["call_id"] == added["call_id"] and final["arguments"] == args
    jsonschema.validate(json.loads(args), WEATHER["parameters"])


def test_max_output_tokens_makes_an_incomplete_response(deployment):
    body = {"model": MODEL, "input": "Tell me a long story about a dragon.", "max_output_tokens": 5}
    answer = create(deployment, body)
    assert answer["status"] == "incomplete" and answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer["usage"]["output_tokens"] == 5 and answer["output"][0]["status"] == "incomplete"
    events = stream(deployment, body)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_logprobs_when_included(deployment):
    body = {
        "model": MODEL,
        "input": QUESTION,
        "temperature": 0,
        "max_output_tokens": 5,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    part = create(deployment, body)["output"][0]["content"][0]
    assert len(part["logprobs"]) == 5 and all(len(lp["top_logprobs"]) == 2 for lp in part["logprobs"])
    assert "".join(lp["token"] for lp in part["logprobs"]) == part["text"]
    deltas = [e for e in stream(deployment, body) if e["type"] == "response.output_text.delta"]
    assert sum(len(e["logprobs"]) for e in deltas) == 5


def test_cached_tokens_count_prefix_cache_hits(deployment):
    document = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(12))
    body = {"model": MODEL, "input": f"{document}\nHow many lines?", "temperature": 0, "max_output_tokens": 3}
    create(deployment, body)
    again = create(deployment, body)
    assert again["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert again["usage"]["input_tokens_details"]["cached_tokens"] <= again["usage"]["input_tokens"]
    chat = httpx.post(
        f"{deployment.base_url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": body["input"]}], "max_tokens": 3},
        timeout=300,
    ).json()
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": QUESTION, "previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": QUESTION, "conversation": {"id": "conv_1"}}, "conversation"),
        ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": QUESTION, "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is in this image?"},
                            {"type": "input_image", "image_url": "https://example.com/cat.png", "detail": "auto"},
                        ],
                    }
                ]
            },
            "input[0].content[1]",
        ),
        ({"input": 42}, "input"),
        ({"input": [{"type": "message", "content": "no role"}]}, "input[0].role"),
        ({}, "input"),
    ],
)
def test_refused_fields_are_400s_naming_them_and_the_worker_keeps_serving(deployment, client, body, param):
    got = post(deployment, {"model": MODEL, **body})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param and got.json()["error"]["type"] == "invalid_request_error"
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=3).status in ("completed", "incomplete")


def test_an_unknown_model_is_a_404(deployment):
    got = post(deployment, {"model": "gpt-4o", "input": "Hi"})
    assert got.status_code == 404 and got.json()["error"]["param"] == "model"


def test_metrics_and_openapi_cover_the_endpoint(deployment, client):
    client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    metrics = httpx.get(f"{deployment.base_url.removesuffix('/v1')}/metrics", timeout=30).text
    assert 'endpoint="/v1/responses",method="POST",status="200"' in metrics
    assert 'llamadeploy_e2e_request_latency_seconds_count{endpoint="/v1/responses"}' in metrics
    doc = httpx.get(f"{deployment.base_url.removesuffix('/v1')}/openapi.json", timeout=30).json()
    assert "/v1/responses" in doc["paths"] and "ResponsesRequest" in doc["components"]["schemas"]


def test_the_sdk_sees_a_bad_request_naming_previous_response_id(client):
    with pytest.raises(BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    assert info.value.param == "previous_response_id"


def test_max_output_tokens_is_an_upper_bound_cut_to_the_context_left(deployment, client):
    """openai-java's function-calling example sends ``max_output_tokens: 2048``: with a context of
    2048 that is no 400, and the answer stops where the context ends at the latest (``incomplete``
    for ``max_output_tokens`` when it gets there; tests/unit/test_responses.py pins the cut).
    Chat's ``max_tokens`` keeps OpenAI's 400 for what cannot fit."""
    context = deployment.config["model"]["max_model_len"]
    ask = "\n\nIgnore the apples above. Continue this list, one number after another: 1, 2, 3, 4, 5, 6,"
    probe = client.responses.create(model=MODEL, input="apple " * 100 + ask, max_output_tokens=1)
    words = 100 + (context - 3) - probe.usage.input_tokens  # " apple" is one token: ~3 tokens left
    text = "apple " * words + ask
    answer = client.responses.create(model=MODEL, input=text, max_output_tokens=context, temperature=0)
    left = context - answer.usage.input_tokens
    assert 0 < left <= 8, answer.usage
    assert answer.usage.output_tokens <= left and answer.max_output_tokens == context
    if answer.usage.output_tokens == left:  # cut where the context ends (the model may stop first)
        assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    streamed = stream(deployment, {"model": MODEL, "input": text, "max_output_tokens": context, "temperature": 0})
    assert streamed[-1]["type"] in ("response.completed", "response.incomplete")
    assert streamed[-1]["response"]["usage"]["output_tokens"] <= left
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=context)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
