"""LoRA's shrink/expand kernels (Triton: under TRITON_INTERPRET=1 on the CPU, compiled on CUDA
when there is one) and the torch path (ops.lora_torch), float32, against a per-token reference
written here: mixed slots with base tokens between them, a slot with no tokens, ranks 8/16/32,
fused parts of unequal and non-power-of-two widths, input features split over programs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from pagedserve.lora.batch import LoRABatch
from pagedserve.lora.ops import lora_torch, lora_torch_masked

SLOTS = 3
# The kernels' device: compiled Triton reads CUDA tensors only; the interpreter CPU ones.
KERNELS_ON = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on_kernels(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(KERNELS_ON) for t in tensors]


def _kernel_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within float32 rounding in the interpreter; compiled tl.dot multiplies float32 in TF32
    (10-bit mantissa), so on CUDA within 2e-3 of the largest value."""
    got, want = got.cpu(), want.cpu()
    if KERNELS_ON.type == "cpu":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * float(want.abs().max()))


def _factors(rank: int, in_features: int, parts: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    bounds = [sum(parts[:i]) for i in range(len(parts) + 1)]
    # A scaled so that A x is of unit size at any width (float32's rounding stays below atol)
    a = torch.randn(SLOTS, len(parts) * rank, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(SLOTS, bounds[-1], rank, generator=gen)
    return a, b, bounds


def _reference(x, y, a, b, bounds, token_slots):
    """One token and one part at a time: y[t, part] += B_part (A_part x[t])."""
    out = y.clone()
    rank = b.shape[-1]
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for p in range(len(bounds) - 1):
            lo, hi = bounds[p], bounds[p + 1]
            out[t, lo:hi] += b[slot, lo:hi] @ (a[slot, p * rank:(p + 1) * rank] @ x[t])
    return out


def _step(per_request, num_tokens, in_features, out_features):
    batch = LoRABatch(64, SLOTS, torch.device("cpu"))
    batch.set(np.array(per_request), np.array(num_tokens))
    t = int(sum(num_tokens))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(t, in_features, generator=gen), torch.randn(t, out_features, generator=gen)
    return batch, x, y


CASES = [  # (rank, in features, fused parts' rows)
    (8, 40, [24, 12, 12]),  # q/k/v of unequal widths, nothing a power of two
    (16, 72, [50, 50]),  # gate/up
    (32, 33, [70]),  # a whole layer wider than one output block
    (16, 2100, [40]),  # the shrink's input features over eight programs, the last one short
]
STEP = ([0, -1, 2, 2, -1, 1, 0], [3, 2, 5, 1, 4, 18, 1])  # slots per request, tokens


@pytest.mark.parametrize("rank,in_features,parts", CASES)
def test_torch_path_matches_reference(rank, in_features, parts):
    a, b, bounds = _factors(rank, in_features, parts, seed=rank)
    batch, x, y = _step(*STEP, in_features, bounds[-1])
    want = _reference(x, y, a, b, bounds, batch.token_slots[:x.shape[0]])
    got = y.clone()
    lora_torch(x, got, a, b, bounds, batch.groups)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert (want - y).abs().max() > 1.0  # the term is there to be dropped
    got = y.clone()
    lora_torch_masked(x, got, a, b.transpose(1, 2).contiguous(), bounds, batch.token_slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rank,in_features,parts", CASES)
def test_kernels_match_reference(rank, in_features, parts):
    kernels = pytest.importorskip("pagedserve.lora.kernels")
    a, b, bounds = _factors(rank, in_features, parts, seed=rank)
    bounds_t = torch.tensor(bounds, dtype=torch.int32)
    batch, x, y = _step(*STEP, in_features, bounds[-1])
    want = _reference(x, y, a, b, bounds, batch.token_slots[:x.shape[0]])
    assert batch.num_blocks == 4  # slot 0: 4 tokens, slot 1: 18 (two blocks), slot 2: 6
    assert kernels.split_k(in_features) == (8 if in_features > 2000 else 1)
    a, b, bounds_t, x, y, rows, blocks = _on_kernels(
        a, b, bounds_t, x, y, batch.sorted_rows, batch.blocks)
    got = y.clone()
    kernels.grouped(x, got, a, b, bounds, bounds_t, rows, blocks, batch.num_blocks)
    _kernel_close(got, want)
    # as under a graph: the grid over every block a step of more rows may have (padding rows
    # are in no block and stay untouched; the blocks past the step's are empty)
    pad, x_more = _on_kernels(torch.randn(3, bounds[-1]), torch.randn(3, in_features))
    x_pad = torch.cat([x, x_more])
    got = torch.cat([y, pad])
    grid = batch.grid_blocks(x_pad.shape[0])
    assert grid == 3 + SLOTS > batch.num_blocks
    kernels.grouped(x_pad, got, a, b, bounds, bounds_t, rows, blocks, grid)
    _kernel_close(got[:x.shape[0]], want)
    assert torch.equal(got[x.shape[0]:], pad)


@pytest.mark.parametrize("tiles, max_ranks", [
    (dict(block_n=16, n_tiles=3), 128),  # a program's column tiles run past its part's end
    (dict(block_k=16, k_per_split=14, max_splits=5), 128),  # five splits, the last one short
    (dict(), 16),  # q/k/v's 24 ranks over two shrink programs, the second half empty
], ids=["column-groups", "splits", "large-rank-tiles"])
def test_kernels_under_other_launch_shapes(tiles, max_ranks, monkeypatch):
    """The shapes the benchmark's sweep tries give the same sums (q/k/v's 24 ranks in one
    shrink program), and so do large ranks' (here made small): the shrink's ranks in chunks
    of `max_ranks`, the expand's column tiles narrowed."""
    kernels = pytest.importorskip("pagedserve.lora.kernels")
    assert kernels.expand_block_n(16) == 64 and kernels.expand_block_n(256) == 32
    monkeypatch.setattr(kernels, "MAX_SHRINK_RANKS", max_ranks)
    if max_ranks == 16:
        monkeypatch.setattr(kernels, "EXPAND_TILE_ELEMENTS", 16 * 16)
        assert kernels.expand_block_n(8) == 16
    a, b, bounds = _factors(8, 72, [24, 12, 12], seed=3)
    bounds_t = torch.tensor(bounds, dtype=torch.int32)
    batch, x, y = _step(*STEP, 72, bounds[-1])
    want = _reference(x, y, a, b, bounds, batch.token_slots[:x.shape[0]])
    tiles = kernels.LoRATiles(**tiles)
    assert kernels.split_k(72, tiles) == (5 if tiles.max_splits == 5 else 1)
    a, b, bounds_t, x, y, rows, blocks = _on_kernels(
        a, b, bounds_t, x, y, batch.sorted_rows, batch.blocks)
    got = y.clone()
    kernels.grouped(x, got, a, b, bounds, bounds_t, rows, blocks, batch.num_blocks, tiles)
    _kernel_close(got, want)


def test_kernels_skip_base_tokens_and_steps():
    kernels = pytest.importorskip("pagedserve.lora.kernels")
    a, b, bounds = _factors(16, 40, [24, 12, 12], seed=5)
    bounds_t = torch.tensor(bounds, dtype=torch.int32)
    x, y = torch.randn(6, 40), torch.randn(6, 48)
    batch = LoRABatch(8, SLOTS, torch.device("cpu"))
    batch.set(np.array([1, -1, 2]), np.array([3, 1, 2]))  # slot 0: no tokens
    assert batch.blocks[:3].tolist() == [[1, 0, 3], [2, 3, 5], [0, 0, 0]]
    assert batch.sorted_rows[:5].tolist() == [0, 1, 2, 4, 5]
    want = _reference(x, y, a, b, bounds, batch.token_slots[:6])
    a, b, bounds_t, x, y, rows, blocks = _on_kernels(a, b, bounds_t, x, y, batch.sorted_rows,
                                                     batch.blocks)
    got = y.clone()
    kernels.grouped(x, got, a, b, bounds, bounds_t, rows, blocks, batch.num_blocks)
    _kernel_close(got, want)
    assert torch.equal(got[3], y[3])  # the base token
    base = LoRABatch(8, SLOTS, KERNELS_ON)
    base.set(np.array([-1, -1]), np.array([4, 2]))
    assert base.num_blocks == 0 and not base.active and not base.groups
    got = y.clone()
    kernels.grouped(x, got, a, b, bounds, bounds_t, base.sorted_rows, base.blocks,
                    base.grid_blocks(6))
    assert torch.equal(got, y)


def test_batch_clears_rows_of_the_previous_step():
    batch = LoRABatch(40, SLOTS, torch.device("cpu"))
    assert batch.max_blocks == 3 + SLOTS
    batch.set(np.array([0, 1, 2]), np.array([4, 4, 4]))
    batch.set(np.array([2, -1]), np.array([1, 1]))
    assert batch.token_slots.tolist() == [2] + [-1] * 39
    assert batch.blocks[:4].tolist() == [[2, 0, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    batch.set(np.array([1, 0, 1]), np.array([30, 4, 2]))  # slot 1: 32 tokens, two blocks
    assert batch.token_slots.tolist() == [1] * 30 + [0] * 4 + [1] * 2 + [-1] * 4
    assert batch.sorted_rows[:36].tolist() == [30, 31, 32, 33, *range(30), 34, 35]
    assert batch.num_blocks == 3 and batch.blocks[:4].tolist() == \
        [[0, 0, 4], [1, 4, 36], [1, 20, 36], [0, 0, 0]]  # (slot, first, end of its run)
    with pytest.raises(ValueError, match=r"a step of 50 tokens, more than .* hold \(40"):
        batch.set(np.array([1]), np.array([50]))  # a graph reads the buffers where they are
    with pytest.raises(ValueError, match=f"slot {SLOTS} of {SLOTS} LoRA slots"):
        batch.set(np.array([SLOTS]), np.array([2]))
    assert batch.num_tokens == 36 and batch.num_blocks == 3  # refused before any change
    assert batch.grid_blocks(2) == 2  # a graph of 2 rows: no more blocks than rows


def test_cpu_lora_needs_no_triton():
    """The CPU path imports no Triton (the CPU install may lack it)."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import numpy as np, torch\n"
            "from pagedserve.lora.batch import LoRABatch\n"
            "from pagedserve.lora.ops import add_lora\n"
            "b = LoRABatch(4, 1, torch.device('cpu')); b.set(np.array([0]), np.array([2]))\n"
            "y = torch.zeros(2, 4)\n"
            "add_lora(torch.ones(2, 3), y, torch.ones(1, 2, 3), torch.ones(1, 4, 2), None,\n"
            "         [0, 4], torch.tensor([0, 4]), b)\n"
            "assert float(y[0, 0]) == 6.0, y\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_kernels_in_float16():
    """16-bit factors and activations (the interpreter's tl.dot takes fp16, not bf16): within
    float16 rounding of the float32 reference (the shrink's output rounds to fp16 first)."""
    kernels = pytest.importorskip("pagedserve.lora.kernels")
    a, b, bounds = _factors(16, 72, [50, 50], seed=9)
    a, b = (0.25 * a).half(), (0.25 * b).half()
    bounds_t = torch.tensor(bounds, dtype=torch.int32)
    batch, x, y = _step(*STEP, 72, bounds[-1])
    x, y = x.half(), y.half()
    want = _reference(x.float(), y.float(), a.float(), b.float(), bounds,
                      batch.token_slots[:x.shape[0]])
    scale = float(want.abs().max())
    a, b, bounds_t, x, y, rows, blocks = _on_kernels(a, b, bounds_t, x, y, batch.sorted_rows,
                                                     batch.blocks)
    for num_blocks in (batch.num_blocks, batch.grid_blocks(x.shape[0])):  # a step's, a graph's
        got = y.clone()
        kernels.grouped(x, got, a, b, bounds, bounds_t, rows, blocks, num_blocks)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got.float().cpu(), want, rtol=0, atol=1e-3 * scale)
