"""The scheduler's encoder cache: when an image's encoder runs, how a chunk stops before a
span it cannot fill, references and eviction, the rule for spans that may not be split (an
engine whose encoder cache holds one image: tests/multimodal/test_llava.py)."""

from __future__ import annotations

from types import SimpleNamespace

from pagedserve.multimodal.encoder_cache import EncoderCacheManager
from pagedserve.multimodal.inputs import MultiModalFeature, PlaceholderRange


def _request(rid: str, spans: list[tuple[int, int, str]]):
    features = [MultiModalFeature("image", ident, PlaceholderRange(offset, length), {})
                for offset, length, ident in spans]
    return SimpleNamespace(request_id=rid, mm_features=features, num_computed_tokens=0)


def _run(cache: EncoderCacheManager, request, num_new: int) -> tuple[int, list[int]]:
    """One step of one request: plan, commit, advance."""
    cache.begin_step()
    start = request.num_computed_tokens
    num_new, to_encode = cache.plan(request, start, num_new)
    cache.commit(request, to_encode, start, num_new)
    request.num_computed_tokens += num_new
    return num_new, to_encode


def test_encoder_runs_when_a_chunk_first_reaches_the_span():
    cache = EncoderCacheManager(cache_size=100, compute_budget=100)
    r = _request("a", [(4, 9, "x"), (20, 9, "y")])
    assert _run(cache, r, 3) == (3, [])  # before the first span
    assert _run(cache, r, 4) == (4, [0])  # reaches x: encoded, the span split
    assert _run(cache, r, 10) == (10, [])  # x's rest from the store
    assert _run(cache, r, 10) == (10, [1])  # y
    assert cache.num_cached == 2


def test_a_chunk_stops_before_a_span_it_has_no_room_for():
    cache = EncoderCacheManager(cache_size=9, compute_budget=9)
    a, b = _request("a", [(2, 9, "x")]), _request("b", [(1, 9, "y")])
    assert _run(cache, a, 5) == (5, [0])
    # b's image needs 9 rows; a still needs x (its span is not done): b stops before its span
    assert _run(cache, b, 8) == (1, [])
    assert _run(cache, a, 20) == (20, [])  # a goes past x: its reference goes next step
    assert _run(cache, b, 8) == (8, [0])  # x evicted for y
    assert cache.take_freed() == ["x"]


def test_step_encoder_budget_and_shared_images():
    cache = EncoderCacheManager(cache_size=100, compute_budget=10)
    cache.begin_step()
    a, b = _request("a", [(0, 9, "x")]), _request("b", [(0, 9, "y"), (9, 9, "x")])
    n, enc = cache.plan(a, 0, 9)
    cache.commit(a, enc, 0, n)
    assert (n, enc) == (9, [0])
    # y would pass the step's budget of 10 rows (9 spent on x): b waits
    assert cache.plan(b, 0, 18) == (0, [])
    cache.begin_step()
    assert cache.plan(b, 0, 18) == (18, [0])  # x is in the store already: only y runs


def test_unreferenced_rows_stay_until_room_is_needed():
    cache = EncoderCacheManager(cache_size=18, compute_budget=18)
    a = _request("a", [(0, 9, "x")])
    _run(cache, a, 12)
    cache.release(a)  # finished
    again = _request("a2", [(0, 9, "x")])
    assert _run(cache, again, 12) == (12, [])  # a hit: nothing to encode
    cache.release(again)
    c = _request("c", [(0, 9, "y"), (9, 9, "z")])
    assert _run(cache, c, 18) == (18, [0, 1])  # room for y and z: x evicted
    assert cache.take_freed() == ["x"]


def test_bidirectional_spans_are_never_split():
    cache = EncoderCacheManager(cache_size=100, compute_budget=100, bidirectional_spans=True,
                                span_limit=16)
    r = _request("a", [(3, 9, "x")])
    assert _run(cache, r, 8) == (3, [])  # would end inside the span: stops before it
    assert _run(cache, r, 8) == (0, [])  # the span (9) does not fit in 8 tokens
    assert _run(cache, r, 12) == (12, [0])  # the whole span in one step
