"""The rejection sampler's Triton kernel (spec_decode/rejection_kernels.py) against its torch
path, on the same batch and the same random draws (both start from one global seed and fresh
generators of the same request seeds, and the sampler draws before it picks a path): the same
tokens and logprobs on random batches (greedy, random with and without draft probabilities,
mixed rows, 0..Kmax drafts a request, top-k / top-p / min-p, penalties, seeded rows, a
residual with no mass left). Independent of both: random rows under top-k 1 give the greedy
rule's tokens, worked out here. Small shapes in Triton's interpreter on the CPU; B=64, K=4,
V=128k on CUDA (gpu)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.engine.sampler import SamplingMetadata, apply_penalties, apply_top_k_top_p_min_p
from pagedserve.spec_decode.rejection_sampler import RejectionSampler, expand_metadata
from pagedserve.spec_decode.verify import build_layout

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

pytest.importorskip("triton")
from pagedserve.spec_decode.rejection_kernels import rejection_tokens_triton  # noqa: E402

CPU = torch.device("cpu")


def _params(kind: str, gen: torch.Generator) -> SamplingParams:
    """One request's settings: greedy, or random with a draw of the target's filters."""
    if kind == "greedy":
        return SamplingParams(temperature=0, frequency_penalty=0.5)
    pick = torch.randint(0, 5, (1,), generator=gen).item()
    filters = [{}, {"top_k": 7}, {"top_p": 0.8}, {"min_p": 0.1},
               {"top_k": 20, "presence_penalty": 1.0, "seed": 11}][pick]
    return SamplingParams(temperature=0.6 + float(torch.rand(1, generator=gen)), logprobs=2,
                          **filters)


class Batch:
    """A random verify step: B requests with 0..kmax drafts, each draft either the target's
    argmax at its position (likely kept) or a random token (likely rejected)."""

    def __init__(self, seed: int, b: int, kmax: int, vocab: int, kinds: str,
                 draft_probs: bool, device: torch.device = CPU) -> None:
        gen = torch.Generator().manual_seed(seed)
        num = torch.randint(0, kmax + 1, (b,), generator=gen)
        num[0], num[-1] = kmax, 0  # a request with every draft, one with none
        rows = int((num + 1).sum())
        self.logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
        argmax = self.logits.cpu().argmax(-1)
        starts = torch.cumsum(num + 1, 0) - (num + 1)
        self.drafts = []
        for i in range(b):
            likely = argmax[starts[i]:starts[i] + num[i]]
            other = torch.randint(0, vocab, (int(num[i]),), generator=gen)
            take = torch.rand(int(num[i]), generator=gen) < 0.75
            self.drafts.append(torch.where(take, likely, other).tolist())
        qsl = np.concatenate([[0], np.cumsum(num.numpy() + 1)])
        self.layout = build_layout(num.numpy(), self.drafts, qsl, device)
        which = {"greedy": ["greedy"] * b, "random": ["random"] * b,
                 "mixed": ["greedy", "random"] * b}[kinds][:b]
        self.params = [_params(kind, gen) for kind in which]
        self.outputs = [torch.randint(0, vocab, (3,), generator=gen).tolist() for _ in range(b)]
        self.vocab, self.device = vocab, device
        self.draft_probs = None
        if draft_probs:  # a draft model's distributions near the target's, in a wider grid
            near = self.logits.cpu()[starts[:, None] + torch.arange(kmax).clamp_max(
                (num[:, None] - 1).clamp_min(0))]
            wide = (near + torch.randn(b, kmax, vocab, generator=gen)).softmax(-1)
            self.draft_probs = torch.cat([wide, wide[:, :1]], 1).to(device)[:, :kmax]

    def meta(self) -> SamplingMetadata:
        gens = {i: torch.Generator(self.device).manual_seed(p.seed)
                for i, p in enumerate(self.params) if p.seed is not None}
        return SamplingMetadata.build(self.params, [[]] * len(self.params), self.outputs, gens,
                                      None, self.vocab, self.device)

    def run(self, use_kernel: bool, draft_probs: torch.Tensor | None = None):
        torch.manual_seed(1234)  # the same global draws for both paths
        dp = self.draft_probs if draft_probs is None else draft_probs
        return RejectionSampler(use_kernel=use_kernel)(self.logits, self.meta(), self.layout,
                                                       dp)


def _assert_same(batch: Batch, draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    want = batch.run(False, draft_probs)
    got = batch.run(True, draft_probs)
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    if want.logprobs is not None:
        assert torch.equal(got.logprob_token_ids, want.logprob_token_ids)
        assert torch.equal(got.logprobs, want.logprobs)
    return want.sampled_token_ids.cpu()


@pytest.mark.parametrize("kinds,draft_probs", [
    ("greedy", False), ("greedy", True), ("random", False), ("random", True), ("mixed", False),
    ("mixed", True)])
def test_kernel_gives_the_torch_paths_tokens(kinds, draft_probs):
    kept_all = first_rejected = 0
    for seed in range(3):
        batch = Batch(seed, b=10, kmax=4, vocab=48, kinds=kinds, draft_probs=draft_probs)
        tokens = _assert_same(batch)
        kept = (tokens >= 0).sum(1) - 1
        num = torch.from_numpy(batch.layout.num_drafts)
        kept_all += int(((kept == num) & (num > 0)).sum())
        first_rejected += int(((kept == 0) & (num > 0)).sum())
    assert kept_all and first_rejected  # the cases compared include both ends of the walk


@pytest.mark.parametrize("kmax", [0, 1])
def test_kernel_without_drafts_or_with_one(kmax):
    for kinds in ("greedy", "mixed"):
        _assert_same(Batch(5, b=6, kmax=kmax, vocab=40, kinds=kinds, draft_probs=False))


def test_kernel_over_several_vocabulary_blocks():
    """A vocabulary of 4,500: the race runs over three blocks of 2,048, the last partial."""
    for kinds, draft_probs in (("mixed", True), ("random", False)):
        _assert_same(Batch(9, b=5, kmax=3, vocab=4500, kinds=kinds, draft_probs=draft_probs))


def test_equal_scores_go_to_the_lowest_token_as_torchs_argmax():
    """Equal race scores within a block and across blocks: the lowest token id wins."""
    vocab = 4500
    probs = torch.zeros(1, vocab)
    probs[0, [2100, 4200, 2200]] = torch.tensor([0.25, 0.25, 0.125])
    probs[0, 0] = 0.375
    noise = torch.ones(1, vocab)
    noise[0, 0] = 2.0  # token 0 scores 0.1875: the tie at 0.25 is between 2100 and 4200
    none = torch.zeros(1, dtype=torch.int64)
    tokens = rejection_tokens_triton(
        none.clone(), probs, none, none, torch.zeros(1, 0, dtype=torch.int64),
        torch.zeros(1, dtype=torch.bool), None, None, noise)
    assert tokens.tolist() == [[2100]]
    probs[0, 2201] = 0.125  # and within a block: 2200 and 2201 tie, 2100 and 4200 gone
    probs[0, [2100, 4200]] = 0.0
    noise[0, 0] = 4.0
    tokens = rejection_tokens_triton(
        none.clone(), probs, none, none, torch.zeros(1, 0, dtype=torch.int64),
        torch.zeros(1, dtype=torch.bool), None, None, noise)
    assert tokens.tolist() == [[2200]]


def test_kernel_falls_back_to_p_where_the_residual_is_empty():
    """q = 2p everywhere: a draft is rejected when u > 1/2, and max(p - q, 0) is all zero,
    so the replacement is a sample of p (both paths), never an arbitrary token."""
    batch = Batch(7, b=8, kmax=3, vocab=32, kinds="random", draft_probs=False)
    rows = batch.layout.row_start[:, None] + np.minimum(np.arange(3)[None, :],
                                                        batch.layout.num_drafts[:, None])
    expanded = expand_metadata(batch.meta(), batch.layout)
    processed = apply_penalties(batch.logits.clone(), expanded) / expanded.temperature[:, None]
    p = apply_top_k_top_p_min_p(processed, expanded).softmax(-1)
    tokens = _assert_same(batch, 2 * p[torch.from_numpy(rows)])
    kept = (tokens >= 0).sum(1) - 1
    assert (kept < torch.from_numpy(batch.layout.num_drafts)).any()  # some were rejected
    final = tokens.gather(1, kept[:, None])[:, 0]
    assert (p[torch.from_numpy(batch.layout.row_start) + kept, final] > 0).all()


def test_top_k_one_rows_follow_the_greedy_rule():
    """Under top-k 1 a random row's p is one-hot at the argmax: a draft equal to it passes
    (p = 1 >= u), any other fails (p = 0 < u) and is replaced by the argmax; worked out here
    from the logits, not from either path."""
    vocab, drafts = 16, [[3, 5, 9], [], [2], [7, 7]]
    torch.manual_seed(3)
    num = np.array([len(d) for d in drafts])
    layout = build_layout(num, drafts, np.concatenate([[0], np.cumsum(num + 1)]), CPU)
    logits = torch.randn(layout.num_rows, vocab)
    # Rows: request 0 at 0..3, 1 at 4, 2 at 5..6, 3 at 7..9. Request 0 keeps 3 and 5, then
    # rejects 9; request 3 keeps its first 7, then rejects its second.
    logits[0, 3] = logits[1, 5] = logits[7, 7] = 10.0
    logits[2, 9] = logits[8, 7] = -10.0
    argmax = logits.argmax(-1).tolist()
    want = []
    for i, ds in enumerate(drafts):
        row, out = int(layout.row_start[i]), []
        for j, d in enumerate(ds):
            if argmax[row + j] != d:
                break
            out.append(d)
        out.append(argmax[row + len(out)])
        want.append(out + [-1] * (4 - len(out)))
    params = [SamplingParams(temperature=0.9, top_k=1)] * len(drafts)
    meta = SamplingMetadata.build(params, [[]] * 4, [[]] * 4, {}, None, vocab, CPU)
    out = RejectionSampler(use_kernel=True)(logits, meta, layout)
    assert out.sampled_token_ids.tolist() == want
    assert want[0] == [3, 5, argmax[2], -1] and want[3] == [7, argmax[8], -1, -1]


@pytest.mark.gpu
@pytest.mark.parametrize("kinds,draft_probs", [("greedy", False), ("random", False),
                                               ("mixed", True)])
def test_kernel_equals_torch_on_cuda_at_a_real_shape(kinds, draft_probs):
    cuda = torch.device("cuda")
    for seed in range(2):
        batch = Batch(seed, b=64, kmax=4, vocab=128_256, kinds=kinds, draft_probs=draft_probs,
                      device=cuda)
        _assert_same(batch)


@pytest.mark.slow
def test_the_benchmark_runs_its_smoke_shapes():
    """benchmarks/rejection_sampler.py --smoke: both paths' tokens agree on every row."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "benchmarks/rejection_sampler.py", "--smoke"],
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, check=True).stdout
    assert out.count("True") == 18 and "False" not in out
