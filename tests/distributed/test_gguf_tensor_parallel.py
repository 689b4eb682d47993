"""Tensor parallelism with a GGUF's blocks kept (`--quantization gguf`; the Triton GEMMs run in
the interpreter here, the same sharding code as on CUDA): a tiny Llama GGUF with every kept
block type, one no-kernel type (Q5_0) and one F16 linear, which the method dequantizes at load,
and an odd vocabulary (the head's last rank padded with zero rows).

- Each rank's weights, decoded with `gguf`'s own dequantizer, are the slices of the file's
  dequantized weights that a rank holds (both ranks, built in this process: no collective runs
  while loading).
- Served at two ranks on the CPU (gloo) with the blocks kept, greedy tokens and every logprob
  equal one rank's of the same file dequantized at load, in float32.
- A row-parallel layer whose rank share is not whole blocks (256-input K-quant blocks split 128
  per rank) is refused, naming the layer, the tensor, the type and the sizes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedserve import LLM, SamplingParams
from tests.models.test_gguf_families import qwen_vocab, write_vocab
from tests.quantization.gguf_writer import write_llama_gguf
from tests.quantization.test_fp8_tensor_parallel import _as_rank
from tests.quantization.test_gguf_model import TYPES, _load, _tiny_llama

# hidden 256 (4 heads of 64, 2 K/V heads), intermediate 512: at two ranks o_proj's inputs are
# 128 per rank (32-input types only), down_proj's 256 (the K-quants too).
TP_TYPES = {"q_proj": T.Q4_K, "k_proj": T.Q4_K, "v_proj": T.Q6_K, "o_proj": T.Q8_0,
            "gate_proj": T.Q4_0, "up_proj": T.Q4_1, "down_proj": T.Q5_K, "lm_head": T.Q6_K,
            "1.o_proj": T.Q5_0, "1.down_proj": T.F16}
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory="16MiB", max_model_len=128,
              block_size=16)
PROMPTS = [[5, 17, 33, 2, 9, 100, 7], [150, 3, 3, 44]]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Any]:
    """The servable file, one whose o_proj is Q5_K (256 inputs a block), and the vocabulary's
    size."""
    vocab = qwen_vocab()
    assert len(vocab.tokens) % 2  # odd: the head's second rank holds a padding row
    root = tmp_path_factory.mktemp("gguf-tp")
    out: dict[str, Any] = {"vocab": len(vocab.tokens)}
    for name, types in (("tp", TP_TYPES), ("q5_k_o_proj", TYPES)):
        path = root / f"{name}.gguf"
        write_llama_gguf(path, _tiny_llama(seed=3, vocab=len(vocab.tokens)), types,
                         lambda writer: write_vocab(writer, vocab))
        out[name] = str(path)
    return out


def _weight(layer: torch.nn.Module) -> torch.Tensor:
    """What a layer multiplies by: its kept codes dequantized by the kernel's own
    dequantization (parts stacked), or the weight it dequantized at load."""
    if layer.weight is not None:
        return layer.weight
    return torch.cat([w.dequantize(torch.float32) for w in layer.gguf_w4a16])


def _rank_slices(full: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The weights rank `rank` of two holds, cut here from the whole dequantized ones: half
    the query heads and one of the two K/V heads, half of gate and of up, half of o's and
    down's inputs, half the vocabulary padded to an even count."""
    out = {}
    rows = lambda w, n: w[rank * n:(rank + 1) * n]  # noqa: E731
    cols = lambda w, n: w[:, rank * n:(rank + 1) * n]  # noqa: E731
    for i, layer in enumerate(full.model.layers):
        qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
        q, k, v = qkv[:256], qkv[256:384], qkv[384:]
        out[f"{i}.qkv"] = torch.cat([rows(q, 128), rows(k, 64), rows(v, 64)])
        out[f"{i}.gate_up"] = torch.cat([rows(gate_up[:512], 256), rows(gate_up[512:], 256)])
        out[f"{i}.o"] = cols(layer.self_attn.o_proj.weight, 128)
        out[f"{i}.down"] = cols(layer.mlp.down_proj.weight, 256)
    head = full.lm_head.weight
    padded = torch.cat([head, head.new_zeros(head.shape[0] % 2, head.shape[1])])
    out["head"] = rows(padded, padded.shape[0] // 2)
    return out


def test_each_rank_holds_its_slices_of_the_blocks(files, monkeypatch):
    full = _load(files["tp"], keep=False)
    for rank in (0, 1):
        _as_rank(monkeypatch, rank)
        model = _load(files["tp"], keep=True)
        layers = model.model.layers
        assert hasattr(layers[0].self_attn.o_proj, "gguf_w4a16")  # Q8_0, 128 inputs kept
        assert layers[1].self_attn.o_proj.weight is not None  # Q5_0: dequantized, sliced
        got = {}
        for i, layer in enumerate(layers):
            got[f"{i}.qkv"] = _weight(layer.self_attn.qkv_proj)
            got[f"{i}.gate_up"] = _weight(layer.mlp.gate_up_proj)
            got[f"{i}.o"] = _weight(layer.self_attn.o_proj)
            got[f"{i}.down"] = _weight(layer.mlp.down_proj)
        got["head"] = _weight(model.lm_head)
        want = _rank_slices(full, rank)
        assert got.keys() == want.keys()
        for name, weight in want.items():
            torch.testing.assert_close(got[name], weight, rtol=0, atol=0, msg=name)


def test_a_row_parallel_split_inside_a_block_is_refused(files, monkeypatch):
    _as_rank(monkeypatch, 0)
    with pytest.raises(ValueError) as refusal:
        _load(files["q5_k_o_proj"], keep=True)
    assert str(refusal.value) == (
        "model.layers.0.self_attn.o_proj: GGUF tensor blk.0.attn_output.weight (Q5_K, 256 "
        "outputs x 256 inputs) cannot split its inputs 128 per rank (tensor_parallel_size 2): "
        "a rank must hold whole Q5_K blocks of 256 inputs and a row has 1; use a "
        "tensor_parallel_size that divides 1")


def _served(path: str, quantization: str, tensor_parallel_size: int, vocab: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=vocab)
    llm = LLM(model=path, tensor_parallel_size=tensor_parallel_size, max_logprobs=vocab,
              quantization=quantization, **ENGINE)
    try:
        if tensor_parallel_size == 2:
            head = llm.engine.runner.model.lm_head  # rank 0's: its blocks, half the vocab
            assert [b.out_features for b in head.gguf_w4a16] == [(vocab + 1) // 2]
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.engine.check_blocks_free()
    finally:
        llm.engine.shutdown()
    return [o.outputs[0] for o in outputs]


def test_two_ranks_serve_the_blocks_as_one_rank_serves_the_file(files, monkeypatch):
    """Two ranks with the blocks kept against one rank with the file dequantized at load (the
    float32 reference, fast outside the interpreter; one rank's kept blocks equal it in
    tests/quantization/test_gguf_model.py)."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", "")  # no converted tokenizer kept
    vocab = files["vocab"]
    one = _served(files["tp"], "none", 1, vocab)
    two = _served(files["tp"], "gguf", 2, vocab)
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys() and len(la) >= vocab
            got = torch.tensor([lb[t].logprob for t in la])
            want = torch.tensor([la[t].logprob for t in la])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
