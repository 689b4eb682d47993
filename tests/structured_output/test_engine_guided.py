"""Guided decoding in the engine with the bundled SmolLM2 (CPU; float32 where tokens are
compared across batches): outputs of JSON schemas validate with jsonschema, regex and choice
outputs match, every sampled token is one a fresh xgrammar matcher accepts, n > 1,
preemption, unguided greedy outputs unchanged beside guided ones, logit_bias; and the bitmask
application against a naive float32 reference."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import GuidedDecodingParams
from pagedserve.structured_output import apply_token_bitmask
from pagedserve.structured_output.manager import StructuredOutputManager, allow_other_rows
from tests.structured_output.schemas import FAST, SCHEMAS
from tests.utils.paged import model_with_tokenizer, tiny_chat_model

PROMPT = "Answer with JSON only.\n"
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llm() -> LLM:
    # The CPU's default int8 weights (a quarter of float32's bytes per step, which bind on the
    # CPU): these tests check the form of what comes out, not exact tokens. The tests that
    # compare tokens across batches run float32 engines of their own.
    return LLM(model=None, kv_cache_memory="64MiB", max_num_seqs=64)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> dict[str, str]:
    """`LLM` arguments of a tiny random model with the bundled tokenizer, for the CPU cases
    that compare tokens across runs or preempt: the grammars bound what they let through, and
    SmolLM2's 30 layers took 25 s of their steps for the same paths."""
    return {"model": str(tiny_chat_model(tmp_path_factory.mktemp("tiny"), init_std=0.2))}


@pytest.fixture(scope="module")
def tiny_llm(tiny_model: dict[str, str]) -> LLM:
    """The tiny model's engine, for cases of schemas that bound every value (their JSON ends
    whatever the weights)."""
    return LLM(**tiny_model, kv_cache_memory="64MiB", max_num_seqs=64)


def _model_for(device: str, request: pytest.FixtureRequest) -> dict[str, str]:
    """The tiny model on the CPU, the bundled one (or its random twin) on CUDA."""
    return request.getfixturevalue("tiny_model") if device == "cpu" else model_with_tokenizer()


_COMPILERS: dict[int, xgr.GrammarCompiler] = {}


def _matcher_accepts_all(llm: LLM, guided: GuidedDecodingParams, token_ids: list[int]) -> bool:
    """A fresh matcher (compiled apart from the engine's) accepts the tokens, ending there."""
    vocab = llm.engine.runner.vocab_size
    if vocab not in _COMPILERS:
        info = xgr.TokenizerInfo.from_huggingface(llm.get_tokenizer(), vocab_size=vocab)
        _COMPILERS[vocab] = xgr.GrammarCompiler(info)
    matcher = xgr.GrammarMatcher(_COMPILERS[vocab].compile_grammar(_reference_grammar(guided)))
    return all(matcher.accept_token(t) for t in token_ids) and matcher.is_terminated()


def _reference_grammar(guided: GuidedDecodingParams) -> xgr.Grammar:
    if guided.json is not None:
        return xgr.Grammar.from_json_schema(json.dumps(guided.json), any_whitespace=False)
    if guided.regex is not None:
        return xgr.Grammar.from_regex(guided.regex)
    raise AssertionError("not used here")


def _generate_schemas(llm: LLM, names: list[str], samples: int) -> None:
    params, expected = [], []
    for name in names:
        guided = GuidedDecodingParams(json=SCHEMAS[name])
        for i in range(samples):
            params.append(SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=MAX_TOKENS,
                                         guided_decoding=guided))
            expected.append(name)
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for name, p, out in zip(expected, params, outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name])
        assert _matcher_accepts_all(llm, p.guided_decoding, c.token_ids), (name, c.text)


def test_json_schemas_fast(tiny_llm: LLM) -> None:
    _generate_schemas(tiny_llm, FAST, samples=2)


@pytest.mark.slow
def test_json_schemas_all(llm: LLM) -> None:
    _generate_schemas(llm, list(SCHEMAS), samples=5)


def test_regex_choice_json_object(llm: LLM) -> None:
    regex = r"[A-Z][a-z]{2,5} [0-9]{1,3}"
    choices = ["Paris", "London", "New York", "a \"quoted\" one"]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=40,
                             guided_decoding=GuidedDecodingParams(regex=regex)) for i in range(3)]
    params += [SamplingParams(temperature=0.8, seed=i, max_tokens=40,
                              guided_decoding=GuidedDecodingParams(choice=choices))
               for i in range(3)]
    params += [SamplingParams(temperature=0.8, seed=i, max_tokens=120,
                              guided_decoding=GuidedDecodingParams(json_object=True))
               for i in range(2)]
    outs = llm.generate(["The capital of France is"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(re.fullmatch(regex, t) for t in texts[:3]), texts[:3]
    assert all(t in choices for t in texts[3:6]), texts[3:6]
    for out in outs[6:]:
        if out.outputs[0].finish_reason == "stop":  # an unbounded object may hit the limit
            assert isinstance(json.loads(out.outputs[0].text), dict)
        else:
            assert out.outputs[0].text.startswith("{")


def test_n_sequences_each_follow_the_grammar(tiny_llm: LLM) -> None:
    schema = SCHEMAS["weather_call"]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                            guided_decoding=GuidedDecodingParams(json=schema))
    out = tiny_llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("device, every_row, workers", [
    ("cpu", False, 0), pytest.param("cpu", True, 0, marks=pytest.mark.slow), ("cpu", True, 1),
    pytest.param("cuda", None, None, marks=pytest.mark.gpu)])
def test_unguided_greedy_unchanged_beside_guided(device, every_row, workers, monkeypatch,
                                                 request) -> None:
    """Greedy tokens of requests without a grammar are those they get alone. The guided
    requests come first and two of them end early, so the batch's rows move: a row that held a
    grammar's mask holds an unguided request's next. `every_row`: the mask covers every row
    (the other rows allowing every token: CUDA's way, forced here on the CPU) or only the
    grammars' rows (the CPU's); None: the device's own way. With grammar workers the steps are
    async (as on CUDA), so decode steps of the same requests repeat the workers' task."""
    if every_row is not None:
        monkeypatch.setattr(StructuredOutputManager, "_masks_every_row",
                            property(lambda self: every_row))
    # float32: greedy tokens do not depend on how requests are batched.
    llm = LLM(**_model_for(device, request), dtype="float32", device=device,
              kv_cache_memory="16MiB",
              gpu_memory_utilization=0.2, guided_decoding_workers=workers,
              async_scheduling=True if workers else None)
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    guided = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens,
                             guided_decoding=GuidedDecodingParams(json=SCHEMAS[name]))
              for i, (name, max_tokens) in enumerate(zip(FAST[:3], (4, 5, 20), strict=True))]
    with llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        mixed = llm.generate([PROMPT] * len(guided) + prompts, guided + [greedy] * 3,
                             use_tqdm=False)
        if workers:
            assert llm.engine.structured_output.num_repeats > 0
    assert [o.outputs[0].token_ids for o in mixed[3:]] == alone
    assert [len(o.outputs[0].token_ids) for o in mixed] == [4, 5, 20, 16, 16, 16]


def test_allow_other_rows_keeps_its_marks() -> None:
    """Random steps over two reused buffers: after each, the rows without a grammar allow every
    token and the grammars' rows are what their fill wrote, whatever the buffer held."""
    rng = np.random.default_rng(0)
    masks = [rng.integers(-2**31, 2**31 - 1, (8, 3), dtype=np.int32) for _ in range(2)]
    marks = [np.zeros(8, dtype=bool) for _ in range(2)]
    for step in range(200):
        buffer, num_rows = step % 2, int(rng.integers(1, 9))
        rows = sorted(rng.choice(num_rows, int(rng.integers(0, num_rows + 1)), replace=False))
        allow_other_rows(masks[buffer], marks[buffer], list(rows), num_rows)
        filled = rng.integers(-2**31, 2**31 - 1, (len(rows), 3), dtype=np.int32)
        masks[buffer][rows] = filled  # the fill
        other = np.setdiff1d(np.arange(num_rows), rows)
        assert (masks[buffer][other] == -1).all()
        assert (masks[buffer][rows] == filled).all()


def test_guided_through_preemption(tiny_model: dict[str, str]) -> None:
    # 20 blocks of 4 tokens for 8 requests of ~10 prompt tokens growing by up to 60: the
    # scheduler must preempt (recompute), and the matchers must follow the tokens kept. The
    # tiny model's arrays (21 to 40 tokens) preempt too, in a quarter of SmolLM2's 5 s.
    llm = LLM(**tiny_model, kv_cache_memory="16MiB", block_size=4, num_gpu_blocks_override=40,
              max_num_seqs=8)
    schema = SCHEMAS["array_of_objects"]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=60,
                             guided_decoding=GuidedDecodingParams(json=schema))
              for i in range(8)]
    outs = llm.generate([PROMPT] * 8, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, out in zip(params, outs, strict=True):
        c = out.outputs[0]
        assert _matcher_accepts_all(llm, p.guided_decoding, c.token_ids), c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_ignore_eos_still_ends_with_the_grammar(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    c = llm.generate("Is water wet?", params, use_tqdm=False)[0].outputs[0]
    assert c.text in ("yes", "no") and c.finish_reason == "stop"


def test_logit_bias(llm: LLM) -> None:
    prompt = "The capital of France is"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    forced = 1234
    up = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                        logit_bias={forced: 100})
    assert llm.generate(prompt, up, use_tqdm=False)[0].outputs[0].token_ids == [forced] * 4
    down = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                          logit_bias={str(plain[0]): -100})  # JSON-style string keys too
    assert llm.generate(prompt, down, use_tqdm=False)[0].outputs[0].token_ids[0] != plain[0]
    for bad in ({1: 101}, {-1: 1.0}, {"x": 1.0}, {1: float("nan")}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="vocabulary size"):
        llm.engine.check_sampling(SamplingParams(logit_bias={10**6: 1.0}))


@pytest.mark.parametrize("bad, what", [
    ({"json": {"type": "strnig"}}, "invalid JSON schema"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
     "invalid JSON schema"),
    ({"regex": "[a-"}, "invalid regex"),
    ({"grammar": "root ::= undefined_rule"}, "invalid EBNF grammar"),
    ({"choice": []}, "non-empty list"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({}, "exactly one"),
])
def test_bad_specs_are_value_errors(bad: dict, what: str) -> None:
    with pytest.raises(ValueError, match=re.escape(what)):
        SamplingParams(guided_decoding=GuidedDecodingParams(**bad))


def test_bitmask_application_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    batch, vocab = 5, 1000
    logits = torch.randn(batch, vocab, generator=g)
    allowed = torch.rand(batch, vocab, generator=g) < 0.3
    # Pack the allowed bits the way xgrammar reads them: bit j of word k is token 32k + j.
    words = -(-vocab // 32)
    padded = torch.zeros(batch, words * 32, dtype=torch.bool)
    padded[:, :vocab] = allowed
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    packed = (padded.view(batch, words, 32).long() * weights).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    rows = [0, 2, 3]
    out = logits.clone()
    apply_token_bitmask(out, bitmask, rows)
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(~allowed[rows], float("-inf"))
    assert torch.equal(out, expected)


def test_rollback_matches_a_fresh_matcher(llm: LLM) -> None:
    manager = llm.engine.structured_output
    guided = GuidedDecodingParams(json=SCHEMAS["flat_required"])
    tokens = llm.get_tokenizer().encode('{"name": "Ann", "age": 7}', add_special_tokens=False)
    grammar = manager.new_grammar(guided, frozenset({2}))
    assert all(grammar.accept(t) for t in tokens)
    grammar.rollback_to(3)
    fresh = manager.new_grammar(guided, frozenset({2}))
    assert all(fresh.accept(t) for t in tokens[:3])
    a = manager.finish_fill(manager.start_fill([grammar], [0], 1)).clone()
    b = manager.finish_fill(manager.start_fill([fresh], [0], 1)).clone()
    assert torch.equal(a, b) and grammar.num_accepted == 3


def _mixed_batch(device: str, async_scheduling: bool, model: dict[str, str]
                 ) -> list[list[int]]:
    # On CUDA the cache is sized by gpu_memory_utilization (kv_cache_memory is the CPU's), and
    # the two runs of the comparison share the process.
    llm = LLM(**model, dtype="float32", device=device,
              kv_cache_memory="64MiB", gpu_memory_utilization=0.2,
              async_scheduling=async_scheduling)
    regex = r"[A-Z][a-z]{2,5} [0-9]{1,3}"
    prompts = ["The capital of France is", "Once upon a time", PROMPT, PROMPT]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),  # outlives
              SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=0, max_tokens=MAX_TOKENS,
                             guided_decoding=GuidedDecodingParams(json=SCHEMAS["flat_required"])),
              SamplingParams(temperature=0.8, seed=1, max_tokens=MAX_TOKENS,
                             guided_decoding=GuidedDecodingParams(regex=regex))]
    with llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    jsonschema.validate(json.loads(outs[2].outputs[0].text), SCHEMAS["flat_required"])
    assert re.fullmatch(regex, outs[3].outputs[0].text)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_async_scheduling_with_guided_requests(device: str, request) -> None:
    """Guided requests keep async scheduling on: the runner advances their matchers by the
    in-flight step's samples before it fills the next step's bitmask. Every output equals the
    step-by-step run's (the CPU runs the async code paths without overlap; on CUDA the bitmask
    goes through pinned memory and Triton/CUDA)."""
    model = _model_for(device, request)
    assert _mixed_batch(device, True, model) == _mixed_batch(device, False, model)


def test_guided_requests_do_not_force_synchronous_steps() -> None:
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert not params.needs_host_history
    assert SamplingParams(repetition_penalty=1.2).needs_host_history


def test_backend_choice() -> None:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.settings_checks import check_settings
    from pagedserve.structured_output import check_backend

    check_backend("xgrammar")
    assert check_settings(EngineConfig.from_kwargs(guided_decoding_backend="guidance",
                                                   device="cpu")) is None
    with pytest.raises(ValueError, match="one of xgrammar, guidance"):
        check_backend("outlines")


def test_core_decodes_guided_requests_without_parsing_them_again(monkeypatch):
    """msgspec runs __post_init__ on what it decodes: the engine core's input thread decodes
    the front's requests with their specs taken as parsed (parsing a schema again held the
    core's GIL ~1.7 ms a request); anywhere else a spec is parsed when made."""
    from pagedserve.engine.core_messages import CoreRequest
    from pagedserve.engine.core_process import CoreInput, decoder, encoder
    from pagedserve.sampling_params import specs_parsed_by_sender
    from pagedserve.structured_output import grammar

    spec = GuidedDecodingParams(json=SCHEMAS["flat_required"])
    request = CoreRequest("r", [1, 2, 3], SamplingParams(guided_decoding=spec), 0.0)
    data = encoder().encode(CoreInput(adds=[[request]]))
    parsed = []
    monkeypatch.setattr(grammar, "parse_grammar", parsed.append)
    with specs_parsed_by_sender():
        got = decoder(CoreInput).decode(data).adds[0][0].params.guided_decoding
    assert parsed == [] and got.key == spec.key and got.kind == "json"
    decoder(CoreInput).decode(data)
    assert parsed == [spec.key]


def test_an_xgrammar_matcher_is_asked_if_it_ended_only_after_a_stop_token() -> None:
    """RequestGrammar skips the library's is_terminated after tokens that cannot end an
    xgrammar matcher, and still sees the end on its stop token."""
    from pagedserve.structured_output.manager import RequestGrammar

    class Matcher:  # an xgrammar-like matcher that ends on its stop token 2
        stop_token_ids = [2]

        def __init__(self) -> None:
            self.asked = 0
            self.ended = False

        def accept_token(self, token: int) -> bool:
            self.ended = token == 2
            return True

        def is_terminated(self) -> bool:
            self.asked += 1
            return self.ended

    matcher = Matcher()
    grammar = RequestGrammar(matcher)
    asked = matcher.asked  # once, at the start
    for token in (5, 7, 9):
        assert grammar.accept(token) and not grammar.is_terminated
    assert matcher.asked == asked
    assert grammar.accept(2) and grammar.is_terminated
    # llguidance's matchers may end on any token: asked every time.
    other = Matcher()
    grammar = RequestGrammar(other, ends_on_stop_token=False)
    grammar.accept(5)
    assert other.asked == 2
