"""A request's stop strings and stop ids are bounded (--max-stop-strings,
--max-stop-string-length, --max-stop-token-ids): the front searches every stop string in the
text at every token and the core looks the stop ids up at every step, so a request over a limit
is refused with a ValueError naming the limit before it reaches the engine. A model without a
tokenizer cannot find stop strings (it makes no text): they are refused, stop ids still work."""

from __future__ import annotations

import re

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import ModelConfig
from pagedserve.engine.llm_engine import STOP_NEEDS_TOKENIZER

ENGINE = {"model": "random:tiny", "device": "cpu", "dtype": "float32",
          "kv_cache_memory": "8MiB"}
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def llm():
    llm = LLM(**ENGINE)
    yield llm
    llm.close()


def test_defaults() -> None:
    model = ModelConfig()
    assert (model.max_stop_strings, model.max_stop_string_length,
            model.max_stop_token_ids) == (32, 1024, 1024)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(stop=["z" * 200_000]),
     "stop strings must be at most 1024 characters long (the engine's "
     "--max-stop-string-length), got one of 200000"),
    (SamplingParams(stop=[f"s{i}" for i in range(33)]),
     "stop must hold at most 32 strings (the engine's --max-stop-strings), got 33"),
    (SamplingParams(stop_token_ids=[0] * 1025),
     "stop_token_ids must hold at most 1024 ids (the engine's --max-stop-token-ids), got 1025"),
])
def test_over_a_limit_is_refused(llm, params, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(PROMPT, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_at_the_limits_runs(tmp_path) -> None:
    from tests.pooling.st_model import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path)  # stop strings need text to be found in
    params = SamplingParams(stop=["z" * 1024] + [f"s{i}" for i in range(31)],
                            stop_token_ids=[0] * 1024, max_tokens=3, ignore_eos=True)
    with LLM(**ENGINE, tokenizer=str(tmp_path)) as llm:
        out = llm.generate(PROMPT, params, use_tqdm=False)
    assert out[0].finished and len(out[0].outputs[0].token_ids) == 3


def test_stop_strings_without_a_tokenizer_are_refused(llm) -> None:
    """They were accepted and never matched (no text is made to find them in)."""
    with pytest.raises(ValueError, match=re.escape(STOP_NEEDS_TOKENIZER)):
        llm.generate(PROMPT, SamplingParams(stop=["w"], max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert "--tokenizer DIR" in STOP_NEEDS_TOKENIZER and "stop_token_ids" in \
        STOP_NEEDS_TOKENIZER  # the words the user needs, whatever the wording around them
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    greedy.stop_token_ids = [free[2]]
    out = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:free.index(free[2]) + 1]


def test_limits_are_engine_settings() -> None:
    with LLM(**ENGINE, max_stop_strings=1, max_stop_string_length=4,
             max_stop_token_ids=2) as small:
        with pytest.raises(ValueError, match="at most 1 strings"):
            small.generate(PROMPT, SamplingParams(stop=["a", "b"]), use_tqdm=False)
        with pytest.raises(ValueError, match="at most 4 characters"):
            small.generate(PROMPT, SamplingParams(stop=["abcde"]), use_tqdm=False)
        with pytest.raises(ValueError, match="at most 2 ids"):
            small.generate(PROMPT, SamplingParams(stop_token_ids=[1, 2, 3]), use_tqdm=False)
    with pytest.raises(ValueError, match="max_stop_strings must be >= 0, got -1"):
        ModelConfig(max_stop_strings=-1)
