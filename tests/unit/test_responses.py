"""The Responses API's pure parts: request validation and translation to a chat request, output
items and events from chat chunks, the response object, all checked against OpenAI's published
schema and the ``openai`` SDK's types (tests/openai_schema)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.app import error_middleware
from router.errors import ApiError
from router.responses.output import OutputBuilder
from router.responses.request import ResponsesRequest, input_messages, refuse_stateful, to_chat
from router.responses.shaping import ResponseShaper
from router.responses.stream import stream_response
from router.schemas import parse
from router.shaping import Choice
from router.tools import tool_mode
from tests.openai_schema import check_event, check_response
from worker.contract.protocol import Tokens, Usage

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def request(**body) -> ResponsesRequest:
    req = parse(ResponsesRequest, {"model": "m", **body})
    refuse_stateful(req)
    return req


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        to_chat(request(**body))
    assert info.value.status == 400
    return info.value


def test_a_string_input_with_instructions_is_a_system_and_a_user_turn():
    chat = to_chat(request(input="Hi", instructions="Be brief."))
    assert [(m.role, m.text()) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]


def test_lenient_items_as_langchain4j_and_openai_java_send_them():
    items = [
        {"role": "developer", "content": "Answer in French."},  # no "type" (openai-java EasyInputMessage)
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"},
        {"type": "reasoning", "summary": []},
    ]
    messages = input_messages(request(input=items))
    assert messages == [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    chat = to_chat(request(input=items, tools=[WEATHER]))  # tools without "strict"
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.strict is None


def test_a_function_call_without_a_text_turn_makes_its_own_assistant_turn():
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "id": "fc_1", "status": "completed", "call_id": "c", "name": "f", "arguments": "{}"},
    ]
    assert input_messages(request(input=items))[1]["content"] is None


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [WEATHER, {"type": "code_interpreter"}]}, "tools[1].type"),
        ({"input": "x", "tool_choice": {"type": "file_search"}, "tools": [WEATHER]}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [42]}, "input[0]"),
        ({"input": []}, "input"),
    ],
)
def test_refusals_name_the_field(body, param):
    err = None
    try:
        to_chat(request(**body))
    except ApiError as exc:
        err = exc
    assert err is not None and err.status == 400 and err.param == param, err and err.message
    assert param.split("[")[0] in err.message


def test_a_malformed_input_is_a_400_naming_input():
    with pytest.raises(ApiError) as info:
        request(input=42)
    assert info.value.param == "input"


def test_tool_choice_and_text_format_translate():
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": {}}
    chat = to_chat(
        request(
            input="x",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
            max_output_tokens=20,
        )
    )
    assert chat.tool_choice.function.name == "get_weather"
    assert chat.response_format.schema_and_strict() == (schema, True)
    assert chat.max_completion_tokens == 20
    assert to_chat(request(input="x", tool_choice="auto")).tool_choice is None  # no tools: the same answer


@pytest.mark.parametrize("choice", [{"type": "function"}, {"type": "function", "name": 5}])
def test_a_function_tool_choice_without_a_name_is_a_400_naming_it(choice):
    """Not chat's "should be 'none', 'auto' or 'required'", which hides what is missing."""
    with pytest.raises(ApiError) as info:
        to_chat(request(input="x", tools=[WEATHER], tool_choice=choice))
    assert (info.value.status, info.value.param) == (400, "tool_choice.name")


def finished(text: str, finish: str = "stop") -> Tokens:
    return Tokens(
        request_id="r",
        text_delta=text,
        token_ids=[1],
        finish_reason=finish,
        usage=Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8, cached_tokens=2),
    )


def build(req: ResponsesRequest, parts: list[Tokens]):
    chat = to_chat(req)
    choice, out = Choice(0, True, tool_mode(chat), None, None), OutputBuilder()
    events = [e for tok in parts for e in out.feed(choice.feed(tok))]
    shaper = ResponseShaper(req, chat, "m")
    return events, shaper.finished(choice, out.items, 5)


def numbered(events: list[dict]) -> list[dict]:
    return [{"type": e["type"], "sequence_number": i, **e} for i, e in enumerate(events)]


def test_text_events_in_order_and_the_response_validates():
    parts = [Tokens(request_id="r", text_delta=t, token_ids=[1]) for t in ("The ", "sky")] + [finished(" is blue.")]
    events, response = build(request(input="Sky?"), parts)
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    for e in numbered(events):
        check_event(e)
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    sdk = check_response(response)
    assert sdk.output_text == "The sky is blue." and response["status"] == "completed"
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 2
    assert response["usage"]["total_tokens"] == 8


def test_a_cut_answer_is_incomplete():
    _, response = build(request(input="x", max_output_tokens=3), [finished("abc", "length")])
    check_response(response)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"


def test_an_empty_answer_is_one_empty_message():
    events, response = build(request(input="x"), [finished("")])
    for e in numbered(events):
        check_event(e)
    assert check_response(response).output_text == ""


def test_a_forced_call_streams_as_a_function_call_item():
    req = request(input="Weather in Paris?", tools=[WEATHER], tool_choice="required")
    text = ['{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}', "}"]
    parts = [Tokens(request_id="r", text_delta=t, token_ids=[1]) for t in text[:-1]] + [finished(text[-1])]
    events, response = build(req, parts)
    for e in numbered(events):
        check_event(e)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.output_item.added" and kinds[-2:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    item = check_response(response).output[0]
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.arguments == '{"city": "Paris"}' and item.call_id.startswith("call_")
    assert {e["item_id"] for e in events if "item_id" in e} == {response["output"][0]["id"]}


def test_whitespace_before_an_auto_tool_call_makes_no_message():
    req = request(input="Weather in Paris?", tools=[WEATHER])
    _, response = build(
        req, [finished('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')]
    )
    assert [i["type"] for i in response["output"]] == ["function_call"]
    check_response(response)


def stream_through(tokens: list[Tokens], failure: ApiError | None, status: int = 200) -> list[tuple[str, dict]]:
    """Run :func:`stream_response` behind a real aiohttp server (in this process, with the router's
    error middleware) with these worker events, then ``failure`` raised as the relay raises a lost
    worker or a timeout; checks the HTTP status and returns every ``(event line, data)`` sent (or
    the error body as one pair)."""
    req = request(input="x")
    chat = to_chat(req)

    async def events():
        for tok in tokens:
            yield tok
        if failure is not None:
            raise failure

    async def handler(http: web.Request) -> web.StreamResponse:
        choice = Choice(0, True, None, None, None)
        return await stream_response(http, ResponseShaper(req, chat, "m"), choice, events(), 30, 5)

    async def main() -> str:
        app = web.Application(middlewares=[error_middleware()])
        app.router.add_post("/", handler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/")
            assert resp.status == status
            return await resp.text()

    text = asyncio.run(main())
    if status != 200:
        return [("", json.loads(text))]
    out, kind = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: "):
            out.append((kind, json.loads(line[len("data: ") :])))
    return out


def test_a_stream_numbers_its_events_and_ends_with_the_whole_response():
    sent = stream_through([Tokens(request_id="r", text_delta="Hi", token_ids=[1]), finished(" there")], None)
    for i, (kind, data) in enumerate(sent):
        check_event(data, kind)
        assert data["sequence_number"] == i
    assert [d["type"] for _, d in sent][:2] == ["response.created", "response.in_progress"]
    assert sent[-1][1]["type"] == "response.completed"
    assert check_response(sent[-1][1]["response"]).output_text == "Hi there"


def test_a_failure_after_the_stream_started_is_an_error_event_then_response_failed():
    lost = ApiError(502, "worker 1 was lost (killed by SIGKILL)", code="worker_lost")
    sent = stream_through([Tokens(request_id="r", text_delta="Hi", token_ids=[1])], lost)
    for kind, data in sent:
        check_event(data, kind)
    error, failed = sent[-2][1], sent[-1][1]
    assert error["type"] == "error" and error["code"] == "worker_lost" and "SIGKILL" in error["message"]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": lost.message}


def test_a_refusal_before_the_stream_started_is_the_http_error():
    [(_, body)] = stream_through([], ApiError(429, "queue full", code="worker_error"), status=429)
    assert body["error"]["message"] == "queue full" and body["error"]["type"] == "rate_limit_error"


def test_a_forced_call_grammar_writes_the_name_before_the_arguments():
    """The stream announces a forced call (output_item.added with its name) before the argument
    deltas only if the grammar writes "name" first; xgrammar follows the schema's property order."""
    import xgrammar as xgr

    from router.tools import tool_grammar

    chat = to_chat(request(input="x", tools=[WEATHER], tool_choice="required"))
    rules = str(xgr.Grammar.from_json_schema(tool_grammar(chat, tool_mode(chat)).source, any_whitespace=False))
    root = next(line for line in rules.splitlines() if line.startswith("root ::="))
    assert root.startswith('root ::= (("{" "\\"name\\""'), root


def test_max_output_tokens_is_cut_to_the_context_left_and_the_servers_ceiling():
    """Responses' ``max_output_tokens`` is an upper bound (OpenAI): cut, never refused; None stays
    None (the chat path's default applies)."""
    from types import SimpleNamespace

    from router.responses.api import output_bound

    api = SimpleNamespace(cfg=SimpleNamespace(limits=SimpleNamespace(max_tokens=4096)), max_model_len=2048)
    assert output_bound(api, 2048, 223) == 2048 - 223
    assert output_bound(api, 100, 223) == 100
    assert output_bound(api, 8192, 10) == 2038
    assert output_bound(api, None, 223) is None
    api.max_model_len = 8192
    assert output_bound(api, 8000, 10) == 4096  # limits.max_tokens
