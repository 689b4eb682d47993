"""The Triton kernels of attention/ops against plain torch / the float32 reference. On the CPU
they run in the Triton interpreter (small shapes); the `gpu` tests run the full shape grid."""

import math

import numpy as np
import pytest
import torch

from pagedserve.attention import get_backend_cls
from tests.utils.conformance import BATCHES, Case, reference_attention, run_case

triton = pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not get_backend_cls("TRITON").is_available()[0]:
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from pagedserve.attention.backends import triton_attn  # noqa: E402
from pagedserve.attention.ops import decode_split_kv, unified_attention  # noqa: E402
from pagedserve.attention.ops.reshape_and_cache import reshape_and_cache  # noqa: E402
from pagedserve.attention.ops.unified_attention import TileConfig, query_block_map  # noqa: E402

TRITON = get_backend_cls("TRITON")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("packed", [True, False])
def test_reshape_and_cache_matches_scatter(dtype, block_size, packed):
    gen = torch.Generator().manual_seed(0)
    hkv, d, t = 3, 80, 37
    num_blocks = 64 // block_size
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(DEVICE)
    # key/value as strided views of a fused projection, as a model hands them over (heads
    # packed in a row), or with heads apart (the kernel's general addressing).
    qkv = torch.randn(t, 4 * hkv * d, generator=gen).to(dtype).to(DEVICE)
    if packed:
        key = qkv[:, hkv * d:2 * hkv * d].view(t, hkv, d)
        value = qkv[:, 2 * hkv * d:3 * hkv * d].view(t, hkv, d)
    else:
        key = qkv.view(t, 2 * hkv, 2 * d)[:, ::2, :d]
        value = qkv.view(t, 2 * hkv, 2 * d)[:, 1::2, d:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[::5] = -1  # padding tokens
    expected = cache.clone()
    keep = slots >= 0
    expected[0].view(-1, hkv, d)[slots[keep]] = key.cpu()[keep].to(DEVICE)
    expected[1].view(-1, hkv, d)[slots[keep]] = value.cpu()[keep].to(DEVICE)

    reshape_and_cache(key, value, cache[0], cache[1], slots.to(DEVICE), block_t=8)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("packed", [True, False])
def test_reshape_and_cache_writes_values_of_their_own_head_size(packed):
    # K rows of 192 and V rows of 128 into the two halves of one side-by-side cache.
    gen = torch.Generator().manual_seed(0)
    hkv, d, dv, t, block_size, num_blocks = 2, 192, 128, 21, 16, 3
    cache = torch.randn(TRITON.get_kv_cache_shape(num_blocks, block_size, hkv, d,
                                                  head_size_v=dv), generator=gen).to(DEVICE)
    k_cache, v_cache = TRITON.kv_cache_views(cache, head_size_v=dv)
    qkv = torch.randn(t, hkv * (2 * d + dv), generator=gen).to(DEVICE)
    key = qkv[:, :hkv * d].view(t, hkv, d)
    if packed:
        value = qkv[:, 2 * hkv * d:].view(t, hkv, dv)
    else:  # heads apart: each value head is the tail of a (d + dv)-wide row
        value = qkv[:, hkv * d:].view(t, hkv, d + dv)[:, :, d:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[::4] = -1
    expected = cache.clone()
    keep = slots >= 0
    exp_k, exp_v = TRITON.kv_cache_views(expected, head_size_v=dv)
    exp_k.view(-1, hkv, d)[slots[keep]] = key.cpu()[keep].to(DEVICE)
    exp_v.view(-1, hkv, dv)[slots[keep]] = value.cpu()[keep].to(DEVICE)

    reshape_and_cache(key, value, k_cache, v_cache, slots.to(DEVICE), block_t=8)
    assert torch.equal(cache, expected)


def test_query_block_map():
    # Requests with 5, 1, 9 new tokens and 3 cached in each; blocks of 4 tokens.
    qsl = np.array([0, 5, 6, 15])
    seq_lens = np.array([8, 4, 12])
    req, start = query_block_map(qsl, seq_lens, 4)
    blocks = sorted(zip(req.tolist(), start.tolist(), strict=True))
    assert blocks == [(0, 0), (0, 4), (1, 0), (2, 0), (2, 4), (2, 8)]
    keys = np.minimum(seq_lens[req] - np.diff(qsl)[req] + start + 4, seq_lens[req])
    assert (np.diff(keys) <= 0).all()  # heaviest first


def _paged_decode_inputs(seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed,
                         head_size_v=None):
    """(k_cache, v_cache, table, query, keys, values); head_size_v: the side-by-side layout."""
    gen = torch.Generator().manual_seed(seed)
    pages = [math.ceil(s / block_size) for s in seq_lens]
    perm = torch.randperm(sum(pages) + 2, generator=gen)
    value_size = {} if head_size_v is None else {"head_size_v": head_size_v}
    cache = torch.randn(TRITON.get_kv_cache_shape(sum(pages) + 2, block_size, num_kv_heads,
                                                  head_size, **value_size),
                        generator=gen).to(dtype)
    k_cache, v_cache = TRITON.kv_cache_views(cache, **value_size)
    table = torch.full((len(seq_lens), max(pages)), -1, dtype=torch.int32)
    keys, values, pos = [], [], 0
    for i, (s, n) in enumerate(zip(seq_lens, pages, strict=True)):
        ids = perm[pos:pos + n]
        pos += n
        table[i, :n] = ids.int()
        keys.append(k_cache[ids].flatten(0, 1)[:s])
        values.append(v_cache[ids].flatten(0, 1)[:s])
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(dtype)
    return k_cache, v_cache, table, query, keys, values


@pytest.mark.parametrize("window,soft_cap,with_sinks,head_size_v", [
    (None, None, False, None), (40, None, False, None), (None, 10.0, False, None),
    (None, None, True, None), (40, 10.0, True, None), (None, None, True, 96)],
    ids=["plain", "window", "soft-cap", "sinks", "window-soft-cap-sinks", "diff-kv-sinks"])
def test_split_kv_decode_matches_reference(window, soft_cap, with_sinks, head_size_v):
    seq_lens = [70, 1, 33, 129]
    h, hkv, d, bs = 8, 2, 64, 16
    # Values 96 wide against keys of 64: V padded to 128 where K is not; the partials and the
    # output hold values.
    dv = d if head_size_v is None else head_size_v
    dtype = torch.float16
    k_cache, v_cache, table, query, keys, values = _paged_decode_inputs(
        seq_lens, h, hkv, d, bs, dtype, 1, head_size_v)
    # The merge adds the sinks: counted once whatever the split count (or none if forgotten).
    sinks = (torch.randn(h, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    sinks = sinks if with_sinks else None
    num_splits = 4
    tiles = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)  # 16-key partitions
    qsl = np.arange(len(seq_lens) + 1)
    req, start = query_block_map(qsl, np.array(seq_lens), 1)
    partials = decode_split_kv.allocate_partials(len(seq_lens), h, dv, num_splits, DEVICE)
    out = torch.full((len(seq_lens), h, dv), float("nan"), dtype=dtype, device=DEVICE)
    scale = d ** -0.5
    decode_split_kv.split_kv_decode(
        query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), out, table.to(DEVICE),
        torch.from_numpy(qsl).int().to(DEVICE), torch.tensor(seq_lens).int().to(DEVICE),
        torch.from_numpy(req).to(DEVICE), torch.from_numpy(start).to(DEVICE), len(seq_lens), 16,
        scale, tiles, num_splits, partials, window, soft_cap,
        sinks=None if sinks is None else sinks.to(DEVICE))
    for i, s in enumerate(seq_lens):
        ref = reference_attention(query[i:i + 1], keys[i], values[i], s - 1, scale, window,
                                  soft_cap, sinks)
        torch.testing.assert_close(out[i:i + 1].float().cpu(), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("with_sinks,head_size_v", [(False, None), (True, None), (True, 96)],
                         ids=["plain", "sinks", "diff-kv-sinks"])
def test_backend_takes_split_path_for_small_decode_batches(monkeypatch, with_sinks,
                                                           head_size_v):
    calls = []
    real = decode_split_kv.split_kv_decode

    def counting(*args, **kwargs):
        calls.append(args[13])  # num_splits
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_split_kv, "device_sm_count", lambda device: 64)
    monkeypatch.setattr(decode_split_kv, "SPLIT_MIN_SEQ_LEN", 0)
    monkeypatch.setattr(decode_split_kv, "MIN_TILES_PER_SPLIT", 1)
    monkeypatch.setattr(decode_split_kv, "split_kv_decode", counting)
    monkeypatch.setattr(unified_attention, "INTERPRETER_TILES", TileConfig(16, 16, 4, 2))
    monkeypatch.setattr(unified_attention, "DECODE_TILES", TileConfig(16, 16, 4, 2))
    case = Case(BATCHES["decode"], 16, 8, 2, 64, torch.float32, sliding_window=20,
                sinks=with_sinks, head_size_v=head_size_v)
    run_case(TRITON, case, DEVICE)
    assert calls and calls[0] > 1


@pytest.mark.parametrize("batch", ["mixed", "chunked_prefill"])
@pytest.mark.parametrize("window", [None, 8])
def test_small_tiles_walk_masked_and_unmasked_ranges(monkeypatch, batch, window):
    # 16-key tiles and 4-token query blocks: many blocks per request, and tiles before, inside
    # and after the unmasked middle range of each block.
    small = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
    monkeypatch.setattr(unified_attention, "INTERPRETER_TILES", small)
    monkeypatch.setattr(unified_attention, "PREFILL_TILES", small)
    monkeypatch.setattr(unified_attention, "DECODE_TILES", small)
    run_case(TRITON, Case(BATCHES[batch], 16, 8, 2, 64, torch.float32, window), DEVICE)


class _WriteFirstImpl(triton_attn.TritonAttentionImpl):
    """K/V written by reshape_and_cache first, then attention reading every key from the
    pages: the kernel without its fused write (as benchmarks time it alone)."""

    def _attend(self, query, key, value, k_cache, v_cache, output, md):
        common = md.common
        reshape_and_cache(key, value, k_cache, v_cache, common.slot_mapping)
        unified_attention.unified_attention(
            query, k_cache, v_cache, output, common.block_table, common.query_start_loc,
            common.seq_lens, md.qblock_req, md.qblock_start, md.num_qblocks, md.block_q,
            md.block_m, self.scale, md.tiles, self.sliding_window, self.logits_soft_cap)


class _WriteFirstBackend(triton_attn.TritonAttentionBackend):
    impl_cls = _WriteFirstImpl


@pytest.mark.parametrize("batch,window,head_size_v", [
    ("mixed", None, None), ("mixed", 8, None), ("chunked_prefill", None, None),
    ("chunked_prefill", 8, None), ("mixed", 8, 96), ("decode", None, 96)])
def test_unfused_kernel_reads_new_keys_from_the_pages(monkeypatch, batch, window, head_size_v):
    small = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
    monkeypatch.setattr(unified_attention, "INTERPRETER_TILES", small)
    run_case(_WriteFirstBackend, Case(BATCHES[batch], 16, 8, 2, 64, torch.float32, window,
                                      head_size_v=head_size_v), DEVICE)


def test_same_step_written_context_path_with_diff_kv(monkeypatch):
    # context_written_in_step: TRITON writes K/V with reshape_and_cache first, then attends
    # from the pages only (new keys included); values of their own head size on both paths.
    from pagedserve.attention.metadata import CommonMetadataBuilder

    real_build = CommonMetadataBuilder.build

    def written(self, *args, **kwargs):
        return real_build(self, *args, **{**kwargs, "context_written_in_step": True})

    monkeypatch.setattr(CommonMetadataBuilder, "build", written)
    run_case(TRITON, Case(BATCHES["mixed"], 16, 8, 2, 192, torch.float32, 8,
                          head_size_v=128), DEVICE)


@pytest.mark.parametrize("head_size,dtype", [(80, torch.float32), (96, torch.float16)])
def test_odd_head_size_block_64(head_size, dtype):
    run_case(TRITON, Case(BATCHES["mixed"], 64, 8, 2, head_size, dtype, sliding_window=24),
             DEVICE)


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads", [(1, 6, 1), (32, 12, 2)])
def test_mqa_and_odd_group_sizes(block_size, num_heads, num_kv_heads):
    # 6 query heads per KV head: the row tile is padded past BLOCK_Q * group size.
    run_case(TRITON, Case(BATCHES["mixed"], block_size, num_heads, num_kv_heads, 64,
                          torch.float32, sliding_window=16), DEVICE)


def test_soft_cap_with_window_and_gqa():
    run_case(TRITON, Case(BATCHES["chunked_prefill"], 32, 8, 2, 64, torch.float32,
                          sliding_window=12, logits_soft_cap=3.0), DEVICE)


def test_rocm_backend_runs_the_triton_path():
    rocm = get_backend_cls("ROCM")
    assert issubclass(rocm, TRITON)
    run_case(rocm, Case(BATCHES["mixed"], 16, 4, 2, 64, torch.float16), DEVICE)


def test_refuses_what_it_cannot_do():
    from pagedserve.attention import AttentionLayerConfig

    layer = AttentionLayerConfig(8, 2, 64, torch.float16)
    assert TRITON.validate_configuration(layer, 16, DEVICE) == []
    assert TRITON.validate_configuration(layer, 0, DEVICE)
    assert TRITON.validate_configuration(AttentionLayerConfig(8, 2, 72, torch.float16), 16,
                                         DEVICE)
    mla = AttentionLayerConfig(8, 2, 192, torch.float16, head_size_v=128)
    assert TRITON.validate_configuration(mla, 16, DEVICE) == []
    odd_v = AttentionLayerConfig(8, 2, 192, torch.float16, head_size_v=72)
    assert TRITON.validate_configuration(odd_v, 16, DEVICE) == [
        "value head size 72 not in [64, 80, 96, 128, 192, 256]"]


# --- GPU: the full shape grid in bf16 -------------------------------------------------------

GPU_GRID = [
    pytest.param(batch, bs, ratio, d, window, id=f"{batch}-bs{bs}-gqa{ratio}-d{d}-w{window}")
    for batch in BATCHES for bs in (16, 32, 64) for ratio in (1, 4, 8)
    for d in (64, 80, 96, 128, 256) for window in (None, 8)
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,block_size,ratio,head_size,window", GPU_GRID)
def test_gpu_shape_grid_bf16(batch, block_size, ratio, head_size, window):
    case = Case(BATCHES[batch], block_size, 2 * ratio, 2, head_size, torch.bfloat16, window)
    run_case(TRITON, case, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,head_size", [
    pytest.param(batch, d, id=f"{batch}-d{d}") for batch in BATCHES for d in (64, 128, 256)])
def test_gpu_rocm_runs_the_triton_path_bf16(batch, head_size):
    # ROCM on CUDA is the TRITON builder and kernels by subclassing: a slice of the grid shows
    # the subclass wires them up the same way on the GPU.
    case = Case(BATCHES[batch], 16, 8, 2, head_size, torch.bfloat16, 8)
    run_case(get_backend_cls("ROCM"), case, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("window,soft_cap,sinks", [
    (None, None, False), (700, None, False), (None, 30.0, False), (None, None, True),
    (128, None, True)], ids=["plain", "window", "soft-cap", "sinks", "window-sinks"])
def test_gpu_split_kv_long_decodes_bf16(window, soft_cap, sinks):
    # Three long decodes x 8 KV heads fill few SMs: the builder chooses the split path.
    from pagedserve.attention.ops.decode_split_kv import choose_num_splits

    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert choose_num_splits(3, 8, 4001, sms, 64) > 1
    # Sinks of std 8: against thousands of keys, smaller ones would not show in bf16.
    case = Case([(4000, 1), (2500, 1), (1100, 1)], 16, 32, 8, 128, torch.bfloat16, window,
                soft_cap, sinks=sinks, sink_std=8.0)
    run_case(TRITON, case, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,block_size,ratio,head_size,head_size_v", [
    pytest.param(batch, bs, ratio, d, dv, id=f"{batch}-bs{bs}-gqa{ratio}-d{d}-dv{dv}")
    for batch in BATCHES for bs in (16, 32) for ratio in (1, 4, 8)
    for d, dv in ((192, 128), (128, 64))])
def test_gpu_diff_kv_bf16(batch, block_size, ratio, head_size, head_size_v):
    # Values of their own head size (MLA's 192/128): the large-head tiles at D_PAD 256.
    case = Case(BATCHES[batch], block_size, 2 * ratio, 2, head_size, torch.bfloat16, 8,
                head_size_v=head_size_v)
    run_case(TRITON, case, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("sinks", [False, True])
def test_gpu_split_kv_long_decodes_diff_kv_bf16(sinks):
    case = Case([(4000, 1), (2500, 1), (1100, 1)], 16, 32, 8, 192, torch.bfloat16,
                sinks=sinks, sink_std=8.0, head_size_v=128)
    run_case(TRITON, case, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_gpu_float32(batch):
    run_case(TRITON, Case(BATCHES[batch], 16, 8, 2, 128, torch.float32, 8), DEVICE)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter's program order shows the race")
def test_same_step_prefix_hits_see_the_written_cache(tmp_path, make_llm):
    # n = 3 samples of one prompt are admitted in one step and the later ones hit the blocks
    # the first one's prefill writes in that step: TRITON must write K/V before attending
    # there (its fused write runs alongside the reads otherwise; the interpreter runs the
    # writing program after the reading ones, so the race shows).
    import transformers

    from pagedserve import SamplingParams

    config = transformers.LlamaConfig(
        vocab_size=173, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
        initializer_range=0.3, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    prompt = [(i * 7) % 170 + 3 for i in range(40)]
    params = SamplingParams(temperature=0, n=3, max_tokens=6)
    outputs = {}
    for backend in ("CPU", "TRITON"):
        llm = make_llm(model=str(tmp_path), dtype="float32", device="cpu",
                       kv_cache_memory="16MiB", enable_prefix_caching=True, block_size=4,
                       attention_backend=backend)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        outputs[backend] = [c.token_ids for c in out.outputs]
    assert outputs["TRITON"] == outputs["CPU"]
