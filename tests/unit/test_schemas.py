"""Request validation is strict and total (every bad body is a 400 naming the field), the
OpenAPI document matches the validators, and errors keep OpenAI's shape."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.config import ConfigError, DeployConfig, parse_config
from router.errors import ApiError, error_type
from router.openapi import build_openapi
from router.schemas import ChatRequest, CompletionRequest, parse

HI = [{"role": "user", "content": "hi"}]
ROUTER = DeployConfig(model={"max_model_len": 2048}).router_settings()  # what `up` gives (auto resolved)


def bad(model, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(model, body)
    assert e.value.status == 400
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}
    return e.value


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": HI, "max_tokens": "5"}, "max_tokens"),
        ({"messages": HI, "max_tokens": 1.5}, "max_tokens"),
        ({"messages": HI, "max_tokens": True}, "max_tokens"),
        ({"messages": HI, "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages.0.content"),
        ({"messages": HI, "stop": ["ok", "\ud800"]}, "stop"),
        ({"messages": HI, "stop": [1]}, "stop"),
        ({"messages": HI, "seed": 2**63}, "seed"),
        ({"messages": HI, "seed": -(2**63) - 1}, "seed"),
        ({"messages": HI, "top_k": 2**31}, "top_k"),
        ({"messages": HI, "temperature": "hot"}, "temperature"),
        ({"messages": HI, "temperature": 2.5}, "temperature"),
        ({"messages": HI, "top_p": -0.1}, "top_p"),
        ({"messages": HI, "top_p": 1.01}, "top_p"),
        ({"messages": HI, "n": 17}, "n"),
        ({"messages": HI, "logprobs": 1}, "logprobs"),
        ({"messages": HI, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": HI, "tools": [{"type": "function"}]}, "tools.0.function"),
        ({"messages": HI, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        ({"messages": HI, "tool_choice": "required"}, "tool_choice"),
        ({"messages": HI, "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": HI, "frequency_penalty": -3}, "frequency_penalty"),
        ({"messages": HI, "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": HI, "logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": HI, "logit_bias": {"5": -101}}, "logit_bias"),
        ({"messages": HI, "min_tokens": -1}, "min_tokens"),
        ({"messages": HI, "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, "response_format"),
        ({"messages": HI, "functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages.0"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages.0",
        ),
        ({"messages": HI, "audio": {"voice": "x"}}, "audio"),
        ({"messages": HI, "modalities": ["text", "audio"]}, "modalities.1"),
        ({"messages": []}, "messages"),
        ({"model": "x"}, "messages"),
    ],
)
def test_chat_rejects_with_the_field_named(body, param):
    err = bad(ChatRequest, body)
    assert err.param == param and err.message.startswith(param)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [[1], "a"]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": "x", "echo": 1}, "echo"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "\udc00"}, "prompt"),
    ],
)
def test_completion_rejects_with_the_field_named(body, param):
    assert bad(CompletionRequest, body).param == param


@pytest.mark.parametrize("data", [[], "text", 5, None])
def test_body_must_be_an_object(data):
    assert "JSON object" in bad(ChatRequest, data).message


def test_valid_requests_parse():
    req = parse(
        ChatRequest,
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "user", "content": "😀 " + json.loads('"\\ud83d\\ude00"')},
            ],
            "max_tokens": 5,
            "stop": "x",
            "seed": -1,
            "temperature": 0,
            "unknown_field": {"a": 1},
        },
    )
    assert req.stop_list() == ["x"] and req.messages[0].text() == "be brief"
    assert parse(CompletionRequest, {"prompt": "one"}).prompt == ["one"]
    assert parse(CompletionRequest, {"prompt": ["one", "two"]}).prompt == ["one", "two"]
    assert parse(CompletionRequest, {"prompt": [1, 2, 3]}).prompt == [[1, 2, 3]]
    # lm-evaluation-harness's local-completions loglikelihood body: token-id lists, echo, max_tokens 1
    lm_eval = {"model": "m", "prompt": [[1, 2], [3]], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}
    req = parse(CompletionRequest, {**lm_eval, "echo": True})
    assert req.prompt == [[1, 2], [3]] and req.echo and req.logprobs == 1
    assert parse(CompletionRequest, {"prompt": "x", "echo": True, "max_tokens": 0}).max_tokens == 0
    too_many = bad(CompletionRequest, {"prompt": ["a"] * 8, "n": 9})
    assert "64 choices" in too_many.message


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
CHAT_KEYS = st.sampled_from(
    [
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "n",
        "logprobs",
        "tools",
        "model",
        "user",
        "stream_options",
        "max_completion_tokens",
        "response_format",
        "tool_choice",
        "logit_bias",
        "top_logprobs",
        "presence_penalty",
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(CHAT_KEYS, JSON, max_size=6) | JSON)
def test_any_json_is_accepted_or_a_400(body):
    """Total: whatever JSON arrives, validation returns a request or raises a 400, nothing else."""
    for model in (ChatRequest, CompletionRequest):
        try:
            parse(model, body)
        except ApiError as exc:
            assert exc.status == 400


def test_error_types():
    assert error_type(401) == "authentication_error" and error_type(405) == "invalid_request_error"
    assert error_type(413) == "invalid_request_error" and error_type(503) == "service_unavailable"
    assert error_type(599) == "server_error"
    assert ApiError(404, "nope", code="x").body() == {
        "error": {"message": "nope", "type": "not_found_error", "param": None, "code": "x"}
    }


def test_openapi_document_is_loadable_and_covers_the_routes():
    doc = build_openapi(ROUTER)
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json"} <= set(
        doc["paths"]
    )
    refs = {m for m in json.dumps(doc).split('"#/components/schemas/')[1:]}
    assert {r.split('"')[0] for r in refs} <= set(doc["components"]["schemas"])
    schema = schemathesis.openapi.from_dict(doc)
    assert len(list(schema.get_all_operations())) == len(doc["paths"])
    assert "security" not in doc
    assert "limits.max_body_bytes" in doc["info"]["description"]


def test_openapi_declares_bearer_auth_when_keys_are_set():
    doc = build_openapi(
        parse_config(
            {"model": {"max_model_len": 2048}, "router": {"api_keys": ["sk-secret-1"], "admin_token": "adm-secret"}}
        ).router_settings()
    )
    assert doc["security"] == [{"bearer": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert "secret" not in json.dumps(doc)


def test_openapi_request_schema_is_the_validators():
    doc = build_openapi(ROUTER)
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    assert chat["properties"]["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    role = doc["components"]["schemas"]["Message"]["properties"]["role"]
    assert set(role["enum"]) == {"system", "user", "assistant", "developer", "tool"}


def test_config_refuses_an_exposed_admin_api_without_a_token():
    with pytest.raises(ConfigError) as e:
        parse_config({"router": {"admin_host": "0.0.0.0", "api_keys": ["secret-key"]}})
    assert "router.admin_token" in str(e.value) and "secret-key" not in str(e.value)
    assert parse_config({"router": {"admin_host": "0.0.0.0", "admin_token": "t"}}).router.admin_host == "0.0.0.0"
    assert parse_config({"router": {"admin_host": "::1"}}).router.admin_host == "::1"


def test_config_secrets_are_not_echoed_and_zmq_scheme_is_checked():
    with pytest.raises(ConfigError) as e:
        parse_config({"router": {"api_keys": ["", "secret-key"]}})
    assert "router.api_keys" in str(e.value) and "secret-key" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_config({"router": {"zmq_address": "inproc://x"}})
    assert "router.zmq_address" in str(e.value)
    assert parse_config({"router": {"zmq_address": "tcp://127.0.0.1:5555"}}).router.zmq_address


def test_api_keys_from_the_environment(monkeypatch):
    from launcher.config import load_config

    monkeypatch.setenv("LLAMADEPLOY_API_KEYS", " k1 , k2,, ")
    monkeypatch.setenv("LLAMADEPLOY_ADMIN_TOKEN", "adm")
    cfg = load_config(None)
    assert cfg.router.api_keys == ["k1", "k2"] and cfg.router.admin_token == "adm"


def test_explicit_null_means_the_default_for_n_stream_and_parallel_tool_calls():
    """Jackson-serialised Java clients send ``null`` for unset fields; OpenAI takes it as the default."""
    body = {"messages": [{"role": "user", "content": "hi"}], "n": None, "stream": None, "parallel_tool_calls": None}
    req = parse(ChatRequest, body)
    assert (req.n, req.stream, req.parallel_tool_calls) == (1, False, True)
    assert parse(CompletionRequest, {"prompt": "hi", "n": None, "stream": None}).n == 1


@pytest.mark.parametrize("top_p", [0, 0.0, 0.5, 1])
def test_top_p_takes_openais_whole_range(top_p):
    assert parse(ChatRequest, {"messages": HI, "top_p": top_p}).top_p == top_p
    assert parse(CompletionRequest, {"prompt": "hi", "top_p": top_p}).top_p == top_p
