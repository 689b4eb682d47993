"""The OpenAI-compatible server end to end: a real `pagedserve serve` subprocess on a loopback
port, driven by the official `openai` client and raw httpx. Expected texts come from the
offline engine in this process (LLM(model=None), greedy), never from the server itself."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from pagedserve import LLM, SamplingParams, __version__
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError
from pagedserve.engine.llm import render_chat
from tests.utils.server import ServerProcess, read_metrics, wait_for_metrics

MODEL = "smollm2"
REF_TOKENS = 8
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite food is",
    "In 1492, Columbus",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "To make a cup of tea, first",
    "Python is a programming language that",
    "The largest planet in the solar system is",
    "Hello, my name is",
    "A haiku about the sea:\n",
    "The square root of 144 is",
    "List of European countries: France, Germany,",
    "Photosynthesis is the process by which plants convert sunlight into",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_TOKENS = 12
GREEDY = {"temperature": 0, "ignore_eos": True}


@dataclass
class Reference:
    llm: LLM
    # texts[i][k]: greedy text of PROMPTS[i] after k tokens (ignore_eos), k = 1..REF_TOKENS.
    texts: list[dict[int, str]] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    plain: object = None  # LLM.generate(PROMPTS[0]) greedy with logprobs=2, EOS honoured
    chat_text: str = ""
    chat_tokens: int = 0
    chat_token_ids: list[int] = field(default_factory=list)
    chat_prompt_ids: list[int] = field(default_factory=list)


def _texts_per_length(llm: LLM) -> tuple[list[dict[int, str]], list[int]]:
    """Step the offline engine, recording each prompt's text after every token."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=REF_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ref-{i}", prompt, params)
    texts: list[dict[int, str]] = [{} for _ in PROMPTS]
    lens = [0] * len(PROMPTS)
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = int(out.request_id.split("-")[1])
            texts[i][len(out.outputs[0].token_ids)] = out.outputs[0].text
            lens[i] = len(out.prompt_token_ids)
    return texts, lens


@pytest.fixture(scope="module")
def ref() -> Reference:
    # float32 weights: the path that matches transformers (the CPU's int8 default is as
    # batch-invariant: tests/server/test_batch_invariance.py).
    llm = LLM(model=None, dtype="float32", kv_cache_memory="128MiB")
    texts, lens = _texts_per_length(llm)
    final = llm.generate(PROMPTS, SamplingParams(max_tokens=REF_TOKENS, **GREEDY),
                         use_tqdm=False)
    for i, out in enumerate(final):  # the stepped texts are LLM.generate's
        assert texts[i][REF_TOKENS] == out.outputs[0].text
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=REF_TOKENS,
                                                    logprobs=2), use_tqdm=False)[0]
    chat = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=CHAT_TOKENS),
                    use_tqdm=False)[0]
    return Reference(llm, texts, lens, plain, chat.outputs[0].text,
                     len(chat.outputs[0].token_ids), list(chat.outputs[0].token_ids),
                     render_chat(llm.tokenizer, CHAT))


@pytest.fixture(scope="module")
def server(request, tmp_path_factory) -> ServerProcess:
    # Started first so the model loads while the reference runs in this process.
    srv = ServerProcess(["--served-model-name", MODEL, "--dtype", "float32",
                         "--kv-cache-memory", "512MiB"],
                        tmp_path_factory.mktemp("server") / "server.log", wait=False)
    try:
        request.getfixturevalue("ref")
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def core_server(request, tmp_path_factory) -> ServerProcess:
    """The same server with its engine core in a process of its own."""
    request.getfixturevalue("ref")
    srv = ServerProcess(["--served-model-name", MODEL, "--dtype", "float32",
                         "--kv-cache-memory", "512MiB", "--engine-core-process"],
                        tmp_path_factory.mktemp("core_server") / "server.log")
    yield srv
    srv.stop()


# Run against the core-process server only with `-m slow` (tests/server/conftest.py): by
# default the served core process is tested by tests/server/test_core_process_faults.py
# (requests, streams, its death) and the front/core split by tests/engine/test_core_process.py.
CORE_PROCESS_SLOW = {
    "test_completion_greedy_equals_llm_generate", "test_completion_stream",
    "test_stop_strings_and_token_ids", "test_chat_equals_llm_chat",
    "test_chat_stream_with_openai_client_n2", "test_client_disconnect_aborts_and_frees_blocks",
    "test_completion_default_max_tokens_is_16", "test_completion_echo_and_logprobs",
    "test_n_and_seed_reproducible", "test_chat_without_max_tokens_runs_to_eos",
    "test_chat_logprobs", "test_64_concurrent_streams_batch_and_free_all_blocks",
    "test_completion_logprobs_end_where_the_stop_string_cuts_the_text",
    "test_chat_logprobs_end_where_the_stop_string_cuts_the_text",
    "test_bench_serve_runs_against_both",
}


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def any_server(request) -> ServerProcess:
    """The tests that take it (and `client`) run against both: same texts, same answers."""
    return request.getfixturevalue("server" if request.param == "in-process" else "core_server")


@pytest.fixture(scope="module")
def client(any_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=any_server.url + "/v1", api_key="unused", timeout=600,
                         max_retries=0)


def post(server: ServerProcess, path: str, body, headers=None) -> httpx.Response:
    kwargs = {"json": body} if not isinstance(body, str) else {"content": body}
    return httpx.post(server.url + path, headers=headers, timeout=600, **kwargs)


def sse_events(lines) -> list:
    """`data: ...` lines -> parsed JSON chunks, the final [DONE] kept as the string."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(resp: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None, contains: tuple[str, ...] = ()) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    for text in contains:
        assert text in error["message"], error
    return error


def assert_all_blocks_free(url: str) -> dict[str, float]:
    m = wait_for_metrics(url, lambda m: m["pagedserve:num_requests_running"] == 0
                         and m["pagedserve:kv_cache_free_blocks"]
                         == m["pagedserve:kv_cache_total_blocks"], timeout=60)
    assert m["pagedserve:num_requests_running"] == 0
    assert m["pagedserve:num_requests_waiting"] == 0
    assert m["pagedserve:kv_cache_free_blocks"] == m["pagedserve:kv_cache_total_blocks"]
    assert m["pagedserve:kv_cache_usage_perc"] == 0
    return m


# ---- plain routes -------------------------------------------------------------------------


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


# ---- completions --------------------------------------------------------------------------


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


def _stop_of_two_tokens(texts: dict[int, str]) -> tuple[int, str]:
    """(k, stop): a stop string that is exactly the text of greedy tokens k+1 and k+2 and
    found nowhere earlier (texts[j]: the text after j tokens), so that the text returned is
    that of tokens 1..k (with the stop string, 1..k+2). Each of tokens k..k+2 has text of
    its own (no character split over them)."""
    texts = {0: "", **texts}
    last = max(texts)
    assert sorted(texts) == list(range(last + 1)), "a step's text is missing"
    for k in sorted(range(1, last - 1), key=lambda k: abs(k - last // 2)):
        ends = [len(texts[j]) for j in range(k - 1, k + 3)]
        stop = texts[k + 2][ends[1]:]
        if ends == sorted(set(ends)) and texts[last].find(stop) == ends[1]:
            return k, stop
    pytest.skip("no two greedy tokens make a stop string found nowhere before them")


def test_completion_logprobs_end_where_the_stop_string_cuts_the_text(client, ref):
    """Logprobs are for the tokens whose text is returned: not for those of the stop string
    (unless include_stop_str_in_output), streamed or not."""
    k, stop = _stop_of_two_tokens(ref.texts[0])
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


# ---- chat ---------------------------------------------------------------------------------


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
    k, stop = _stop_of_two_tokens({j: ref.llm.tokenizer.decode(ids[:j], skip_special_tokens=True)
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


# ---- errors -------------------------------------------------------------------------------

LONG_PROMPT = [42] * 8180

ERROR_CASES = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", None),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt", None),
    ("/v1/completions", {}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs",
     None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role", None),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", None),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model",
     "model_not_found"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", None),
    ("/tokenize", {"model": MODEL}, 400, "prompt", None),
    ("/v1/completions", "{not json", 400, None, None),
]


@pytest.mark.parametrize("path,body,status,param,code", ERROR_CASES,
                         ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(ERROR_CASES)])
def test_error_responses(server, path, body, status, param, code):
    headers = {"Content-Type": "application/json"}
    assert_error(post(server, path, body, headers), status, param, code)


def test_body_must_be_json(server):
    resp = httpx.post(server.url + "/v1/completions", data={"prompt": "x"})
    assert_error(resp, 400, contains=("JSON object",))


def test_body_that_is_not_json_names_where_it_breaks(server):
    for path in ("/v1/completions", "/v1/messages"):
        resp = httpx.post(server.url + path, content=b'{"prompt": [}',
                          headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]  # OpenAI's shape, or Anthropic's on /v1/messages
        assert error["message"] == ("the request body is not valid JSON: Expecting value at "
                                    "character 12"), error
        assert error.get("param") is None, error


def test_context_length_error_names_both_numbers(server, ref):
    max_len = ref.llm.engine.max_model_len
    resp = post(server, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 20})
    error = assert_error(resp, 400, "prompt", "context_length_exceeded",
                         (str(max_len), str(len(LONG_PROMPT) + 20)))
    assert error["type"] == "invalid_request_error"
    long_chat = [{"role": "user", "content": "hello " * 9000}]
    assert_error(post(server, "/v1/chat/completions", {"messages": long_chat}), 400,
                 "messages", contains=(str(max_len),))


def test_embeddings_from_a_generating_model_refused(server):
    r = post(server, "/v1/embeddings", {"model": MODEL, "input": "hello"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "generates text: it serves no embeddings" in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == "model"


def test_bad_requests_do_not_disturb_others(server, ref):
    """Bad requests fired while a stream runs: each gets its 400, the stream is unharmed."""
    result = {}

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=600, json={
                "prompt": PROMPTS[3], "max_tokens": REF_TOKENS, "stream": True,
                **GREEDY}) as resp:
            events = sse_events(resp.iter_lines())
        result["text"] = "".join(e["choices"][0]["text"] for e in events[:-1])

    thread = threading.Thread(target=stream)
    thread.start()
    for body in ({"prompt": LONG_PROMPT, "max_tokens": 20}, {"prompt": "x", "min_p": 7},
                 {"prompt": [10**9]}):
        assert post(server, "/v1/completions", body).status_code == 400
    thread.join(600)
    assert result["text"] == ref.texts[3][REF_TOKENS]


# ---- concurrency, disconnects, metrics ----------------------------------------------------


def test_64_concurrent_streams_batch_and_free_all_blocks(any_server, ref):
    server = any_server
    lengths = [2, 4, 6, 8]
    jobs = [(i, k) for k in lengths for i in range(len(PROMPTS))]
    assert len(jobs) == 64
    seen_running = []

    async def one(client: httpx.AsyncClient, i: int, k: int) -> tuple[str, dict]:
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": k, "stream": True,
                "stream_options": {"include_usage": True}, **GREEDY}
        text, usage = "", None
        async with client.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                else:
                    usage = chunk["usage"]
        return text, usage

    async def sample_metrics(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            text = (await client.get(server.url + "/metrics")).text
            for line in text.splitlines():
                if line.startswith("pagedserve:num_requests_running "):
                    seen_running.append(float(line.split()[-1]))
            await asyncio.sleep(0.05)

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_metrics(client, stop))
            results = await asyncio.gather(*(one(client, i, k) for i, k in jobs))
            stop.set()
            await sampler
            return results

    results = asyncio.run(main())
    for (i, k), (text, usage) in zip(jobs, results, strict=True):
        assert text == ref.texts[i][k], (PROMPTS[i], k)
        assert usage["completion_tokens"] == k
        assert usage["prompt_tokens"] == ref.prompt_lens[i]
    m = assert_all_blocks_free(server.url)
    assert m["pagedserve:max_num_requests_running"] > 1
    assert max(seen_running) > 1, seen_running


def test_client_disconnect_aborts_and_frees_blocks(any_server, ref):
    server = any_server
    before = read_metrics(server.url)
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 4000, "stream": True,
            **GREEDY}
    with httpx.Client(timeout=600) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            received = 0
            for line in resp.iter_lines():
                received += line.startswith("data: ")
                if received == 3:
                    break
    # The client is gone: the engine must drop the request and free its blocks.
    aborted = "pagedserve:num_aborted_requests_total"
    m = wait_for_metrics(server.url, lambda m: m[aborted] == before[aborted] + 1, timeout=60)
    assert m[aborted] == before[aborted] + 1
    # A non-streamed request whose client gives up is aborted too.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=2)
    m = wait_for_metrics(server.url, lambda m: m[aborted] == before[aborted] + 2, timeout=60)
    assert m[aborted] == before[aborted] + 2
    m = assert_all_blocks_free(server.url)
    generated = (m["pagedserve:generation_tokens_total"]
                 - before["pagedserve:generation_tokens_total"])
    assert generated < 4000
    resp = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, **GREEDY})
    assert resp.json()["choices"][0]["text"] == ref.texts[0][4]


def test_bench_serve_runs_against_both(any_server, capsys):
    from pagedserve.cli import main

    rc = main(["bench", "serve", "--url", any_server.url, "--num-prompts", "4",
               "--input-len", "8", "--output-len", "4", "--max-concurrency", "2"])
    assert rc == 0, capsys.readouterr()
    assert_all_blocks_free(any_server.url)


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


# ---- authentication, the waiting-queue limit, async scheduling (a second server) -----------

API_KEY = "test-secret-key"


@pytest.fixture(scope="module")
def key_server(server, tmp_path_factory) -> ServerProcess:
    srv = ServerProcess(["--max-num-seqs", "1", "--max-waiting-requests", "1",
                         "--kv-cache-memory", "512MiB", "--async-scheduling"],
                        tmp_path_factory.mktemp("key_server") / "server.log",
                        env={"PAGEDSERVE_API_KEY": API_KEY})
    yield srv
    srv.stop()


def test_api_key(key_server):
    url = key_server.url
    good = {"Authorization": f"Bearer {API_KEY}"}
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert_error(httpx.get(url + "/v1/models", headers=headers), 401,
                     code="invalid_api_key")
        assert_error(post(key_server, "/v1/completions", {"prompt": "x"}, headers), 401)
        assert_error(post(key_server, "/tokenize", {"prompt": "x"}, headers), 401)
    assert httpx.get(url + "/v1/models", headers=good).status_code == 200
    # A malformed body without the key is a 401 (the key is checked before the body is read);
    # with it, a 400.
    assert_error(post(key_server, "/v1/completions", "{not json"), 401, code="invalid_api_key")
    assert_error(post(key_server, "/v1/completions", "{not json", good), 400)
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(url + path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)
    assert ok.completions.create(model=ok.models.list().data[0].id, prompt="Hi",
                                 max_tokens=2).usage.completion_tokens == 2


def test_waiting_queue_limit_answers_503(key_server):
    """max_num_seqs 1, limit 1: one running, one waiting, the next is refused with 503."""
    url, headers = key_server.url, {"Authorization": f"Bearer {API_KEY}"}
    waiting = "pagedserve:num_requests_waiting"
    second = {}

    def send_second():
        second["resp"] = post(key_server, "/v1/completions",
                              {"prompt": "Hi", "max_tokens": 2}, headers)

    with httpx.Client(timeout=600, headers=headers) as http:
        body = {"prompt": PROMPTS[1], "max_tokens": 4000, "stream": True, **GREEDY}
        with http.stream("POST", url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it is running
            thread = threading.Thread(target=send_second)
            thread.start()
            m = wait_for_metrics(url, lambda m: m[waiting] == 1, timeout=60)
            assert m[waiting] == 1
            refused = post(key_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                           headers)
            assert_error(refused, 503, code="overloaded", contains=("waiting",))
    # Closing the stream aborts the long request; the waiting one then runs.
    thread.join(600)
    assert second["resp"].status_code == 200
    assert second["resp"].json()["usage"]["completion_tokens"] == 2
    assert_all_blocks_free(url)


# ---- AsyncLLM in this process -------------------------------------------------------------


def test_async_llm_abort_bad_request_and_cancel(ref):
    engine = ref.llm.engine
    greedy = SamplingParams(max_tokens=REF_TOKENS, **GREEDY)
    long = SamplingParams(max_tokens=2000, **GREEDY)

    async def collect(agen) -> str:
        text = ""
        async for out in agen:
            text = out.outputs[0].text
        return text

    async def main():
        llm = AsyncLLM(engine)
        try:
            good = asyncio.create_task(collect(llm.generate(PROMPTS[4], greedy, "good")))
            with pytest.raises(ValueError, match="maximum context length"):
                await llm.add_request("bad", LONG_PROMPT, SamplingParams(max_tokens=20))
            assert await good == ref.texts[4][REF_TOKENS]

            # abort(): applied before the next step, the stream ends, the blocks are free.
            stream = await llm.add_request("long", PROMPTS[6], long)
            for _ in range(3):
                await stream.__anext__()
            steps = llm.snapshot.num_steps
            await llm.abort("long")
            assert llm.snapshot.num_steps - steps <= 1
            rest = [out async for out in stream]  # at most the step that ran meanwhile
            assert len(rest) <= 1 and stream.aborted
            assert llm.snapshot.num_free_blocks == llm.snapshot.num_blocks

            # A cancelled consumer (a dropped client) aborts its request too.
            started = asyncio.Event()

            async def consume():
                async for _ in llm.generate(PROMPTS[7], long, "cancelled"):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            deadline = time.monotonic() + 60
            while llm.snapshot.num_aborted < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert llm.snapshot.num_aborted == 2
            assert llm.snapshot.num_free_blocks == llm.snapshot.num_blocks

            # Shutdown ends in-flight streams with EngineDeadError and refuses new requests.
            stream = await llm.add_request("inflight", PROMPTS[8], long)
            await stream.__anext__()
            await asyncio.to_thread(llm.shutdown)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await llm.add_request("late", PROMPTS[0], greedy)
        finally:
            await asyncio.to_thread(llm.shutdown)
        assert not llm.is_running

    asyncio.run(main())
    assert not engine.has_unfinished_requests()
    assert engine.check_blocks_free()


def test_async_scheduling_server_streams_the_same_text(key_server, ref):
    """The second server keeps a step in flight (--async-scheduling): streamed greedy text,
    a stop string and the usage equal the synchronous LLM's, and every block comes back."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", key_server.url + "/v1/completions", headers=headers, timeout=600,
                      json={"prompt": PROMPTS[2], "max_tokens": REF_TOKENS, "stream": True,
                            "stream_options": {"include_usage": True}, **GREEDY}) as resp:
        events = sse_events(resp.iter_lines())
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == ref.texts[2][REF_TOKENS]
    assert events[-2]["usage"]["completion_tokens"] == REF_TOKENS
    full = ref.texts[0][REF_TOKENS]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    body = post(key_server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": REF_TOKENS,
                                                "stop": [stop], **GREEDY}, headers).json()
    assert body["choices"][0]["text"] == full[:full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert_all_blocks_free(key_server.url)
