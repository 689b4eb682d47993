"""Encoder-only (bidirectional, no cache) attention: each backend's `forward_encoder` on a
varlen batch equals a float32 plain-torch softmax computed request by request; backends that
cannot run it refuse it by name at start-up."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention import AttentionLayerConfig, BuilderConfig, get_backend_cls
from pagedserve.attention.encoder import ENCODER_ONLY, EncoderMetadata
from pagedserve.attention.registry import BackendSelectionError, select_backend

LENGTHS = [5, 1, 37, 16, 70, 2]


def reference(q, k, v, lengths, scale, window=None):
    """Per request, per head: softmax(q k^T * scale) v in float32 (GQA by repeating K/V); a
    window keeps keys within window - 1 positions either side."""
    g = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        scores = qs @ ks.transpose(1, 2) * scale
        if window is not None:
            pos = torch.arange(n)
            far = (pos[:, None] - pos[None, :]).abs() >= window
            scores = scores.masked_fill(far, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out.append((p @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


class _Common:
    """The fields of CommonAttentionMetadata that an encoder step reads."""

    def __init__(self, lengths, device):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        self.query_start_loc = cu.to(device)
        self.query_start_loc_cpu = cu.numpy()
        self.context_lens_cpu = torch.zeros(len(lengths), dtype=torch.int32).numpy()
        self.num_reqs, self.num_actual_tokens = len(lengths), int(cu[-1])
        self.max_query_len = max(lengths)


def run_backend(name, dtype, device, heads=(4, 2), head_size=64, lengths=LENGTHS,
                window=None):
    torch.manual_seed(0)
    h, hkv = heads
    t = sum(lengths)
    q = torch.randn(t, h, head_size, dtype=dtype, device=device)
    k = torch.randn(t, hkv, head_size, dtype=dtype, device=device)
    v = torch.randn(t, hkv, head_size, dtype=dtype, device=device)
    layer = AttentionLayerConfig(h, hkv, head_size, dtype, attn_type=ENCODER_ONLY,
                                 sliding_window=window)
    backend = get_backend_cls(name)
    assert not backend.validate_configuration(layer, 16, torch.device(device))
    builder = backend.get_builder_cls()(BuilderConfig.for_layer(
        layer, 16, 8, 256, 16, torch.device(device)))
    md = builder.build_step(_Common(lengths, device))
    out = backend.get_impl_cls()(layer).forward_encoder(q, k, v, md)
    ref = reference(q, k, v, lengths, head_size ** -0.5, window)
    return out.float(), ref


@pytest.mark.parametrize("name", ["CPU", "FLEX_ATTENTION", "TRITON"])
def test_encoder_attention_equals_reference(name):
    out, ref = run_backend(name, torch.float32, "cpu")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["CPU", "FLEX_ATTENTION", "TRITON"])
def test_two_sided_window(name):
    """ModernBERT's local layers: keys within window - 1 positions on either side."""
    out, ref = run_backend(name, torch.float32, "cpu", lengths=[40, 3, 20], window=9)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_cpu_without_gqa_and_one_request():
    out, ref = run_backend("CPU", torch.float32, "cpu", heads=(3, 3), head_size=64,
                           lengths=[9])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_triton_head_size_not_a_power_of_two():
    out, ref = run_backend("TRITON", torch.float32, "cpu", heads=(2, 1), head_size=80,
                           lengths=[3, 40])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_encoder_metadata_refuses_cached_tokens():
    common = _Common([4, 4], "cpu")
    common.context_lens_cpu[1] = 3
    with pytest.raises(ValueError, match="encoder requests run whole"):
        EncoderMetadata.from_common(common)


@pytest.mark.parametrize("name", ["TURBOQUANT", "CPU_MLA", "TRITON_MLA"])
def test_backends_without_it_refuse_it_by_name(name):
    layer = AttentionLayerConfig(4, 2, 64, torch.float16, attn_type=ENCODER_ONLY)
    reasons = get_backend_cls(name).validate_configuration(layer, 16, torch.device("cpu"))
    assert any("encoder-only" in r for r in reasons), reasons


def test_selection_names_the_layers():
    layers = [AttentionLayerConfig(4, 2, 64, torch.float32, attn_type=ENCODER_ONLY,
                                   logits_soft_cap=30.0)] * 2
    with pytest.raises(BackendSelectionError, match="all 2 layers: encoder-only attention "
                                                    "with a logits soft-cap not supported"):
        select_backend("CPU", torch.device("cpu"), layers, 16)
    with pytest.raises(ValueError, match="attn_type must be one of"):
        AttentionLayerConfig(4, 2, 64, torch.float32, attn_type="cross")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["FLASH_ATTN", "FLASHINFER", "TRITON", "FLEX_ATTENTION"])
def test_gpu_backends_encoder_attention(name):
    ok, why = get_backend_cls(name).is_available()
    if not ok:
        pytest.skip(why)
    out, ref = run_backend(name, torch.float16, "cuda", head_size=64)
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)


def test_flash_attn_encoder_hands_back_the_kernels_output(monkeypatch):
    """FLASH_ATTN's encoder call (a stand-in `flash_attn` module on the CPU): its varlen kernel
    gets every request's rows with causal=False, and the kernel's own output comes back, not a
    copy, when it covers every row; with rows past the step's tokens the result is a new
    tensor of every row, the tokens' rows the kernel's."""
    import sys
    import types

    from pagedserve.attention.backends.encoder_gpu import flash_attn_encoder

    made = []

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               softmax_scale, causal, **extra):
        assert not causal and torch.equal(cu_seqlens_q, cu_seqlens_k)
        lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        assert max_seqlen_q == max(lengths)
        made.append(reference(q, k, v, lengths, softmax_scale).to(q.dtype))
        return made[-1]

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_varlen_func=varlen))
    torch.manual_seed(0)
    t = sum(LENGTHS)
    q, k, v = (torch.randn(t + 3, 4, 16) for _ in range(3))
    md = EncoderMetadata.from_common(_Common(LENGTHS, "cpu"))
    out = flash_attn_encoder("fa2", q[:t], k[:t], v[:t], md, 0.25, None)
    assert out is made[-1]
    padded = flash_attn_encoder("fa2", q, k, v, md, 0.25, None)  # 3 rows past the tokens
    assert padded.shape == q.shape and torch.equal(padded[:t], made[-1])


def test_flashinfer_encoder_hands_back_the_wrappers_output():
    """FLASHINFER's encoder call (a stand-in planned wrapper): the wrapper's own output when it
    covers every row; with rows past the step's tokens, a new tensor holding it."""
    from pagedserve.attention.backends.encoder_gpu import (
        FlashInferEncoderImpl,
        RaggedEncoderMetadata,
    )

    class Impl(FlashInferEncoderImpl):
        num_heads, value_head_size = 4, 16

    made = []

    class Wrapper:
        def run(self, q, k, v):
            made.append(reference(q, k, v, LENGTHS, 0.25))
            return made[-1]

    torch.manual_seed(0)
    t = sum(LENGTHS)
    q, k, v = (torch.randn(t + 3, 4, 16) for _ in range(3))
    base = EncoderMetadata.from_common(_Common(LENGTHS, "cpu"))
    md = RaggedEncoderMetadata(base.cu_seqlens, base.cu_seqlens_cpu, base.max_seqlen,
                               base.num_reqs, base.num_tokens, wrapper=Wrapper())
    assert Impl().forward_encoder(q[:t], k[:t], v[:t], md) is made[-1]
    padded = Impl().forward_encoder(q, k, v, md)
    assert padded.shape == (t + 3, 4, 16) and torch.equal(padded[:t], made[-1])
