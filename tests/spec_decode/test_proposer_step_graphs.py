"""The target's decode and verify steps through the graph path with a proposer that keeps K/V
of its own (spec_decode/step_graphs.py): the graphed forward also runs the draft model over
the step's padded tokens (its K/V) or copies what a head captures into a persistent buffer.
Without CUDA the padded path runs eagerly (`DecodeGraphs(capture=False)`); on CUDA real graphs
are captured and replayed. Outputs equal those without speculation, and every proposal's
drafts (which a wrong captured buffer or draft K/V would change, the outputs not) equal the
fully eager engine's."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import SamplingParams
from pagedserve.engine import runner_warmup
from pagedserve.engine.cuda_graphs import DecodeGraphs
from pagedserve.spec_decode.speculator import Speculator
from pagedserve.spec_decode.step_graphs import ProposerStep
from tests.spec_decode.test_draft_graphs import _spec, triton_spec
from tests.spec_decode.test_engine import _assert_same, _prompts, _run, _tiny

K = 3


def _padded_target_steps(monkeypatch, check: bool = True) -> list[DecodeGraphs]:
    """Engines built from here on get the target's decode graphs of sizes 1, 2, 4, 8 and
    verify graphs (q = 1+K) of 2, 4, 8 (at most max_num_seqs), run eagerly on the padded
    metadata, each through its start-up check first (`check`); returns the list of them."""
    made = []

    def setup(inputs, backend, config, max_model_len):
        sizes = [s for s in (1, 2, 4, 8) if s <= config.scheduler.max_num_seqs]
        q = 1 + config.speculative.num_speculative_tokens
        verify = DecodeGraphs(inputs, sizes[1:], capture=False, query_len=q)
        graphs = DecodeGraphs(inputs, sizes, capture=False, verify=verify)
        if check:
            graphs.check_against_eager()
            verify.check_against_eager()
        made.append(graphs)
        return graphs

    monkeypatch.setattr(runner_warmup, "setup_decode_graphs", setup)
    monkeypatch.setattr(runner_warmup, "setup_verify_graphs", lambda *args: None)
    return made


def _record_drafts(monkeypatch) -> list:
    """Every proposal's drafts, row by row, in order."""
    seen = []
    propose = Speculator.propose

    def spy(self, *args, **kwargs):
        drafts = propose(self, *args, **kwargs)
        seen.append([drafts.row(i) for i in range(len(drafts.counts))])
        return drafts

    monkeypatch.setattr(Speculator, "propose", spy)
    return seen


def _mtp_spec(tmp_path_factory) -> tuple[str, dict]:
    from tests.spec_decode.test_mtp import write_target_with_mtp

    path = tmp_path_factory.mktemp("step_graphs_mtp")
    write_target_with_mtp(path)
    return str(path), {"method": "mtp", "num_speculative_tokens": K}


@pytest.mark.parametrize("method", ["draft_model", "eagle3",
                                    pytest.param("mtp", marks=pytest.mark.slow)])
def test_padded_target_steps_with_a_proposer(tmp_path_factory, make_llm, monkeypatch, method):
    """CPU backend: every request of a step has K drafts (a draft per step, no cut), so its
    verify steps are uniform and pad to 4 or 8; decode steps (the first after the prompts)
    pad too. Outputs equal no speculation, and each proposal's drafts and the acceptance equal
    those of the engine without the graph path."""
    target, spec = (_mtp_spec(tmp_path_factory) if method == "mtp"
                    else _spec(method, tmp_path_factory, k=K))
    prompts = _prompts()[:3]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    kwargs = dict(max_num_seqs=8, block_size=8)
    want, _ = _run(make_llm, target, prompts, params, None, **kwargs)
    drafts = _record_drafts(monkeypatch)
    _, eager_stats = _run(make_llm, target, prompts, params, spec, **kwargs)
    eager_drafts = list(drafts)
    drafts.clear()
    made = _padded_target_steps(monkeypatch)
    got, stats = _run(make_llm, target, prompts, params, spec, **kwargs)
    _assert_same(got, want)
    assert drafts == eager_drafts and any(any(row) for row in drafts)
    assert len(made) == 1
    # (the start-up check replays size 8 only)
    assert made[0].verify.replays[4] > 0, "no verify step went through the padding"
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens"):
        assert getattr(stats, name) == getattr(eager_stats, name), name
    if method == "draft_model":  # (a random head's drafts are rejected all but by chance)
        assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_padded_target_steps_in_the_triton_interpreter(tmp_path, make_llm, monkeypatch, method):
    """TRITON's kernels (the interpreter, head sizes 64) over the padded target steps with the
    proposer's part: outputs equal no speculation, drafts the eager engine's."""
    pytest.importorskip("triton")
    target, spec = triton_spec(method, tmp_path)
    prompts, params = _prompts()[:3], SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True)
    kwargs = dict(attention_backend="TRITON", max_num_seqs=4)
    want, _ = _run(make_llm, target, prompts, params, None, **kwargs)
    drafts = _record_drafts(monkeypatch)
    _run(make_llm, target, prompts, params, spec, **kwargs)
    eager_drafts = list(drafts)
    drafts.clear()
    made = _padded_target_steps(monkeypatch)
    got, _ = _run(make_llm, target, prompts, params, spec, **kwargs)
    _assert_same(got, want)
    assert drafts == eager_drafts and made[0].verify.replays[4] > 0


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_the_start_up_check_covers_the_proposer(tmp_path_factory, make_llm, monkeypatch,
                                                method):
    """The check compares the proposer's part too: a graphed forward that leaves the draft's
    K/V or the head's captured rows unwritten (the proposer skipped outside the eager
    reference) fails it, while the target's hidden states still agree."""
    target, spec = _spec(method, tmp_path_factory, k=K)
    made = _padded_target_steps(monkeypatch, check=False)
    llm = make_llm(model=target, dtype="float32", device="cpu", kv_cache_memory="8MiB",
                   speculative_config=spec, max_num_seqs=8, block_size=8)
    graphs = made[0]
    assert llm.engine.runner.decode_graphs is graphs
    with torch.inference_mode():
        graphs.check_against_eager()
        graphs.verify.check_against_eager()
    run = ProposerStep.run

    def skipped(self, *args):
        if self._reference:
            run(self, *args)

    monkeypatch.setattr(ProposerStep, "run", skipped)
    for g in (graphs, graphs.verify):
        with torch.inference_mode(), pytest.raises(RuntimeError, match="proposer's part"):
            g.check_against_eager()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_cuda_target_graphs_with_a_proposer(tmp_path_factory, make_llm, monkeypatch, method):
    """On CUDA (TRITON, float32, head sizes 64): with a draft model or an EAGLE-3 head the
    target's decode and verify graphs are captured (the proposer's part inside) and checked at
    start-up, and replayed; outputs equal no speculation, and each proposal's drafts and the
    acceptance equal those of the eager engine."""
    from pagedserve.spec_decode.random_head import write_random_eagle3_head

    root = tmp_path_factory.mktemp(f"cuda_step_graphs_{method}")
    target = _tiny(root / "target", 0, 128, 4, heads=2)  # TRITON's head sizes start at 64
    model = (_tiny(root / "draft", 3, 128, 1, heads=2) if method == "draft_model"
             else write_random_eagle3_head(root / "head",
                                           transformers.AutoConfig.from_pretrained(target), 60,
                                           dtype=torch.float32))
    spec = {"method": method, "model": model, "num_speculative_tokens": K}
    kwargs = dict(device="cuda", attention_backend="TRITON", engine_core_process=False,
                  max_num_seqs=4)
    prompts = _prompts()[:3]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    want, _ = _run(make_llm, target, prompts, params, None, gpu_memory_utilization=0.05,
                   enforce_eager=True, **kwargs)
    drafts = _record_drafts(monkeypatch)
    _, eager_stats = _run(make_llm, target, prompts, params, spec,
                          gpu_memory_utilization=0.05, enforce_eager=True, **kwargs)
    eager_drafts = list(drafts)
    drafts.clear()
    llm = make_llm(model=target, dtype="float32", speculative_config=spec,
                   gpu_memory_utilization=0.05, **kwargs)
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.verify is not None, "target graphs were not captured"
    assert (runner.speculator.graph_step.buffer is not None) == (method == "eagle3")
    at_start = (sum(graphs.replays.values()), sum(graphs.verify.replays.values()))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [[(c.token_ids, c.finish_reason,
             [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs])
            for c in o.outputs] for o in outs]
    stats = llm.engine.call_utility("stats")
    _assert_same(got, want)
    assert drafts == eager_drafts
    assert sum(graphs.verify.replays.values()) > at_start[1], "no verify step replayed"
    assert stats.spec_decode_num_accepted_tokens == eager_stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_num_draft_tokens == eager_stats.spec_decode_num_draft_tokens > 0
