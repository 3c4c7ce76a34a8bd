"""Placement over injected inventories, and the launcher → worker GPU contract (env + check)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from launcher.plan.placement import GpuInfo, Inventory, PlacementError, discover, place, visible_gpus
from worker.contract.env import EXPECTED_GPUS_ENV, expected_from_env
from worker.contract.settings import WorkersConfig
from worker.contract.units import GiB
from worker.gpus import GpuMismatch, check_gpus, layer_fractions


def gpu(i: int, total_gib: float = 80, used_gib: float = 0.5, name: str = "NVIDIA A100-SXM4-80GB") -> GpuInfo:
    return GpuInfo(
        i, name, f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}", int(total_gib * GiB), int((total_gib - used_gib) * GiB)
    )


def inventory(n: int, visible: str | None = None, **kw) -> Inventory:
    return Inventory([gpu(i, **kw) for i in range(n)], list(range(16)), visible, 64 * GiB)


def workers(**kw) -> WorkersConfig:
    return WorkersConfig(**kw)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_auto_is_one_replica_per_gpu(n):
    specs = place(workers(), inventory(n))
    assert [s.gpus for s in specs] == [(i,) for i in range(n)]
    assert [s.label for s in specs] == [f"cuda[{i}]" for i in range(n)]
    assert all(s.device == "cuda" and s.share == 1.0 for s in specs)
    assert specs[-1].env["CUDA_VISIBLE_DEVICES"] == str(n - 1)
    assert specs[-1].env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


@pytest.mark.parametrize(
    "n, per, expected",
    [
        (2, 2, [(0, 1)]),
        (4, 2, [(0, 1), (2, 3)]),
        (8, 2, [(0, 1), (2, 3), (4, 5), (6, 7)]),
        (8, 4, [(0, 1, 2, 3), (4, 5, 6, 7)]),
        (8, 8, [tuple(range(8))]),
    ],
)
def test_gpus_per_replica_groups_consecutive_gpus(n, per, expected):
    specs = place(workers(gpus_per_replica=per), inventory(n))
    assert [s.gpus for s in specs] == expected
    assert specs[0].cuda_visible_devices == ",".join(map(str, expected[0]))
    assert len(json.loads(specs[0].env[EXPECTED_GPUS_ENV])["gpus"]) == per


def test_leftover_gpus_stay_idle_and_are_logged(caplog):
    with caplog.at_level(logging.WARNING):
        specs = place(workers(gpus_per_replica=3), inventory(4))
    assert [s.gpus for s in specs] == [(0, 1, 2)]
    assert "[3] stay idle" in caplog.text


def test_workers_per_gpu_share_one_gpu():
    specs = place(workers(workers_per_gpu=2), inventory(1))
    assert [s.gpus for s in specs] == [(0,), (0,)]
    assert [s.share for s in specs] == [0.5, 0.5]
    assert json.loads(specs[1].env[EXPECTED_GPUS_ENV])["share"] == 0.5


def test_replicas_spread_over_gpus_before_doubling_up():
    assert [s.gpus for s in place(workers(workers_per_gpu=2, replicas=2), inventory(2))] == [(0,), (1,)]
    specs = place(workers(workers_per_gpu=2, replicas=3), inventory(2))
    assert [s.gpus for s in specs] == [(0,), (1,), (0,)]
    assert [s.share for s in specs] == [0.5, 1.0, 0.5]


def test_explicit_devices_are_physical_indices():
    specs = place(workers(devices=[3, 1]), inventory(4))
    assert [s.gpus for s in specs] == [(3,), (1,)]
    assert specs[0].gpu_info[0].uuid == gpu(3).uuid


def test_more_replicas_than_gpus_is_a_clear_error():
    with pytest.raises(PlacementError) as err:
        place(workers(replicas=3), inventory(2))
    msg = str(err.value)
    assert "replicas=3" in msg and "[0, 1]" in msg and "2 replica slot" in msg and "workers_per_gpu" in msg


def test_more_gpus_per_replica_than_gpus_is_an_error():
    with pytest.raises(PlacementError, match="gpus_per_replica=4 but only 2 GPU"):
        place(workers(gpus_per_replica=4), inventory(2))


def test_duplicate_devices_are_an_error():
    with pytest.raises(PlacementError, match="twice"):
        place(workers(devices=[0, 0]), inventory(2))


def test_gpu_index_without_any_gpu_names_the_fix():
    with pytest.raises(PlacementError) as err:
        place(workers(devices=[0]), Inventory([], [0, 1]))
    assert "no GPU" in str(err.value) and "devices: cpu" in str(err.value)


def test_unknown_gpu_index_lists_the_real_ones():
    with pytest.raises(PlacementError, match=r"GPU \[5\] but this machine has GPUs \[0, 1\]"):
        place(workers(devices=[5]), inventory(2))


def test_inherited_visible_devices_limit_auto_and_keep_physical_numbers():
    specs = place(workers(), inventory(4, visible="2,3"))
    assert [s.gpus for s in specs] == [(2,), (3,)]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["2", "3"]


def test_renumbered_indices_under_visible_devices_explain_the_trap():
    with pytest.raises(PlacementError) as err:
        place(workers(devices=[0, 1]), inventory(4, visible="2,3"))
    msg = str(err.value)
    assert "CUDA_VISIBLE_DEVICES=2,3" in msg and "physical" in msg and "did you mean devices: [2, 3]" in msg


def test_visible_devices_by_uuid_and_unique_prefix_map_to_physical():
    inv = inventory(4, visible=f"{gpu(3).uuid},{gpu(1).uuid[:12]}")
    assert [g.index for g in visible_gpus(inv)] == [3, 1]
    assert [s.gpus for s in place(workers(), inv)] == [(3,), (1,)]


def test_visible_devices_stop_at_a_negative_entry_like_cuda():
    assert [g.index for g in visible_gpus(inventory(4, visible="1,-1,2"))] == [1]
    assert place(workers(), inventory(2, visible="-1"))[0].device == "cpu"
    assert place(workers(), inventory(2, visible=""))[0].device == "cpu"


@pytest.mark.parametrize(
    "visible, match",
    [
        ("7", "names GPU 7"),
        ("GPU-ffff", "matches no GPU"),
        ("MIG-1234", "MIG"),
        ("1,1", "twice"),
    ],
)
def test_bad_visible_devices_are_errors(visible, match):
    with pytest.raises(PlacementError, match=match):
        place(workers(), inventory(4, visible=visible))


def test_visible_devices_without_gpus_falls_back_to_cpu():
    assert place(workers(), Inventory([], [0, 1, 2, 3], "0"))[0].device == "cpu"


def test_partly_used_gpu_is_placed_with_its_free_memory():
    inv = Inventory([gpu(0), gpu(1, used_gib=60)], [0], None)
    specs = place(workers(), inv)
    assert specs[1].gpu_info[0].used_bytes == 60 * GiB
    assert specs[1].gpu_info[0].free_bytes == 20 * GiB


def test_cpu_replicas_split_cores_and_hide_gpus():
    specs = place(workers(devices="cpu", replicas=2), inventory(2))
    assert [s.cpus for s in specs] == [tuple(range(8)), tuple(range(8, 16))]
    assert specs[0].env == {"CUDA_VISIBLE_DEVICES": "", EXPECTED_GPUS_ENV: ""}


def test_discover_reports_this_process():
    inv = discover()
    assert inv.cpus == sorted(os.sched_getaffinity(0))
    assert inv.visible_env == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert inv.ram_available_bytes > 0


# ---- the worker's side of the contract ------------------------------------------------------


def seen_as_torch(g: GpuInfo, cuda: int) -> dict:
    return {"cuda": cuda, "name": g.name, "uuid": g.uuid, "total_bytes": g.total_bytes}


def test_worker_accepts_what_the_launcher_intended():
    spec = place(workers(gpus_per_replica=2), inventory(4, visible="2,3"))[0]
    expected = expected_from_env(spec.env)
    check_gpus(expected, [seen_as_torch(gpu(2), 0), seen_as_torch(gpu(3), 1)], spec.cuda_visible_devices)


def test_worker_mismatch_names_both_sides():
    spec = place(workers(devices=[2]), inventory(4))[0]
    with pytest.raises(GpuMismatch) as err:
        check_gpus(expected_from_env(spec.env), [seen_as_torch(gpu(0), 0)], "2")
    msg = str(err.value)
    assert "physical 2" in msg and "cuda:0" in msg and gpu(0).uuid[:12] in msg and gpu(2).uuid[:12] in msg


def test_worker_mismatch_on_count():
    spec = place(workers(gpus_per_replica=2), inventory(2))[0]
    with pytest.raises(GpuMismatch, match="torch sees 0 GPU"):
        check_gpus(expected_from_env(spec.env), [], "0,1", " (torch built for CUDA None)")


def test_worker_without_expectation_checks_nothing():
    assert expected_from_env({}) is None
    check_gpus(None, [], "")


def test_layer_fractions_follow_the_device_map():
    dm = {"model.embed_tokens": 0, **{f"model.layers.{i}": i // 3 for i in range(6)}, "model.norm": 1, "lm_head": 1}
    assert layer_fractions(dm, 6) == {0: 0.5, 1: 0.5}
    assert layer_fractions(None, 6) == {0: 1.0}


def test_worker_matches_torch_uuids_without_the_nvml_prefix():
    spec = place(workers(devices=[1]), inventory(2))[0]
    torch_style = {
        "cuda": 0,
        "name": "renamed by the driver",
        "uuid": gpu(1).uuid.removeprefix("GPU-").upper(),
        "total_bytes": 1,
    }
    check_gpus(expected_from_env(spec.env), [torch_style], "1")  # the UUID decides, not the name
    with pytest.raises(GpuMismatch):
        check_gpus(expected_from_env(spec.env), [{**torch_style, "uuid": gpu(0).uuid[4:]}], "1")


# ---- NVML: per-GPU errors, MIG, and NVML missing while CUDA works --------------------------

from launcher.plan.placement import GpuProblem, cuda_probe, nvml_gpus, nvml_scan  # noqa: E402
from tests.helpers.fake_nvml import FakeNvml  # noqa: E402

H100 = {"name": "NVIDIA H100 80GB HBM3", "total_gib": 80, "used_gib": 1, "capability": (9, 0)}


def nvml_gpu(i: int, **kw) -> dict:
    return {**H100, "uuid": f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}", **kw}


def mig(i: int, j: int, gib: float = 10) -> dict:
    return {
        "name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
        "uuid": f"MIG-{i:04x}{j:04x}-1111-2222-3333-{j:012x}",
        "total_gib": gib,
        "used_gib": 0,
    }


def test_nvml_scan_reads_memory_and_capability():
    fake = FakeNvml([nvml_gpu(0), nvml_gpu(1, capability=(7, 5), name="Tesla T4", total_gib=16)])
    scan = nvml_scan(fake)
    assert not scan.error and not scan.problems and fake.shutdowns == 1
    assert [(g.index, g.name, g.capability) for g in scan.gpus] == [(0, H100["name"], (9, 0)), (1, "Tesla T4", (7, 5))]
    assert scan.gpus[1].total_bytes == 16 * GiB and scan.gpus[0].used_bytes == GiB


def test_one_failing_gpu_is_named_and_the_others_are_kept():
    scan = nvml_scan(FakeNvml([nvml_gpu(0), nvml_gpu(1, fail="memory"), nvml_gpu(2)]))
    assert [g.index for g in scan.gpus] == [0, 2]
    assert scan.problems == [GpuProblem(1, "NVML cannot query GPU 1: memory: GPU is lost")]


def test_nvml_init_failure_is_an_error_not_an_exception():
    scan = nvml_scan(FakeNvml([], init_error="NVML Shared Library Not Found"))
    assert scan.gpus == [] and "NVML Shared Library Not Found" in scan.error


def test_auto_refuses_a_gpu_nvml_could_not_query():
    inv = Inventory([gpu(0), gpu(2)], [0], None, gpu_problems=(GpuProblem(1, "NVML cannot query GPU 1: lost"),))
    with pytest.raises(PlacementError) as err:
        place(workers(), inv)
    assert "GPU 1" in str(err.value) and "workers.devices: [0, 2]" in str(err.value)
    assert [s.gpus for s in place(workers(devices=[0, 2]), inv)] == [(0,), (2,)]  # left out on purpose
    with pytest.raises(PlacementError, match="cannot be used: NVML cannot query GPU 1"):
        place(workers(devices=[1]), inv)
    assert [s.gpus for s in place(workers(), Inventory(inv.gpus, [0], "2", gpu_problems=inv.gpu_problems))] == [(2,)]


def test_nvml_missing_while_cuda_sees_gpus_fails_loudly_with_the_fix():
    inv = Inventory([], [0, 1], None, nvml_error="NVML unavailable: NVML Shared Library Not Found", cuda_without_nvml=2)
    with pytest.raises(PlacementError) as err:
        place(workers(), inv)
    msg = str(err.value)
    assert "CUDA sees 2 GPU(s)" in msg and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in msg and "devices: cpu" in msg
    assert place(workers(devices="cpu"), inv)[0].device == "cpu"  # CPU on purpose still works
    cpu_box = Inventory([], [0, 1], None, nvml_error="NVML unavailable: no driver", cuda_without_nvml=0)
    assert place(workers(), cpu_box)[0].device == "cpu"


def test_cuda_probe_on_this_machine_matches_nvml():
    assert (cuda_probe() > 0) == bool(nvml_gpus())


def test_mig_gpu_is_listed_by_its_instances_with_their_own_memory():
    scan = nvml_scan(FakeNvml([nvml_gpu(0, mig=[mig(0, 0), mig(0, 1, 20)]), nvml_gpu(1)]))
    assert [(g.index, g.is_mig, g.total_bytes) for g in scan.gpus] == [
        (0, True, 10 * GiB),
        (0, True, 20 * GiB),
        (1, False, 80 * GiB),
    ]
    assert scan.gpus[0].parent_uuid == nvml_gpu(0)["uuid"] and scan.gpus[0].capability == (9, 0)


def test_mig_mode_without_instances_is_a_problem_with_the_fix():
    scan = nvml_scan(FakeNvml([nvml_gpu(0, mig=[])]))
    assert scan.gpus == [] and "MIG mode but has no MIG instances" in scan.problems[0].message
    assert "-mig 0" in scan.problems[0].message
    with pytest.raises(PlacementError, match="no MIG instances"):
        place(workers(), Inventory(scan.gpus, [0], None, gpu_problems=tuple(scan.problems)))


def test_workers_are_placed_on_mig_instances_by_uuid():
    scan = nvml_scan(FakeNvml([nvml_gpu(0, mig=[mig(0, 0), mig(0, 1)]), nvml_gpu(1)]))
    inv = Inventory(scan.gpus, [0], None)
    specs = place(workers(), inv)
    assert [s.cuda_visible_devices for s in specs] == [mig(0, 0)["uuid"], mig(0, 1)["uuid"], "1"]
    assert [s.gpus for s in specs] == [(0,), (0,), (1,)]
    assert specs[0].label.startswith("cuda[0:MIG-") and specs[0].label != specs[1].label
    sent = json.loads(specs[0].env[EXPECTED_GPUS_ENV])["gpus"][0]
    assert sent["total_bytes"] == 10 * GiB and sent["parent_uuid"] == nvml_gpu(0)["uuid"]
    assert [s.cuda_visible_devices for s in place(workers(devices=[0]), inv)] == [mig(0, 0)["uuid"], mig(0, 1)["uuid"]]
    only = Inventory(scan.gpus, [0], mig(0, 1)["uuid"])
    assert [s.cuda_visible_devices for s in place(workers(), only)] == [mig(0, 1)["uuid"]]


def test_mig_instances_cannot_be_layer_split():
    scan = nvml_scan(FakeNvml([nvml_gpu(0, mig=[mig(0, 0), mig(0, 1)])]))
    with pytest.raises(PlacementError, match="one MIG instance"):
        place(workers(gpus_per_replica=2), Inventory(scan.gpus, [0], None))


def test_worker_accepts_a_mig_instance_by_its_uuid_or_its_gpu():
    scan = nvml_scan(FakeNvml([nvml_gpu(0, mig=[mig(0, 0)])]))
    spec = place(workers(), Inventory(scan.gpus, [0], None))[0]
    expected = expected_from_env(spec.env)
    bare = mig(0, 0)["uuid"].removeprefix("MIG-")
    check_gpus(expected, [{"cuda": 0, "name": "x", "uuid": "GPU-" + bare, "total_bytes": 1}], spec.cuda_visible_devices)
    parent = {"cuda": 0, "name": "x", "uuid": nvml_gpu(0)["uuid"], "total_bytes": 1}
    check_gpus(expected, [parent], spec.cuda_visible_devices)  # drivers that report the parent's UUID
    with pytest.raises(GpuMismatch):
        check_gpus(expected, [{**parent, "uuid": nvml_gpu(5)["uuid"]}], spec.cuda_visible_devices)
