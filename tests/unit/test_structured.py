"""Router side of structured output and tools: schema checks, the compile check (real xgrammar on
the real tokenizer), tool prompts, call parsing and streaming, and response shapes validated by
the ``openai`` SDK's own types."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from router.errors import ApiError
from router.schemas import ChatRequest, parse
from router.shaping import Choice, Shaper, TokenTexts, total_usage
from router.structured import MAX_SCHEMA_BYTES, GrammarChecker, check_schema
from router.tools import CallStreamer, chat_messages, parse_calls, tool_grammar, tool_mode
from worker.contract.protocol import Grammar, TokenLogprob, Tokens, Usage


def deep(n: int) -> dict:
    node: dict = {"type": "object"}
    for _ in range(n):
        node = {"type": "object", "properties": {"a": node}}
    return node


HOSTILE = [
    {"type": "object", "properties": {"foo": "bar"}},
    {"type": "array", "items": {"type": "integer"}, "minItems": 100000000},
    {"type": "string", "pattern": "foo**"},
    deep(100),
    {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 1000} for i in range(1100)}},
    {"type": "object", "patternProperties": {"(": {"type": "string"}}},
    ["not", "a", "schema"],
]


@pytest.mark.parametrize(
    "schema", HOSTILE, ids=["not-a-schema", "minItems", "pattern", "deep", "megabyte", "pattern-key", "list"]
)
def test_hostile_schemas_are_400_response_format(schema):
    with pytest.raises(ApiError) as e:
        check_schema(schema)
    assert e.value.status == 400 and e.value.param == "response_format"


def test_size_limit_is_on_compact_json_in_the_clients_key_order():
    ok = {"type": "object", "properties": {"a": {"type": "string", "description": "x" * (MAX_SCHEMA_BYTES // 2)}}}
    assert json.loads(check_schema(ok)) == ok
    assert check_schema({"b": 1, "a": {"type": "string"}}) == '{"b":1,"a":{"type":"string"}}'


def test_the_grammar_writes_properties_in_the_schemas_order(tokenizer):
    """Two schemas that differ only in key order compile to two grammars, each accepting its own
    order and refusing the other (xgrammar follows ``properties``' order)."""
    import xgrammar as xgr

    name_age = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    age_name = {"type": "object", "properties": {"age": {"type": "integer"}, "name": {"type": "string"}}}
    for schema in (name_age, age_name):
        schema["required"], schema["additionalProperties"] = ["name", "age"], False
    first, second = check_schema(name_age), check_schema(age_name)
    assert first != second and json.loads(first) == json.loads(second)
    for source, good, wrong in (
        (first, '{"name": "A", "age": 3}', '{"age": 3, "name": "A"}'),
        (second, '{"age": 3, "name": "A"}', '{"name": "A", "age": 3}'),
    ):
        grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False)
        assert xgr.testing._is_grammar_accept_string(grammar, good)
        assert not xgr.testing._is_grammar_accept_string(grammar, wrong)
    checker = GrammarChecker(tokenizer)

    async def go():
        for source in (first, second):
            assert await checker.check(Grammar(kind="json_schema", source=source), "response_format") > 0

    asyncio.run(go())


def test_compile_check_refuses_what_xgrammar_cannot_compile_and_caches(tokenizer):
    checker = GrammarChecker(tokenizer)

    async def go():
        with pytest.raises(ApiError) as e:
            await checker.check(Grammar(kind="json_schema", source='{"$ref":"#"}'), "response_format")
        assert e.value.status == 400 and e.value.param == "response_format" and "[" not in e.value.message[:3]
        good = Grammar(
            kind="json_schema", source=check_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
        )
        first = await checker.check(good, "response_format")
        again = await checker.check(good, "response_format")
        return first, again

    first, again = asyncio.run(go())
    assert first > 0 and again == 0.0


def test_building_the_compiler_is_not_counted_in_a_grammars_timeout(tokenizer):
    """The first structured request of a router imports xgrammar (and torch) and walks the
    vocabulary: a one-time cost that on a loaded box can outlast the compile timeout by itself;
    a valid schema must not be refused for it (it was: a 400 "did not compile within 5 s")."""
    checker = GrammarChecker(tokenizer, timeout_s=0.5)
    build = checker._ensure

    def slow_build():
        if checker._compiler is None:
            time.sleep(1.0)  # the import and the vocabulary walk on a busy box
        return build()

    checker._ensure = slow_build
    good = Grammar(kind="json_schema", source=check_schema({"type": "object"}))
    assert asyncio.run(checker.check(good, "response_format")) > 0


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]


def chat(**kw) -> ChatRequest:
    return parse(ChatRequest, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, **kw})


def test_tools_render_into_the_system_turn_and_history_round_trips():
    req = parse(
        ChatRequest,
        {
            "tools": TOOLS,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            ],
        },
    )
    messages, extra = chat_messages(req, native=False)
    assert extra == {}
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    native, extra = chat_messages(req, native=True)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[3]["role"] == "tool" and native[3]["tool_call_id"] == "call_1"
    none, extra = chat_messages(chat(tool_choice="none"), native=False)
    assert extra == {} and "# Tools" not in json.dumps(none)


def test_forced_tool_grammar_compiles_and_names_the_function(tokenizer):
    named = chat(tool_choice={"type": "function", "function": {"name": "add"}})
    g = tool_grammar(named, tool_mode(named))
    schema = json.loads(g.source)
    assert schema["properties"]["name"] == {"const": "add"}
    required = chat(tool_choice="required")
    assert len(json.loads(tool_grammar(required, tool_mode(required)).source)["anyOf"]) == 2
    asyncio.run(GrammarChecker(tokenizer).check(g, "tools"))
    bad = parse(
        ChatRequest,
        {
            "messages": [{"role": "user", "content": "x"}],
            "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": "b"}}}}],
        },
    )
    with pytest.raises(ApiError) as e:
        tool_grammar(bad, tool_mode(bad))
    assert e.value.param == "tools"


def test_tool_parameters_with_defs_compile_and_keep_their_order(tokenizer):
    """A Pydantic model's schema as a function's parameters (``$ref: #/$defs/...``): the
    definitions move to the grammar's root, where the reference resolves; the arguments are
    written in the parameters' order. Two tools defining one name differently are a 400."""
    import xgrammar as xgr

    def tools(*params):
        return [{"type": "function", "function": {"name": f"f{i}", "parameters": p}} for i, p in enumerate(params)]

    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Place"}},
        "required": ["name", "home"],
        "$defs": {"Place": {"type": "object", "properties": {"zip": {"type": "string"}, "city": {"type": "string"}}}},
    }
    req = parse(ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": tools(person, person)})
    g = tool_grammar(req, tool_mode(req.model_copy(update={"tool_choice": "required"})))
    assert json.loads(g.source)["$defs"] == person["$defs"]
    asyncio.run(GrammarChecker(tokenizer).check(g, "tools"))
    grammar = xgr.Grammar.from_json_schema(g.source, any_whitespace=False)
    call = '{"name": "f0", "arguments": {"name": "A", "home": {"zip": "1", "city": "B"}}}'
    assert xgr.testing._is_grammar_accept_string(grammar, call)
    assert not xgr.testing._is_grammar_accept_string(
        grammar, call.replace('"zip": "1", "city": "B"', '"city": "B", "zip": "1"')
    )
    other = {**person, "$defs": {"Place": {"type": "string"}}}
    clash = parse(ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": tools(person, other)})
    with pytest.raises(ApiError) as e:
        tool_grammar(clash, tool_mode(clash.model_copy(update={"tool_choice": "required"})))
    assert e.value.status == 400 and e.value.param == "tools"


def test_parse_calls_auto_forced_and_no_call():
    auto = tool_mode(chat())
    content, calls = parse_calls(
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        '\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        auto,
    )
    assert content == "Sure." and [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == {"city": "Rome"} and calls[0].id.startswith("call_")
    single = tool_mode(chat(parallel_tool_calls=False))
    assert (
        len(
            parse_calls(
                '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": "add", '
                '"arguments": {}}</tool_call>',
                single,
            )[1]
        )
        == 1
    )
    assert parse_calls("It is sunny.", auto) == ("It is sunny.", [])
    assert parse_calls('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', auto)[1] == []
    forced = tool_mode(chat(tool_choice="required"))
    content, calls = parse_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', forced)
    assert content is None and calls[0].name == "add"


def test_call_streamer_forced_sends_name_first_then_fragments():
    mode = tool_mode(chat(tool_choice="required"))
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    s = CallStreamer(mode)
    deltas = []
    for i in range(0, len(text), 5):
        content, d = s.feed(text[i : i + 5])
        assert content == ""
        deltas += d
    _, tail, calls = s.finish()
    deltas += tail
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["function"]["arguments"] for d in deltas)
    assert json.loads(args) == {"city": "Paris"} and calls[0].id == deltas[0]["id"]


def test_call_streamer_auto_passes_content_and_holds_a_tag():
    s = CallStreamer(tool_mode(chat()))
    out = [
        s.feed("Let me check. <tool"),
        s.feed('_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'),
        s.feed("</tool_call>"),
    ]
    assert "".join(c for c, _ in out) == "Let me check. " and all(not d for _, d in out)
    rest, deltas, _calls = s.finish()
    assert (
        rest == ""
        and deltas[0]["function"]["name"] == "add"
        and json.loads(deltas[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    )
    plain = CallStreamer(tool_mode(chat()))
    assert plain.feed("No tools <t")[0] == "No tools " and plain.finish()[0] == "<t"


class Texts(TokenTexts):
    def __init__(self):
        super().__init__([b"a", b" b", b"\xe2\x82", b"\xac", b"{", b"}"])


def lp(t):
    return TokenLogprob(token_id=t, logprob=-0.25, top=[(t, -0.25), (5, -9999.0)])


def test_chat_shapes_validate_with_the_sdk_types():
    events = [
        Tokens(request_id="r", text_delta="a b", token_ids=[1], logprobs=[lp(0), lp(1)]),
        Tokens(
            request_id="r",
            text_delta="€",
            token_ids=[3],
            logprobs=[lp(2), lp(3)],
            finish_reason="stop",
            usage=Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7),
        ),
    ]
    shaper = Shaper("abc", "m", chat=True, include_usage=True)
    choices = [Choice(i, True, None, Texts(), 2) for i in range(2)]
    chunks = []
    for _i, c in enumerate(choices):
        for e in events:
            chunks += [shaper.chunk([part]) for part in c.feed(e)]
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch)
        assert "usage" in ch and ch["usage"] is None
    assert {ch["choices"][0]["index"] for ch in chunks} == {0, 1}
    body = shaper.whole([c.whole() for c in choices], total_usage(3, choices))
    parsed = ChatCompletion.model_validate(body)
    assert body["choices"][0]["message"]["refusal"] is None
    assert parsed.usage.completion_tokens == 8 and parsed.usage.prompt_tokens == 3
    content = parsed.choices[0].logprobs.content
    assert [c.token for c in content] == ["a", " b", "\ufffd", "\ufffd"] and content[2].bytes == [0xE2, 0x82]
    assert content[0].top_logprobs[1].logprob == -9999.0


def test_tool_call_choice_and_completion_logprobs_shapes():
    mode = tool_mode(chat(tool_choice="required"))
    c = Choice(0, True, mode, None, None)
    shaper = Shaper("x", "m", chat=True)
    parts = c.feed(
        Tokens(
            request_id="r",
            text_delta='{"name": "add", "arguments": {"a": 1, "b": 2}}',
            token_ids=[1],
            finish_reason="stop",
            usage=Usage(prompt_tokens=1, completion_tokens=5, total_tokens=6),
        )
    )
    for p in parts:
        ChatCompletionChunk.model_validate(shaper.chunk([p]))
    assert parts[-1]["finish_reason"] == "tool_calls"
    whole = ChatCompletion.model_validate(shaper.whole([c.whole()], total_usage(1, [c])))
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2} and whole.choices[0].message.content is None
    comp = Choice(0, False, None, Texts(), 1)
    comp.feed(
        Tokens(
            request_id="r",
            text_delta="a b",
            token_ids=[1],
            logprobs=[lp(0), lp(1)],
            finish_reason="length",
            usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
        )
    )
    body = Shaper("y", "m", chat=False).whole([comp.whole()], total_usage(1, [comp]))
    parsed = Completion.model_validate(body)
    assert parsed.choices[0].logprobs.text_offset == [0, 1] and parsed.choices[0].logprobs.top_logprobs == [
        {"a": -0.25},
        {" b": -0.25},
    ]


def test_the_router_builds_each_text_models_compiler_at_start_and_freezes_it(tokenizer):
    """At start the router builds the grammar compiler of each text model (not of an embedding
    model), so that no request pays it while a worker computes beside the router; what it allocated
    is frozen out of the collector's full collections with the rest of start-up."""
    import gc

    from router.serve import warm_grammar_checkers
    from router.state import ServedModel
    from worker.contract.settings import ModelConfig

    chat = ServedModel(ModelConfig(name="chat"), tokenizer=tokenizer)
    embed = ServedModel(ModelConfig(name="embed", task="embed"), tokenizer=tokenizer)
    frozen, callbacks = gc.get_freeze_count(), list(gc.callbacks)
    try:
        asyncio.run(warm_grammar_checkers({"chat": chat, "embed": embed}))
        assert chat.grammar_checker._compiler is not None
        assert "grammar_checker" not in embed.__dict__  # never built: an embedding model has no grammars
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
        gc.callbacks[:] = callbacks  # the slow-collection log belongs to a server process, not pytest's


def test_a_standby_router_loads_on_a_thread_that_yields_the_cpu_and_serves_from_one_that_did_not():
    """A standby router loads (imports, tokenizers, compilers) while the workers serve: that work
    runs on a thread at a lower priority (nice), its result and errors reach the caller, and the
    caller's thread, which serves after the takeover, and the threads it starts keep theirs."""
    import os
    import threading

    from router.main import STANDBY_NICE, on_lowered_thread

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = priority()
    assert on_lowered_thread(priority, STANDBY_NICE) == min(base + STANDBY_NICE, 19)
    assert priority() == base
    later = []
    thread = threading.Thread(target=lambda: later.append(priority()))
    thread.start()
    thread.join()
    assert later == [base]

    def fails():
        raise ValueError("no tokenizer here")

    with pytest.raises(ValueError, match="no tokenizer here"):
        on_lowered_thread(fails, STANDBY_NICE)
