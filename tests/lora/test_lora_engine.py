"""LoRA through the engine (CPU, float32): one generate call mixing the base and three PEFT
adapters gives each PeftModel's greedy tokens and logprobs; adapters from --lora-modules and
added later; no prefix-cache block shared across adapters; the per-step adapter cap."""

from __future__ import annotations

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.lora import LoRARequest
from tests.lora.adapters import ADAPTERS, save_adapter, save_base

NEW = 5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    base = save_base(root / "base")
    refs = {name: save_adapter(base, root / name, rank, alpha, rslora, seed=i + 1)
            for i, (name, (rank, alpha, rslora)) in enumerate(ADAPTERS.items())}
    return root, base, refs


def _engine(make_llm, root, **kwargs):
    kwargs = {"max_lora_rank": 32, **kwargs}
    return make_llm(model=str(root / "base"), dtype="float32", device="cpu", enable_lora=True,
                    enable_prefix_caching=True, **kwargs)


def _hf_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1:].float()
    return out[0, len(prompt):].tolist(), torch.log_softmax(logits, -1)


def test_one_batch_mixes_base_and_adapters(make_llm, saved):
    root, base, refs = saved
    # r8 from --lora-modules (id 1), the others named first by requests (ids 2, 3)
    llm = _engine(make_llm, root, lora_modules=[f"r8={root / 'r8'}"], max_loras=3)
    _check_mixed(llm, root, base, refs)


def test_padded_decode_steps_run_the_kernels_over_every_row(make_llm, saved):
    """Decode steps padded to a captured size the way CUDA graphs run them (here eagerly,
    `DecodeGraphs(capture=False)`), through Triton's kernels (the interpreter): their grid over
    every padded row, the padding in no slot's run."""
    pytest.importorskip("triton")
    from pagedserve.engine.cuda_graphs import DecodeGraphs

    root, base, refs = saved
    llm = _engine(make_llm, root, max_loras=3, max_num_seqs=8)
    runner = llm.engine.runner
    runner.lora.batch.use_kernels = True
    graphs = DecodeGraphs(runner.graph_inputs(), [8], capture=False)
    runner.decode_graphs = graphs
    _check_mixed(llm, root, base, refs)
    assert graphs.replays[8] >= NEW - 1  # the 4 requests' decodes, padded to 8


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_padded_verify_steps_route_every_token(make_llm, saved, kernels):
    """A verify step (3 requests of 1+K tokens: an adapter, the base, another adapter) padded
    to 4 requests as its CUDA graph runs it (capture off): graph-mode LoRA routes each token
    row by its slot's run, so the real rows equal the unpadded eager step's, which the
    adapters move."""
    import numpy as np

    from pagedserve.engine.cuda_graphs import DecodeGraphs

    if kernels:
        pytest.importorskip("triton")
    root, base, refs = saved
    q = 4
    llm = _engine(make_llm, root, max_loras=3, max_num_seqs=8,
                  speculative_config={"method": "ngram", "num_speculative_tokens": q - 1})
    runner = llm.engine.runner
    runner.lora.batch.use_kernels = kernels
    inputs = runner.graph_inputs()
    verify = DecodeGraphs(inputs, [4, 8], capture=False, query_len=q)
    graphs = DecodeGraphs(inputs, [1, 2, 4, 8], capture=False, verify=verify)
    for i, name in enumerate(("r8", "r16"), start=1):
        runner.lora.add_adapter(LoRARequest(name, i, str(root / name)))
    commons = verify.dummy_decode(3, [5, 37, 18])
    ids = torch.randint(0, runner.vocab_size, (3 * q,), generator=torch.Generator().manual_seed(0))
    runner.input_ids.device[:3 * q].copy_(ids)
    eager_md = {key: b.build(commons[0]) for key, b in runner.builders.items()}
    out = {}
    with torch.inference_mode():
        for adapters in ([0, 0, 0], [1, 0, 2]):
            runner.lora.set_step(adapters, np.full(3, q))
            out[tuple(adapters)] = runner.run_model(eager_md, 3 * q).clone()
        padded = graphs.run(commons).clone()
    assert verify.replays == {4: 1}
    eager, plain = out[1, 0, 2], out[0, 0, 0]
    moved = (eager - plain).abs().amax(dim=-1).reshape(3, q) > 1e-3
    assert moved[[0, 2]].all() and not moved[1].any()
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)


def test_two_tensor_parallel_ranks_shard_the_adapters(saved):
    """Tensor parallelism (two gloo ranks on the CPU): each rank holds its share of A and B
    (column-parallel layers B's rows, row-parallel ones A's columns, their partial terms
    summed by the layer's all-reduce); each PeftModel's tokens and logprobs within 1e-4."""
    from pagedserve import LLM

    root, base, refs = saved
    llm = LLM(model=str(root / "base"), dtype="float32", device="cpu", enable_lora=True,
              max_lora_rank=32, max_loras=3, tensor_parallel_size=2, kv_cache_memory="16MiB",
              max_model_len=128)
    try:
        layers = llm.engine.runner.lora.layers  # rank 0's
        attn = "model.layers.0.self_attn."
        qkv, o = layers[attn + "qkv_proj"], layers[attn + "o_proj"]
        assert qkv.lora_b.shape[1] == 64 and qkv.lora_a.shape[2] == 64  # of 128 rows; all in
        assert o.lora_a.shape[2] == 32 and o.lora_b.shape[1] == 64  # of 64 columns; all out
        _check_mixed(llm, root, base, refs)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_two_ranks_with_one_kv_head_replicate_its_factors(tmp_path):
    """One K/V head over two ranks: each rank holds the whole k and v, and so the whole of
    their B rows."""
    from pagedserve import LLM
    from tests.lora import adapters

    base = adapters.save_base(tmp_path / "base", num_key_value_heads=1)
    ref = save_adapter(base, tmp_path / "a", 16, 8, True, seed=4)
    llm = LLM(model=str(tmp_path / "base"), dtype="float32", device="cpu", enable_lora=True,
              max_lora_rank=16, tensor_parallel_size=2, kv_cache_memory="16MiB",
              max_model_len=128)
    try:
        prompt = [9, 41, 7, 200, 3, 3, 18]
        params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=0, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False,
                           lora_request=LoRARequest("a", 1, str(tmp_path / "a")))[0]
        tokens, logprobs = _hf_greedy(ref, prompt)
        assert out.outputs[0].token_ids == tokens
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens,
                                                             strict=True)])
        torch.testing.assert_close(got, logprobs[torch.arange(NEW), tokens], rtol=1e-4,
                                   atol=1e-4)
    finally:
        llm.engine.shutdown()


def _check_mixed(llm, root, base, refs):
    """One generate call of the base and the three adapters: each PeftModel's greedy tokens
    and logprobs."""
    requests = {"r8": LoRARequest("r8", 1, str(root / "r8")),
                "r16": LoRARequest("r16", 2, str(root / "r16")),
                "r32": LoRARequest("r32", 3, str(root / "r32"))}
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (6, 19, 11, 23)]
    names = [None, "r8", "r16", "r32"]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[requests[n] if n else None for n in names])
    for name, prompt, out in zip(names, prompts, outs, strict=True):
        ref = base if name is None else refs[name]
        tokens, logprobs = _hf_greedy(ref, prompt)
        assert out.outputs[0].token_ids == tokens, name
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens,
                                                             strict=True)])
        want = logprobs[torch.arange(NEW), tokens]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)




def test_adapters_over_int8_linears(make_llm, tmp_path):
    """Over weight-only int8 linears (the CPU's default for a GGUF, whose float weights are
    gone after loading) an adapter still moves the tokens to its PeftModel's; the products
    read bfloat16 inputs through int8 codes, so the logprobs agree to a few percent."""
    base = save_base(tmp_path / "base", tie_word_embeddings=True)  # as SmolLM2's
    ref = save_adapter(base, tmp_path / "r8", 8, 16, False, seed=1)
    llm = _engine(make_llm, tmp_path, quantization="int8", max_loras=2)
    # the tied head, an int8 linear here, is no target (as the float head is not)
    assert "lm_head" not in llm.engine.runner.lora.layers
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (9, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[None, LoRARequest("r8", 1, str(tmp_path / "r8"))])
    assert _hf_greedy(base, prompts[1])[0] != _hf_greedy(ref, prompts[1])[0]
    for model, prompt, out in zip((base, ref), prompts, outs, strict=True):
        tokens, logprobs = _hf_greedy(model, prompt)
        assert out.outputs[0].token_ids == tokens
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens,
                                                             strict=True)])
        torch.testing.assert_close(got, logprobs[torch.arange(NEW), tokens], rtol=0.05,
                                   atol=0.05)
