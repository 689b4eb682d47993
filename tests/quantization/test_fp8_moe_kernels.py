"""FP8 experts in the grouped GEMM (interpreter, float32 model dtype) against a per-pair loop
over the dequantized weights, activations quantized the same way (our group kernel, so that
both run the interpreter's e4m3 cast): blocks that do not divide the sizes, several tokens per
expert, experts no token chose."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.quantization.ops.fp8_block_gemm import quantize_per_token_group
from pagedserve.quantization.ops.fp8_moe_kernels import fp8_fused_experts
from tests.quantization import fp8_writer as w


def _dq(x: torch.Tensor, group: int) -> torch.Tensor:
    q, s = quantize_per_token_group(x, group)
    return q.float() * s.repeat_interleave(group, 1)[:, :x.shape[1]]


def _stacked(experts: list[tuple], parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [E, rows, cols] and scales with each part's block rows in turn."""
    codes = torch.stack([torch.cat([p[0] for p in e]) for e in experts])
    scales = torch.stack([torch.cat([p[1] for p in e]) for e in experts])
    assert all(len(e) == parts for e in experts)
    return codes, scales


@pytest.mark.parametrize("tokens,block", [(3, (32, 32)), (9, (24, 32))])
def test_fp8_experts_equal_the_dequantized_loop(tokens, block):
    torch.manual_seed(tokens)
    num_experts, hidden, inter, top_k = 4, 48, 40, 2
    gate_up, down, gate_up_deq, down_deq = [], [], [], []
    for _ in range(num_experts):
        g, u = (w.quantize(torch.randn(inter, hidden), "block", block) for _ in range(2))
        d = w.quantize(torch.randn(hidden, inter), "block", block)
        gate_up.append(((g[0], g[1]), (u[0], u[1])))
        down.append(((d[0], d[1]),))
        gate_up_deq.append(torch.cat([g[2], u[2]]))
        down_deq.append(d[2])
    w13, w13_s = _stacked(gate_up, 2)
    w2, w2_s = _stacked(down, 1)
    x = torch.randn(tokens, hidden)
    ids = torch.randint(0, num_experts - 1, (tokens, top_k))  # the last expert idle
    weights = torch.rand(tokens, top_k)
    got = fp8_fused_experts(x, w13, w13_s, w2, w2_s, weights, ids, block)
    want = torch.zeros(tokens, hidden)
    x_hat = _dq(x, block[1])
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up = (x_hat[t:t + 1] @ gate_up_deq[e].T).chunk(2, dim=-1)
            act = _dq(F.silu(gate) * up, block[1])
            want[t] += (act @ down_deq[e].T)[0] * weights[t, j]
    assert float((got - want).norm() / want.norm()) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_gpu_fp8_experts_on_the_qwen3_30b_a3b_shape(tokens):
    """128 experts of 768, hidden 2048, top 8, bf16, 128 x 128 blocks: against the float
    experts on the dequantized weights (the intermediate's FP8 rounding is the difference)."""
    from pagedserve.models.moe import torch_experts
    from pagedserve.quantization.fp8_format import quantize_blocks

    torch.manual_seed(0)
    num_experts, hidden, inter, top_k = 128, 2048, 768, 8
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda") * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, device="cuda") * inter ** -0.5
    q13, s13 = zip(*(quantize_blocks(w, (128, 128)) for w in w13), strict=True)
    q2, s2 = zip(*(quantize_blocks(w, (128, 128)) for w in w2), strict=True)
    q13, s13, q2, s2 = (torch.stack(t) for t in (q13, s13, q2, s2))
    deq13 = q13.float() * s13.repeat_interleave(128, 1).repeat_interleave(128, 2)
    deq2 = q2.float() * s2.repeat_interleave(128, 1).repeat_interleave(128, 2)
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    logits = torch.randn(tokens, num_experts, device="cuda")
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k)
    got = fp8_fused_experts(x, q13, s13, q2, s2, weights.bfloat16(), ids, (128, 128)).float()
    want = torch_experts(_dq(x.float(), 128), deq13, deq2, weights, ids)
    assert float((got - want).norm() / want.norm()) < 0.05
