"""The server's plain routes (health, version, models, tokenize, metrics) against the offline
reference."""

from __future__ import annotations

import httpx

from pagedserve import __version__
from tests.server.openai_server import CHAT, GREEDY, MODEL, PROMPTS, post
from tests.utils.server import read_metrics


def test_health_version_models(server, ref):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == ref.llm.engine.max_model_len


def test_tokenize_detokenize(server, ref):
    prompt = PROMPTS[7]
    tokens = ref.llm.tokenizer.encode(prompt, add_special_tokens=False)
    body = post(server, "/tokenize", {"model": MODEL, "prompt": prompt}).json()
    assert body == {"tokens": tokens, "count": len(tokens),
                    "max_model_len": ref.llm.engine.max_model_len}
    assert post(server, "/detokenize", {"model": MODEL, "tokens": tokens}).json() == {
        "prompt": prompt}
    chat = post(server, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    assert chat["tokens"] == ref.chat_prompt_ids


def test_metrics_exposition(server):
    post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3, **GREEDY})
    m = read_metrics(server.url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "kv_cache_free_blocks", "kv_cache_total_blocks", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "max_num_requests_running"):
        assert "pagedserve:" + name in m, name
    assert m["pagedserve:prompt_tokens_total"] > 0
    assert m["pagedserve:generation_tokens_total"] >= 3
    assert m["pagedserve:time_to_first_token_seconds_count"] >= 1
    assert m["pagedserve:inter_token_latency_seconds_count"] >= 2
    assert m["pagedserve:e2e_request_latency_seconds_count"] >= 1
    assert m['pagedserve:request_success_total{finished_reason="length"}'] >= 1
    # The same long prompt twice: the second finds its full blocks in the prefix cache.
    prompt = " ".join(PROMPTS)
    for _ in range(2):
        post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    after = read_metrics(server.url)
    hits = "pagedserve:prefix_cache_hits_total"
    assert after[hits] >= m[hits] + 16
    # A cache_salt keeps one tenant's prefixes from another's: no hits on first use.
    salted = {"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"}
    post(server, "/v1/completions", salted)
    first = read_metrics(server.url)[hits]
    assert first == after[hits]
    post(server, "/v1/completions", salted)
    assert read_metrics(server.url)[hits] >= first + 16
