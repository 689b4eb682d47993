"""Reasoning parsers (`--reasoning-parser`): a thinking model's `<think>...</think>` goes to
`reasoning_content`, the rest to `content`.

- qwen3 (also "think"): reasoning only when the reply opens with <think>.
- deepseek_r1: the template opens <think> itself, so the reply starts inside it: everything
  up to </think> is reasoning (all of it while </think> has not come).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    implicit_start: bool  # the reply begins inside the thinking section

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of the text so far. Not `final`: a tail that may be the
        beginning of a tag is left out, so a longer text's split extends a shorter one's."""
        if not final:
            text = text[:len(text) - _partial_tag(text)]
        body = text.lstrip()
        opened = body.startswith(START)
        if opened:
            body = body[len(START):]
        elif not self.implicit_start:
            if not final and START.startswith(body):
                return "", ""  # may yet open with <think>
            return "", text
        reasoning, closed, content = body.partition(END)
        if not closed:
            return body, ""
        return reasoning, content.lstrip()


def _partial_tag(text: str) -> int:
    """Characters at the end of `text` that could begin <think> or </think>."""
    for n in range(min(len(END) - 1, len(text)), 0, -1):
        tail = text[-n:]
        if START.startswith(tail) or END.startswith(tail):
            return n
    return 0


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", implicit_start=False),
    "think": ReasoningParser("think", implicit_start=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {name!r}") from None
