"""The transformers fallback (worker/hf_model.py): a non-Llama architecture runs through the same
engine — block cache, chunked prefill, prefix cache — and greedy output equals transformers' own
``generate``. A tiny random Qwen2 model (attention biases: not the compact path) made in the test."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from launcher.models import resolve_model
from worker import model as model_mod
from worker.attention import KVCache
from worker.blocks import BlockManager
from worker.contract.protocol import Generate, SamplingParams, Tokens
from worker.engine import Engine
from worker.hf_model import HFModel
from worker.runner import ModelRunner
from worker.scheduler import Scheduler

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    smol = resolve_model("smollm2-135m-instruct", progress=False)
    config = Qwen2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, folder / name)
    return str(folder)


def test_fallback_matches_transformers_generate(tiny):
    config = model_mod.load_config(tiny)
    model = model_mod.load_model(model_mod.plan_in_process(tiny, torch.float32, 512))
    assert isinstance(model, HFModel)
    layers, kv_heads, head_dim = model_mod.kv_shape(config)
    events: list = []
    engine = Engine(
        ModelRunner(model, KVCache(layers, 64, 16, kv_heads, head_dim, torch.float32, CPU), CPU),
        model_mod.load_tokenizer(tiny),
        Scheduler(BlockManager(64, 16), 4, 8, 7),
        512,
        CPU,
        config.vocab_size,
        {2},
    )
    prompts = [list(range(100, 140)), list(range(100, 120)) + list(range(500, 523))]  # a shared 16-token block
    for i, p in enumerate(prompts):
        events += engine.submit(
            Generate(
                request_id=f"r{i}",
                prompt_token_ids=p,
                params=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
            )
        )
    while engine.has_work:
        events += engine.step()
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        want = reference.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10)[0, len(p) :]
        got = [t for e in events if isinstance(e, Tokens) and e.request_id == f"r{i}" for t in e.token_ids]
        assert got == want.tolist()
    assert engine.scheduler.blocks.hit_tokens >= 16
