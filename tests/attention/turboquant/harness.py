"""The TurboQuant tests' shared harness: one step of the TURBOQUANT backend (builder + impl) on
random paged data, the float32 references it is held to, and the check of the new tokens' slots."""

from __future__ import annotations

import math

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
    Returns (output, cache, per request: (query, K, V, context length)), everything needed to
    build references."""
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
        reqs.append((query, k, v, c))
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
