"""Models mixing sliding-window and full attention layers (Gemma 2, Gemma 3's 5 local : 1
global, gpt-oss) through KV cache groups, against transformers on the same weights (float32,
CPU, greedy, eager reference): prompts several windows long, with chunked prefill, forced
preemption and prefix-cache hits; the sliding groups hold about a window of blocks while the
full group holds the whole sequence."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import SamplingParams
from pagedserve.kv_cache.single_type import OUT_OF_WINDOW
from tests.utils.paged import hf_greedy

WINDOW, BLOCK, NUM_NEW = 32, 8, 12
PROMPT_LENS = [230, 75, 140]
COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              initializer_range=0.15, sliding_window=WINDOW)
GEMMA = dict(query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh")


def _configs() -> dict[str, transformers.PretrainedConfig]:
    return {
        "gemma2": transformers.Gemma2Config(
            **COMMON, **GEMMA, num_hidden_layers=3, attn_logit_softcapping=30.0,
            final_logit_softcapping=20.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        # 5 local to 1 global: one group per local layer and one for the global one.
        "gemma3": transformers.Gemma3TextConfig(
            **COMMON, **GEMMA, num_hidden_layers=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"], rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
        "gpt_oss": transformers.GptOssConfig(
            **COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"]),
    }


NUM_GROUPS = {"gemma2": 3, "gemma3": 6, "gpt_oss": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}
    for i, (name, config) in enumerate(_configs().items()):
        torch.manual_seed(i)
        hf = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.float32)
        with torch.no_grad():
            for pname, p in hf.named_parameters():
                if "norm" in pname:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif "bias" in pname or "sinks" in pname:
                    p.copy_(0.5 * torch.randn_like(p))
        path = tmp_path_factory.mktemp(name)
        hf.eval().save_pretrained(path)
        g = torch.Generator().manual_seed(50 + i)
        prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
                   for n in PROMPT_LENS]
        built[name] = (str(path), prompts, [hf_greedy(hf, p, NUM_NEW) for p in prompts])
    return built


VARIANTS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 24},
    # Step N+1 scheduled before N's samples are back: a block's last token is known a step
    # late, so a sliding group frees a block only once it is published.
    "async_chunked": {"max_num_batched_tokens": 24, "async_scheduling": True},
    # Just the room the longest request needs alone (its full group's blocks and each sliding
    # group's window and chunk): the next one admitted beside it runs out mid-prefill.
    "preemption": {"max_num_batched_tokens": 16},
}
PREEMPTION_BLOCKS = {"gemma2": 47, "gemma3": 71}


def _llm(make_llm, path: str, **kwargs):
    return make_llm(model=path, dtype="float32", device="cpu", kv_cache_memory="16MiB",
                    block_size=BLOCK, **kwargs)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(_configs()))
def test_greedy_matches_transformers(models, make_llm, name, variant):
    if name == "gpt_oss" and variant != "default":
        pytest.skip("gpt-oss's chunking and preemption run in tests/models/test_families.py")
    path, prompts, expected = models[name]
    extra = {"num_gpu_blocks_override": PREEMPTION_BLOCKS[name]} if variant == "preemption" else {}
    llm = _llm(make_llm, path, **VARIANTS[variant], **extra)
    assert llm.engine.kv_cache.num_groups == NUM_GROUPS[name]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(("name", "async_scheduling"),
                         [("gemma2", False), ("gemma3", False), ("gemma3", True)])
def test_prefix_cache_hits_with_groups(models, make_llm, name, async_scheduling):
    """The same prompts again hit the cache in every group (the sliding groups the blocks of
    the window before the hit): the second run computes only the last block, and its tokens
    are still transformers'."""
    path, prompts, expected = models[name]
    llm = _llm(make_llm, path, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for round_ in range(2):
        before = llm.engine.stats().prefix_cache_hits
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, f"round {round_}"
    hits = llm.engine.stats().prefix_cache_hits - before
    assert hits == sum((n - 1) // BLOCK * BLOCK for n in PROMPT_LENS)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_sliding_groups_hold_about_a_window(models, make_llm, name):
    """One long request, chunked: each sliding group's peak is the window before a chunk and
    the chunk's blocks, not the whole prompt; the full group holds every block."""
    path, prompts, expected = models[name]
    chunk = 24
    llm = _llm(make_llm, path, max_num_batched_tokens=chunk)
    engine = llm.engine
    kv = engine.kv_cache
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    engine.add_request("long", prompts[0], params)
    peaks = [0] * kv.num_groups
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        for g, manager in enumerate(kv.groups):
            held = manager.req_to_blocks.get("long", ())
            peaks[g] = max(peaks[g], sum(1 for b in held if b is not OUT_OF_WINDOW))
    assert tokens == expected[0]
    # The full group: every block of the prompt and of the tokens after it (the last step's
    # block may be freed with the request before it is looked at).
    prompt_blocks = -(-PROMPT_LENS[0] // BLOCK)
    total = -(-(PROMPT_LENS[0] + NUM_NEW - 1) // BLOCK)
    for manager, peak in zip(kv.groups, peaks, strict=True):
        if manager.sliding_window is None:
            assert prompt_blocks < peak <= total
        else:
            assert peak <= -(-(WINDOW - 1 + chunk) // BLOCK) + 2 < total // 2


def test_padded_decode_steps_with_groups(models, make_llm):
    """Decode steps padded to a captured size the way CUDA graphs run them (here eagerly:
    `DecodeGraphs(capture=False)`): every group's block table and slot mapping padded in its
    own persistent buffers; tokens still transformers'."""
    from pagedserve.engine.cuda_graphs import DecodeGraphs

    path, prompts, expected = models["gemma3"]
    llm = _llm(make_llm, path, max_num_batched_tokens=64, max_num_seqs=8)
    runner = llm.engine.runner
    assert runner.decode_graphs is None  # never on the CPU
    graphs = DecodeGraphs(runner.graph_inputs(), [4, 8], capture=False)
    runner.decode_graphs = graphs
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert graphs.replays[4] > 0  # the 3 requests' decodes, padded to 4


def test_padded_verify_step_with_groups(models, make_llm):
    """A verify step (3 requests of 1+K tokens over contexts of 5, 37 and 18) padded to 4
    requests as its CUDA graph runs it (capture off): every group's tables padded onto the
    first's, the real rows equal to the unpadded eager step's."""
    from pagedserve.engine.cuda_graphs import DecodeGraphs

    path, _, _ = models["gemma3"]
    q = 3
    llm = _llm(make_llm, path, max_num_batched_tokens=64, max_num_seqs=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": q - 1})
    runner = llm.engine.runner
    inputs = runner.graph_inputs()
    verify = DecodeGraphs(inputs, [4, 8], capture=False, query_len=q)
    graphs = DecodeGraphs(inputs, [4, 8], capture=False, verify=verify)
    commons = verify.dummy_decode(3, [5, 37, 18])
    assert len(commons) == NUM_GROUPS["gemma3"]
    ids = torch.randint(0, runner.vocab_size, (3 * q,), generator=torch.Generator().manual_seed(0))
    runner.input_ids.device[:3 * q].copy_(ids)
    eager_md = inputs.group_metadata(commons, lambda builder, common: builder.build(common))
    with torch.inference_mode():
        eager = runner.run_model(eager_md, 3 * q).clone()
        padded = graphs.run(commons).clone()
    assert verify.replays == {4: 1}
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)


def _plain_layout(monkeypatch) -> None:
    """Engines built from here on keep every layer in one group (no block freed early): the
    layout before cache groups, as a reference."""
    from pagedserve.engine import model_runner
    from pagedserve.kv_cache.groups import plain_layout

    monkeypatch.setattr(model_runner, "plan_kv_cache_groups", plain_layout)


def test_plain_layout_reference_is_one_group(models, make_llm, monkeypatch):
    path, prompts, expected = models["gemma2"]
    _plain_layout(monkeypatch)
    llm = _llm(make_llm, path, max_num_batched_tokens=24)
    assert llm.engine.kv_cache.num_groups == 1 and llm.engine.kv_cache.sliding_window is None
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TRITON", "FLASHINFER", "FLASH_ATTN"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_groups_on_cuda(tmp_path, monkeypatch, name, backend):
    """KV cache groups on CUDA: each group's block table and slot mapping in persistent
    buffers that decode graphs replay over, async scheduling, prefix hits on the second run
    (the sliding groups' window blocks). TRITON in float32 against transformers' tokens; the
    bfloat16-only backends against the same backend with every layer in one group (the
    layout before groups: the same kernels over the same sequences, so the same tokens)."""
    import gc

    from pagedserve import LLM
    from pagedserve.attention.registry import BackendSelectionError, get_backend_cls

    ok, why = get_backend_cls(backend).is_available()
    if not ok:
        pytest.skip(f"{backend}: {why}")
    config = _configs()[name]
    config.head_dim = 64
    torch.manual_seed(7)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                       dtype=torch.float32)
    hf.eval().save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
               for n in PROMPT_LENS]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    dtype = "float32" if backend == "TRITON" else "bfloat16"

    def run(plain: bool):
        if plain:
            _plain_layout(monkeypatch)
        try:
            llm = LLM(model=str(tmp_path), dtype=dtype, device="cuda",
                      attention_backend=backend, gpu_memory_utilization=0.2,
                      max_num_batched_tokens=64, block_size=16)
        except BackendSelectionError as exc:  # e.g. soft-cap on FLASH_ATTN's torch kernels
            pytest.skip(str(exc).splitlines()[0])
        try:
            assert llm.engine.kv_cache.num_groups == (1 if plain else NUM_GROUPS[name])
            runs = []
            for _ in range(2):
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                       use_tqdm=False)
                runs.append([o.outputs[0].token_ids for o in outputs])
            hits = llm.engine.stats().prefix_cache_hits
            graphs = llm.engine.runner.decode_graphs
            # No reference to the engine may outlive it: its cache (a fifth of the GPU) would
            # count in the next engine's profiled peak.
            replays = 0 if graphs is None else sum(graphs.replays.values())
            del graphs
            assert llm.engine.check_blocks_free()
        finally:
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        assert hits > 0
        assert replays > 0
        return runs

    grouped = run(plain=False)
    if backend == "TRITON":
        expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
        assert grouped == [expected, expected]
    else:  # run for run: the second hits the cache in both layouts alike
        assert grouped == run(plain=True)


def test_group_metadata_equals_a_full_build_over_its_table():
    """A further group's metadata (`build_group`): the shared per-step arrays of the first
    group's, its own block table, slot mapping and page table, as a full build over its table
    would give them, in its own buffers."""
    import numpy as np

    from pagedserve.attention.metadata import TABLE_BUFFERS, CommonMetadataBuilder

    rng = np.random.default_rng(0)
    tables = [rng.permutation(64).astype(np.int32).reshape(4, 16) for _ in range(2)]
    rows = np.array([2, 0, 3])
    computed = np.array([20, 33, 7], dtype=np.int32)
    scheduled = np.array([9, 1, 1], dtype=np.int32)

    def builder():
        return CommonMetadataBuilder(4, 32, 16, BLOCK, torch.device("cpu"))

    first, second, reference = builder(), builder(), builder()
    common = first.build(rows, computed, scheduled, 1, tables[0])
    grouped = second.build_group(common, rows, tables[1])
    full = reference.build(rows, computed, scheduled, 1, tables[1])
    for name in TABLE_BUFFERS:
        assert torch.equal(getattr(grouped, name), getattr(full, name)), name
        assert getattr(grouped, name).data_ptr() == second.dev[name].data_ptr()
    assert not torch.equal(grouped.slot_mapping, common.slot_mapping)
    for name in ("query_start_loc", "seq_lens", "positions", "context_lens"):
        assert getattr(grouped, name) is getattr(common, name)
    assert np.array_equal(grouped.paged_kv_indptr_cpu, full.paged_kv_indptr_cpu)


def test_start_up_log_names_the_groups(models, make_llm, caplog):
    path, _, _ = models["gemma3"]
    with caplog.at_level("INFO", logger="pagedserve"):
        llm = _llm(make_llm, path)
    assert "KV cache groups share" in caplog.text
    assert "group 5: full, layers [5]" in caplog.text
    assert "group 0: sliding window 32, layers [0]" in caplog.text
    # Bytes per token count every group: six layers' K and V of 2 heads of 16 floats.
    assert llm.engine.kv_cache_bytes_per_token() == 6 * 2 * 2 * 16 * 4
