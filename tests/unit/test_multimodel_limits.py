"""deploy.yaml's ``limits`` are one section for every model, while each model has its own context
length: a prompt limit set for the longest model must not let a prompt fill a shorter one."""

from __future__ import annotations

import pytest

from router.errors import ApiError
from router.openai_api import sampling_params
from router.schemas import CompletionRequest
from router.settings import LimitsConfig, RouterSettings
from router.state import Api, ServedModel
from tests.helpers.router_pool import RecordingPool
from worker.contract.settings import ModelConfig


class Vocab(list):
    """A stand-in tokenizer: only its length (the vocabulary size) is read here."""


def two_models(max_prompt_tokens: int) -> Api:
    served = [
        ServedModel(ModelConfig(name="long", max_model_len=4096), tokenizer=Vocab(range(100))),
        ServedModel(ModelConfig(name="short", max_model_len=512), tokenizer=Vocab(range(100))),
    ]
    cfg = RouterSettings(limits=LimitsConfig(max_prompt_tokens=max_prompt_tokens))
    return Api(cfg, RecordingPool(), models={m.name: m for m in served})


def test_the_prompt_limit_is_capped_by_each_models_context_length():
    api = two_models(max_prompt_tokens=3000)
    assert api.for_request("long", "/v1/completions").max_prompt_tokens == 3000
    assert api.for_request("short", "/v1/completions").max_prompt_tokens == 511


def test_a_prompt_over_the_short_models_context_without_max_tokens_is_400_not_a_negative_budget():
    short = two_models(max_prompt_tokens=3000).for_request("short", "/v1/completions")
    req = CompletionRequest(model="short", prompt="x")
    with pytest.raises(ApiError) as e:
        sampling_params(short, req, prompt_len=600, max_tokens=None)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
