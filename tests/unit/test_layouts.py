"""Data parallel, tensor parallel or layer split: plan's choice for Llama-2 7B/13B/70B in FP16 on
common GPU inventories, the side-by-side table, and `up` refusing a tensor-parallel size the
model or the machine cannot take (exit 2, before anything starts)."""

from __future__ import annotations

import json
import logging

import pytest
from rich.console import Console
from typer.testing import CliRunner

from launcher import cli
from launcher.config import DeployConfig
from launcher.plan.layouts import DATA_PARALLEL, LAYER_SPLIT, TENSOR_PARALLEL, choose, compare, tp_unavailable
from launcher.plan.placement import GpuInfo, Inventory, WorkerSpec
from launcher.plan.plan import make_plan, parse_gpus, recommend
from launcher.plan.report import layouts_table, render
from launcher.plan.sizing import planned_budget, size, tp_rank_weights
from tests.helpers.model_configs import LLAMA2, SMOLLM2_135M, deploy_file, llama2
from worker.contract.units import GiB


def fp16(name: str, max_model_len: int = 2048, max_num_seqs: int = 8):
    return size(llama2(name), "float16", max_model_len, max_num_seqs, 8192)  # GPU auto: 8192-token idle prefill


def advice(name: str, gpus: str):
    rec = recommend(fp16(name), parse_gpus(gpus), DeployConfig())
    return rec.replicas, rec.tensor_parallel_size, rec.gpus_per_replica


@pytest.mark.parametrize(
    "model, gpus, expected",
    [
        ("7B", "1x24GB", (1, 1, 1)),  # ~13.5 GB of weights fit one 24 GB card: data parallel
        ("7B", "2x24GB", (2, 1, 1)),  # ... and one replica per card beats splitting it
        ("13B", "1x24GB", (0, 1, 0)),  # ~26 GB of weights: not on one 24 GB card, nothing to split over
        ("13B", "2x24GB", (1, 2, 1)),  # TP 2 over two 24 GB cards
        ("13B", "1x48GB", (1, 1, 1)),  # one 48 GB card holds it: no split at all
        ("70B", "4x80GB", (1, 4, 1)),  # ~138 GB: not on one 80 GB card; TP 4
        ("70B", "1x80GB", (0, 1, 0)),
    ],
)
def test_the_layout_advice_for_llama_2_in_fp16(model, gpus, expected):
    assert advice(model, gpus) == expected


def test_on_a_ray_cluster_tensor_parallel_is_not_offered():
    ray = DeployConfig.model_validate({"cluster": {"backend": "ray"}})
    tp = {lay.kind: lay for lay in compare(fp16("13B"), parse_gpus("2x24GB"), 0.9, tp_unavailable(ray))}
    assert not tp[TENSOR_PARALLEL].fits and "cluster.backend: ray" in tp[TENSOR_PARALLEL].why_not
    rec = recommend(fp16("13B"), parse_gpus("2x24GB"), ray)
    assert (rec.tensor_parallel_size, rec.gpus_per_replica) == (1, 2)  # the layer split is what is left
    assert "tensor parallel is local only" in rec.note
    assert tp_unavailable(DeployConfig()) == ""


def test_13b_on_one_24gb_card_says_it_does_not_fit_and_what_would():
    rec = recommend(fp16("13B"), parse_gpus("1x24GB"), DeployConfig())
    assert "float16 needs" in rec.note and "int8-quantized" in rec.note


def test_70b_tp_2_on_80gb_cards_fits_one_sequence_so_tp_4_is_chosen():
    s, gpus = fp16("70B"), parse_gpus("4x80GB")
    two = planned_budget(gpus[:2], s, 0.9, tp=2).tokens // s.max_model_len
    four = planned_budget(gpus, s, 0.9, tp=4).tokens // s.max_model_len
    assert 1 <= two < s.max_num_seqs <= four  # TP 2 fits, but holds less than one batch
    tp = {lay.kind: lay for lay in compare(s, gpus, 0.9)}[TENSOR_PARALLEL]
    assert (tp.gpus_per_replica, tp.seqs) == (4, four)


def test_a_rank_holds_its_share_of_the_matrices_and_the_whole_embeddings():
    s = fp16("70B")
    embeddings = 2 * 32000 * 8192 * 2  # embed_tokens and lm_head, 16-bit
    rank = tp_rank_weights(s, 4)
    assert s.weights / 4 < rank < s.weights / 4 + embeddings
    assert rank == pytest.approx((s.weights - embeddings) / 4 + embeddings, rel=1e-3)


def test_the_three_layouts_side_by_side():
    layouts = compare(fp16("13B"), parse_gpus("2x24GB"), 0.9)
    assert [lay.kind for lay in layouts] == [DATA_PARALLEL, TENSOR_PARALLEL, LAYER_SPLIT]
    dp, tp, split = layouts
    assert not dp.fits and "no room for one 2048-token sequence" in dp.why_not
    assert tp.fits and split.fits and (tp.gpus_per_replica, tp.replicas) == (2, 1)
    assert choose(layouts) is tp  # both fit: the split is not chosen while TP divides the model
    plan = make_plan(DeployConfig(), Inventory(parse_gpus("2x24GB"), [0]), llama2("13B"), "float16")
    console = Console(width=200, record=True)
    console.print(layouts_table(layouts, plan))
    text = console.export_text()
    assert "tensor parallel *" in text and "tensor_parallel_size: 2" in text
    assert f"{tp.kv_room / GiB:.2f}" in text and "gpus_per_replica: 2" in text
    console.print(render(plan, DeployConfig()))
    assert "replicas: 1, tensor_parallel_size: 2" in console.export_text()


def test_a_layer_split_where_no_tensor_parallel_size_divides_the_model():
    s = size(llama2("13B", num_key_value_heads=5), "float16", 2048, 8, 8192)
    tp = compare(s, parse_gpus("2x24GB"), 0.9)[1]
    assert not tp.fits and "no size from 2 to 2 divides the model's 40 attention heads, 5 KV heads" in tp.why_not
    assert choose(compare(s, parse_gpus("2x24GB"), 0.9)).kind == LAYER_SPLIT


def test_a_tensor_parallel_worker_is_planned_per_rank():
    gpus = parse_gpus("2x24GB")
    cfg = DeployConfig.model_validate({"workers": {"tensor_parallel_size": 2}})
    plan = make_plan(cfg, Inventory(gpus, [0]), llama2("13B"), "float16")
    assert plan.ok, plan.errors
    assert [f.spec.tp for f in plan.fits] == [2]
    assert plan.fits[0].seqs == compare(plan.sizing, gpus, 0.9)[1].seqs
    split = make_plan(
        DeployConfig.model_validate({"workers": {"tensor_parallel_size": 3}}),
        Inventory(parse_gpus("3x24GB"), [0]),
        llama2("13B"),
        "float16",
    )
    assert any(
        "workers.tensor_parallel_size: 3 does not divide the model's 40 attention heads" in e for e in split.errors
    )


def test_cpu_ranks_each_count_a_process_and_their_part_of_the_weights():
    cfg = DeployConfig.model_validate({"workers": {"devices": "cpu", "tensor_parallel_size": 2}})
    one, two = (
        make_plan(DeployConfig.model_validate({"workers": {"devices": "cpu"}}), Inventory([], [0, 1]), llama2("7B")),
        make_plan(cfg, Inventory([], [0, 1]), llama2("7B")),
    )
    assert two.fits[0].budget > one.fits[0].budget  # replicated embeddings and a second process
    assert two.fits[0].spec == WorkerSpec(0, "cpu", cpus=(0, 1), tp=2)


@pytest.fixture
def in_process_up():
    """`up` run in this process sets up logging and captures warnings; undone afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


@pytest.mark.usefixtures("in_process_up")
def test_up_refuses_more_tp_replicas_than_the_gpus_give(tmp_path, monkeypatch):
    gpus = [GpuInfo(i, "GPU", f"GPU-{i}", 80 * GiB, 80 * GiB) for i in range(2)]
    monkeypatch.setattr("launcher.plan.placement.discover", lambda: Inventory(gpus, [0, 1], None, 64 * GiB))
    started = []
    monkeypatch.setattr(cli, "serve", lambda *a: started.append(a) or 0)
    path = deploy_file(tmp_path, {"devices": "auto", "tensor_parallel_size": 3, "replicas": 1})
    result = CliRunner().invoke(cli.app, ["up", path])
    assert result.exit_code == 2 and not started
    assert "workers.tensor_parallel_size=3 but only 2 GPU(s) [0, 1] are available" in " ".join(result.output.split())
    path = deploy_file(tmp_path, {"devices": "auto", "tensor_parallel_size": 3, "replicas": 2})
    (tmp_path / "model" / "config.json").write_text(json.dumps(SMOLLM2_135M))
    gpus += [GpuInfo(i, "GPU", f"GPU-{i}", 80 * GiB, 80 * GiB) for i in range(2, 4)]
    result = CliRunner().invoke(cli.app, ["up", path])
    assert result.exit_code == 2 and not started
    assert "workers.replicas=2 but GPUs [0, 1, 2, 3] give only 1 replica slot(s)" in " ".join(result.output.split())


@pytest.mark.usefixtures("in_process_up")
def test_plan_command_takes_the_tensor_parallel_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2["13B"], "vocab_size": 32000}))
    args = ["plan", "--model", str(tmp_path), "--gpus", "2x24GB", "--dtype", "float16"]
    result = CliRunner().invoke(cli.app, [*args, "--tensor-parallel-size", "2"])
    assert result.exit_code == 0, result.output
    assert "cuda[0,1] (TP 2)" in result.output and "data parallel" in result.output
