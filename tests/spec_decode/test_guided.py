"""Guided requests (a JSON schema, a regex, a choice) with speculative decoding: greedy outputs
equal those without speculation token for token, with n-gram drafts (xgrammar and llguidance)
and a draft model; every output is valid under its grammar; drafts of guided requests are
kept (the batches hold guided requests only, so the engine's counters are theirs). And the
pieces: a verify step's bitmask rows against fresh matchers advanced by hand, and the
drafts a grammar accepts.

The target is the spec tests' tiny random Llama (VOCAB ids) with a character tokenizer of
exactly that many ids saved beside it. The prompt spells out the choice and a JSON value,
so n-gram lookups propose what the grammar then forces."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.sampling_params import GuidedDecodingParams
from tests.spec_decode.test_engine import CASES, NGRAM, VOCAB, _assert_same, _run, _tiny

SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["alpha", "omega"]},
    "size": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "size", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{3,8}( [a-z]{3,8}){2}\."
CHOICES = ["the quick brown fox", "jumps over the lazy dog"]
PROMPT = ('say the quick brown fox or jumps over the lazy dog; '
          '{"name": "omega", "size": 42, "tags": ["red", "blue"]} and so on')


def _char_tokenizer():
    """A fast tokenizer of VOCAB ids: <unk>, <s>, </s> (ids 0-2: the tiny Llama's bos 1 and
    eos 2), then one id per printable ASCII character but the backtick. A byte-fallback
    decoder, which both grammar libraries read."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(32, 127) if chr(c) != "`"]
    assert len(tokens) == VOCAB
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)},
                                        unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def guided_path(tmp_path_factory):
    path = _tiny(tmp_path_factory.mktemp("tiny_guided"), 0, 32, 2)
    _char_tokenizer().save_pretrained(path)
    return path


def _requests() -> list[SamplingParams]:
    """Each grammar greedy, then each seeded at temperature 0.8, two sequences each (valid;
    not compared)."""
    specs = [GuidedDecodingParams(json=SCHEMA), GuidedDecodingParams(regex=REGEX),
             GuidedDecodingParams(choice=CHOICES)]
    return ([SamplingParams(temperature=0, max_tokens=80, guided_decoding=g) for g in specs]
            + [SamplingParams(temperature=0.8, seed=s, n=2, max_tokens=80, guided_decoding=g)
               for s, g in enumerate(specs)])


def _prompt_ids() -> list[list[int]]:
    ids = _char_tokenizer().encode(PROMPT)
    return [ids, ids[10:], ids[::-1][:40]] * 2


def _check_valid(outputs, params) -> None:
    tokenizer = _char_tokenizer()
    for output, p in zip(outputs, params, strict=True):
        for token_ids, finish_reason, _ in output:
            text = tokenizer.decode([t for t in token_ids if t != 2])
            assert finish_reason == "stop", text
            guided = p.guided_decoding
            if guided.json is not None:
                jsonschema.validate(json.loads(text), SCHEMA)
            elif guided.regex is not None:
                assert re.fullmatch(REGEX, text), text
            else:
                assert text in CHOICES, text


def _check(got, want, stats) -> None:
    """The greedy requests' tokens equal those without speculation; every output is valid
    under its grammar; verify steps of guided requests kept drafts."""
    params = _requests()
    _assert_same(got[:3], want[:3])
    _check_valid(got, params)
    assert stats.spec_decode_num_accepted_tokens > 0


@pytest.fixture(scope="module")
def no_speculation(guided_path):
    """The outputs without speculation (xgrammar), for the tests that compare with them."""
    from pagedserve import LLM

    with LLM(model=guided_path, dtype="float32", device="cpu", kv_cache_memory="8MiB") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompt_ids()], _requests(),
                            use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, None) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("case", ["plain"] + [pytest.param(c, marks=pytest.mark.slow) for c in (
    "overlap", "chunked", "preempting", "prefix-caching")])
def test_ngram_greedy_equals_no_speculation(guided_path, no_speculation, make_llm, case):
    """Drafts the grammar forces are kept, the others rejected. `overlap`: async scheduling
    with drafts off while 4 or more requests run, so guided steps first overlap (the runner
    advancing the grammars ahead of the scheduler) and then verify drafts; the others as the
    spec tests' cases of that name."""
    kwargs = {"overlap": dict(async_scheduling=True),  # (the spec tests' pool is too small)
              "preempting": dict(num_gpu_blocks_override=60, block_size=4,
                                 kv_cache_memory=None)}.get(case, CASES.get(case))
    spec = NGRAM if case != "overlap" else dict(NGRAM, disable_by_batch_size=4)
    got, stats = _run(make_llm, guided_path, _prompt_ids(), _requests(), spec, **kwargs)
    _check(got, no_speculation, stats)
    if case == "plain":
        assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if case == "preempting":
        assert stats.num_preemptions > 0
    if case == "prefix-caching":
        assert stats.prefix_cache_hits > 0


@pytest.mark.slow
def test_ngram_guidance_greedy_equals_no_speculation(guided_path, make_llm):
    """The same with llguidance, whose matchers end on an ordinary token (within the drafts:
    the rows after it allow every token). Fast: test_mask_rows_follow_the_drafts."""
    kwargs = dict(guided_decoding_backend="guidance")
    want, _ = _run(make_llm, guided_path, _prompt_ids(), _requests(), None, **kwargs)
    got, stats = _run(make_llm, guided_path, _prompt_ids(), _requests(), NGRAM, **kwargs)
    _check(got, want, stats)


def test_draft_model_greedy_equals_no_speculation(guided_path, no_speculation, make_llm,
                                                  caplog):
    """A draft identical to the target proposes its unconstrained choices: the scheduler keeps
    those the grammar allows (unchecked, the ones it refuses would reach the mask's fill,
    which logs them), and the target, masked, keeps every one. The greedy requests only (the
    draft's steps make it the slowest case)."""
    spec = {"method": "draft_model", "model": guided_path, "num_speculative_tokens": 3}
    got, stats = _run(make_llm, guided_path, _prompt_ids()[:3], _requests()[:3], spec)
    _assert_same(got, no_speculation[:3])
    _check_valid(got, _requests()[:3])
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert not [r for r in caplog.records if "refused" in r.getMessage()]


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_mask_rows_follow_the_drafts(guided_path, backend):
    """Row j of a guided request's verify rows equals the mask of a fresh matcher that accepted
    its first j drafts; a draft that ends the grammar leaves the rows after it allowing every
    token; the matchers are as they were afterwards."""
    from pagedserve.structured_output import StructuredOutputManager

    tokenizer = _char_tokenizer()
    manager = StructuredOutputManager(tokenizer, VOCAB, torch.device("cpu"), 4, backend,
                                      num_speculative_tokens=4)
    end = frozenset({2})
    specs = [GuidedDecodingParams(json=SCHEMA), GuidedDecodingParams(choice=CHOICES)]
    # JSON's separators: xgrammar's ", " and ": ", llguidance's compact ones.
    comma, colon = (",", ":") if backend == "guidance" else (", ", ": ")
    prefixes = ['{"name"' + colon + '"om', "jumps over the lazy d"]
    drafts = [tokenizer.encode('ega"' + comma), tokenizer.encode("og") + [2]]

    def fresh(i, n):
        grammar = manager.new_grammar(specs[i], end)
        assert all(grammar.accept(t) for t in tokenizer.encode(prefixes[i]) + drafts[i][:n])
        return grammar

    grammars = [fresh(0, 0), fresh(1, 0)]
    # The drafts a grammar keeps: llguidance's ends on the "g" (xgrammar's on the EOS after).
    kept = [len(drafts[0]), 3 if backend == "xgrammar" else 2]
    assert [g.validate(d) for g, d in zip(grammars, drafts, strict=True)] == kept
    drafts = [d[:n] for d, n in zip(drafts, kept, strict=True)]
    # As in the engine's steps: the host buffers are made (on the first fill) in inference mode.
    with torch.inference_mode():
        before = manager.finish_fill(manager.start_fill(grammars, [0, 7], 11)).clone()
        for buffer in manager._bitmasks:  # no row left from before passes for a filled one
            buffer.zero_()
        rows = manager.finish_fill(manager.start_fill(grammars, [0, 7], 11, drafts)).clone()
    for i, start in enumerate((0, 7)):
        for j in range(len(drafts[i]) + 1):
            grammar = fresh(i, j)
            if grammar.is_terminated:
                assert (rows[start + j] == -1).all()
                continue
            want = manager.finish_fill(manager.start_fill([grammar], [0], 1))[0]
            assert torch.equal(rows[start + j], want), (i, j)
    after = manager.finish_fill(manager.start_fill(grammars, [0, 7], 11)).clone()
    assert torch.equal(after[[0, 7]], before[[0, 7]])
    assert [g.num_accepted for g in grammars] == [len(tokenizer.encode(p)) for p in prefixes]
    manager.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_validate_keeps_the_accepted_prefix(guided_path, backend):
    """The longest prefix the grammar accepts, the matcher left as it was (llguidance's
    matcher would be in its error state for good after a refused token)."""
    from pagedserve.structured_output import StructuredOutputManager

    tokenizer = _char_tokenizer()
    manager = StructuredOutputManager(tokenizer, VOCAB, torch.device("cpu"), 1, backend)
    grammar = manager.new_grammar(GuidedDecodingParams(regex=REGEX), frozenset({2}))
    assert all(grammar.accept(t) for t in tokenizer.encode("abc de"))
    assert grammar.validate(tokenizer.encode("f ghi.")) == 6
    assert grammar.validate(tokenizer.encode("fX ghi")) == 1
    # Up to the token that ends the grammar: xgrammar's stop token, llguidance's "." (after
    # which nothing but EOS may come).
    ends_on_eos = backend == "xgrammar"
    assert grammar.validate(tokenizer.encode("f ghi.") + [2, 5]) == 6 + ends_on_eos
    assert grammar.validate([]) == 0
    assert all(grammar.accept(t) for t in tokenizer.encode("fg hij."))
    assert not ends_on_eos or grammar.accept(2)
    assert grammar.is_terminated and grammar.validate([2]) == 0
    manager.shutdown()


def test_grammar_workers_are_refused_with_speculation():
    from pagedserve.structured_output.manager import resolve_workers

    assert resolve_workers(None, torch.device("cpu"), speculative=True) == 0
    with pytest.raises(ValueError, match="guided_decoding_workers 2 with speculative"):
        resolve_workers(2, torch.device("cpu"), speculative=True)


@pytest.mark.slow
def test_eagle3_greedy_equals_no_speculation(guided_path, no_speculation, make_llm, tmp_path):
    """A random EAGLE-3 head: the drafts it proposes that the grammar allows are verified."""
    from tests.spec_decode.test_eagle import write_eagle3

    spec = {"method": "eagle3", "model": write_eagle3(tmp_path / "eagle3", tap_ids=[1, 0, 1]),
            "num_speculative_tokens": 3}
    got, stats = _run(make_llm, guided_path, _prompt_ids(), _requests(), spec)
    _assert_same(got[:3], no_speculation[:3])
    _check_valid(got, _requests())
    assert stats.spec_decode_num_drafts > 0


@pytest.mark.gpu
def test_cuda_greedy_equals_no_speculation(tmp_path, make_llm):
    """On CUDA in float32 (TRITON: head sizes of 64): the mask of every row read in place from
    pinned host memory by the sampler's kernel, a verify step's rows included."""
    path = _tiny(tmp_path / "target", 0, 128, 4, heads=2)
    _char_tokenizer().save_pretrained(path)
    kwargs = dict(device="cuda", engine_core_process=False)
    want, _ = _run(make_llm, path, _prompt_ids(), _requests(), None,
                   gpu_memory_utilization=0.05, **kwargs)
    got, stats = _run(make_llm, path, _prompt_ids(), _requests(), NGRAM,
                      gpu_memory_utilization=0.05, **kwargs)
    _check(got, want, stats)
