"""Speculative decoding under tensor parallelism on the CPU (gloo, float32, two ranks): every
rank verifies the scheduler's drafts and keeps rank 0's accepted tokens. Greedy outputs with
n-gram drafts at two ranks equal one rank's without speculation token for token, with drafts
both kept and rejected; seeded sampling with drafts reproduces one rank's; a draft model and
EAGLE heads split like the target likewise, with the same drafts as one rank's; what cannot
run split is refused by name."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams

VOCAB = 97
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory="8MiB", max_model_len=128)


def _tiny(path, seed: int, hidden: int, layers: int, tied: bool = False) -> str:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return _tiny(tmp_path_factory.mktemp("tp_spec_target"), 0, 32, 2)


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so that lookups find matches."""
    g = torch.Generator().manual_seed(1)
    out = []
    for length, repeats in ((5, 4), (9, 2), (3, 6), (6, 3), (2, 9), (17, 1)):
        out.append(torch.randint(3, VOCAB, (length,), generator=g).tolist() * repeats)
    return out


GREEDY = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 7, 24)]
SEEDED = [SamplingParams(temperature=t, top_k=k, top_p=0.9, seed=s, max_tokens=20,
                         ignore_eos=True) for s, (t, k) in enumerate([(0.5, 5), (1.0, 0),
                                                                      (0.3, 20)])]


def _generate(path: str, spec, params, tp: int = 1, prompts=None, **kwargs):
    llm = LLM(model=path, tensor_parallel_size=tp, speculative_config=spec, **ENGINE, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts or _prompts()], params,
                            use_tqdm=False)
        assert llm.engine.check_blocks_free()
        return [o.outputs[0].token_ids for o in outs], llm.engine.call_utility("stats")
    finally:
        llm.engine.shutdown()
        _no_workers_left()


def _no_workers_left() -> None:
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


def _kept_and_rejected(stats) -> None:
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    """One rank's greedy tokens without speculation."""
    return _generate(target, None, GREEDY * 2)[0][:3]


def _two_ranks_equal_one(target: str, plain: list[list[int]], spec: dict,
                         drafts: list | None = None) -> None:
    """Greedy requests (against one rank without drafts) beside seeded ones (against one rank
    with the same drafts: a seeded request's draws follow its drafts) in one batch; the same
    drafts proposed and kept as at one rank."""
    params = GREEDY + SEEDED
    one, one_stats = _generate(target, spec, params)
    one_drafts = list(drafts or [])
    if drafts is not None:
        drafts.clear()
    two, stats = _generate(target, spec, params, tp=2)
    assert two[:3] == plain and two[3:] == one[3:]
    assert one[:3] == plain
    if drafts is None:
        _kept_and_rejected(stats)
    else:  # (a random head's drafts are rarely the target's choice): rank 0's drafts
        assert one_drafts and sorted(drafts) == sorted(one_drafts)
    assert ((stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
            == (one_stats.spec_decode_num_draft_tokens, one_stats.spec_decode_num_accepted_tokens))


# The draft model's case covers the verify step at two ranks; n-gram adds only its proposer.
@pytest.mark.slow
def test_ngram_two_ranks_equal_one_rank(target, plain):
    _two_ranks_equal_one(target, plain, NGRAM)


def test_draft_model_two_ranks_equal_one_rank(target, plain, tmp_path):
    """A draft model of other weights and sizes, loaded split like the target on each rank
    (its K/V in each rank's cache, its steps' collectives beside the target's)."""
    draft = _tiny(tmp_path / "draft", 3, 16, 1)
    _two_ranks_equal_one(target, plain, {"method": "draft_model", "model": draft,
                                         "num_speculative_tokens": 3})


@pytest.mark.slow
def test_whole_draft_on_every_rank(target, plain, tmp_path, monkeypatch):
    """draft_tensor_parallel_size 1 beside a split target: the whole draft (tied embedding and
    head, whose logits then need no gather) on every rank, no collectives in its steps; rank 0
    proposes what one rank does."""
    from pagedserve.spec_decode.draft_model import DraftModelProposer

    seen, propose = [], DraftModelProposer.propose_from

    def spy(self, runner, step):
        assert self.model.model.embed_tokens.weight.shape[0] == VOCAB  # not a rank's rows
        drafts = propose(self, runner, step)
        seen.extend((int(step.num_tokens[i]), int(step.newest[i]), drafts.row(i))
                    for i in range(len(step.rows)) if drafts.counts[i])
        return drafts

    monkeypatch.setattr(DraftModelProposer, "propose_from", spy)
    draft = _tiny(tmp_path / "draft", 3, 16, 1, tied=True)
    _two_ranks_equal_one(target, plain, {"method": "draft_model", "model": draft,
                                         "num_speculative_tokens": 3,
                                         "draft_tensor_parallel_size": 1}, seen)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_eagle_head_two_ranks_equal_one_rank(target, plain, tmp_path, monkeypatch, method):
    """An EAGLE head's decoder layer split like the target's (fc, norms, lm_head whole):
    the same drafts as at one rank (tests/spec_decode/test_eagle.py checks them against the
    published forward)."""
    from tests.spec_decode.test_eagle import _record_drafts, write_eagle1, write_eagle3

    head = (write_eagle3(tmp_path / "head", tap_ids=[1, 0, 1]) if method == "eagle3"
            else write_eagle1(tmp_path / "head"))
    _two_ranks_equal_one(target, plain, {"method": method, "model": head,
                                         "num_speculative_tokens": 3},
                         _record_drafts(monkeypatch))


# DeepSeek's is slow (50 s here): its target's split is tests/distributed/
# test_deepseek_tensor_parallel.py, a head's split the Qwen3-Next case.
@pytest.mark.parametrize("family", ["qwen3_next",
                                    pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_mtp_layer_two_ranks_equal_one_rank(tmp_path, monkeypatch, family):
    """An MTP layer split like its target: Qwen3-Next's block (q/k/v heads and experts per
    rank; fc and norms whole; the target's split embedding and head) and DeepSeek-V3's layer
    (latent attention by heads, experts per rank; enorm, hnorm, eh_proj whole; the embedding
    read from the checkpoint, its own head split). Greedy tokens equal one rank's without
    speculation, rank 0 proposes the very drafts one rank does, as many kept.
    (tests/spec_decode/test_qwen3_next_mtp.py and test_mtp.py check one rank's drafts against
    the published forward.)"""
    import importlib

    from tests.spec_decode.test_eagle import _record_drafts
    from tests.spec_decode.test_state_layers import prompts

    module = importlib.import_module("tests.spec_decode." + {
        "qwen3_next": "test_qwen3_next_mtp", "deepseek_v3": "test_mtp"}[family])
    module.write_target_with_mtp(tmp_path)
    if family == "deepseek_v3":  # its embedding from the target's checkpoint tensor
        from safetensors.torch import load_file, save_file

        state = load_file(tmp_path / "model.safetensors")
        del state["model.layers.2.embed_tokens.weight"]
        save_file(state, str(tmp_path / "model.safetensors"))
    MTP = module.MTP
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 17, 6)]
    run = lambda spec, tp=1: _generate(str(tmp_path), spec, params, tp,  # noqa: E731
                                       prompts()[:3])
    plain, _ = run(None)
    drafts = _record_drafts(monkeypatch)
    one, one_stats = run(MTP)
    one_drafts = list(drafts)
    drafts.clear()
    two, stats = run(MTP, tp=2)
    assert one == plain and two == plain
    assert one_drafts and sorted(drafts) == sorted(one_drafts)
    # (DeepSeek's random layer drafts what the target never picks: all rejected.)
    assert stats.spec_decode_num_accepted_tokens > 0 or family == "deepseek_v3"
    assert ((stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
            == (one_stats.spec_decode_num_draft_tokens, one_stats.spec_decode_num_accepted_tokens))


@pytest.mark.slow
def test_guided_requests_with_drafts_at_two_ranks(tmp_path):
    """Rank 0 alone masks each draft position (the other ranks' requests have no matchers):
    a JSON schema and a choice beside a plain request, drafted by the target itself (every
    draft the grammar allows is kept), give one rank's tokens without speculation."""
    import json

    from tests.distributed.test_tensor_parallel import guided_params
    from tests.utils.paged import tiny_chat_model

    model = str(tiny_chat_model(tmp_path / "tiny", init_std=0.2))
    params = guided_params(plain_tokens=30)
    outputs, stats = {}, None
    for tp, spec in ((1, None), (2, {"method": "draft_model", "model": model,
                                     "num_speculative_tokens": 3})):
        llm = LLM(model=model, dtype="float32", kv_cache_memory="16MiB", max_model_len=128,
                  tensor_parallel_size=tp, speculative_config=spec)
        try:
            outs = llm.generate(["Answer:"] * 3, params, use_tqdm=False)
            outputs[tp] = [o.outputs[0].token_ids for o in outs]
            stats = llm.engine.call_utility("stats")
            assert llm.engine.check_blocks_free()
        finally:
            llm.engine.shutdown()
    assert outputs[2] == outputs[1]
    assert set(json.loads(outs[0].outputs[0].text)) == {"ok", "n"}
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    _no_workers_left()


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle3", "model": "unused", "num_speculative_tokens": 2,
      "draft_tensor_parallel_size": 1},
     "draft_tensor_parallel_size 1 with method 'eagle3' and tensor_parallel_size 2 is not"),
    ({"method": "draft_model", "model": "unused", "num_speculative_tokens": 2,
      "draft_tensor_parallel_size": 4},
     r"draft_tensor_parallel_size 4 .* \(the target's size, or 1 for a whole draft"),
])
def test_refused_before_any_rank_starts(target, spec, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=target, tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    assert not multiprocessing.active_children()


def test_guided_request_async_steps_with_a_draft_model_at_two_ranks(tmp_path, monkeypatch):
    """Async scheduling while drafts are off (disable_by_batch_size) with a guided request in
    the batch: rank 0 records a step's samples inside the next launch (its mask needs them),
    but proposes at collect as every other rank does, so the draft model's collectives meet
    (they met the next step's broadcast before: a hang). One rank's tokens without drafts."""
    from pagedserve.sampling_params import GuidedDecodingParams
    from tests.utils.paged import tiny_chat_model

    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", "30")
    model = str(tiny_chat_model(tmp_path / "tiny", init_std=0.2))
    params = [SamplingParams(temperature=0, max_tokens=8,
                             guided_decoding=GuidedDecodingParams(choice=["left", "right"]))]
    params += [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2
    outputs = {}
    for tp, spec in ((1, None), (2, {"method": "draft_model", "model": model,
                                     "num_speculative_tokens": 3, "disable_by_batch_size": 2})):
        llm = LLM(model=model, dtype="float32", kv_cache_memory="16MiB", max_model_len=128,
                  tensor_parallel_size=tp, speculative_config=spec, async_scheduling=True)
        try:
            outs = llm.generate(["Answer:"] * 3, params, use_tqdm=False)
            outputs[tp] = [o.outputs[0].token_ids for o in outs]
        finally:
            llm.engine.shutdown()
    assert outputs[2] == outputs[1]
    _no_workers_left()
