"""``model.name`` kinds, decided in one place for both loading and planning."""

from __future__ import annotations

import pytest

from launcher.models import ModelNotFound, classify


def test_each_kind_of_name(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMADEPLOY_CACHE", str(tmp_path / "cache"))
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text("{}")
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")

    embedded = classify("SmolLM2-135M-Instruct")
    assert (embedded.kind, embedded.name) == ("embedded", "smollm2-135m-instruct")
    assert embedded.converted == tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    assert (classify(str(tmp_path / "llama")).kind, classify(str(tmp_path / "llama")).path) == (
        "folder",
        tmp_path / "llama",
    )
    gguf = classify(str(tmp_path / "tiny.gguf"))
    assert (gguf.kind, gguf.converted) == ("gguf", tmp_path / "cache" / "models" / "tiny")
    assert classify("meta-llama/Llama-3.1-8B").kind == "hf"


@pytest.mark.parametrize(
    "name,words",
    [
        ("{tmp}", "has no config.json"),
        ("{tmp}/missing.gguf", "does not exist"),
        ("not-a-model", "is not the embedded default"),
    ],
)
def test_names_of_no_kind_say_why(tmp_path, name, words):
    with pytest.raises(ModelNotFound, match=words):
        classify(name.format(tmp=tmp_path))
