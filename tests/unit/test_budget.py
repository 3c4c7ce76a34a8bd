"""The one GPU KV-budget rule (worker.contract.budget) and the worker's measuring helpers over a fake
``torch.cuda`` (no GPU needed)."""

from __future__ import annotations

import pytest

from worker.contract.budget import GPU_ALLOWANCE_BYTES, GpuFacts, kv_budget, memory_fraction, too_small
from worker.contract.units import GiB
from worker.gpus import apply_memory_fraction, capabilities, measure_gpus, memory_reserved_total, reset_peaks

MiB = 2**20
LLAMA2_7B_KV = 512 * 1024  # bytes per token, 16-bit


def test_activation_peak_and_allowance_come_off_the_kv_room():
    # Llama-2-7B bf16 on a 24 GiB card: 12.55 GiB weights, 1.5 GiB measured prefill peak
    facts = [GpuFacts(24 * GiB, 24 * GiB - 13 * GiB, int(12.55 * GiB), int(1.5 * GiB), resident=True)]
    b = kv_budget(facts, LLAMA2_7B_KV, 0.9)
    room = int(24 * GiB * 0.9) - int(12.55 * GiB) - int(1.5 * GiB) - GPU_ALLOWANCE_BYTES
    assert b.tokens == room // LLAMA2_7B_KV
    assert b.bytes == b.tokens * LLAMA2_7B_KV <= room  # allocated once, never more than the room
    without_peak = kv_budget([GpuFacts(24 * GiB, 11 * GiB, int(12.55 * GiB), 0, resident=True)], LLAMA2_7B_KV, 0.9)
    assert without_peak.tokens - b.tokens == int(1.5 * GiB) // LLAMA2_7B_KV


def test_other_processes_bound_the_budget_through_free_memory():
    # 80 GiB card, 60 GiB held by someone else, our 12.55 GiB loaded: free is 7.45 GiB
    facts = [GpuFacts(80 * GiB, 80 * GiB - 60 * GiB - int(12.55 * GiB), int(12.55 * GiB), GiB, resident=True)]
    b = kv_budget(facts, LLAMA2_7B_KV, 0.9)
    free_room = facts[0].free_bytes - int(80 * GiB * 0.1) - GiB
    assert b.gpus[0].bound_by == "free"
    assert b.tokens == max(0, free_room) // LLAMA2_7B_KV


def test_plan_and_worker_agree_on_the_same_gpu():
    """plan (before loading: free from NVML, weights not resident) and the worker (after warm-up:
    weights resident, CUDA context in use) get the same tokens when their estimates match."""
    total, weights, peak, context = 80 * GiB, int(12.55 * GiB), GiB, int(0.5 * GiB)
    planned = kv_budget([GpuFacts(total, total, weights, peak)], LLAMA2_7B_KV, 0.9)
    measured = kv_budget([GpuFacts(total, total - weights - context, weights, peak, resident=True)], LLAMA2_7B_KV, 0.9)
    assert planned.tokens == measured.tokens > 0
    assert planned.gpus[0].bound_by == measured.gpus[0].bound_by == "share"


def test_share_halves_the_ceiling():
    one = kv_budget([GpuFacts(80 * GiB, 80 * GiB, 2 * GiB, GiB)], LLAMA2_7B_KV, 0.9)
    half = kv_budget([GpuFacts(80 * GiB, 80 * GiB, 2 * GiB, GiB)], LLAMA2_7B_KV, 0.9, share=0.5)
    assert half.gpus[0].bound_by == "share"
    assert half.tokens == (int(80 * GiB * 0.45) - 4 * GiB) // LLAMA2_7B_KV < one.tokens


def test_layer_split_is_bounded_by_the_tightest_gpu():
    # half the layers on each GPU; GPU 1 is shared with another process holding 30 GiB
    a = GpuFacts(80 * GiB, 80 * GiB - 7 * GiB, 7 * GiB, GiB, 0.5, resident=True)
    b = GpuFacts(80 * GiB, 80 * GiB - 37 * GiB, 7 * GiB, GiB, 0.5, resident=True)
    budget = kv_budget([a, b], LLAMA2_7B_KV, 0.9)
    per_gpu = LLAMA2_7B_KV // 2
    assert budget.tightest.index == 1 and budget.gpus[1].bound_by == "free"
    assert budget.tokens == budget.gpus[1].room // per_gpu
    assert [g.bytes for g in budget.gpus] == [budget.tokens * per_gpu] * 2  # the same tokens on each GPU
    assert budget.bytes == budget.tokens * LLAMA2_7B_KV


def test_tokens_round_down_to_whole_blocks_and_never_go_negative():
    facts = [GpuFacts(24 * GiB, 24 * GiB, 10 * GiB, GiB)]
    assert kv_budget(facts, LLAMA2_7B_KV, 0.9, block_tokens=256).tokens % 256 == 0
    full = kv_budget([GpuFacts(24 * GiB, GiB, 23 * GiB, GiB, resident=True)], LLAMA2_7B_KV, 0.9)
    assert full.tokens == 0 and full.bytes == 0
    with pytest.raises(ValueError):
        kv_budget(facts, 0, 0.9)


def test_refuse_ready_below_one_full_length_sequence():
    facts = [GpuFacts(24 * GiB, 24 * GiB, int(12.55 * GiB), GiB)]
    b = kv_budget(facts, LLAMA2_7B_KV, 0.9, share=0.5)
    msg = too_small(b, 4096, 0.9, share=0.5)
    assert msg and f"KV budget of {b.tokens} tokens" in msg and "max_model_len=4096" in msg
    assert "workers_per_gpu" in msg and "gpu_memory_utilization" in msg
    busy = kv_budget([GpuFacts(24 * GiB, 4 * GiB, 12 * GiB, GiB, resident=True)], LLAMA2_7B_KV, 0.9)
    assert "free the GPU" in too_small(busy, 4096, 0.9)
    roomy = kv_budget([GpuFacts(80 * GiB, 80 * GiB, 13 * GiB, GiB)], LLAMA2_7B_KV, 0.9)
    assert too_small(roomy, 4096, 0.9) is None


def test_memory_fraction_per_replica_share():
    assert memory_fraction(0.9, 0.5) == pytest.approx(0.45)
    assert memory_fraction(1.0, 1.0) == 1.0


# ---- the worker's side, over a fake torch.cuda ---------------------------------------------


class FakeCuda:
    """The ``torch.cuda`` calls worker.gpus makes, over per-device numbers."""

    def __init__(self, devices: list[dict]):
        self.devices, self.calls = devices, []

    def device_count(self):
        return len(self.devices)

    def empty_cache(self):
        self.calls.append("empty_cache")

    def mem_get_info(self, dev):
        return self.devices[dev]["free"], self.devices[dev]["total"]

    def memory_allocated(self, dev):
        return self.devices[dev]["allocated"]

    def max_memory_allocated(self, dev):
        return self.devices[dev]["peak"]

    def memory_reserved(self, dev):
        return self.devices[dev]["reserved"]

    def reset_peak_memory_stats(self, dev):
        self.calls.append(("reset", dev))

    def set_per_process_memory_fraction(self, fraction, dev):
        self.calls.append(("fraction", fraction, dev))

    def get_device_capability(self, dev):
        return self.devices[dev]["capability"]


def fake_gpu(**kw) -> dict:
    return {
        "total": 80 * GiB,
        "free": 60 * GiB,
        "allocated": 14 * GiB,
        "peak": 16 * GiB,
        "reserved": 15 * GiB,
        "capability": (9, 0),
        **kw,
    }


def test_measure_gpus_reads_weights_peak_and_free_after_emptying_the_cache():
    cuda = FakeCuda([fake_gpu(), fake_gpu(free=40 * GiB, allocated=10 * GiB, peak=10 * GiB + 300 * MiB)])
    facts = measure_gpus({0: 0.5, 1: 0.5}, cuda=cuda)
    assert cuda.calls == ["empty_cache"]
    assert [(f.weights_bytes, f.activation_peak_bytes, f.free_bytes) for f in facts] == [
        (14 * GiB, 2 * GiB, 60 * GiB),
        (10 * GiB, 300 * MiB, 40 * GiB),
    ]
    assert all(f.resident and f.layer_fraction == 0.5 for f in facts)
    assert measure_gpus({0: 1.0}, {0: 5}, cuda=cuda)[0].activation_peak_bytes == 5


def test_reset_fraction_reserved_and_capabilities_cover_every_visible_gpu():
    cuda = FakeCuda([fake_gpu(), fake_gpu(reserved=3 * GiB, capability=(8, 6))])
    reset_peaks(cuda)
    assert apply_memory_fraction(0.9, 0.5, cuda) == pytest.approx(0.45)
    assert cuda.calls == [
        ("reset", 0),
        ("reset", 1),
        ("fraction", pytest.approx(0.45), 0),
        ("fraction", pytest.approx(0.45), 1),
    ]
    assert memory_reserved_total(cuda) == 18 * GiB  # both GPUs of a split replica, reserved not allocated
    assert capabilities(cuda) == [(9, 0), (8, 6)]


def test_kv_budget_after_warmup_sizes_each_gpu_or_refuses_ready():
    from worker.gpus import KvTooSmall, kv_budget_after_warmup

    cuda = FakeCuda([fake_gpu(free=60 * GiB), fake_gpu(free=60 * GiB)])
    budget = kv_budget_after_warmup(LLAMA2_7B_KV, {0: 0.5, 1: 0.5}, 0.9, 1.0, 4096, block_tokens=16, cuda=cuda)
    assert budget.tokens % 16 == 0 and budget.tokens >= 4096
    assert [g.bytes for g in budget.gpus] == [budget.tokens * LLAMA2_7B_KV // 2] * 2
    tight = FakeCuda([fake_gpu(free=9 * GiB)])  # 80 GiB card, someone else holds most of it
    with pytest.raises(KvTooSmall, match="less than one max_model_len=4096"):
        kv_budget_after_warmup(LLAMA2_7B_KV, {0: 1.0}, 0.9, 1.0, 4096, cuda=tight)


def test_the_cuda_graphs_pool_comes_off_the_kv_budget_beside_the_prefill_peak():
    from worker.gpus import kv_budget_after_warmup, transient_peaks

    cuda = FakeCuda([fake_gpu()])
    peaks = transient_peaks(cuda)
    assert peaks == {0: 2 * GiB}  # peak 16 − allocated 14
    alone = kv_budget_after_warmup(LLAMA2_7B_KV, {0: 1.0}, 0.9, 1.0, 4096, cuda=cuda, activation_peak=peaks)
    pool = 3 * GiB  # the graphs keep their pool while a prefill's activations come and go: both come off
    both = kv_budget_after_warmup(
        LLAMA2_7B_KV, {0: 1.0}, 0.9, 1.0, 4096, cuda=cuda, activation_peak={0: 2 * GiB + pool}
    )
    assert alone.tokens - both.tokens == pool // LLAMA2_7B_KV


def test_no_graphs_pool_is_measured_where_none_is_captured():
    from types import SimpleNamespace

    import torch

    from worker.step.capture import graph_pool_bytes

    cpu_cache = SimpleNamespace(layers=[torch.empty(1)], block_size=16)
    assert graph_pool_bytes(object(), cpu_cache, 8, False, None, 1024) == 0  # CPU: the fused step, no graphs
    assert graph_pool_bytes(object(), cpu_cache, 8, True, None, 1024) == 0  # enforce_eager
