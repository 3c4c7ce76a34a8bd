"""The decode step's written-out RMSNorm gives exactly torch's on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.llama import rms_norm_cpu


def test_rms_norm_cpu_is_bit_for_bit_torchs():
    g = torch.Generator().manual_seed(0)
    for rows, width, eps in ((1, 576, 1e-5), (3, 576, 1e-5), (45, 576, 1e-6), (8, 4096, 1e-5), (2, 64, 1e-2)):
        weight = torch.randn(width, generator=g)
        for scale in (1e-3, 1.0, 40.0):
            x = torch.randn(rows, width, generator=g) * scale
            assert torch.equal(rms_norm_cpu(x, weight, eps), F.rms_norm(x, (width,), weight, eps))
