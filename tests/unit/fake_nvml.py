"""A stand-in for the ``pynvml`` module: the calls ``launcher.placement.nvml_scan`` makes, over
GPUs described as dicts, with errors injectable per GPU and per call (no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

GiB = 2**30


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
