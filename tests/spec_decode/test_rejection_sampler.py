"""The rejection sampler alone: greedy rules, a draft equal to the target's choice always kept
(acceptance rate 1.0, mean acceptance length K+1), the kept-then-replaced token distributed
as the target's own sample (chi-squared over 10^6 requests in one vectorised call), top-k and
temperature honoured, seeded rows reproducible, penalties counting the drafts before each
position. The greedy rules and the distribution also through the Triton kernel (in the
interpreter on the CPU; the million requests on CUDA, gpu)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.engine.sampler import SamplingMetadata
from pagedserve.spec_decode.metrics import SpecDecodeStats, mean_acceptance_length
from pagedserve.spec_decode.rejection_sampler import RejectionSampler, expand_metadata
from pagedserve.spec_decode.verify import build_layout

CPU = torch.device("cpu")
kernel = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")


def _meta(params, vocab, generators=None, outputs=None, device=CPU):
    n = len(params)
    return SamplingMetadata.build(params, [[]] * n, outputs or [[]] * n, generators or {},
                                  None, vocab, device)


def _layout(drafts: list[list[int]], device=CPU):
    num = np.array([len(d) for d in drafts], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(num + 1)]).astype(np.int32)
    return build_layout(num, drafts, qsl, device)


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=kernel)])
def test_greedy_keeps_drafts_until_the_first_mismatch_then_adds_the_target_token(use_kernel):
    vocab = 6
    # Request 0: target argmaxes 1, 2, 3, 4; drafts 1, 2, 5 -> keeps 1, 2, then 3.
    # Request 1: no drafts -> argmax 0. Request 2: drafts 4, 4 all right -> bonus 5.
    argmax = [1, 2, 3, 4, 0, 4, 4, 5]
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float() * 5
    layout = _layout([[1, 2, 5], [], [4, 4]])
    out = RejectionSampler(use_kernel=use_kernel)(
        logits, _meta([SamplingParams(temperature=0)] * 3, vocab), layout)
    assert out.sampled_token_ids.tolist() == [[1, 2, 3, -1], [0, -1, -1, -1], [4, 4, 5, -1]]


def test_a_draft_equal_to_the_target_is_always_kept():
    """Greedy drafts that are the target's argmax, and random drafts whose probabilities are
    the target's own (p / q = 1 >= u): every draft kept, mean acceptance length K + 1."""
    torch.manual_seed(0)
    b, k, vocab = 64, 4, 11
    logits = torch.randn(b * (k + 1), vocab)
    greedy_drafts = logits.argmax(-1).view(b, k + 1)[:, :k]
    stats = SpecDecodeStats(k)
    for params, drafts, q in [
        (SamplingParams(temperature=0), greedy_drafts, None),
        (SamplingParams(temperature=0.7, top_k=5), None, "target"),
    ]:
        meta = _meta([params] * b, vocab)
        if drafts is None:  # drafts sampled from the target itself, with its probabilities
            rows = expand_metadata(meta, _layout([[0] * k] * b))
            probs = (logits / 0.7).view(b, k + 1, vocab)
            kth = probs.topk(5, dim=-1).values[..., -1:]
            probs = probs.masked_fill(probs < kth, float("-inf")).softmax(-1)
            drafts = torch.multinomial(probs[:, :k].reshape(-1, vocab), 1).view(b, k)
            assert rows.top_k.shape == (b * (k + 1),)
        layout = _layout(drafts.tolist())
        draft_probs = probs[:, :k] if q == "target" else None
        out = RejectionSampler()(logits, meta, layout, draft_probs)
        kept = (out.sampled_token_ids >= 0).sum(1) - 1
        assert kept.tolist() == [k] * b
        stats.observe(layout.num_drafts, kept.numpy())
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # acceptance rate 1.0
    assert mean_acceptance_length(stats.num_drafts, stats.num_accepted_tokens) == k + 1
    assert stats.num_accepted_tokens_per_pos.tolist() == [2 * b] * k


def _chi2_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(chi2 / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("path,b", [
    ("torch", 1_000_000),
    # The interpreter runs a program per request (~8 ms each): fewer requests, slow.
    pytest.param("interpreted", 10_000, marks=[kernel, pytest.mark.slow]),
    pytest.param("cuda", 1_000_000, marks=pytest.mark.gpu),
])
def test_random_rejection_sampling_follows_the_target_distribution(path, b):
    """10^6 requests with one n-gram draft each (one-hot q), from a fixed 8-token target under
    temperature 0.8 and top-k 6: the first token each keeps (the draft, or the replacement
    from max(p - q, 0)) is a sample of the processed target; the bonus after a kept draft is
    a sample of the next position's target. `interpreted` and `cuda` run the Triton kernel."""
    torch.manual_seed(1)
    device = torch.device("cuda") if path == "cuda" else CPU
    vocab = 8
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, 1.5, 0.2, -3.0],
                         [0.0, 0.3, -1.0, 2.0, 0.1, 0.0, 1.0, 0.5]])
    logits = base.repeat(b, 1).to(device)
    params = SamplingParams(temperature=0.8, top_k=6)
    drafts = torch.randint(0, vocab, (b, 1))  # drafts of every token, some outside the top-k
    sampler = RejectionSampler(use_kernel=path != "torch")
    out = sampler(logits, _meta([params] * b, vocab, device=device),
                  _layout(drafts.tolist(), device))
    tokens = out.sampled_token_ids.cpu()
    for position in range(2):
        target = base[position] / 0.8
        target = target.masked_fill(target < target.topk(6).values[-1], float("-inf"))
        p = target.softmax(-1).double().numpy()
        picked = tokens[:, position] if position == 0 else tokens[tokens[:, 1] >= 0, 1]
        counts = np.bincount(picked.numpy(), minlength=vocab).astype(np.float64)
        assert counts[p == 0].sum() == 0  # top-k's excluded tokens never come out
        assert _chi2_p_value(counts, p) > 0.01


def test_seeded_rows_reproduce_whatever_the_batch():
    vocab, k = 9, 3
    torch.manual_seed(2)
    logits = torch.randn(k + 1, vocab)
    params = SamplingParams(temperature=1.0, seed=5)
    drafts = [1, 2, 3]

    def run(extra: int) -> list[int]:
        # The seeded request alone, or after `extra` unseeded ones.
        gens = {extra: torch.Generator().manual_seed(5)}
        rows = [SamplingParams(temperature=1.0)] * extra + [params]
        all_logits = torch.cat([torch.randn(extra * 3, vocab), logits])
        layout = _layout([[4, 4]] * extra + [drafts])
        out = RejectionSampler()(all_logits, _meta(rows, vocab, gens), layout)
        return out.sampled_token_ids[extra].tolist()

    assert run(0) == run(3) == run(7)


def test_penalties_count_the_drafts_before_each_position():
    vocab = 10
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    meta = _meta([params, params], vocab, outputs=[[7], [7, 7]])
    layout = _layout([[3, 3, 5], [1]])
    rows = expand_metadata(meta, layout)
    counts = rows.output_token_counts
    assert counts[:, [1, 3, 5, 7]].tolist() == [
        [0, 0, 0, 1], [0, 1, 0, 1], [0, 2, 0, 1], [0, 2, 1, 1],  # request 0's four rows
        [0, 0, 0, 2], [1, 0, 0, 2]]  # request 1's two rows


def test_an_unknown_path_is_refused_at_start_up(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_REJECTION_SAMPLER", "fast")
    with pytest.raises(ValueError, match="PAGEDSERVE_REJECTION_SAMPLER='fast': use auto, torch"):
        RejectionSampler()
