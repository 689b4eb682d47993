"""TURBOQUANT's backend (builder + impl on the torch path) against float32 references on random
paged data, and the engine with every preset: on the CPU against the unquantized cache, and (the
`gpu` test) serving the bundled model on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.attention.ops import turboquant_format as tqf
from tests.attention.turboquant.harness import (
    CUDA,
    PRESETS,
    _check_new_slots,
    _relative_mse,
    references,
    run_turboquant_case,
)
from tests.utils.conformance import BATCHES
from tests.utils.paged import bundled_gguf

# ---- the backend on random paged data ---------------------------------------------------------

# Relative error of the output against attention over the exact K/V: a few times the preset's
# K/V round-trip error (these random keys are near-Gaussian; 3-bit and naive ones lose most).
EXACT_TOLERANCE = {"tq_k8v4": 0.12, "tq_4bit": 0.2, "tq_3bit": 0.35, "naive_int4": 0.3,
                   "naive_int3": 0.6}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_backend_matches_references(preset, batch):
    out, cache, reqs, new_slots, key, value = run_turboquant_case(preset, BATCHES[batch])
    dequant, exact = references(preset, reqs)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)
    assert _relative_mse(out, exact) ** 0.5 < EXACT_TOLERANCE[preset]
    _check_new_slots(preset, cache, new_slots, key, value)


@pytest.mark.parametrize("window,soft_cap,block_size,num_heads", [
    (8, None, 16, 8), (None, 5.0, 32, 4), (None, None, 1, 2), (5, 3.0, 16, 6)])
def test_backend_window_soft_cap_block_sizes(window, soft_cap, block_size, num_heads):
    preset = "tq_4bit"
    out, *_ = run_turboquant_case(preset, BATCHES["mixed"], block_size, num_heads,
                                  window=window, soft_cap=soft_cap, seed=3)
    reqs = run_turboquant_case(preset, BATCHES["mixed"], block_size, num_heads, window=window,
                               soft_cap=soft_cap, seed=3)[2]
    dequant, _ = references(preset, reqs, window, soft_cap)
    torch.testing.assert_close(out, dequant, rtol=1e-4, atol=1e-4)


def test_backend_half_precision():
    out, _, reqs, *_ = run_turboquant_case("tq_k8v4", BATCHES["mixed"], dtype=torch.bfloat16)
    dequant, _ = references("tq_k8v4", reqs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dequant, rtol=2e-2, atol=2e-2)


# ---- the engine -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=211, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    path = tmp_path_factory.mktemp("tiny_llama_tq")
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 211, (n,), generator=gen).tolist() for n in (5, 40, 12)]
    return str(path), prompts


def _mean_kl(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    return float(np.mean([(r.exp() * (r - g)).sum(-1).mean() for r, g in zip(ref, got,
                                                                            strict=True)]))


def test_engine_generates_with_every_preset(make_llm, tiny_llama):
    from pagedserve import SamplingParams

    path, prompts = tiny_llama
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(model=path, dtype="float32", device="cpu", kv_cache_memory="2MiB",
                  max_num_batched_tokens=32)  # chunked prefill: quantized context mid-prompt
    base = make_llm(attention_backend="CPU", **common)
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    reference = base.score(prompts, expected)
    kl = {}
    for preset in PRESETS:
        llm = make_llm(attention_backend="TURBOQUANT", kv_cache_dtype=preset, **common)
        # The same budget holds as many more blocks as the packed page is smaller (fp32 here).
        ratio = 2 * 32 * 4 / tqf.PRESETS[preset].slot_bytes(32)
        assert llm.engine.kv_cache.num_blocks >= 0.95 * ratio * base.engine.kv_cache.num_blocks
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert [len(g) for g in got] == [12] * len(prompts)
        kl[preset] = _mean_kl(reference, llm.score(prompts, expected))
    # This random model is chaotic (tiny logit margins), so only coarse checks: a broken
    # rotation or packing costs nats, and more bits lose less.
    assert kl["tq_k8v4"] < 0.3, kl
    assert kl["tq_k8v4"] < kl["tq_4bit"] < kl["tq_3bit"], kl
    assert kl["naive_int4"] < kl["naive_int3"], kl


def test_engine_picks_turboquant_for_a_preset_unasked(make_llm, caplog):
    """--kv-cache-dtype tq_4bit alone starts the engine (issue #47): the CPU's automatic order
    stores no preset, so TURBOQUANT is chosen and the choice logged; naming a backend that
    stores no preset beside it is an error before the model loads."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.attention import BackendSelectionError

    common = dict(model="random:tiny", device="cpu", dtype="float32", kv_cache_memory="16MiB",
                  kv_cache_dtype="tq_4bit")
    with caplog.at_level("INFO"):
        llm = make_llm(**common)
    assert llm.engine.runner.backend.get_name() == "TURBOQUANT"
    assert ("kv_cache_dtype 'tq_4bit': attention backend TURBOQUANT (the automatic order's CPU "
            "does not store it)") in caplog.text
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(BackendSelectionError, match="CPU does not store kv_cache_dtype"):
        LLM(**common, attention_backend="CPU")


@pytest.mark.slow
def test_bundled_model_tq_k8v4_agrees_with_unquantized(make_llm):
    from pagedserve import SamplingParams

    prompts = ["The capital of France is", "Photosynthesis is the process by which"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", kv_cache_memory="64MiB")
    base = make_llm(attention_backend="CPU", **common)
    ids = [base.tokenizer.encode(p) for p in prompts]
    expected = [o.outputs[0].token_ids for o in base.generate(ids, params, use_tqdm=False)]
    reference = base.score(ids, expected)
    llm = make_llm(attention_backend="TURBOQUANT", kv_cache_dtype="tq_k8v4", **common)
    got = llm.score(ids, expected)
    top1 = np.mean([float((r.argmax(-1) == g.argmax(-1)).float().mean())
                    for r, g in zip(reference, got, strict=True)])
    assert top1 >= 0.9 and _mean_kl(reference, got) < 0.05


@pytest.mark.gpu
def test_engine_bundled_model_tq_k8v4(make_llm):
    from pagedserve import SamplingParams

    prompts = ["The capital of France is", "Photosynthesis is the process by which"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # A fixed pool: several engines live at once here, so memory profiling would not fit.
    common = dict(model=str(bundled_gguf()), device=CUDA, dtype="bfloat16",
                  num_gpu_blocks_override=256)
    base = make_llm(attention_backend="TRITON", **common)
    ids = [base.tokenizer.encode(p) for p in prompts]
    expected = [o.outputs[0].token_ids for o in base.generate(ids, params, use_tqdm=False)]
    reference = base.score(ids, expected)
    for preset in PRESETS:
        llm = make_llm(attention_backend="TURBOQUANT", kv_cache_dtype=preset, **common)
        outs = llm.generate(ids, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 48 for o in outs)
        if preset == "tq_k8v4":
            got = llm.score(ids, expected)
            top1 = np.mean([float((r.argmax(-1) == g.argmax(-1)).float().mean())
                            for r, g in zip(reference, got, strict=True)])
            assert top1 >= 0.9
