"""Bidirectional image spans (Gemma 3): the step's per-token `attend_limit` in the common
metadata, honoured by CPU, TRITON (interpreted) and FLEX_ATTENTION against a plain-torch
reference (causal or same span, then the window, as transformers' Gemma 3 mask), and refused
by name on the backends without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.attention import AttentionLayerConfig, BuilderConfig, get_backend_cls
from pagedserve.attention.backend import BIDIRECTIONAL_REASON
from pagedserve.attention.metadata import (
    BidirectionalSpans,
    CommonMetadataBuilder,
    attend_limits,
)
from pagedserve.attention.registry import BackendSelectionError, select_backend
from tests.utils.conformance import Case, run_case

CPU = torch.device("cpu")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# (context_len, query_len) per request and each request's spans [start, end) in positions: a
# span crossing query blocks (TRITON's interpreter takes 16-token blocks at 4 queries per KV
# head), two spans in one request, a span whose start is cached (a prefix-cache hit that ends
# inside an image) and one ending at the request's last token, beside decodes (one with a span
# wholly in its past).
SPAN_BATCH = [(0, 40), (0, 17), (10, 20), (31, 1), (20, 1)]
SPANS = [[(5, 29)], [(2, 6), (9, 17)], [(6, 18), (22, 30)], [], [(3, 10)]]


def _spans(req, start, end):
    return BidirectionalSpans(np.array(req), np.array(start), np.array(end))


def test_attend_limits_match_a_loop():
    token_req = np.repeat(np.arange(3), [12, 7, 9])
    positions = np.concatenate([np.arange(12), np.arange(5, 12), np.arange(30, 39)])
    spans = _spans([2, 0, 0, 1], [33, 2, 8, 0], [36, 5, 12, 6])
    got = attend_limits(token_req, positions, spans)
    want = positions.copy()
    for r, s, e in zip(spans.req, spans.start, spans.end, strict=True):
        inside = (token_req == r) & (positions >= s) & (positions < e)
        want[inside] = e - 1
    np.testing.assert_array_equal(got, want)
    # Spans that move no token's limit (in the past, of length one, of another request).
    assert attend_limits(token_req, positions, _spans([0, 1, 2], [20, 9, 3], [25, 10, 9])) \
        is None
    assert attend_limits(token_req, positions, _spans([], [], [])) is None


@pytest.mark.parametrize("name,window,ratio", [
    ("CPU", None, 4), ("CPU", 8, 1), ("TRITON", None, 4), ("TRITON", 8, 4),
    ("FLEX_ATTENTION", None, 4), ("FLEX_ATTENTION", 8, 1)])
def test_backend_matches_reference(name, window, ratio):
    backend = get_backend_cls(name)
    if not backend.is_available()[0]:
        pytest.skip(backend.is_available()[1])
    run_case(backend, Case(SPAN_BATCH, 16, 2 * ratio, 2, 64, torch.float32, window,
                           spans=SPANS), CPU)


def test_triton_float16():
    backend = get_backend_cls("TRITON")
    if not backend.is_available()[0]:
        pytest.skip(backend.is_available()[1])
    run_case(backend, Case(SPAN_BATCH, 16, 8, 2, 64, torch.float16, spans=SPANS), CPU)


def test_flex_physical_block_mask_lists_the_span_tiles():
    """The physical layout (CUDA's) visits only the tiles its plan lists: with spans, the tiles
    past a query's own position that its span reaches must be listed too (checked against
    flex's own create_block_mask over the same mask_mod). Eager flex on the CPU ignores the
    plan, so run_case could not tell."""
    flex_backend = get_backend_cls("FLEX_ATTENTION")

    class Physical(flex_backend.builder_cls):
        physical_kv = True
        PREFILL_Q_TILE = 16

    bs = 4
    batch, spans = [(0, 40), (10, 20)], [[(5, 29)], [(6, 18), (22, 30)]]
    case = Case(batch, bs, 4, 2, 16, torch.float32, spans=spans)
    pages = [list(range(10)), list(range(10, 18))]
    table = np.full((2, 12), -1, np.int32)
    for row, ids in enumerate(pages):
        table[row, :len(ids)] = ids
    common = CommonMetadataBuilder(2, 64, 12, bs, CPU).build(
        rows=np.arange(2), num_computed=np.array([0, 10], np.int32),
        num_scheduled=np.array([40, 20], np.int32), num_prefills=2, block_table=table,
        spans=_spans([0, 1, 1], [5, 6, 22], [29, 18, 30]))
    config = BuilderConfig.for_layer(case.layer(), bs, 2, 60, 12, CPU)
    md = Physical(config).build(common)
    num_blocks = 18
    mask = md.block_mask_for(num_blocks)
    ref = torch.nn.attention.flex_attention.create_block_mask(
        md.mask_fn, None, None, md.num_rows, num_blocks * bs, device=CPU, BLOCK_SIZE=md.tiles)

    def tiles(num, idx):
        return [set(idx[0, 0, t, :int(num[0, 0, t])].tolist()) for t in range(num.shape[2])]

    listed = [p | f for p, f in zip(tiles(mask.kv_num_blocks, mask.kv_indices),
                                    tiles(mask.full_kv_num_blocks, mask.full_kv_indices),
                                    strict=True)]
    needed = [p | f for p, f in zip(tiles(ref.kv_num_blocks, ref.kv_indices),
                                    tiles(ref.full_kv_num_blocks, ref.full_kv_indices),
                                    strict=True)]
    assert listed == needed


def test_a_span_past_the_step_is_refused():
    """A span must be scheduled whole (the scheduler never splits one): a step that ends
    inside a span would attend keys it does not hold."""
    builder = CommonMetadataBuilder(1, 32, 4, 16, CPU)
    with pytest.raises(ValueError, match="span"):
        builder.build(rows=np.arange(1), num_computed=np.zeros(1, np.int32),
                      num_scheduled=np.array([10], np.int32), num_prefills=1,
                      block_table=np.zeros((1, 4), np.int32), spans=_spans([0], [4], [14]))


def test_backends_without_the_capability_refuse_it_by_name():
    layer = AttentionLayerConfig(4, 2, 64, torch.float16, bidirectional_spans=True)
    for name in ("FLASHINFER", "FLASH_ATTN", "ROCM", "TURBOQUANT"):
        reasons = get_backend_cls(name).validate_configuration(layer, 16, torch.device("cuda"))
        assert BIDIRECTIONAL_REASON in reasons, name
    for name in ("CPU", "TRITON", "FLEX_ATTENTION"):
        assert BIDIRECTIONAL_REASON not in get_backend_cls(name).validate_configuration(
            layer, 16, CPU)
    with pytest.raises(BackendSelectionError,
                       match="ROCM cannot run this model: layer 0: bidirectional image spans"):
        select_backend("ROCM", CPU, [layer.__class__(4, 2, 64, torch.float32,
                                                     bidirectional_spans=True)], 16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["TRITON", "FLEX_ATTENTION"])
@pytest.mark.parametrize("window", [None, 8])
def test_compiled_kernels_on_cuda(name, window):
    """TRITON's compiled kernel (tensor-core dots in bf16) and compiled flex (which visits only
    the listed tiles of its physical plan) against the same reference."""
    if name == "FLEX_ATTENTION":
        from pagedserve.attention.backends.flex_attention import FlexAttentionImpl

        FlexAttentionImpl.compile_flex()
    run_case(get_backend_cls(name), Case(SPAN_BATCH, 16, 8, 2, 128, torch.bfloat16, window,
                                         spans=SPANS), torch.device("cuda"))
