"""workers.tensor_parallel_size: config validation and placement over injected inventories."""

from __future__ import annotations

import pytest

from launcher.config import ConfigError, DeployConfig, parse_config
from launcher.placement import GpuInfo, Inventory, PlacementError, place

GiB = 2**30


def workers(**keys):
    return DeployConfig.model_validate({"workers": keys}).workers


def gpus(n: int) -> list[GpuInfo]:
    return [GpuInfo(i, "GPU", f"GPU-{i}", 80 * GiB, 80 * GiB) for i in range(n)]


def test_default_is_one_rank():
    assert DeployConfig().workers.tensor_parallel_size == 1


def test_tensor_parallel_and_layer_split_are_exclusive():
    with pytest.raises(ConfigError) as err:
        parse_config({"workers": {"tensor_parallel_size": 2, "gpus_per_replica": 2}})
    line = str(err.value).splitlines()[1]
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
