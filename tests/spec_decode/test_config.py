"""--speculative-config: vLLM's field names from the flag (JSON), LLM(...) (a dict) and YAML;
one-line errors for what is malformed."""

from __future__ import annotations

import argparse

import pytest

from pagedserve.arg_utils import add_engine_args, engine_config
from pagedserve.config import EngineConfig
from pagedserve.spec_decode.config import check_supported, parse_speculative_config


def test_flag_and_keyword_give_the_same_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 4, '
                              '"prompt_lookup_max": 3, "prompt_lookup_min": 2}'])
    from_flag = engine_config(args).speculative
    from_kwargs = EngineConfig.from_kwargs(speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 2}).speculative
    assert from_flag == from_kwargs
    assert (from_flag.prompt_lookup_min, from_flag.prompt_lookup_max) == (2, 3)
    assert EngineConfig().speculative is None


@pytest.mark.parametrize("model, method", [("/m/opt-125m", "draft_model"),
                                           ("/m/EAGLE-Vicuna-7B-v1.3", "eagle"),
                                           ("/m/EAGLE3-LLaMA3.1-Instruct-8B/", "eagle3")])
def test_a_model_without_a_method_is_a_draft_or_a_head_by_its_name(model, method):
    """As vLLM reads it (its docs' draft model example names no method)."""
    spec = parse_speculative_config({"model": model, "num_speculative_tokens": 2})
    assert spec.method == method


@pytest.mark.parametrize("method", ["deepseek_mtp", "qwen3_next_mtp"])
def test_vllm_per_model_mtp_names_read_as_mtp(method):
    """Qwen3-Next's model card passes qwen3_next_mtp (it was refused as no method)."""
    spec = parse_speculative_config({"method": method, "num_speculative_tokens": 2})
    assert spec.method == "mtp"


def test_lookup_defaults():
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ({"num_speculative_tokens": 2}, "needs 'method'"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method 'medusa' is not one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown field"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min 4 is above prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "m"}, "takes no model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size must be"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    # checked with the flags, not after the target has loaded
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nowhere/draft"},
     "speculative_config: model '/nowhere/draft' does not exist as a local model directory"),
    ({"method": "eagle", "num_speculative_tokens": 2, "model": "/nowhere/head"},
     "speculative_config: model '/nowhere/head' does not exist"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"},
     "synthetic_acceptance_rate in"),
    ({"method": "ngram", "num_speculative_tokens": 2, "synthetic_acceptance_rate": 0.5},
     "applies only to"),
])
def test_bad_values_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(speculative_config=value)


def test_tensor_parallelism_checks():
    """Every method runs split (DeepSeek's MTP layer is refused where it loads: test_mtp.py).
    A draft model splits like the target or runs whole on every rank; a head or MTP block
    only splits (refused by EngineConfig, before any rank starts)."""
    ngram = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2})
    for tp in (1, 2, 4):
        check_supported(ngram, tensor_parallel_size=tp)
    check_supported(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                              "draft_tensor_parallel_size": 2}),
                    tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"\(the target's size, or 1\)"):
        check_supported(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                                  "draft_tensor_parallel_size": 4}),
                        tensor_parallel_size=2)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    check_supported(parse_speculative_config(mtp), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size 1 with method 'mtp'"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, speculative_config=dict(
            mtp, draft_tensor_parallel_size=1))
    for method, draft_tp, ok in (("draft_model", 1, True), ("draft_model", 2, True),
                                 ("draft_model", 4, False), ("eagle", 1, False),
                                 ("eagle", 2, True)):
        spec = parse_speculative_config({"method": method, "model": "x",
                                         "num_speculative_tokens": 2,
                                         "draft_tensor_parallel_size": draft_tp})
        if ok:
            check_supported(spec, tensor_parallel_size=2)
            continue
        with pytest.raises(ValueError, match=f"draft_tensor_parallel_size {draft_tp} with "):
            EngineConfig.from_kwargs(tensor_parallel_size=2, speculative_config=spec)


def test_a_pooling_model_is_refused_at_start_up(make_llm, tmp_path):
    """It generates nothing to draft: refused when the engine starts, not on every request."""
    from tests.pooling.st_model import tiny_qwen3_embedder

    path = tiny_qwen3_embedder(tmp_path / "embedder")
    with pytest.raises(ValueError, match=r"a pooling model \(--runner pooling\) generates no "
                                         r"tokens to draft"):
        make_llm(model=str(path), device="cpu", dtype="float32", kv_cache_memory="8MiB",
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_more_drafts_than_the_context_holds_are_refused_at_start_up(make_llm, tmp_path):
    """A K no sequence has room for is a mistake (it ran, silently cut to what fits)."""
    from tests.spec_decode.test_engine import _tiny

    path = _tiny(tmp_path / "tiny", 0, 32, 1)
    with pytest.raises(ValueError, match=r"num_speculative_tokens 100000 is not below the "
                                         r"max_model_len 64"):
        make_llm(model=str(path), device="cpu", dtype="float32", kv_cache_memory="8MiB",
                 max_model_len=64,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 100000})
