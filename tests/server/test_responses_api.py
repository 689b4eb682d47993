"""The Responses API against a real server, through the official `openai` client (its own
parsers read every event): whole and streamed responses in the official event order, a tool
round trip by items and by previous_response_id, text.format json_schema, the store, a 10-turn
agent conversation served from the prefix cache, and hostile bodies answered with 4xx."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagedserve.server.common import ApiError
from pagedserve.server.output_blocks import Block, BlockStream
from pagedserve.server.responses.protocol import ResponsesRequest
from pagedserve.server.responses.store import ResponseStore, StoredResponse
from pagedserve.server.responses.translate import renamed, response_object
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

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": WEATHER_SCHEMA}
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(agent_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent_server.url + "/v1", api_key=KEY, max_retries=0,
                         timeout=120)


def test_create_whole_and_streamed(client) -> None:
    whole = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.",
                                    max_output_tokens=4, temperature=0)
    assert whole.id.startswith("resp_") and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].type == "message" and whole.output_text
    assert whole.usage.output_tokens == 4 and whole.usage.input_tokens > 0
    events = list(client.responses.create(model=MODEL, input="Hello there", stream=True,
                                          instructions="Be brief.", max_output_tokens=4,
                                          temperature=0))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 4,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole.output_text  # greedy: the same text


def test_stream_helper_with_a_forced_call(client) -> None:
    with client.responses.stream(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                 tool_choice=FORCED, max_output_tokens=40,
                                 temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


def test_tool_round_trip_and_previous_response_id(client, agent_server) -> None:
    # Greedy: a sampled call may run past max_output_tokens inside its arguments.
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=40, temperature=0)
    call = first.output[0]
    assert first.status == "completed" and call.type == "function_call"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    # By previous_response_id: the server holds the conversation...
    chained = client.responses.create(model=MODEL, previous_response_id=first.id,
                                      input=[result], tools=[WEATHER], max_output_tokens=3,
                                      temperature=0)
    # ...or every item sent back: the same prompt, so the same greedy answer.
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments}, result]
    resent = client.responses.create(model=MODEL, input=items, tools=[WEATHER],
                                     max_output_tokens=3, temperature=0, store=False)
    assert chained.usage.input_tokens == resent.usage.input_tokens
    assert chained.output_text == resent.output_text
    assert chained.previous_response_id == first.id
    assert client.responses.retrieve(chained.id).output_text == chained.output_text
    headers = {"authorization": f"Bearer {KEY}"}
    gone = httpx.get(f"{agent_server.url}/v1/responses/{resent.id}", headers=headers)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"


def test_delete_a_stored_response(client, agent_server) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    url = f"{agent_server.url}/v1/responses"
    first, second = (client.responses.create(model=MODEL, input="Hello there",
                                             max_output_tokens=1, temperature=0)
                     for _ in range(2))
    reply = httpx.delete(f"{url}/{first.id}", headers=headers)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"id": first.id, "object": "response", "deleted": True}
    client.responses.delete(second.id)  # the client's own call
    for gone in (first.id, second.id):
        after = httpx.get(f"{url}/{gone}", headers=headers)
        assert after.status_code == 404
        assert after.json()["error"]["param"] == "response_id"
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError):  # once only
            client.responses.delete(gone)
    with pytest.raises(openai.BadRequestError, match="Previous response"):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id,
                                max_output_tokens=1)
    unknown = httpx.delete(f"{url}/resp_unknown", headers=headers)
    assert unknown.status_code == 404 and set(unknown.json()["error"]) == {
        "message", "type", "param", "code"}


def test_text_format_json_schema(client) -> None:
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA, "strict": True}
    r = client.responses.create(model=MODEL, input="Pick a city", text={"format": fmt},
                                max_output_tokens=30)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER_SCHEMA)


def test_reasoning_becomes_its_own_item() -> None:
    """A reasoning block (from --reasoning-parser) is a reasoning item before the message."""
    blocks = BlockStream(blocks=[Block("reasoning", 0, "think"), Block("text", 1, "hi")],
                         finish_reason="stop")
    body = ResponsesRequest(input="x")
    out = response_object("resp_1", MODEL, body, 0, blocks)["output"]
    assert [o["type"] for o in out] == ["reasoning", "message"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "think"}]


def test_the_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(2)
    for name in "abc":
        store.put(name, StoredResponse({}, []))
        store.get("a")  # kept in use
    assert set(store.entries) == {"a", "c"}
    ResponseStore(0).put("a", StoredResponse({}, []))  # stores nothing, refuses nothing
    assert store.delete("a") and not store.delete("a") and set(store.entries) == {"c"}



def test_the_store_is_bounded_in_bytes_too() -> None:
    """Each stored response keeps its conversation, images' data URLs included: a thousand
    60 MiB photos were 60 GB kept alive. Past --responses-store-bytes the least recently used
    go; a response larger than the whole budget is not kept."""
    photo = {"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + "A" * 400}}]}
    store = ResponseStore(100, max_bytes=1000)
    for name in "abc":
        store.put(name, StoredResponse({"id": name}, [photo]))
        store.get("a")  # kept in use
    assert set(store.entries) == {"a", "c"} and store.num_bytes <= 1000
    store.put("huge", StoredResponse({}, [{"role": "user", "content": "x" * 2000}]))
    assert "huge" not in store.entries and set(store.entries) == {"a", "c"}
    assert store.delete("a") and set(store.entries) == {"c"} and 0 < store.num_bytes < 500
    store.put("c", StoredResponse({}, []))  # stored again under its id: counted once
    assert store.num_bytes < 100


def test_agent_conversation_is_served_from_the_prefix_cache(client) -> None:
    previous, turn_input = None, "Weather in Oslo?"
    usages = []
    for turn in range(TURNS):
        r = client.responses.create(model=MODEL, instructions=SYSTEM, input=turn_input,
                                    previous_response_id=previous, tools=[WEATHER],
                                    tool_choice=FORCED, max_output_tokens=40)
        usages.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens))
        call = r.output[-1]
        assert call.type == "function_call"
        previous = r.id
        turn_input = [{"type": "function_call_output", "call_id": call.call_id,
                       "output": f"sunny, {turn} degrees"}]
    assert cached_share(usages) >= 0.9, usages


HOSTILE = [
    ({"model": MODEL}, "input"),
    ({"model": MODEL, "input": 5}, "input"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": MODEL, "input": "x", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "input": "x", "bogus": True}, "bogus"),
    ({"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input.0.content.0"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"model": MODEL, "input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"model": MODEL, "input": "x", "tools": [WEATHER],
      "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema",
                                                        "name": "a"}}}, "text.format"),
    ({"model": MODEL, "input": "x", "text": {"format": {
        "type": "json_schema", "name": "a", "schema": {"type": "nope"}}}}, "text.format"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_nope"},
     "previous_response_id"),
    ({"model": MODEL, "input": "x", "truncation": "auto"}, "truncation"),
    ({"model": MODEL, "input": "x", "background": True}, "background"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 10 ** 9}, "input"),  # too long
    ({"model": MODEL, "input": "\ud800"}, None),
]


def test_hostile_bodies_are_4xx(agent_server) -> None:
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    for body, param in HOSTILE:
        reply = httpx.post(agent_server.url + "/v1/responses", content=json.dumps(body),
                           headers=headers, timeout=60)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert param is None or (error["param"] or "").startswith(param), (param, error)
    wrong = httpx.post(agent_server.url + "/v1/responses", json={"model": "gpt-x",
                                                                 "input": "x"},
                       headers=headers, timeout=60)
    assert wrong.status_code == 404
    denied = httpx.post(agent_server.url + "/v1/responses", json={"input": "x"}, timeout=60)
    assert denied.status_code == 401 and "error" in denied.json()
    leave_mid_stream(agent_server, "/v1/responses", {"model": MODEL, "input": "x",
                                                     "max_output_tokens": 1500,
                                                     "stream": True}, "resp_")
    healthy(agent_server.url)


@pytest.mark.parametrize("param, message, want_param, want", [
    ("max_tokens", "max_tokens must be >= 1 or None, got -1", "max_output_tokens",
     "max_output_tokens must be >= 1 or None, got -1"),
    ("response_format", "response_format: invalid JSON schema: 'bogus' is not valid",
     "text.format", "text.format: invalid JSON schema: 'bogus' is not valid"),
    ("max_tokens", "max_tokensx is not this field", "max_output_tokens",
     "max_tokensx is not this field"),
])
def test_chat_errors_name_the_responses_fields(param, message, want_param, want) -> None:
    """The chat path's errors say the fields the client sent (max_output_tokens, text.format),
    in the message as in `param`."""
    error = renamed(ApiError(400, message, param=param)).body.error
    assert (error.param, error.message) == (want_param, want)
