"""The second server (key_server): the API key, the waiting-queue limit's 503, and async
scheduling's streamed text."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.server.openai_server import (
    API_KEY,
    GREEDY,
    PROMPTS,
    REF_TOKENS,
    assert_all_blocks_free,
    assert_error,
    post,
    sse_events,
)
from tests.utils.server import wait_for_metrics


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
