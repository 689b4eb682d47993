"""A chat request's template variables: vLLM's chat_template_kwargs and reasoning_effort reach
the chat template (what gpt-oss's and Qwen3's templates read), and a key that is an argument
of the template call itself is a 400 naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedserve.server import protocol as p
from pagedserve.server.chat import render_template, template_variables
from pagedserve.server.common import ApiError
from tests.server.openai_server import CHAT, MODEL, assert_error, post

TEMPLATE = ("{{ reasoning_effort | default('none') }}|{{ greeting | default('') }}|"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def _request(**fields) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest(messages=CHAT, **fields)


def test_variables_reach_the_template(ref):
    state = SimpleNamespace(llm=SimpleNamespace(engine=SimpleNamespace(chat_template=TEMPLATE)),
                            tokenizer=ref.llm.tokenizer, tool_parser=None, mm_processor=None)
    body = _request(reasoning_effort="high", chat_template_kwargs={"greeting": "hello"})
    ids = render_template(state, [dict(m) for m in CHAT], True,
                          template_kwargs=template_variables(body))
    assert ref.llm.tokenizer.decode(ids) == f"high|hello|{CHAT[0]['content']}"
    # chat_template_kwargs name the variable too: theirs wins.
    both = _request(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
    assert template_variables(both) == {"reasoning_effort": "low"}
    assert template_variables(_request()) is None


def test_reserved_keys_are_refused():
    with pytest.raises(ApiError) as err:
        template_variables(_request(chat_template_kwargs={"add_generation_prompt": False}))
    assert err.value.status == 400 and err.value.body.error.param == "chat_template_kwargs"


def test_served_routes_take_them(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 1,
            "chat_template_kwargs": {"enable_thinking": False}}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    assert_error(post(server, "/tokenize", {"model": MODEL, "messages": CHAT,
                                            "chat_template_kwargs": {"tokenize": False}}),
                 400, "chat_template_kwargs")


def test_an_assistant_messages_reasoning_reaches_the_template():
    from pagedserve.server.chat_media import MediaSettings, template_input

    messages = [p.ChatMessage(role="user", content="hi"),
                p.ChatMessage(role="assistant", content="", reasoning="think first",
                              tool_calls=[{"id": "c1", "type": "function", "function": {
                                  "name": "f", "arguments": "{}"}}]),
                p.ChatMessage(role="tool", content="42", tool_call_id="c1")]
    rendered = template_input(messages, None, None, MediaSettings(), MODEL).messages
    assert rendered[1]["reasoning_content"] == "think first"
    assert "reasoning_content" not in rendered[0] and "reasoning_content" not in rendered[2]
