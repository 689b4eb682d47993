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
