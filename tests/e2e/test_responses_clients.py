"""``/v1/responses`` as the Java clients call it: request bodies replayed exactly as openai-java and
LangChain4j serialise them (written from their sources, cited per test), and the answers read the
way those clients read them. Also the JDK-only example examples/java/Responses.java where ``java``
is on PATH."""

from __future__ import annotations

import json

import httpx

from tests.helpers.deployment import MODEL
from tests.helpers.java import run_example
from tests.openai_schema import check_event, check_response

# LangChain4j's ToolSpecification -> JsonObjectSchema -> map, non-strict (no additionalProperties, no "strict")
LC4J_WEATHER = {
    "type": "function",
    "name": "getWeather",
    "description": "Returns the current weather for a given city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def post(deployment, body: dict) -> dict:
    got = httpx.post(f"{deployment.base_url}/responses", json=body, timeout=300)
    assert got.status_code == 200, got.text
    check_response(got.json())
    return got.json()


def events_of(deployment, body: dict) -> list[tuple[str, dict]]:
    """``(event line, data)`` of every event, each checked against the schema and the SDK."""
    out, kind = [], None
    with httpx.stream("POST", f"{deployment.base_url}/responses", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                check_event(data, kind)
                out.append((kind, data))
    return out


def openai_java_reads(response: dict) -> None:
    """What openai-java's ``Response`` needs to deserialise and validate (its models/responses/
    Response.kt, ResponseOutputMessage.kt, ResponseOutputText.kt, ResponseFunctionToolCall.kt,
    ResponseUsage.kt): the fields it declares required, with their types."""
    for key in ("id", "created_at", "model", "output", "parallel_tool_calls", "tool_choice", "tools"):
        assert key in response, key
    assert isinstance(response["created_at"], (int, float)) and isinstance(response["output"], list)
    usage = response["usage"]
    assert {"input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details", "total_tokens"} <= set(
        usage
    )
    assert "cached_tokens" in usage["input_tokens_details"]
    assert "reasoning_tokens" in usage["output_tokens_details"]
    for item in response["output"]:
        if item["type"] == "message":
            assert {"id", "status", "content", "role"} <= set(item)
            for part in item["content"]:
                assert part["type"] == "output_text" and part["annotations"] == []
        else:
            assert item["type"] == "function_call" and isinstance(item["arguments"], str)
            assert {"call_id", "name", "id"} <= set(item)


def langchain4j_reads(events: list[tuple[str, dict]]) -> dict:
    """The answer LangChain4j's ``ResponsesApiEventListener`` (langchain4j-open-ai/.../
    OpenAiResponsesClient.java) builds from a stream: text from ``response.completed``'s output,
    tool calls assembled from ``output_item.added`` + argument deltas matched by item id; the
    stream must end with ``response.completed`` or ``response.incomplete`` or it waits forever."""
    builders: dict[str, dict] = {}
    calls: list[dict] = []
    streamed = ""
    for _, e in events:
        if e["type"] == "response.output_text.delta":
            streamed += e["delta"]
        elif e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call":
            builders[e["item"]["id"]] = {"id": e["item"]["call_id"], "name": e["item"]["name"], "arguments": ""}
        elif e["type"] == "response.function_call_arguments.delta":
            builders[e["item_id"]]["arguments"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.done":
            calls.append({**builders.pop(e["item_id"]), "arguments": e["arguments"]})
    last = events[-1][1]
    assert last["type"] in ("response.completed", "response.incomplete"), last["type"]
    output = last["response"]["output"]
    text = "".join(c["text"] for i in output if i["type"] == "message" for c in i["content"])
    status = last["response"]["status"]
    finish = {"completed": "TOOL_EXECUTION" if calls else "STOP", "incomplete": "LENGTH"}[status]
    return {"text": text, "streamed": streamed, "calls": calls, "finish": finish, "usage": last["response"]["usage"]}


def test_openai_java_create_with_a_string_input(deployment):
    """ResponseCreateParams.builder().input(String).model(...).maxOutputTokens(...).build(), as
    openai-java-example/.../ResponsesExample.java sends it (Jackson, fields in declaration order)."""
    answer = post(
        deployment, {"input": "Say this is a test", "model": MODEL, "max_output_tokens": 30, "temperature": 0}
    )
    openai_java_reads(answer)
    assert answer["output"][0]["content"][0]["text"].strip()


def test_openai_java_conversation_echoing_its_output_items(deployment):
    """ResponsesConversationExample.java: EasyInputMessage items (no "type"), then the previous
    ResponseOutputMessage echoed back whole (id, status, annotations, logprobs) before the next turn."""
    ask = {"content": "Tell me a one-line story about building the best SDK!", "role": "user"}
    first = post(deployment, {"input": [ask], "model": MODEL, "max_output_tokens": 20, "temperature": 0})
    openai_java_reads(first)
    again = {"content": "But why?", "role": "user"}
    body = {"input": [ask, *first["output"], again], "model": MODEL, "max_output_tokens": 20, "temperature": 0}
    second = post(deployment, body)
    openai_java_reads(second)


def test_openai_java_function_calling_round_trip(deployment):
    """ResponsesFunctionCallingRawExample.java: two strict function tools with hyphenated names,
    ResponseInputItem.Message items (role and input_text parts, no "type"), the returned
    ResponseFunctionToolCall echoed back as is, then its FunctionCallOutput."""
    tools = [
        {
            "name": "get-sdk-quality",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string", "description": "The name of the SDK."}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "strict": True,
            "type": "function",
            "description": "Gets the quality of the given SDK.",
        },
        {
            "name": "get-sdk-score",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "strict": True,
            "type": "function",
            "description": "Gets the review score (out of 10) for the given SDK.",
        },
    ]
    ask = {"content": [{"text": "What is the quality of the OpenAI Java SDK?", "type": "input_text"}], "role": "user"}
    body = {
        "input": [ask],
        "model": MODEL,
        "max_output_tokens": 60,
        "temperature": 0,
        "tool_choice": "required",
        "tools": tools,
    }
    first = post(deployment, body)
    openai_java_reads(first)
    call = first["output"][0]
    assert call["type"] == "function_call" and call["name"] in ("get-sdk-quality", "get-sdk-score"), first["output"]
    result = {"call_id": call["call_id"], "output": '{"quality": "robust"}', "type": "function_call_output"}
    second = post(deployment, {**body, "input": [ask, call, result], "tool_choice": "auto"})
    openai_java_reads(second)


def test_openai_java_structured_output_schema_with_dollar_schema(deployment):
    """ResponsesStructuredOutputsExample.java: text(Class) -> a json_schema format named
    json-schema-from-<Class>, strict, the schema made by victools with "$schema" (draft 2020-12)
    and additionalProperties false (openai-java-core/.../core/StructuredOutputs.kt)."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    fmt = {"name": "json-schema-from-Place", "schema": schema, "type": "json_schema", "strict": True}
    answer = post(
        deployment,
        {
            "input": "Paris is in France. Give the city and country.",
            "model": MODEL,
            "text": {"format": fmt},
            "max_output_tokens": 60,
        },
    )
    openai_java_reads(answer)
    place = json.loads(answer["output"][0]["content"][0]["text"])
    assert set(place) == {"city", "country"}
    assert answer["text"]["format"]["name"] == "json-schema-from-Place"


def test_openai_java_create_streaming(deployment):
    """ResponsesStreamingExample.java: createStreaming adds "stream": true; the SSE reader
    (openai-java-core/.../core/handlers/SseHandler.kt) throws on any event with a top-level "error"
    key; the example prints outputTextDelta() events."""
    body = {"input": "Tell me a story in one line.", "model": MODEL, "stream": True, "max_output_tokens": 40}
    events = events_of(deployment, body)
    assert all("error" not in data and "sequence_number" in data for _, data in events)
    deltas = [d for _, d in events if d["type"] == "response.output_text.delta"]
    assert deltas and all({"item_id", "output_index", "content_index", "logprobs"} <= set(d) for d in deltas)
    openai_java_reads(events[-1][1]["response"])


def lc4j_body(stream: bool, tool_choice: str | None = None, extra_input: list | None = None) -> dict:
    """OpenAiResponsesClient.buildRequestPayload (langchain4j-open-ai/.../OpenAiResponsesClient.java):
    model, input (type "message" items with input_text parts), stream, store false, the optional
    sampling fields, tools without "strict", tool_choice only with tools."""
    body = {
        "model": MODEL,
        "input": [
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "You are helpful."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            *(extra_input or []),
        ],
        "stream": stream,
        "store": False,
        "temperature": 0.0,
        "max_output_tokens": 60,
        "parallel_tool_calls": True,
        "truncation": "disabled",
        "include": ["reasoning.encrypted_content"],
        "service_tier": "auto",
        "safety_identifier": "user-1",
        "prompt_cache_key": "weather",
        "reasoning": {"effort": "low"},
        "tools": [LC4J_WEATHER],
    }
    if stream:
        body["stream_options"] = {"include_obfuscation": False}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return body


def test_langchain4j_chat_model_with_a_tool_and_the_turn_after(deployment):
    """OpenAiResponsesChatModel: parseChatResponse reads output[] (message text, function_call
    call_id/name/arguments), usage and status; the next turn sends the AiMessage's tool request as a
    function_call item without id or status, and the result as function_call_output."""
    first = post(deployment, lc4j_body(False, "required"))
    call = first["output"][0]
    assert call["type"] == "function_call" and call["name"] == "getWeather" and json.loads(call["arguments"])
    turn = [
        {"type": "function_call", "call_id": call["call_id"], "name": "getWeather", "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "18 degrees and sunny"},
    ]
    second = post(deployment, lc4j_body(False, "auto", turn))
    assert second["status"] in ("completed", "incomplete")
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    earlier = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]}]
    assert post(deployment, lc4j_body(False, None, earlier + turn))["output"]


def test_langchain4j_streaming_chat_model_text_and_tool_call(deployment):
    """OpenAiResponsesStreamingChatModel: the final text from response.completed, the tool call
    assembled by item id, the finish reason from the status."""
    text = langchain4j_reads(events_of(deployment, {**lc4j_body(True), "tools": [], "max_output_tokens": 30}))
    assert text["text"] == text["streamed"] and text["text"].strip() and text["finish"] in ("STOP", "LENGTH")
    assert text["usage"]["input_tokens_details"]["cached_tokens"] >= 0
    tool = langchain4j_reads(events_of(deployment, lc4j_body(True, "required")))
    assert tool["finish"] == "TOOL_EXECUTION" and len(tool["calls"]) == 1
    assert tool["calls"][0]["name"] == "getWeather" and json.loads(tool["calls"][0]["arguments"])["city"]


def test_langchain4j_server_tools_are_refused_by_name(deployment):
    """serverTools(web_search) go into tools as they are: this server runs none."""
    body = {**lc4j_body(False), "tools": [LC4J_WEATHER, {"type": "web_search"}]}
    got = httpx.post(f"{deployment.base_url}/responses", json=body, timeout=60)
    assert got.status_code == 400 and got.json()["error"]["param"] == "tools[1].type"


def test_java_responses_example(deployment):
    out = run_example("Responses.java", "What is the capital of France?", env={"LLAMADEPLOY_URL": deployment.base_url})
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert lines["status"] in ("completed", "incomplete") and lines["text"].strip()
    assert lines["streamed"] == lines["text"] and int(lines["events"]) >= 9
