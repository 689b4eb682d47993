"""moe_kernels.fused_experts (Triton grouped GEMMs over the (token, slot) pairs sorted by expert)
against moe.torch_experts, and the alignment's invariants. On the CPU the kernels run in the
Triton interpreter on small shapes (its bf16 casts truncate, so bf16 is compared loosely and
fp16 checks the 16-bit rounding); the `gpu` tests sweep serving token and expert counts on
CUDA and check that a step needs no host sync and can be captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from pagedserve.models.moe import SILU, ExpertActivation, torch_experts

triton = pytest.importorskip("triton")

from pagedserve.models import moe_align  # noqa: E402
from pagedserve.models import moe_kernels as mk  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SWIGLU = ExpertActivation("swiglu_clamped")
# Largest error allowed, relative to the output's largest magnitude. Float32 only reorders
# sums; bf16 in the interpreter truncates where the GPU rounds (~3% seen, vs ~1% for torch's
# own bf16 path against float64).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3,
             torch.bfloat16: 6e-2 if DEVICE.type == "cpu" else 3e-2}


def _layer(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
           dtype: torch.dtype, bias: bool, seed: int = 0, device: torch.device = DEVICE,
           float32_weights: bool = True) -> tuple:
    """(x, gate_up_proj, down_proj, weights, ids, gate_up_bias, down_bias): unit-scale
    activations, routing by a softmax top-k of random logits."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x = rand(num_tokens, hidden)
    gate_up = rand(num_experts, 2 * inter, hidden, scale=hidden ** -0.5)
    down = rand(num_experts, hidden, inter, scale=inter ** -0.5)
    biases = (rand(num_experts, 2 * inter, scale=0.5), rand(num_experts, hidden, scale=0.5))
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    if not float32_weights:
        weights = weights.to(dtype)
    return (x, gate_up, down, weights, ids, *(biases if bias else (None, None)))


def _compare(args: tuple, activation: ExpertActivation, **kwargs) -> None:
    x, gate_up, down, weights, ids, gate_up_bias, down_bias = args
    got = mk.fused_experts(x, gate_up, down, weights, ids, activation, gate_up_bias, down_bias,
                           **kwargs)
    want = torch_experts(x, gate_up, down, weights, ids, activation, gate_up_bias, down_bias)
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = max(want.float().abs().max().item(), 1e-3)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOLERANCE[x.dtype] * scale, f"max error {err:.3g} at scale {scale:.3g}"


def _check_alignment(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    sorted_pairs, block_expert, num_padded = moe_align.align_by_expert(ids, num_experts, block_m)
    flat = ids.flatten().cpu()
    pairs = flat.numel()
    blocks = moe_align.max_blocks(pairs, num_experts, block_m)
    assert sorted_pairs.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    assert sorted_pairs.dtype == block_expert.dtype == torch.int32
    padded = int(num_padded.item())
    counts = torch.bincount(flat, minlength=num_experts)
    assert padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    sorted_pairs, block_expert = sorted_pairs.cpu().long(), block_expert.cpu().long()
    # Every pair exactly once, before num_padded; everything else is the invalid id.
    valid = sorted_pairs < pairs
    assert not valid[padded:].any()
    assert (sorted_pairs[~valid] == pairs).all()
    assert torch.equal(sorted_pairs[valid].sort().values, torch.arange(pairs))
    # Each block is one expert's, that expert is block_expert's, experts ascend, and a block is
    # never all padding (each expert pads by less than block_m).
    for b in range(padded // block_m):
        block = sorted_pairs[b * block_m:(b + 1) * block_m]
        experts = flat[block[block < pairs]]
        assert experts.numel() > 0 and (experts == block_expert[b]).all()
    assert (block_expert.diff()[:padded // block_m - 1] >= 0).all()
    assert ((block_expert >= 0) & (block_expert < num_experts)).all()


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [
    (1, 1, 4, 16), (1, 3, 8, 16), (5, 2, 8, 16), (33, 3, 6, 16), (33, 3, 5, 4),
    (100, 2, 3, 32), (7, 1, 1, 16), (64, 8, 128, 16),
    # more pairs than one counting program takes (moe_align.CHUNK)
    (300, 4, 6, 16), (300, 8, 128, 64)])
def test_align_by_expert(num_tokens, top_k, num_experts, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    _check_alignment(ids.to(DEVICE), num_experts, block_m)
    # Skewed: every token on the same few experts, the rest empty.
    _check_alignment((ids % min(top_k + 1, num_experts)).to(DEVICE), num_experts, block_m)


def test_align_by_expert_bound_is_tight():
    # One pair on each of min(P, E) experts is exactly the worst case the bound allows.
    ids = torch.arange(8, device=DEVICE).view(4, 2)
    sorted_pairs, block_expert, num_padded = moe_align.align_by_expert(ids, 8, 16)
    assert int(num_padded.item()) == sorted_pairs.numel() == 8 * 16
    assert block_expert.tolist() == list(range(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", [SILU, SWIGLU], ids=["silu", "swiglu_clamped"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fused_experts_matches_torch(dtype, activation, bias):
    # 33 tokens x 3 of 6 experts: every block part padding.
    _compare(_layer(33, 3, 6, 64, 48, dtype, bias), activation)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,hidden,inter", [
    (1, 1, 4, 32, 32), (1, 3, 8, 64, 48), (5, 2, 8, 32, 48)])
def test_fused_experts_decode_batches(num_tokens, top_k, num_experts, hidden, inter):
    # Decode-sized: one pair per block, experts without tokens.
    _compare(_layer(num_tokens, top_k, num_experts, hidden, inter, torch.float32, True,
                    seed=num_tokens), SWIGLU)


@pytest.mark.parametrize("activation", [SILU, SWIGLU], ids=["silu", "swiglu_clamped"])
def test_fused_experts_fp16_rounding(activation):
    # fp16 casts round correctly in the interpreter: this checks where the kernels round.
    _compare(_layer(33, 3, 6, 64, 48, torch.float16, True, float32_weights=False), activation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_experts_masked_tiles_and_strides(dtype):
    """Tiles smaller than the layer in every dimension, none dividing it (K and column masks,
    several K steps, several blocks per expert, grouped program order with a remainder),
    weights in the model dtype, x a strided view and gate_up_proj stored transposed."""
    x, gate_up, down, weights, ids, gate_up_bias, down_bias = _layer(
        33, 3, 4, 40, 48, dtype, True, seed=3, float32_weights=False)
    x = torch.cat([x, x], dim=1)[:, ::2]
    gate_up = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    tiles = mk.MoeTiles(block_m=16, block_n_up=32, block_n_down=32, block_k=16, group_m=3,
                        num_warps=1, num_stages=1)
    _compare((x, gate_up, down, weights, ids, gate_up_bias, down_bias), SWIGLU, tiles=tiles)


def test_fused_experts_empty_and_unused_experts():
    x, gate_up, down, weights, ids, _, _ = _layer(5, 2, 6, 32, 32, torch.float32, False)
    empty = mk.fused_experts(x[:0], gate_up, down, weights[:0], ids[:0])
    assert empty.shape == (0, 32) and empty.dtype == x.dtype
    # Only experts 4 and 5 get tokens; one expert only.
    _compare((x, gate_up, down, weights, 4 + ids % 2, None, None), SILU)
    _compare((x, gate_up[:1], down[:1], weights[:, :1], ids[:, :1] * 0, None, None), SILU)


def test_fused_experts_rejects_mixed_dtypes():
    x, gate_up, down, weights, ids, _, _ = _layer(2, 1, 2, 32, 32, torch.float32, False)
    with pytest.raises(ValueError, match="one dtype"):
        mk.fused_experts(x.half(), gate_up, down, weights, ids)


def test_tile_table():
    cuda = torch.device("cuda")
    decode = mk.select_tiles(1 * 8 / 128, torch.bfloat16, cuda)
    prefill = mk.select_tiles(8192 * 8 / 128, torch.bfloat16, cuda)
    assert decode.block_m == 16 and prefill.block_m >= 64
    rows = [0.1, 2, 3, 8, 9, 32, 33, 128, 129, 10_000]
    block_ms = [mk.select_tiles(r, torch.bfloat16, cuda).block_m for r in rows]
    assert block_ms == sorted(block_ms)
    for r in rows:
        for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
            t = mk.select_tiles(r, dtype, cuda)
            # One pipeline stage holds the rows and the weight tiles (gate and up, or down):
            # all stages within the H200's 227 KB of shared memory.
            stage = (t.block_m + max(2 * t.block_n_up, t.block_n_down)) * t.block_k * size
            assert stage * t.num_stages <= 227 * 1024
            assert min(t.block_m, t.block_n_up, t.block_n_down, t.block_k) >= 16


@pytest.fixture
def no_tf32():
    """The float32 reference must not round its matmul inputs to tf32 either."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


GPU_TOKENS = [1, 2, 7, 16, 64, 255, 1024, 4096, 8192]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (32, 4), (128, 8)])
def test_gpu_token_and_expert_sweep(dtype, num_experts, top_k, no_tf32):
    """Every tile-table row (token counts 1..8192) for Mixtral-, gpt-oss- and Qwen3-MoE-like
    routing; I = 384 is not a multiple of the wider column tiles."""
    for num_tokens in GPU_TOKENS:
        for activation, bias in ((SILU, False), (SWIGLU, True)):
            _compare(_layer(num_tokens, top_k, num_experts, 1024, 384, dtype, bias,
                            seed=num_tokens), activation)


@pytest.mark.gpu
def test_gpu_no_host_sync_and_cuda_graph():
    x, gate_up, down, weights, ids, _, _ = _layer(16, 8, 128, 512, 256, torch.bfloat16, False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mk.fused_experts(x, gate_up, down, weights, ids)  # compile and warm the allocator
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.set_sync_debug_mode("error")  # any torch op that waits for the GPU raises
    try:
        mk.fused_experts(x, gate_up, down, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mk.fused_experts(x, gate_up, down, weights, ids)
    # New routing and inputs in the captured buffers: the replay must follow them.
    x2, _, _, weights2, ids2, _, _ = _layer(16, 8, 128, 512, 256, torch.bfloat16, False, seed=9)
    for dst, src in ((x, x2), (weights, weights2), (ids, ids2)):
        dst.copy_(src)
    graph.replay()
    want = torch_experts(x, gate_up, down, weights, ids)
    scale = want.float().abs().max().item()
    assert (out.float() - want.float()).abs().max().item() <= TOLERANCE[x.dtype] * scale
