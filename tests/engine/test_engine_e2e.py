"""End to end against transformers on the same weights (float32, CPU, greedy): token ids equal
for batches of prompts of different lengths, also with chunked prefill, preemption and block
sizes 1 and 32; prompt logprobs within 1e-4 relative."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import SamplingParams
from tests.utils.paged import check_prompt_logprobs, hf_greedy, hf_prompt_logprobs

NUM_NEW = 32
PROMPT_LENS = [3, 17, 8, 40, 1, 25, 12, 33, 64]

VARIANTS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_gpu_blocks_override": 24, "block_size": 4},
    "block_size_1": {"block_size": 1},
    "block_size_32": {"block_size": 32},
}


def _tiny_configs() -> dict[str, transformers.PretrainedConfig]:
    common = dict(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, tie_word_embeddings=False)
    return {
        "llama_gqa": transformers.LlamaConfig(**common, rope_theta=10000.0),
        "qwen2": transformers.Qwen2Config(**common),
        "mistral_window": transformers.MistralConfig(**common, sliding_window=24),
    }


def _save(config: transformers.PretrainedConfig, path, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    model.save_pretrained(path)
    return model


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    models = {}
    for i, (name, config) in enumerate(_tiny_configs().items()):
        path = tmp_path_factory.mktemp(name)
        hf = _save(config, path, seed=i)
        prompts = _prompts(config.vocab_size, seed=100 + i)
        expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
        models[name] = (str(path), hf, prompts, expected)
    return models


def _engine_greedy(make_llm, path: str | None, prompts, **kwargs):
    if path is not None:  # tiny models: a small pool keeps start-up fast at block size 1
        kwargs.setdefault("kv_cache_memory", "16MiB")
    llm = make_llm(model=path, dtype="float32", device="cpu", **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2", "mistral_window"])
def test_tiny_models_match_transformers(tiny_models, make_llm, name, variant):
    path, _, prompts, expected = tiny_models[name]
    got, llm = _engine_greedy(make_llm, path, prompts, **VARIANTS[variant])
    assert got == expected
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if variant == "chunked_prefill":
        assert max(PROMPT_LENS) > 16  # the longest prompts were split across steps


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2", "mistral_window"])
def test_tiny_models_prompt_logprobs(tiny_models, make_llm, name):
    path, hf, prompts, _ = tiny_models[name]
    llm = make_llm(model=path, dtype="float32", device="cpu", max_num_batched_tokens=16,
                   kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_prompt_logprobs(hf, prompts, outputs, top=5)


# The variants exercise the scheduler, which the in-process tests above cover; the core
# process only moves its outputs.
@pytest.mark.parametrize("variant", [
    "default", pytest.param("chunked_prefill", marks=pytest.mark.slow),
    pytest.param("preemption", marks=pytest.mark.slow)])
def test_core_process_matches_transformers(tiny_models, make_llm, variant):
    """The engine core in a process of its own: the same greedy tokens (as transformers'),
    preemption seen through the core's stats, prompt logprobs within 1e-4, and the core's
    blocks all free afterwards (make_llm asks it)."""
    path, hf, prompts, expected = tiny_models["llama_gqa"]
    got, llm = _engine_greedy(make_llm, path, prompts, engine_core_process=True,
                              **VARIANTS[variant])
    assert got == expected
    if variant == "preemption":
        assert llm.engine.call_utility("stats").num_preemptions > 0
    if variant == "chunked_prefill":
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        check_prompt_logprobs(hf, prompts, outputs, top=5)


# ---- the bundled SmolLM2 -------------------------------------------------------------------

SMOL_PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three laws of robotics are",
    "Water boils at",
    "In 1969, the first",
    "A haiku about autumn leaves:\n",
    "Translate to French: good morning, my friend. How are you doing today? I hope",
]


@pytest.fixture(scope="module")
def smollm_reference():
    from pagedserve.models.loader import default_model_path

    path = default_model_path()
    directory, name = str(path.parent), path.name
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                           torch_dtype=torch.float32)
    hf.eval()
    prompts = [tok.encode(p, add_special_tokens=False) for p in SMOL_PROMPTS]
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    return hf, prompts, expected


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_smollm2_matches_transformers(smollm_reference, make_llm, variant):
    _, prompts, expected = smollm_reference
    kwargs = dict(VARIANTS[variant])
    if variant == "preemption":
        kwargs["num_gpu_blocks_override"] = 30
    got, llm = _engine_greedy(make_llm, None, prompts, **kwargs)
    assert got == expected
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_smollm2_flex_attention_matches_transformers(smollm_reference, make_llm):
    """The bundled model through FLEX_ATTENTION (eager flex on the CPU), chunked prefill."""
    _, prompts, expected = smollm_reference
    got, llm = _engine_greedy(make_llm, None, prompts, attention_backend="FLEX_ATTENTION",
                              max_num_batched_tokens=32)
    assert llm.engine.runner.backend.get_name() == "FLEX_ATTENTION"
    assert got == expected


@pytest.mark.slow
def test_smollm2_prompt_logprobs(smollm_reference, make_llm):
    hf, prompts, _ = smollm_reference
    llm = make_llm(model=None, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ref = hf_prompt_logprobs(hf, prompt)
        for pos, entry in enumerate(output.prompt_logprobs[1:], start=1):
            for token_id, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[pos - 1, token_id].item(), rel=1e-4,
                                                   abs=1e-4)


@pytest.mark.slow
def test_smollm2_text(make_llm):
    llm = make_llm(model=None)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0]
    assert out.outputs[0].text.startswith(" Paris.")
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in chat.outputs[0].text
    assert chat.outputs[0].finish_reason == "stop"


def test_teacher_forced_scoring_matches_transformers(tiny_models, make_llm):
    path, hf, prompts, _ = tiny_models["llama_gqa"]
    g = torch.Generator().manual_seed(7)
    continuations = [torch.randint(3, 211, (12,), generator=g).tolist() for _ in prompts]
    llm = make_llm(model=path, dtype="float32", device="cpu", kv_cache_memory="16MiB")
    scores = llm.score(prompts, continuations)
    for prompt, cont, got in zip(prompts, continuations, scores, strict=True):
        ref = hf_prompt_logprobs(hf, prompt + cont)[len(prompt) - 1:-1]
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
