"""The encoder cache through the real scheduler on random workloads with images: preemption,
aborts, prefix caching, repeated images and a step in flight. A mirror of the runner's store
follows each step's evictions and encodes; every image span a step computes must find its rows
there, the store never holds more than encoder_cache_size rows, and once every request has
finished no reference, holder or leaked row is left."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache import KVCacheManager
from pagedserve.multimodal.encoder_cache import EncoderCacheManager
from pagedserve.multimodal.inputs import MultiModalFeature, PlaceholderRange
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Request, RequestStatus, Scheduler

IMAGE_TOKEN = 7


def _image_request(rng: random.Random, rid: str, idents: list[str]) -> Request:
    """Text, then one to three images (spans of 3..12 tokens) with text between them."""
    ids: list[int] = [rng.randrange(100, 200) for _ in range(rng.randint(0, 9))]
    features = []
    for _ in range(rng.randint(1, 3)):
        ident = rng.choice(idents)
        length = 3 + int(ident[1:]) % 10  # an image's size follows its identifier
        features.append(MultiModalFeature("image", ident, PlaceholderRange(len(ids), length),
                                          {}))
        ids += [IMAGE_TOKEN] * length
        ids += [rng.randrange(100, 200) for _ in range(rng.randint(0, 6))]
    ids.append(rng.randrange(100, 200))
    return Request(rid, ids, SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True),
                   mm_features=features)


def _check_step(out, store: dict[str, int], cache: EncoderCacheManager) -> None:
    """The runner's order: drop the evicted rows, encode, then read every span reached."""
    for ident in out.free_encoder_identifiers:
        store.pop(ident, None)
    by_id = {r.request_id: r for r in out.requests}
    for rid, indices in out.scheduled_encoder_inputs.items():
        for index in indices:
            feature = by_id[rid].mm_features[index]
            store[feature.identifier] = feature.placeholder.num_embeds
    assert sum(store.values()) <= cache.cache_size
    for req, start, n in zip(out.requests, out.num_computed_tokens, out.num_scheduled_tokens,
                             strict=True):
        for feature in req.mm_features:
            p = feature.placeholder
            if p.offset < start + n and p.end > start:
                assert feature.identifier in store, (req.request_id, feature.identifier)
                if cache.bidirectional_spans:  # whole spans (from a prefix hit's end on)
                    assert p.end <= start + n, (req.request_id, feature.identifier)


def _run(seed: int, num_blocks: int, caching: bool, overlap: bool, cache_rows: int,
         whole_spans: bool = False) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24), kv,
                      max_model_len=256)
    cache = sched.encoder_cache = EncoderCacheManager(cache_rows, cache_rows, whole_spans,
                                                         24 if whole_spans else None)
    idents = [f"i{k}" for k in range(6)]
    pending = [_image_request(rng, f"r{i}", idents) for i in range(30)]
    store: dict[str, int] = {}
    in_flight = None
    for _ in range(3000):
        if not (pending or sched.has_unfinished_requests() or in_flight is not None):
            break
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add_request(pending.pop(0))
        if sched.requests and rng.random() < 0.05:  # an abort, waiting or running
            sched.finish_requests([rng.choice(list(sched.requests))],
                                  RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        if in_flight is not None:
            prev, in_flight = in_flight, None
            sched.update_from_output(prev, np.array([150 for _ in prev.requests]))
        if out.is_empty:
            continue
        _check_step(out, store, cache)
        if overlap:
            in_flight = out
        else:
            sched.update_from_output(out, np.array([150 for _ in out.requests]))
    else:
        pytest.fail("the workload did not finish")
    cache.begin_step()
    assert not cache.refs and not cache.holders
    assert set(cache.unreferenced) == set(cache.rows)
    assert cache.num_free_rows + sum(cache.rows.values()) == cache.cache_size
    assert kv.num_free_blocks == num_blocks


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", ["preempting", "caching", "in_flight", "whole_spans"])
def test_encoder_cache_random_workload(seed: int, kind: str) -> None:
    args = {"preempting": dict(num_blocks=20, caching=False, overlap=False, cache_rows=24),
            "caching": dict(num_blocks=40, caching=True, overlap=False, cache_rows=16),
            "in_flight": dict(num_blocks=24, caching=True, overlap=True, cache_rows=20),
            "whole_spans": dict(num_blocks=24, caching=True, overlap=True, cache_rows=20,
                                whole_spans=True)}
    _run(seed, **args[kind])
