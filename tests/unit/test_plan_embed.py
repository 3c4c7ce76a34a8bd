"""The plan of an embedding model: its weights and one step's activations, no KV cache, its own
input length; alone and beside a chat model, on CPU and on an injected 24 GB GPU, and up's preflight."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest

from launcher.config import DeployConfig
from launcher.plan.embed import EmbedFit, EmbedSizing, embed_params
from launcher.plan.packing import place_models
from launcher.plan.placement import GpuInfo, Inventory
from launcher.plan.plan import make_plan, preflight
from launcher.plan.several import plan_models, preflight_models
from launcher.plan.shape import read_shape
from launcher.plan.sizing import CPU_PROCESS_BYTES, GPU_CONTEXT_BYTES
from tests.helpers.model_configs import SMOLLM2_135M, llama2, minilm_folder
from worker.contract.embed_spec import CPU_STEP_TOKENS, GPU_STEP_TOKENS, EmbedSpec
from worker.contract.settings import ModelConfig
from worker.contract.shapes import from_hf_config
from worker.contract.units import GB, GiB

SMOLLM2 = from_hf_config(SMOLLM2_135M, "smollm2-135m")


def gpu_inventory(total_gb: float = 24, n: int = 1) -> Inventory:
    gpus = [GpuInfo(i, "GPU", f"GPU-{i:08x}", int(total_gb * GB), int(total_gb * GB), (8, 9)) for i in range(n)]
    return Inventory(gpus, list(range(8)), None, 64 * GiB)


def cpu_inventory(cores: int = 4, ram_gib: float = 64) -> Inventory:
    return Inventory([], list(range(cores)), None, int(ram_gib * GiB))


@pytest.fixture
def minilm(tmp_path):
    """MiniLM's shape as ``plan`` reads it for ``task: auto`` from its folder."""
    folder = minilm_folder(tmp_path)
    return read_shape(folder, ModelConfig(name=folder))


def chat_and_embed(**top) -> DeployConfig:
    return DeployConfig.model_validate(
        {"models": [{"name": "chat"}, {"name": "embed", "task": "embed", "workers": {"replicas": 1}}], "workers": top}
    )


def test_a_sentence_transformers_folder_is_read_with_the_workers_spec(minilm, tmp_path):
    assert minilm.embed is not None
    assert (minilm.embed.max_tokens, minilm.embed.encoder, minilm.embed.pooling) == (256, True, "mean")
    folder = str(tmp_path / "minilm")
    assert read_shape(folder).embed is None  # without its model section: the shape alone
    assert read_shape(folder, ModelConfig(name=folder, max_model_len=128)).embed.max_tokens == 128


def test_minilm_weights_are_its_published_count_without_pooler_or_lm_head(minilm):
    assert embed_params(minilm, minilm.embed) == 22_565_376  # BertModel's 22,713,216 less the pooler's 147,840


def test_a_decoder_served_for_embeddings_counts_no_lm_head():
    shape = llama2("7B")  # untied: the LM head is a table of its own
    spec = EmbedSpec("lasttoken", True, 4096, 4096, 4096, False, False)
    assert embed_params(shape, spec) == shape.params - shape.vocab_size * shape.hidden_size


def test_chat_and_embed_on_cpu_the_embed_model_has_no_kv_and_its_own_length(minilm):
    result = plan_models(chat_and_embed(devices="cpu", replicas=1), cpu_inventory(), [SMOLLM2, minilm])
    assert result.ok, result.errors
    chat, embed = result.plans
    s = embed.sizing
    assert isinstance(s, EmbedSizing) and s.step_tokens == CPU_STEP_TOKENS and s.spec.max_tokens == 256
    assert [type(f) for f in embed.fits] == [EmbedFit] and embed.fits[0].kv_room == 0
    assert embed.fits[0].need == s.weights + CPU_PROCESS_BYTES + s.activations
    assert s.weights == 22_565_376 * 4  # float32 on a CPU without bf16
    assert embed.recommendation.describe() == "replicas: 1, devices: cpu"
    lines = result.split()
    assert "full-length" in lines[0] and "full-length" not in lines[1]
    assert lines[1].endswith("embeddings (no KV cache)")
    assert chat.sizing.kv_per_token > 0  # the chat model's plan is as before


def test_chat_and_embed_on_a_24gb_gpu_share_it_and_both_fit(minilm):
    result = plan_models(chat_and_embed(), gpu_inventory(24), [SMOLLM2, minilm])
    assert result.ok, result.errors
    embed = result.plans[1]
    fit = embed.fits[0]
    assert fit.spec.share == 0.5 and fit.fits
    assert embed.sizing.step_tokens == GPU_STEP_TOKENS
    assert fit.need == embed.sizing.weights + GPU_CONTEXT_BYTES + embed.sizing.activations
    assert fit.budget == int(24 * GB * 0.9 * 0.5)
    assert "max_num_seqs" not in embed.recommendation.describe()


def test_an_embedding_model_is_not_refused_for_a_kv_cache_it_does_not_keep():
    long = replace(llama2("7B"), max_position_embeddings=32768)  # a 7B decoder trained for embeddings
    cfg = DeployConfig.model_validate({"model": {"dtype": "float16", "max_model_len": 32768}})
    as_chat = make_plan(cfg, gpu_inventory(24), long)
    assert not as_chat.ok  # 16 GiB of KV for one 32k sequence on top of 12.6 GiB of weights
    embed = replace(long, embed=EmbedSpec("lasttoken", True, 4096, 4096, 32768, False, False))
    plan = make_plan(cfg, gpu_inventory(24), embed)
    assert plan.ok, plan.errors
    assert plan.sizing.weights < as_chat.sizing.weights  # no LM head


def test_a_gpu_too_small_for_a_step_is_refused_naming_the_step_and_a_smaller_one_fits(minilm):
    cfg = DeployConfig.model_validate({"model": {"task": "embed"}})
    plan = make_plan(cfg, gpu_inventory(1.5), minilm)
    assert not plan.ok and len(plan.errors) == 1
    assert f"a step of {GPU_STEP_TOKENS} tokens" in plan.errors[0] and "no KV cache" in plan.errors[0]
    assert plan.recommendation.replicas == 0
    smaller = cfg.model_copy(update={"workers": cfg.workers.model_copy(update={"max_prefill_tokens": 1024})})
    assert make_plan(smaller, gpu_inventory(1.5), minilm).ok


def test_tensor_parallel_is_refused_for_an_embedding_model(minilm):
    cfg = DeployConfig.model_validate({"model": {"task": "embed"}, "workers": {"tensor_parallel_size": 2}})
    plan = make_plan(cfg, gpu_inventory(24, n=2), minilm)
    assert "an embedding model runs on one device" in " ".join(plan.errors)


def test_preflights_read_the_folders_and_plan_the_embed_model_without_kv(tmp_path, caplog):
    chat = tmp_path / "chat"
    chat.mkdir()
    (chat / "config.json").write_text(json.dumps(SMOLLM2_135M))
    embed = minilm_folder(tmp_path)
    cfg = DeployConfig.model_validate(
        {
            "models": [{"name": str(chat), "served_name": "chat"}, {"name": embed, "served_name": "embed"}],
            "workers": {"replicas": 1},
        }
    )
    inv = gpu_inventory(24)
    specs = place_models([one.workers for one in cfg.served()], inv, [one.name for one in cfg.served()])
    with caplog.at_level(logging.INFO, logger="launcher.plan.several"):
        assert preflight_models(cfg, inv, specs) is None
    assert "embeddings (no KV cache)" in caplog.text
    small = gpu_inventory(1.5)
    problem = preflight_models(cfg, small, place_models([one.workers for one in cfg.served()], small))
    assert problem is not None and "model 'embed': worker 1" in problem and "no KV cache" in problem
    alone = DeployConfig.model_validate({"model": {"name": embed}})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="launcher.plan.plan"):
        assert preflight(alone, inv, place_models([alone.workers], inv)) is None
    assert "inputs up to 256 tokens" in caplog.text and "full-length" not in caplog.text
