"""Tensor parallelism's arithmetic: which models split over N ranks (worker.contract.tp_rules.tp_problems) and
which part of each weight a rank holds — checked by running N shards of a small Llama in threads
with an in-process all-reduce against the whole model."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LlamaConfig

from worker.attention import KVCache, build_batch
from worker.contract.shapes import ModelShape
from worker.contract.tp_rules import shard_range, tp_problems, valid_sizes
from worker.llama import LlamaModel, random_weights

SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
LLAMA2_7B = {"num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008}
LLAMA3_70B = {"num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672}


def test_models_that_divide_have_no_problems():
    assert tp_problems(SMOLLM2, 1) == [] and tp_problems(SMOLLM2, 3) == []
    assert tp_problems(LLAMA2_7B, 2) == [] and tp_problems(LLAMA2_7B, 4) == []
    assert tp_problems(LLAMA3_70B, 8) == []


def test_a_size_that_does_not_divide_is_one_line_naming_the_key_and_the_fix():
    (line,) = tp_problems(SMOLLM2, 2)
    assert line == (
        "workers.tensor_parallel_size: 2 does not divide the model's 9 attention heads, 3 KV heads; use one of 3"
    )
    (line,) = tp_problems(LLAMA3_70B, 16)
    assert line.startswith("workers.tensor_parallel_size: 16 does not divide the model's 8 KV heads;")
    assert line.endswith("use one of 2, 4, 8")
    (line,) = tp_problems({"num_attention_heads": 7, "intermediate_size": 100}, 2)
    assert line == (
        "workers.tensor_parallel_size: 2 does not divide the model's 7 attention heads, 7 KV heads; "
        "this model does not split; use 1 (or workers.gpus_per_replica)"
    )
    assert tp_problems(SMOLLM2, 0) == ["workers.tensor_parallel_size: 0 must be at least 1"]


def test_a_model_the_llama_forward_cannot_run_is_refused_where_the_config_names_it():
    qwen = {**SMOLLM2, "architectures": ["Qwen2ForCausalLM"]}
    assert tp_problems(qwen, 3) == [
        "workers.tensor_parallel_size: 3 needs a Llama-family model, the only forward that is split "
        "(architecture ['Qwen2ForCausalLM'] is not Llama-family); use 1"
    ]
    assert tp_problems(qwen, 1) == []
    mistral = {**LLAMA2_7B, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert "sliding-window attention" in tp_problems(mistral, 2)[0]
    assert tp_problems({**LLAMA2_7B, "architectures": ["LlamaForCausalLM"]}, 2) == []


def test_config_objects_dicts_and_model_shapes_alike():
    shape = ModelShape("x", 4096, 32, 32, 8, 128, 14336, 128256)
    assert tp_problems(shape, 8) == [] and "8 KV heads" in tp_problems(shape, 16)[0]
    config = LlamaConfig(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, hidden_size=576)
    assert tp_problems(config, 3) == [] and tp_problems(config, 2) != []
    assert valid_sizes(SMOLLM2) == [1, 3]
    assert valid_sizes({"num_attention_heads": 12, "intermediate_size": 36}) == [1, 2, 3, 4, 6, 12]


def test_shard_ranges_tile_each_split_weight_and_leave_the_rest_whole():
    assert shard_range("model.layers.0.self_attn.q_proj.weight", (576, 576), 1, 3) == (0, 192, 384)
    assert shard_range("model.layers.0.self_attn.k_proj.bias", (192,), 2, 3) == (0, 128, 192)
    assert shard_range("model.layers.0.self_attn.o_proj.weight", (576, 576), 0, 3) == (1, 0, 192)
    assert shard_range("model.layers.3.mlp.down_proj.weight", (576, 1536), 2, 3) == (1, 1024, 1536)
    assert shard_range("model.layers.3.mlp.up_proj.weight", (1536, 576), 1, 3) == (0, 512, 1024)
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        assert shard_range(name, (10, 10), 1, 2) is None
    assert shard_range("model.layers.0.self_attn.q_proj.weight", (576, 576), 0, 1) is None
    with pytest.raises(ValueError, match="does not divide"):
        shard_range("model.layers.0.self_attn.q_proj.weight", (576, 576), 0, 5)


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
        num_hidden_layers=2,
        vocab_size=300,
        max_position_embeddings=64,
    )


def test_random_weight_shards_are_slices_of_the_whole():
    config = tiny_config()
    whole = random_weights(config, torch.device("cpu"), torch.float32)
    parts = [random_weights(config, torch.device("cpu"), torch.float32, rank=r, world=3) for r in range(3)]
    for name, full in whole.items():
        where = shard_range(name, tuple(full.shape), 0, 3)
        if where is None:
            assert all(torch.equal(p[name], full) for p in parts), name
        else:
            assert torch.equal(torch.cat([p[name] for p in parts], dim=where[0]), full), name


class ThreadGroup:
    """``world`` ranks as threads of one process: ``all_reduce`` sums their tensors in rank order."""

    def __init__(self, world: int):
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world, timeout=30)

    def rank_view(self, rank: int):
        group = self

        class View:
            world = group.world

            def all_reduce(self, t):
                group.slots[rank] = t.float()
                group.barrier.wait()
                total = sum(group.slots[1:], group.slots[0].clone())
                group.barrier.wait()
                return total

        return View()


def test_sharded_forward_over_threads_matches_the_whole_model():
    """Three shards (2 query heads, 1 KV head, 32 MLP channels each) summed as the all-reduce does
    give the whole model's logits: a prefill chunk, then a decode step over the cached keys."""
    config, cpu = tiny_config(), torch.device("cpu")

    def step(model, cache, rows):
        prompt = list(range(3, 3 + 20))
        first = build_batch(16, cpu, [], [([0, 1], 0, 20)])
        model.forward(torch.tensor(prompt), torch.arange(20), first, cache, torch.tensor([19]))
        second = build_batch(16, cpu, [([0, 1], 21)], [])
        rows.append(model.forward(torch.tensor([7]), torch.tensor([20]), second, cache, torch.tensor([0])))

    whole = LlamaModel(config, random_weights(config, cpu, torch.float32), cpu, torch.float32, 64)
    expected: list = []
    step(whole, KVCache(2, 4, 16, 3, 8, torch.float32, cpu), expected)

    group = ThreadGroup(3)
    outputs: list[list] = [[] for _ in range(3)]
    threads = []
    for r in range(3):
        shard = LlamaModel(
            config,
            random_weights(config, cpu, torch.float32, rank=r, world=3),
            cpu,
            torch.float32,
            64,
            tp=group.rank_view(r),
        )
        assert (shard.heads, shard.kv_heads) == (2, 1)
        cache = KVCache(2, 4, 16, 1, 8, torch.float32, cpu)
        threads.append(threading.Thread(target=step, args=(shard, cache, outputs[r]), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for out in outputs:
        assert torch.allclose(out[0], expected[0], atol=1e-5, rtol=1e-4)


def test_attention_biases_whole_and_sharded_match_transformers():
    """A Llama with ``attention_bias`` (q/k/v and o_proj biases): the compact forward, whole and
    over three shards, gives transformers' logits (o_proj's bias added once, after the ranks' sum)."""
    from transformers import LlamaForCausalLM

    config, cpu = tiny_config(), torch.device("cpu")
    config.attention_bias = True
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # transformers starts biases at zero, which would hide a dropped one
    whole = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    prompt = list(range(3, 23))
    expected = hf(torch.tensor([prompt])).logits[0, -1]

    def prefill(model, cache, out):
        batch = build_batch(16, cpu, [], [([0, 1], 0, 20)])
        out.append(model.forward(torch.tensor(prompt), torch.arange(20), batch, cache, torch.tensor([19]))[0])

    alone: list = []
    prefill(LlamaModel(config, whole, cpu, torch.float32, 64), KVCache(2, 4, 16, 3, 8, torch.float32, cpu), alone)
    assert torch.allclose(alone[0], expected, atol=1e-5, rtol=1e-4)

    group, outputs, threads = ThreadGroup(3), [[] for _ in range(3)], []
    for r in range(3):
        part = {}
        for name, t in whole.items():
            where = shard_range(name, tuple(t.shape), r, 3)
            part[name] = t if where is None else t.narrow(where[0], where[1], where[2] - where[1])
        shard = LlamaModel(config, part, cpu, torch.float32, 64, tp=group.rank_view(r))
        cache = KVCache(2, 4, 16, 1, 8, torch.float32, cpu)
        threads.append(threading.Thread(target=prefill, args=(shard, cache, outputs[r]), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for out in outputs:
        assert torch.allclose(out[0], expected, atol=1e-5, rtol=1e-4)
