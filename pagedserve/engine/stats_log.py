"""The engine core's periodic log line (throughput, queue, KV cache, prefix hits)."""

from __future__ import annotations

import logging
import time
from typing import Any

from pagedserve.spec_decode.metrics import describe_acceptance

logger = logging.getLogger("pagedserve.engine.core")


def maybe_log_stats(core: Any, interval: float = 10.0) -> None:
    """One line every `interval` seconds while `core.log_stats` is on."""
    if not core.log_stats:
        return
    now = time.monotonic()
    if now - core._last_log < interval:
        return
    s = core.stats()
    rate = (s.generation_tokens - core._logged_tokens) / (now - core._last_log)
    hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0
    logger.info("generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%, "
                "prefix cache hit rate %.1f%%, preemptions %d", rate, s.num_running,
                s.num_waiting, 100 * s.kv_cache_usage, 100 * hit_rate, s.num_preemptions)
    if s.spec_decode_num_drafts:
        logger.info("speculative decoding: %s", describe_acceptance(s))
    core._last_log, core._logged_tokens = now, s.generation_tokens
