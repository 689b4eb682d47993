"""The batched pooling pass against one request at a time, and Matryoshka truncation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.pooling.methods import finish, pool


@pytest.mark.parametrize("method", ["cls", "mean", "last"])
def test_pool_equals_per_request(method):
    torch.manual_seed(0)
    lengths = [1, 7, 3, 16]
    hidden = torch.randn(sum(lengths) + 5, 8)  # rows past the step's tokens: padding
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    got = pool(hidden[:sum(lengths)], cu, method)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        rows = hidden[start:end]
        want = {"cls": rows[0], "mean": rows.mean(0), "last": rows[-1]}[method]
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=0)


def test_finish_truncates_then_normalises():
    torch.manual_seed(0)
    pooled = torch.randn(4, 8)
    out = finish(pooled, [None, 3, None, 5], normalize=True)
    torch.testing.assert_close(out[0], F.normalize(pooled[0], dim=0))
    torch.testing.assert_close(out[1, :3], F.normalize(pooled[1, :3], dim=0))
    assert (out[1, 3:] == 0).all() and (out[3, 5:] == 0).all()
    raw = finish(pooled, [2, None, None, None], normalize=False)
    torch.testing.assert_close(raw[0, :2], pooled[0, :2])
    torch.testing.assert_close(raw[1:], pooled[1:])
    assert finish(pooled, [None] * 4, normalize=False) is pooled
