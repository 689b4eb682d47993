"""What the tests of the agent-facing APIs share: the server's key and model name, a tool whose
forced call is short (its one argument an enum), and a long system prompt, so that a 10-turn
agent conversation is mostly a prefix the cache holds."""

from __future__ import annotations

import re
import time

import httpx

from tests.utils.server import ServerProcess, wait_for_metrics

MODEL = "tiny"
KEY = "sk-agent-test"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                  "required": ["city"], "additionalProperties": False}
# About 1,000 tokens: each turn adds a call and its result (tens of tokens) behind it.
SYSTEM = " ".join(f"Rule {i}: answer briefly, check the weather tool before you guess, and "
                  f"never invent a city." for i in range(50))
TURNS = 10


def cached_share(usages: list[tuple[int, int]]) -> float:
    """Of the prompt tokens after the first turn, the share the prefix cache held:
    usages are (prompt tokens, cached tokens) per turn."""
    later = usages[1:]
    return sum(c for _, c in later) / sum(n for n, _ in later)


def healthy(url: str) -> None:
    """/health answers 200, an ordinary chat request completes, and nothing is left running,
    waiting or holding KV blocks."""
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    reply = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert reply.status_code == 200, reply.text
    metrics = wait_for_metrics(url, lambda m: m["pagedserve:num_requests_running"] == 0
                               and m["pagedserve:kv_cache_usage_perc"] == 0, timeout=30)
    assert metrics["pagedserve:num_requests_running"] == 0
    assert metrics["pagedserve:num_requests_waiting"] == 0
    assert metrics["pagedserve:kv_cache_usage_perc"] == 0


def leave_mid_stream(server: ServerProcess, path: str, body: dict, id_prefix: str) -> None:
    """Start a long streamed answer, read a few events and hang up: the server aborts it (its
    log line says so; run to its end, it would say "length")."""
    pattern = re.compile(id_prefix + r"\w+: \d+ prompt \+ \d+ completion tokens, finish (\w+)")
    before = len(pattern.findall(server.log_path.read_text()))
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + path, json=body, headers=headers,
                      timeout=60) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 30
    finishes = []
    while len(finishes) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
        finishes = pattern.findall(server.log_path.read_text())
    assert finishes[before:] in (["abort"], ["aborted"]), finishes[before:]
