"""A request's stop strings and stop ids are bounded (--max-stop-strings,
--max-stop-string-length, --max-stop-token-ids): the front searches every stop string in the
text at every token and the core looks the stop ids up at every step, so a request over a limit
is refused with a ValueError naming the limit before it reaches the engine."""

from __future__ import annotations

import re

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import ModelConfig

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


def test_at_the_limits_runs(llm) -> None:
    params = SamplingParams(stop=["z" * 1024] + [f"s{i}" for i in range(31)],
                            stop_token_ids=[0] * 1024, max_tokens=3, ignore_eos=True)
    out = llm.generate(PROMPT, params, use_tqdm=False)
    assert out[0].finished


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
