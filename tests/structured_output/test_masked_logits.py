"""The masked copy of the logits (one Triton kernel on a GPU) against xgrammar's own kernel and a
plain float32 reference; on the CPU in the Triton interpreter."""

import os

import pytest
import torch

from pagedserve.structured_output.manager import apply_token_bitmask, masked_logits

xgr = pytest.importorskip("xgrammar")
triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
runs_kernel = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the kernel needs CUDA or TRITON_INTERPRET=1")


def reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Token t of a row is kept where bit t % 32 of its word t // 32 is set."""
    vocab = logits.shape[1]
    tokens = torch.arange(vocab)
    bits = (bitmask.cpu().long()[:, tokens // 32] >> (tokens % 32)) & 1
    return logits.cpu().masked_fill(bits == 0, float("-inf"))


def case(rows: int, vocab: int, words: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    bitmask[0] = -1  # every token allowed
    bitmask[-1] = 0  # none
    return logits, bitmask


@runs_kernel
@pytest.mark.parametrize("vocab", [32, 100, 4096, 5000])
def test_kernel_matches_reference_and_xgrammar(vocab):
    from pagedserve.structured_output.masked_logits import masked_logits_triton

    logits, bitmask = case(5, vocab, -(-vocab // 32) + 1)  # a wider mask, as a padded one
    out = masked_logits_triton(logits.to(DEVICE), bitmask.to(DEVICE))
    expected = reference(logits, bitmask)
    assert torch.equal(out.cpu(), expected)
    theirs = logits.clone()
    apply_token_bitmask(theirs, bitmask, None)  # xgrammar's (CPU) kernel
    assert torch.equal(out.cpu(), theirs)


@runs_kernel
def test_kernel_divides_by_each_rows_temperature():
    """The sampler's fused path: mask and temperature in one kernel, bit for bit torch's
    division (the samples must not move)."""
    from pagedserve.structured_output.masked_logits import masked_logits_triton

    logits, bitmask = case(6, 5000, 157, seed=6)
    temperature = torch.tensor([0.7, 1.0, 0.3, 1.3, 0.0999, 2.0])
    out = masked_logits_triton(logits.to(DEVICE), bitmask.to(DEVICE), temperature.to(DEVICE))
    expected = reference(logits, bitmask) / temperature.unsqueeze(1)
    assert torch.equal(out.cpu(), expected)
    assert torch.equal(masked_logits(logits, bitmask, [0, 2], temperature),
                       _masked_rows(logits, bitmask, [0, 2]) / temperature.unsqueeze(1))


def _masked_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    out[rows] = reference(logits, bitmask)[rows]
    return out


@runs_kernel
def test_kernel_reads_row_strided_views():
    """The sampler's logits are the first rows of a persistent buffer; the device mask too."""
    from pagedserve.structured_output.masked_logits import masked_logits_triton

    logits, bitmask = case(8, 300, 10, seed=1)
    big = torch.full((8, 320), 7.0)
    big[:, :300] = logits
    out = masked_logits_triton(big.to(DEVICE)[:6, :300], bitmask.to(DEVICE)[:6])
    assert out.shape == (6, 300) and out.is_contiguous()
    assert torch.equal(out.cpu(), reference(logits[:6], bitmask[:6]))


def test_masked_logits_leaves_its_input_alone():
    logits, bitmask = case(4, 200, 7, seed=2)
    before = logits.clone()
    for rows in (None, [1, 3]):
        out = masked_logits(logits.to(DEVICE), bitmask.to(DEVICE), rows)
        expected = before.clone()
        index = list(range(4)) if rows is None else rows
        expected[index] = reference(before, bitmask)[index]
        assert torch.equal(out.cpu(), expected)
        assert torch.equal(logits, before)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_at_the_bundled_models_shape():
    """Batch 64 over SmolLM2's 49,152 tokens, against xgrammar's Triton kernel on the device."""
    from pagedserve.structured_output.masked_logits import masked_logits_triton

    logits, bitmask = case(64, 49152, 1536, seed=3)
    logits, bitmask = logits.cuda(), bitmask.cuda()
    theirs = logits.clone()
    apply_token_bitmask(theirs, bitmask, None)
    assert torch.equal(masked_logits_triton(logits, bitmask), theirs)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_reads_a_pinned_host_mask():
    """The sampler hands the kernel the fill's page-locked host buffer itself (no copy)."""
    from pagedserve.structured_output.masked_logits import masked_logits_triton

    logits, bitmask = case(64, 49152, 1536, seed=4)
    pinned = bitmask.pin_memory()
    out = masked_logits_triton(logits.cuda()[:40], pinned[:40])
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reference(logits[:40], bitmask[:40]))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("greedy_rows", [0, 3])
def test_sampler_fused_mask_and_temperature_samples_as_the_unfused(greedy_rows):
    """The same noise gives the same tokens with the mask's kernel dividing by the temperature
    (every row masked) and with the mask applied by rows, then divided (the unfused path)."""
    from pagedserve.engine.sampler import Sampler, SamplingMetadata, mask_takes_temperature
    from pagedserve.sampling_params import SamplingParams

    rows, vocab = 16, 49152
    logits, bitmask = case(rows, vocab, vocab // 32, seed=7)
    bitmask[-1] = -1  # the helper's row of no token is no sampling case
    params = ([SamplingParams(temperature=0.0)] * greedy_rows
              + [SamplingParams(temperature=0.5 + 0.1 * i) for i in range(rows - greedy_rows)])
    samples = []
    for fused in (True, False):
        meta = SamplingMetadata.build(params, [[]] * rows, [[]] * rows, {}, eos_token_id=1,
                                      vocab_size=vocab, device="cuda")
        meta.token_bitmask = bitmask.pin_memory() if fused else bitmask.cuda()
        meta.bitmask_rows = None if fused else list(range(rows))
        assert mask_takes_temperature(logits.cuda(), meta) == fused
        torch.cuda.manual_seed(11)
        samples.append(Sampler()(logits.cuda(), meta).sampled_token_ids.cpu())
    assert torch.equal(samples[0], samples[1])
    allowed = reference(logits, bitmask).gather(1, samples[0].unsqueeze(1)) > float("-inf")
    assert allowed.all()


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not CUDA, reason="needs CUDA")])])
def test_logit_bias_then_the_mask_of_every_row(device):
    """The sampler's order: the bias, then the grammar's mask; on CUDA with the mask in pinned
    host memory, as the fill hands it over (the kernel reads it there)."""
    from pagedserve.engine.sampler import SamplingMetadata, apply_penalties
    from pagedserve.sampling_params import SamplingParams

    logits, bitmask = case(3, 96, 3, seed=5)
    bias = {5: 50.0, 7: -3.0}
    params = [SamplingParams(temperature=0.8, logit_bias=bias)] + [SamplingParams()] * 2
    meta = SamplingMetadata.build(params, [[]] * 3, [[]] * 3, {}, eos_token_id=1,
                                  vocab_size=96, device=device)
    meta.token_bitmask = bitmask.pin_memory() if device == "cuda" else bitmask
    out = apply_penalties(logits.to(device), meta)
    biased = logits.clone()
    biased[0, 5] += 50.0
    biased[0, 7] -= 3.0
    assert torch.equal(out.cpu(), reference(biased, bitmask))
