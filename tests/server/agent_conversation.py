"""What the tests of the agent-facing APIs share: the server's key and model name, a tool whose
forced call is short (its one argument an enum), and a long system prompt, so that a 10-turn
agent conversation is mostly a prefix the cache holds."""

from __future__ import annotations

import httpx

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
    """/health answers 200 and an ordinary chat request completes."""
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    reply = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert reply.status_code == 200, reply.text
