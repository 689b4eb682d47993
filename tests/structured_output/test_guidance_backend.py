"""The `guidance` backend (llguidance) in the engine with the bundled SmolLM2 (CPU):
JSON schemas validate, regex, choice and GBNF outputs match in full, every output is one a
fresh llguidance matcher accepts to its end, n > 1 and preemption keep the form, and a bad
grammar is a ValueError naming the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import GuidedDecodingParams
from pagedserve.structured_output import check_backend, guided_decoding_unavailable
from tests.structured_output.schemas import FAST, SCHEMAS

llguidance = pytest.importorskip("llguidance")

PROMPT = "Answer with JSON only.\n"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=None, kv_cache_memory="64MiB", max_num_seqs=32,
               guided_decoding_backend="guidance")


def _fresh_matcher_accepts(llm: LLM, guided: GuidedDecodingParams, token_ids: list[int]) -> bool:
    """A matcher built apart from the engine's accepts the tokens and has nothing more to add."""
    import llguidance.hf

    tokenizer = llguidance.hf.from_tokenizer(llm.get_tokenizer(),
                                             n_vocab=llm.engine.runner.vocab_size)
    if guided.json is not None:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(guided.json), defaults={"whitespace_flexible": False})
    elif guided.regex is not None:
        grammar = llguidance.grammar_from("regex", guided.regex)
    elif guided.choice is not None:
        grammar = llguidance.grammar_from("choice", json.dumps(guided.choice))
    else:
        grammar = llguidance.grammar_from("grammar", guided.grammar)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    ends = set(llm.engine.tokenizer.all_special_ids)
    return (all(matcher.consume_token(t) for t in token_ids if t not in ends)
            and matcher.is_accepting())


def test_json_schemas(llm: LLM) -> None:
    params, names = [], []
    for name in FAST[:3]:  # xgrammar's test runs every schema; this one the backend's own path
        for i in range(1):
            params.append(SamplingParams(temperature=0.8, seed=100 + i, max_tokens=160,
                                         guided_decoding=GuidedDecodingParams(json=SCHEMAS[name])))
            names.append(name)
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for name, p, out in zip(names, params, outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name])
        assert _fresh_matcher_accepts(llm, p.guided_decoding, c.token_ids), (name, c.text)
    assert llm.engine.check_blocks_free()


def test_regex_choice_and_grammar(llm: LLM) -> None:
    specs = [GuidedDecodingParams(regex=r"[0-9]{3}-[a-z]{2}"),
             GuidedDecodingParams(choice=["red", "green", "blue"]),
             GuidedDecodingParams(grammar='root ::= "id:" [0-9] [0-9] ("!" | "?")')]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, guided_decoding=g)
              for i, g in enumerate(specs)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[0]), texts
    assert texts[1] in ("red", "green", "blue"), texts
    assert re.fullmatch(r"id:[0-9]{2}[!?]", texts[2]), texts
    for p, out in zip(params, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        assert _fresh_matcher_accepts(llm, p.guided_decoding, out.outputs[0].token_ids)


@pytest.mark.slow  # the xgrammar preemption test covers the shared path
def test_n_sequences_and_preemption() -> None:
    """Tiny cache: sequences are preempted and recomputed; each still follows its grammar."""
    llm = LLM(model=None, dtype="float32", guided_decoding_backend="guidance", block_size=16,
              num_gpu_blocks_override=24, max_num_seqs=8)
    guided = GuidedDecodingParams(json=SCHEMAS["flat_required"])
    out = llm.generate([PROMPT], SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=120,
                                                guided_decoding=guided), use_tqdm=False)[0]
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS["flat_required"])
    assert llm.engine.check_blocks_free()


def test_a_grammar_llguidance_refuses_is_a_value_error(llm: LLM) -> None:
    manager = llm.engine.structured_output
    with pytest.raises(ValueError, match="invalid regex"):
        manager._ensure_backend().compile(("regex", "(?<=a)b"))  # lookbehind: not regular


def test_backend_is_checked_by_package(monkeypatch) -> None:
    import importlib.util

    check_backend("guidance")
    assert guided_decoding_unavailable("guidance") is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llguidance" else real(name, *a))
    # The engine starts without it (check_backend passes); guided requests are refused.
    check_backend("guidance")
    assert "needs the llguidance package" in guided_decoding_unavailable("guidance")
