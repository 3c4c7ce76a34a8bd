"""doctor on an embedding model: its rows size it as ``plan`` does (weights without an LM head and
one step's activations, no KV cache), alone and beside a chat model; no kernel table is measured."""

from __future__ import annotations

import pytest

from launcher.config import DeployConfig
from launcher.plan import doctor_kernels
from launcher.plan.doctor import deployment_checks, kernels_check, model_check, models_checks, quantization_check
from launcher.plan.placement import Inventory
from tests.helpers.model_configs import minilm_folder
from worker.contract.units import GiB

CPU = Inventory([], [0, 1], None, 64 * GiB)


@pytest.fixture
def measured(monkeypatch):
    """The models whose kernel table doctor measured (none is measured here)."""
    seen: list[str] = []
    monkeypatch.setattr(doctor_kernels, "kernel_check", lambda cfg, *a: seen.append(cfg.model.name) or ("ok", "", ""))
    return seen


def one_embed_model(folder: str, **model) -> DeployConfig:
    return DeployConfig.model_validate(
        {"model": {"name": folder, **model}, "workers": {"devices": "cpu", "replicas": 1}}
    )


def test_an_embedding_model_is_sized_without_kv_cache(tmp_path, measured):
    cfg = one_embed_model(minilm_folder(tmp_path))  # task: auto, a sentence-transformers folder
    model, shape = model_check(cfg.model)
    assert shape.embed is not None and "embeddings, 22.6 M parameters (no LM head)" in model.detail
    memory = deployment_checks(cfg, CPU, shape)[-1]
    assert memory.name == "memory plan" and memory.status == "ok", memory
    assert "no KV cache" in memory.detail and "inputs up to 256 tokens" in memory.detail
    assert "sequences of" not in memory.detail  # not sized as a chat model
    quantization = quantization_check(cfg, CPU, shape)
    assert (
        quantization.status == "ok"
        and "float weights" in quantization.detail
        and "LM head and norms" not in (quantization.detail)
    )
    kernels = kernels_check(cfg, CPU, shape)
    assert kernels.status == "ok" and "measures its encoder's float kernels at load" in kernels.detail
    assert measured == []  # not the chat model's decoder shapes


def test_int8_on_an_embedding_model_fails_as_up_refuses_it(tmp_path):
    cfg = one_embed_model(minilm_folder(tmp_path), quantization="int8")
    _, shape = model_check(cfg.model)
    row = quantization_check(cfg, CPU, shape)
    assert row.status == "fail" and "run with float weights" in row.detail and row.fix


def test_beside_a_chat_model_the_embedding_models_plan_has_no_kv_cache(tmp_path, measured):
    cfg = DeployConfig.model_validate(
        {
            "workers": {"devices": "cpu", "replicas": 1},
            "models": [
                {"name": "smollm2-135m-instruct", "max_model_len": 2048},  # 8 full-length sequences in 1 GiB
                {"name": minilm_folder(tmp_path), "served_name": "mini"},
            ],
        }
    )
    rows = {r.name: r for r in models_checks(cfg, CPU)}
    assert "embeddings, 22.6 M parameters" in rows["'mini': model"].detail
    memory = rows["memory plan"]
    assert memory.status == "ok", memory
    chat, embed = memory.detail.split(" worker 1:")
    assert "full-length sequence" in chat and "embeddings (no KV cache)" in embed
    assert measured == ["smollm2-135m-instruct"]
