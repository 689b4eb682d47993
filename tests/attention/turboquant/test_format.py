"""TURBOQUANT's format: the Lloyd-Max codebooks against Max's table, the randomized Hadamard
rotation, code packing, distortion against the Gaussian Lloyd-Max theory, capacity per memory
budget against bf16, the presets' binding and validation, and the cache's plane layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedserve.attention import AttentionLayerConfig, get_backend_cls
from pagedserve.attention.backends.cpu import CPUAttentionBackend
from pagedserve.attention.backends.turboquant import TurboQuantBackend
from pagedserve.attention.ops import turboquant_format as tqf
from tests.attention.turboquant.harness import PRESETS, _relative_mse

# Max (1960), "Quantizing for minimum distortion", Table I: the optimum levels (positive half)
# and mean squared error for a unit-variance Gaussian.
MAX_LEVELS = {3: (0.2451, 0.7560, 1.3440, 2.1520),
              4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326)}
MAX_DISTORTION = {3: 0.03454, 4: 0.009497}


# ---- format -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [3, 4])
def test_lloyd_max_codebook_matches_max_table(bits):
    levels = tqf.lloyd_max_codebook(bits)
    assert len(levels) == 2 ** bits
    positive = levels[2 ** (bits - 1):]
    np.testing.assert_allclose(positive, MAX_LEVELS[bits], atol=2e-4)
    np.testing.assert_allclose(levels[:2 ** (bits - 1)], [-x for x in reversed(positive)])
    assert tqf.gaussian_distortion(levels) == pytest.approx(MAX_DISTORTION[bits], rel=1e-3)
    # Monte Carlo check of the distortion formula with nearest-level quantization.
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lv = torch.tensor(levels, dtype=torch.float64)
    mse = (x[:, None] - lv).abs().min(dim=1).values.square().mean().item()
    assert mse == pytest.approx(MAX_DISTORTION[bits], rel=0.02)


def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("d", [16, 64, 128])
def test_rotation_is_the_orthogonal_randomized_hadamard(d):
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(1))
    signs = tqf.hadamard_signs(d)
    assert set(signs.tolist()) == {-1.0, 1.0}
    expected = (x * signs) @ _sylvester(d).T / math.sqrt(d)
    torch.testing.assert_close(tqf.rotate(x), expected, rtol=1e-5, atol=1e-5)
    r = tqf.rotation_matrix(d)
    torch.testing.assert_close(r @ r.T, torch.eye(d), rtol=0, atol=1e-5)
    torch.testing.assert_close(tqf.unrotate(tqf.rotate(x)), x, rtol=1e-5, atol=1e-5)
    # Deterministic for a seed, different for another.
    assert torch.equal(tqf.rotation_matrix(d), r)
    assert not torch.equal(tqf.rotation_matrix(d, seed=tqf.ROTATION_SEED + 1), r)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_pack_unpack(bits):
    codes = torch.randint(0, 2 ** bits, (4, 2, 64), generator=torch.Generator().manual_seed(2))
    packed = tqf.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(tqf.unpack_codes(packed, bits, 64), codes)


def test_packing_bit_order():
    # Channel c occupies bits [c * bits, (c + 1) * bits) of a little-endian stream.
    four = tqf.pack_codes(torch.tensor([[1, 2, 15, 0]]), 4)
    assert four.tolist() == [[0x21, 0x0F]]
    three = tqf.pack_codes(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]]), 3)
    word = sum(c << (3 * i) for i, c in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
    assert three.tolist() == [[word & 255, (word >> 8) & 255, word >> 16]]


def _vectors_with_outliers(n: int, d: int, seed: int) -> torch.Tensor:
    """Key-like vectors: a few channels carry most of the energy."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen) + 0.5
    x[:, 3] *= 15.0
    x[:, d // 2] = 8.0 + torch.randn(n, generator=gen)
    return x


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits,preset", [(4, "tq_4bit"), (3, "tq_3bit")])
def test_turboquant_distortion_matches_lloyd_max_theory(d, bits, preset):
    x = _vectors_with_outliers(2048, d, seed=d + bits)
    k_hat, v_hat = tqf.quantize_dequantize(tqf.PRESETS[preset], x, x)
    # Rotated coordinates are ~N(0, 1/d) * |x|: the relative error is the per-coordinate
    # Lloyd-Max distortion, whatever the channel outliers were.
    assert _relative_mse(k_hat, x) == pytest.approx(MAX_DISTORTION[bits], rel=0.2)
    assert _relative_mse(v_hat, x) == pytest.approx(MAX_DISTORTION[bits], rel=0.2)


def test_fp8_keys_and_naive_presets():
    d = 128
    x = _vectors_with_outliers(2048, d, seed=7)
    k_hat, v_hat = tqf.quantize_dequantize(tqf.PRESETS["tq_k8v4"], x, x)
    # e4m3: 3 mantissa bits, relative rounding error uniform in +-2^-4 -> MSE ~ 2^-8 / 3 / 2.
    assert _relative_mse(k_hat, x) < 1e-3
    assert _relative_mse(v_hat, x) == pytest.approx(MAX_DISTORTION[4], rel=0.2)
    for preset, bits in (("naive_int4", 4), ("naive_int3", 3)):
        k_hat, _ = tqf.quantize_dequantize(tqf.PRESETS[preset], x, x)
        step = (x.amax(-1) - x.amin(-1)) / (2 ** bits - 1)
        expected = float((step.square() / 12).sum() * d / x.square().sum())
        assert _relative_mse(k_hat, x) == pytest.approx(expected, rel=0.2)
        # The outliers stretch the naive range: the rotation is what makes TurboQuant better.
        tq = tqf.quantize_dequantize(tqf.PRESETS[f"tq_{bits}bit"], x, x)[0]
        assert _relative_mse(tq, x) < 0.5 * _relative_mse(k_hat, x)


def test_zero_and_constant_vectors_stay_finite():
    x = torch.zeros(3, 64)
    x[1] = 2.5
    for preset in tqf.PRESETS.values():
        k_hat, v_hat = tqf.quantize_dequantize(preset, x, x)
        assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
        torch.testing.assert_close(k_hat[0], x[0])


# ---- capacity ---------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("preset,min_ratio", [("tq_k8v4", 2.5), ("tq_4bit", 3.5),
                                              ("tq_3bit", 4.5)])
def test_blocks_per_budget_vs_bf16(preset, min_ratio, d):
    bs, hkv = 16, 8
    bf16 = CPUAttentionBackend.get_page_size_bytes(bs, hkv, d, torch.bfloat16)
    bound = TurboQuantBackend.for_kv_cache_dtype(preset)
    packed = bound.get_page_size_bytes(bs, hkv, d, bound.get_kv_cache_dtype(preset,
                                                                            torch.bfloat16))
    assert bf16 / packed >= min_ratio
    # The page is exactly the slots: codes plus fp16 meta per token, head and K/V.
    p = tqf.PRESETS[preset]
    per_vector = {"tq_k8v4": (d + 2, d // 2 + 2), "tq_4bit": (d // 2 + 2,) * 2,
                  "tq_3bit": (3 * d // 8 + 2,) * 2}[preset]
    assert packed == bs * hkv * sum(per_vector) == bs * hkv * p.slot_bytes(d)


def test_preset_binding_and_validation():
    bind = TurboQuantBackend.for_kv_cache_dtype
    assert bind("auto") is bind("tq_4bit")
    bound = TurboQuantBackend.for_kv_cache_dtype("tq_3bit")
    assert bound.get_name() == "TURBOQUANT" and bound.lossy_kv_cache
    assert bound.get_kv_cache_shape(5, 16, 3, 64) == (5, 3, 16, 52)
    assert bound.get_kv_cache_dtype("tq_3bit", torch.float32) == torch.uint8
    with pytest.raises(ValueError, match="for_kv_cache_dtype"):
        bound.get_kv_cache_dtype("tq_4bit", torch.float32)
    with pytest.raises(ValueError, match="presets"):
        TurboQuantBackend.for_kv_cache_dtype("int4")
    cpu = torch.device("cpu")
    ok = AttentionLayerConfig(8, 2, 64, torch.float32, kv_cache_dtype="tq_k8v4")
    assert TurboQuantBackend.validate_configuration(ok, 16, cpu) == []
    odd = AttentionLayerConfig(8, 2, 80, torch.float32, kv_cache_dtype="tq_4bit")
    assert any("power of two" in r for r in TurboQuantBackend.validate_configuration(odd, 16,
                                                                                      cpu))
    bad = AttentionLayerConfig(8, 2, 64, torch.float32, kv_cache_dtype="fp8")
    assert any("kv_cache_dtype" in r for r in TurboQuantBackend.validate_configuration(bad, 16,
                                                                                      cpu))
    assert get_backend_cls("TURBOQUANT") is TurboQuantBackend


@pytest.mark.parametrize("capability,preset,refused", [
    ((8, 0), "tq_k8v4", True), ((8, 0), "tq_4bit", False), ((8, 9), "tq_k8v4", False),
    ((9, 0), "tq_k8v4", False)])
def test_fp8_keys_need_compute_capability_8_9(monkeypatch, capability, preset, refused):
    """tq_k8v4's e4m3 conversions do not exist before sm_89: refused there by name."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    layer = AttentionLayerConfig(8, 2, 64, torch.bfloat16, kv_cache_dtype=preset)
    reasons = TurboQuantBackend.validate_configuration(layer, 16, torch.device("cuda"))
    assert any("compute capability 8.9" in r for r in reasons) is refused


@pytest.mark.parametrize("preset", PRESETS)
def test_cache_plane_layout(preset):
    """Each (block, KV head) region is [K code rows | V code rows | K metas | V metas]; the
    planes read back the records `encode_kv` makes, and nothing else of the cache is touched."""
    p = tqf.PRESETS[preset]
    d, bs, hkv, nb = 64, 4, 3, 5
    gen = torch.Generator().manual_seed(11)
    key, value = torch.randn(7, hkv, d, generator=gen), torch.randn(7, hkv, d, generator=gen)
    slots = torch.tensor([0, 5, 19, 6, -1, 13, 3])
    cache = torch.zeros(tqf.cache_shape(p, nb, bs, hkv, d), dtype=torch.uint8)
    tqf.store_kv(p, cache, key, value, slots)
    records = tqf.encode_kv(p, key, value)
    kc, vc = p.key.code_bytes(d), p.value.code_bytes(d)
    km, vm = p.key.meta_bytes, p.value.meta_bytes
    assert p.plane_offsets(d, bs) == (0, bs * kc, bs * (kc + vc), bs * (kc + vc + km))
    region = cache.view(nb, hkv, bs * p.slot_bytes(d))
    written = torch.zeros(nb, bs, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, t = divmod(slot, bs)
        written[b, t] = True
        k_rec, v_rec = records[i, :, :kc + km], records[i, :, kc + km:]
        o = p.plane_offsets(d, bs)
        assert torch.equal(region[b, :, o[0] + t * kc:o[0] + (t + 1) * kc], k_rec[:, :kc])
        assert torch.equal(region[b, :, o[1] + t * vc:o[1] + (t + 1) * vc], v_rec[:, :vc])
        assert torch.equal(region[b, :, o[2] + t * km:o[2] + (t + 1) * km], k_rec[:, kc:])
        assert torch.equal(region[b, :, o[3] + t * vm:o[3] + (t + 1) * vm], v_rec[:, vc:])
    back = tqf.slot_records(p, cache, d)  # [nb, hkv, bs, S]
    valid = slots >= 0  # written[] enumerates slots in increasing order
    assert torch.equal(back.transpose(1, 2)[written], records[valid][slots[valid].argsort()])
    assert not back.transpose(1, 2)[~written].any()
    # Gathered pages convert the same way.
    assert torch.equal(tqf.slot_records(p, cache[[3, 1]], d), back[[3, 1]])


@pytest.mark.parametrize("preset", ["tq_k8v4", "tq_4bit", "tq_3bit"])
def test_plane_layout_aligns_code_rows(preset):
    # d128, block size 16: every plane and every code row starts on a 16-byte boundary (vector
    # loads), metas on 2 bytes, and a (block, head) region is a multiple of 16 bytes.
    p, d, bs = tqf.PRESETS[preset], 128, 16
    assert p.slot_bytes(d) * bs % 16 == 0
    assert all(o % 16 == 0 for o in p.plane_offsets(d, bs))
    assert p.key.code_bytes(d) % 16 == 0 and p.value.code_bytes(d) % 16 == 0
