"""Tool-call and reasoning parsers on fixed texts: whole replies, and streams cut at every
character whose deltas must add up to the whole reply's message."""

from __future__ import annotations

import json

import pytest

from pagedserve.server import protocol as p
from pagedserve.server.chat_output import ChatChoiceParser
from pagedserve.server.reasoning import get_reasoning_parser
from pagedserve.server.tool_parsers import get_tool_parser

WEATHER = {"city": "Paris", "days": 3}


def _stream(parser: ChatChoiceParser, text: str, step: int = 1) -> dict:
    """Feed `text` in pieces; merge the deltas as the openai client does."""
    content, reasoning, calls = "", "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        delta = parser.delta(piece, finished=i == len(pieces) - 1)
        if delta is None:
            continue
        content += delta.content or ""
        reasoning += delta.reasoning_content or ""
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.function and d.function.name, "a call's first delta names it"
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += (d.function.arguments if d.function else "") or ""
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [tuple(c) for c in calls.values()]}


def _whole(parser: ChatChoiceParser, text: str) -> dict:
    m = parser.message(text)
    return {"content": m.content or None, "reasoning": m.reasoning_content,
            "calls": [(c.function.name, c.function.arguments) for c in m.tool_calls]}


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": '
               '{"city": "Paris", "days": 3}}\n</tool_call>', "Let me check.", 1),
    ("hermes", '<tool_call>{"name": "weather", "arguments": {"city": "Paris", "days": 3}}'
               '</tool_call>\n<tool_call>{"name": "weather", "arguments": {"city": "Paris", '
               '"days": 3}}</tool_call>', None, 2),
    ("smollm2", '<tool_call>[{"name": "weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "weather", "arguments": {"city": "Paris", "days": 3}}]</tool_call>',
     None, 2),
    ("llama3_json", '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris", '
                    '"days": 3}}', None, 1),
    ("llama3_json", ' {"name": "weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "weather", "parameters": {"city": "Paris", "days": 3}}', None, 2),
])
def test_tool_parsers_read_calls(name: str, text: str, content: str | None, calls: int) -> None:
    before, parsed = get_tool_parser(name).parse(text)
    assert before == content
    assert [(n, json.loads(a)) for n, a in parsed] == [("weather", WEATHER)] * calls
    for step in (1, 3, 7):
        streamed = _stream(ChatChoiceParser("auto", tools=get_tool_parser(name)), text, step)
        whole = _whole(ChatChoiceParser("auto", tools=get_tool_parser(name)), text)
        assert [(n, json.loads(a)) for n, a in streamed["calls"]] == [
            (n, json.loads(a)) for n, a in whole["calls"]]
        assert (streamed["content"] or "").strip() == (whole["content"] or "").strip()


@pytest.mark.parametrize("name", ["hermes", "smollm2", "llama3_json"])
def test_text_without_calls_is_content(name: str) -> None:
    text = "The weather in Paris is <b>sunny</b> {not json"
    before, parsed = get_tool_parser(name).parse(text)
    assert parsed == [] and before == text
    parser = ChatChoiceParser("auto", tools=get_tool_parser(name))
    assert _stream(parser, text)["content"] == text
    broken = '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>'
    assert get_tool_parser("hermes").parse(broken) == (broken, [])


def test_format_calls_round_trip() -> None:
    calls = [("weather", json.dumps(WEATHER)), ("time", "{}")]
    for name in ("hermes", "smollm2", "llama3_json"):
        parser = get_tool_parser(name)
        _, parsed = parser.parse(parser.format_calls(calls))
        assert [(n, json.loads(a)) for n, a in parsed] == [(n, json.loads(a)) for n, a in calls]


def test_required_array_streams_arguments_piece_by_piece() -> None:
    args = ['{"city": "Pa\\"ris]}", "days": [1, {"x": 2}]}', "{}"]
    text = f'[{{"name": "weather", "arguments": {args[0]}}}, {{"name": "time", "arguments": ' \
           f'{args[1]}}}]'
    whole = _whole(ChatChoiceParser("required"), text)
    assert whole["calls"] == [("weather", args[0]), ("time", args[1])]
    assert whole["content"] is None
    for step in (1, 2, 5):
        assert _stream(ChatChoiceParser("required"), text, step)["calls"] == whole["calls"]


def test_named_function_arguments_are_the_reply() -> None:
    text = json.dumps(WEATHER)
    whole = _whole(ChatChoiceParser("named", function_name="weather"), text)
    assert whole["calls"] == [("weather", text)]
    assert _stream(ChatChoiceParser("named", function_name="weather"), text, 2)["calls"] == \
        whole["calls"]
    parser = ChatChoiceParser("named", function_name="weather")
    parser.message(text)
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nsome thought\n</think>\n\nThe answer.", "\nsome thought\n",
     "The answer."),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>unfinished", "unfinished", None),
    ("deepseek_r1", "thinking first</think>Answer", "thinking first", "Answer"),
    ("deepseek_r1", "<think>t</think>A", "t", "A"),
    ("deepseek_r1", "all reasoning", "all reasoning", None),
])
def test_reasoning_split(name: str, text: str, reasoning: str | None,
                         content: str | None) -> None:
    r, c = get_reasoning_parser(name).split(text)
    assert (r or None, c or None) == (reasoning, content)
    for step in (1, 2, 4):
        streamed = _stream(ChatChoiceParser(reasoning=get_reasoning_parser(name)), text, step)
        assert (streamed["reasoning"], streamed["content"]) == (reasoning, content)


def test_reasoning_then_tool_call() -> None:
    text = '<think>I should call it</think><tool_call>{"name": "weather", "arguments": ' \
           '{"city": "Paris", "days": 3}}</tool_call>'
    parser = ChatChoiceParser("auto", get_reasoning_parser("qwen3"), get_tool_parser("hermes"))
    whole = _whole(parser, text)
    assert whole["reasoning"] == "I should call it"
    assert [(n, json.loads(a)) for n, a in whole["calls"]] == [("weather", WEATHER)]
    streamed = _stream(ChatChoiceParser("auto", get_reasoning_parser("qwen3"),
                                        get_tool_parser("hermes")), text)
    assert streamed["reasoning"] == whole["reasoning"]
    assert streamed["calls"] == [(n, a) for n, a in whole["calls"]]


def test_protocol_response_format_alias() -> None:
    fmt = p.ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                "strict": True}})
    assert fmt.json_schema is not None and fmt.json_schema.json_schema == {"type": "object"}
