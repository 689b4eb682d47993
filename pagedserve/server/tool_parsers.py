"""Tool-call formats in generated text (`--tool-call-parser`): how a model is told about its
tools when its chat template has no place for them, how it writes calls, and how they are
read back out of the text.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
  (Hermes, Qwen and other ChatML models).
- smollm2: `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`, a JSON list in
  one block (SmolLM2's function-calling format; the bundled model's ChatML template has no
  tools section, so the server writes the tools into the system message).
- llama3_json: the reply is `{"name": ..., "parameters": {...}}` (calls separated by `;`),
  optionally after `<|python_tag|>` (Llama 3.1+).
"""

from __future__ import annotations

import json
import re
from typing import Any

ParsedCall = tuple[str, str]  # (function name, arguments as JSON text)
# What makes a reply's JSON no call: not JSON, or nested past the interpreter's recursion limit
# (a client can steer a reply there with a guided regex; json raises RecursionError for it).
NOT_JSON = (json.JSONDecodeError, RecursionError)


def _arguments_text(call: Any) -> ParsedCall | None:
    """(name, arguments JSON) of a decoded call object, or None if it is not one."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except NOT_JSON:
            return None
    if not isinstance(args, dict):
        return None
    try:
        return call["name"], json.dumps(args, ensure_ascii=False)
    except RecursionError:  # decoded near the limit, one level deeper to write out
        return None


def _tools_json(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


class ToolParser:
    """Reads tool calls out of a reply; `start` marks where calls begin."""

    name = ""
    start = ""

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content before the calls, or None; the calls). Text whose calls do not parse is
        all content, with no calls."""
        raise NotImplementedError

    def format_calls(self, calls: list[ParsedCall]) -> str:
        """Calls of an earlier assistant turn as this format writes them."""
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where tool calls begin in `text`, or None while none has."""
        i = text.find(self.start)
        return None if i < 0 else i

    def held_back(self, text: str) -> int:
        """How many characters at the end of `text` could be the beginning of `start`: a
        stream holds them until it knows."""
        for n in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-n:]):
                return n
        return 0


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return ("You may call functions to answer. The functions are described, one JSON "
                "object per line, inside <tools></tools>:\n<tools>\n" + _tools_json(tools)
                + "\n</tools>\nTo call a function, write a JSON object with its name and "
                  "arguments inside <tool_call></tool_call>, one block per call:\n<tool_call>\n"
                  '{"name": "function_name", "arguments": {"arg": "value"}}\n</tool_call>')

    def _blocks(self, text: str) -> list[str]:
        pattern = re.escape(self.start) + r"(.*?)(?:" + re.escape(self.end) + r"|$)"
        return re.findall(pattern, text, flags=re.DOTALL)

    def _decode_block(self, block: str) -> list[ParsedCall] | None:
        try:
            value = json.loads(block.strip())
        except NOT_JSON:
            return None
        call = _arguments_text(value)
        return None if call is None else [call]

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        i = self.call_start(text)
        if i is None:
            return text, []
        calls: list[ParsedCall] = []
        for block in self._blocks(text[i:]):
            decoded = self._decode_block(block)
            if decoded is None:
                return text, []
            calls.extend(decoded)
        if not calls:
            return text, []
        return text[:i].strip() or None, calls

    def format_calls(self, calls: list[ParsedCall]) -> str:
        return "\n".join(f'{self.start}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n'
                         f"{self.end}" for name, args in calls)


class SmolLM2ToolParser(HermesToolParser):
    name = "smollm2"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return ("You can call the functions listed, one JSON object per line, inside "
                "<tools></tools>:\n<tools>\n" + _tools_json(tools) + "\n</tools>\nTo call "
                "functions, answer with a JSON list of calls inside <tool_call></tool_call>:\n"
                '<tool_call>[{"name": "function_name", "arguments": {"arg": "value"}}]'
                "</tool_call>\nIf no function fits, answer in plain text.")

    def _decode_block(self, block: str) -> list[ParsedCall] | None:
        try:
            value = json.loads(block.strip())
        except NOT_JSON:
            return None
        items = value if isinstance(value, list) else [value]
        calls = [_arguments_text(item) for item in items]
        return None if not calls or None in calls else calls  # type: ignore[return-value]

    def format_calls(self, calls: list[ParsedCall]) -> str:
        body = ", ".join(f'{{"name": {json.dumps(name)}, "arguments": {args}}}'
                         for name, args in calls)
        return f"{self.start}[{body}]{self.end}"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start = "<|python_tag|>"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return ("You may call functions to answer. To call one, reply with only a JSON object "
                '{"name": function name, "parameters": an object of argument names and '
                "values}; separate several calls with ;. The functions, one JSON object per "
                "line:\n" + _tools_json(tools))

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith((self.start, "{")):
            return len(text) - len(stripped)
        return None

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        # Nothing but whitespace yet, or the beginning of the python tag: wait.
        if not stripped or self.start.startswith(stripped):
            return len(text)
        return 0

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        i = self.call_start(text)
        if i is None:
            return text, []
        body = text[i:].removeprefix(self.start).strip()
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos = 0
        while pos < len(body):
            try:
                value, pos = decoder.raw_decode(body, pos)
            except NOT_JSON:
                return text, []
            call = _arguments_text(value)
            if call is None:
                return text, []
            calls.append(call)
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return text, []
            pos = len(body) - len(rest)
        return (None, calls) if calls else (text, [])

    def format_calls(self, calls: list[ParsedCall]) -> str:
        return "; ".join(f'{{"name": {json.dumps(name)}, "parameters": {args}}}'
                         for name, args in calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, SmolLM2ToolParser, Llama3JsonToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got "
                         f"{name!r}") from None
