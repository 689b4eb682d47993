"""/v1/chat/completions: texts, stream chunks, n, logprobs and stop strings equal the offline
engine's chat."""

from __future__ import annotations

import httpx
import pytest

from tests.server.openai_server import CHAT, CHAT_TOKENS, MODEL, sse_events, stop_of_two_tokens

# The core-process variants run with `-m slow` only (see test_completions_api.py).
CORE_PROCESS_SLOW = {
    "test_chat_equals_llm_chat", "test_chat_stream_with_openai_client_n2",
    "test_chat_without_max_tokens_runs_to_eos", "test_chat_logprobs",
    "test_chat_logprobs_end_where_the_stop_string_cuts_the_text",
}

def test_chat_equals_llm_chat(client, ref):
    for limit in ({"max_completion_tokens": CHAT_TOKENS}, {"max_tokens": CHAT_TOKENS}):
        resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                              **limit)
        assert resp.id.startswith("chatcmpl-")
        assert resp.object == "chat.completion"
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].message.content == ref.chat_text
        assert resp.usage.prompt_tokens == len(ref.chat_prompt_ids)
        assert resp.usage.completion_tokens == ref.chat_tokens


def test_chat_without_max_tokens_runs_to_eos(client, ref):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content.startswith(ref.chat_text)


def test_chat_stream_chunk_shapes(server, ref):
    body = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": CHAT_TOKENS,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=600) as resp:
        assert resp.status_code == 200
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks[1:-2]]
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in content)
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == ref.chat_text
    last = chunks[-2]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    # Earlier tests sent this chat: its prompt may be in the prefix cache, in whole blocks.
    assert 0 <= usage.pop("prompt_tokens_details")["cached_tokens"] < len(ref.chat_prompt_ids)
    assert usage == {"prompt_tokens": len(ref.chat_prompt_ids),
                     "completion_tokens": ref.chat_tokens,
                     "total_tokens": len(ref.chat_prompt_ids) + ref.chat_tokens}


def test_chat_stream_with_openai_client_n2(client):
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2,
                                            seed=5, stream=True)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2,
                                           seed=5)
    assert [c.message.content for c in again.choices] == [texts[0], texts[1]]


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                          max_tokens=5, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for token in content:
        values = [t.logprob for t in token.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert token.logprob == pytest.approx(values[0], abs=1e-5)  # greedy picks the top
        assert token.bytes == list(token.token.encode())


def test_chat_logprobs_end_where_the_stop_string_cuts_the_text(client, ref):
    ids = ref.chat_token_ids
    k, stop = stop_of_two_tokens({j: ref.llm.tokenizer.decode(ids[:j], skip_special_tokens=True)
                                   for j in range(1, len(ids) + 1)})
    body = {"model": MODEL, "messages": CHAT, "max_tokens": CHAT_TOKENS, "temperature": 0,
            "logprobs": True, "top_logprobs": 1, "stop": [stop]}
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "stop"
    content = whole.logprobs.content
    assert len(content) == k
    assert "".join(t.token for t in content) == whole.message.content
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = [t for c in chunks for choice in c.choices if choice.logprobs
                for t in choice.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert "".join(choice.delta.content or "" for c in chunks for choice in c.choices) == \
        whole.message.content
