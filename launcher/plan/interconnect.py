"""How the GPUs are connected to each other (NVLink or PCIe), from NVML's topology queries.

Tensor parallelism all-reduces every layer's output between its ranks, twice per layer per
step, so its gain over one card depends on this link: much larger over NVLink than over PCIe
(the dated benchmark results have the figures). Per pair of GPUs: NVLink when NVML's peer-to-peer status
over NVLink is OK (``nvmlDeviceGetP2PStatus(..., NVML_P2P_CAPS_INDEX_NVLINK)``, which also covers
NVSwitch systems), or, where a driver cannot answer that, when both GPUs have an active NVLink
(``nvmlDeviceGetNvLinkState``); otherwise PCIe, with the path from
``nvmlDeviceGetTopologyCommonAncestor`` (one switch, a host bridge, across CPU sockets...).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

NVLINK, PCIE = "NVLink", "PCIe"
# nvmlGpuTopologyLevel_t: the closest common ancestor of two GPUs on the PCIe tree
PCIE_PATHS = {
    0: "on one board",
    10: "through one PCIe switch",
    20: "through several PCIe switches",
    30: "through a PCIe host bridge",
    40: "across PCIe host bridges within a NUMA node",
    50: "across CPU sockets",
}
MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS


@dataclass(frozen=True)
class Link:
    """How physical GPUs ``a`` and ``b`` reach each other: ``kind`` NVLink or PCIe, ``path`` for PCIe."""

    a: int
    b: int
    kind: str
    path: str = ""

    def describe(self) -> str:
        return f"GPU {self.a}-{self.b}: {self.kind}" + (f" ({self.path})" if self.path else "")


def gpu_links(indices: list[int], nvml=None) -> tuple[list[Link], str]:
    """The link between every pair of the physical GPUs ``indices``, and an error ("" when NVML
    answered). ``nvml`` is the ``pynvml`` module or a stand-in with its API (tests). Never raises."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return [], f"nvidia-ml-py is not installed ({exc})"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return [], f"NVML unavailable: {exc}"
    try:
        handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        links = []
        for n, a in enumerate(indices):
            for b in indices[n + 1 :]:
                links.append(_link(nvml, a, b, handles[a], handles[b]))
        return links, ""
    except nvml.NVMLError as exc:
        return [], f"NVML cannot read the GPU topology: {exc}"
    finally:
        nvml.nvmlShutdown()


def _link(nvml, a: int, b: int, ha, hb) -> Link:
    try:
        status = nvml.nvmlDeviceGetP2PStatus(ha, hb, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
        if status == nvml.NVML_P2P_STATUS_OK:
            return Link(a, b, NVLINK)
    except nvml.NVMLError as exc:  # not supported by this driver: look at the links themselves
        log.debug("P2P status of GPUs %d-%d: %s", a, b, exc)
        if _active_nvlinks(nvml, ha) and _active_nvlinks(nvml, hb):
            return Link(a, b, NVLINK)
    level = nvml.nvmlDeviceGetTopologyCommonAncestor(ha, hb)
    return Link(a, b, PCIE, PCIE_PATHS.get(int(level), f"topology level {level}"))


def _active_nvlinks(nvml, handle) -> int:
    active = 0
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", MAX_LINKS)):
        try:
            active += nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED
        except nvml.NVMLError:  # NotSupported: no such link (or no NVLink at all)
            break
    return active
