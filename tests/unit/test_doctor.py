"""doctor's rules on injected facts: CUDA build vs driver, CUDA_VISIBLE_DEVICES, GPUs, placement."""

from __future__ import annotations

import pytest

from launcher.config import DeployConfig
from launcher.plan.doctor import (
    arch_checks,
    cuda_compat,
    cuda_version,
    deployment_checks,
    dtype_check,
    gpu_checks,
    visibility_check,
    wheel_runs_on,
)
from launcher.plan.placement import GpuInfo, GpuProblem, Inventory
from worker.contract.units import GiB


def gpu(i: int, used_gib: float = 0.5, name: str = "NVIDIA L4") -> GpuInfo:
    return GpuInfo(i, name, f"GPU-{i:04d}", 24 * GiB, int((24 - used_gib) * GiB))


def test_nvml_cuda_version_as_text():
    assert cuda_version(12040) == "12.4" and cuda_version(11080) == "11.8" and cuda_version(None) is None


def test_cuda_build_against_driver():
    assert cuda_compat("12.4", "12.6").status == "ok"
    assert cuda_compat("12.4", "12.4").status == "ok"
    minor = cuda_compat("12.8", "12.2")
    assert minor.status == "warn" and "12.8" in minor.fix and "12.2" in minor.fix
    major = cuda_compat("12.1", "11.8")
    assert major.status == "fail" and "cannot use the GPUs" in major.detail and "driver" in major.fix
    assert cuda_compat(None, "12.4").status == "skip"
    assert cuda_compat("12.4", None).status == "skip"


def test_visible_devices_are_explained_in_physical_terms():
    inv = Inventory([gpu(i) for i in range(4)], [0], "2,3")
    row = visibility_check(inv)
    assert row.status == "ok" and "cuda:0 = physical 2" in row.detail and "cuda:1 = physical 3" in row.detail
    assert visibility_check(Inventory([gpu(0)], [0], "5")).status == "fail"
    assert visibility_check(Inventory([], [0], "0")).status == "skip"


def test_mixed_gpus_with_index_visibility_warn_about_device_order(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    inv = Inventory([gpu(0, name="NVIDIA A100"), gpu(1, name="NVIDIA T4")], [0], "1")
    row = visibility_check(inv)
    assert row.status == "warn" and "PCI_BUS_ID" in row.fix


def test_busy_gpu_is_a_warning():
    rows = gpu_checks(Inventory([gpu(0), gpu(1, used_gib=12)], [0]))
    assert [r.status for r in rows] == ["ok", "warn"]
    assert gpu_checks(Inventory([], [0]))[0].status == "skip"


def test_gpu_devices_without_gpu_fail_with_a_fix():
    cfg = DeployConfig.model_validate({"workers": {"devices": [0]}})
    rows = deployment_checks(cfg, Inventory([], [0, 1]), None)
    assert rows[0].name == "placement" and rows[0].status == "fail" and "devices: cpu" in rows[0].detail


def test_newer_cuda_major_is_a_warning_when_the_test_kernel_ran():
    assert cuda_compat("13.0", "12.8").status == "fail"
    forward = cuda_compat("13.0", "12.8", kernel_ran=True)
    assert forward.status == "warn" and "forward-compatibility" in forward.detail


@pytest.mark.parametrize(
    "capability, arch_list, runs",
    [
        ((7, 0), ["sm_75", "sm_80", "sm_86", "sm_90"], False),  # V100 after torch dropped sm70
        ((7, 0), ["sm_70", "sm_75"], True),
        ((8, 6), ["sm_80"], True),  # same major, newer minor
        ((8, 0), ["sm_86"], False),  # older minor than the cubin
        ((9, 0), ["sm_80", "sm_90a"], True),
        ((10, 0), ["sm_90a"], False),  # arch-specific: exactly 9.0 only
        ((10, 0), ["sm_80", "compute_90"], True),  # PTX JIT for newer GPUs
        ((12, 0), ["sm_100", "sm_120"], True),
        ((9, 0), [], False),
    ],
)
def test_wheel_architectures_against_compute_capability(capability, arch_list, runs):
    assert wheel_runs_on(capability, arch_list) is runs


def test_gpu_the_wheel_cannot_run_on_fails_with_a_fix():
    v100 = GpuInfo(0, "Tesla V100-SXM2-32GB", "GPU-0", 32 * GiB, 32 * GiB, capability=(7, 0))
    h100 = GpuInfo(1, "NVIDIA H100", "GPU-1", 80 * GiB, 80 * GiB, capability=(9, 0))
    rows = arch_checks([v100, h100], ["sm_80", "sm_90"])
    assert [(r.name, r.status) for r in rows] == [("GPU 0 kernels", "fail")]
    assert "7.0" in rows[0].detail and "cannot run" in rows[0].detail and "older release" in rows[0].fix
    assert arch_checks([h100], ["sm_80", "sm_90"])[0].status == "ok"
    assert arch_checks([h100], [])[0].status == "skip"
    assert arch_checks([], ["sm_90"])[0].status == "skip"


def test_dtype_row_says_what_auto_means_here():
    t4 = Inventory([GpuInfo(0, "Tesla T4", "GPU-0", 16 * GiB, 16 * GiB, capability=(7, 5))], [0])
    row = dtype_check(DeployConfig(), t4)
    assert row.status == "ok" and row.detail == "auto → float16 (GPU compute capability 7.5 < 8.0)"
    forced = DeployConfig.model_validate({"model": {"dtype": "bfloat16"}})
    assert dtype_check(forced, t4).status == "warn"
    cpu = Inventory([], [0], cpu_flags=frozenset({"avx512_bf16"}))
    assert "bfloat16" in dtype_check(DeployConfig(), cpu).detail


def test_nvml_missing_while_cuda_works_and_unqueried_gpus_fail():
    rows = gpu_checks(Inventory([], [0], nvml_error="NVML unavailable: not found", cuda_without_nvml=1))
    assert rows[0].status == "fail" and "NVIDIA_DRIVER_CAPABILITIES" in rows[0].detail
    rows = gpu_checks(Inventory([gpu(0)], [0], gpu_problems=(GpuProblem(1, "NVML cannot query GPU 1: lost"),)))
    assert [(r.name, r.status) for r in rows] == [("GPU 0", "ok"), ("GPU 1", "fail")]


# ---- the GPUs' interconnect ------------------------------------------------------------------


def interconnect(n: int, tp: int = 1, **topology):
    from launcher.plan.doctor import interconnect_check
    from tests.helpers.fake_nvml import FakeTopology

    cfg = DeployConfig.model_validate({"workers": {"tensor_parallel_size": tp}})
    return interconnect_check(cfg, Inventory([gpu(i) for i in range(n)], [0]), FakeTopology(n, **topology))


def test_nvlink_between_every_pair_is_ok():
    row = interconnect(2, tp=2, nvlink=[(0, 1)])
    assert row.status == "ok" and "NVLink between every pair of GPUs [0, 1]" in row.detail


def test_tensor_parallel_over_pcie_is_a_warning_naming_the_path():
    row = interconnect(2, tp=2, level=30)
    assert row.status == "warn" and "GPU 0-1: PCIe (through a PCIe host bridge)" in row.detail
    assert "gains little" in row.detail and "tensor_parallel_size: 2" in row.fix


def test_pcie_without_tensor_parallel_is_reported_not_warned():
    row = interconnect(3, nvlink=[(0, 1)], level=50)
    assert row.status == "ok"
    assert "GPU 0-1: NVLink; GPU 0-2: PCIe (across CPU sockets); GPU 1-2: PCIe (across CPU sockets)" in row.detail
    assert "gains little" in row.detail


def test_tensor_parallel_is_judged_by_the_links_inside_each_replica():
    """Two NVLink-bridged pairs over PCIe, TP 2: each replica's two GPUs are one pair, so the
    PCIe between the pairs costs the all-reduces nothing (reported, not warned)."""
    bridged = interconnect(4, tp=2, nvlink=[(0, 1), (2, 3)], level=50)
    assert bridged.status == "ok" and "GPU 0-2: PCIe (across CPU sockets)" in bridged.detail
    crossed = interconnect(4, tp=2, nvlink=[(0, 2), (1, 3)], level=50)  # replicas on 0,1 and 2,3
    assert crossed.status == "warn" and "tensor_parallel_size: 2" in crossed.fix
    assert "GPU 0-1: PCIe" in crossed.detail


def test_nvlink_state_answers_where_the_p2p_query_is_not_supported():
    assert interconnect(2, tp=2, nvlink=[(0, 1)], p2p_unsupported=True).status == "ok"
    assert interconnect(2, tp=2, p2p_unsupported=True, level=10).detail.startswith("GPU 0-1: PCIe (through one PCIe")


def test_one_gpu_or_no_nvml_skips_the_interconnect():
    assert interconnect(1).status == "skip"
    from launcher.plan.doctor import interconnect_check
    from tests.helpers.fake_nvml import FakeNvml

    row = interconnect_check(DeployConfig(), Inventory([gpu(0), gpu(1)], [0]), FakeNvml([], init_error="no driver"))
    assert row.status == "skip" and "NVML unavailable: no driver" in row.detail


def test_every_model_of_several_is_checked_on_its_own_placed_device_grouped_by_model(monkeypatch, tmp_path):
    from launcher.plan import doctor_kernels
    from launcher.plan.doctor import models_checks

    measured = []
    monkeypatch.setattr(
        doctor_kernels,
        "kernel_check",
        lambda cfg, shape, device, dtype: measured.append((cfg.model.name, device, dtype)) or ("ok", "", ""),
    )
    cfg = DeployConfig.model_validate(
        {
            "workers": {"devices": "cpu", "replicas": 1},
            "models": [
                {"name": "smollm2-135m-instruct"},
                {"name": str(tmp_path / "nothing.gguf"), "served_name": "gone", "workers": {"devices": [0]}},
            ],
        }
    )
    a100 = Inventory([GpuInfo(0, "NVIDIA A100", "GPU-0", 80 * GiB, 80 * GiB, capability=(8, 0))], [0, 1])
    rows = models_checks(cfg, a100)
    names = [r.name for r in rows]
    assert names[0] == "placement" and names[-1] == "memory plan"
    first = [n for n in names if n.startswith("'smollm2-135m-instruct': ")]
    second = [n for n in names if n.startswith("'gone': ")]
    assert (
        [n.split(": ", 1)[1] for n in first]
        == ["model", "dtype", "quantization", "kernels"]
        == [n.split(": ", 1)[1] for n in second]
    )
    assert names.index(first[-1]) < names.index(second[0])  # grouped: one model's rows, then the next's
    by = {r.name: r for r in rows}
    assert by["'smollm2-135m-instruct': dtype"].detail.startswith("auto → float32 (CPU")  # its CPU, no bf16
    assert by["'gone': dtype"].detail.startswith("auto → bfloat16")  # its A100
    assert by["'gone': model"].status == "fail" and by["memory plan"].status == "skip"
    assert measured == [("smollm2-135m-instruct", "cpu", "float32")]  # the GPU model: CUDA does not run here


def test_a_random_init_folder_needs_no_weights_but_a_plain_one_does(tmp_path):
    import json

    from launcher.plan.doctor import model_check
    from worker.contract.settings import ModelConfig

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    plain, _ = model_check(ModelConfig(name=str(tmp_path)))
    assert plain.status == "fail" and "lacks weights" in plain.detail
    drawn, shape = model_check(ModelConfig(name=str(tmp_path), random_init=True))
    assert drawn.status == "ok" and "random weights (model.random_init)" in drawn.detail and shape is not None
    (tmp_path / "tokenizer.json").unlink()
    untokenized, _ = model_check(ModelConfig(name=str(tmp_path), random_init=True))
    assert untokenized.status == "fail" and untokenized.detail.endswith("lacks tokenizer"), untokenized.detail
