"""The TurboQuant KV-cache format in plain torch: the CPU implementation and the reference the
Triton kernels are tested against.

A K or V vector x of d = head_size channels (d a power of two) is stored as one record of bytes:
  [packed codes | meta], meta being fp16 little-endian values beside the codes.

Rotated presets (TurboQuant) first apply the randomized Hadamard rotation R = H D / sqrt(d) (H the
Sylvester Hadamard matrix, D a fixed random +-1 diagonal from ROTATION_SEED), y = R x. Then
u = y * sqrt(d) / |x| has near-N(0, 1) coordinates whatever the channel statistics of x were
(outlier channels are spread over all coordinates), and each coordinate is quantized with the
Lloyd-Max codebook for N(0, 1) (`lloyd_max`), or cast to fp8 e4m3 (`fp8`); meta = |x|. The stored
vector is y_hat = |x| / sqrt(d) * codebook[code], still in the rotated domain: since R is
orthogonal, q.k = (Rq).(Rk), so attention scores rotated queries against it and rotates the
output back once.

Naive presets (the comparison) skip the rotation and quantize x uniformly per vector between its
min and max (`uniform`): meta = (scale, min), x_hat = min + scale * code.

Codes are packed little-endian in a bit stream: channel c occupies bits [c * bits, (c + 1) * bits),
so 4-bit codes share a byte in pairs (low nibble first) and 3-bit codes go 8 to 3 bytes.

A slot (one token of one KV head) is the record pair [K record | V record] (`encode_kv`), but the
paged cache does not store slots side by side. The cache tensor is uint8
[num_blocks, num_kv_heads, block_size, slot_bytes]; the trailing [block_size, slot_bytes] of a
(block, KV head) only sizes its region of block_size * slot_bytes contiguous bytes, which holds
the block's tokens as a structure of arrays (offsets: `KVPreset.plane_offsets`):

  [K codes  block_size rows x K code bytes]   row t = token t's packed K codes
  [V codes  block_size rows x V code bytes]
  [K metas  block_size x K meta bytes]        fp16: the norm, or (scale, min) for uniform codes
  [V metas  block_size x V meta bytes]

So a code row starts at its plane's offset plus a multiple of its length (128 / 64 / 48 bytes at
d128 for 8 / 4 / 3 bits): with the block size a multiple of 16, every plane and every code row
at d128 is 16-byte aligned (no padding needed) and the kernels read rows with vector loads; the
metas are aligned fp16 arrays. The byte count per block is that of the slots, so capacity is
unchanged. `cache_planes` gives the four planes as views, `slot_records` rebuilds the
[..., slot_bytes] records of a cache (or of gathered pages), and `store_kv` writes through the
planes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

ROTATION_SEED = 0x5EED_7A
FP16_MAX = 65504.0


@dataclass(frozen=True)
class VectorCodec:
    """How one K or V vector is stored: kind is 'lloyd_max', 'fp8' or 'uniform'."""

    kind: str
    bits: int

    def code_bytes(self, head_size: int) -> int:
        return head_size * self.bits // 8

    @property
    def meta_bytes(self) -> int:
        return 4 if self.kind == "uniform" else 2  # (scale, min) or the norm, fp16 each

    def record_bytes(self, head_size: int) -> int:
        return self.code_bytes(head_size) + self.meta_bytes

    @property
    def num_levels(self) -> int:
        return 1 << self.bits


@dataclass(frozen=True)
class KVPreset:
    name: str
    key: VectorCodec
    value: VectorCodec
    rotated: bool

    def slot_bytes(self, head_size: int) -> int:
        return self.key.record_bytes(head_size) + self.value.record_bytes(head_size)

    def value_offset(self, head_size: int) -> int:
        """Where the V record starts inside a slot record."""
        return self.key.record_bytes(head_size)

    def plane_offsets(self, head_size: int, block_size: int) -> tuple[int, int, int, int]:
        """Byte offsets of the K codes, V codes, K metas and V metas planes inside the
        block_size * slot_bytes region of one (block, KV head)."""
        k_codes = block_size * self.key.code_bytes(head_size)
        v_codes = block_size * self.value.code_bytes(head_size)
        k_meta = block_size * self.key.meta_bytes
        return 0, k_codes, k_codes + v_codes, k_codes + v_codes + k_meta


_LM4, _LM3 = VectorCodec("lloyd_max", 4), VectorCodec("lloyd_max", 3)
PRESETS: dict[str, KVPreset] = {
    "tq_k8v4": KVPreset("tq_k8v4", VectorCodec("fp8", 8), _LM4, rotated=True),
    "tq_4bit": KVPreset("tq_4bit", _LM4, _LM4, rotated=True),
    "tq_3bit": KVPreset("tq_3bit", _LM3, _LM3, rotated=True),
    "naive_int4": KVPreset("naive_int4", VectorCodec("uniform", 4), VectorCodec("uniform", 4),
                           rotated=False),
    "naive_int3": KVPreset("naive_int3", VectorCodec("uniform", 3), VectorCodec("uniform", 3),
                           rotated=False),
}
DEFAULT_PRESET = "tq_4bit"  # what kv_cache_dtype "auto" means for this cache


def get_preset(name: str) -> KVPreset:
    key = DEFAULT_PRESET if name == "auto" else name
    if key not in PRESETS:
        raise ValueError(f"unknown TurboQuant kv_cache_dtype {name!r}; presets: auto, "
                         f"{', '.join(PRESETS)}")
    return PRESETS[key]


# ---- rotation ---------------------------------------------------------------------------------

def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform over the last dim (a power of two):
    x @ H with H the Sylvester Hadamard matrix, in d log d additions."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < d:
        pairs = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return x


@functools.cache
def _signs_cpu(head_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (head_size,), generator=gen).float() * 2 - 1


def hadamard_signs(head_size: int, seed: int = ROTATION_SEED,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """The random +-1 diagonal D of the rotation, fixed by the seed."""
    if head_size & (head_size - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head size, got {head_size}")
    return _signs_cpu(head_size, seed).to(device)


def rotate(x: torch.Tensor, seed: int = ROTATION_SEED) -> torch.Tensor:
    """y = R x over the last dim (float32), R = H D / sqrt(d)."""
    d = x.shape[-1]
    return fwht(x.float() * hadamard_signs(d, seed, x.device)) / math.sqrt(d)


def unrotate(y: torch.Tensor, seed: int = ROTATION_SEED) -> torch.Tensor:
    """x = R^T y (H is symmetric)."""
    d = y.shape[-1]
    return fwht(y.float()) * hadamard_signs(d, seed, y.device) / math.sqrt(d)


def rotation_matrix(head_size: int, seed: int = ROTATION_SEED,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """R [d, d] float32 with rotate(x) = x @ R.T (the kernels multiply by it with tl.dot)."""
    eye = torch.eye(head_size, device=device)
    return rotate(eye, seed).T.contiguous()


# ---- Lloyd-Max codebooks for N(0, 1) ------------------------------------------------------------

def _gaussian_cell_stats(edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probability and first moment of N(0, 1) on each cell [edges[i], edges[i+1]]."""
    cdf = torch.special.ndtr(edges)
    pdf = torch.exp(-0.5 * edges.square()) / math.sqrt(2 * math.pi)
    pdf = torch.where(torch.isinf(edges), torch.zeros_like(pdf), pdf)
    return cdf[1:] - cdf[:-1], pdf[:-1] - pdf[1:]


@functools.cache
def lloyd_max_codebook(bits: int) -> tuple[float, ...]:
    """The 2^bits reconstruction levels minimising E[(X - Q(X))^2] for X ~ N(0, 1): Lloyd's
    iteration (boundaries at midpoints, levels at the cell's conditional mean, both exact for
    the Gaussian) in float64 until it stops moving."""
    n = 1 << bits
    levels = torch.linspace(-2.5, 2.5, n, dtype=torch.float64)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(20000):
        edges = torch.cat([-inf, (levels[1:] + levels[:-1]) / 2, inf])
        prob, moment = _gaussian_cell_stats(edges)
        new = moment / prob
        if float((new - levels).abs().max()) < 1e-13:
            levels = new
            break
        levels = new
    return tuple(levels.tolist())


def gaussian_distortion(levels: tuple[float, ...]) -> float:
    """E[(X - Q(X))^2] for X ~ N(0, 1) and nearest-level quantization to `levels` (sorted)."""
    lv = torch.tensor(levels, dtype=torch.float64)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    edges = torch.cat([-inf, (lv[1:] + lv[:-1]) / 2, inf])
    prob, moment = _gaussian_cell_stats(edges)
    # E[X^2 on cell] via integration by parts: P + a phi(a) - b phi(b).
    pdf = torch.exp(-0.5 * edges.square()) / math.sqrt(2 * math.pi)
    x_pdf = torch.where(torch.isinf(edges), torch.zeros_like(pdf), edges * pdf)
    second = prob + x_pdf[:-1] - x_pdf[1:]
    return float((second - 2 * lv * moment + lv.square() * prob).sum())


def codebook_levels(codec: VectorCodec) -> torch.Tensor:
    """Value of each code before the per-vector scale (float32): Lloyd-Max levels, or 0..L-1
    for uniform codes. fp8 codes are their own value (empty table)."""
    if codec.kind == "lloyd_max":
        return torch.tensor(lloyd_max_codebook(codec.bits), dtype=torch.float32)
    if codec.kind == "uniform":
        return torch.arange(codec.num_levels, dtype=torch.float32)
    return torch.zeros(0)


def codebook_boundaries(codec: VectorCodec) -> torch.Tensor:
    """Decision boundaries of the Lloyd-Max quantizer (midpoints between levels), float32."""
    levels = codebook_levels(codec)
    return (levels[1:] + levels[:-1]) / 2


# ---- packing ----------------------------------------------------------------------------------

def _group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte group: 8 -> (1, 1), 4 -> (2, 1), 3 -> (8, 3)."""
    codes = 8 // math.gcd(8, bits)
    return codes, codes * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [..., d] (< 2^bits) -> uint8 [..., d * bits / 8]."""
    g, nbytes = _group(bits)
    lead, d = codes.shape[:-1], codes.shape[-1]
    grouped = codes.to(torch.int64).reshape(*lead, d // g, g)
    shifts = torch.arange(g, device=codes.device) * bits
    word = (grouped << shifts).sum(-1)
    byte_shifts = torch.arange(nbytes, device=codes.device) * 8
    packed = ((word[..., None] >> byte_shifts) & 255).to(torch.uint8)
    return packed.reshape(*lead, d // g * nbytes)


def unpack_codes(packed: torch.Tensor, bits: int, head_size: int) -> torch.Tensor:
    """uint8 [..., d * bits / 8] -> codes int64 [..., d]."""
    g, nbytes = _group(bits)
    lead = packed.shape[:-1]
    grouped = packed.to(torch.int64).reshape(*lead, head_size // g, nbytes)
    word = (grouped << (torch.arange(nbytes, device=packed.device) * 8)).sum(-1)
    shifts = torch.arange(g, device=packed.device) * bits
    return ((word[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*lead, head_size)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float [...] -> uint8 [..., 2], little-endian fp16."""
    half = x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).contiguous()
    return half.view(torch.uint8).reshape(*x.shape, 2)


def _from_fp16_bytes(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] -> float32 [...]."""
    return b.contiguous().view(torch.float16)[..., 0].float()


# ---- vectors ----------------------------------------------------------------------------------

def encode_vectors(y: torch.Tensor, codec: VectorCodec) -> torch.Tensor:
    """Vectors [..., d] in the storage domain (already rotated for TurboQuant) -> records uint8
    [..., record_bytes]."""
    y = y.float()
    d = y.shape[-1]
    if codec.kind == "uniform":
        lo, hi = y.amin(-1), y.amax(-1)
        scale = ((hi - lo) / (codec.num_levels - 1)).to(torch.float16).float()
        lo = lo.to(torch.float16).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.floor((y - lo[..., None]) / safe[..., None] + 0.5)
        codes = codes.clamp(0, codec.num_levels - 1)
        meta = torch.cat([_fp16_bytes(scale), _fp16_bytes(lo)], dim=-1)
    else:
        norm = torch.linalg.vector_norm(y, dim=-1)
        unit = y * (math.sqrt(d) / norm.clamp(min=1e-30))[..., None]
        if codec.kind == "fp8":
            codes = unit.to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            codes = torch.bucketize(unit, codebook_boundaries(codec).to(y.device))
        meta = _fp16_bytes(norm)
    return torch.cat([pack_codes(codes, codec.bits), meta], dim=-1)


def decode_vectors(records: torch.Tensor, codec: VectorCodec, head_size: int) -> torch.Tensor:
    """Records uint8 [..., record_bytes] -> float32 vectors [..., d] in the storage domain."""
    n = codec.code_bytes(head_size)
    codes = unpack_codes(records[..., :n], codec.bits, head_size)
    if codec.kind == "fp8":
        unit = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        unit = codebook_levels(codec).to(records.device)[codes]
    first = _from_fp16_bytes(records[..., n:n + 2])
    if codec.kind == "uniform":
        return unit * first[..., None] + _from_fp16_bytes(records[..., n + 2:n + 4])[..., None]
    return unit * (first / math.sqrt(head_size))[..., None]


def to_storage_domain(preset: KVPreset, x: torch.Tensor) -> torch.Tensor:
    return rotate(x) if preset.rotated else x.float()


def from_storage_domain(preset: KVPreset, y: torch.Tensor) -> torch.Tensor:
    return unrotate(y) if preset.rotated else y


def encode_kv(preset: KVPreset, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """key/value [..., d] -> slots uint8 [..., slot_bytes]."""
    k = encode_vectors(to_storage_domain(preset, key), preset.key)
    v = encode_vectors(to_storage_domain(preset, value), preset.value)
    return torch.cat([k, v], dim=-1)


def decode_kv(preset: KVPreset, slots: torch.Tensor,
              head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots uint8 [..., slot_bytes] -> (K, V) float32 [..., d] in the storage domain."""
    split = preset.value_offset(head_size)
    return (decode_vectors(slots[..., :split], preset.key, head_size),
            decode_vectors(slots[..., split:], preset.value, head_size))


def quantize_dequantize(preset: KVPreset, key: torch.Tensor,
                        value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What attention sees of key/value after a round trip through the cache (float32, the
    original domain)."""
    k, v = decode_kv(preset, encode_kv(preset, key, value), key.shape[-1])
    return from_storage_domain(preset, k), from_storage_domain(preset, v)


# ---- the paged cache --------------------------------------------------------------------------

def cache_shape(preset: KVPreset, num_blocks: int, block_size: int, num_kv_heads: int,
                head_size: int) -> tuple[int, int, int, int]:
    """uint8 [num_blocks, num_kv_heads, block_size, slot_bytes]: block_size * slot_bytes bytes
    per (block, KV head), laid out as planes (module docstring)."""
    return (num_blocks, num_kv_heads, block_size, preset.slot_bytes(head_size))


def cache_planes(preset: KVPreset, kv_cache: torch.Tensor,
                 head_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (K codes, V codes, K metas, V metas), each uint8 [..., block_size, n], of a cache or
    of gathered pages [..., block_size, slot_bytes] whose last two dims are contiguous. Writing
    into them writes the cache."""
    *lead, block_size, slot_bytes = kv_cache.shape
    if slot_bytes != preset.slot_bytes(head_size):
        raise ValueError(f"{preset.name} at head size {head_size} has "
                         f"{preset.slot_bytes(head_size)}-byte slots, the cache has {slot_bytes}")
    region = kv_cache.view(*lead, block_size * slot_bytes)
    offsets = preset.plane_offsets(head_size, block_size)
    widths = (preset.key.code_bytes(head_size), preset.value.code_bytes(head_size),
              preset.key.meta_bytes, preset.value.meta_bytes)
    return tuple(region[..., o:o + block_size * w].view(*lead, block_size, w)
                 for o, w in zip(offsets, widths, strict=True))


def _record_planes(preset: KVPreset, records: torch.Tensor,
                   head_size: int) -> tuple[torch.Tensor, ...]:
    """Records [..., slot_bytes] -> (K codes, V codes, K metas, V metas) in plane order."""
    kc, kr = preset.key.code_bytes(head_size), preset.key.record_bytes(head_size)
    vc = preset.value.code_bytes(head_size)
    return (records[..., :kc], records[..., kr:kr + vc], records[..., kc:kr],
            records[..., kr + vc:])


def slot_records(preset: KVPreset, kv_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """The slot records uint8 [..., block_size, slot_bytes] (token t of a block at row t, as
    `encode_kv` makes them) of a cache or of gathered pages in the plane layout (a copy)."""
    k_codes, v_codes, k_meta, v_meta = cache_planes(preset, kv_cache, head_size)
    return torch.cat([k_codes, k_meta, v_codes, v_meta], dim=-1)


def store_kv(preset: KVPreset, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Quantize key/value [T, Hkv, d] into kv_cache [blocks, Hkv, block_size, slot_bytes] at
    slot_mapping [T]; slots of -1 are skipped."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    block_size, head_size = kv_cache.shape[2], key.shape[-1]
    slot_mapping = slot_mapping.long()
    blocks, rows = slot_mapping // block_size, slot_mapping % block_size
    records = encode_kv(preset, key, value)
    for plane, part in zip(cache_planes(preset, kv_cache, head_size),
                           _record_planes(preset, records, head_size), strict=True):
        plane[blocks, :, rows] = part
