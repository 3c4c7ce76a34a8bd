"""Several models' replicas packed onto injected GPUs and cores, and the plan of them together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from launcher import cli
from launcher.config import DeployConfig
from launcher.plan.packing import place_models
from launcher.plan.placement import GpuInfo, Inventory, PlacementError, place
from launcher.plan.several import plan_models
from tests.helpers.deployment import free_port
from tests.helpers.model_configs import SMOLLM2_135M, llama2
from worker.contract.settings import WorkersConfig
from worker.contract.shapes import from_hf_config
from worker.contract.units import GiB

SMOLLM2 = from_hf_config(SMOLLM2_135M, "smollm2-135m")


def gpu(i: int, total_gib: float = 80) -> GpuInfo:
    return GpuInfo(i, "GPU", f"GPU-{i:08x}", int(total_gib * GiB), int(total_gib * GiB))


def inventory(n_gpus: int = 0, cores: int = 12, ram_gib: float = 64, total_gib: float = 80) -> Inventory:
    return Inventory([gpu(i, total_gib) for i in range(n_gpus)], list(range(cores)), None, int(ram_gib * GiB))


def w(**kw) -> WorkersConfig:
    return WorkersConfig(**kw)


def layout(specs) -> list[tuple]:
    return [(s.worker_id, s.model, s.device, s.gpus or s.cpus, round(s.share, 2)) for s in specs]


def test_one_model_is_placed_as_today():
    inv = inventory(4)
    assert place_models([w(workers_per_gpu=2, replicas=6)], inv) == place(w(workers_per_gpu=2, replicas=6), inv)


def test_cpu_cores_are_split_among_all_replicas_of_all_models():
    specs = place_models([w(devices="cpu", replicas=2), w(devices="cpu", replicas=1)], inventory(cores=12))
    assert layout(specs) == [
        (0, 0, "cpu", (0, 1, 2, 3), 1.0),
        (1, 0, "cpu", (4, 5, 6, 7), 1.0),
        (2, 1, "cpu", (8, 9, 10, 11), 1.0),
    ]


def test_more_cpu_replicas_than_cores_names_the_models():
    with pytest.raises(PlacementError) as e:
        place_models([w(devices="cpu", replicas=2), w(devices="cpu", replicas=2)], inventory(cores=3), ["a", "b"])
    assert "'a' 2, 'b' 2: 4 in all" in str(e.value) and "only 3 cores" in str(e.value)


def test_a_small_model_shares_a_gpu_with_another_models_replica():
    specs = place_models([w(), w(replicas=1)], inventory(2))  # chat on every GPU, one embedder
    assert layout(specs) == [(0, 0, "cuda", (0,), 0.5), (1, 0, "cuda", (1,), 1.0), (2, 1, "cuda", (0,), 0.5)]


def test_a_later_model_starts_on_the_least_used_gpu():
    specs = place_models([w(replicas=1), w(replicas=1)], inventory(2))
    assert layout(specs) == [(0, 0, "cuda", (0,), 1.0), (1, 1, "cuda", (1,), 1.0)]


def test_a_gpu_model_beside_a_cpu_model_gets_no_core_split():
    specs = place_models([w(), w(devices="cpu", replicas=1)], inventory(1, cores=8))
    assert layout(specs) == [(0, 0, "cuda", (0,), 1.0), (1, 1, "cpu", tuple(range(8)), 1.0)]


def test_a_placement_error_names_its_model():
    with pytest.raises(PlacementError, match=r"model 'embed': workers.devices names GPU \[5\]"):
        place_models([w(), w(devices=[5])], inventory(2), ["chat", "embed"])


def two_models(**top) -> DeployConfig:
    return DeployConfig.model_validate(
        {
            "models": [
                {"name": "chat", "dtype": "float32"},
                {"name": "embed", "dtype": "float32", "workers": {"replicas": 1}},
            ],
            "workers": top,
        }
    )


def test_two_small_models_fit_on_cpu_and_the_split_names_each_model():
    result = plan_models(two_models(devices="cpu", replicas=1), inventory(cores=4), [SMOLLM2, SMOLLM2])
    assert result.ok, result.errors
    lines = result.split()
    assert lines[0].startswith("worker 0: model 'chat' on cpu[0,1]") and lines[1].startswith(
        "worker 1: model 'embed' on cpu[2,3]"
    )


def test_cpu_ram_is_checked_across_models_in_one_line():
    result = plan_models(
        two_models(devices="cpu", replicas=1, kv_cache_gib=1.0), inventory(cores=4, ram_gib=1.5), [SMOLLM2, SMOLLM2]
    )
    assert len(result.errors) == 1, result.errors
    assert result.errors[0].startswith("CPU workers need") and "together ('chat'" in result.errors[0]


def test_a_shared_gpu_too_small_for_both_is_refused_naming_the_model():
    big = llama2("7B")  # ~12.6 GiB of float16 weights: alone it fits a 24 GB card, with half of it not
    cfg = DeployConfig.model_validate(
        {"models": [{"name": "chat", "dtype": "float16"}, {"name": "small", "dtype": "float16"}]}
    )
    alone = plan_models(cfg.model_copy(update={"models": cfg.models[:1]}), inventory(1, total_gib=24), [big])
    assert alone.ok, alone.errors
    result = plan_models(cfg, inventory(1, total_gib=24), [big, SMOLLM2])
    assert [s.share for p in result.plans for s in p.specs] == [0.5, 0.5]
    assert len(result.errors) == 1 and result.errors[0].startswith("model 'chat': worker 0 (cuda[0])"), result.errors


def two_model_file(tmp_path, second: str) -> Path:
    """Two entries of the same config folder; ``second``: the second entry's own keys."""
    model = tmp_path / "model"  # its own config folder: the plan never needs the model cache
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(SMOLLM2_135M))
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        f"models:\n  - {{name: {model}, served_name: chat}}\n"
        f"  - {{name: {model}, served_name: small, {second}}}\n"
        f"router: {{port: {free_port()}, admin_port: {free_port()}}}\n"
        "workers: {devices: cpu, replicas: 1}\n"
    )
    return deploy


def test_plan_command_shows_the_split_per_model_and_one_line_per_problem(tmp_path):
    fits = CliRunner().invoke(cli.app, ["plan", str(two_model_file(tmp_path, "workers: {kv_cache_gib: 0.5}"))])
    assert fits.exit_code == 0, fits.output
    assert "model chat" in fits.output and "model small" in fits.output
    assert "worker 0: model 'chat' on cpu[" in fits.output and "worker 1: model 'small' on cpu[" in fits.output
    refused = CliRunner().invoke(cli.app, ["plan", str(two_model_file(tmp_path, "workers: {kv_cache_gib: 0.001}"))])
    assert refused.exit_code == 1
    errors = [line for line in refused.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: model 'small': worker 1"), refused.output


def test_up_places_every_model_and_passes_one_folder_per_model(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(cli, "serve", lambda *a: started.append(a) or 0)
    monkeypatch.setattr(
        "launcher.models.resolve_model", lambda name, progress=True, quantization="auto": Path(f"/m/{quantization}")
    )
    deploy = two_model_file(tmp_path, "quantization: int8")
    done = CliRunner().invoke(cli.app, ["up", str(deploy)])
    assert done.exit_code == 0, done.output
    ((cfg, specs, paths),) = started
    assert [(s.worker_id, s.model) for s in specs] == [(0, 0), (1, 1)]
    assert paths == [Path("/m/auto"), Path("/m/int8")]
    assert [one.name for one in cfg.served()] == ["chat", "small"]
