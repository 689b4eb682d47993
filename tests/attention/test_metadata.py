"""CommonAttentionMetadata: the worked CSR example of docs/architecture.md ("The metadata
contract"), and buffer reuse across steps."""

import numpy as np
import pytest
import torch

from pagedserve.attention.metadata import BUFFERS, CommonMetadataBuilder
from pagedserve.engine.input_batch import BlockTable


def _build(builder, table, computed, scheduled, num_prefills=0, rows=None):
    rows = np.arange(len(computed)) if rows is None else np.asarray(rows)
    return builder.build(rows, np.asarray(computed, dtype=np.int32),
                         np.asarray(scheduled, dtype=np.int32), num_prefills, table.table)


def test_architecture_worked_example():
    table = BlockTable(max_num_reqs=4, max_blocks_per_seq=6)
    for row, ids in enumerate([[0, 1, 3], [2, 5], [4, 6, 7, 8]]):
        table.add_row(row, ids)
    builder = CommonMetadataBuilder(4, 64, 6, 16, torch.device("cpu"))
    # seq_lens 40, 25, 50 as decodes: 39 + 1, 24 + 1, 49 + 1.
    md = _build(builder, table, [39, 24, 49], [1, 1, 1])
    assert md.paged_kv_indptr.tolist() == [0, 3, 5, 9]
    assert md.paged_kv_indices.tolist() == [0, 1, 3, 2, 5, 4, 6, 7, 8]
    assert md.paged_kv_last_page_len.tolist() == [8, 9, 2]
    assert md.seq_lens.tolist() == [40, 25, 50]
    assert md.context_lens.tolist() == [39, 24, 49]
    assert md.query_start_loc.tolist() == [0, 1, 2, 3]
    # The columns up to the widest request's pages (4); the rest are never read.
    assert md.block_table[:, :4].tolist() == [[0, 1, 3, -1], [2, 5, -1, -1], [4, 6, 7, 8]]
    # Token 39 of request 0 is in its third block (id 3) at offset 7.
    assert md.slot_mapping.tolist() == [3 * 16 + 7, 5 * 16 + 8, 8 * 16 + 1]
    assert md.positions.tolist() == [39, 24, 49]
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (3, 3, 0)
    assert (md.max_query_len, md.max_seq_len) == (1, 50)


def test_full_last_page_has_block_size_length():
    table = BlockTable(2, 4)
    table.add_row(0, [7, 3])
    builder = CommonMetadataBuilder(2, 64, 4, 16, torch.device("cpu"))
    md = _build(builder, table, [0], [32], num_prefills=1)
    assert md.paged_kv_last_page_len.tolist() == [16]
    assert md.slot_mapping.tolist() == [7 * 16 + i for i in range(16)] + \
        [3 * 16 + i for i in range(16)]


def _expected(table, rows, computed, scheduled, bs):
    slots, indices, last = [], [], []
    for row, c, s in zip(rows, computed, scheduled, strict=True):
        ids = table.table[row]
        for p in range(c, c + s):
            slots.append(int(ids[p // bs]) * bs + p % bs)
        n = -(-(c + s) // bs)
        indices += ids[:n].tolist()
        last.append(c + s - (n - 1) * bs)
    return slots, indices, last


def test_larger_then_smaller_batch_reuses_buffers():
    bs = 4
    rng = np.random.default_rng(0)
    table = BlockTable(16, 32)
    perm = rng.permutation(16 * 32)
    for row in range(16):
        table.add_row(row, perm[row * 32:(row + 1) * 32].tolist())
    builder = CommonMetadataBuilder(16, 512, 32, bs, torch.device("cpu"))
    pointers = None
    for rows, computed, scheduled, num_prefills in [
        ([3, 0, 7, 9, 12, 15, 1], [0, 5, 17, 30, 8, 60, 2], [13, 40, 1, 1, 1, 1, 1], 2),
        ([5, 2], [10, 3], [1, 1], 0),
        ([11, 4, 6], [0, 0, 99], [20, 3, 1], 2),
    ]:
        md = _build(builder, table, computed, scheduled, num_prefills, rows)
        slots, indices, last = _expected(table, rows, computed, scheduled, bs)
        assert md.slot_mapping.tolist() == slots
        assert md.paged_kv_indices.tolist() == indices
        assert md.paged_kv_last_page_len.tolist() == last
        assert md.query_start_loc.tolist() == [0, *np.cumsum(scheduled).tolist()]
        assert md.num_prefill_tokens == sum(scheduled[:num_prefills])
        width = -(-(np.asarray(computed) + scheduled).max() // bs)  # the pages in use
        assert md.block_table[:, :width].tolist() == table.table[rows, :width].tolist()
        now = (md.slot_mapping.data_ptr(), md.paged_kv_indices.data_ptr(),
               md.query_start_loc.data_ptr(), md.block_table.data_ptr())
        assert pointers is None or now == pointers  # views of the same persistent buffers
        pointers = now


def _as_if_on_a_device(builder: CommonMetadataBuilder) -> None:
    """Give a CPU builder a separate 'device' block, so its region copies run as on CUDA."""
    capacity = {name: view.shape[0] for name, view in builder.host.items()}
    kinds = {"reqs": capacity["seq_lens"], "reqs+1": capacity["query_start_loc"],
             "tokens": capacity["positions"], "pages": capacity["paged_kv_indices"]}
    builder._dev_block = torch.full_like(builder._host_block, 0x7F)  # garbage until copied
    builder.dev = builder._carve(builder._dev_block, kinds)


def test_region_copies_carry_every_used_entry():
    """On CUDA the buffers go over in one copy per region: after a step (and after padding it
    for a graph) every entry a step reads is on the device, for every buffer."""
    table = BlockTable(8, 6)
    for row, ids in enumerate([[0, 1, 3], [2, 5], [4, 6, 7, 8], [9]]):
        table.add_row(row, ids)
    builder = CommonMetadataBuilder(8, 64, 6, 16, torch.device("cpu"))
    _as_if_on_a_device(builder)
    for computed, scheduled, prefills, pad in [([0, 20], [30, 5], 1, None),
                                               ([39, 24, 49], [1, 1, 1], 0, 6),
                                               ([3], [1], 0, 4),
                                               ([39, 20], [3, 3], 2, 5)]:  # verify steps
        md = _build(builder, table, computed, scheduled, prefills)
        if pad is not None:
            md = builder.pad_decode(md, pad)
        lengths = {"reqs": md.num_reqs, "reqs+1": md.num_reqs + 1,
                   "tokens": md.num_actual_tokens,
                   "pages": int(md.paged_kv_indptr_cpu[md.num_reqs])}
        for name, buf in BUFFERS.items():
            on_device = getattr(md, name)
            assert on_device.data_ptr() == builder.dev[name].data_ptr(), name
            assert torch.equal(on_device, builder.host[name][:lengths[buf.length]]), name


def test_pad_decode_of_a_verify_step():
    """A uniform step of q = 3 tokens a request (a verify step with 2 drafts) padded from 2 to
    4 requests: each padding request holds 3 tokens at positions 0..2 with slot -1, seq_len 3
    and the one page 0 filled to 3; the real entries stand, and every request stays a prefill
    (the scheduler's class for several new tokens)."""
    table = BlockTable(max_num_reqs=4, max_blocks_per_seq=6)
    for row, ids in enumerate([[0, 1, 3], [2, 5]]):
        table.add_row(row, ids)
    builder = CommonMetadataBuilder(4, 64, 6, 16, torch.device("cpu"))
    md = _build(builder, table, [37, 15], [3, 3], num_prefills=2)
    real = {name: getattr(md, name).tolist() for name in BUFFERS if name != "block_table"}
    padded = builder.pad_decode(md, 4)
    assert (padded.num_reqs, padded.num_actual_tokens, padded.max_query_len) == (4, 12, 3)
    assert (padded.num_prefills, padded.num_prefill_tokens, padded.num_decodes) == (4, 12, 0)
    assert padded.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert padded.positions.tolist() == [37, 38, 39, 15, 16, 17, 0, 1, 2, 0, 1, 2]
    assert padded.slot_mapping.tolist() == real["slot_mapping"] + [-1] * 6
    assert padded.seq_lens.tolist() == [40, 18, 3, 3]
    assert padded.context_lens.tolist() == [37, 15, 0, 0]
    assert padded.paged_kv_indptr.tolist() == [0, 3, 5, 6, 7]
    assert padded.paged_kv_indices.tolist() == [0, 1, 3, 2, 5, 0, 0]
    assert padded.paged_kv_last_page_len.tolist() == [8, 2, 3, 3]
    assert padded.block_table[2:, 0].tolist() == [0, 0]
    for name, values in real.items():  # the real requests' entries are untouched
        assert getattr(padded, name).tolist()[:len(values)] == values, name


def test_pad_decode_refuses_a_step_of_unequal_queries():
    table = BlockTable(max_num_reqs=4, max_blocks_per_seq=6)
    table.add_row(0, [0, 1])
    table.add_row(1, [2])
    builder = CommonMetadataBuilder(4, 64, 6, 16, torch.device("cpu"))
    md = _build(builder, table, [10, 4], [3, 2], num_prefills=2)
    with pytest.raises(ValueError, match="uniform step: 2 requests, 5 tokens"):
        builder.pad_decode(md, 4)


def test_without_csr_indices_the_rest_is_the_same():
    """A builder for backends that do not read the CSR page indices (TRITON) leaves them empty
    and builds everything else as with them."""
    table = BlockTable(max_num_reqs=4, max_blocks_per_seq=6)
    for row, ids in enumerate([[0, 1, 3], [2, 5], [4, 6, 7, 8]]):
        table.add_row(row, ids)
    full, lean = (CommonMetadataBuilder(4, 64, 6, 16, torch.device("cpu"), csr=csr)
                  for csr in (True, False))
    args = ([10, 24, 49], [14, 1, 1], 1)  # a prefill chunk, then two decodes
    a, b = _build(full, table, *args), _build(lean, table, *args)
    assert a.paged_kv_indices.tolist() == [0, 1, 2, 5, 4, 6, 7, 8]
    assert len(b.paged_kv_indices) == 0
    for name in BUFFERS:
        if name not in ("paged_kv_indices", "block_table"):
            assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert a.block_table[:, :4].tolist() == b.block_table[:, :4].tolist()


def test_positions_are_a_new_tensor_every_step():
    """The rotary layers gather cos/sin once per step, keyed by the positions tensor they are
    handed (models/layers.py): two steps of the same length must not share that object."""
    table = BlockTable(max_num_reqs=2, max_blocks_per_seq=4)
    table.add_row(0, [3, 1])
    builder = CommonMetadataBuilder(2, 16, 4, 16, torch.device("cpu"))
    first = _build(builder, table, [5], [1])
    second = _build(builder, table, [6], [1])
    assert first.positions is not second.positions
    assert first.slot_mapping is second.slot_mapping  # the other views are kept
