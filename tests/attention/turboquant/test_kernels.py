"""TURBOQUANT: the format (codebooks, rotation, packing, distortion against the Gaussian
Lloyd-Max theory), capacity per memory budget, the backend against float32 references on random
paged data, the Triton kernels in the interpreter against the torch format, and the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedserve.attention import AttentionLayerConfig, BuilderConfig, get_backend_cls
from pagedserve.attention.backends.cpu import CPUAttentionBackend
from pagedserve.attention.backends.turboquant import TurboQuantBackend
from pagedserve.attention.ops import turboquant_format as tqf
from pagedserve.scheduler.metadata import BlockTable, CommonMetadataBuilder
from tests.utils.conformance import BATCHES, reference_attention

PRESETS = list(tqf.PRESETS)

# Max (1960), "Quantizing for minimum distortion", Table I: the optimum levels (positive half)
# and mean squared error for a unit-variance Gaussian.
MAX_LEVELS = {3: (0.2451, 0.7560, 1.3440, 2.1520),
              4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326)}
MAX_DISTORTION = {3: 0.03454, 4: 0.009497}


# ---- format -------------------------------------------------------------------------------------

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


def _relative_mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).square().sum() / b.square().sum())


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


# ---- capacity -----------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("preset,min_ratio", [("tq_k8v4", 2.5), ("tq_4bit", 3.5),
                                              ("tq_3bit", 4.5)])
def test_blocks_per_budget_vs_bf16(preset, min_ratio, d):
    bs, hkv = 16, 8
    bf16 = CPUAttentionBackend.get_page_size_bytes(bs, hkv, d, torch.bfloat16)
    bound = TurboQuantBackend.for_preset(preset)
    packed = bound.get_page_size_bytes(bs, hkv, d, bound.get_kv_cache_dtype(preset,
                                                                            torch.bfloat16))
    assert bf16 / packed >= min_ratio
    # The page is exactly the slots: codes plus fp16 meta per token, head and K/V.
    p = tqf.PRESETS[preset]
    per_vector = {"tq_k8v4": (d + 2, d // 2 + 2), "tq_4bit": (d // 2 + 2,) * 2,
                  "tq_3bit": (3 * d // 8 + 2,) * 2}[preset]
    assert packed == bs * hkv * sum(per_vector) == bs * hkv * p.slot_bytes(d)


def test_preset_binding_and_validation():
    assert TurboQuantBackend.for_preset("auto") is TurboQuantBackend.for_preset("tq_4bit")
    bound = TurboQuantBackend.for_preset("tq_3bit")
    assert bound.get_name() == "TURBOQUANT" and bound.lossy_kv_cache
    assert bound.get_kv_cache_shape(5, 16, 3, 64) == (5, 3, 16, 52)
    assert bound.get_kv_cache_dtype("tq_3bit", torch.float32) == torch.uint8
    with pytest.raises(ValueError, match="for_preset"):
        bound.get_kv_cache_dtype("tq_4bit", torch.float32)
    with pytest.raises(ValueError, match="presets"):
        TurboQuantBackend.for_preset("int4")
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


# ---- the backend on random paged data -------------------------------------------------------

def run_turboquant_case(preset: str, batch: list[tuple[int, int]], block_size: int = 16,
                        num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 64,
                        dtype: torch.dtype = torch.float32, window: int | None = None,
                        soft_cap: float | None = None, use_kernels: bool = False,
                        device: str = "cpu", seed: int = 0, tiles=None,
                        num_splits: int | None = None, fill: int = 0,
                        decode_kernel: str | None = None, fused: bool = False):
    """Context K/V written into shuffled pages through the torch format, then one step of the
    backend (builder + impl) over the new tokens (tiles: the kernels' launch shape, if given;
    fill: the byte of every slot not written, 255 makes NaN metas and fp8 codes;
    decode_kernel: 'auto', 'cuda' or 'triton' for decode steps, default 'triton' when tiles
    are given, as they are the Triton kernel's; fused: query/key/value as views of one fused
    QKV output and the output with padded rows, as a model hands them over).
    Returns (output, cache, per request: (query, K, V, context length)), everything needed to
    build references."""
    gen = torch.Generator().manual_seed(seed)
    p = tqf.PRESETS[preset]
    backend = TurboQuantBackend.for_preset(preset)
    hkv, d, bs = num_kv_heads, head_size, block_size
    blocks_per_req = [math.ceil((c + q) / bs) for c, q in batch]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    if fill:  # block 0 never written: the prefetching loop's unmasked reads past the context
        perm.remove(0)  # land there, so they see the fill (NaN metas and fp8 codes at 255)
        perm.append(0)
    block_ids, pos = [], 0
    for n in blocks_per_req:
        block_ids.append(perm[pos:pos + n])
        pos += n
    cache = torch.full(backend.get_kv_cache_shape(num_blocks, bs, hkv, d), fill,
                       dtype=torch.uint8)
    reqs = []
    for ids, (c, q) in zip(block_ids, batch, strict=True):
        k = (torch.randn(c + q, hkv, d, generator=gen) + 0.3).to(dtype)
        k[:, :, 1] *= 4  # an outlier channel, as real keys have
        v = torch.randn(c + q, hkv, d, generator=gen).to(dtype)
        query = torch.randn(q, num_heads, d, generator=gen).to(dtype)
        slots = torch.tensor([ids[t // bs] * bs + t % bs for t in range(c)], dtype=torch.int64)
        tqf.store_kv(p, cache, k[:c], v[:c], slots)
        reqs.append((query, k, v, c))
    cache = cache.to(device)

    num_prefills = sum(1 for _, q in batch if q > 1)
    max_blocks = max(blocks_per_req) + 2
    table = BlockTable(len(batch), max_blocks)
    for row, ids in enumerate(block_ids):
        table.add_row(row, ids)
    common = CommonMetadataBuilder(len(batch), sum(q for _, q in batch), max_blocks, bs,
                                   torch.device(device)).build(
        rows=np.arange(len(batch)), num_computed=np.array([c for c, _ in batch], np.int32),
        num_scheduled=np.array([q for _, q in batch], np.int32), num_prefills=num_prefills,
        block_table=table)
    config = BuilderConfig(num_heads, hkv, d, dtype, bs, len(batch), common.num_actual_tokens,
                           max_blocks, torch.device(device), window, soft_cap, preset)
    builder = backend.get_builder_cls()(config)
    builder.use_kernels = use_kernels
    builder.decode_tiles = builder.prefill_tiles = tiles
    builder.num_splits = num_splits
    if decode_kernel is not None or tiles is not None:
        builder.decode_kernel = decode_kernel or "triton"
    impl = backend.get_impl_cls()(num_heads, d, d ** -0.5, hkv, window, soft_cap, preset)
    query = torch.cat([r[0] for r in reqs]).to(device)
    key = torch.cat([r[1][r[3]:] for r in reqs]).to(device)
    value = torch.cat([r[2][r[3]:] for r in reqs]).to(device)
    output = None
    if fused:
        t = query.shape[0]
        qkv = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], 1)
        query, key, value = (x.view(t, -1, d) for x in qkv.split(
            [num_heads * d, hkv * d, hkv * d], dim=1))
        output = torch.empty(t, num_heads, d + 8, dtype=dtype, device=device)[..., :d]
    out = impl.forward(query, key, value, cache, builder.build(common), output=output)
    # The new tokens' slots hold their encodings.
    new_slots = torch.tensor([ids[t // bs] * bs + t % bs for ids, (c, q) in
                              zip(block_ids, batch, strict=True) for t in range(c, c + q)])
    return out.cpu(), cache.cpu(), reqs, new_slots, key.cpu(), value.cpu()


def references(preset: str, reqs, window=None, soft_cap=None):
    """Per request: float32 attention over (dequantized context + exact new tokens), and over
    the exact K/V."""
    p = tqf.PRESETS[preset]
    dequant, exact = [], []
    for query, k, v, c in reqs:
        d = k.shape[-1]
        kq, vq = tqf.quantize_dequantize(p, k[:c].float(), v[:c].float())
        k_seen = torch.cat([kq, k[c:].float()])
        v_seen = torch.cat([vq, v[c:].float()])
        scale = d ** -0.5
        dequant.append(reference_attention(query, k_seen, v_seen, c, scale, window, soft_cap))
        exact.append(reference_attention(query, k, v, c, scale, window, soft_cap))
    return torch.cat(dequant), torch.cat(exact)


def _check_new_slots(preset, cache, new_slots, key, value):
    p = tqf.PRESETS[preset]
    bs = cache.shape[2]
    stored = tqf.slot_records(p, cache, key.shape[-1])[new_slots // bs, :, new_slots % bs]
    assert torch.equal(stored, tqf.encode_kv(p, key.float(), value.float()))


# Relative error of the output against attention over the exact K/V: a few times the preset's
# K/V round-trip error (these random keys are near-Gaussian; 3-bit and naive ones lose most).
EXACT_TOLERANCE = {"tq_k8v4": 0.12, "tq_4bit": 0.2, "tq_3bit": 0.35, "naive_int4": 0.3,
                   "naive_int3": 0.6}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_backend_matches_references(preset, batch):
    out, cache, reqs, new_slots, key, value = run_turboquant_case(preset, BATCHES[batch])
    dequant, exact = references(preset, reqs)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)
    assert _relative_mse(out, exact) ** 0.5 < EXACT_TOLERANCE[preset]
    _check_new_slots(preset, cache, new_slots, key, value)


@pytest.mark.parametrize("window,soft_cap,block_size,num_heads", [
    (8, None, 16, 8), (None, 5.0, 32, 4), (None, None, 1, 2), (5, 3.0, 16, 6)])
def test_backend_window_soft_cap_block_sizes(window, soft_cap, block_size, num_heads):
    preset = "tq_4bit"
    out, *_ = run_turboquant_case(preset, BATCHES["mixed"], block_size, num_heads,
                                  window=window, soft_cap=soft_cap, seed=3)
    reqs = run_turboquant_case(preset, BATCHES["mixed"], block_size, num_heads, window=window,
                               soft_cap=soft_cap, seed=3)[2]
    dequant, _ = references(preset, reqs, window, soft_cap)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)


def test_backend_half_precision():
    out, _, reqs, *_ = run_turboquant_case("tq_k8v4", BATCHES["mixed"], dtype=torch.bfloat16)
    dequant, _ = references("tq_k8v4", reqs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dequant, rtol=2e-2, atol=2e-2)


# ---- Triton kernels (interpreter on the CPU, small shapes) ------------------------------------

def _kernels_runnable() -> bool:
    return torch.cuda.is_available() or get_backend_cls("TRITON").is_available()[0]


kernels = pytest.mark.skipif(not _kernels_runnable(), reason="needs CUDA or TRITON_INTERPRET=1")
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@kernels
@pytest.mark.parametrize("preset", PRESETS)
def test_kernels_store_and_attend(preset):
    """The fused store writes the reference's exact bytes; the attention kernel matches float32
    attention over the dequantized context plus the exact new tokens."""
    out, cache, reqs, new_slots, key, value = run_turboquant_case(
        preset, BATCHES["mixed"], use_kernels=True, device=KERNEL_DEVICE)
    _check_new_slots(preset, cache, new_slots, key, value)
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)


@kernels
@pytest.mark.parametrize("batch,window,soft_cap,block_size,num_heads,dtype", [
    ("chunked_prefill", 8, None, 16, 8, torch.float32),
    ("decode", None, 5.0, 1, 8, torch.float32),
    ("prefill", None, None, 32, 2, torch.float16),
])
@pytest.mark.parametrize("preset", ["tq_3bit", "tq_4bit", "tq_k8v4"])  # each code-load path
def test_kernels_shapes_and_options(batch, window, soft_cap, block_size, num_heads, dtype,
                                    preset):
    args = dict(block_size=block_size, num_heads=num_heads, window=window, soft_cap=soft_cap,
                dtype=dtype, head_size=32, seed=5, device=KERNEL_DEVICE)
    out, cache, reqs, new_slots, key, value = run_turboquant_case(
        preset, BATCHES[batch], use_kernels=True, **args)
    dequant, _ = references(preset, reqs, window, soft_cap)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), dequant, rtol=tol, atol=tol)
    _check_new_slots(preset, cache, new_slots, key, value)


@kernels
@pytest.mark.parametrize("batch,window,soft_cap,block_size,head_size", [
    ("chunked_prefill", 8, None, 16, 32), ("decode", 20, 5.0, 1, 32),
    ("mixed", None, None, 32, 32), ("decode", None, None, 16, 64)])  # 64: two 3-bit chunks
@pytest.mark.parametrize("preset", ["tq_3bit", "tq_4bit", "tq_k8v4"])
def test_kernels_register_prefetch(batch, window, soft_cap, block_size, head_size, preset):
    """The loop that loads the next tile's codes and metas (and the page numbers two tiles
    ahead) while the current one is computed: windows (tiles starting past 0), page sizes
    below and above the tile, prefill and decode; unwritten slots all 0xFF (NaN metas and fp8
    codes), which the unmasked loads read past the context."""
    from pagedserve.attention.ops.turboquant_kernels import TQTiles

    out, _, reqs, _, _, _ = run_turboquant_case(
        preset, BATCHES[batch], block_size, 8, use_kernels=True, window=window,
        soft_cap=soft_cap, head_size=head_size, seed=6, device=KERNEL_DEVICE,
        tiles=TQTiles.parse("16/16/1/1/prmt/0/1"), fill=255)
    dequant, _ = references(preset, reqs, window, soft_cap)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)


@kernels
@pytest.mark.parametrize("preset,tiles", [
    ("tq_3bit", "16/16/1/1/select"), ("tq_4bit", "16/64/2/1/select"),
    ("tq_k8v4", "16/16/1/1/select"), ("naive_int3", "16/32/1/1/select"),
    ("tq_4bit", "32/16/1/1/table"), ("tq_3bit", "16/32/1/1/gather"),
    ("tq_4bit", "16/16/2/1/gather"), ("tq_3bit", "16/32/1/1/prmt"), ("tq_4bit", "32/16/1/1/prmt"),
    ("tq_k8v4", "16/16/1/1/prmt"),
    # register prefetch of the next tile (the last field)
    ("tq_3bit", "16/16/1/1/prmt/0/1"), ("tq_4bit", "16/32/1/1/prmt/0/1"),
    ("tq_k8v4", "16/16/1/1/prmt/0/1"), ("naive_int3", "16/16/1/1/table/0/1"),
    ("tq_4bit", "32/16/1/1/select/0/1")])
def test_kernels_tile_configs_and_lookups(preset, tiles):
    """Other launch shapes and the select-tree codebook lookup agree with the reference."""
    from pagedserve.attention.ops.turboquant_kernels import TQTiles

    out, cache, reqs, new_slots, key, value = run_turboquant_case(
        preset, BATCHES["mixed"], use_kernels=True, device=KERNEL_DEVICE, head_size=32, seed=9,
        tiles=TQTiles.parse(tiles))
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)
    _check_new_slots(preset, cache, new_slots, key, value)


@kernels
@pytest.mark.parametrize("preset,num_splits,window,soft_cap,tiles", [
    ("tq_4bit", 3, None, None, "16/16/1/1/prmt"), ("tq_k8v4", 2, None, 5.0, "16/32/1/1/prmt"),
    ("tq_3bit", 5, 20, None, "16/16/1/1/gather"), ("naive_int4", 4, None, None, "16/16/1/1"),
    ("tq_4bit", 16, None, None, "16/16/1/1/prmt"),
    ("tq_3bit", 3, 20, None, "16/16/1/1/prmt/0/1"), ("tq_k8v4", 4, None, 5.0, "16/16/1/1/prmt/0/1"),
    ("naive_int4", 2, None, None, "16/16/1/1/table/0/1")])
def test_kernels_split_kv_decode(preset, num_splits, window, soft_cap, tiles):
    """Split-KV decode: each request's context cut into num_splits ranges (some empty when
    there are more splits than tiles), partials merged by reduce_split_kv; the new token is
    attended by the last split alone. Matches the reference like the unsplit kernel."""
    from pagedserve.attention.ops.turboquant_kernels import TQTiles

    batch = [(70, 1), (16, 1), (5, 1), (0, 1), (47, 1)]
    out, cache, reqs, new_slots, key, value = run_turboquant_case(
        preset, batch, use_kernels=True, device=KERNEL_DEVICE, head_size=32, seed=11,
        num_heads=8, num_kv_heads=2, window=window, soft_cap=soft_cap,
        tiles=TQTiles.parse(tiles), num_splits=num_splits, fill=255)
    dequant, _ = references(preset, reqs, window, soft_cap)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)
    _check_new_slots(preset, cache, new_slots, key, value)


@kernels
@pytest.mark.parametrize("lookup", ["table", "select", "gather", "prmt"])
@pytest.mark.parametrize("preset", ["tq_4bit", "tq_k8v4", "tq_3bit"])
def test_kernels_half_precision_dots(preset, lookup, monkeypatch):
    """The tensor-core path (level tables in the input dtype, half-precision dots) that the GPU
    runs, here in fp16 (the interpreter's bf16 is broken)."""
    import functools

    from pagedserve.attention.ops import turboquant_kernels as tqk

    monkeypatch.setattr(tqk, "tq_attention", functools.partial(tqk.tq_attention, upcast=False))
    out, _, reqs, *_ = run_turboquant_case(
        preset, BATCHES["mixed"], use_kernels=True, device=KERNEL_DEVICE, head_size=32,
        dtype=torch.float16, seed=4, tiles=tqk.TQTiles(16, 32, 1, 1, lookup))
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out.float(), dequant, rtol=2e-2, atol=2e-2)


@kernels
@pytest.mark.parametrize("lookup", ["table", "select", "gather", "prmt"])
@pytest.mark.parametrize("preset", PRESETS)
def test_kernel_dequantization_is_exact(preset, lookup):
    """The kernel's code unpacking and codebook lookup (table, select tree, shuffle gather; for
    'prmt' its stand-in without inline PTX: the word loads and channel order) give
    exactly the format's levels for every code row of a block, K and V; the scales come from
    its fp16 metas."""
    from pagedserve.attention.ops import turboquant_kernels as tqk

    p, d, bs = tqf.PRESETS[preset], 32, 16
    gen = torch.Generator().manual_seed(12)
    key, value = torch.randn(bs, 1, d, generator=gen) * 3, torch.randn(bs, 1, d, generator=gen)
    cache = torch.zeros(tqf.cache_shape(p, 1, bs, 1, d), dtype=torch.uint8)
    tqf.store_kv(p, cache, key, value, torch.arange(bs))
    records = tqf.slot_records(p, cache, d)[0, 0]
    tensors = tqk.format_tensors(p, d, torch.device("cpu"))
    cache16, layout = tqk._layout_args(p, cache, d)
    k_rec, v_rec = records[:, :p.value_offset(d)], records[:, p.value_offset(d):]
    for codec, rec, levels, prefix in ((p.key, k_rec, tensors.k_levels, "K"),
                                       (p.value, v_rec, tensors.v_levels, "V")):
        args = tqk._codec_args(prefix, codec, d)
        values = torch.empty(bs, d, device=KERNEL_DEVICE)
        scale = torch.empty(bs, device=KERNEL_DEVICE)
        _dequant_probe_kernel[(1,)](
            cache.to(KERNEL_DEVICE), cache16.to(KERNEL_DEVICE), levels.to(KERNEL_DEVICE),
            values, scale,
            CODES_OFF=0 if prefix == "K" else layout["V_CODES_OFF"],
            META_OFF=layout[f"{prefix}_META_OFF"], N=bs, HEAD_SIZE=d,
            KIND=args[f"{prefix}_KIND"], BITS=codec.bits, G=args[f"{prefix}_GROUP"],
            CODE_BYTES=codec.code_bytes(d), META_N=args[f"{prefix}_META_N"],
            LOOKUP=tqk.PRMT_STAND_IN if lookup == "prmt" else tqk.LOOKUPS[lookup])
        values, scale = values.cpu(), scale.cpu()
        n = codec.code_bytes(d)
        codes = tqf.unpack_codes(rec[:, :n], codec.bits, d)
        norm = rec[:, n:n + 2].contiguous().view(torch.float16)[:, 0].float()
        if codec.kind == "uniform":
            torch.testing.assert_close(values, tqf.decode_vectors(rec, codec, d), rtol=0,
                                       atol=1e-5)
            assert torch.equal(scale, torch.ones(bs))
            continue
        if codec.kind == "fp8":
            unit = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
        else:
            unit = tqf.codebook_levels(codec)[codes]
        assert torch.equal(values, unit)
        torch.testing.assert_close(scale, norm / math.sqrt(d), rtol=1e-6, atol=0)


def _run_ptx(asm: str, operands: list[int]) -> list[int]:
    """Execute the integer PTX subset of the 'prmt' lookup's inline asm (and/or/shl/shr/lop3/
    prmt .b32, mov.b32 of registers and of a {lo, hi} pair) on Python ints: operands holds $0..$N
    (outputs first, ignored) and returns them after the block."""
    regs: dict[str, int] = {f"${i}": v for i, v in enumerate(operands)}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) & 0xFFFFFFFF if tok[0].isdigit() else regs[tok]

    for line in asm.replace("{\n", "\n").split(";"):
        line = line.strip().strip("{}").strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):
            pair, src = args.rsplit(",", 1)
            lo, hi = (t.strip() for t in pair.strip("{} ").split(","))
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        dst, *src = (t.strip() for t in args.split(","))
        x = [val(t) for t in src]
        if op == "mov.b32":
            r = x[0]
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "or.b32":
            r = x[0] | x[1]
        elif op == "shl.b32":
            r = (x[0] << x[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            r = x[0] >> x[1]
        elif op == "lop3.b32":  # the truth table's bits indexed by (a, b, c) = (0xF0, 0xCC, 0xAA)
            r = 0
            for bit in range(32):
                a, b, c = ((v >> bit) & 1 for v in x[:3])
                r |= ((x[3] >> (a << 2 | b << 1 | c)) & 1) << bit
        elif op == "cvt.rn.f16x2.e4m3x2":  # two fp8 bytes -> two fp16, byte 1 to the high half
            pair = torch.tensor([x[0] & 255, x[0] >> 8], dtype=torch.uint8)
            halves = pair.view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16)
            r = (int(halves[0]) & 0xFFFF) | (int(halves[1]) & 0xFFFF) << 16
        elif op == "prmt.b32":
            src_bytes = [(x[0] >> 8 * i) & 255 for i in range(4)] + \
                        [(x[1] >> 8 * i) & 255 for i in range(4)]
            r = 0
            for i in range(4):
                sel = (x[2] >> 4 * i) & 15
                byte = src_bytes[sel & 7]
                if sel & 8:
                    byte = 255 if byte & 128 else 0
                r |= byte << 8 * i
        else:
            raise AssertionError(f"unexpected PTX op {op}")
        regs[dst] = r
    return [regs[f"${i}"] for i in range(len(operands))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [3, 4])
def test_prmt_lookup_asm_gives_the_levels(bits, dtype):
    """The 'prmt' lookup's inline PTX (CUDA only: the interpreter runs a stand-in) run by a
    small PTX emulator: every code of words cut from real packed code rows maps to its
    codebook level's exact 16-bit pattern, output k holding channel k of the word."""
    from pagedserve.attention.ops import turboquant_kernels as tqk

    codec = tqf.VectorCodec("lloyd_max", bits)
    levels = tqf.codebook_levels(codec).to(dtype)
    table = [int(w) & 0xFFFFFFFF for w in tqk.byte_plane_table(levels)]
    asm = (tqk.PRMT4_ASM if bits == 4 else tqk.PRMT3_ASM).value
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 1 << bits, (64, 32), generator=gen)
    codes[0, :16] = torch.arange(16) % (1 << bits)  # every code at every position
    codes[1, :16] = torch.arange(16).flip(0) % (1 << bits)
    packed = tqf.pack_codes(codes, bits)  # [64, 4 * bits] bytes: 4 words of 8 codes per row
    words = packed.view(64, 4, bits).to(torch.int64)
    words = sum(words[..., k] << 8 * k for k in range(bits))
    if bits == 3:  # the GPU path's 24-bit groups come with another group's byte on top
        words = words | (torch.randint(0, 256, words.shape, generator=gen) << 24)
    expected = levels.view(torch.int16).to(torch.int64) & 0xFFFF
    for r in range(codes.shape[0]):
        for g in range(4):
            out = _run_ptx(asm, [0] * 8 + [int(words[r, g])] + table)[:8]
            assert out == [int(expected[c]) for c in codes[r, 8 * g:8 * g + 8]], (r, g)


def test_fp8_words_asm_converts_exactly():
    """The prefetching loop's fp8 key conversion (inline PTX: a word of 4 e4m3 codes -> 4
    fp16) run by the PTX emulator: every byte value at every position, as torch converts."""
    from pagedserve.attention.ops import turboquant_kernels as tqk

    every = torch.arange(256, dtype=torch.int64)
    every = every[~torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
                  .isnan()]
    expected = (every.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
                .view(torch.int16).to(torch.int64) & 0xFFFF)
    for shift in range(4):
        rolled = every.roll(17 * shift + 1)
        for i in range(every.numel()):
            codes = [int(every[i]), int(rolled[i]), int(every[-1 - i]), int(rolled[-1 - i])]
            codes = codes[shift:] + codes[:shift]
            word = sum(c << 8 * k for k, c in enumerate(codes))
            out = _run_ptx(tqk.FP8X4_ASM.value, [0] * 4 + [word])[:4]
            lookup = {int(b): int(e) for b, e in zip(every, expected, strict=True)}
            assert out == [lookup[c] for c in codes], codes


@kernels
def test_decode_benchmark_tile_sweep_runs():
    """benchmarks/kv_quant_quality.py --kernel-bench --tq-tiles: one row per preset and tile
    config next to the TRITON row, in the interpreter at a tiny size (float32)."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).parents[3] / "benchmarks" / "kv_quant_quality.py"
    spec = importlib.util.spec_from_file_location("kv_quant_quality", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    tiles = ["16/16/1/1", "16/32/1/1/select"]
    rows = bench.decode_benchmark(num_seqs=2, context=40, num_heads=4, num_kv_heads=2,
                                  head_size=32, presets=("tq_4bit", "tq_k8v4"), tq_tiles=tiles,
                                  device=KERNEL_DEVICE, dtype=torch.float32, warmup=0, iters=1)
    assert [(r["impl"], r["tiles"]) for r in rows] == [("TRITON float32", "")] + [
        (f"TURBOQUANT {p}", t) for p in ("tq_4bit", "tq_k8v4")
        for t in ("16/16/1/1/table", "16/32/1/1/select")]
    assert all(r["rel_err"] < 0.2 for r in rows)
    # The same preset gives the same output whatever the launch shape.
    assert rows[1]["rel_err"] == pytest.approx(rows[2]["rel_err"], rel=1e-3)
    # --tq-splits: one row per split count, labelled, the same output.
    rows = bench.decode_benchmark(num_seqs=2, context=40, num_heads=4, num_kv_heads=2,
                                  head_size=32, presets=("tq_4bit",), tq_tiles=["16/16/1/1/prmt"],
                                  device=KERNEL_DEVICE, dtype=torch.float32, warmup=0, iters=1,
                                  tq_splits=[1, 3])
    assert [r["tiles"] for r in rows[1:]] == ["16/16/1/1/prmt x1", "16/16/1/1/prmt x3"]
    assert rows[1]["rel_err"] == pytest.approx(rows[2]["rel_err"], rel=1e-3)


def test_tile_config_parsing():
    from pagedserve.attention.ops.turboquant_kernels import DECODE_TILES, TQTiles

    assert TQTiles.parse("16/64/4/2") == TQTiles(16, 64, 4, 2, "table")
    assert TQTiles.parse(" 16/128/8/3/select ") == TQTiles(16, 128, 8, 3, "select")
    assert TQTiles.parse("16/32/4/2/gather").lookup == "gather"
    assert TQTiles.parse("16/64/8/2/prmt").lookup == "prmt"
    assert TQTiles.parse("16/64/8/2/prmt/128") == TQTiles(16, 64, 8, 2, "prmt", 128)
    assert str(TQTiles(16, 64, 8, 2, "prmt", 128)) == "16/64/8/2/prmt/128"
    assert TQTiles.parse("16/32/4/1/prmt/128/1") == TQTiles(16, 32, 4, 1, "prmt", 128, 1)
    assert str(TQTiles(16, 32, 4, 1, "prmt", 0, 1)) == "16/32/4/1/prmt/0/1"
    assert TQTiles.parse(str(DECODE_TILES)) == DECODE_TILES
    for bad in ("16/64/4", "16/48/4/2", "16/64/4/2/lut", "a/64/4/2", "16/8/4/2", "16/64/3/2",
                "16/64/4/2/prmt/x", "16/64/4/2/prmt/300"):
        with pytest.raises(ValueError):
            TQTiles.parse(bad)


if _kernels_runnable():
    import triton
    import triton.language as tl

    from pagedserve.attention.ops.fp8 import fp32_to_e4m3_bits
    from pagedserve.attention.ops.turboquant_kernels import _load_vectors

    @triton.jit
    def _dequant_probe_kernel(cache_ptr, cache16_ptr, levels_ptr, values_ptr, scale_ptr,
                              CODES_OFF: tl.constexpr, META_OFF: tl.constexpr,
                              N: tl.constexpr, HEAD_SIZE: tl.constexpr, KIND: tl.constexpr,
                              BITS: tl.constexpr, G: tl.constexpr, CODE_BYTES: tl.constexpr,
                              META_N: tl.constexpr, LOOKUP: tl.constexpr):
        rows = tl.arange(0, N)
        offs = tl.arange(0, HEAD_SIZE)
        values, scale = _load_vectors(cache_ptr + CODES_OFF + rows * CODE_BYTES,
                                      cache16_ptr + META_OFF + rows * META_N, rows < N,
                                      levels_ptr, HEAD_SIZE, KIND, BITS, G, LOOKUP,
                                      values_ptr.dtype.element_ty)
        tl.store(values_ptr + rows[:, None] * HEAD_SIZE + offs[None, :], values.to(tl.float32))
        tl.store(scale_ptr + rows, scale)

    @triton.jit
    def _convert_fp8_kernel(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, fp32_to_e4m3_bits(tl.load(x_ptr + offs)).to(tl.uint8))


@kernels
def test_kernel_fp8_rounding_matches_torch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, generator=gen) * torch.exp(2 * torch.randn(2048, generator=gen))
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    every[every.isnan()] = 0.0
    x[:256] = every  # every representable value
    x[256:512] = every * 1.0625  # halfway between neighbours: ties round to even
    x[512:768] = every * 0.97
    x = x.clamp(-440, 440).to(KERNEL_DEVICE)
    out = torch.empty(2048, dtype=torch.uint8, device=KERNEL_DEVICE)
    _convert_fp8_kernel[(1,)](x, out, N=2048)
    assert torch.equal(out.cpu(), x.cpu().to(torch.float8_e4m3fn).view(torch.uint8))


# ---- the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=211, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    path = tmp_path_factory.mktemp("tiny_llama_tq")
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 211, (n,), generator=gen).tolist() for n in (5, 40, 12)]
    return str(path), prompts


def _mean_kl(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    return float(np.mean([(r.exp() * (r - g)).sum(-1).mean() for r, g in zip(ref, got,
                                                                            strict=True)]))


def test_engine_generates_with_every_preset(make_llm, tiny_llama):
    from pagedserve import SamplingParams

    path, prompts = tiny_llama
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(model=path, dtype="float32", device="cpu", kv_cache_memory="2MiB",
                  max_num_batched_tokens=32)  # chunked prefill: quantized context mid-prompt
    base = make_llm(attention_backend="CPU", **common)
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    reference = base.score(prompts, expected)
    kl = {}
    for preset in PRESETS:
        llm = make_llm(attention_backend="TURBOQUANT", kv_cache_dtype=preset, **common)
        # The same budget holds as many more blocks as the packed page is smaller (fp32 here).
        ratio = 2 * 32 * 4 / tqf.PRESETS[preset].slot_bytes(32)
        assert llm.engine.kv_cache.num_blocks >= 0.95 * ratio * base.engine.kv_cache.num_blocks
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert [len(g) for g in got] == [12] * len(prompts)
        kl[preset] = _mean_kl(reference, llm.score(prompts, expected))
    # This random model is chaotic (tiny logit margins), so only coarse checks: a broken
    # rotation or packing costs nats, and more bits lose less.
    assert kl["tq_k8v4"] < 0.3, kl
    assert kl["tq_k8v4"] < kl["tq_4bit"] < kl["tq_3bit"], kl
    assert kl["naive_int4"] < kl["naive_int3"], kl


@pytest.mark.slow
def test_bundled_model_tq_k8v4_agrees_with_unquantized(make_llm):
    from pagedserve import SamplingParams

    prompts = ["The capital of France is", "Photosynthesis is the process by which"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", kv_cache_memory="64MiB")
    base = make_llm(attention_backend="CPU", **common)
    ids = [base.tokenizer.encode(p) for p in prompts]
    expected = [o.outputs[0].token_ids for o in base.generate(ids, params, use_tqdm=False)]
    reference = base.score(ids, expected)
    llm = make_llm(attention_backend="TURBOQUANT", kv_cache_dtype="tq_k8v4", **common)
    got = llm.score(ids, expected)
    top1 = np.mean([float((r.argmax(-1) == g.argmax(-1)).float().mean())
                    for r, g in zip(reference, got, strict=True)])
    assert top1 >= 0.9 and _mean_kl(reference, got) < 0.05
