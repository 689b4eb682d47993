"""One request must never take the server down. Each case a hostile client found runs against a
real `pagedserve serve` subprocess and is followed by an ordinary request that must succeed,
with the metrics back at idle (nothing running or waiting, no KV block held). Then a bounded
fuzz over the request schemas, admission limits, body limits, and shutdown."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.server import protocol as p
from tests.utils.paged import tiny_chat_model
from tests.utils.server import ServerProcess, wait_for_metrics

MODEL = "tiny"
CPU = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "32MiB",
       "--served-model-name", MODEL]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # > 16 tokens: a full block


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # One running and eight waiting sequences at most, for the admission test; a drain of
    # 0.3 s: the shutdown test, this server's last user, stops it.
    proc = ServerProcess(["--model", model_dir, *CPU, "--max-request-body-bytes", "200000",
                          "--max-n", "4", "--max-waiting-requests", "8", "--max-num-seqs", "1",
                          "--shutdown-timeout", "0.3"],
                         tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()


def post(server: ServerProcess, path: str, body: object, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=120,
                      **kwargs)


def assert_openai_error(reply: httpx.Response, status: int, *needles: str) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"] or needle == error["param"], error


def assert_still_serving(server: ServerProcess) -> None:
    """An ordinary request works, and nothing is left running, waiting or holding blocks."""
    reply = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                                             "temperature": 0})
    assert reply.status_code == 200, reply.text
    metrics = wait_for_metrics(server.url, lambda m: m["pagedserve:num_requests_running"] == 0
                               and m["pagedserve:kv_cache_usage_perc"] == 0, timeout=30)
    assert metrics["pagedserve:num_requests_running"] == 0
    assert metrics["pagedserve:num_requests_waiting"] == 0
    assert metrics["pagedserve:kv_cache_usage_perc"] == 0
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# The single requests that killed the engine or answered 500 in plain text.
CASES = {
    "seed past 2**64": (
        "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "seed": 2**64}, 400, "seed"),
    "seed + n - 1 past 2**64": (
        "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "n": 2, "seed": 2**64 - 1},
        400, "seed"),
    "stop id outside the vocabulary": (
        "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "min_tokens": 2,
                            "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    "surrogate cache salt": (
        "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4, "cache_salt": "\ud800"},
        400, "surrogate"),
    "surrogate prompt": (
        "/v1/completions", {"prompt": "hi \udfff", "max_tokens": 4}, 400, "surrogate"),
    "surrogate model name": (
        "/v1/completions", {"model": "x\ud800", "prompt": "hi"}, 400, "surrogate"),
    "surrogate in /tokenize": ("/tokenize", {"prompt": "\ud800"}, 400, "surrogate"),
    "booleans and floats as token ids": (
        "/v1/completions", {"prompt": [True, 100.0], "max_tokens": 2}, 400, "prompt"),
    "user message without content": (
        "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "content"),
    "tool message without tool_call_id": (
        "/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, 400,
        "tool_call_id"),
    "n above --max-n": ("/v1/completions", {"prompt": "hi", "n": 5}, 400, "n"),
    "more prompts than --max-n": (
        "/v1/completions", {"prompt": ["a", "b", "c", "d", "e"]}, 400, "prompt"),
    # Searched for in the text at every token: bounded in number and length.
    "a 150,000-character stop string": (
        "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop": ["z" * 150_000]}, 400,
        "--max-stop-string-length"),
    "more stop strings than --max-stop-strings": (
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                 "stop": [f"s{i}" for i in range(33)]}, 400,
        "--max-stop-strings"),
    "more stop ids than --max-stop-token-ids": (
        "/v1/completions", {"prompt": "hi", "stop_token_ids": [0] * 1025}, 400,
        "--max-stop-token-ids"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_gets_a_4xx_and_the_server_carries_on(server, case) -> None:
    path, body, status, needle = CASES[case]
    # json.dumps writes lone surrogates as \ud800 escapes, as a hostile client would.
    reply = post(server, path, {"model": MODEL, **body})
    assert_openai_error(reply, status, needle)
    assert_still_serving(server)


def test_body_over_the_limit_is_413_before_parsing(server) -> None:
    reply = post(server, "/v1/completions", b'{"prompt": "' + b"x" * 300_000 + b'"}')
    assert_openai_error(reply, 413, "larger than the server takes")
    chunks = (b"x" * 50_000 for _ in range(8))  # no content-length: counted as it arrives
    reply = httpx.post(server.url + "/v1/completions", content=chunks, timeout=60)
    assert reply.status_code == 413
    assert_still_serving(server)


def test_long_inputs_hold_up_neither_the_event_loop_nor_running_streams(server) -> None:
    message = "word " * 30_000  # under the body limit, slow to template and tokenize
    slow = threading.Thread(target=post, args=(server, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": message}]}))
    slow.start()
    time.sleep(0.2)
    start = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert time.monotonic() - start < 2.0
    slow.join(120)
    assert_still_serving(server)


def test_admission_counts_each_sequence_once(server) -> None:
    """The module's server runs one sequence and lets eight wait."""
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    replies: list[httpx.Response] = []

    def one() -> None:
        replies.append(post(server, "/v1/completions", body))

    threads = [threading.Thread(target=one) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    statuses = sorted(r.status_code for r in replies)
    # At most 8 wait (one runs): of 10 at once, no more than 2 can be refused.
    assert statuses.count(503) <= 2 and set(statuses) <= {200, 503}, statuses
    for reply in replies:
        if reply.status_code == 503:
            assert reply.json()["error"]["code"] == "overloaded"
    assert_still_serving(server)


# ---- fuzz ---------------------------------------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(["\ud800", "", "tiny", "user", "system"]))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=8)
ENDPOINTS = {"/v1/completions": p.CompletionRequest, "/v1/chat/completions":
             p.ChatCompletionRequest, "/tokenize": p.TokenizeRequest,
             "/detokenize": p.DetokenizeRequest}


@st.composite
def request_bodies(draw) -> tuple[str, object]:
    """A body for a route: mostly its own fields (from its schema) with values of any JSON
    kind, sometimes an unknown field, sometimes not an object at all."""
    path = draw(st.sampled_from(list(ENDPOINTS)))
    fields = list(ENDPOINTS[path].model_json_schema()["properties"])
    if draw(st.integers(0, 9)) == 0:
        return path, draw(JSON_VALUES)
    keys = draw(st.lists(st.sampled_from(fields), max_size=6, unique=True))
    body = {key: draw(JSON_VALUES) for key in keys}
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(1, 4))
    if draw(st.integers(0, 4)) == 0:
        body[draw(st.text(min_size=1, max_size=6))] = 1
    return path, body


def test_fuzzed_bodies_never_get_a_5xx(server) -> None:
    seen: dict[int, int] = {}

    @settings(max_examples=100, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request_bodies())
    def check(path_body: tuple[str, object]) -> None:
        path, body = path_body
        reply = post(server, path, body)
        seen[reply.status_code] = seen.get(reply.status_code, 0) + 1
        assert reply.status_code < 500, (path, body, reply.text)
        if reply.status_code >= 400:
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert seen.get(400, 0) > 0  # the fuzz reached validation, not only one route
    assert_still_serving(server)


# ---- shutdown -----------------------------------------------------------------------------

# The module server's last user (a start of its own took ~5 s): the drain stops it.
def test_shutdown_drains_then_ends_streams_with_an_error(server) -> None:
    proc = server
    events: list[str] = []
    started = threading.Event()
    # ~500 tokens: seconds of work, far past the drain's 0.3 s.
    body = {"prompt": "Hello", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}

    def stream() -> None:
        with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 3:
                        started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    proc.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    refused = post(proc, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert_openai_error(refused, 503, "shutting down")
    reader.join(60)
    assert proc.proc.wait(30) == 0
    # The stream ran on, then ended with an error event once the drain timed out.
    assert 3 <= len(events) < 500 and '"error"' in events[-2] and events[-1] == "data: [DONE]"


@pytest.mark.slow  # a server start-up; the drain test above covers the first signal
def test_second_signal_exits_at_once(model_dir, tmp_path) -> None:
    proc = ServerProcess(["--model", model_dir, *CPU, "--shutdown-timeout", "60"],
                         tmp_path / "log")
    body = {"prompt": "Hello", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    reader = threading.Thread(target=lambda: httpx.post(proc.url + "/v1/completions",
                                                        json=body, timeout=120))
    reader.start()
    time.sleep(1.0)
    proc.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    start = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    proc.proc.wait(30)
    assert time.monotonic() - start < 15
    reader.join(30)


def test_a_dead_engine_stops_the_server() -> None:
    """A failed step (engine state unknown) reaches on_dead, which stops the server; run_serve
    then exits with status 1."""
    from pagedserve.engine.async_llm import AsyncLLM

    class Broken:
        tokenizer = None

        def core_stats(self):
            from pagedserve.engine.core_messages import CoreStats

            return CoreStats(0, 0, 0.0, 0, 0, 0, 0, 0, 1, 1, True, 0, 0.0)

        def on_core_death(self, callback) -> None:
            pass

        def check_alive(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

        def stats(self):
            from pagedserve.engine.llm_engine import EngineStats

            return EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)

        def has_unfinished_requests(self) -> bool:
            return True

        def step(self):
            raise RuntimeError("a step failed")

    import uvicorn

    from pagedserve.server.cli import DrainingServer

    llm = AsyncLLM(Broken())
    server = DrainingServer(uvicorn.Config(app=None), state=None, llm=llm, timeout=1)
    llm.on_dead = server.stop_now
    llm.start()
    deadline = time.monotonic() + 10
    while not server.should_exit and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.should_exit and isinstance(llm.error, RuntimeError)
    assert not llm.is_running
