"""A tiny Llama GGUF (written here with gguf's writer: q/k rows interleaved as llama.cpp's
converter does, every kept block type among its linears, an untied Q6_K head) loaded with
`--quantization gguf` in the Triton interpreter: its linears keep their blocks, and its logits
equal the dequantize-at-load path's, at prefill (the dense path) and decode (the fused GEMM).
A type without a kernel is dequantized at load and the start-up log says so."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T

from pagedserve.models import gguf_file
from pagedserve.models.loader import build_model
from pagedserve.quantization.gguf_blocks import GgufLinearMethod
from pagedserve.quantization.registry import resolve_quantization
from tests.quantization import gguf_writer
from tests.quantization.gguf_writer import write_llama_gguf
from tests.utils.paged import generate_greedy, run_prefill

CPU = torch.device("cpu")
# A Q4_K_M-like mix, and every other kept type once.
TYPES = {"q_proj": T.Q4_K, "k_proj": T.Q4_K, "v_proj": T.Q6_K, "o_proj": T.Q5_K,
         "gate_proj": T.Q4_0, "up_proj": T.Q4_1, "down_proj": T.Q8_0, "lm_head": T.Q6_K}


def _tiny_llama(seed: int = 0, vocab: int = 96) -> transformers.PreTrainedModel:
    # K-quants take rows of 256 values: hidden 256, intermediate 512.
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.1)
            if "norm" in name:
                param.add_(1.0)
    return model


def _load(path, keep: bool) -> torch.nn.Module:
    reader = gguf_file.open_gguf(str(path))
    config = gguf_file.gguf_config(reader)
    weights = gguf_file.gguf_weights(reader, config, keep_quantized=keep)
    return build_model(config, torch.float32, CPU, weights, "gguf" if keep else None)


def test_a_gguf_model_keeps_its_blocks_and_its_logits(tmp_path, caplog, monkeypatch):
    from pagedserve.quantization.ops import w4a16_gemm

    # The prefill's 76 rows take the dequantized weight's dense GEMM (the interpreter runs the
    # fused GEMM's 76 rows in ~30 s); the decode steps' 3 rows the fused GEMM.
    monkeypatch.setattr(w4a16_gemm, "DEQUANTIZE_ABOVE_M", 64)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, _tiny_llama(), TYPES)
    with caplog.at_level(logging.INFO, logger="pagedserve.quantization.layers"):
        kept = _load(path, keep=True)
    dense = _load(path, keep=False)
    linears = [m for m in kept.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 4 + 1
    assert all(isinstance(m.quant_method, GgufLinearMethod) and m.weight is None
               for m in linears)
    qkv = kept.model.layers[0].self_attn.qkv_proj
    assert [(t, w.out_features, w.bits) for t, w in zip(qkv.gguf_types, qkv.gguf_w4a16,
                                                        strict=True)] == [
        ("Q4_K", 256 + 128, 4), ("Q6_K", 128, 8)]
    assert "gguf Q4_K+Q6_K -> W4A16 kernel: 2 layers" in caplog.text
    # 5 + 11 + 60 prompt rows: above DEQUANTIZE_ABOVE_M, the decoded weight's dense GEMM.
    prompts = [[int(t) for t in torch.randint(0, 96, (n,), generator=torch.Generator()
                                              .manual_seed(n))] for n in (5, 11, 60)]
    for got, want in zip(run_prefill(kept, prompts), run_prefill(dense, prompts), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Decode: three rows a step through the fused GEMM.
    tokens, logits = generate_greedy(kept, prompts, 3)
    want_tokens, want_logits = generate_greedy(dense, prompts, 3)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_type_without_a_kernel_is_dequantized_at_load_and_logged(tmp_path, caplog):
    path = tmp_path / "q5_0.gguf"
    write_llama_gguf(path, _tiny_llama(seed=1), {**TYPES, "o_proj": T.Q5_0})
    with caplog.at_level(logging.INFO, logger="pagedserve.quantization.layers"):
        kept = _load(path, keep=True)
    assert "gguf Q5_0: no kernel, dequantized at load: 2 layers" in caplog.text
    o_proj = kept.model.layers[0].self_attn.o_proj
    assert o_proj.weight is not None and not hasattr(o_proj, "gguf_w4a16")
    dense = _load(path, keep=False)
    torch.testing.assert_close(o_proj.weight, dense.model.layers[0].self_attn.o_proj.weight)
    prompts = [[1, 2, 3, 4, 5]]
    torch.testing.assert_close(run_prefill(kept, prompts)[0], run_prefill(dense, prompts)[0],
                               rtol=1e-4, atol=1e-4)


def test_the_flag_needs_a_gguf_file_and_a_kernel_device(monkeypatch):
    assert resolve_quantization("gguf", "m.gguf", "auto", CPU) == "gguf"  # interpreted here
    with pytest.raises(ValueError, match="'model_dir' is not a .gguf file"):
        resolve_quantization("gguf", "model_dir", "auto", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs Triton kernels, on CUDA"):
        resolve_quantization("gguf", "m.gguf", "auto", CPU)
    cuda = torch.device("cuda")
    assert resolve_quantization("auto", "m.gguf", "auto", cuda) is None  # until GPU-tested
    monkeypatch.setenv("PAGEDSERVE_GGUF_KERNEL", "1")
    assert resolve_quantization("auto", "m.gguf", "auto", cuda) == "gguf"
    assert resolve_quantization("auto", "model_dir", "auto", cuda) is None
    assert resolve_quantization("auto", "m.gguf", "auto", CPU) == "int8"  # the CPU default


def test_the_engine_serves_a_gguf_with_the_flag(tmp_path, make_llm):
    """`quantization="gguf"` through the engine (its tokenizer from the file): the same greedy
    tokens as the file dequantized at load."""
    from pagedserve import SamplingParams
    from tests.models.test_gguf_families import qwen_vocab, write_vocab

    vocab = qwen_vocab()
    path = tmp_path / "tiny-chat.gguf"
    write_llama_gguf(path, _tiny_llama(seed=2, vocab=len(vocab.tokens)), TYPES,
                     lambda writer: write_vocab(writer, vocab))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = ["the cat sat on the mat", "hello world"]
    outputs = {}
    for method in ("gguf", "none"):
        llm = make_llm(model=str(path), dtype="float32", device="cpu", kv_cache_memory="16MiB",
                       quantization=method)
        outputs[method] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        kept = [m for m in llm.engine.runner.model.modules() if hasattr(m, "gguf_w4a16")]
        assert len(kept) == (9 if method == "gguf" else 0)
    assert outputs["gguf"] == outputs["none"]


@pytest.mark.gpu
def test_the_bundled_smollm2_keeps_its_q4_1_blocks():
    """The bundled SmolLM2 (210 Q4_1 linears, a Q8_0 embedding tied to the head) with its
    blocks kept: logits of a prefill (the dense path) and of two decode steps (the fused GEMM)
    equal the dequantized file's. A GPU test: in the interpreter it passes in ~8 minutes."""
    from pagedserve.models.loader import load_model
    from tests.utils.paged import bundled_gguf

    path = str(bundled_gguf())
    device = torch.device("cuda")
    kept = load_model(path, torch.float32, device, 256, quantization="gguf").model
    dense = load_model(path, torch.float32, device, 256).model
    linears = [m for m in kept.modules() if hasattr(m, "gguf_w4a16")]
    assert len(linears) == 30 * 4 and {t for m in linears for t in m.gguf_types} == {"Q4_1"}
    prompts = [list(range(100, 180)), [1, 504, 3458, 282, 4649, 314]]
    for got, want in zip(run_prefill(kept, prompts[:1]), run_prefill(dense, prompts[:1]),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    tokens, logits = generate_greedy(kept, prompts[1:], 2)
    want_tokens, want_logits = generate_greedy(dense, prompts[1:], 2)
    assert tokens == want_tokens
    torch.testing.assert_close(logits[0], want_logits[0], rtol=1e-4, atol=1e-3)


def test_a_gguf_without_a_tokenizer_loads_with_none_or_the_one_named(tmp_path):
    """A weights-only GGUF (no tokenizer.ggml.model) loads as a directory without tokenizer
    files does, and `--tokenizer` replaces the file's: it was converted first, and failed."""
    from pagedserve.models.loader import load_model
    from tests.models.test_gguf_families import qwen_vocab, write_vocab

    vocab = qwen_vocab()
    model = _tiny_llama(seed=4, vocab=len(vocab.tokens))
    bare, with_vocab = tmp_path / "bare.gguf", tmp_path / "vocab.gguf"
    write_llama_gguf(bare, model, {})
    write_llama_gguf(with_vocab, model, {}, lambda writer: write_vocab(writer, vocab))
    assert load_model(str(bare), torch.float32, CPU).tokenizer is None
    named = load_model(str(bare), torch.float32, CPU, tokenizer=str(with_vocab)).tokenizer
    assert named is not None and len(named) == len(vocab.tokens)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K])
def test_torch_dequantizer_gives_gguf_bits(qtype):
    """The load path's torch dequantizer of the common block types: the very float32 values
    of gguf's own, whatever the tensor's shape (the bundled model's tensors: the engine tests)."""
    import numpy as np
    from gguf.quants import dequantize, quantize

    from pagedserve.quantization.gguf_blocks import dequantize_array

    k_type = qtype in (T.Q4_K, T.Q5_K, T.Q6_K)  # super-blocks of 256: the tests' quantizer
    shape = (3, 2, 512) if k_type else (3, 4, 96)
    values = np.random.default_rng(int(qtype)).standard_normal(shape).astype(np.float32)
    values[0, 0, :256] = 0.0  # an all-zero block (scale 0)
    blocks = (gguf_writer.quantize(values.reshape(-1, shape[-1]), qtype).reshape(
        *shape[:-1], -1) if k_type else quantize(values, qtype))
    got = dequantize_array(blocks, qtype, "t")
    assert got.shape == values.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, dequantize(blocks, qtype))
    assert np.abs(got - values).max() < 0.3  # and it is the tensor, near enough
