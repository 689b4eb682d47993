"""/v1/completions through the openai client and raw httpx: texts, streams, logprobs and stop
strings equal the offline engine's greedy ones."""

from __future__ import annotations

import math

import httpx
import pytest

from tests.server.openai_server import (
    GREEDY,
    MODEL,
    PROMPTS,
    REF_TOKENS,
    post,
    sse_events,
    stop_of_two_tokens,
)

# Run against the core-process server only with `-m slow` (tests/server/conftest.py): by
# default the served core process is tested by tests/server/test_core_process_faults.py
# (requests, streams, its death) and the front/core split by tests/engine/test_core_process.py.
CORE_PROCESS_SLOW = {
    "test_completion_greedy_equals_llm_generate", "test_completion_stream",
    "test_stop_strings_and_token_ids", "test_completion_default_max_tokens_is_16",
    "test_completion_echo_and_logprobs", "test_n_and_seed_reproducible",
    "test_completion_logprobs_end_where_the_stop_string_cuts_the_text",
}

def test_completion_greedy_equals_llm_generate(client, ref):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=REF_TOKENS,
                                     temperature=0)
    expected = ref.plain.outputs[0]
    assert resp.id.startswith("cmpl-")
    assert resp.object == "text_completion"
    assert resp.model == MODEL
    assert resp.system_fingerprint
    assert len(resp.choices) == 1
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(ref.plain.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_default_max_tokens_is_16(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16
    assert resp.choices[0].finish_reason == "length"


def test_completion_prompt_forms(server, ref):
    """A list of strings, token ids and a list of token-id lists: one choice per prompt."""
    ids = [ref.llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    k = 4
    for prompt in (PROMPTS[:2], ids[0], ids):
        body = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                "max_tokens": k, **GREEDY}).json()
        n = 1 if isinstance(prompt[0], int) else 2
        assert [c["index"] for c in body["choices"]] == list(range(n))
        assert [c["text"] for c in body["choices"]] == [ref.texts[i][k] for i in range(n)]
        assert body["usage"]["prompt_tokens"] == sum(ref.prompt_lens[:n])
        assert body["usage"]["completion_tokens"] == n * k


def test_completion_stream(client, any_server, ref):
    server = any_server
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=REF_TOKENS,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={**GREEDY})
    chunks = list(stream)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == REF_TOKENS
    assert chunks[-1].usage.prompt_tokens == ref.prompt_lens[2]
    text = "".join(c.choices[0].text for c in chunks[:-1])
    assert text == ref.texts[2][REF_TOKENS]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    # Raw: Server-Sent Events ending with [DONE]; no usage chunk unless asked for.
    with httpx.stream("POST", server.url + "/v1/completions", timeout=600,
                      json={"prompt": PROMPTS[2], "max_tokens": 3, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])


def test_completion_echo_and_logprobs(client, ref):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=REF_TOKENS,
                                     temperature=0, logprobs=2)
    expected = ref.plain.outputs[0]
    lp = resp.choices[0].logprobs
    assert "".join(lp.tokens) == resp.choices[0].text
    assert len(lp.token_logprobs) == len(expected.token_ids)
    for token_id, position, value, top in zip(expected.token_ids, expected.logprobs,
                                              lp.token_logprobs, lp.top_logprobs, strict=True):
        assert math.isclose(value, position[token_id].logprob, rel_tol=1e-4, abs_tol=1e-5)
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the argmax
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2,
                                     temperature=0, echo=True, logprobs=1)
    choice = echo.choices[0]
    assert choice.text == PROMPTS[0] + ref.plain.outputs[0].text[:len(choice.text)
                                                                   - len(PROMPTS[0])]
    n_prompt = len(ref.plain.prompt_token_ids)
    assert len(choice.logprobs.tokens) == n_prompt + 2
    assert choice.logprobs.token_logprobs[0] is None  # nothing precedes the first token
    assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])


def test_n_and_seed_reproducible(client):
    def sample():
        return client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, n=2,
                                         temperature=1.0, seed=1234)

    a, b = sample(), sample()
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 16
    other = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8,
                                      temperature=1.0, seed=99)
    assert other.choices[0].text != a.choices[0].text


def test_stop_strings_and_token_ids(client, ref):
    full = ref.texts[0][REF_TOKENS]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=REF_TOKENS,
                                     stop=[stop], extra_body=GREEDY)
    choice = resp.choices[0]
    assert choice.text == full[:full.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    kept = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=REF_TOKENS,
                                     stop=stop, extra_body={**GREEDY,
                                                            "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.index(stop) + len(stop)]
    first_id = ref.llm.tokenizer.encode(ref.texts[0][1], add_special_tokens=False)[0]
    by_id = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=REF_TOKENS,
                                      extra_body={**GREEDY, "stop_token_ids": [first_id]})
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.choices[0].text == ""
    assert by_id.choices[0].model_extra["stop_reason"] == first_id


def test_completion_logprobs_end_where_the_stop_string_cuts_the_text(client, ref):
    """Logprobs are for the tokens whose text is returned: not for those of the stop string
    (unless include_stop_str_in_output), streamed or not."""
    k, stop = stop_of_two_tokens(ref.texts[0])
    for include, kept in ((False, k), (True, k + 2)):
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": REF_TOKENS, "logprobs": 1,
                "stop": [stop], "extra_body": {**GREEDY, "include_stop_str_in_output": include}}
        whole = client.completions.create(**body).choices[0]
        assert whole.finish_reason == "stop" and whole.text == ref.texts[0][kept]
        lp = whole.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == kept
        assert "".join(lp.tokens) == whole.text
        assert lp.text_offset == [len(ref.texts[0][j]) if j else 0 for j in range(kept)]
        chunks = [c.choices[0] for c in client.completions.create(**body, stream=True)]
        assert "".join(c.text for c in chunks) == whole.text
        streamed = [c.logprobs for c in chunks if c.logprobs]
        assert [t for s in streamed for t in s.tokens] == lp.tokens
        assert [o for s in streamed for o in s.text_offset] == lp.text_offset
        assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(
            lp.token_logprobs, abs=1e-5)
