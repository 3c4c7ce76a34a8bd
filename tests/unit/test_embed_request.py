"""Pure parts of embeddings: the request's ``input`` forms and their 400s, ``dimensions`` and the
answer's encodings (router/embeddings), the task rule and the pooling spec read from a model's
files (worker/contract)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from router.embeddings.api import check_dimensions, shape
from router.embeddings.request import MAX_INPUTS, EmbeddingRequest, refuse_stream, split_input
from router.errors import ApiError
from worker.contract.embed_spec import EmbedSpec, EmbedSpecError, read_spec
from worker.contract.settings import ModelConfig
from worker.contract.tasks import TaskError, check_task, resolve_task

SPEC = EmbedSpec("mean", True, 384, 384, 256, matryoshka=False, encoder=True)
MATRYOSHKA = EmbedSpec("mean", True, 768, 768, 512, matryoshka=True, encoder=True)


def test_the_four_input_forms():
    assert split_input("a") == ["a"]
    assert split_input(["a", "b"]) == ["a", "b"]
    assert split_input([1, 2, 3]) == [[1, 2, 3]]
    assert split_input([[1], [2, 3]]) == [[1], [2, 3]]
    assert len(split_input(["x"] * MAX_INPUTS)) == MAX_INPUTS


def test_one_token_id_array_is_one_input_however_long():
    # its length counts tokens (the model's limit, or truncate: true, decides), not inputs
    assert split_input(list(range(MAX_INPUTS + 500))) == [list(range(MAX_INPUTS + 500))]


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ("", "empty string"),
        ([], "empty array"),
        (["x"] * (MAX_INPUTS + 1), "2049 items"),
        (["a", ""], "input[1] is an empty string"),
        (["a", 1], "input[1] is an integer"),
        ([1, "a"], "input[1] is a string"),
        ([[1], "a"], "input[1] is a string"),
        ([[1], []], "input[1] is an empty token-id array"),
        ([[1, True]], "input[0][1] is a boolean"),
        ([True], "input[0] is a boolean"),
        ([[[1]]], "input[0][0] is an array"),
        ([None], "input[0] is null"),
        (3, "not an integer"),
        ({"a": 1}, "not an object"),
        (["\ud800"], "lone surrogate"),
        ("\ud800", "lone surrogate"),  # a single string too (it reached the tokenizer: a 500)
    ],
)
def test_malformed_input_is_named(raw, named):
    with pytest.raises(ApiError) as err:
        split_input(raw)
    assert err.value.status == 400 and err.value.param == "input" and named in err.value.message


def test_stream_true_is_refused_as_embeddings_do_not_stream():
    # an SSE answer is not what comes back: ignoring it would change the answer's shape silently
    assert EmbeddingRequest.model_validate({"input": "a", "stream": False}).stream is False
    with pytest.raises(ApiError) as err:
        refuse_stream(EmbeddingRequest.model_validate({"input": "a", "stream": True}))
    assert err.value.status == 400 and err.value.param == "stream" and "does not stream" in err.value.message
    refuse_stream(EmbeddingRequest.model_validate({"input": "a", "stream": None}))


def test_dimensions_only_for_a_model_trained_for_them():
    assert check_dimensions(SPEC, None) is None and check_dimensions(SPEC, 384) is None
    with pytest.raises(ApiError, match="not trained"):
        check_dimensions(SPEC, 128)
    assert check_dimensions(MATRYOSHKA, 256) == 256
    with pytest.raises(ApiError, match="over"):
        check_dimensions(MATRYOSHKA, 1024)


def test_truncation_renormalises_and_base64_is_little_endian_float32():
    rng = np.random.default_rng(0)
    v = rng.standard_normal(768).astype("<f4")
    v /= np.linalg.norm(v)
    [cut] = shape([v.tobytes()], 256, "float")
    assert len(cut) == 256 and abs(np.linalg.norm(cut) - 1.0) < 1e-6
    assert np.allclose(np.array(cut) / cut[0], v[:256] / v[0], rtol=1e-5)  # the same direction
    [b64] = shape([v.tobytes()], None, "base64")
    assert np.array_equal(np.frombuffer(base64.b64decode(b64), "<f4"), v)
    [floats] = shape([v.tobytes()], None, "float")
    assert np.array_equal(np.array(floats, dtype=np.float32), v)


def write(folder, name: str, data) -> None:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def st_folder(tmp_path, pooling: dict, normalize: bool = True, extra: dict | None = None):
    write(tmp_path, "config.json", {"model_type": "bert", "hidden_size": 768, "max_position_embeddings": 512})
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    write(tmp_path, "modules.json", modules)
    write(tmp_path, "1_Pooling/config.json", pooling)
    write(tmp_path, "sentence_bert_config.json", {"max_seq_length": 384})
    for name, data in (extra or {}).items():
        write(tmp_path, name, data)
    return tmp_path


def test_spec_from_a_sentence_transformers_folder(tmp_path):
    spec = read_spec(st_folder(tmp_path, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}), 2048)
    assert (spec.pooling, spec.normalize, spec.dim, spec.max_tokens, spec.matryoshka) == ("cls", True, 768, 384, False)
    assert read_spec(tmp_path, 100).max_tokens == 100  # model.max_model_len caps it


def test_spec_new_pooling_key_no_normalize_and_truncate_dim(tmp_path):
    folder = st_folder(
        tmp_path,
        {"pooling_mode": "lasttoken"},
        normalize=False,
        extra={"config_sentence_transformers.json": {"truncate_dim": 256}},
    )
    spec = read_spec(folder, 2048)
    assert (spec.pooling, spec.normalize, spec.dim, spec.hidden, spec.matryoshka) == (
        "lasttoken",
        False,
        256,
        768,
        True,
    )


def test_spec_refuses_a_pooling_it_does_not_compute(tmp_path):
    with pytest.raises(EmbedSpecError, match="weightedmean"):
        read_spec(st_folder(tmp_path, {"pooling_mode": "weightedmean"}), 2048)


def test_a_plain_decoder_is_pooled_by_its_last_token(tmp_path):
    write(tmp_path, "config.json", {"model_type": "llama", "hidden_size": 576, "max_position_embeddings": 8192})
    spec = read_spec(tmp_path, 2048)
    assert (spec.pooling, spec.normalize, spec.dim, spec.max_tokens, spec.encoder) == (
        "lasttoken",
        True,
        576,
        2048,
        False,
    )


def test_the_task_rule(tmp_path):
    auto = ModelConfig(name="x")
    write(tmp_path / "llama", "config.json", {"model_type": "llama"})
    write(tmp_path / "bert", "config.json", {"model_type": "bert"})
    st = st_folder(tmp_path / "st", {"pooling_mode": "mean"})
    write(st, "config.json", {"model_type": "qwen3"})  # a decoder in sentence-transformers layout
    assert resolve_task(auto, tmp_path / "llama") == "generate"
    assert resolve_task(auto, tmp_path / "bert") == "embed"
    assert resolve_task(auto, st) == "embed"
    assert resolve_task(auto, tmp_path / "model.gguf") == "generate"
    assert resolve_task(auto, None) == "generate"
    assert resolve_task(ModelConfig(name="x", task="embed"), tmp_path / "llama") == "embed"


def test_generate_on_an_encoder_is_refused_in_one_line(tmp_path):
    # its worker would load a BERT as a decoder and die with an AttributeError, restart after restart
    write(tmp_path / "bert", "config.json", {"model_type": "bert"})
    write(tmp_path / "llama", "config.json", {"model_type": "llama"})
    with pytest.raises(TaskError) as err:
        check_task(ModelConfig(name="all-minilm-l6-v2", task="generate"), tmp_path / "bert")
    assert "all-minilm-l6-v2" in str(err.value) and "task: embed" in str(err.value)
    check_task(ModelConfig(name="x", task="auto"), tmp_path / "bert")
    check_task(ModelConfig(name="x", task="generate"), tmp_path / "llama")
    check_task(ModelConfig(name="x", task="generate"), tmp_path / "model.gguf")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_for_embeddings_are_refused(tmp_path, quantization):
    # the embedding worker loads float weights: the vectors were float32's while plan counted int8
    write(tmp_path / "bert", "config.json", {"model_type": "bert"})
    for task in ("auto", "embed"):
        with pytest.raises(TaskError) as err:
            check_task(ModelConfig(name="m", task=task, quantization=quantization), tmp_path / "bert")
        assert f"quantization: {quantization}" in str(err.value)
    check_task(ModelConfig(name="m", task="embed", quantization="none"), tmp_path / "bert")
    write(tmp_path / "llama", "config.json", {"model_type": "llama"})
    check_task(ModelConfig(name="m", quantization=quantization), tmp_path / "llama")


def test_the_router_resolves_task_auto_and_reads_the_spec(tmp_path):
    from router.serve import served_model

    folder = st_folder(tmp_path / "st", {"pooling_mode": "mean"})
    embed = served_model(ModelConfig(name="e"), str(folder), tokenizer=None)
    assert (embed.task, embed.embed_spec.pooling, embed.config.max_model_len) == ("embed", "mean", 384)
    write(tmp_path / "llama", "config.json", {"model_type": "llama"})
    chat = served_model(ModelConfig(name="c", max_model_len=2048), str(tmp_path / "llama"), tokenizer=None)
    assert (chat.task, chat.embed_spec, chat.config.max_model_len) == ("generate", None, 2048)
