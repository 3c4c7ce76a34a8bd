"""The router's tokenizer (router/tokenizer.py) is AutoTokenizer's, loaded without torch where the
class is known: for each cached model folder, the same class, ids, chat template and special tokens
as ``AutoTokenizer.from_pretrained``; other folders go through AutoTokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from router.tokenizer import DIRECT, direct_class, load_tokenizer

MODELS = Path.home() / ".cache/llamadeploy/models"
FOLDERS = ["smollm2-135m-instruct", "smollm2-135m-instruct.gguf", "all-minilm-l6-v2"]
TEXTS = [
    "Summarise the following document in three sentences.",
    "  leading spaces, tabs\tand\nnewlines; ünïcödé, 日本語, emoji 🦙",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "",
]
CHAT = [
    {"role": "system", "content": "You extract keywords as JSON."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def cached(name: str) -> Path:
    path = MODELS / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"{name} is not cached")
    return path


@pytest.mark.parametrize("name", FOLDERS)
def test_a_cached_folder_loads_directly_as_autotokenizer_does(name):
    from transformers import AutoTokenizer

    path = cached(name)
    assert direct_class(path) is not None, "every model the suite serves loads without torch"
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    assert len(ours) == len(auto) and ours.get_vocab() == auto.get_vocab()
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        auto.eos_token_id,
        auto.bos_token_id,
        auto.pad_token_id,
    )
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        assert ours(text, add_special_tokens=False)["input_ids"] == auto(text, add_special_tokens=False)["input_ids"]
        ids = auto(text)["input_ids"]
        assert ours.decode(ids) == auto.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert (
        ours(TEXTS, truncation=True, max_length=8)["input_ids"]
        == auto(TEXTS, truncation=True, max_length=8)["input_ids"]
    )
    assert ours.chat_template == auto.chat_template
    if auto.chat_template:
        for prompt in (True, False):
            kwargs = {"add_generation_prompt": prompt, "tokenize": False}
            assert ours.apply_chat_template(CHAT, **kwargs) == auto.apply_chat_template(CHAT, **kwargs)


def test_the_router_loads_its_tokenizer_without_importing_torch():
    path = cached("smollm2-135m-instruct")
    code = (
        "import sys; from router.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(path)!r}); t.apply_chat_template([{{'role': 'user', 'content': 'hi'}}], "
        "tokenize=False); import router.serve; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def write(folder: Path, config: dict, tokenizer_config: dict, tokenizer_json: bool = True) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if tokenizer_json:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def test_only_a_known_pair_with_a_tokenizer_json_and_no_remote_code_loads_directly(tmp_path):
    plain = {"tokenizer_class": "TokenizersBackend"}
    assert direct_class(write(tmp_path / "a", {"model_type": "llama"}, plain)) == "TokenizersBackend"
    assert direct_class(write(tmp_path / "b", {"model_type": "bert"}, {"tokenizer_class": "BertTokenizer"})) == (
        "BertTokenizer"
    )
    # qwen2 declaring the generic class gets Qwen2Tokenizer from AutoTokenizer (its hub class is known wrong)
    assert direct_class(write(tmp_path / "c", {"model_type": "qwen2"}, plain)) is None
    assert direct_class(write(tmp_path / "d", {"model_type": "llama"}, {"tokenizer_class": "LlamaTokenizer"})) is None
    remote = {**plain, "auto_map": {"AutoTokenizer": ["x.Tok", None]}}
    assert direct_class(write(tmp_path / "e", {"model_type": "llama"}, remote)) is None
    assert direct_class(write(tmp_path / "f", {"model_type": "llama"}, plain, tokenizer_json=False)) is None
    assert direct_class(tmp_path / "missing") is None
    assert direct_class(write(tmp_path / "g", {}, plain)) is None


def test_every_direct_class_is_a_transformers_class():
    import transformers

    for name in DIRECT.values():
        assert hasattr(transformers, name)
