"""Command-line flags (``load_config``'s overrides) on a deploy.yaml with a ``models:`` list."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from launcher.cli import app
from launcher.config import ConfigError, load_config

TWO = """
models:
  - name: smollm2-135m-instruct
  - name: smollm2-135m-instruct
    served_name: second
    max_model_len: 512
    workers: {replicas: 1}
workers: {devices: cpu, replicas: 2}
"""


@pytest.fixture
def two(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(TWO)
    return path


def test_a_model_flag_applies_to_every_entry_instead_of_blaming_the_file(two):
    cfg = load_config(two, {"model.quantization": "int8", "model.max_model_len": 256})
    assert [(s.model.quantization, s.model.max_model_len) for s in cfg.served()] == [("int8", 256), ("int8", 256)]
    assert [s.name for s in cfg.served()] == ["smollm2-135m-instruct", "second"]


def test_a_workers_flag_overrides_the_key_in_an_entry_too(two):
    cfg = load_config(two, {"workers.replicas": 3})
    assert [s.workers.replicas for s in cfg.served()] == [3, 3]


def test_the_model_name_flag_with_a_models_list_is_one_clear_line(two):
    with pytest.raises(ConfigError) as err:
        load_config(two, {"model.name": "other"})
    assert "models:" in str(err.value) and "model.name" in str(err.value)
    assert "not both" not in str(err.value)


@pytest.mark.parametrize(
    "entry, says",
    [
        (
            "name: /nonexistent/m.gguf\n    served_name: second",
            ("models[1] (second)", "/nonexistent/m.gguf does not exist"),
        ),
        (
            "name: all-minilm-l6-v2\n    task: generate",
            ("models[1] (all-minilm-l6-v2)", "no LM head"),
        ),  # as up refuses it
    ],
)
def test_plan_names_the_models_entry_it_refuses(tmp_path, entry, says):
    path = tmp_path / "deploy.yaml"
    path.write_text(f"models:\n  - name: smollm2-135m-instruct\n  - {entry}\nworkers: {{devices: cpu, replicas: 1}}\n")
    result = CliRunner().invoke(app, ["plan", str(path)])
    assert result.exit_code == 2 and all(part in result.output for part in says)
