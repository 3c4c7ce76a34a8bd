"""workers.tensor_parallel_size: config validation and placement over injected inventories."""

from __future__ import annotations

import pytest

from launcher.config import ConfigError, DeployConfig, parse_config
from launcher.plan.placement import GpuInfo, Inventory, PlacementError, place
from tests.helpers.model_configs import SMOLLM2_135M
from worker.contract.units import GiB


def workers(**keys):
    return DeployConfig.model_validate({"workers": keys}).workers


def gpus(n: int) -> list[GpuInfo]:
    return [GpuInfo(i, "GPU", f"GPU-{i}", 80 * GiB, 80 * GiB) for i in range(n)]


def test_default_is_one_rank():
    assert DeployConfig().workers.tensor_parallel_size == 1


def test_tensor_parallel_and_layer_split_are_exclusive():
    with pytest.raises(ConfigError) as err:
        parse_config({"workers": {"tensor_parallel_size": 2, "gpus_per_replica": 2}})
    (line,) = err.value.problems
    assert "workers.tensor_parallel_size=2 and workers.gpus_per_replica=2 are exclusive" in line
    assert "set one of them to 1" in line


def test_a_tp_replica_takes_n_gpus_one_rank_per_gpu():
    specs = place(workers(tensor_parallel_size=2), Inventory(gpus(4), [0, 1]))
    assert [(s.gpus, s.tp) for s in specs] == [((0, 1), 2), ((2, 3), 2)]
    assert [specs[1].rank_env(r)["CUDA_VISIBLE_DEVICES"] for r in range(2)] == ["2", "3"]


def test_replicas_times_tp_must_fit_the_gpus():
    with pytest.raises(PlacementError, match=r"workers.replicas=3 but GPUs \[0, 1, 2, 3\] give only 2") as err:
        place(workers(tensor_parallel_size=2, replicas=3), Inventory(gpus(4), [0]))
    assert "tensor_parallel_size=2" in str(err.value)
    with pytest.raises(PlacementError, match=r"workers\.tensor_parallel_size=4 but only 2 GPU"):
        place(workers(tensor_parallel_size=4), Inventory(gpus(2), [0]))


def test_tp_over_mig_instances_is_refused():
    mig = [GpuInfo(0, "H100 MIG", f"MIG-{j}", 40 * GiB, 40 * GiB, (9, 0), "GPU-0") for j in range(2)]
    with pytest.raises(PlacementError, match="NCCL cannot run tensor parallelism across MIG"):
        place(workers(tensor_parallel_size=2), Inventory(mig, [0]))


def test_cpu_ranks_get_disjoint_cores_when_there_are_enough():
    specs = place(workers(devices="cpu", replicas=2, tensor_parallel_size=2), Inventory([], list(range(8))))
    assert [[s.rank_cpus(r) for r in range(2)] for s in specs] == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    shared = place(workers(devices="cpu", replicas=2, tensor_parallel_size=2), Inventory([], [0, 1]))
    assert [[s.rank_cpus(r) for r in range(2)] for s in shared] == [[(0,), (0,)], [(1,), (1,)]]


def test_plan_counts_kv_cache_gib_per_rank_on_cpu():
    """On CPU each rank allocates workers.kv_cache_gib for its 1/N of the KV heads (as the worker
    does, worker.replica.load_shard), so a TP 3 replica holds three times the tokens of one rank."""
    from launcher.plan.plan import make_plan
    from worker.contract.shapes import from_hf_config

    smollm2 = from_hf_config(SMOLLM2_135M, "smollm2")
    inv = Inventory([], [0, 1], None, 64 * GiB)
    deploy = DeployConfig.model_validate(
        {"model": {"dtype": "float32"}, "workers": {"devices": "cpu", "replicas": 1, "tensor_parallel_size": 3}}
    )
    fit = make_plan(deploy, inv, smollm2).fits[0]
    # the worker: 2^30 // (15 KiB/token/rank × 16) = 4369 blocks of 16 tokens = 34 sequences of 2048
    assert (fit.kv_room, fit.seqs) == (3 * GiB, 34)
    # a per-rank kv_cache_gib that holds one sequence only across the three ranks still fits
    tight = deploy.model_copy(deep=True)
    tight.workers.kv_cache_gib = 0.04
    plan = make_plan(tight, inv, smollm2)
    assert plan.fits[0].seqs == 1 and plan.ok, plan.errors


def test_a_tp_size_the_gpus_cannot_hold_still_gets_a_gpu_recommendation():
    """``plan --gpus 2x24GB --tensor-parallel-size 3``: the placement error names the key, and the
    recommendation is for those two GPUs (not for CPU, as if the host had none)."""
    from launcher.plan.plan import make_plan
    from worker.contract.shapes import from_hf_config

    llama7b = from_hf_config(
        {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "intermediate_size": 11008,
            "vocab_size": 32000,
        },
        "llama-2-7b",
    )
    two = [GpuInfo(i, "GPU", f"GPU-{i}", 24 * GiB, 24 * GiB) for i in range(2)]
    plan = make_plan(
        DeployConfig.model_validate({"workers": {"tensor_parallel_size": 4}}), Inventory(two, [0]), llama7b
    )
    assert not plan.ok and "workers.tensor_parallel_size=4 but only 2 GPU(s)" in plan.errors[0]
    rec = plan.recommendation
    assert (rec.device, rec.replicas, rec.tensor_parallel_size) == ("cuda", 2, 1), rec.describe()
    assert plan.sizing.dtype != "float32"  # planned for the GPUs, not for CPU
