"""The TurboQuant tests' shared harness: one step of the TURBOQUANT backend (builder + impl) on
random paged data, the float32 references it is held to, and the checks of the new tokens'
slots (byte for byte, or within boundary rounding for half-precision inputs on the GPU)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from pagedserve.attention import AttentionLayerConfig, BuilderConfig
from pagedserve.attention.backends.turboquant import TurboQuantBackend
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.attention.ops import turboquant_format as tqf
from pagedserve.engine.input_batch import BlockTable
from tests.utils.conformance import reference_attention

PRESETS = list(tqf.PRESETS)
CUDA = "cuda"


class CaseRequest(NamedTuple):
    """One request of a case: its queries, every token's K/V (context first), its context
    length and every token's cache slot (context first)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    context: int
    slots: torch.Tensor


def _relative_mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).square().sum() / b.square().sum())


def run_turboquant_case(preset: str, batch: list[tuple[int, int]], block_size: int = 16,
                        num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 64,
                        dtype: torch.dtype = torch.float32, window: int | None = None,
                        soft_cap: float | None = None, use_kernels: bool = False,
                        device: str = "cpu", seed: int = 0, tiles=None,
                        num_splits: int | None = None, fill: int = 0,
                        decode_kernel: str | None = None, fused: bool = False,
                        graph_size: int | None = None, graph_max_seq_len: int = 0,
                        num_sms: int | None = None):
    """Context K/V written into shuffled pages through the torch format, then one step of the
    backend (builder + impl) over the new tokens (tiles: the kernels' launch shape, if given;
    fill: the byte of every slot not written, 255 makes NaN metas and fp8 codes;
    decode_kernel: 'auto', 'cuda' or 'triton' for decode steps, default 'triton' when tiles
    are given, as they are the Triton kernel's; fused: query/key/value as views of one fused
    QKV output and the output with padded rows, as a model hands them over; graph_size: a
    decode batch padded to that many requests as for a captured CUDA graph, its metadata from
    `build_for_cudagraph` after `prepare_for_cudagraphs(graph_max_seq_len)`, the padding rows'
    query/key/value random; the real rows are returned; num_sms: what the split heuristic
    believes the device has).
    Returns (output, cache, per request a CaseRequest, the new tokens' slots, their K, their V),
    everything needed to build references."""
    gen = torch.Generator().manual_seed(seed)
    p = tqf.PRESETS[preset]
    backend = TurboQuantBackend.for_kv_cache_dtype(preset)
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
        all_slots = torch.tensor([ids[t // bs] * bs + t % bs for t in range(c + q)],
                                 dtype=torch.int64)
        reqs.append(CaseRequest(query, k, v, c, all_slots))
    cache = cache.to(device)

    num_prefills = sum(1 for _, q in batch if q > 1)
    max_blocks = max(blocks_per_req) + 2
    table = BlockTable(len(batch), max_blocks)
    for row, ids in enumerate(block_ids):
        table.add_row(row, ids)
    capacity = max(len(batch), graph_size or 0)
    common_builder = CommonMetadataBuilder(capacity, sum(q for _, q in batch) + capacity,
                                           max_blocks, bs, torch.device(device))
    common = common_builder.build(
        rows=np.arange(len(batch)), num_computed=np.array([c for c, _ in batch], np.int32),
        num_scheduled=np.array([q for _, q in batch], np.int32), num_prefills=num_prefills,
        block_table=table.table)
    config = BuilderConfig(num_heads, hkv, d, dtype, bs, capacity,
                           common.num_actual_tokens + capacity, max_blocks,
                           torch.device(device), window, soft_cap, preset)
    builder = backend.get_builder_cls()(config)
    builder.use_kernels = use_kernels
    builder.decode_tiles = builder.prefill_tiles = tiles
    builder.num_splits = num_splits
    if num_sms is not None:  # the SMs the split heuristic fills (0 off CUDA: never splits)
        builder.num_sms = num_sms
    if decode_kernel is not None or tiles is not None:
        builder.decode_kernel = decode_kernel or "triton"
    impl = backend.get_impl_cls()(AttentionLayerConfig(num_heads, hkv, d, dtype, window,
                                                       soft_cap, preset))
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
    if graph_size is None:
        metadata = builder.build(common)
    else:
        t, extra = query.shape[0], graph_size - len(batch)
        padded = common_builder.pad_decode(common, graph_size)
        builder.prepare_for_cudagraphs(graph_max_seq_len)
        metadata = builder.build_for_cudagraph(common, graph_size, padded)

        def pad(x: torch.Tensor) -> torch.Tensor:
            rows = torch.randn((extra, *x.shape[1:]), generator=gen).to(x.dtype)
            return torch.cat([x, rows.to(x.device)])

        query, key, value = pad(query), pad(key), pad(value)
        if output is not None:
            output = torch.empty(t + extra, num_heads, d, dtype=dtype, device=device)
    out = impl.forward(query, key, value, cache, metadata, output=output)
    if graph_size is not None:
        out, key, value = out[:t], key[:t], value[:t]
    # The new tokens' slots hold their encodings.
    new_slots = torch.tensor([ids[t // bs] * bs + t % bs for ids, (c, q) in
                              zip(block_ids, batch, strict=True) for t in range(c, c + q)])
    return out.cpu(), cache.cpu(), reqs, new_slots, key.cpu(), value.cpu()


def references(preset: str, reqs, window=None, soft_cap=None):
    """Per request: float32 attention over (dequantized context + exact new tokens), and over
    the exact K/V."""
    p = tqf.PRESETS[preset]
    dequant, exact = [], []
    for query, k, v, c, *_ in reqs:
        d = k.shape[-1]
        kq, vq = tqf.quantize_dequantize(p, k[:c].float(), v[:c].float())
        k_seen = torch.cat([kq, k[c:].float()])
        v_seen = torch.cat([vq, v[c:].float()])
        scale = d ** -0.5
        dequant.append(reference_attention(query, k_seen, v_seen, c, scale, window, soft_cap))
        exact.append(reference_attention(query, k, v, c, scale, window, soft_cap))
    return torch.cat(dequant), torch.cat(exact)


def cache_references(preset: str, cache: torch.Tensor, reqs, window: int | None = None,
                     soft_cap: float | None = None) -> torch.Tensor:
    """Per request (concatenated): float32 attention over its context as the cache holds it
    (the records at its context slots decoded, whoever wrote them, so a code that fell the
    other way on a decision boundary is what the kernel must attend too) and its exact new
    tokens. reqs: CaseRequests, or tuples (query, K, V, context, slots) of any dtype."""
    p = tqf.PRESETS[preset]
    bs, d = cache.shape[2], reqs[0][1].shape[-1]
    records = tqf.slot_records(p, cache.cpu(), d)
    outs = []
    for query, k, v, c, slots in reqs:
        ctx = slots[:c]
        k_ctx, v_ctx = tqf.decode_kv(p, records[ctx // bs, :, ctx % bs], d)
        k_seen = torch.cat([tqf.from_storage_domain(p, k_ctx), k[c:].float()])
        v_seen = torch.cat([tqf.from_storage_domain(p, v_ctx), v[c:].float()])
        outs.append(reference_attention(query, k_seen, v_seen, c, d ** -0.5, window, soft_cap))
    return torch.cat(outs)


def code_planes(preset: tqf.KVPreset, records: torch.Tensor, head_size: int):
    """(codes, metas as int16 bit patterns) of K then V of slot records [..., slot_bytes]."""
    out = []
    off = 0
    for codec in (preset.key, preset.value):
        n = codec.code_bytes(head_size)
        rec = records[..., off:off + codec.record_bytes(head_size)]
        codes = tqf.unpack_codes(rec[..., :n], codec.bits, head_size)
        meta = rec[..., n:].contiguous().view(torch.int16).long()
        out.append((codes, meta))
        off += codec.record_bytes(head_size)
    return out


# At most this fraction of a plane's codes may sit one level off the reference's (measured on
# the H200 by test_store_kernel_writes_reference_codes, float32 and bf16 inputs).
MAX_FLIP_FRACTION = 1e-3


def assert_records_close(preset: tqf.KVPreset, got: torch.Tensor, expected: torch.Tensor,
                         head_size: int) -> None:
    """Slot records written by the GPU's store kernel against the torch format's: codes exact
    except, rarely, one level off where a coordinate sits on a decision boundary (the kernel
    rotates with a matmul, the reference with a butterfly, in another summation order); norms
    and scales within one fp16 ulp. A wrong slot or a wrong row fails: its codes differ almost
    everywhere."""
    for (c_ref, m_ref), (c_got, m_got) in zip(code_planes(preset, expected, head_size),
                                              code_planes(preset, got, head_size), strict=True):
        diff = (c_ref - c_got).abs()
        assert diff.max() <= 1, f"a code {int(diff.max())} levels off"
        flipped = float((diff > 0).float().mean())
        assert flipped < MAX_FLIP_FRACTION, f"{flipped:.2%} of the codes differ"
        assert (m_ref - m_got).abs().max() <= 1, "a meta more than one fp16 ulp off"


def _check_new_slots(preset, cache, new_slots, key, value, exact: bool = True):
    """The new tokens' slots hold the torch format's encoding of their K/V: byte for byte
    (exact: the CPU, float32 inputs), or within `assert_records_close` (half-precision inputs
    through the GPU's store kernel)."""
    p = tqf.PRESETS[preset]
    bs, d = cache.shape[2], key.shape[-1]
    stored = tqf.slot_records(p, cache, d)[new_slots // bs, :, new_slots % bs]
    expected = tqf.encode_kv(p, key.float(), value.float())
    if exact:
        assert torch.equal(stored, expected)
    else:
        assert_records_close(p, stored, expected, d)


def assert_only_slots_written(preset: str, before: torch.Tensor, after: torch.Tensor,
                              slots: torch.Tensor, head_size: int) -> None:
    """Every slot record outside `slots` is as it was (padding rows, slot -1, and wrong slots
    write nothing)."""
    p = tqf.PRESETS[preset]
    num_blocks, _, bs, _ = before.shape
    old, new = (tqf.slot_records(p, c.cpu(), head_size).transpose(1, 2).reshape(num_blocks * bs, -1)
                for c in (before, after))
    others = torch.ones(num_blocks * bs, dtype=torch.bool)
    others[slots] = False
    changed = (old[others] != new[others]).any(-1)
    assert not changed.any(), f"{int(changed.sum())} slots outside the step's were written"
