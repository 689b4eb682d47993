"""FLEX_ATTENTION backend: PyTorch's `torch.nn.attention.flex_attention` over the paged cache.

Each layer runs one flex call with batch 1 over the step's new tokens. Two key layouts:

- **Physical** (CUDA): no gather. The keys and values handed to flex are the cache itself,
  viewed as one sequence of every slot [1, Hkv, num_blocks * block_size, D]. The builder plans
  a `BlockMask` straight from the page table: for each query tile, the KV tiles (physical pages)
  its queries may attend, listed as flex's `kv_indices` (partial tiles) and `full_kv_indices`
  (tiles every query of the tile sees in full: no mask_mod there). The mask_mod maps a slot
  back to (logical page, offset) through an inverse page table (physical page -> logical index,
  filled for the pages this step's queries can see) and checks that the query's own request
  holds that page there, so causality and windows use logical positions. A KV tile is one page
  (block size >= 16) or the pages of 16 slots (smaller pages; the mask_mod sorts out the pages
  inside a tile). Query tiles are 16 rows in decode-heavy steps and 128 in prefill-heavy ones,
  and each request starts a new tile (`ALIGN_REQUESTS`: its rows are padded to a tile; padding
  rows are masked out), so a tile reads one request's pages only and the tiles of a decode
  batch run side by side rather than one tile walking every request's context. The query
  heads that share a KV head are rows of one flex head (`FOLD_GQA`: a token's G heads are G
  consecutive rows), so a tile reads each page once for all of them (flex's enable_gqa would
  run a flex head per query head, each reading the pages again) and a decode tile of 16 rows
  holds G real rows rather than one.
- **Gathered** (CPU): the keys are every request's context gathered from its pages into one
  packed sequence. Eager flex materialises the [H, T, K] scores and applies the mask_mod to
  every pair (the block mask's sparsity is ignored): with the physical layout K would be the
  whole cache's slot count, far too slow for the CPU engine. The physical form is tested on the
  CPU all the same (small caches, `FlexAttentionMetadataBuilder.physical_kv`), its block mask
  against flex's own `create_block_mask` over the same mask_mod.

The plan is built on the host in numpy from the metadata's host mirrors (page table in CSR form,
lengths; no per-token loop and no device sync), once per step per layer configuration (window),
and shared by every layer of it; the inverse page table needs the cache's size and is filled by
the first layer that runs (`FlexAttentionMetadata.block_mask_for`). Its host cost per step is in
docs/benchmarks.md (benchmarks/flex_attention_cpu.py).

Soft-cap is a score_mod (cap * tanh(s / cap)); attention sinks are exact from the LSE flex
returns: the sink column adds exp(sink) to the softmax denominator, so the output is rescaled
by sigmoid(lse - sink), in float32. GQA: folded into rows (physical), flex's `enable_gqa`
(gathered, or FOLD_GQA off). Values of another head size need nothing more (flex takes V's
last dimension as it comes): DiffKV layers run on the base class's side-by-side cache layout.
On CUDA flex_attention is compiled (`torch.compile`), and the engine runs the backend's
`warmup_steps` at start-up so that each kind of step compiles then, not in the first request.

Adding a custom score_mod or mask_mod: subclass `FlexAttentionMetadataBuilder` and extend
`mask_mod` (combine with `torch.nn.attention.flex_attention.and_masks` / `or_masks`), or
subclass `FlexAttentionImpl` and extend `score_mod`. q_idx is a flex query row (a padding row
has request 0 and position -1); kv_idx is a physical cache slot (block_id * block_size +
offset) in the physical layout, a packed key index in the gathered one; h is the KV head when
GQA is folded (a score_mod that depends on the query head wants `FOLD_GQA = False`). Translate
them with the metadata: `md.q_req[q]`, `md.q_pos[q]` (request, absolute position) and
`md.key_position(q, kv)` (the key's absolute position in q's request, -1 when the key is not
q's request's), e.g. a prefix-LM mask_mod is `base(b, h, q, kv) | (md.key_position(q, kv) >= 0)
& (md.key_position(q, kv) < prefix)`. A mask that lets a query see keys outside its causal
window must also widen the plan (`plan_kv_tiles`), else the physical layout's block mask never
visits them. Then register the subclass as a backend of its own name
(registry.register_backend).

Longer than 500 lines: the two key layouts' plans, their mask_mods, the impl and the backend
share the metadata class and the tile constants; split, each part would import the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerConfig,
    AttentionMetadataBuilder,
)
from pagedserve.attention.backends import flex_encoder
from pagedserve.attention.backends.cpu import write_kv
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.device import to_device_async

# The gathered layout's tile (every tile is listed: eager flex ignores sparsity anyway).
_GATHER_TILE = 128
# Flex's KV tiles on the GPU are at least this many slots.
_MIN_KV_TILE = 16


def _flex_module() -> Any:
    """The flex_attention module, imported on first use (absent from old torch builds)."""
    from torch.nn.attention import flex_attention

    return flex_attention


@dataclass
class KVTilePlan:
    """A step's block mask in flex's terms, on the host: for each query tile the KV tiles it
    attends partially (mask_mod applied) and fully, and the pages its queries can see."""

    kv_num_blocks: np.ndarray  # [Tq] int32
    kv_indices: np.ndarray  # [Tq, W] int32, the first kv_num_blocks of a row valid
    full_num_blocks: np.ndarray  # [Tq] int32
    full_indices: np.ndarray  # [Tq, W] int32 (as wide as kv_indices: see `_same_width`)
    pages: np.ndarray  # [E] int64, physical page of each visible (request, logical page)
    logical: np.ndarray  # [E] int64, its logical index in its request


def _tile_rows(num_tiles: int, row: np.ndarray, value: np.ndarray,
               distinct: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each tile's distinct values, left-packed: ([Tq] counts, [Tq, W]). `row` is sorted;
    `distinct`: no value repeats within a row (else they are sorted and deduplicated)."""
    counts = np.bincount(row, minlength=num_tiles)
    width = max(int(counts.max()) if num_tiles else 0, 1)
    col = np.arange(len(row)) - (np.cumsum(counts) - counts)[row]
    if distinct:
        grid = np.zeros((num_tiles, width), dtype=np.int32)
        grid[row, col] = value
        return counts.astype(np.int32), grid
    big = np.iinfo(np.int64).max
    grid = np.full((num_tiles, width), big, dtype=np.int64)
    grid[row, col] = value
    grid.sort(axis=1)
    # Duplicates (a page shared through the prefix cache, pages of one KV tile) sent to the end.
    dup = np.zeros_like(grid, dtype=bool)
    dup[:, 1:] = grid[:, 1:] == grid[:, :-1]
    grid[dup] = big
    grid.sort(axis=1)
    kept = (grid != big).sum(axis=1)
    width = max(int(kept.max()) if num_tiles else 0, 1)
    grid = grid[:, :width]
    grid[grid == big] = 0
    return kept.astype(np.int32), grid.astype(np.int32)


def _same_width(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both grids one width: flex's CUDA kernels (torch 2.11) read full_kv_indices with
    kv_indices' row stride, so different widths read another tile's row."""
    width = max(a.shape[1], b.shape[1])
    return tuple(np.pad(x, ((0, 0), (0, width - x.shape[1]))) for x in (a, b))


def plan_kv_tiles(row_start: np.ndarray, query_lens: np.ndarray, context_lens: np.ndarray,
                  page_ids: np.ndarray, page_indptr: np.ndarray, block_size: int,
                  window: int | None, q_tile: int, pages_per_kv_tile: int,
                  num_rows: int, one_request_per_tile: bool = False,
                  rows_per_token: int = 1, limits: np.ndarray | None = None) -> KVTilePlan:
    """The physical layout's tiles. Request r's queries are flex rows [row_start[r],
    row_start[r] + query_lens[r] * rows_per_token), rows_per_token consecutive rows a token,
    at positions context_lens[r] + i; its pages are
    page_ids[page_indptr[r]:page_indptr[r + 1]]. A query at p sees positions
    (p - window, p] (all of [0, p] without a window). Query tile t is rows
    [t * q_tile, (t + 1) * q_tile); KV tile j is pages [j * pages_per_kv_tile, ...).
    `one_request_per_tile` (rows aligned to tiles) with one page a KV tile lists each tile's
    pages as they come: a request's visible pages are distinct. `limits` [tokens] (the step's
    `attend_limit`): a query sees up to its limit rather than its own position (the window
    still counts from the position); limits never decrease along a request."""
    bs = block_size
    num_tiles = -(-num_rows // q_tile)
    b = len(query_lens)
    real = query_lens > 0
    reqs = np.arange(b)[real]
    # Segments: the rows of one request inside one query tile.
    starts = np.union1d(np.arange(0, num_rows, q_tile), row_start[:b][real])
    seg_req = reqs[np.searchsorted(row_start[:b][real], starts, side="right") - 1]
    g = rows_per_token
    req_end = row_start[seg_req] + query_lens[seg_req] * g
    tile = starts // q_tile
    ends = np.minimum(np.minimum((tile + 1) * q_tile, req_end),
                      np.append(starts[1:], num_rows))
    keep = ends > starts  # drop segments made of padding rows only
    starts, ends, seg_req, tile = starts[keep], ends[keep], seg_req[keep], tile[keep]
    first = context_lens[seg_req] + (starts - row_start[seg_req]) // g
    last = context_lens[seg_req] + (ends - 1 - row_start[seg_req]) // g
    if limits is not None:  # a segment's last row has its largest limit
        token_start = np.cumsum(query_lens) - query_lens
        last_token = token_start[seg_req] + (ends - 1 - row_start[seg_req]) // g
        last_seen = np.maximum(last, limits[last_token])
    else:
        last_seen = last
    lo = np.zeros_like(first) if window is None else np.maximum(first - window + 1, 0) // bs
    hi = last_seen // bs
    count = hi - lo + 1
    seg = np.repeat(np.arange(len(starts)), count)
    logical = lo[seg] + np.arange(int(count.sum())) - (np.cumsum(count) - count)[seg]
    pages = page_ids[page_indptr[seg_req[seg]] + logical].astype(np.int64)
    # A page every row of its tile sees in full: the tile is one request's rows only, all
    # real, and the page lies inside every row's window. Only when a KV tile is one page.
    whole = (ends - starts == q_tile)
    if pages_per_kv_tile == 1:
        full_lo = (np.zeros_like(first) if window is None
                   else np.maximum(last - window + bs, 0) // bs)
        full_hi = (first + 1) // bs - 1
        full = whole[seg] & (logical >= full_lo[seg]) & (logical <= full_hi[seg])
    else:
        full = np.zeros(len(seg), dtype=bool)
    kv_tiles = pages // pages_per_kv_tile
    distinct = one_request_per_tile and pages_per_kv_tile == 1
    kv_num, kv_idx = _tile_rows(num_tiles, tile[seg][~full], kv_tiles[~full], distinct)
    full_num, full_idx = _tile_rows(num_tiles, tile[seg][full], kv_tiles[full], distinct)
    kv_idx, full_idx = _same_width(kv_idx, full_idx)
    return KVTilePlan(kv_num, kv_idx, full_num, full_idx, pages, logical.astype(np.int64))


@dataclass
class FlexAttentionMetadata:
    common: CommonAttentionMetadata
    num_tokens: int  # the step's real tokens (query rows attended)
    physical: bool  # the cache itself as keys (else gathered keys)
    num_rows: int  # flex's query length (real tokens plus padding rows)
    q_rows: torch.Tensor | None  # [T * gqa_fold] int64 flex rows of the tokens; None: row =
    # token. Token t's query heads h * gqa_fold + j (j < gqa_fold) are row q_rows[t *
    # gqa_fold + j] of flex head h.
    q_req: torch.Tensor  # [num_rows] int64 request of each row (padding: 0)
    q_pos: torch.Tensor  # [num_rows] int64 absolute position of each row (padding: -1)
    block_size: int
    # [num_rows] int64 the last key position each row sees, when the step has an
    # `attend_limit` (bidirectional image spans); None: its own position.
    q_limit: torch.Tensor | None = None
    gqa_fold: int = 1  # query heads per KV head folded into rows (1: flex's enable_gqa)
    # Gathered layout: [K] int64 physical slot, request and position of each packed key.
    kv_slot: torch.Tensor | None = None
    kv_req: torch.Tensor | None = None
    kv_pos: torch.Tensor | None = None
    # Physical layout: the plan on the device, and the inverse page table once filled.
    plan: dict[str, torch.Tensor] = field(default_factory=dict)
    tiles: tuple[int, int] = (_GATHER_TILE, _GATHER_TILE)  # (query rows, KV slots) per tile
    page_logical: torch.Tensor | None = None  # [num_blocks] int32, -1: not seen this step
    mask_fn: Callable[..., torch.Tensor] | None = None
    kernel_options: dict[str, Any] | None = None
    block_mask: Any = None  # flex's BlockMask

    def key_position(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """The absolute position of key kv_idx in q_idx's request; -1 when the key is not in
        that request (another request's page, a page this step does not read)."""
        req = self.q_req[q_idx]
        if not self.physical:
            return torch.where(self.kv_req[kv_idx] == req, self.kv_pos[kv_idx], -1)
        bs, table = self.block_size, self.common.block_table
        page = kv_idx // bs
        logical = self.page_logical[page]
        held = table[req, logical.clamp(0, table.shape[1] - 1)] == page
        return torch.where(held & (logical >= 0), logical * bs + kv_idx % bs, -1)

    def block_mask_for(self, num_blocks: int) -> Any:
        """The step's BlockMask over a cache of `num_blocks` pages (physical layout), built
        by the first layer that asks and shared by the rest."""
        if self.block_mask is not None:
            return self.block_mask
        inverse = torch.full((num_blocks,), -1, dtype=torch.int32, device=self.q_req.device)
        # A page shared through the prefix cache sits at the same logical index in every
        # request that holds it (a block's hash covers its whole prefix): duplicates agree.
        inverse.scatter_(0, self.plan["pages"], self.plan["logical"])
        self.page_logical = inverse
        self.block_mask = _flex_module().BlockMask.from_kv_blocks(
            self.plan["kv_num_blocks"], self.plan["kv_indices"],
            self.plan["full_num_blocks"], self.plan["full_indices"], BLOCK_SIZE=self.tiles,
            mask_mod=self.mask_fn, seq_lengths=(self.num_rows, num_blocks * self.block_size),
            compute_q_blocks=False)
        return self.block_mask


def _to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """The host arrays on the device in one copy (int64 on the way, each its own dtype after)."""
    flat = np.concatenate([a.ravel().astype(np.int64) for a in arrays.values()])
    dev = to_device_async(torch.from_numpy(flat), device)
    out, pos = {}, 0
    for name, a in arrays.items():
        dtype = torch.int32 if a.dtype == np.int32 else torch.int64
        out[name] = dev[pos:pos + a.size].view(a.shape).to(dtype)
        pos += a.size
    return out


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder):
    # The cache itself as keys (else gathered): None follows the device (CUDA: physical).
    physical_kv: ClassVar[bool | None] = None
    # Each request starts its own query tile (physical layout).
    ALIGN_REQUESTS: ClassVar[bool] = True
    # The query heads that share a KV head become rows of one flex head (physical layout):
    # a tile then reads each KV page once for all of them, not once per query head.
    FOLD_GQA: ClassVar[bool] = True
    DECODE_Q_TILE: ClassVar[int] = 16
    PREFILL_Q_TILE: ClassVar[int] = 128

    def uses_physical_kv(self) -> bool:
        if self.physical_kv is not None:
            return self.physical_kv
        return self.config.device.type == "cuda"

    def build(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        if self.uses_physical_kv():
            md = self._build_physical(common)
        else:
            md = self._build_gathered(common)
        md.mask_fn = self.mask_mod(md)
        if md.physical:
            return md
        flex = _flex_module()
        device = common.query_start_loc.device
        num_keys = len(md.kv_slot)
        if device.type != "cpu":  # the gathered layout off the CPU: a sparse mask
            md.block_mask = flex.create_block_mask(md.mask_fn, None, None, md.num_rows,
                                                   num_keys, device=device,
                                                   BLOCK_SIZE=_GATHER_TILE)
        else:
            # Eager flex applies the mask_mod to every pair: listing every tile costs nothing
            # and spares create_block_mask's dense evaluation.
            tiles = -(-max(md.num_rows, 1) // _GATHER_TILE)
            kv_tiles = -(-max(num_keys, 1) // _GATHER_TILE)
            num = torch.full((1, 1, tiles), kv_tiles, dtype=torch.int32, device=device)
            idx = torch.arange(kv_tiles, dtype=torch.int32, device=device).expand(
                1, 1, tiles, kv_tiles)
            md.block_mask = flex.BlockMask.from_kv_blocks(
                num, idx, BLOCK_SIZE=_GATHER_TILE, mask_mod=md.mask_fn,
                seq_lengths=(md.num_rows, num_keys), compute_q_blocks=False)
        return md

    def _build_gathered(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        n, b, device = common.num_actual_tokens, common.num_reqs, common.query_start_loc.device
        seq_lens = common.seq_lens[:b].long()
        qsl = common.query_start_loc[:b + 1].long()
        reqs = torch.arange(b, device=device)
        num_keys = int(common.seq_lens_cpu[:b].sum())
        kv_req = torch.repeat_interleave(reqs, seq_lens, output_size=num_keys)
        kv_start = torch.cumsum(seq_lens, 0) - seq_lens
        kv_pos = torch.arange(num_keys, device=device) - kv_start[kv_req]
        bs = common.block_size
        blocks = common.block_table[kv_req, kv_pos // bs].long()
        kv_slot = blocks * bs + kv_pos % bs
        q_req = torch.repeat_interleave(reqs, qsl[1:] - qsl[:-1], output_size=n)
        q_pos = common.positions[:n].long()
        q_limit = None if common.attend_limit is None else common.attend_limit[:n].long()
        return FlexAttentionMetadata(common, n, False, n, None, q_req, q_pos, bs, q_limit,
                                     kv_slot=kv_slot, kv_req=kv_req, kv_pos=kv_pos)

    def q_tile(self, common: CommonAttentionMetadata) -> int:
        """Rows per query tile: small when decodes dominate (a tile of one decode is mostly
        padding), large for prefills (fewer tiles, each reading its pages once)."""
        if common.num_decode_tokens >= common.num_prefill_tokens:
            return self.DECODE_Q_TILE
        return self.PREFILL_Q_TILE

    def _build_physical(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        n, b, bs = common.num_actual_tokens, common.num_reqs, common.block_size
        g = self.config.num_heads // self.config.num_kv_heads if self.FOLD_GQA else 1
        q_tile = self.q_tile(common)
        qsl = common.query_start_loc_cpu[:b + 1].astype(np.int64)
        query_lens = np.diff(qsl)
        context_lens = common.context_lens_cpu[:b].astype(np.int64)
        row_start = np.zeros(b + 1, dtype=np.int64)
        if self.ALIGN_REQUESTS:
            np.cumsum(-(-query_lens * g // q_tile) * q_tile, out=row_start[1:])
        else:
            row_start[1:] = qsl[1:] * g
        num_rows = int(row_start[b])
        pages_per_kv_tile = -(-_MIN_KV_TILE // bs)
        limits = common.attend_limit_cpu
        plan = plan_kv_tiles(row_start, query_lens, context_lens,
                             common.paged_kv_indices_cpu, common.paged_kv_indptr_cpu, bs,
                             self.config.sliding_window, q_tile, pages_per_kv_tile, num_rows,
                             one_request_per_tile=self.ALIGN_REQUESTS, rows_per_token=g,
                             limits=limits)
        # Every token's g rows, token-major; their request and position.
        token_req = np.repeat(np.arange(b), query_lens)
        token_rows = row_start[token_req] + (np.arange(n) - qsl[token_req]) * g
        rows = (token_rows[:, None] + np.arange(g)).ravel()
        q_req = np.zeros(num_rows, dtype=np.int64)
        q_req[rows] = np.repeat(token_req, g)
        q_pos = np.full(num_rows, -1, dtype=np.int64)
        q_pos[rows] = np.repeat(common.positions_cpu[:n], g)
        host = {}
        if limits is not None:
            q_limit = np.full(num_rows, -1, dtype=np.int64)
            q_limit[rows] = np.repeat(limits[:n], g)
            host["q_limit"] = q_limit
        dev = _to_device({**host, "kv_num_blocks": plan.kv_num_blocks[None, None],
                          "kv_indices": plan.kv_indices[None, None],
                          "full_num_blocks": plan.full_num_blocks[None, None],
                          "full_indices": plan.full_indices[None, None],
                          "pages": plan.pages, "logical": plan.logical.astype(np.int32),
                          "q_rows": rows, "q_req": q_req, "q_pos": q_pos},
                         common.query_start_loc.device)
        q_rows, q_req_t, q_pos_t = dev.pop("q_rows"), dev.pop("q_req"), dev.pop("q_pos")
        q_limit_t = dev.pop("q_limit", None)
        kv_tile = pages_per_kv_tile * bs
        options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": min(q_tile, 64),
                   "BLOCK_N": min(kv_tile, 64)}
        return FlexAttentionMetadata(common, n, True, num_rows, q_rows, q_req_t, q_pos_t, bs,
                                     q_limit_t, gqa_fold=g, plan=dev, tiles=(q_tile, kv_tile),
                                     kernel_options=options)

    def mask_mod(self, md: FlexAttentionMetadata) -> Callable[..., torch.Tensor]:
        """True where query row q_idx may see key kv_idx: a key of its own request, causal on
        absolute positions (up to the row's `q_limit` where the step has one: the end of its
        image span), inside the sliding window (which counts back from the query itself)."""
        window = self.config.sliding_window
        limit = md.q_pos if md.q_limit is None else md.q_limit

        def causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                   kv_idx: torch.Tensor) -> torch.Tensor:
            kv_pos = md.key_position(q_idx, kv_idx)
            return (kv_pos >= 0) & (kv_pos <= limit[q_idx])

        def windowed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                     kv_idx: torch.Tensor) -> torch.Tensor:
            kv_pos = md.key_position(q_idx, kv_idx)
            q_pos = md.q_pos[q_idx]
            return (kv_pos >= 0) & (kv_pos <= limit[q_idx]) & (kv_pos > q_pos - window)

        return causal if window is None else windowed

    def build_encoder(self, common: CommonAttentionMetadata) -> Any:
        return flex_encoder.encoder_metadata(common, _flex_module(), self.config.sliding_window)

    def warmup(self) -> None:
        if self.config.device.type == "cuda":  # compiled there, eager elsewhere
            FlexAttentionImpl.compile_flex()


class FlexAttentionImpl(AttentionImpl):
    supports_sinks = True
    supports_diff_kv = True
    supports_encoder_only = True
    # flex_attention itself, replaced by its compiled form by `compile_flex` (CUDA warm-up).
    _flex: Callable[..., Any] | None = None

    @classmethod
    def compile_flex(cls) -> None:
        if FlexAttentionImpl._flex is None:
            # One compiled variant per mask kind (causal, windowed), score_mod (soft-cap or
            # none) and query tile (decode, prefill): more than dynamo's default limit of 8
            # recompiles per frame, after which it would fall back to eager flex.
            dynamo_config = torch._dynamo.config
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 32)
            FlexAttentionImpl._flex = torch.compile(_flex_module().flex_attention)

    def score_mod(self) -> Callable[..., torch.Tensor] | None:
        """The layer's logit transform (after scaling, before masking): soft-cap or none."""
        cap = self.logits_soft_cap
        if cap is None:
            return None

        def soft_cap(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                     kv_idx: torch.Tensor) -> torch.Tensor:
            return cap * torch.tanh(score / cap)

        return soft_cap

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FlexAttentionMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
        n = md.num_tokens
        k_cache, v_cache = FlexAttentionBackend.kv_cache_views(kv_cache, self.layer.head_size_v)
        write_kv(k_cache, v_cache, key[:n], value[:n], md.common.slot_mapping[:n])
        if output is None:
            output = query.new_empty(query.shape[0], self.num_heads, self.value_head_size)
        if n == 0:
            return output
        k_slots, v_slots = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
        if md.physical:
            block_mask = md.block_mask_for(k_cache.shape[0])
        else:
            block_mask = md.block_mask
            k_slots, v_slots = k_slots[md.kv_slot], v_slots[md.kv_slot]
        # [S, Hkv, D] -> [1, Hkv, S, D].
        k = k_slots.transpose(0, 1)[None].to(query.dtype)
        v = v_slots.transpose(0, 1)[None].to(query.dtype)
        # Queries [n, H, D] -> [1, H / g, rows, D]: query head h * g + j of token t is row
        # q_rows[t * g + j] of flex head h (g = 1: rows are tokens, or q_rows places them).
        g, hkv = md.gqa_fold, self.num_heads // md.gqa_fold
        q = query[:n].reshape(n, hkv, g, -1).transpose(0, 1).reshape(hkv, n * g, -1)
        if md.q_rows is not None:
            rows = q.new_zeros(hkv, md.num_rows, self.head_size)
            rows[:, md.q_rows] = q
            q = rows
        out, lse = self._attend(q[None], k, v, block_mask, md.kernel_options,
                                enable_gqa=hkv != self.num_kv_heads)
        out, lse = out[0], lse[0]
        if md.q_rows is not None:
            out, lse = out[:, md.q_rows], lse[:, md.q_rows]
        # Back to [n, H, Dv] and [n, H].
        out = out.reshape(hkv, n, g, -1).transpose(0, 1).reshape(n, self.num_heads, -1)
        lse = lse.reshape(hkv, n, g).transpose(0, 1).reshape(n, self.num_heads)
        sinks = self.bound_sinks()
        if sinks is not None:
            # The sink column only enlarges the denominator: out * sum / (sum + exp(sink)).
            rescale = torch.sigmoid(lse.float() - sinks.detach().float()[None, :])
            out = (out.float() * rescale[..., None]).to(query.dtype)
        output[:n] = out
        return output

    def forward_encoder(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_metadata: Any, output: torch.Tensor | None = None) -> torch.Tensor:
        if output is None:
            output = query.new_empty(query.shape[0], self.num_heads, self.value_head_size)
        return flex_encoder.encoder_forward(self._attend, query, key, value, attn_metadata,
                                            output)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any,
                kernel_options: dict[str, Any] | None,
                enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
        flex = _flex_module()
        compiled = FlexAttentionImpl._flex
        use_compiled = compiled is not None and q.is_cuda
        fn = compiled if use_compiled else flex.flex_attention
        options = kernel_options
        if use_compiled and options is None and q.shape[2] < _GATHER_TILE:
            # The gathered layout on CUDA: torch's flex-decoding kernel found no launch
            # configuration for it (GQA, one batch row; torch 2.11): the main kernel runs.
            options = {"FORCE_USE_FLEX_ATTENTION": True}
        out, aux = fn(q, k, v, score_mod=self.score_mod(), block_mask=block_mask,
                      scale=self.scale, enable_gqa=enable_gqa,
                      kernel_options=options if use_compiled else None,
                      return_aux=flex.AuxRequest(lse=True))
        return out, aux.lse


class FlexAttentionBackend(AttentionBackend):
    name = "FLEX_ATTENTION"
    reads_paged_kv_indices = True
    supports_sliding_window = True
    supports_soft_cap = True
    supports_sinks = True
    supports_diff_kv = True
    supports_encoder_only = True
    supports_encoder_window = True
    supports_bidirectional_spans = True  # the mask_mod and the plan read attend_limit
    description = ("torch flex_attention (block mask from the page table over the cache "
                   "itself on CUDA; gathered pages, eager, on CPU)")

    impl_cls = FlexAttentionImpl
    builder_cls = FlexAttentionMetadataBuilder
    metadata_cls = FlexAttentionMetadata

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig, block_size: int,
                               device: torch.device) -> list[str]:
        reasons = super().validate_configuration(layer, block_size, device)
        # Compiled (CUDA), flex's Triton kernels tile the head dimension in 16s: inductor
        # refuses smaller heads only when the first step compiles.
        small = [n for n in (layer.head_size, layer.head_size_v) if n is not None and n < 16]
        if device.type == "cuda" and small:
            reasons.append(f"head size {small[0]} under 16 (flex_attention compiled on CUDA "
                           "takes 16 and up)")
        return reasons

    @classmethod
    def warmup_steps(cls, device: torch.device) -> list[tuple[int, int, int]]:
        """On CUDA each kind of step compiles flex apart: decode-heavy steps (16-row query
        tiles) under 128 rows (flex's main kernel forced, `_attend`) and over, and
        prefill-heavy steps (128-row tiles). Each kind runs twice at other sizes: the second
        compile makes the sizes dynamic, and later steps reuse it. Eager elsewhere: none."""
        if device.type != "cuda":
            return []
        return [(2, 1, 40), (3, 1, 70), (9, 1, 40), (12, 1, 70), (1, 100, 0), (2, 150, 30)]

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        try:
            flex = _flex_module()
        except ImportError as exc:
            return False, f"torch.nn.attention.flex_attention not importable: {exc}"
        if not hasattr(flex, "AuxRequest"):
            return False, f"torch {torch.__version__} too old: flex_attention lacks AuxRequest"
        return True, "torch flex_attention (eager on CPU, compiled on CUDA)"
