"""doctor's rules on injected facts: CUDA build vs driver, CUDA_VISIBLE_DEVICES, GPUs, placement."""

from __future__ import annotations

from launcher.config import DeployConfig
from launcher.doctor import cuda_compat, cuda_version, deployment_checks, gpu_checks, visibility_check
from launcher.placement import GpuInfo, Inventory

GiB = 2**30


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
