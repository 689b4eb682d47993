"""Bad requests get a 4xx in OpenAI's error shape, name the field, and leave other requests'
work alone."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.server.openai_server import (
    CHAT,
    GREEDY,
    LONG_PROMPT,
    MODEL,
    PROMPTS,
    REF_TOKENS,
    assert_error,
    post,
    sse_events,
)

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
