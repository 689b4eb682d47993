"""The per-step attention metadata every backend consumes, and its builder.

`CommonAttentionMetadata` is the contract between the engine and the backends: the engine builds
it once per step, every layer reads it (through its backend's own metadata). docs/architecture.md
has the worked example. Its tensors live in persistent buffers allocated once at their largest
size; each step writes in place and hands out views, so pointers stay put for CUDA-graph replay.
One table, `BUFFERS`, names them: it drives their allocation, the views a step hands out and the
padding of a decode step to a captured graph size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """Built once per step and shared by every layer. Device tensors, plus host mirrors (`*_cpu`,
    numpy) for backends that plan on the host. Requests are in batch order: prefills first,
    then decodes (a decode is a request with exactly one new token)."""

    query_start_loc: torch.Tensor  # [B+1] int32, cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens after this step
    context_lens: torch.Tensor  # [B] int32, tokens in the cache before this step
    # [B, max_blocks_per_seq] int32, padded with -1 up to the step's widest request's pages;
    # the columns past those are stale (no kernel reads a row past its sequence's pages)
    block_table: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset; -1 = padding
    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    paged_kv_indptr: torch.Tensor  # [B+1] int32 (CSR form of the block table)
    paged_kv_indices: torch.Tensor  # [total_pages] int32
    paged_kv_last_page_len: torch.Tensor  # [B] int32, in 1..block_size
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    context_lens_cpu: np.ndarray
    paged_kv_indptr_cpu: np.ndarray
    paged_kv_last_page_len_cpu: np.ndarray
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    block_size: int
    # A request's cached prefix includes blocks this same step writes (a same-step prefix-cache
    # hit): a backend that fuses its K/V write into attention must write first.
    context_written_in_step: bool = False
    # [B] int64, each request's state slot, for models with state layers (attention/state.py);
    # set by the runner after `build`.
    state_slots: torch.Tensor | None = None
    # The page ids on the host too, for planners that read them there (FlashInfer's MLA plan
    # takes their range; reading the device copy would wait for the GPU).
    paged_kv_indices_cpu: np.ndarray | None = None
    # The new tokens' positions on the host (a second cache group's slot mapping is built
    # from them).
    positions_cpu: np.ndarray | None = None
    # [T] int32, the last key position each new token sees, for models whose image tokens
    # attend to each other both ways (Gemma 3: `AttentionLayerConfig.bidirectional_spans`): a
    # token inside an image span sees up to the span's last token, every other token its own
    # position. None in every step without a token that sees past itself (steps without
    # images, every pure-decode step): other models and decodes pay nothing. The scheduler
    # never splits such a span across steps, so the keys up to every limit are in the step.
    attend_limit: torch.Tensor | None = None
    attend_limit_cpu: np.ndarray | None = None


@dataclass(frozen=True)
class BidirectionalSpans:
    """A step's image spans whose tokens attend to each other both ways: span i covers
    positions [start[i], end[i]) of the step's request `req[i]` (its index in the batch)."""

    req: np.ndarray  # [S] int
    start: np.ndarray  # [S] int
    end: np.ndarray  # [S] int


def attend_limits(token_req: np.ndarray, positions: np.ndarray,
                  spans: BidirectionalSpans) -> np.ndarray | None:
    """The last key position each token sees (`CommonAttentionMetadata.attend_limit`): a span's
    last position for its tokens, the token's own elsewhere; None when that is every token's
    own. Spans of one request must not overlap."""
    if not len(spans.req) or not len(positions):
        return None
    # One sorted key per (request, position) pair, so one search finds each token's span.
    stride = int(max(positions.max(), spans.end.max())) + 1
    span_key = spans.req.astype(np.int64) * stride + spans.start
    order = np.argsort(span_key, kind="stable")
    span_key, span_last = span_key[order], spans.end[order].astype(np.int64) - 1
    span_req, span_start = spans.req[order], spans.start[order]
    token_key = token_req.astype(np.int64) * stride + positions
    idx = np.searchsorted(span_key, token_key, side="right") - 1
    found = np.maximum(idx, 0)
    inside = ((idx >= 0) & (span_req[found] == token_req) & (positions >= span_start[found])
              & (positions <= span_last[found]))
    if not inside.any():
        return None
    limits = np.where(inside, span_last[found], positions).astype(np.int32)
    return None if np.array_equal(limits, positions) else limits


# Entries of a padding request (see pad_decode) that follow its query length q: a running
# sum to which it adds its q tokens or its one page, its sequence length q (also its one
# page's fill), and its tokens' positions 0..q-1.
SUM_TOKENS = "sum_tokens"
SUM_PAGES = "sum_pages"
QUERY_LEN = "query_len"
TOKEN_OFFSET = "token_offset"


@dataclass(frozen=True)
class Buffer:
    """One persistent tensor of the common metadata."""

    dtype: torch.dtype
    # The step quantity its length follows: "reqs" [B], "reqs+1" [B+1], "tokens" [T] or
    # "pages" [total_pages]. block_table has max_blocks_per_seq columns besides.
    length: str
    # A padding request's entry (see pad_decode): a constant, or one of the q-dependent kinds
    # above.
    pad: int | str


BUFFERS: dict[str, Buffer] = {
    "query_start_loc": Buffer(torch.int32, "reqs+1", SUM_TOKENS),
    "seq_lens": Buffer(torch.int32, "reqs", QUERY_LEN),
    "context_lens": Buffer(torch.int32, "reqs", 0),
    "block_table": Buffer(torch.int32, "reqs", -1),
    "slot_mapping": Buffer(torch.int64, "tokens", -1),
    "positions": Buffer(torch.int64, "tokens", TOKEN_OFFSET),
    "paged_kv_indptr": Buffer(torch.int32, "reqs+1", SUM_PAGES),
    "paged_kv_indices": Buffer(torch.int32, "pages", 0),
    "paged_kv_last_page_len": Buffer(torch.int32, "reqs", QUERY_LEN),
}
HOST_MIRRORS = ("query_start_loc", "seq_lens", "context_lens", "paged_kv_indptr",
                "paged_kv_last_page_len", "paged_kv_indices", "positions")
# The buffers that follow a KV cache group's block table; the rest are one per step.
TABLE_BUFFERS = ("block_table", "slot_mapping", "paged_kv_indptr", "paged_kv_indices",
                 "paged_kv_last_page_len")
# On CUDA the buffers live in one pinned host block and one device block of the same layout,
# in these regions, and a step's entries go over in one copy per region, gaps included (the
# first region's span holds the positions' full capacity: 64 KiB at 8,192 batched tokens),
# rather than one per buffer: each copy costs ~25 us of host time, and they were half the
# metadata's host time on the H200. The table buffers of a region sit together at its end, so
# another KV cache group's builder copies little besides them.
REGIONS = (("query_start_loc", "seq_lens", "context_lens", "positions", "paged_kv_indptr",
            "paged_kv_last_page_len", "slot_mapping"), ("block_table",), ("paged_kv_indices",))
assert sorted(n for region in REGIONS for n in region) == sorted(BUFFERS)
ALIGN = 256  # bytes, each buffer's start in the blocks


def _lengths(num_reqs: int, num_tokens: int, num_pages: int) -> dict[str, int]:
    return {"reqs": num_reqs, "reqs+1": num_reqs + 1, "tokens": num_tokens, "pages": num_pages}


class CommonMetadataBuilder:
    """Turns a step's (rows, cached lengths, new lengths) into CommonAttentionMetadata."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device, csr: bool = True) -> None:
        self.block_size = block_size
        # Build the CSR page table's indices (AttentionBackend.reads_paged_kv_indices); without
        # them `paged_kv_indices` is empty.
        self.csr = csr
        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        capacity = _lengths(max_num_reqs, max_num_tokens, max_num_reqs * max_blocks_per_seq)
        # name -> (byte offset in the blocks, bytes per entry: a block table entry is a row)
        self._layout: dict[str, tuple[int, int]] = {}
        size = 0
        for name in (name for region in REGIONS for name in region):
            entry = BUFFERS[name].dtype.itemsize * (max_blocks_per_seq
                                                     if name == "block_table" else 1)
            size = -(-size // ALIGN) * ALIGN
            self._layout[name] = (size, entry)
            size += capacity[BUFFERS[name].length] * entry
        self._host_block = torch.zeros(size, dtype=torch.uint8,
                                       pin_memory=device.type == "cuda")
        self.host = self._carve(self._host_block, capacity)
        self.np = {name: t.numpy() for name, t in self.host.items()}
        if device.type == "cpu":
            self._dev_block, self.dev = self._host_block, self.host
        else:
            self._dev_block = torch.zeros(size, dtype=torch.uint8, device=device)
            self.dev = self._carve(self._dev_block, capacity)
        self._arange = np.arange(max(capacity.values()) + 1, dtype=np.int64)
        self._dev_views: dict[tuple[str, int], torch.Tensor] = {}
        self._max_num_tokens = max_num_tokens
        # (host, device) buffers of `attend_limit`, allocated by the first step that has one:
        # outside BUFFERS, so models without bidirectional spans neither hold nor copy them.
        self._limit_bufs: tuple[torch.Tensor, torch.Tensor] | None = None

    def _carve(self, block: torch.Tensor, capacity: dict[str, int]) -> dict[str, torch.Tensor]:
        """Every buffer, at its largest, as a typed view of `block`."""
        views = {}
        for name, buf in BUFFERS.items():
            offset, entry = self._layout[name]
            rows = capacity[buf.length]
            view = block[offset:offset + rows * entry].view(buf.dtype)
            views[name] = view.view(rows, -1) if name == "block_table" else view
        return views

    def build(self, rows: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray,
              num_prefills: int, block_table: np.ndarray,
              context_written_in_step: bool = False,
              spans: BidirectionalSpans | None = None) -> CommonAttentionMetadata:
        """`rows`: each request's row of `block_table` ([rows, max_blocks_per_seq] int32, the
        engine's persistent table); `num_computed` / `num_scheduled`: its cached and new tokens;
        `spans`: the step's bidirectional image spans, if the model has them."""
        bs = self.block_size
        b = len(rows)
        t = int(num_scheduled.sum())
        h = self.np

        qsl = h["query_start_loc"][: b + 1]
        qsl[0] = 0
        np.cumsum(num_scheduled, out=qsl[1:])
        seq_lens = h["seq_lens"][:b]
        np.add(num_computed, num_scheduled, out=seq_lens)
        h["context_lens"][:b] = num_computed

        # Position of every new token: its request's cached length plus its offset in the step.
        token_req = np.repeat(self._arange[:b], num_scheduled)
        positions = h["positions"][:t]
        np.subtract(self._arange[:t], qsl[token_req], out=positions)
        positions += num_computed[token_req]
        total_pages = self._fill_table(rows, block_table, token_req, positions, seq_lens)

        lengths = _lengths(b, t, total_pages)
        self._copy_to_device(None, lengths)
        num_prefill_tokens = int(qsl[num_prefills])
        limit, limit_cpu = (None, None) if spans is None else self._limits(
            token_req, positions, seq_lens, spans)
        return CommonAttentionMetadata(
            **self._views(lengths),
            attend_limit=limit,
            attend_limit_cpu=limit_cpu,
            num_reqs=b,
            num_actual_tokens=t,
            max_query_len=int(num_scheduled.max()) if b else 0,
            max_seq_len=int(seq_lens.max()) if b else 0,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decodes=b - num_prefills,
            num_decode_tokens=t - num_prefill_tokens,
            block_size=bs,
            context_written_in_step=context_written_in_step,
        )

    def _limits(self, token_req: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray,
                spans: BidirectionalSpans) -> tuple[torch.Tensor | None, np.ndarray | None]:
        """The step's `attend_limit` (device view, host view), or (None, None)."""
        limits = attend_limits(token_req, positions, spans)
        if limits is None:
            return None, None
        past = limits >= seq_lens[token_req]
        if past.any():
            i = int(np.argmax(past))
            raise ValueError(
                f"request {int(token_req[i])} of the step: the bidirectional image span of its "
                f"position {int(positions[i])} ends at {int(limits[i])}, past the step's last "
                f"token {int(seq_lens[token_req[i]]) - 1}: such a span must be scheduled whole")
        if self._limit_bufs is None:
            pin = self.device.type == "cuda"
            host = torch.zeros(self._max_num_tokens, dtype=torch.int32, pin_memory=pin)
            dev = host if self.device.type == "cpu" else torch.zeros_like(host,
                                                                          device=self.device)
            self._limit_bufs = (host, dev)
        host, dev = self._limit_bufs
        t = len(limits)
        host_view = host.numpy()[:t]
        host_view[:] = limits
        if dev is not host:
            dev[:t].copy_(host[:t], non_blocking=True)
        return dev[:t], host_view

    def _fill_table(self, rows: np.ndarray, block_table: np.ndarray, token_req: np.ndarray,
                    positions: np.ndarray, seq_lens: np.ndarray) -> int:
        """The block table's rows, the slot mapping and the CSR page table into the host
        buffers; returns the number of pages (0 without the CSR indices)."""
        bs = self.block_size
        b = len(rows)
        h = self.np
        num_pages = (seq_lens + bs - 1) // bs
        width = int(num_pages.max()) if b else 0
        # Only the columns of pages in use: no kernel reads a row past its sequence's pages
        # (a padding request's one page is column 0). mode="clip" (the rows are valid) spares
        # numpy the buffered copy of `out` that its default mode makes: 3x faster.
        table = h["block_table"][:b, :width]
        np.take(block_table[:, :width], rows, axis=0, out=table, mode="clip")
        slots = h["slot_mapping"][:len(positions)]
        np.multiply(table[token_req, positions // bs], bs, out=slots)
        slots += positions % bs

        # CSR page table over the pages each request's context occupies.
        indptr = h["paged_kv_indptr"][: b + 1]
        indptr[0] = 0
        np.cumsum(num_pages, out=indptr[1:])
        last = h["paged_kv_last_page_len"][:b]
        np.subtract(seq_lens, (num_pages - 1) * bs, out=last)
        if not self.csr:
            return 0
        total_pages = int(indptr[b])
        mask = self._arange[:width] < num_pages[:, None]
        h["paged_kv_indices"][:total_pages] = table[mask]
        return total_pages

    def build_group(self, common: CommonAttentionMetadata, rows: np.ndarray,
                    block_table: np.ndarray) -> CommonAttentionMetadata:
        """`common`, built by another builder for this step, with the block table, slot
        mapping and page table of another KV cache group (its `block_table`, the engine's
        persistent table of that group) in this builder's own buffers. The per-request and
        per-token arrays are shared; only the page-dependent ones are built again."""
        b, t = common.num_reqs, common.num_actual_tokens
        token_req = np.repeat(self._arange[:b], np.diff(common.query_start_loc_cpu))
        total_pages = self._fill_table(rows, block_table, token_req, common.positions_cpu,
                                       common.seq_lens_cpu)
        lengths = _lengths(b, t, total_pages)
        self._copy_to_device(None, lengths, TABLE_BUFFERS)
        return dataclasses.replace(common, **self._views(lengths, TABLE_BUFFERS))

    def pad_decode(self, common: CommonAttentionMetadata, size: int,
                   onto: CommonAttentionMetadata | None = None) -> CommonAttentionMetadata:
        """`common`, a uniform step of B requests of q new tokens each (q = 1: a pure decode;
        q = 1+K: a verify step) this builder just built, padded in place to `size` requests
        for a captured CUDA graph. Entries [B, size) of every buffer are written on the host
        and copied over, so the copies `build` issued for [0, B) stand. A padding request has
        q tokens at positions 0..q-1 with slot -1 (no K/V write), seq_len q and the one page 0
        (the caller keeps q <= block_size), so it reads valid memory and touches nothing real.
        The padded step keeps the scheduler's classes: q = 1 all decodes, q > 1 all prefills."""
        b, t = common.num_reqs, common.num_actual_tokens
        q = common.max_query_len
        if t != b * q:
            raise ValueError(f"pad_decode takes a uniform step: {b} requests, {t} tokens, "
                             f"longest query {q}")
        extra = size - b
        if not extra and onto is None:  # a full graph: `common` is its step already
            return common
        pages = len(common.paged_kv_indices_cpu)  # 0 without the CSR indices
        before = _lengths(b, t, pages)
        after = _lengths(size, t + extra * q, pages + extra)
        # Another group's tables (`onto`: the step already padded by the first group's builder)
        # pad only the page-dependent buffers.
        names = tuple(BUFFERS) if onto is None else TABLE_BUFFERS
        for name in names:
            buf = BUFFERS[name]
            lo, hi = before[buf.length], after[buf.length]
            self._pad_entries(self.np[name], lo, hi, buf.pad, q)
        self.np["block_table"][b:size, 0] = 0  # a padding request's one page
        self._copy_to_device(before, after, names)
        if onto is not None:
            return dataclasses.replace(onto, **self._views(after, names))
        prefills = size if q > 1 else 0
        return dataclasses.replace(
            common, **self._views(after), num_reqs=size, num_actual_tokens=t + extra * q,
            max_query_len=q, max_seq_len=max(common.max_seq_len, q), num_prefills=prefills,
            num_prefill_tokens=prefills * q, num_decodes=size - prefills,
            num_decode_tokens=(size - prefills) * q)

    def _pad_entries(self, array: np.ndarray, lo: int, hi: int, pad: int | str, q: int
                     ) -> None:
        """Entries [lo, hi) of a host buffer for padding requests of q tokens each."""
        dst = array[lo:hi]
        if pad in (SUM_TOKENS, SUM_PAGES):
            step = q if pad == SUM_TOKENS else 1
            np.multiply(self._arange[1:hi - lo + 1], step, out=dst)
            dst += array[lo - 1]
        elif pad == QUERY_LEN:
            dst[...] = q
        elif pad == TOKEN_OFFSET:
            np.remainder(self._arange[:hi - lo], q, out=dst)
        else:
            dst[...] = pad

    def _copy_to_device(self, start: dict[str, int] | None, end: dict[str, int],
                        names: tuple[str, ...] | None = None) -> None:
        """Copy entries [start, end) of the buffers `names` (all by default; lengths by kind;
        None: from 0), one copy per region."""
        if self.dev is self.host:
            return
        for region in REGIONS:
            lo_byte, hi_byte = None, 0
            for name in region:
                if names is not None and name not in names:
                    continue
                length = BUFFERS[name].length
                lo = 0 if start is None else start[length]
                hi = end[length]
                if hi > lo:
                    offset, entry = self._layout[name]
                    lo_byte = offset + lo * entry if lo_byte is None else lo_byte
                    hi_byte = offset + hi * entry
            if lo_byte is not None:
                self._dev_block[lo_byte:hi_byte].copy_(self._host_block[lo_byte:hi_byte],
                                                       non_blocking=True)

    def _views(self, lengths: dict[str, int], names: tuple[str, ...] | None = None
               ) -> dict[str, torch.Tensor | np.ndarray]:
        names = tuple(BUFFERS) if names is None else names
        # A device slice costs microseconds of host time, a dict lookup far less: slices are
        # kept by (buffer, length) and handed out again (the buffers never move). Not the
        # positions: the rotary layers gather cos/sin once per step, keyed by that tensor.
        cache = self._dev_views
        if len(cache) > 4096:
            cache.clear()
        views: dict[str, torch.Tensor | np.ndarray] = {}
        for name in names:
            key = (name, lengths[BUFFERS[name].length])
            view = cache.get(key)
            if view is None:
                view = self.dev[name][:key[1]]
                if name != "positions":
                    cache[key] = view
            views[name] = view
        for name in HOST_MIRRORS:
            if name in names:
                views[f"{name}_cpu"] = self.np[name][:lengths[BUFFERS[name].length]]
        return views
