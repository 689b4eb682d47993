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
