"""A body that fails validation is answered with the field that is wrong: inside a union
(`prompt`: text, ids or lists of them; `input`: text or items) the branch the body took,
named by its fields, not by pydantic's labels of the branches it did not take."""

from __future__ import annotations

import pydantic
import pytest

from pagedserve.server.api import describe_invalid_body
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.responses.protocol import ResponsesRequest


def _describe(model: type[pydantic.BaseModel], body: dict) -> tuple[str, str | None]:
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate(body)
    return describe_invalid_body([{**e, "loc": ("body", *e["loc"])}
                                  for e in info.value.errors()])


@pytest.mark.parametrize("model, body, message, param", [
    (ResponsesRequest, {"input": [{"role": "bogus", "content": "x"}]},
     "input.0.role: Input should be 'user', 'assistant', 'system' or 'developer'",
     "input.0.role"),
    (ResponsesRequest, {"input": [{"type": "message", "role": "user",
                                   "content": [{"type": "input_text"}]}]},
     "input.0.content.0.text: Field required", "input.0.content.0.text"),
    (CompletionRequest, {"prompt": [[1, "x"]]}, "prompt.0.1: Input should be a valid integer",
     "prompt.0.1"),
    # no branch got further than another: the first, and how many more
    (CompletionRequest, {"prompt": {"a": 1}},
     "prompt: Input should be a valid string (and 3 more error(s))", "prompt"),
    # a validator's own message, without pydantic's "Value error, " before it
    (CompletionRequest, {"prompt": "hi \udfff"},
     "prompt holds an unpaired UTF-16 surrogate (U+D800..U+DFFF); send valid Unicode text",
     None),
    # no union on the way: as before
    (ChatCompletionRequest, {"messages": [{"role": "bogus", "content": "x"}]},
     "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'",
     "messages.0.role"),
])
def test_the_error_names_the_field_of_the_branch_taken(model, body, message, param):
    assert _describe(model, body) == (message, param)


def test_a_request_that_needs_the_missing_tokenizer_is_told_what_to_do():
    """It said "send token ids" also to a token-id prompt asking for logprobs."""
    from types import SimpleNamespace

    from pagedserve.server.common import ApiError, ServerState

    state = ServerState(llm=SimpleNamespace(tokenizer=None), model_name="m", metrics=None)
    with pytest.raises(ApiError) as raised:
        state.tokenizer  # noqa: B018 (the property raises)
    assert raised.value.status == 400
    assert "(text prompts, chat messages and logprobs do): send token ids, or serve it with " \
           "--tokenizer DIR" in str(raised.value)


def _nested(depth: int, leaf: object) -> list:
    value = [leaf]
    for _ in range(depth):
        value = [value]
    return value


def test_the_unicode_check_walks_any_depth():
    """A body nested just under the JSON parser's limit (guided_json, response_format's schema,
    Anthropic's tools) passed the parser, then the check recursed past the interpreter's
    limit: a 500. It walks without recursion now."""
    from pagedserve.server.unicode_check import unpaired_surrogate

    assert unpaired_surrogate({"x": _nested(5000, "fine")}) is None
    assert unpaired_surrogate({"x": _nested(3, "bad \ud800")}) == "x.0.0.0.0"
    assert unpaired_surrogate({"a": ["ok", {"b": "\udfff"}], "c": "\ud800"}) == "a.1.b"
    assert unpaired_surrogate({"\ud800": 1}) == "\\ud800"  # a key too (its escape)
    body = {"prompt": "hi", "guided_json": {"x": _nested(5000, 1)}}
    CompletionRequest.model_validate(body)  # no RecursionError
