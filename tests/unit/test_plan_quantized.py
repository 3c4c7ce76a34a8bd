"""plan with quantized weights (model.quantization): the sizing table's int8 rows served — 13B on
one 24 GB card, 70B over 2×48 GB or 4×24 GB — quantization recommended where it is what makes a
model fit, `plan --quantization`, and doctor's row. Injected GPUs, no processes."""

from __future__ import annotations

import json
from dataclasses import replace

from rich.console import Console
from typer.testing import CliRunner

from launcher import cli
from launcher.config import DeployConfig
from launcher.plan.doctor import quantization_check
from launcher.plan.layouts import TENSOR_PARALLEL, compare
from launcher.plan.placement import Inventory
from launcher.plan.plan import make_plan, parse_gpus
from launcher.plan.report import sizing_table
from launcher.plan.sizing import planned_budget
from tests.helpers.model_configs import LLAMA2, SMOLLM2_135M, llama2
from worker.contract.shapes import GgufTypes, from_hf_config, weight_bytes, weight_format
from worker.contract.units import GiB


def deploy(quantization: str = "auto", **workers) -> DeployConfig:
    return DeployConfig.model_validate({"model": {"quantization": quantization}, "workers": workers})


def on(gpus: str) -> Inventory:
    return Inventory(parse_gpus(gpus), list(range(8)), None, 64 * GiB)


def layout(plan) -> tuple[int, int, int]:
    rec = plan.recommendation
    return rec.replicas, rec.tensor_parallel_size, rec.gpus_per_replica


def test_13b_int8_fits_one_24gb_card_with_the_kv_room_it_leaves():
    plan = make_plan(deploy("int8"), on("1x24GB"), llama2("13B"))
    assert plan.ok, plan.errors
    s = plan.sizing
    assert (s.label, s.weights) == ("int8 + bfloat16", 13_025_054_720)
    assert layout(plan) == (1, 1, 1)  # data parallel: one replica per card
    tokens = planned_budget(plan.gpus, s, 0.9).tokens
    assert plan.fits[0].kv_room == tokens * s.kv_per_token and plan.fits[0].seqs == tokens // 2048 >= 3
    two = make_plan(deploy("int8"), on("2x24GB"), llama2("13B"))
    assert two.ok and layout(two) == (2, 1, 1) and len(two.fits) == 2


def test_13b_bfloat16_does_not_fit_one_24gb_card_and_int8_is_recommended():
    plan = make_plan(deploy(), on("1x24GB"), llama2("13B"))
    assert not plan.ok and plan.recommendation.replicas == 0
    int8 = make_plan(deploy("int8"), on("1x24GB"), llama2("13B"))
    tokens = int8.fits[0].kv_room // int8.sizing.kv_per_token
    note = plan.recommendation.note
    assert f"does not fit in bfloat16; fits with model.quantization: int8 — {tokens:,} tokens of KV cache" in note
    assert "gpus_per_replica: 1, replicas: 1" in note and "another engine" not in note
    assert "fits with model.quantization: int8" in plan.errors[0]  # the fix `up` prints


def test_70b_int8_is_tensor_parallel_2_over_two_48gb_cards():
    plan = make_plan(deploy("int8"), on("2x48GB"), llama2("70B"))
    assert layout(plan) == (1, 2, 1)
    tp = make_plan(deploy("int8", tensor_parallel_size=2), on("2x48GB"), llama2("70B"))
    assert tp.ok, tp.errors
    assert tp.fits[0].seqs == compare(tp.sizing, tp.gpus, 0.9)[1].seqs >= 1
    assert not make_plan(deploy(), on("2x48GB"), llama2("70B")).ok  # 128 GiB of bfloat16 do not fit


def test_70b_int8_is_tensor_parallel_4_over_four_24gb_cards():
    plan = make_plan(deploy("int8"), on("4x24GB"), llama2("70B"))
    assert layout(plan) == (1, 4, 1)
    tp = {lay.kind: lay for lay in compare(plan.sizing, plan.gpus, 0.9)}[TENSOR_PARALLEL]
    assert tp.gpus_per_replica == 4 and tp.fits  # two 24 GB cards cannot hold 32.6 GiB per rank


def test_7b_bfloat16_on_one_24gb_card_is_unchanged():
    plan = make_plan(deploy(), on("1x24GB"), llama2("7B"))
    assert plan.ok and layout(plan) == (1, 1, 1)
    assert plan.sizing.label == "bfloat16" and plan.sizing.weights == 2 * llama2("7B").params
    assert plan.recommendation.note == ""


def test_70b_on_one_80gb_card_is_recommended_int4_when_int8_does_not_fit():
    # 80e9 bytes: 67.1 GiB usable; int8's 64.3 GiB of weights + allowance + activations exceed it
    plan = make_plan(deploy(), on("1x80GB"), llama2("70B"))
    assert not plan.ok
    assert "fits with model.quantization: int4" in plan.recommendation.note


def test_cpu_workers_count_quantized_weights_in_their_ram():
    plan = make_plan(deploy("int8", devices="cpu"), Inventory([], [0, 1], None, 64 * GiB), llama2("7B"))
    assert plan.sizing.label == "int8 + float32"  # auto on a CPU without bf16: embeddings in float32
    assert plan.sizing.weights == weight_bytes(llama2("7B"), "float32", weight_format("int8", None)).total
    assert plan.fits[0].budget < make_plan(deploy(devices="cpu"), Inventory([], [0, 1]), llama2("7B")).fits[0].budget


def test_a_gguf_file_under_auto_is_planned_as_stored_and_unservable_types_warned():
    shape = from_hf_config(SMOLLM2_135M, "smollm2")
    plan = make_plan(deploy(devices="cpu"), Inventory([], [0]), replace(shape, gguf_types=GgufTypes("Q4_1", "Q8_0")))
    assert plan.sizing.label == "Q4_1 + float32" and plan.sizing.fmt.linear.group == 32
    odd = make_plan(deploy(), on("1x24GB"), replace(shape, gguf_types=GgufTypes("Q4_K+Q6_K", "Q4_K", "Q6_K")))
    assert any("not Q6_K" in w for w in odd.warnings) and odd.sizing.label == "bfloat16"


def test_the_sizing_table_has_int8_and_int4_rows_and_marks_the_planned_one():
    plan = make_plan(deploy("int8"), on("1x24GB"), llama2("13B"))
    console = Console(width=250, record=True)
    console.print(sizing_table(plan, deploy("int8")))
    text = console.export_text()
    assert "int8 + bfloat16 *" in text and "int4 + bfloat16" in text and "bfloat16/float16" in text
    assert f"{13_025_054_720 / 10**9:.2f}" in text  # int8 weights GB
    row = next(line for line in text.splitlines() if "int8 + bfloat16 *" in line)
    assert row.rstrip(" │").endswith("1")  # one GPU per replica


def test_plan_command_takes_quantization(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2["13B"], "vocab_size": 32000}))
    runner = CliRunner()
    args = ["plan", "--model", str(tmp_path), "--gpus", "1x24GB"]
    fits = runner.invoke(cli.app, [*args, "--quantization", "int8"])
    assert fits.exit_code == 0, fits.output
    assert "int8 + bfloat16 *" in fits.output and "replicas: 1, gpus_per_replica: 1" in fits.output
    bf16 = runner.invoke(cli.app, args)  # does not fit as configured: plan answers with int8
    assert bf16.exit_code == 0 and "The configured layout does not fit" in bf16.output, bf16.output
    assert "Set in deploy.yaml:\nmodel:\n  quantization: int8" in bf16.output
    wrong = runner.invoke(cli.app, [*args, "--dtype", "int8"])
    assert wrong.exit_code == 2 and "--quantization int8" in wrong.output
    bad = runner.invoke(cli.app, [*args, "--quantization", "int3"])
    assert bad.exit_code == 2 and "quantization" in bad.output


def test_doctor_shows_the_quantization_in_effect_and_its_weight_bytes():
    row = quantization_check(deploy("int8"), on("1x24GB"), llama2("13B"))
    assert row.status == "ok"
    assert "model.quantization: int8 → int8 at load: linear layers 8 bits + a float32 scale per output" in row.detail
    assert "weights 12.13 GiB = 11.82 GiB linear layers + 0.31 GiB embeddings, LM head and norms" in row.detail
    assert quantization_check(deploy(), on("1x24GB"), None).status == "skip"
    shape = from_hf_config(SMOLLM2_135M, "smollm2")
    odd = quantization_check(deploy(), on("1x24GB"), replace(shape, gguf_types=GgufTypes("Q6_K", "Q6_K")))
    assert odd.status == "warn" and "not Q6_K" in odd.detail
