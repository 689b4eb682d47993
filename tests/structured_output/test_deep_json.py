"""JSON nested past Python's recursion limit. A client can steer a reply there (a guided regex
beside tool_choice "auto", or a tool schema that refers to itself): the tool-call parsers and
Anthropic's tool_use blocks read such a reply as text, never as a 500 or a cut stream. And a
schema nested just under the JSON parser's limit is refused by name, not a 500."""

from __future__ import annotations

import pytest

from pagedserve.sampling_params import GuidedDecodingParams
from pagedserve.server.anthropic.translate import content_block
from pagedserve.server.chat_output import ChatChoiceParser
from pagedserve.server.output_blocks import Block
from pagedserve.server.tool_parsers import get_tool_parser
from pagedserve.structured_output.grammar import grammar_key

DEEP = "[" * 5000  # json.loads raises RecursionError, not JSONDecodeError, before the end
DEEP_CALLS = {
    "hermes": "<tool_call>" + DEEP,
    "smollm2": "<tool_call>" + DEEP + "</tool_call>",
    "llama3_json": '<|python_tag|>{"name": "f", "parameters": ' + DEEP,
}


@pytest.mark.parametrize("name", list(DEEP_CALLS))
def test_a_call_nested_too_deep_is_content(name: str) -> None:
    text = DEEP_CALLS[name]
    assert get_tool_parser(name).parse(text) == (text, [])
    message = ChatChoiceParser("auto", tools=get_tool_parser(name)).message(text)
    assert message.content == text and message.tool_calls == []
    streamed = ChatChoiceParser("auto", tools=get_tool_parser(name))
    delta = streamed.delta(text, finished=True)
    assert delta is not None and delta.content == text and delta.tool_calls is None


def test_arguments_nested_too_deep_are_no_call() -> None:
    """Arguments that decode but are too deep to write back out (a string of JSON, decoded
    once more) are no call either."""
    deep_args = '"' + "[" * 990 + "]" * 990 + '"'
    text = f'<tool_call>{{"name": "f", "arguments": {deep_args}}}</tool_call>'
    assert get_tool_parser("hermes").parse(text) == (text, [])


def test_anthropic_tool_use_nested_too_deep_is_text() -> None:
    block = Block("tool_call", 0, text='{"a": ' * 3000, name="f", call_id="call_1")
    assert content_block(block, whole=True) == {"type": "text", "text": block.text}


def test_a_schema_nested_too_deep_is_refused_by_name() -> None:
    deep: list = [1]
    for _ in range(5000):
        deep = [deep]
    for schema in ({"enum": [deep]}, '{"enum": [' + DEEP + "]" * 5000 + "]}"):
        with pytest.raises(ValueError, match="the JSON schema is nested too deeply"):
            grammar_key("json", schema)
        with pytest.raises(ValueError, match="guided_decoding.json: the JSON schema is nested"):
            GuidedDecodingParams(json=schema)


def test_required_tools_nested_too_deep_are_refused_by_name() -> None:
    """tool_choice "required" relocates each tool's $refs by walking its schema: a schema
    deeper than the interpreter recurses is the request's 400, naming the tool."""
    from pagedserve.server import protocol as p
    from pagedserve.server.common import ApiError
    from pagedserve.server.guided import tool_call_guided

    deep: dict = {"type": "object"}
    for _ in range(5000):
        deep = {"allOf": [deep]}
    tools = [p.ChatTool.model_validate({"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}),
        p.ChatTool.model_construct(type="function", function=p.FunctionDefinition.model_construct(
            name="g", parameters=deep))]
    with pytest.raises(ApiError) as err:
        tool_call_guided(tools, "required", parallel=True)
    assert err.value.status == 400
    assert err.value.body.error.param == "tools.1.function.parameters"
