"""Prometheus metrics of one server: engine gauges and counters read at scrape time, latency
histograms observed by the engine thread as outputs come out."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.outputs import RequestOutput

PREFIX = "pagedserve:"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class EngineCollector(Collector):
    """Reads the engine thread's latest snapshot, so a scrape never touches the engine."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm

    def collect(self) -> Iterator[Metric]:
        snap = self.llm.snapshot
        s = snap.stats
        gauges = [
            ("num_requests_running", "Sequences in the running batch.", s.num_running),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            ("max_num_requests_running", "Most requests in one step since start.",
             snap.max_num_running),
            ("kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1).",
             s.kv_cache_usage),
            ("kv_cache_total_blocks", "KV cache blocks in the pool.", snap.num_blocks),
            ("kv_cache_free_blocks",
             "KV blocks held by no request (free or cached-evictable).", snap.num_free_blocks),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = [
            ("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
             s.prompt_tokens),
            ("generation_tokens", "Tokens generated.", s.generation_tokens),
            ("num_preemptions", "Preemptions of running sequences.", s.num_preemptions),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             s.prefix_cache_hits),
            ("num_engine_steps", "Engine steps run.", snap.num_steps),
            ("num_aborted_requests", "Requests aborted (client gone or cancelled).",
             snap.num_aborted),
        ]
        if s.spec_decode_num_accepted_tokens_per_pos:  # speculative decoding on
            counters += [
                ("spec_decode_num_drafts", "Requests' verify steps with drafts.",
                 s.spec_decode_num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.",
                 s.spec_decode_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 s.spec_decode_num_accepted_tokens)]
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        if s.spec_decode_num_accepted_tokens_per_pos:
            per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted at each position.",
                                          labels=["position"])
            for position, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([str(position)], n)
            yield per_pos


class ServerMetrics:
    """One app's registry. Implements the AsyncLLM's OutputObserver."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(llm))
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Arrival to first generated token.", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between a request's consecutive outputs.",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Arrival to the last token of finished requests.",
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.finished = Counter(PREFIX + "request_success", "Finished requests by reason.",
                                ["finished_reason"], registry=self.registry)

    def observe_output(self, output: RequestOutput, inter_token_latency: float | None) -> None:
        m = output.metrics
        if m is None:
            return
        if inter_token_latency is None and m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        elif inter_token_latency is not None:
            self.itl.observe(inter_token_latency)
        if output.finished:
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
            for completion in output.outputs if isinstance(output.outputs, list) else ():
                self.finished.labels(completion.finish_reason or "unknown").inc()

    def observe_abort(self) -> None:
        """Aborts are counted from the engine snapshot; nothing else to record."""
