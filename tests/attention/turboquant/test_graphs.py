"""TURBOQUANT's CUDA-graph path and its prefill split.

CPU (Triton kernels under the interpreter): a decode step padded to a captured size, with the
metadata `build_for_cudagraph` makes, gives the float32 reference on its real rows (and the
eager step's output), with split counts fixed per size whatever the step's lengths; prefill
steps (first chunks, chunks continuing a context, mixed with decodes) run the new tokens
through the dense kernel and merge the quantized context, against the float32 reference that
dequantizes the context the same way.

GPU (`gpu` mark, the lead runs them): a captured graph replayed on other lengths equals the
eager step for each preset and decode kernel, and the float32 attention over the cache it
read; prefill steps at the 8B shape against the same reference. On the GPU the store kernel's
codes are held to the torch format's within boundary rounding (a coordinate on a decision
boundary may fall either way), so the attention references decode the cache as written, not
a re-encoding. The engine's greedy tokens with graphs equal those without, and graphs were
replayed.
"""

from __future__ import annotations

import gc
import os
from typing import NamedTuple

import numpy as np
import pytest
import torch

from pagedserve.attention import AttentionLayerConfig, BuilderConfig
from pagedserve.attention.backends.turboquant import TurboQuantBackend
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.attention.ops import turboquant_format as tqf
from tests.attention.turboquant.harness import (
    PRESETS,
    _check_new_slots,
    assert_only_slots_written,
    cache_references,
    references,
    run_turboquant_case,
)
from tests.utils.conformance import BATCHES
from tests.utils.params import diagonal, only_in_ci

kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Decodes of different contexts, one at 0 (a first token) and ones across page boundaries.
DECODES = [(15, 1), (40, 1), (0, 1), (33, 1), (70, 1)]


@kernels
@pytest.mark.parametrize("preset", only_in_ci(PRESETS, {"tq_k8v4", "tq_4bit", "tq_3bit"}))
def test_padded_graph_decode_matches_reference(preset):
    """5 decodes padded to 8 (padding rows: random query/key/value, slot -1, context 0) with
    the graph metadata: the real rows equal the float32 reference and the eager step; the new
    tokens' slots hold their encodings and nothing else was written."""
    args = dict(head_size=32, seed=3, device=DEVICE)
    out, cache, reqs, new_slots, key, value = run_turboquant_case(
        preset, DECODES, use_kernels=True, graph_size=8, graph_max_seq_len=4096, **args)
    eager, eager_cache, *_ = run_turboquant_case(preset, DECODES, use_kernels=True, **args)
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    _check_new_slots(preset, cache, new_slots, key, value)
    assert torch.equal(cache, eager_cache)  # the padding rows wrote nothing


@kernels
@pytest.mark.parametrize("preset", only_in_ci(["tq_3bit", "tq_4bit", "tq_k8v4", "naive_int4"],
                                              {"tq_3bit", "tq_4bit", "tq_k8v4"}))
def test_padded_graph_split_decode_matches_reference(preset):
    """With the SMs of a GPU the split heuristic splits the padded batch for the engine's
    longest sequence (4,096), not for these short contexts: most splits are empty, and the
    merged result still equals the reference."""
    out, _, reqs, *_ = run_turboquant_case(
        preset, DECODES, use_kernels=True, head_size=32, seed=4, device=DEVICE, graph_size=8,
        graph_max_seq_len=4096, num_sms=64)
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)


MAX_BLOCKS = 400  # contexts up to 6,400 tokens at block size 16


def _builder(preset: str, max_reqs: int = 16, num_sms: int = 132):
    config = BuilderConfig(8, 2, 32, torch.float32, 16, max_reqs, 256, MAX_BLOCKS,
                           torch.device("cpu"), kv_cache_dtype=preset)
    builder = TurboQuantBackend.for_kv_cache_dtype(preset).get_builder_cls()(config)
    builder.use_kernels = True
    builder.num_sms = num_sms
    common_builder = CommonMetadataBuilder(max_reqs, 256, MAX_BLOCKS, 16, torch.device("cpu"))
    return builder, common_builder


def _decode_step(common_builder, contexts: list[int]):
    b = len(contexts)
    table = np.arange(b * MAX_BLOCKS, dtype=np.int32).reshape(b, MAX_BLOCKS)
    return common_builder.build(np.arange(b), np.array(contexts, np.int32),
                                np.ones(b, np.int32), 0, table)


def test_graph_launch_bounds_fixed_per_size():
    """The graph metadata of one padded size is the same launch whatever the step's lengths:
    the split count comes from the padded batch and the engine's bound, the maps and partial
    buffers from fixed addresses; eager steps still choose their split by the step."""
    builder, cb = _builder("tq_4bit")
    builder.prepare_for_cudagraphs(8192)
    plans = []
    for contexts in ([5, 9], [3000, 17, 6000]):
        common = _decode_step(cb, contexts)
        padded = cb.pad_decode(common, 4)
        plans.append(builder.build_for_cudagraph(common, 4, padded).kernel)
    first, second = plans
    assert first.num_splits == second.num_splits > 1
    assert (first.num_qblocks, first.block_q, first.tiles) == (4, 1, second.tiles)
    assert first.qblock_req.data_ptr() == second.qblock_req.data_ptr()
    assert [t.data_ptr() for t in first.partials] == [t.data_ptr() for t in second.partials]
    # A larger padded batch fills more SMs: fewer splits (or none).
    common = _decode_step(cb, [5, 9])
    big = builder.build_for_cudagraph(common, 16, cb.pad_decode(common, 16)).kernel
    assert big.num_splits <= first.num_splits
    # Eagerly, a short step does not split.
    assert builder.build(_decode_step(cb, [5, 9])).kernel.num_splits == 1


def test_prefill_plan_splits_dense_context_and_decodes():
    """A first chunk needs no context launch; a chunk after earlier pages gets context blocks
    for its own queries only; a mixed step's decodes get a decode launch of their own."""
    builder, cb = _builder("tq_3bit", num_sms=0)

    def step(batch):
        b = len(batch)
        table = np.arange(b * MAX_BLOCKS, dtype=np.int32).reshape(b, MAX_BLOCKS)
        p = sum(1 for _, q in batch if q > 1)
        return cb.build(np.arange(b), np.array([c for c, _ in batch], np.int32),
                        np.array([q for _, q in batch], np.int32), p, table)

    first = builder.build(step([(0, 20), (0, 7)])).prefill
    assert first.context is None and first.decodes is None
    assert first.new_lens.tolist() == [20, 7]
    assert first.dense_qblocks == sum(-(-q // first.dense_block_q) for q in (20, 7))
    chunked = builder.build(step([(0, 20), (48, 9), (3, 1)])).prefill
    ctx = chunked.context
    assert ctx is not None
    assert set(ctx.qblock_req[:ctx.num_qblocks].tolist()) == {1}  # only the continued prefill
    assert ctx.num_qblocks == -(-9 // ctx.block_q)
    assert chunked.decodes.num_qblocks == 1
    assert chunked.decodes.qblock_req[:1].tolist() == [2]
    assert chunked.decodes.num_splits == 1


@kernels
@pytest.mark.parametrize("preset,batch", diagonal(  # the merge needs contexts: not "prefill"
    [("tq_3bit",), ("tq_4bit",), ("naive_int3",), ("tq_k8v4",)],  # for the TurboQuant presets
    ["chunked_prefill", "mixed", "prefill"]))
def test_prefill_split_matches_reference(preset, batch):
    """New tokens at full precision through the dense kernel, earlier pages through the
    TurboQuant kernel, merged by log-sum-exp: the float32 reference that dequantizes the
    context the same way; far from attention over the quantized new tokens would be."""
    out, cache, reqs, new_slots, key, value = run_turboquant_case(
        preset, BATCHES[batch], use_kernels=True, head_size=32, seed=7, device=DEVICE)
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)
    _check_new_slots(preset, cache, new_slots, key, value)
    assert_only_slots_written(preset, torch.zeros_like(cache), cache,
                              torch.cat([r.slots for r in reqs]), 32)


@kernels
@pytest.mark.parametrize("window,soft_cap", [(8, None), (None, 5.0), (5, 3.0)])
def test_prefill_split_window_and_soft_cap(window, soft_cap):
    """The merge with a sliding window (contexts partly or wholly outside it) and soft-capped
    scores (both softmaxes in the same capped, base-2 units)."""
    batch = [(16, 16), (40, 9), (7, 2), (31, 1)]
    out, _, reqs, *_ = run_turboquant_case(
        "tq_4bit", batch, use_kernels=True, head_size=32, seed=8, window=window,
        soft_cap=soft_cap, device=DEVICE)
    dequant, _ = references("tq_4bit", reqs, window, soft_cap)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available() or not os.environ.get("TRITON_INTERPRET"),
                    reason="the interpreter's run (GPU: test_engine_graphs_match_eager_gpu)")
@pytest.mark.slow  # about a minute in the interpreter
def test_engine_padded_graph_steps_match_eager():
    """The engine on the kernels (interpreter): chunked prefills (24-token steps: a chunk
    continuing its context beside a first chunk and a decode), then decode steps through the
    graph path (`DecodeGraphs(capture=False)`: padded metadata from `build_for_cudagraph`,
    split for a 4,096-token bound), give the eager engine's greedy tokens."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.bench import random_prompts
    from pagedserve.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes

    llm = LLM(model="random:tiny", attention_backend="TURBOQUANT", kv_cache_dtype="tq_4bit",
              max_num_seqs=8, num_gpu_blocks_override=8, enable_prefix_caching=False,
              device="cpu", dtype="float32", kv_cache_memory="16MiB",
              max_num_batched_tokens=24)
    runner = llm.engine.runner
    for builder in runner.builders.values():
        builder.use_kernels = True  # the CUDA path's kernels, under the interpreter
        builder.num_sms = 64
    prompts = [random_prompts(1, n, 512, seed=n)[0] for n in (5, 21, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def greedy() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    runner.step_log = []
    eager = greedy()
    assert any(prefills and len(n) > prefills for _, n, prefills, _ in runner.step_log), \
        "no mixed step: the decode launch of a prefill step went untested"
    graphs = DecodeGraphs(runner.graph_inputs(), graph_batch_sizes(8, runner.max_num_tokens),
                          capture=False)
    for builder in runner.builders.values():
        builder.prepare_for_cudagraphs(4096)
    runner.decode_graphs = graphs
    assert greedy() == eager
    assert graphs.replays[4] > 0  # 3 decodes ran padded to 4


@kernels
def test_prefill_benchmark_runs():
    """benchmarks/tq_prefill.py: a TRITON row and one per preset and context-launch shape, the
    TURBOQUANT output within the quantization's error of TRITON's."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[3] / "benchmarks" / "tq_prefill.py"
    spec = importlib.util.spec_from_file_location("tq_prefill", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.prefill_benchmark(num_seqs=2, context=20, chunk=12, num_heads=4,
                                   num_kv_heads=2, head_size=32, presets=("tq_4bit",),
                                   prefill_tiles=["16/32/1/1", "16/32/1/1/select"],
                                   device=DEVICE, dtype=torch.float32, warmup=0, iters=1)
    assert [r["tiles"] for r in rows] == ["", "16/32/1/1", "16/32/1/1/select"]
    assert all(0.0 < r["rel_err"] < 0.3 for r in rows[1:])
    assert rows[1]["rel_err"] == pytest.approx(rows[2]["rel_err"], rel=1e-4)


@pytest.mark.parametrize("preset", ["tq_3bit", "tq_k8v4", "naive_int4"])
def test_gpu_checks_see_real_errors(preset):
    """The checks the GPU tests rely on, on the torch path: the reference that decodes the
    cache equals the re-encoding one where the cache holds the same codes and follows the
    cache where it does not; the near-code check passes one-level flips and a meta ulp but not
    a record in the wrong slot, two levels off or too many flips; a stray write is seen."""
    from tests.attention.turboquant.harness import MAX_FLIP_FRACTION, assert_records_close

    p, d = tqf.PRESETS[preset], 32
    out, cache, reqs, new_slots, key, value = run_turboquant_case(
        preset, BATCHES["mixed"], head_size=d, seed=13)
    dequant, _ = references(preset, reqs)
    torch.testing.assert_close(cache_references(preset, cache, reqs), dequant, rtol=0, atol=0)
    torch.testing.assert_close(out, cache_references(preset, cache, reqs), rtol=1e-4,
                               atol=1e-4)
    # A context code moved one level: the cache's reference moves with it.
    r = next(r for r in reqs if r.context > 0)
    bs, slot = cache.shape[2], int(r.slots[0])
    moved = cache.clone()
    k_codes = tqf.cache_planes(p, moved, d)[0]
    k_codes[slot // bs, :, slot % bs, 0] ^= 1
    assert not torch.equal(cache_references(preset, moved, reqs), dequant)

    records = tqf.slot_records(p, cache, d)[new_slots // bs, :, new_slots % bs]
    expected = tqf.encode_kv(p, key.float(), value.float())
    assert_records_close(p, records, expected, d)

    def recorded(codes_k: torch.Tensor) -> torch.Tensor:
        """`records` with its K codes replaced."""
        n = p.key.code_bytes(d)
        return torch.cat([tqf.pack_codes(codes_k, p.key.bits), records[..., n:]], -1)

    codes = tqf.unpack_codes(records[..., :p.key.code_bytes(d)], p.key.bits, d)
    one_off = codes.clone().flatten()
    up = one_off[0] < (1 << p.key.bits) - 1
    one_off[0] += 1 if up else -1
    assert_records_close(p, recorded(one_off.view_as(codes)), expected, d)
    two_off = codes.clone().flatten()
    two_off[0] += 2 if up else -2
    with pytest.raises(AssertionError):
        assert_records_close(p, recorded(two_off.view_as(codes)), expected, d)
    many = codes.clone().flatten()
    n = int(many.numel() * MAX_FLIP_FRACTION) + 2
    many[:n] = torch.where(many[:n] < (1 << p.key.bits) - 1, many[:n] + 1, many[:n] - 1)
    with pytest.raises(AssertionError):
        assert_records_close(p, recorded(many.view_as(codes)), expected, d)
    with pytest.raises(AssertionError):  # the records of the slots one row on
        assert_records_close(p, records.roll(1, 0), expected, d)

    written = torch.cat([r.slots for r in reqs])
    assert_only_slots_written(preset, torch.zeros_like(cache), cache, written, d)
    with pytest.raises(AssertionError):  # a slot of the step left out: its write is stray
        assert_only_slots_written(preset, torch.zeros_like(cache), cache, written[1:], d)


# ---- GPU ----------------------------------------------------------------------------------

class GraphStep(NamedTuple):
    graphed: torch.Tensor  # the replay's output of the real rows, float32
    eager: torch.Tensor  # the eager step's, from the cache as it was before the replay
    reqs: list  # per request (query, K, V, context, slots), float32 as drawn
    cache_before: torch.Tensor  # the cache before the step (the contexts written on the CPU)
    graph_cache: torch.Tensor  # after the replay
    eager_cache: torch.Tensor  # after the eager step


def _graph_step(preset: str, decode_kernel: str, contexts: list[int], size: int,
                seed: int) -> GraphStep:
    """A decode step over `contexts` (bf16, 32:8 heads, d128) through a graph captured at
    `size` on a dummy step (every context 0), replayed after the real step's metadata was
    written into its buffers, and eagerly from the same cache. The contexts are encoded on the
    CPU from the float32 draws, so only the cache says what the kernels read."""
    gen = torch.Generator().manual_seed(seed)
    backend = TurboQuantBackend.for_kv_cache_dtype(preset)
    p = tqf.PRESETS[preset]
    h, hkv, d, bs, dev = 32, 8, 128, 16, torch.device("cuda")
    max_blocks = max(contexts) // bs + 2
    num_blocks = size * max_blocks + 1
    cache = torch.zeros(backend.get_kv_cache_shape(num_blocks, bs, hkv, d), dtype=torch.uint8)
    table = np.full((size, max_blocks), -1, np.int32)
    reqs = []
    for row, c in enumerate(contexts):
        ids = list(range(1 + row * max_blocks, 1 + (row + 1) * max_blocks))
        table[row] = ids
        k = torch.randn(c + 1, hkv, d, generator=gen)
        v = torch.randn(c + 1, hkv, d, generator=gen)
        q = torch.randn(1, h, d, generator=gen)
        slots = torch.tensor([ids[t // bs] * bs + t % bs for t in range(c + 1)],
                             dtype=torch.int64)
        tqf.store_kv(p, cache, k[:c], v[:c], slots[:c])
        reqs.append((q, k, v, c, slots))
    cache = cache.to(dev)
    cb = CommonMetadataBuilder(size, size, max_blocks, bs, dev)
    config = BuilderConfig(h, hkv, d, torch.bfloat16, bs, size, size, max_blocks, dev,
                           kv_cache_dtype=preset)
    builder = backend.get_builder_cls()(config)
    builder.decode_kernel = decode_kernel
    impl = backend.get_impl_cls()(AttentionLayerConfig(h, hkv, d, torch.bfloat16, None, None,
                                                       preset))
    builder.prepare_for_cudagraphs(4096)
    q_buf = torch.zeros(size, h, d, dtype=torch.bfloat16, device=dev)
    k_buf = torch.zeros(size, hkv, d, dtype=torch.bfloat16, device=dev)
    v_buf = torch.zeros_like(k_buf)
    out_buf = torch.zeros_like(q_buf)

    def step(ctx: list[int], rows: np.ndarray):
        common = cb.build(np.arange(len(ctx)), np.array(ctx, np.int32),
                          np.ones(len(ctx), np.int32), 0, rows)
        return common, builder.build_for_cudagraph(common, size, cb.pad_decode(common, size))

    # The dummy step writes its (zero) tokens into block 0, which no request holds.
    _, md = step([0] * size, np.zeros((size, max_blocks), np.int32))
    for _ in range(2):  # compile outside the capture
        impl.forward(q_buf, k_buf, v_buf, cache, md, output=out_buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(q_buf, k_buf, v_buf, cache, md, output=out_buf)
    common, _ = step(contexts, table[:len(contexts)])
    b = len(contexts)
    q_buf[:b] = torch.cat([r[0] for r in reqs]).to(dev, torch.bfloat16)
    k_buf[:b] = torch.stack([r[1][r[3]] for r in reqs]).to(dev, torch.bfloat16)
    v_buf[:b] = torch.stack([r[2][r[3]] for r in reqs]).to(dev, torch.bfloat16)
    cache_before = cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    graphed = out_buf[:b].float().cpu()
    graph_cache = cache.cpu()
    cache.copy_(cache_before)
    eager = impl.forward(q_buf[:b], k_buf[:b], v_buf[:b], cache, builder.build(common)).float()
    return GraphStep(graphed, eager.cpu(), reqs, cache_before.cpu(), graph_cache, cache.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("decode_kernel", ["triton", "auto"])
@pytest.mark.parametrize("preset", ["tq_k8v4", "tq_4bit", "tq_3bit", "naive_int4"])
@pytest.mark.parametrize("size,contexts", [(4, [700, 3000, 65]), (32, [1200] * 20 + [5, 17])])
def test_graph_replay_matches_eager_gpu(preset, decode_kernel, size, contexts):
    """A graph captured on a dummy step and replayed on a real one (other lengths, padding
    rows) equals the eager step, and the float32 reference within bf16 rounding; it wrote the
    new tokens' slots as the eager step did, near the torch format's codes, and nothing
    else (the padding rows' slots are -1)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    step = _graph_step(preset, decode_kernel, contexts, size, seed=size)
    torch.testing.assert_close(step.graphed, step.eager, rtol=2e-2, atol=2e-2)
    # Reference: the bf16-rounded query and new token in float32, over the context the cache
    # holds (encoded from the float32 draws: re-encoding their bf16 rounding would move codes
    # across decision boundaries the kernel never saw).
    rounded = [(q.bfloat16(), k.bfloat16(), v.bfloat16(), c, slots)
               for q, k, v, c, slots in step.reqs]
    dequant = cache_references(preset, step.graph_cache, rounded)
    torch.testing.assert_close(step.graphed, dequant, rtol=3e-2, atol=3e-2)
    new_slots = torch.stack([slots[c] for _, _, _, c, slots in step.reqs])
    assert_only_slots_written(preset, step.cache_before, step.graph_cache, new_slots, 128)
    assert torch.equal(step.graph_cache, step.eager_cache)
    new_k = torch.stack([k[c] for _, k, _, c, _ in rounded])
    new_v = torch.stack([v[c] for _, _, v, c, _ in rounded])
    _check_new_slots(preset, step.graph_cache, new_slots, new_k, new_v, exact=False)


@pytest.mark.gpu
@pytest.mark.parametrize("decode_kernel", ["triton", "auto"])
@pytest.mark.parametrize("preset", ["tq_k8v4", "tq_4bit", "tq_3bit", "naive_int4"])
def test_prefill_split_matches_reference_gpu(preset, decode_kernel):
    """The 8B shape (32:8 heads, d128, bf16): a first chunk, chunks continuing long contexts
    (the merge) and decodes of the same step (their own decode launch, the CUDA kernel under
    'auto'), against the float32 reference over the same bf16 inputs and the context the cache
    holds; the store kernel wrote the new tokens' slots (within boundary rounding of the torch
    format's codes) and nothing else."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    batch = [(0, 300), (700, 257), (129, 64), (2048, 33), (900, 1), (40, 1), (0, 1)]
    out, cache, reqs, new_slots, key, value = run_turboquant_case(
        preset, batch, num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
        use_kernels=True, device="cuda", decode_kernel=decode_kernel)
    out = out.float()
    dequant = cache_references(preset, cache, reqs)
    torch.testing.assert_close(out, dequant, rtol=2e-2, atol=2e-2)
    # The tolerance sees the merge: with the earlier pages weighted zero, the rows of the
    # requests that have them would be far off.
    alone = cache_references(preset, cache, [(q, k[c:], v[c:], 0, s[c:])
                                             for q, k, v, c, s in reqs])
    has_context = torch.cat([torch.full((len(r.query),), r.context > 0) for r in reqs])
    assert (out - alone)[has_context].abs().amax() > 0.2
    _check_new_slots(preset, cache, new_slots, key, value, exact=False)
    assert_only_slots_written(preset, torch.zeros_like(cache), cache,
                              torch.cat([r.slots for r in reqs]), 128)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tq_k8v4", "tq_4bit", "tq_3bit"])
def test_engine_graphs_match_eager_gpu(preset):
    """The engine captures TURBOQUANT decode graphs (start-up checks replay against eager),
    replays them, and its greedy tokens match the eager engine's (a split count that differs
    between the graph and the eager step may round a near-tie differently: the check allows
    a late divergence only)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pagedserve import LLM, SamplingParams
    from pagedserve.bench import random_prompts

    runs = {}
    for eager in (True, False):
        llm = LLM(model="random:tiny", dtype="bfloat16", device="cuda",
                  attention_backend="TURBOQUANT", kv_cache_dtype=preset, max_num_seqs=8,
                  num_gpu_blocks_override=64, enforce_eager=eager)
        graphs = llm.engine.runner.decode_graphs
        prompts = [random_prompts(1, n, 512, seed=n)[0] for n in (7, 30, 19)]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        runs[eager] = ([list(o.outputs[0].token_ids) for o in outs],
                       dict(graphs.replays) if graphs is not None else {},
                       graphs is not None and bool(graphs.graphs))
        del llm, graphs, outs
        gc.collect()
        torch.cuda.empty_cache()
    (eager_tokens, _, eager_captured), (tokens, replays, captured) = runs[True], runs[False]
    assert not eager_captured
    assert captured, "graph capture failed (see the warning in the log); the engine fell back"
    assert replays.get(4, 0) > 0, f"3 decodes should replay the size-4 graph: {replays}"
    for g, e in zip(tokens, eager_tokens, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), None)
        assert first is None or first >= 8, f"graphed tokens diverge at {first}: {g} vs {e}"
