"""Room for a rollout's new replicas (pure logic): spare cores, free memory beside a slot, new slots."""

from __future__ import annotations

from launcher.plan.placement import GpuInfo, Inventory, WorkerSpec
from launcher.rollout.room import free_beside, new_spec, spare_cpus

GIB = 2**30


def cpu_slots(*cores):
    return [WorkerSpec(i, "cpu", cpus=c) for i, c in enumerate(cores)]


def test_a_cpu_surge_takes_a_spare_core_set_else_shares_the_replaced_ones():
    specs = cpu_slots((0, 1), (2, 3))
    roomy = Inventory(cpus=list(range(6)), ram_available_bytes=8 * GIB)
    full = Inventory(cpus=list(range(4)), ram_available_bytes=8 * GIB)
    assert spare_cpus(specs, roomy.cpus, 2) == (4, 5)
    assert free_beside(specs[0], specs, roomy) == 8 * GIB
    assert free_beside(specs[0], specs, full) == full.ram_available_bytes  # it may share the old one's cores
    assert new_spec(specs[0], 7, specs, roomy).cpus == (4, 5)
    assert new_spec(specs[0], 7, specs, full) is None  # a new slot (scale up) needs its own cores
    assert new_spec(specs[0], 7, specs, full, share=True).cpus == specs[0].cpus  # a replacement shares them


def test_on_a_cluster_the_new_slot_takes_the_shape_and_ray_places_it():
    specs = cpu_slots((0,), (1,))
    spec = new_spec(specs[0], 2, specs, Inventory(), cluster=True)
    assert spec.worker_id == 2 and spec.cpus == (0,)


def test_a_gpu_slot_has_the_least_free_memory_of_its_gpus_beside_it():
    gpus = [
        GpuInfo(index=i, name="g", uuid=f"GPU-{i}", total_bytes=80 * GIB, free_bytes=f * GIB)
        for i, f in ((0, 30), (1, 10))
    ]
    spec = WorkerSpec(0, "cuda", gpus=(0, 1))
    assert free_beside(spec, [spec], Inventory(gpus=gpus)) == 10 * GIB
    assert free_beside(spec, [spec], Inventory()) == 0  # unknown (a Ray cluster): drain first
    assert new_spec(spec, 3, [spec], Inventory(gpus=gpus)).gpus == (0, 1)
