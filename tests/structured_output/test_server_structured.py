"""Structured outputs and tool calls through the OpenAI API, with the bundled SmolLM2 served
in this process (uvicorn in a thread): response_format, vLLM's guided_* fields, logit_bias,
the openai client's `parse`, tool_choice required / named / auto, streamed and not, reasoning,
and the 400s of bad specs (with a request running beside them undisturbed)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
import uvicorn

from pagedserve import LLM
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.server.api import build_app
from pagedserve.server.reasoning import get_reasoning_parser
from pagedserve.server_config import ServerConfig
from tests.structured_output.schemas import FAST, SCHEMAS
from tests.utils.server import free_port

MODEL = "smollm2"
ASK = [{"role": "user", "content": "Reply in JSON."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Server:
    def __init__(self, llm: LLM, config: ServerConfig) -> None:
        self.async_llm = AsyncLLM(llm.engine)
        self.app = build_app(self.async_llm, config)
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port,
                                                     log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.uvicorn.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no server"
            time.sleep(0.05)

    @property
    def state(self):
        return self.app.state.server

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def server():
    # The CPU's int8 weights: these tests check the form of what comes out, and the one that
    # compares tokens runs its request alone both times.
    llm = LLM(model=None, kv_cache_memory="64MiB", max_num_seqs=64)
    srv = Server(llm, ServerConfig(served_model_name=MODEL, tool_call_parser="hermes",
                                   enable_log_requests=False))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=600, max_retries=0)


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=600)


def concurrently(*calls: Callable[[], Any]) -> list[Any]:
    """Each call's result, the calls sent at once: their requests share the engine's steps
    instead of each running alone (the answers checked do not depend on the batch)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def _chat_text(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, str]:
    """(content, finish_reason) of one choice, streamed or not."""
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=ASK, **kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, stream=True,
                                                **kwargs):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def _schema_outputs(client: openai.OpenAI, names: list[str], samples: int) -> None:
    jobs = [(name, i, stream) for name in names for i in range(samples)
            for stream in (False, True)]

    def run(job):
        name, i, stream = job
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                      "strict": True}}
        return _chat_text(client, stream, response_format=fmt, temperature=0.8, seed=i,
                          max_tokens=160)

    with ThreadPoolExecutor(len(jobs)) as pool:  # one engine batch
        results = list(pool.map(run, jobs))
    for (name, _, stream), (text, finish) in zip(jobs, results, strict=True):
        assert finish == "stop", (name, stream, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_response_format_json_schema_fast(client) -> None:
    _schema_outputs(client, FAST, samples=1)


@pytest.mark.slow
def test_response_format_json_schema_all(client) -> None:
    _schema_outputs(client, list(SCHEMAS), samples=5)


def test_json_object_regex_choice_grammar_fields(server, client) -> None:
    regex = r"[0-9]{3}-[A-Z]{2}"
    schema = SCHEMAS["weather_call"]
    r, *texts, resp = concurrently(
        lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60,
                                               seed=1, temperature=0.8,
                                               response_format={"type": "json_object"}),
        *[lambda stream=stream, body=body: _chat_text(client, stream, max_tokens=20,
                                                      temperature=0.8, extra_body=body)[0]
          for stream in (False, True)
          for body in ({"guided_regex": regex}, {"guided_choice": ["left", "right"]})],
        lambda: _chat_text(client, False, max_tokens=20,
                           extra_body={"guided_grammar": 'root ::= "x" [a-c]{2,4} "!"'})[0],
        # /v1/completions takes them too.
        lambda: client.completions.create(model=MODEL, prompt="JSON:", max_tokens=80,
                                          temperature=0.8, extra_body={"guided_json": schema}))
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    for text in texts[0:4:2]:  # the regex's, not streamed and streamed
        assert re.fullmatch(regex, text), text
    for text in texts[1:4:2]:
        assert text in ("left", "right")
    assert re.fullmatch(r"x[a-c]{2,4}!", texts[4]), texts[4]
    jsonschema.validate(json.loads(resp.choices[0].text), schema)


def test_logit_bias_through_the_api(client) -> None:
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                     logit_bias={"1234": 100},
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    assert resp.choices[0].model_extra["token_ids"] == [1234] * 3


class Step(pydantic.BaseModel):
    explanation: str = pydantic.Field(max_length=30)
    output: int


class Solution(pydantic.BaseModel):
    steps: list[Step] = pydantic.Field(max_length=2)
    answer: Literal["yes", "no"]


def test_openai_parse_with_a_pydantic_model(client) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Is 7 prime?"}],
        response_format=Solution, temperature=0.8, seed=3, max_tokens=200)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Solution)
    assert Solution.model_validate_json(completion.choices[0].message.content) == parsed


def _tool_calls(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[list, str, str | None]:
    """([(name, arguments text)], finish_reason, content) of one choice."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           **kwargs)
        m = r.choices[0].message
        return ([(c.function.name, c.function.arguments) for c in m.tool_calls or []],
                r.choices[0].finish_reason, m.content)
    calls: dict[int, list] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                stream=True, **kwargs):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
    return [tuple(c) for c in calls.values()], finish, content or None


# Streamed by default (the deltas are the harder path); the whole response with -m slow.
@pytest.mark.parametrize("stream", [pytest.param(False, marks=pytest.mark.slow), True])
def test_tool_choice_required_and_named(client, stream: bool) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    one, by_name, parallel = concurrently(
        lambda: _tool_calls(client, stream, tool_choice="required", temperature=0.8, seed=0,
                            max_tokens=120, parallel_tool_calls=False),
        lambda: _tool_calls(client, stream, tool_choice=named, temperature=0.8,
                            max_tokens=60),
        lambda: _tool_calls(client, stream, tool_choice="required", temperature=0.8, seed=1,
                            max_tokens=120))
    calls, finish, content = one
    assert finish == "tool_calls" and len(calls) == 1 and content is None
    jsonschema.validate(json.loads(calls[0][1]), SCHEMA_OF[calls[0][0]])
    calls, finish, _ = by_name
    assert finish == "tool_calls" and [c[0] for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0][1]), SCHEMA_OF["get_time"])
    # Parallel calls: the array is open-ended, and a sampling 135M model may keep adding
    # calls until max_tokens; every call it closed parses and validates.
    calls, finish, content = parallel
    assert calls and content is None and finish in ("tool_calls", "length")
    for name, args in calls[:-1] if finish == "length" else calls:
        jsonschema.validate(json.loads(args), SCHEMA_OF[name])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_reads_the_parser_format(client, stream: bool) -> None:
    # The 135M model does not call tools by itself: a grammar makes it write a hermes call,
    # and the auto path must read it back out of the text.
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
    grammar = 'root ::= "Checking. <tool_call>" ' + json.dumps(call) + ' "</tool_call>"'
    calls, finish, content = _tool_calls(client, stream, tool_choice="auto", max_tokens=60,
                                         extra_body={"guided_grammar": grammar})
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo",
                                                                       "days": 2})]
    assert content.strip() == "Checking."
    # Without a call, auto is plain content.
    calls, finish, content = _tool_calls(client, stream, tool_choice="auto", max_tokens=5,
                                         temperature=0)
    assert calls == [] and finish in ("stop", "length") and content


def test_tool_history_is_rendered(server, client) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    tokens = post(server, "/tokenize", {"messages": messages})
    assert tokens.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_parser(server, client, stream: bool) -> None:
    server.state.reasoning_parser = get_reasoning_parser("qwen3")
    try:
        grammar = 'root ::= "<think>" [a-z ]{3,12} "</think>" [A-Z] [a-z]{2,8}'
        body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0.8,
                "guided_grammar": grammar, "stream": stream}
        if not stream:
            m = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
            reasoning, content = m["reasoning_content"], m["content"]
        else:
            reasoning = content = ""
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                              timeout=600) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            reasoning += c["delta"].get("reasoning_content") or ""
                            content += c["delta"].get("content") or ""
        assert re.fullmatch(r"[a-z ]{3,12}", reasoning), reasoning
        assert re.fullmatch(r"[A-Z][a-z]{2,8}", content), content
    finally:
        server.state.reasoning_parser = None


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "needs json_schema.schema"),
    ({"guided_json": {"$ref": "#/$defs/nowhere"}}, "guided_json", "invalid JSON schema"),
    ({"guided_regex": "([a-z]"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "invalid EBNF grammar"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "vocabulary size"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex",
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nope"}}}}}], "tool_choice": "required"},
     "tools", "invalid JSON schema"),
])
def test_bad_requests_are_400s_naming_the_problem(server, body, param, words) -> None:
    resp = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_bad_request_leaves_the_batch_alone(server, client) -> None:
    """A greedy request runs while bad guided requests are refused: its text is the one it
    gives alone."""
    kwargs = {"max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone, _ = _chat_text(client, False, **kwargs)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(
        text=_chat_text(client, True, **kwargs)[0]))
    worker.start()
    for _ in range(5):
        resp = post(server, "/v1/chat/completions",
                    {"model": MODEL, "messages": ASK, "guided_regex": "(unclosed"})
        assert resp.status_code == 400
    worker.join(600)
    assert result["text"] == alone
    assert server.state.llm.error is None
