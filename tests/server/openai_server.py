"""What the OpenAI-compatible server's tests share: the prompts, the offline engine's greedy
reference (expected texts come from LLM(model=None) in the test process, never from the server
itself), and the HTTP helpers. The fixtures that serve them are in conftest.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.llm import render_chat
from tests.utils.server import ServerProcess, wait_for_metrics

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
LONG_PROMPT = [42] * 8180  # over the bundled model's 8,192-token context with any max_tokens
API_KEY = "test-secret-key"


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


def texts_per_length(llm: LLM) -> tuple[list[dict[int, str]], list[int]]:
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


def build_reference() -> Reference:
    # batch-invariant: tests/server/test_batch_invariance.py).
    llm = LLM(model=None, dtype="float32", kv_cache_memory="128MiB")
    texts, lens = texts_per_length(llm)
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


def stop_of_two_tokens(texts: dict[int, str]) -> tuple[int, str]:
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
