"""A proposer's one-token draft steps through the decode-graph path (spec_decode/draft_graphs.py):
padded to a captured row count, on the graph-mode metadata, read from the proposer's own
persistent input buffers. Without CUDA the padded path runs eagerly (`setup_graphs(capture=
False)`); on CUDA real graphs are captured and replayed. At every proposal the padded drafts
equal those of the eager steps over the same state, the engine's outputs equal those without
speculation, and the acceptance equals the eager path's."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import SamplingParams
from tests.spec_decode.test_eagle import write_eagle3
from tests.spec_decode.test_engine import _assert_same, _prompts, _run, _tiny

# Few blocks, so block 0 (what padding rows read) belongs to a live request.
SMALL_CACHE = dict(num_gpu_blocks_override=48, block_size=4, kv_cache_memory=None,
                   max_num_seqs=8)


def _proposer_class(method: str):
    from pagedserve.spec_decode.draft_model import DraftModelProposer
    from pagedserve.spec_decode.eagle import EagleProposer

    return DraftModelProposer if method == "draft_model" else EagleProposer


def _install(monkeypatch, method: str, capture: bool, sizes: list[int] | None = None) -> list:
    """Engines built from here on set up their proposer's draft graphs with `capture` (off:
    the padded path run eagerly), of `sizes` when given; returns the list of them."""
    cls = _proposer_class(method)
    setup = cls.setup_graphs
    made = []

    def install(self, runner, capture_=True):
        setup(self, runner, capture)
        if sizes is not None:
            self.graphs.decode.sizes = sizes
        made.append(self.graphs)

    monkeypatch.setattr(cls, "setup_graphs", install)
    return made


def _check_against_eager(monkeypatch, method: str) -> dict:
    """At each proposal: the eager steps' drafts first (the graphs set aside), then the padded
    ones over the same state (their K/V writes are the same values): both must agree. Returns
    the number of proposals and of replayed draft steps."""
    cls = _proposer_class(method)
    propose = cls.propose_from
    seen = {"calls": 0, "replays": 0}

    def spy(self, runner, step):
        graphs, self.graphs = self.graphs, None
        eager = propose(self, runner, step)
        self.graphs = graphs
        before = graphs.replays if graphs is not None else 0
        padded = propose(self, runner, step)
        rows = range(len(step.rows))
        assert [padded.row(i) for i in rows] == [eager.row(i) for i in rows]
        seen["calls"] += 1
        seen["replays"] += (graphs.replays if graphs is not None else 0) - before
        return padded

    monkeypatch.setattr(cls, "propose_from", spy)
    return seen


def _spec(method: str, tmp_path_factory, k: int = 3) -> tuple[str, dict]:
    """A target, and the speculative config of a draft model or an EAGLE-3 head for it."""
    root = tmp_path_factory.mktemp(f"draft_graphs_{method}")
    if method == "draft_model":
        return _tiny(root / "target", 0, 32, 2), {
            "method": method, "model": _tiny(root / "draft", 3, 16, 1),
            "num_speculative_tokens": k}
    return _tiny(root / "target", 0, 32, 2), {
        "method": "eagle3", "model": write_eagle3(root / "head", tap_ids=[1, 0, 1]),
        "num_speculative_tokens": k}


def triton_spec(method: str, tmp_path) -> tuple[str, dict]:
    """A target with head sizes of 64 (TRITON's smallest) and the speculative config (K=2) of
    itself as the draft model or of a random EAGLE-3 head, which taps three of its layers."""
    from pagedserve.spec_decode.random_head import write_random_eagle3_head

    target = _tiny(tmp_path / "target", 0, 128, 1 if method == "draft_model" else 4, heads=2)
    model = (target if method == "draft_model" else write_random_eagle3_head(
        tmp_path / "head", transformers.AutoConfig.from_pretrained(target), 60,
        dtype=torch.float32))
    return target, {"method": method, "model": model, "num_speculative_tokens": 2}


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_padded_draft_steps_equal_eager_ones(tmp_path_factory, make_llm, monkeypatch, method):
    """CPU backend: drafts, outputs and acceptance through the padded path (rows padded up to
    8, the largest size here) against the eager path and no speculation."""
    target, spec = _spec(method, tmp_path_factory)
    prompts, params = _prompts(), SamplingParams(temperature=0, max_tokens=12,
                                                 ignore_eos=True, logprobs=1)
    want, _ = _run(make_llm, target, prompts, params, None, **SMALL_CACHE)
    _, eager_stats = _run(make_llm, target, prompts, params, spec, **SMALL_CACHE)
    made = _install(monkeypatch, method, capture=False)
    seen = _check_against_eager(monkeypatch, method)
    got, stats = _run(make_llm, target, prompts, params, spec, **SMALL_CACHE)
    _assert_same(got, want)
    assert len(made) == 1 and seen["calls"] > 0 and seen["replays"] > 0
    assert max(made[0].decode.replays) == 8 and min(made[0].decode.replays) < 8
    assert stats.spec_decode_num_drafts == eager_stats.spec_decode_num_drafts
    assert (stats.spec_decode_num_accepted_tokens
            == eager_stats.spec_decode_num_accepted_tokens)
    assert stats.spec_decode_num_draft_tokens == eager_stats.spec_decode_num_draft_tokens > 0
    if method == "draft_model":  # (a random EAGLE-3 head's drafts are all rejected)
        assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    else:  # its catch-up passes over uniform verify steps padded too
        assert sum(made[0].decode.verify.replays.values()) > 0


def test_padded_catch_up_keeps_the_eager_drafts(tmp_path_factory, make_llm, monkeypatch):
    """An EAGLE-3 head's catch-up pass after uniform verify steps, over all 1+K positions of
    each request (padded to 2, 4 or 8 requests), gives the eager pass's drafts at every
    proposal, with each request keeping 0 to K drafts (synthetic acceptance: the head's
    drafts would all be rejected), so the first draft comes from every position."""
    target, spec = _spec("eagle3", tmp_path_factory)
    spec |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.6}
    made = _install(monkeypatch, "eagle3", capture=False)
    seen = _check_against_eager(monkeypatch, "eagle3")
    kept = []
    from pagedserve.spec_decode.eagle import EagleProposer

    uniform = EagleProposer._catch_up_uniform
    monkeypatch.setattr(EagleProposer, "_catch_up_uniform", lambda self, runner, step, c, m,
                        copied: kept.extend(m.tolist()) or uniform(self, runner, step, c, m,
                                                                    copied))
    prompts = _prompts()[:5]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    _run(make_llm, target, prompts, params, spec, **SMALL_CACHE)
    assert seen["calls"] > 0 and sum(made[0].decode.verify.replays.values()) > 0
    assert set(kept) == {1, 2, 3, 4}  # m: kept drafts + 1, each case seen


@pytest.mark.parametrize("method", ["draft_model",
                                    pytest.param("eagle3", marks=pytest.mark.slow)])
def test_padded_draft_steps_in_the_triton_interpreter(tmp_path, make_llm, monkeypatch, method):
    """TRITON's kernels (the interpreter) over padded draft steps; head sizes of 64."""
    pytest.importorskip("triton")
    target, spec = triton_spec(method, tmp_path)
    prompts, params = _prompts()[:3], SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True)
    want, _ = _run(make_llm, target, prompts, params, None, attention_backend="TRITON")
    _install(monkeypatch, method, capture=False)
    seen = _check_against_eager(monkeypatch, method)
    got, stats = _run(make_llm, target, prompts, params, spec, attention_backend="TRITON")
    _assert_same(got, want)
    assert seen["replays"] > 0 and stats.spec_decode_num_draft_tokens > 0


def test_rows_past_the_largest_size_run_eagerly(tmp_path_factory, make_llm, monkeypatch):
    """With 2 as the only size, draft steps of more live rows are not replayed but run
    eagerly; those of 1 or 2 rows are padded to 2."""
    from pagedserve.spec_decode.draft_graphs import DraftGraphs

    target, spec = _spec("draft_model", tmp_path_factory)
    _install(monkeypatch, "draft_model", capture=False, sizes=[2])
    seen = _check_against_eager(monkeypatch, "draft_model")
    prepare = DraftGraphs.prepare
    sizes = []  # (live rows, the size replayed or None)
    monkeypatch.setattr(DraftGraphs, "prepare", lambda self, common: sizes.append(
        (common.num_reqs, prepare(self, common))) or sizes[-1][1])
    prompts = _prompts()[:6]  # finishing one after another: 6 live rows down to 1
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (2, 4, 6, 8, 10, 12)]
    want, _ = _run(make_llm, target, prompts, params, None, **SMALL_CACHE)
    got, _ = _run(make_llm, target, prompts, params, spec, **SMALL_CACHE)
    _assert_same(got, want)
    assert {size for n, size in sizes if n <= 2} == {2}
    assert {size for n, size in sizes if n > 2} == {None}
    assert seen["replays"] == sum(n <= 2 for n, _ in sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_cuda_draft_graphs_replay_the_eager_drafts(tmp_path_factory, make_llm, monkeypatch,
                                                   method):
    """On CUDA (TRITON, float32): the draft steps' graphs are captured and checked at start-up
    and replayed; every proposal's drafts equal the eager steps' over the same state, and the
    outputs those without speculation."""
    from pagedserve.spec_decode.draft_graphs import DraftGraphs
    from pagedserve.spec_decode.random_head import write_random_eagle3_head

    root = tmp_path_factory.mktemp(f"cuda_draft_graphs_{method}")
    target = _tiny(root / "target", 0, 128, 4, heads=2)  # TRITON's head sizes start at 64
    model = (target if method == "draft_model" else write_random_eagle3_head(
        root / "head", transformers.AutoConfig.from_pretrained(target), 60,
        dtype=torch.float32))
    spec = {"method": method, "model": model, "num_speculative_tokens": 3}
    captured = _install(monkeypatch, method, capture=True)
    kwargs = dict(device="cuda", attention_backend="TRITON", engine_core_process=False,
                  max_num_seqs=8)
    prompts, params = _prompts(), SamplingParams(temperature=0, max_tokens=16,
                                                 ignore_eos=True)
    want, _ = _run(make_llm, target, prompts, params, None, gpu_memory_utilization=0.05,
                   enforce_eager=True, **kwargs)
    seen = _check_against_eager(monkeypatch, method)
    got, stats = _run(make_llm, target, prompts, params, spec, gpu_memory_utilization=0.05,
                      **kwargs)
    _assert_same(got, want)
    assert len(captured) == 1 and isinstance(captured[0], DraftGraphs)
    assert captured[0].decode.graphs.keys() == set(captured[0].sizes)
    assert captured[0].decode.head is not None  # the greedy ids come from the head graphs
    assert seen["calls"] > 0 and seen["replays"] > 0
    assert stats.spec_decode_num_draft_tokens > 0
    if method == "eagle3":  # its catch-up passes after uniform verify steps: graphs too
        catch_up = captured[0].decode.verify
        assert catch_up is not None and sum(catch_up.replays.values()) > 0
