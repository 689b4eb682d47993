"""The offline API (`LLM`) as a vLLM user calls it: its inputs' checks and vLLM's keywords,
on one tiny random model with the bundled tokenizer."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from tests.utils.paged import tiny_chat_model

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), init_std=0.2)
    llm = LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory="16MiB",
              max_model_len=128)
    yield llm
    engine = llm.engine
    assert not engine.has_unfinished_requests(), "requests left in the engine"
    assert engine.call_utility("stats").all_free, "KV blocks leaked"
    llm.close()


@pytest.mark.parametrize("prompts, named", [
    (5, "int"),
    ([None], "NoneType"),
    ([1, "a"], "'a'"),
    ([[1, 2.5]], "2.5"),
    ([{"prompt_token_ids": [1, None]}], "None"),
    (["ok", 3], "prompt 1"),
])
def test_generate_names_a_bad_prompt(llm, prompts, named) -> None:
    with pytest.raises(TypeError) as exc:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert named in str(exc.value)
    assert not llm.engine.has_unfinished_requests()


def test_generate_names_bad_sampling_params(llm) -> None:
    with pytest.raises(TypeError, match="sampling_params.*dict"):
        llm.generate("hi", {"temperature": 0}, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params.*str"):
        llm.generate(["hi", "ho"], [GREEDY, "x"], use_tqdm=False)


def _text(llm, output) -> str:
    return llm.get_tokenizer().decode(output.prompt_token_ids)


def test_chat_takes_vllms_template_keywords(llm) -> None:
    # A template variable of chat_template_kwargs, as Qwen3's enable_thinking is.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "{% if not loop.last or not continue_final_message %}<|im_end|>\n{% endif %}"
                "{% endfor %}{% if greeting %}[{{ greeting }}]{% endif %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False,
                   chat_template=template, chat_template_kwargs={"greeting": "hello"})[0]
    assert _text(llm, out).endswith("[hello]<|im_start|>assistant\n")
    # The final assistant message is continued: no end marker and no new assistant turn.
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert _text(llm, out).endswith("<|im_start|>assistant\nSure,")
    assert out.prompt == _text(llm, out)  # the rendered prompt, as vLLM reports it


def test_chat_refuses_both_generation_prompt_and_continuation(llm) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)
