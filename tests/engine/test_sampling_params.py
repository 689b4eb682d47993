import math

import pytest

from pagedserve.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (
        16,
        0,
        None,
        None,
        None,
    )
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.greedy


def test_normalises_stop_fields() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-4, False)])
def test_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", -5),
        ("stop", [""]),
        ("stop_token_ids", [-3]),
    ],
)
def test_rejects_out_of_range(field: str, value: object) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    assert field in str(exc.value) and repr(value) in str(exc.value)


@pytest.mark.parametrize(
    "kwargs", [{"top_k": -1}, {"top_p": 1.0}, {"min_p": 1.0}, {"logprobs": 0}, {"max_tokens": None}]
)
def test_accepts_boundaries(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_min_tokens_not_above_max_tokens() -> None:
    SamplingParams(min_tokens=5, max_tokens=5)
    SamplingParams(min_tokens=500, max_tokens=None)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=6, max_tokens=5)


def test_from_dict() -> None:
    p = SamplingParams.from_dict({"temperature": 0.5, "stop": "x", "seed": 3})
    assert p == SamplingParams(temperature=0.5, stop=["x"], seed=3)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams.from_dict({"best_of": 2})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 0})


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "0.5"),
        ("top_p", "x"),
        ("min_p", None),
        ("presence_penalty", "1"),
        ("frequency_penalty", [1.0]),
        ("repetition_penalty", "1.2"),
        ("temperature", True),
        ("stop", 5),
        ("stop", ["a", 5]),
        ("stop_token_ids", 5),
        ("stop_token_ids", "12"),
    ],
)
def test_rejects_wrong_types_by_name(field: str, value: object) -> None:
    # A value of the wrong type is named, not left to fail inside a comparison or iteration.
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    assert field in str(exc.value) and repr(value) in str(exc.value)
