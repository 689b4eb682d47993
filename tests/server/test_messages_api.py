"""Anthropic's Messages API against a real server, through the official `anthropic` client
(its own parsers read every event): whole and streamed replies, forced tool use, count_tokens
against /tokenize, a 10-turn agent conversation served from the prefix cache, and hostile
bodies answered with 4xx in Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from pagedserve.server.anthropic.translate import stop_reason
from pagedserve.server.output_blocks import BlockStream
from tests.server.agent_conversation import (
    KEY,
    MODEL,
    SYSTEM,
    TURNS,
    WEATHER_SCHEMA,
    cached_share,
    healthy,
    leave_mid_stream,
)

ASK = [{"role": "user", "content": "Hello there"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": WEATHER_SCHEMA}


@pytest.fixture(scope="module")
def client(agent_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=agent_server.url, api_key=KEY, max_retries=0,
                               timeout=120)


def post(server, path: str, body: object, key: str = KEY) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=120,
                      headers={"x-api-key": key, "content-type": "application/json"})


def test_create_whole_and_streamed(client) -> None:
    message = client.messages.create(model=MODEL, max_tokens=4, messages=ASK,
                                     system="Be brief.", metadata={"user_id": "u1"},
                                     extra_body={"temperature": 0, "top_k": 5})
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.content[0].type == "text"
    assert message.usage.output_tokens <= 4 and message.usage.input_tokens > 0
    events = list(client.messages.create(model=MODEL, max_tokens=4, messages=ASK, stream=True,
                                         extra_body={"temperature": 0, "top_k": 5}))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == message.content[0].text  # greedy: the same reply either way
    assert events[-2].usage.output_tokens == message.usage.output_tokens


def test_stream_helper_and_ping(client, agent_server) -> None:
    with client.messages.stream(model=MODEL, max_tokens=3, messages=ASK) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text and final.stop_reason == "max_tokens"
    with httpx.stream("POST", agent_server.url + "/v1/messages", headers={"x-api-key": KEY},
                      json={"model": MODEL, "max_tokens": 2, "messages": ASK,
                            "stream": True}, timeout=60) as reply:
        names = [line[7:] for line in reply.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]


# "any" with parallel calls may keep adding calls until max_tokens: one call here.
@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_tool_use_forced_by_tool_choice(client, choice) -> None:
    tools = [WEATHER, {"name": "noop", "input_schema": {"type": "object"}}]
    if choice["type"] == "any":
        tools = [WEATHER]
    # Greedy: a sampled argument may run past max_tokens (a random model's string).
    message = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, tools=tools,
                                     tool_choice=choice, extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use"
    use = [b for b in message.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    with client.messages.stream(model=MODEL, max_tokens=40, messages=ASK, tools=tools,
                                tool_choice=choice, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    use = [b for b in final.content if b.type == "tool_use"][0]
    assert final.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)


def test_count_tokens_equals_tokenize(client, agent_server) -> None:
    system = "You are terse."
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=ASK)
    reply = httpx.post(agent_server.url + "/tokenize", headers={"x-api-key": KEY}, timeout=60,
                       json={"messages": [{"role": "system", "content": system}, *ASK]})
    assert counted.input_tokens == reply.json()["count"] > 0
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER],
                                              tool_choice={"type": "any"})
    assert with_tools.input_tokens > counted.input_tokens


def test_stop_reason_mapping() -> None:
    cases = [("tool_calls", None, ("tool_use", None)), ("length", None, ("max_tokens", None)),
             ("stop", "END", ("stop_sequence", "END")), ("stop", 2, ("end_turn", None))]
    for finish, stop, expected in cases:
        assert stop_reason(BlockStream(finish_reason=finish, stop_reason=stop)) == expected


def test_agent_conversation_is_served_from_the_prefix_cache(client) -> None:
    messages: list[dict] = [{"role": "user", "content": "Weather in Oslo?"}]
    usages = []
    for turn in range(TURNS):
        reply = client.messages.create(model=MODEL, max_tokens=40, system=SYSTEM,
                                       messages=messages, tools=[WEATHER],
                                       tool_choice={"type": "tool", "name": "get_weather"})
        u = reply.usage
        usages.append((u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens))
        use = reply.content[-1]
        assert use.type == "tool_use"
        messages += [{"role": "assistant", "content": reply.content},  # as the SDK sends it
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": use.id,
                          "content": f"sunny, {turn} degrees"}]}]
    assert cached_share(usages) >= 0.9, usages


HOSTILE = [
    ({"messages": ASK, "max_tokens": 4}, "model"),
    ({"model": MODEL, "messages": ASK}, "max_tokens"),
    ({"model": MODEL, "messages": [], "max_tokens": 4}, "messages"),
    ({"model": MODEL, "messages": ASK, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": ASK, "max_tokens": 4, "temperature": -1}, "temperature"),
    ({"model": MODEL, "messages": ASK, "max_tokens": 4, "bogus": 1}, "bogus"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "takes text only"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
     "role"),
    ({"model": MODEL, "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}},
     "needs tools"),
    ({"model": MODEL, "max_tokens": 4, "messages": ASK, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ({"model": MODEL, "max_tokens": 4, "messages": ASK,
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"model": MODEL, "max_tokens": 10 ** 9, "messages": ASK}, "maximum context length"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "\ud800"}]},
     "surrogate"),
]


# Anthropic's ranges (temperature and top_p in [0, 1], top_k >= 0) are narrower than the
# engine's, which would take temperature 1.5 or top_k -1: refused at the door.
@pytest.mark.parametrize("field, value", [("temperature", 1.5), ("temperature", -0.5),
                                          ("top_p", 1.5), ("top_p", -0.1), ("top_k", -1)])
def test_sampling_fields_outside_anthropics_ranges_are_400(agent_server, field, value) -> None:
    reply = post(agent_server, "/v1/messages",
                 {"model": MODEL, "messages": ASK, "max_tokens": 1, field: value})
    assert reply.status_code == 400, reply.text
    data = reply.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    message = data["error"]["message"]
    assert message.startswith(field) and repr(value) in message, message


def test_sampling_fields_at_the_edges_of_anthropics_ranges_are_served(client) -> None:
    message = client.messages.create(model=MODEL, max_tokens=1, messages=ASK,
                                     extra_body={"temperature": 1, "top_p": 1, "top_k": 0})
    assert message.usage.output_tokens == 1


def test_hostile_bodies_are_4xx_in_anthropic_shape(agent_server) -> None:
    for body, words in HOSTILE:
        reply = post(agent_server, "/v1/messages", body)
        assert reply.status_code == 400, (body, reply.text)
        data = reply.json()
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
        assert words in data["error"]["message"], (words, data)
    for body in ("not json", "[1, 2]"):
        assert post(agent_server, "/v1/messages", body).status_code == 400
    wrong = post(agent_server, "/v1/messages", {"model": "claude-x", "max_tokens": 4,
                                                "messages": ASK})
    assert wrong.status_code == 404 and wrong.json()["error"]["type"] == "not_found_error"
    denied = post(agent_server, "/v1/messages/count_tokens", {"model": MODEL, "messages": ASK},
                  key="wrong")
    assert denied.status_code == 401
    assert denied.json()["error"]["type"] == "authentication_error"
    leave_mid_stream(agent_server, "/v1/messages", {"model": MODEL, "max_tokens": 1500,
                                                    "messages": ASK, "stream": True}, "msg_")
    healthy(agent_server.url)
