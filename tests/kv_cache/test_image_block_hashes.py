"""Prefix-cache hashes of prompts with images: the blocks an image span touches (one where it
starts or ends mid-block included) carry the image's identifier, the blocks before it do not,
and hashes extended a few blocks at a time equal those computed at once."""

from __future__ import annotations

from pagedserve.kv_cache import KVCacheManager
from pagedserve.multimodal.inputs import MultiModalFeature, PlaceholderRange
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Request

BS = 4


def _hashes(rid: str, ident: str, steps: tuple[int, ...] = (6,)) -> list[bytes]:
    # tokens 0..5 text, 6..12 the image (starts mid-block 1, ends mid-block 3), then text
    ids = list(range(6)) + [99] * 7 + list(range(20, 31))
    span = MultiModalFeature("image", ident, PlaceholderRange(6, 7), {})
    request = Request(rid, ids, SamplingParams(max_tokens=1), mm_features=[span])
    kv = KVCacheManager(64, BS, enable_prefix_caching=True)
    for n in steps:
        hashes = kv._block_hashes(request, n)
    return list(hashes)


def test_image_keys_from_the_block_where_the_span_starts():
    a, b = _hashes("a", "x"), _hashes("b", "y")
    assert a[0] == b[0]  # tokens 0..3: before the image
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))  # block 1 holds its start
    text = Request("t", list(range(6)) + [99] * 7 + list(range(20, 31)),
                   SamplingParams(max_tokens=1))
    plain = KVCacheManager(64, BS, enable_prefix_caching=True)._block_hashes(text, 6)
    assert plain[0] == a[0] and plain[1] != a[1]  # the same ids without the image differ


def test_hashes_extended_block_by_block_equal_hashes_at_once():
    assert _hashes("a", "x", steps=(1, 2, 4, 6)) == _hashes("a", "x")
