"""CPU kernels: linear layers with their weights reordered once into oneDNN's blocked layout.

This is what inductor's weight freezing does on CPU. Decode is bound by reading the weights, and
for the skinny products of a decode step ([B, 576] x [576, N] at B ≤ 32) MKL's sgemm reads them
at about a third of the speed of oneDNN's prepacked kernel on this project's CPU box (README "The
engine" has the profile).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def packed_linear(weight: torch.Tensor, plain_below: int = 0):
    """``x [T, in] -> x @ weight.T`` with ``weight`` [out, in] prepacked for oneDNN, or plain
    ``F.linear`` where the packed kernel is missing or disagrees with it (another torch build).

    ``plain_below`` > 0 keeps the plain weight too and uses it for steps of fewer rows: in float32,
    MKL's sgemm reads a weight for one or two rows about 1.4x faster than oneDNN's packed kernel,
    which wins from four rows on (README "The engine"); that costs a second copy of the weights.
    """
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not packed_kernel_ok():
        return lambda x: F.linear(x, weight)
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    kernel = torch.ops.mkldnn._linear_pointwise
    if plain_below > 0:
        return lambda x: F.linear(x, weight) if x.shape[0] < plain_below else kernel(x, packed, None, "none", [], "")
    return lambda x: kernel(x, packed, None, "none", [], "")


_ok: bool | None = None


def packed_kernel_ok() -> bool:
    """Whether this torch build has oneDNN's prepacked linear and it matches ``F.linear`` (checked once)."""
    global _ok
    if _ok is None:
        try:
            with torch.inference_mode():
                w, x = torch.randn(48, 32), torch.randn(3, 32)
                got = torch.ops.mkldnn._linear_pointwise(
                    x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], ""
                )
                _ok = bool(torch.allclose(got, F.linear(x, w), rtol=1e-3, atol=1e-3))
        except (RuntimeError, AttributeError) as exc:
            log.info("oneDNN prepacked linear unavailable (%s); using F.linear", exc)
            _ok = False
    return _ok
