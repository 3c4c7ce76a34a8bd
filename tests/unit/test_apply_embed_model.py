"""``apply`` on a deployment of an embedding model: the router's live settings keep the model an
embedding model (its pooling spec and its per-input token limit), whether the file changes only
router keys, a worker key (``max_num_seqs``) or the served name. They were served as a model
without a spec: every ``/v1/embeddings`` after an apply was a 500."""

from __future__ import annotations

import json

from router.rollout import AdminTokens, apply_live
from router.served import served_model
from router.settings import RouterSettings
from router.state import Api
from router.workers import WorkerPool
from worker.contract.settings import ModelConfig


def _folder(path):
    files = {
        "config.json": {"model_type": "bert", "hidden_size": 384, "max_position_embeddings": 512},
        "modules.json": [
            {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ],
        "1_Pooling/config.json": {"pooling_mode": "mean"},
        "sentence_bert_config.json": {"max_seq_length": 256},
    }
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(json.dumps(data))
    return path


def _api(folder, section: dict) -> Api:
    cfg = RouterSettings.model_validate({"model": section})
    one = served_model(cfg.model, str(folder), tokenizer=None)
    pool = WorkerPool("inproc://apply-embed", "least_loaded", heartbeat_timeout_s=10)
    return Api(cfg, pool, models={one.name: one})


def _apply(api: Api, section: dict, router: dict | None = None, also: list | None = None) -> None:
    cfg = RouterSettings.model_validate({"model": section, "router": router or {}})
    apply_live(api, AdminTokens(None), cfg, [ModelConfig.model_validate(m) for m in also or []])


def test_router_keys_only_keep_the_served_model_as_it_was(tmp_path):
    section = {"name": "all-minilm-l6-v2", "task": "embed"}
    api = _api(_folder(tmp_path), section)
    before = api.default_model
    _apply(api, section, router={"policy": "round_robin"})
    assert api.default_model is before and api.default_model.embed_spec.max_tokens == 256


def test_a_rolling_change_keeps_the_spec_and_the_token_limit(tmp_path):
    api = _api(_folder(tmp_path), {"name": "all-minilm-l6-v2", "task": "embed"})
    _apply(api, {"name": "all-minilm-l6-v2", "task": "embed", "max_model_len": 128})
    assert api.default_model.task == "embed" and api.default_model.embed_spec.pooling == "mean"
    assert api.default_model.embed_spec.max_tokens == 128 and api.default_model.config.max_model_len == 128


def test_a_rename_serves_both_names_as_embedding_models(tmp_path):
    old = {"name": "all-minilm-l6-v2", "task": "auto"}
    api = _api(_folder(tmp_path), old)
    _apply(api, {**old, "served_name": "minilm"}, also=[old])
    assert list(api.models) == ["minilm", "all-minilm-l6-v2"]
    assert all(m.task == "embed" and m.embed_spec.max_tokens == 256 for m in api.models.values())


def test_several_models_each_keep_their_own_folder_tokenizer_and_spec(tmp_path):
    """A ``models:`` deployment (chat beside embeddings): an apply's sections replace each model
    by its name, each read from its own folder with its own tokenizer; the unchanged one is kept."""
    chat_dir, emb_dir = tmp_path / "chat", _folder(tmp_path / "emb")
    chat_dir.mkdir()
    (chat_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    chat_tok, emb_tok = object(), object()
    sections = [{"name": "chat"}, {"name": "emb", "task": "auto"}]
    cfg = RouterSettings.model_validate({"models": sections})
    models = {
        "chat": served_model(cfg.models[0], str(chat_dir), chat_tok),
        "emb": served_model(cfg.models[1], str(emb_dir), emb_tok),
    }
    api = Api(cfg, WorkerPool("inproc://apply-two", "least_loaded", heartbeat_timeout_s=10), models=models)
    emb_before = api.models["emb"]
    new = RouterSettings.model_validate({"models": [{"name": "chat", "max_model_len": 512}, sections[1]]})
    apply_live(api, AdminTokens(None), new, [])
    chat, emb = api.models["chat"], api.models["emb"]
    assert (chat.task, chat.path, chat.tokenizer, chat.config.max_model_len) == (
        "generate",
        str(chat_dir),
        chat_tok,
        512,
    )
    assert emb is emb_before and emb.embed_spec.max_tokens == 256  # unchanged: kept as it was
    assert api.default_model is chat and list(api.models) == ["chat", "emb"]
