"""The RAM check of CPU workers names what to change for what is over it: a chat worker's
``kv_cache_gib``, an embedding worker's step (``max_prefill_tokens``; it keeps no KV cache)."""

from __future__ import annotations

import pytest

from launcher.config import DeployConfig
from launcher.plan.placement import Inventory
from launcher.plan.plan import make_plan
from launcher.plan.several import plan_models
from launcher.plan.shape import read_shape
from tests.helpers.model_configs import SMOLLM2_135M, minilm_folder
from worker.contract.settings import ModelConfig
from worker.contract.shapes import from_hf_config
from worker.contract.units import GiB

SMOLLM2 = from_hf_config(SMOLLM2_135M, "smollm2-135m")
TINY_RAM = Inventory([], [0, 1, 2, 3], None, int(0.2 * GiB))  # less than any worker needs


@pytest.fixture
def minilm(tmp_path):
    folder = minilm_folder(tmp_path)
    return read_shape(folder, ModelConfig(name=folder))


def test_embedding_workers_alone_are_not_told_to_lower_a_kv_cache(minilm):
    cfg = DeployConfig.model_validate({"model": {"name": "e"}, "workers": {"devices": "cpu", "replicas": 2}})
    (error,) = make_plan(cfg, TINY_RAM, minilm).errors
    assert error.startswith("CPU workers need") and "keeps no KV cache" in error
    assert "kv_cache_gib" not in error and error.endswith(
        "lower replicas or workers.max_prefill_tokens (an embedding worker's step)"
    )


def test_chat_workers_alone_are_told_kv_cache_gib():
    cfg = DeployConfig.model_validate({"workers": {"devices": "cpu", "replicas": 1}})
    errors = [e for e in make_plan(cfg, TINY_RAM, SMOLLM2).errors if e.startswith("CPU workers need")]
    assert len(errors) == 1 and errors[0].endswith("lower replicas or workers.kv_cache_gib")
    assert "max_prefill_tokens" not in errors[0]


def test_chat_beside_embeddings_names_each_kind_and_each_model(minilm):
    cfg = DeployConfig.model_validate(
        {
            "workers": {"devices": "cpu", "replicas": 1},
            "models": [{"name": "chat"}, {"name": "embed", "task": "embed"}],
        }
    )
    (error,) = plan_models(cfg, TINY_RAM, [SMOLLM2, minilm]).errors
    assert "together ('chat'" in error and "'embed'" in error
    assert "kv_cache_gib per chat worker" in error and "per embedding worker, which keeps no KV cache" in error
    assert error.endswith(
        "lower replicas, workers.kv_cache_gib or workers.max_prefill_tokens (an embedding worker's step)"
    )
