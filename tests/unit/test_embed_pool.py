"""Pooling packed hidden states (inputs back to back, no pads) gives what pooling the same states
padded with a mask gives, for every sentence-transformers pooling mode."""

from __future__ import annotations

import pytest
import torch

from worker.embed.model import pool, pool_packed

MODES = ["mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens"]


@pytest.mark.parametrize("mode", MODES)
def test_packed_pooling_equals_padded_pooling(mode):
    torch.manual_seed(0)
    lengths = torch.tensor([3, 1, 5, 2])
    width = int(lengths.max())
    padded = torch.randn(4, width, 8)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    padded = padded.masked_fill(mask.unsqueeze(-1) == 0, 1e3)  # pads hold garbage: never read
    packed = torch.cat([padded[i, : int(n)] for i, n in enumerate(lengths)])
    expected = pool(padded, mask, lengths, mode)
    assert torch.allclose(pool_packed(packed, lengths, mode), expected, atol=1e-6)


def test_mean_pooling_of_one_input_is_its_rows_mean():
    rows = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert torch.equal(pool_packed(rows, torch.tensor([3]), "mean"), rows.mean(0, keepdim=True))
