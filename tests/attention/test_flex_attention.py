"""FLEX_ATTENTION (torch flex_attention, eager on the CPU) against the float32 reference, its
selection by name, and greedy decoding of a tiny Llama against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from pagedserve import SamplingParams
from pagedserve.attention import BuilderConfig, get_backend_cls
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.attention.registry import AUTO_ORDER, select_backend
from tests.utils.conformance import BATCHES, Case, reference_attention, run_case
from tests.utils.paged import hf_greedy

NAME = "FLEX_ATTENTION"
CPU = torch.device("cpu")
BACKEND = get_backend_cls(NAME)
pytestmark = [
    pytest.mark.skipif(not BACKEND.is_available()[0], reason=BACKEND.is_available()[1]),
    # Eager (unfused) flex on the CPU is what these tests mean to run.
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]


def _grid():
    # test_conformance.py runs this backend too (its reduced grid: block sizes 16/32, GQA 1/4,
    # windows, sinks, soft-cap, half precision, DiffKV). CI adds here what it leaves out: block
    # size 1, and soft-cap + sinks + window + GQA together over every batch kind; the rest
    # repeats it (flex's 128-token tiles do not follow the page size) and is slow.
    for batch in BATCHES:
        for block_size in (1, 16, 32):
            for ratio, window, cap, sinks in ((1, None, None, False), (4, 8, None, False),
                                              (3, None, 5.0, True), (4, 8, 5.0, True)):
                fast = ratio == 4 and (block_size == 1 or block_size == 16 and sinks)
                yield pytest.param(batch, block_size, ratio, window, cap, sinks,
                                   marks=() if fast else (pytest.mark.slow,),
                                   id=f"{batch}-bs{block_size}-gqa{ratio}-w{window}"
                                      f"-cap{cap}-sinks{sinks}")


@pytest.mark.parametrize("batch,block_size,ratio,window,cap,sinks", list(_grid()))
def test_matches_reference(batch, block_size, ratio, window, cap, sinks):
    case = Case(BATCHES[batch], block_size, 2 * ratio, 2, 64, torch.float32, window, cap,
                sinks=sinks)
    run_case(BACKEND, case, CPU)


@pytest.mark.slow  # the conformance suite's half-precision cases run it in CI
@pytest.mark.parametrize("batch", ["mixed", "chunked_prefill"])
def test_bfloat16(batch):
    run_case(BACKEND, Case(BATCHES[batch], 16, 8, 2, 64, torch.bfloat16, 8), CPU)


@pytest.mark.slow  # as the conformance suite's DiffKV cases
def test_values_of_another_head_size():
    case = Case(BATCHES["mixed"], 16, 8, 2, 192, torch.float32, 8, 5.0, sinks=True,
                head_size_v=128)
    run_case(BACKEND, case, CPU)


def test_padding_rows_after_the_real_tokens_are_left_alone():
    """A step padded beyond its real tokens (as a captured graph's) attends only the real
    ones; the output rows of padding are not written."""
    layer = Case([(0, 3)], 4, 4, 2, 16, torch.float32).layer()
    common = CommonMetadataBuilder(1, 8, 2, 4, CPU).build(
        rows=np.arange(1), num_computed=np.zeros(1, np.int32),
        num_scheduled=np.array([3], np.int32), num_prefills=1,
        block_table=np.array([[1, 0]], np.int32))
    md = BACKEND.builder_cls(BuilderConfig.for_layer(layer, 4, 1, 8, 2, CPU)).build(common)
    cache = torch.zeros(BACKEND.get_kv_cache_shape(2, 4, 2, 16))
    out = torch.full((5, 4, 16), 7.0)
    q, k, v = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    BACKEND.impl_cls(layer).forward(q, k, v, cache, md, output=out)
    assert torch.isfinite(out[:3]).all() and (out[3:] == 7.0).all()


def test_selected_by_name_only(monkeypatch):
    layers = [Case([], 16, 8, 2, 64, torch.float32, 8, 5.0, sinks=True).layer()]
    assert select_backend(NAME, CPU, layers, 16) is BACKEND
    assert select_backend("flex_attention", CPU, layers, 16) is BACKEND
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", NAME)
    assert select_backend(None, CPU, layers, 16) is BACKEND
    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND")
    assert all(NAME not in order for order in AUTO_ORDER.values())
    assert select_backend(None, CPU, layers, 16) is not BACKEND
    assert set(BACKEND.features()) >= {"sliding-window", "soft-cap", "sinks"}


def _tiny_llama(path) -> transformers.PreTrainedModel:
    """A 2-layer random Llama (GQA 2) saved to `path`, for greedy tests against transformers."""
    config = transformers.LlamaConfig(
        vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf.eval()
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("block_size", [16, pytest.param(1, marks=pytest.mark.slow)])
def test_tiny_llama_greedy_matches_transformers(tmp_path, make_llm, block_size):
    hf = _tiny_llama(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 211, (n,), generator=g).tolist() for n in (3, 17, 40, 1, 25)]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    # 16 tokens a step: long prompts are chunked and share steps with decodes (mixed batches).
    llm = make_llm(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="16MiB",
                   attention_backend=NAME, max_num_batched_tokens=16, block_size=block_size)
    assert llm.engine.runner.backend is BACKEND
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


# The physical layout (the CUDA path: the cache itself as keys, a block mask planned from the
# page table) run eagerly on the CPU with small caches.
class PhysicalBuilder(BACKEND.builder_cls):
    physical_kv = True


class PackedPhysicalBuilder(PhysicalBuilder):
    ALIGN_REQUESTS = False  # vLLM's layout: tiles of packed rows, several requests a tile


class SmallTilePhysicalBuilder(PhysicalBuilder):
    PREFILL_Q_TILE = 16  # prefill tiles of 16 rows: the test batches fill whole tiles


class UnfoldedPhysicalBuilder(PhysicalBuilder):
    FOLD_GQA = False  # flex's enable_gqa: a flex head per query head


def _physical(builder):
    return type(f"{NAME}_{builder.__name__}", (BACKEND,), {"builder_cls": builder})


PHYSICAL = {b.__name__: _physical(b)
            for b in (PhysicalBuilder, PackedPhysicalBuilder, SmallTilePhysicalBuilder,
                      UnfoldedPhysicalBuilder)}


def _physical_grid():
    # CI runs every batch kind through the default layout (block size 16 with every feature,
    # block size 1 with GQA 3 and a window) and the other layouts' decode and mixed batches at
    # block size 32; the rest is slow.
    combos = ((1, None, None, False), (4, 8, 5.0, True), (3, 20, None, False))
    for layout in PHYSICAL:
        for batch in BATCHES:
            for block_size in (1, 16, 32):
                for i, (ratio, window, cap, sinks) in enumerate(combos):
                    if layout == "PhysicalBuilder":
                        fast = (block_size, i) in ((16, 1), (1, 2))
                    else:
                        fast = (block_size, i) == (32, 1) and batch in ("decode", "mixed")
                    yield pytest.param(layout, batch, block_size, ratio, window, cap, sinks,
                                       marks=() if fast else (pytest.mark.slow,),
                                       id=f"{layout}-{batch}-bs{block_size}-gqa{ratio}"
                                          f"-w{window}-cap{cap}-sinks{sinks}")


@pytest.mark.parametrize("layout,batch,block_size,ratio,window,cap,sinks",
                         list(_physical_grid()))
def test_physical_layout_matches_reference(layout, batch, block_size, ratio, window, cap,
                                           sinks):
    case = Case(BATCHES[batch], block_size, 2 * ratio, 2, 64, torch.float32, window, cap,
                sinks=sinks)
    run_case(PHYSICAL[layout], case, CPU)


@pytest.mark.parametrize("layout", [
    layout if layout == "PhysicalBuilder" else pytest.param(layout, marks=pytest.mark.slow)
    for layout in PHYSICAL])
def test_physical_layout_values_of_another_head_size_and_bfloat16(layout):
    run_case(PHYSICAL[layout], Case(BATCHES["mixed"], 16, 8, 2, 192, torch.float32, 8, 5.0,
                                    sinks=True, head_size_v=128), CPU)
    run_case(PHYSICAL[layout], Case(BATCHES["chunked_prefill"], 16, 8, 2, 64, torch.bfloat16,
                                    8), CPU)


def _shared_step(block_size: int, window: int | None):
    """A step over a cache of 40 pages whose requests share pages (a prefix-cache hit: page ids
    repeated at the same logical index) and whose sliding-window tables hold page 0 before the
    window (the engine's placeholder for freed pages; page 0 is another request's real page)."""
    bs = block_size
    g = torch.Generator().manual_seed(3)
    # (context, new) per request; prefills first.
    batch = [(3 * bs, 2 * bs + 3), (3 * bs + 1, 5), (3 * bs + 2, 1), (4 * bs - 1, 1),
             (5 * bs + 8, 1), (1, 1)]
    pages = [-(-(c + q) // bs) for c, q in batch]
    perm = torch.randperm(40, generator=g).tolist()
    perm.remove(0)
    shared = perm[:3]  # requests 0-3 share their first three pages
    rest = iter(perm[3:])
    tables = []
    for i, n in enumerate(pages):
        ids = shared + [next(rest) for _ in range(n - 3)] if i < 4 else [
            next(rest) for _ in range(n)]
        tables.append(ids)
    tables[5][0] = 0  # page 0 is request 5's real page
    # Request 4's pages before its window (as the window's first query sees it): page 0.
    first = 0 if window is None else max((batch[4][0] - window + 1) // bs, 0)
    tables[4][:first] = [0] * first
    max_blocks = max(pages) + 1
    table = np.full((len(batch), max_blocks), -1, np.int32)
    for row, ids in enumerate(tables):
        table[row, :len(ids)] = ids
    common = CommonMetadataBuilder(len(batch), sum(q for _, q in batch), max_blocks, bs,
                                   CPU).build(
        rows=np.arange(len(batch)), num_computed=np.array([c for c, _ in batch], np.int32),
        num_scheduled=np.array([q for _, q in batch], np.int32), num_prefills=2,
        block_table=table)
    return batch, tables, common, max_blocks


@pytest.mark.parametrize("layout", list(PHYSICAL))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [None, 7])
def test_physical_layout_shared_pages_and_placeholders(layout, block_size, window):
    """Pages shared between requests and page-0 placeholders: each request attends exactly its
    own context, read from the cache through its table (a plain float32 reference)."""
    batch, tables, common, max_blocks = _shared_step(block_size, window)
    layer = Case(batch, block_size, 8, 2, 16, torch.float32, window, 5.0).layer()
    config = BuilderConfig.for_layer(layer, block_size, len(batch), common.num_actual_tokens,
                                     max_blocks, CPU)
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(BACKEND.get_kv_cache_shape(40, block_size, 2, 16), generator=g)
    n = common.num_actual_tokens
    q, k, v = (torch.randn(n, 8, 16, generator=g), torch.randn(n, 2, 16, generator=g),
               torch.randn(n, 2, 16, generator=g))
    backend = PHYSICAL[layout]
    md = backend.builder_cls(config).build(common)
    out = backend.impl_cls(layer).forward(q, k, v, cache, md)
    k_slots, v_slots = cache[0].flatten(0, 1), cache[1].flatten(0, 1)
    start = 0
    for i, (c, qlen) in enumerate(batch):
        pos = torch.arange(c + qlen)
        slots = torch.tensor(tables[i])[pos // block_size] * block_size + pos % block_size
        ref = reference_attention(q[start:start + qlen], k_slots[slots], v_slots[slots], c,
                                  layer.softmax_scale, window, 5.0)
        torch.testing.assert_close(out[start:start + qlen], ref, rtol=1e-5, atol=1e-5)
        start += qlen


def _tiles(num: torch.Tensor, idx: torch.Tensor) -> list[list[int]]:
    """Each query tile's listed KV tiles, in order."""
    return [idx[0, 0, t, :int(num[0, 0, t])].tolist() for t in range(num.shape[-1])]


def _step_for_mask(step: str, block_size: int, window: int | None, seed: int):
    """(batch, common metadata, table width, cache blocks) of a step for the block-mask tests:
    the shared-page step, or a BATCHES step over randomly placed pages."""
    if step == "shared":
        batch, _, common, max_blocks = _shared_step(block_size, window)
        return batch, common, max_blocks, 40
    batch = BATCHES[step]
    blocks = [-(-(c + q) // block_size) for c, q in batch]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    max_blocks = max(blocks) + 1
    table = np.full((len(batch), max_blocks), -1, np.int32)
    pos = 0
    for row, nb in enumerate(blocks):
        table[row, :nb] = perm[pos:pos + nb]
        pos += nb
    common = CommonMetadataBuilder(len(batch), sum(q for _, q in batch), max_blocks,
                                   block_size, CPU).build(
        rows=np.arange(len(batch)), num_computed=np.array([c for c, _ in batch], np.int32),
        num_scheduled=np.array([q for _, q in batch], np.int32),
        num_prefills=sum(q > 1 for _, q in batch), block_table=table)
    return batch, common, max_blocks, num_blocks


@pytest.mark.parametrize("layout", list(PHYSICAL))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("step", ["mixed", "decode", "shared"])
def test_physical_block_mask_lists_exactly_the_tiles_the_mask_needs(layout, block_size, window,
                                                                    step):
    """Eager flex ignores the block mask's sparsity (it applies the mask_mod to every pair),
    the GPU kernel visits only the listed tiles: checked here against flex's own
    create_block_mask over the same mask_mod (dense evaluation). Every tile with a visible
    key is listed once (a duplicate would count its keys twice); a tile listed as full (no
    mask_mod) is full."""
    batch, common, max_blocks, num_blocks = _step_for_mask(step, block_size, window, 5)
    layer = Case(batch, block_size, 4, 2, 16, torch.float32, window).layer()
    config = BuilderConfig.for_layer(layer, block_size, len(batch), common.num_actual_tokens,
                                     max_blocks, CPU)
    md = PHYSICAL[layout].builder_cls(config).build(common)
    mask = md.block_mask_for(num_blocks)
    flex = torch.nn.attention.flex_attention
    ref = flex.create_block_mask(md.mask_fn, None, None, md.num_rows, num_blocks * block_size,
                                 device=CPU, BLOCK_SIZE=md.tiles)
    # flex's CUDA kernels read full_kv_indices with kv_indices' row stride.
    assert mask.full_kv_indices.shape == mask.kv_indices.shape
    partial = _tiles(mask.kv_num_blocks, mask.kv_indices)
    full = _tiles(mask.full_kv_num_blocks, mask.full_kv_indices)
    ref_partial = _tiles(ref.kv_num_blocks, ref.kv_indices)
    ref_full = _tiles(ref.full_kv_num_blocks, ref.full_kv_indices)
    for t, (p, f, rp, rf) in enumerate(zip(partial, full, ref_partial, ref_full, strict=True)):
        listed = p + f
        assert len(listed) == len(set(listed)), f"query tile {t}: a KV tile listed twice"
        assert set(listed) == set(rp) | set(rf), f"query tile {t}: {sorted(listed)} listed, " \
                                                 f"{sorted(set(rp) | set(rf))} needed"
        assert set(f) <= set(rf), f"query tile {t}: tiles {set(f) - set(rf)} are not full"
    if layout == "SmallTilePhysicalBuilder" and step == "shared" and block_size == 16 \
            and window is None:
        assert any(full), "no full tile: the case does not test them"


@pytest.mark.parametrize("block_size", [16, pytest.param(1, marks=pytest.mark.slow)])
def test_tiny_llama_greedy_through_the_physical_layout(tmp_path, make_llm, monkeypatch,
                                                       block_size):
    """The engine with the physical layout forced on the CPU (a small cache: eager flex scores
    every slot): chunked prefills sharing steps with decodes, transformers' greedy tokens."""
    monkeypatch.setattr(BACKEND.builder_cls, "physical_kv", True)
    hf = _tiny_llama(tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 211, (n,), generator=g).tolist() for n in (3, 21, 1)]
    expected = [hf_greedy(hf, p, 6) for p in prompts]
    llm = make_llm(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="16MiB",
                   num_gpu_blocks_override=16 * 16 // block_size, attention_backend=NAME,
                   max_num_batched_tokens=8, block_size=block_size)
    runner = llm.engine.runner
    assert all(b.uses_physical_kv() for b in runner.builders.values())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


# A longer step for the GPU: several query and KV tiles per request, decodes over long contexts.
LONG_BATCH = [(0, 300), (200, 77), (1000, 1), (517, 1), (31, 1), (2047, 1), (0, 1)]


def _gpu_grid():
    # The engine's layout over every batch kind, block size and window; the other two
    # layouts over the mixed and long batches.
    for layout in PHYSICAL:
        for batch in [*BATCHES, "long"]:
            for block_size in (1, 16, 32):
                for window in (None, 100):
                    if layout == "PhysicalBuilder" or (batch in ("mixed", "long")
                                                       and block_size == 16 and window):
                        yield pytest.param(layout, batch, block_size, window,
                                           id=f"{layout}-{batch}-bs{block_size}-w{window}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout,batch,block_size,window", list(_gpu_grid()))
def test_compiled_physical_layout_on_cuda(layout, batch, block_size, window):
    """The compiled flex kernel (which, unlike eager flex, visits only the block mask's listed
    tiles and skips the mask_mod in full ones) against the float32 reference, bf16, GQA 4,
    soft-cap and sinks."""
    from pagedserve.attention.backends.flex_attention import FlexAttentionImpl

    FlexAttentionImpl.compile_flex()
    requests = LONG_BATCH if batch == "long" else BATCHES[batch]
    case = Case(requests, block_size, 8, 2, 64, torch.bfloat16, window, 30.0, sinks=True)
    run_case(PHYSICAL[layout], case, torch.device("cuda"))


@pytest.mark.gpu
def test_tiny_llama_greedy_on_cuda(tmp_path):
    """The engine on CUDA through FLEX_ATTENTION (compiled at warm-up, the physical layout)
    against transformers' greedy tokens, float32, chunked prefill."""
    from pagedserve import LLM

    hf = _tiny_llama(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 211, (n,), generator=g).tolist() for n in (3, 17, 40, 1, 25)]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", attention_backend=NAME,
              gpu_memory_utilization=0.2, max_num_batched_tokens=16)
    assert all(b.uses_physical_kv() for b in llm.engine.runner.builders.values())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.slow  # a C++ compile of flex per case (~25 s each on the 2-core machine)
@pytest.mark.parametrize("layout,step,block_size,window", [
    ("PhysicalBuilder", "mixed", 16, None), ("PhysicalBuilder", "shared", 1, 7),
    ("PackedPhysicalBuilder", "shared", 16, 7), ("SmallTilePhysicalBuilder", "shared", 16, None)])
def test_physical_block_mask_drives_a_sparse_kernel(layout, step, block_size, window):
    """flex compiled for the CPU visits only the listed tiles, as the GPU kernel does: with
    the physical block mask it matches eager flex (which scores every pair), and without one
    listed tile it does not (so the comparison can fail). The CPU kernel wants kv_indices as
    wide as the whole KV length, so they are padded here (the CUDA kernel does not)."""
    flex = torch.nn.attention.flex_attention
    batch, common, max_blocks, num_blocks = _step_for_mask(step, block_size, window, 6)
    layer = Case(batch, block_size, 8, 2, 64, torch.float32, window).layer()
    config = BuilderConfig.for_layer(layer, block_size, len(batch), common.num_actual_tokens,
                                     max_blocks, CPU)
    md = PHYSICAL[layout].builder_cls(config).build(common)
    mask = md.block_mask_for(num_blocks)
    slots = num_blocks * block_size
    width = -(-slots // md.tiles[1])

    def sparse(num):
        def pad(t):
            return torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        return flex.BlockMask.from_kv_blocks(
            num, pad(mask.kv_indices), mask.full_kv_num_blocks, pad(mask.full_kv_indices),
            BLOCK_SIZE=md.tiles, mask_mod=md.mask_fn, seq_lengths=(md.num_rows, slots),
            compute_q_blocks=False)

    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 8, md.num_rows, 64, generator=g)
    k, v = torch.randn(1, 2, slots, 64, generator=g), torch.randn(1, 2, slots, 64, generator=g)
    rows = torch.arange(md.num_rows) if md.q_rows is None else md.q_rows
    eager = flex.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)[:, :, rows]
    # Static shapes: the CPU template's dynamic-shape code fails to compile (torch 2.13).
    torch._dynamo.reset()
    compiled = torch.compile(flex.flex_attention, dynamic=False)
    got = compiled(q, k, v, block_mask=sparse(mask.kv_num_blocks), enable_gqa=True)
    torch.testing.assert_close(got[:, :, rows], eager, rtol=1e-5, atol=1e-5)
    dropped = mask.kv_num_blocks.clone()
    tile = int(torch.argmax(dropped))
    dropped[..., tile] -= 1
    got = compiled(q, k, v, block_mask=sparse(dropped), enable_gqa=True)
    assert not torch.allclose(got[:, :, rows], eager, rtol=1e-3, atol=1e-3)


def test_warmup_steps_run_at_start_up_and_leave_no_trace(tmp_path, monkeypatch):
    """The backend's warm-up steps (on CUDA flex compiles per kind of step) run through the
    whole model when the engine starts, the ones past its limits are skipped, and the greedy
    tokens after them are transformers' (what they wrote in the cache is never read)."""
    from pagedserve import LLM
    from pagedserve.attention.backends.flex_attention import FlexAttentionBackend
    from pagedserve.engine.model_runner import ModelRunner

    hf = _tiny_llama(tmp_path)
    steps = [(2, 1, 40), (1, 30, 0), (3, 1, 500)]  # the last is past max_model_len
    monkeypatch.setattr(FlexAttentionBackend, "warmup_steps", classmethod(lambda cls, d: steps))
    ran = []
    real = ModelRunner._dummy_forward
    monkeypatch.setattr(ModelRunner, "_dummy_forward",
                        lambda self, *shape: ran.append(shape) or real(self, *shape))
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", attention_backend=NAME,
              max_model_len=256, kv_cache_memory="8MiB")
    assert ran == steps[:2]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 211, (n,), generator=g).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, 8) for p in prompts]


def test_compiled_flex_refuses_heads_under_16_by_name():
    """Inductor's flex kernels take heads of 16 and up: on CUDA a smaller head is a reason at
    selection (an EAGLE head of 8 failed in its first compiled step on the H200), not on the
    CPU, where flex runs eagerly."""
    from pagedserve.attention.backend import AttentionLayerConfig

    flex = get_backend_cls("FLEX_ATTENTION")
    for sizes, refused in (((8, None), True), ((16, 8), True), ((16, None), False)):
        layer = AttentionLayerConfig(2, 2, sizes[0], torch.float32, head_size_v=sizes[1])
        reasons = flex.validate_configuration(layer, 16, torch.device("cuda"))
        assert any("under 16" in r for r in reasons) == refused, (sizes, reasons)
        assert flex.validate_configuration(layer, 16, torch.device("cpu")) == []
