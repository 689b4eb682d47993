"""What agents send back: a reply as the SDKs hand it over (their objects, or model_dump() with
every field the SDK knows, set or None), the request fields the SDKs pass that mean nothing
here (accepted and ignored, as vLLM ignores them), tool schemas as pydantic writes them ($defs
and $ref), content as lists of text parts, and Anthropic's prefill (a last assistant message
the reply continues)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import openai
import pytest

from pagedserve.server import protocol as p
from pagedserve.server.anthropic import protocol as a
from pagedserve.server.anthropic.translate import chat_request
from pagedserve.server.chat import developer_as_system
from pagedserve.server.chat_media import MediaSettings, template_input
from pagedserve.server.chat_output import ChatChoiceParser
from pagedserve.server.chat_tools import tool_plan
from pagedserve.server.guided import _relocated
from pagedserve.server.responses import protocol as r
from pagedserve.server.responses.translate import input_messages
from pagedserve.server.tool_parsers import HermesToolParser
from tests.server.agent_conversation import KEY, MODEL, WEATHER_SCHEMA

ASK = [{"role": "user", "content": "Weather in Oslo?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
# Chat fields OpenAI's SDK (and the Agents SDK) send that change nothing on this server.
IGNORED = {"metadata": {"run": "1"}, "store": False, "service_tier": "auto",
           "prompt_cache_key": "agent-1", "safety_identifier": "u1", "reasoning_effort": "low",
           "verbosity": "low", "modalities": ["text"]}


@pytest.fixture(scope="module")
def oai(agent_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent_server.url + "/v1", api_key=KEY, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def claude(agent_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=agent_server.url, api_key=KEY, max_retries=0,
                               timeout=120)


def test_chat_takes_its_own_reply_back(oai) -> None:
    """messages.append(reply.choices[0].message), the agent loop's step: the reply carries
    reasoning_content (None without a reasoning parser), and model_dump() adds refusal,
    annotations, audio and function_call, all None."""
    first = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                        tool_choice=FORCED, max_completion_tokens=16,
                                        temperature=0)
    message = first.choices[0].message
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}
    replies = []
    for echoed in (message, message.model_dump()):
        replies.append(oai.chat.completions.create(
            model=MODEL, messages=[*ASK, echoed, result], tools=TOOLS, tool_choice="none",
            max_completion_tokens=3, temperature=0))
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_chat_ignores_the_sdks_fields_that_mean_nothing_here(oai) -> None:
    plain = oai.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=3,
                                        temperature=0)
    ignored = oai.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=3,
                                          temperature=0, **IGNORED)
    assert ignored.choices[0].message.content == plain.choices[0].message.content
    streamed = oai.chat.completions.create(
        model=MODEL, messages=ASK, max_completion_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == plain.choices[0].message.content


@pytest.mark.parametrize("field, value", [("modalities", ["audio"]),
                                          ("reasoning_effort", "extreme")])
def test_chat_still_refuses_what_it_cannot_do(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        p.ChatCompletionRequest.model_validate({"messages": ASK, field: value})


def test_reasoning_content_is_an_assistant_field_only() -> None:
    p.ChatMessage.model_validate({"role": "assistant", "content": "x", "reasoning_content": "y"})
    with pytest.raises(ValueError, match="reasoning_content"):
        p.ChatMessage.model_validate({"role": "user", "content": "x", "reasoning_content": "y"})


def test_responses_ignore_the_sdks_fields_that_mean_nothing_here() -> None:
    r.ResponsesRequest.model_validate({"input": "hi", "prompt_cache_retention": "24h",
                                       "stream": True,
                                       "stream_options": {"include_obfuscation": False}})


def test_messages_take_the_sdks_blocks_back(claude) -> None:
    """The anthropic SDK's model_dump() of a tool_use block carries caller and toolset_name
    (None); tools may say strict and eager_input_streaming, and the request cache_control."""
    tools = [{"name": "get_weather", "input_schema": WEATHER_SCHEMA, "strict": True,
              "eager_input_streaming": True}]
    first = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, tools=tools,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    use = first.content[-1]
    assert use.type == "tool_use"
    messages = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "sunny"}]}]
    reply = claude.messages.create(model=MODEL, max_tokens=2, messages=messages, tools=tools,
                                   extra_body={"cache_control": {"type": "ephemeral"}})
    assert reply.usage.output_tokens > 0


def test_text_parts_are_joined_as_lines() -> None:
    """Two text parts are two pieces of text, not one word: "Hi" and "there" are not
    "Hithere" (vLLM joins them with a newline too)."""
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    chat = p.ChatMessage.model_validate({"role": "user", "content": parts})
    rendered = template_input([chat], None, None, MediaSettings(), MODEL)
    assert rendered.messages[0]["content"] == "Hi\nthere"
    body = r.ResponsesRequest.model_validate({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "there"}]}]})
    assert input_messages(body.input)[0][0]["content"] == "Hi\nthere"


def test_prefill_continues_the_last_assistant_message() -> None:
    body = a.MessagesRequest.model_validate({
        "model": MODEL, "max_tokens": 4,
        "messages": [*ASK, {"role": "assistant", "content": "The weather is"}]})
    chat = chat_request(body)
    assert chat.continue_final_message and not chat.add_generation_prompt
    body.messages.append(a.Message(role="user", content="And Rome?"))
    chat = chat_request(body)
    assert not chat.continue_final_message and chat.add_generation_prompt


def test_prefill_is_rendered_open_and_counted(agent_server, claude) -> None:
    prefill = [*ASK, {"role": "assistant", "content": "The weather is"}]
    headers = {"x-api-key": KEY}

    def tokenize(**fields) -> httpx.Response:
        return httpx.post(agent_server.url + "/tokenize", headers=headers, timeout=60,
                          json={"messages": prefill, **fields})

    tokens = tokenize(add_generation_prompt=False, continue_final_message=True).json()
    text = httpx.post(agent_server.url + "/detokenize", headers=headers, timeout=60,
                      json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe weather is"), text
    counted = claude.messages.count_tokens(model=MODEL, messages=prefill)
    assert counted.input_tokens == tokens["count"]
    reply = claude.messages.create(model=MODEL, max_tokens=2, messages=prefill)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == tokens["count"]
    for fields, words in [({"continue_final_message": True}, "add_generation_prompt"),
                          ({"continue_final_message": True, "add_generation_prompt": False,
                            "messages": ASK}, "last message")]:
        refused = tokenize(**fields)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"]


def _pydantic_style(name: str, units: list[str]) -> dict:
    """A tool as pydantic (and so the Agents SDK) writes its schema: types in $defs, $ref to
    them, Optional as anyOf with null."""
    return {"type": "function", "function": {"name": name, "strict": True, "parameters": {
        "$defs": {"Unit": {"enum": units, "type": "string"}},
        "type": "object", "additionalProperties": False, "required": ["unit", "city"],
        "properties": {"unit": {"$ref": "#/$defs/Unit"},
                       "city": {"anyOf": [{"$ref": "#/$defs/Unit"}, {"type": "null"}]}}}}}


@pytest.mark.parametrize("count", [1, 2])
def test_required_tool_calls_follow_schemas_with_defs(oai, count) -> None:
    """tool_choice "required" nests each tool's schema in one grammar: its $refs must still
    find its own $defs (two tools' Unit differ)."""
    tools = [_pydantic_style("temperature", ["c", "f"]), _pydantic_style("speed", ["kmh"])]
    tools = tools[:count]
    reply = oai.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                        tool_choice="required", parallel_tool_calls=False,
                                        max_completion_tokens=40, temperature=0)
    [call] = reply.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])


def test_relocated_refs_leave_data_alone() -> None:
    schema = {"$defs": {"U": {"const": {"$ref": "#/data"}}},
              "properties": {"default": {"$ref": "#/$defs/U"}, "x": {"$ref": "#"},
                             "y": {"$ref": "other.json#/a"}},
              "default": {"$ref": "#/data"}}
    moved = _relocated(schema, "#/items/anyOf/1/properties/arguments")
    assert moved["properties"]["default"] == {
        "$ref": "#/items/anyOf/1/properties/arguments/$defs/U"}
    assert moved["properties"]["x"] == {"$ref": "#/items/anyOf/1/properties/arguments"}
    assert moved["properties"]["y"] == schema["properties"]["y"]
    assert moved["default"] == moved["$defs"]["U"]["const"] == {"$ref": "#/data"}


def test_developer_messages_are_system_messages_to_a_template_without_them(agent_server) -> None:
    """OpenAI's developer role (the openai SDK's newer system) rendered as a turn of its own
    under the model's default system prompt; a template that knows the role keeps it."""
    headers = {"x-api-key": KEY}

    def prompt(role: str) -> list[int]:
        return httpx.post(agent_server.url + "/tokenize", headers=headers, timeout=60, json={
            "messages": [{"role": role, "content": "Be brief."}, *ASK]}).json()["tokens"]

    assert prompt("developer") == prompt("system")
    messages = [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]
    assert developer_as_system(messages, "{{ messages }}")[0]["role"] == "system"
    knows = "{% if message.role == 'developer' %}"
    assert developer_as_system(messages, knows) == messages


def test_earlier_tool_calls_stay_in_a_prompt_without_tools(agent_server) -> None:
    """A conversation sent without tools (or with tool_choice "none", to make the model answer
    at last) keeps its calls: a template with no place for them rendered an empty assistant
    turn before the results."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    headers = {"x-api-key": KEY}
    tokens = httpx.post(agent_server.url + "/tokenize", headers=headers, timeout=60,
                        json={"messages": messages}).json()["tokens"]
    text = httpx.post(agent_server.url + "/detokenize", headers=headers, timeout=60,
                      json={"tokens": tokens}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text, text


def test_models_retrieve(oai) -> None:
    """client.models.retrieve(name): GET /v1/models/{name}, the card /v1/models lists."""
    card = oai.models.retrieve(MODEL)
    assert card.id == MODEL and card in oai.models.list().data
    with pytest.raises(openai.NotFoundError) as missing:
        oai.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"


TWO_CALLS = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
             '<tool_call>{"name": "b", "arguments": {}}</tool_call>')


@pytest.mark.parametrize("parallel, names", [(True, ["a", "b"]), (False, ["a"])])
def test_auto_tool_calls_keep_to_parallel_tool_calls(parallel, names) -> None:
    """parallel_tool_calls false (Codex's default; Anthropic's disable_parallel_tool_use)
    returns the first call only, whole and streamed, as vLLM does."""
    state = SimpleNamespace(tool_parser=HermesToolParser(), reasoning_parser=None)
    body = p.ChatCompletionRequest.model_validate({
        "messages": ASK, "parallel_tool_calls": parallel,
        "tools": [{"type": "function", "function": {"name": n}} for n in "ab"]})
    plan = tool_plan(state, body)
    whole = plan.parser(state).message(TWO_CALLS)
    assert [c.function.name for c in whole.tool_calls] == names
    streamed = plan.parser(state)
    deltas = [streamed.delta(TWO_CALLS[:30], False), streamed.delta(TWO_CALLS[30:], True)]
    calls = [c for d in deltas if d is not None for c in d.tool_calls or []]
    assert [c.function.name for c in calls] == names
    assert streamed.finish_reason("stop") == "tool_calls"


def test_a_required_reply_cut_before_its_first_call_is_empty_whole_and_streamed() -> None:
    """max_tokens inside the first call's name: the stream sent nothing, the whole reply the
    grammar's scaffolding as content ('[{"name": "get_'), and Messages a text block of it."""
    cut = '[{"name": "get_'
    whole = ChatChoiceParser("required").message(cut)
    assert whole.content is None and whole.tool_calls == []
    assert ChatChoiceParser("required").delta(cut, True) is None
