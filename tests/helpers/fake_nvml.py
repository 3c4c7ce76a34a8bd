"""A stand-in for the ``pynvml`` module: the calls ``launcher.plan.placement.nvml_scan`` makes, over
GPUs described as dicts, with errors injectable per GPU and per call (no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

from worker.contract.units import GiB


class NVMLError(Exception):
    pass


class FakeNvml:
    """``gpus``: dicts with name, uuid, total_gib, used_gib, capability, optional ``mig`` (a list
    of instance dicts, [] = MIG mode without instances) and ``fail`` (a call name that raises)."""

    NVMLError = NVMLError
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, gpus: list[dict], init_error: str | None = None):
        self.gpus, self.init_error, self.shutdowns = gpus, init_error, 0

    def _check(self, handle, call: str) -> None:
        if handle.get("fail") == call:
            raise NVMLError(f"{call}: GPU is lost")

    def nvmlInit(self):
        if self.init_error:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        self._check(self.gpus[i], "handle")
        return self.gpus[i]

    def nvmlDeviceGetName(self, h):
        self._check(h, "name")
        return h["name"].encode()  # older pynvml returns bytes

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h):
        self._check(h, "memory")
        total = int(h["total_gib"] * GiB)
        return SimpleNamespace(total=total, free=total - int(h.get("used_gib", 0) * GiB))

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return h.get("capability", (9, 0))

    def nvmlDeviceGetMigMode(self, h):
        if "mig" not in h:
            raise NVMLError("Not Supported")
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, j):
        if j >= len(h["mig"]):
            raise NVMLError("Not Found")
        return h["mig"][j]


class FakeTopology(FakeNvml):
    """:class:`FakeNvml` plus the topology queries of ``launcher.plan.interconnect``: ``nvlink`` holds
    the pairs ``(a, b)`` joined by NVLink, ``level`` the PCIe common-ancestor level of the others;
    ``p2p_unsupported`` makes the P2P status query raise (older drivers), leaving NvLinkState."""

    NVML_P2P_CAPS_INDEX_NVLINK = 3
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_STATUS_NOT_SUPPORTED = 5
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, count: int, nvlink=(), level: int = 30, p2p_unsupported: bool = False):
        super().__init__([{"name": "GPU", "uuid": f"GPU-{i}", "total_gib": 80, "index": i} for i in range(count)])
        self.nvlink = {frozenset(p) for p in nvlink}
        self.level, self.p2p_unsupported = level, p2p_unsupported

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        if self.p2p_unsupported:
            raise NVMLError("Not Supported")
        assert index == self.NVML_P2P_CAPS_INDEX_NVLINK
        linked = frozenset((a["index"], b["index"])) in self.nvlink
        return self.NVML_P2P_STATUS_OK if linked else self.NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetNvLinkState(self, h, link):
        links = sum(h["index"] in p for p in self.nvlink)
        if link >= max(links, 1):
            raise NVMLError("Not Supported")
        return self.NVML_FEATURE_ENABLED if links else 0

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.level
