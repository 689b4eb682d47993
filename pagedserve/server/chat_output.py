"""One chat choice's text -> OpenAI's message: reasoning, content and tool calls, whole or as
stream deltas. The same parsing serves both, so a streamed choice's deltas add up to the
non-streamed message.

Modes: "text" (no tools, or tool_choice none), "auto" (the tool parser decides), "required"
(the grammar made the reply a JSON array of {"name", "arguments"}), "named" (the grammar made
the reply the named function's arguments object).
"""

from __future__ import annotations

import json
import re
import uuid

from pagedserve.server import protocol as p
from pagedserve.server.reasoning import ReasoningParser
from pagedserve.server.tool_parsers import ParsedCall, ToolParser

# The head of one call in a "required" reply, as the grammar writes it (properties in the
# schema's order: name, then arguments).
_CALL_HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"'
                        r"\s*:\s*(?=\{)")  # matched once the arguments' brace is there


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _CallArrayScanner:
    """Reads a JSON array of {"name", "arguments"} objects as it grows: a call's header delta
    as soon as its name is complete, then its arguments' text piece by piece."""

    def __init__(self) -> None:
        self.pos = 0
        self.state = "head"
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.index = -1

    def feed(self, text: str) -> list[p.DeltaToolCall]:
        out: list[p.DeltaToolCall] = []
        while True:
            if self.state == "head":
                m = _CALL_HEAD.match(text, self.pos)
                if m is None:
                    return out
                self.index += 1
                out.append(p.DeltaToolCall(
                    index=self.index, id=tool_call_id(), type="function",
                    function=p.DeltaFunctionCall(name=json.loads(f'"{m.group(1)}"'),
                                                 arguments="")))
                self.pos, self.state, self.depth = m.end(), "arguments", 0
            elif self.state == "arguments":
                start, done = self.pos, False
                i = start
                while i < len(text) and not done:
                    ch = text[i]
                    i += 1
                    if self.in_string:
                        if self.escaped:
                            self.escaped = False
                        elif ch == "\\":
                            self.escaped = True
                        elif ch == '"':
                            self.in_string = False
                    elif ch == '"':
                        self.in_string = True
                    elif ch in "{[":
                        self.depth += 1
                    elif ch in "}]":
                        self.depth -= 1
                        done = self.depth == 0
                if i > start:
                    out.append(p.DeltaToolCall(index=self.index, function=p.DeltaFunctionCall(
                        arguments=text[start:i])))
                self.pos = i
                if not done:
                    return out
                self.state = "tail"
            else:  # the call object's closing brace
                j = text.find("}", self.pos)
                if j < 0:
                    return out
                self.pos, self.state = j + 1, "head"


def _merge_calls(deltas: list[p.DeltaToolCall]) -> list[p.ToolCall]:
    calls: dict[int, p.ToolCall] = {}
    for d in deltas:
        fn = d.function or p.DeltaFunctionCall()
        if d.index not in calls:
            calls[d.index] = p.ToolCall(id=d.id or tool_call_id(), function=p.FunctionCall(
                name=fn.name or "", arguments=fn.arguments or ""))
        else:
            calls[d.index].function.arguments += fn.arguments or ""
    return list(calls.values())


class ChatChoiceParser:
    def __init__(self, mode: str = "text", reasoning: ReasoningParser | None = None,
                 tools: ToolParser | None = None, function_name: str | None = None,
                 parallel: bool = True) -> None:
        self.mode = mode
        self.reasoning = reasoning
        self.tools = tools
        self.function_name = function_name
        # parallel_tool_calls false: an "auto" reply's first call only, as vLLM returns it
        # ("required" has its grammar allow one call).
        self.parallel = parallel
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.calls_at: int | None = None  # auto: where the tool calls begin in the content
        self.scanner = _CallArrayScanner()
        self.has_calls = False

    def _split(self, final: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", self.text
        return self.reasoning.split(self.text, final)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.has_calls else reason

    # ---- whole responses ----------------------------------------------------------------

    def message(self, text: str) -> p.ChatResponseMessage:
        self.text = text
        reasoning, content = self._split(final=True)
        message = p.ChatResponseMessage(reasoning_content=reasoning or None, content=content)
        if self.mode == "named":
            message.content = None
            message.tool_calls = [p.ToolCall(id=tool_call_id(), function=p.FunctionCall(
                name=self.function_name or "", arguments=content))]
        elif self.mode == "required":
            # The grammar's array is never content: cut before a call's name is whole, the
            # reply is empty (as its stream is), not the array's opening.
            message.content = None
            message.tool_calls = _merge_calls(_CallArrayScanner().feed(content))
        elif self.mode == "auto" and self.tools is not None:
            before, parsed = self._parse(content)
            if parsed:
                message.content = before
                message.tool_calls = [p.ToolCall(id=tool_call_id(), function=p.FunctionCall(
                    name=name, arguments=args)) for name, args in parsed]
        self.has_calls = bool(message.tool_calls)
        return message

    def _parse(self, content: str) -> tuple[str | None, list[ParsedCall]]:
        assert self.tools is not None
        before, parsed = self.tools.parse(content)
        return before, parsed if self.parallel else parsed[:1]

    # ---- stream deltas ------------------------------------------------------------------

    def delta(self, text: str, finished: bool) -> p.DeltaMessage | None:
        """The delta for `text` (new since the last call); None when there is nothing to send
        yet. `finished`: the choice ends with this text (held-back text is flushed)."""
        self.text += text
        reasoning, content = self._split(final=finished)
        out = p.DeltaMessage()
        if len(reasoning) > self.sent_reasoning:
            out.reasoning_content = reasoning[self.sent_reasoning:]
            self.sent_reasoning = len(reasoning)
        if self.mode == "named":
            self._named(content, out)
        elif self.mode == "required":
            deltas = self.scanner.feed(content)
            if deltas:
                out.tool_calls = deltas
                self.has_calls = True
        elif self.mode == "auto" and self.tools is not None:
            self._auto(content, finished, out)
        else:
            self._content(content, len(content), out)
        if out.reasoning_content is None and out.content is None and out.tool_calls is None:
            return None
        return out

    def _content(self, content: str, upto: int, out: p.DeltaMessage) -> None:
        if upto > self.sent_content:
            out.content = content[self.sent_content:upto]
            self.sent_content = upto

    def _named(self, content: str, out: p.DeltaMessage) -> None:
        calls = []
        if not self.has_calls:
            self.has_calls = True
            calls.append(p.DeltaToolCall(index=0, id=tool_call_id(), type="function",
                                         function=p.DeltaFunctionCall(
                                             name=self.function_name, arguments="")))
        if len(content) > self.sent_content:
            calls.append(p.DeltaToolCall(index=0, function=p.DeltaFunctionCall(
                arguments=content[self.sent_content:])))
            self.sent_content = len(content)
        out.tool_calls = calls or None

    def _auto(self, content: str, finished: bool, out: p.DeltaMessage) -> None:
        """Content streams until a tool call begins; the calls are sent whole when the reply
        ends (their text is held until then), or as content if they do not parse."""
        assert self.tools is not None
        if self.calls_at is None:
            self.calls_at = self.tools.call_start(content)
            if self.calls_at is not None:
                self._content(content, self.calls_at, out)  # the text before the calls
        if self.calls_at is None:
            upto = len(content) if finished else len(content) - self.tools.held_back(content)
            self._content(content, upto, out)
            return
        if not finished:
            return
        _, parsed = self._parse(content)
        if not parsed:
            self._content(content, len(content), out)
            return
        self.has_calls = True
        out.tool_calls = [p.DeltaToolCall(index=i, id=tool_call_id(), type="function",
                                          function=p.DeltaFunctionCall(name=name,
                                                                       arguments=args))
                          for i, (name, args) in enumerate(parsed)]
