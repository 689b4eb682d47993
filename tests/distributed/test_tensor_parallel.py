"""Tensor parallelism end to end on the CPU (gloo, float32): greedy tokens of two ranks equal
one rank's for a Llama with one K/V head (replicated over the ranks), a Qwen3 (q/k norms,
heads split) and a Qwen3-MoE (experts split inside), saved as sharded safetensors and read a
slice per rank; with chunked prefill, and preemption forced for Qwen3. gpt-oss in MXFP4 (sinks,
experts with biases) likewise. Gemma 3 (and Gemma 2, slow) at two ranks give transformers'
tokens and top-5 logprobs. A worker killed
mid-generation is a WorkerError within seconds and leaves no process behind; a start-up error
comes back as itself; an engine dropped without close() frees the process for another."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.distributed import parallel_state
from pagedserve.executor import WorkerError
from pagedserve.models.loader import check_tensor_parallel

COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_attention_heads=4,
                                              num_key_value_heads=1),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_attention_heads=4,
                                              num_key_value_heads=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[], decoder_sparse_step=1),
}
PROMPTS = [[5, 17, 33, 2, 9, 100, 7], [150, 3, 3, 44], list(range(20, 60))]
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory="16MiB", max_model_len=128,
              block_size=4, max_num_batched_tokens=16)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


def save_model(config: transformers.PretrainedConfig, path, biases: bool = False) -> str:
    """A random model with weights of std 0.15 (greedy far from ties), sharded; `biases`: its
    biases and sinks too (transformers starts them at zero), std 0.5."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if biases and (name.endswith("bias") or "sinks" in name):
                p.copy_(0.5 * torch.randn_like(p))
                continue
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="100KB")
    return str(path)


def _thread_names() -> list[str]:
    return [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


class OneRank(dict):
    """name -> the model's directory and its one-rank greedy tokens, made on first use (a
    slow case's model only when it runs)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, name: str) -> tuple[str, list[list[int]]]:
        path = save_model(CONFIGS[name](), self.tmp_path_factory.mktemp(name))
        self[name] = (path, greedy(LLM(model=path, **ENGINE)))
        return self[name]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> OneRank:
    return OneRank(tmp_path_factory)


def _no_workers_left() -> None:
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


# Qwen3 runs with few blocks: requests are preempted and resumed (their rows rebuilt on every
# rank from the copies the engine sends), and with a step in flight, as on CUDA: each step's
# input ids take the last step's samples (rank 0's, broadcast) on every rank's device. Llama
# (the same with no q/k norms) runs by default behind a core process, below.
VARIANT = {"qwen3": {"kv_cache_memory": None, "num_gpu_blocks_override": 16,
                     "async_scheduling": True},
           "llama": {"async_scheduling": True}}


# Qwen3-MoE is slow: its experts' split (SparseMoeBlock over FusedMoE, per-expert safetensors
# names) runs at two ranks in test_deepseek_tensor_parallel.py::test_two_ranks_equal_transformers
# [v3] and test_gpt_oss_mxfp4_two_ranks_match_one, its top-k router in
# test_qwen3_next_tensor_parallel.py::test_two_ranks_equal_transformers[moe].
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in ("llama", "qwen3_moe") else n for n in CONFIGS])
def test_two_ranks_match_one(models, name):
    path, expected = models[name]
    llm = LLM(model=path, tensor_parallel_size=2, **{**ENGINE, **VARIANT.get(name, {})})
    try:
        assert llm.engine.runner.world_size == 2
        assert greedy(llm) == expected
        assert llm.engine.check_blocks_free()
        if name == "qwen3":
            assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.shutdown()
    _no_workers_left()


def test_two_ranks_behind_a_core_process(models):
    """The engine core in its own (daemon) process starts the other rank itself, as `serve`
    does on CUDA by default; outputs and shutdown as in one process."""
    path, expected = models["llama"]
    llm = LLM(model=path, tensor_parallel_size=2, engine_core_process=True, **ENGINE)
    try:
        assert greedy(llm) == expected
        assert llm.engine.check_blocks_free()
    finally:
        llm.engine.shutdown()
    _no_workers_left()


def test_random_weights_split_as_one_rank_draws_them(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text("base: tiny\nvocab_size: 97\nnum_attention_heads: 4\n"
                    "num_key_value_heads: 2\n")
    args = dict(model=f"random:{spec}", **ENGINE)
    prompts = [[1, 2, 3, 4, 5], [50, 60, 70]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    one = LLM(**args).generate(prompts, params, use_tqdm=False)
    llm = LLM(tensor_parallel_size=2, **args)
    workers = llm.engine.client.core.runner.processes
    try:
        two = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    # The group goes with the shutdown, gloo's threads with it: a group kept alive past
    # destroy_process_group (its random config imported torch's sharding module meanwhile)
    # left them running, and they aborted the processes at exit.
    assert [p.exitcode for p in workers] == [0]
    assert not [name for name in _thread_names() if "gloo" in name]
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for token, lp in la.items():
                assert lb[token].logprob == pytest.approx(lp.logprob, abs=1e-4)


# Run in a process of its own: one group per process, and the exit itself is checked.
DROPPED_ENGINE = """
import multiprocessing, os
import torch.distributed as dist
from pagedserve import LLM, SamplingParams

args = dict(model="random:tiny", tensor_parallel_size=2, **{engine!r})
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
llm = LLM(**args)
first = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
workers = llm.engine.runner.processes
del llm  # neither close() nor gc.collect(): the last reference goes, and the engine with it
assert not dist.is_initialized(), "the group outlived the engine"
assert [p.exitcode for p in workers] == [0], [p.exitcode for p in workers]
assert not multiprocessing.active_children(), multiprocessing.active_children()
gloo = [t for t in os.listdir("/proc/self/task")
        if "gloo" in open(f"/proc/self/task/{{t}}/comm").read()]
assert not gloo, f"{{len(gloo)}} gloo threads left"
llm = LLM(**args)
second = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
assert second == first, (first, second)
print("second engine ok")
"""  # the second engine is left to the interpreter's exit


def test_dropped_engine_frees_the_process_for_another():
    """`del llm` shuts a tensor-parallel engine down as close() does: its worker exits, the
    group and its threads go, a second engine starts in the same process, and the process
    (the second engine still open) exits cleanly."""
    code = DROPPED_ENGINE.format(engine=ENGINE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT,  # spawned workers: the product's default
                         env={**os.environ, "PAGEDSERVE_PROCESS_START_METHOD": "spawn"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "second engine ok" in out.stdout
    assert "terminate called" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_killed_worker_is_a_clear_error(models):
    path, _ = models["llama"]
    llm = LLM(model=path, tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    (worker,) = engine.runner.processes
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=100,
                                                       ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    _no_workers_left()
    engine.shutdown()  # again: nothing left to do


# Gemma: sliding-window and global layers (a KV cache group each), the scaled embedding and
# the head split over an odd vocabulary (rank 1's last row is padding), soft-caps low enough to
# bite. Gemma 3 ties its head and norms q/k per head; Gemma 2 has a head of its own.
GEMMA = dict(COMMON, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
             num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, sliding_window=5,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             final_logit_softcapping=3.0)
GEMMA_CONFIGS = {
    "gemma3": lambda: transformers.Gemma3TextConfig(**{**GEMMA, "tie_word_embeddings": True}),
    "gemma2": lambda: transformers.Gemma2Config(**GEMMA, attn_logit_softcapping=2.0),
}


@torch.no_grad()
def _transformers_greedy(path: str, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' (eager) greedy tokens and its log-distributions at each of them."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    out = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    logits = hf(out).logits[0, len(prompt) - 1:-1]
    return out[0, len(prompt):].tolist(), torch.log_softmax(logits.float(), dim=-1)


def assert_equal_transformers(path: str, prompts: list[list[int]], outputs: list,
                              num_new: int) -> None:
    """Each output's greedy tokens are transformers' and its top logprobs within 1e-4."""
    from tests.utils.paged import check_top_logprobs

    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, ref = _transformers_greedy(path, prompt, num_new)
        assert out.outputs[0].token_ids == tokens
        check_top_logprobs(out.outputs[0].logprobs, ref)


@pytest.mark.parametrize("name", ["gemma3", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_gemma_two_ranks_equal_transformers(tmp_path, name):
    """Greedy tokens and top-5 logprobs of two ranks equal transformers' (a wrong split of
    the heads, the vocabulary or the KV groups moves the logprobs past 1e-4)."""
    path = save_model(GEMMA_CONFIGS[name](), tmp_path / name)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    prompts = [PROMPTS[0], PROMPTS[2]]  # 7 and 40 tokens: the window of 5 cuts both
    llm = LLM(model=path, tensor_parallel_size=2, **ENGINE)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.check_blocks_free()
    finally:
        llm.engine.shutdown()
    assert_equal_transformers(path, prompts, outputs, 6)
    _no_workers_left()


def test_families_without_tensor_parallel_refuse_by_name(monkeypatch):
    from pagedserve.models.lfm2 import Lfm2ForCausalLM
    from pagedserve.models.llama import Qwen3ForCausalLM

    monkeypatch.setattr(parallel_state, "_world_size", 2)
    check_tensor_parallel(Qwen3ForCausalLM)
    with pytest.raises(ValueError, match="Lfm2ForCausalLM does not support "
                                         "tensor_parallel_size > 1"):
        check_tensor_parallel(Lfm2ForCausalLM)
    with pytest.raises(ValueError, match="int8 quantization"):
        check_tensor_parallel(Qwen3ForCausalLM, "int8")


def test_gpt_oss_mxfp4_two_ranks_match_one(tmp_path):
    """gpt-oss as published (MXFP4 experts, dequantized at load on the CPU): its sinks split
    with the heads, each expert's gate/up bias with its rows, the down bias added once (rank
    0's); tokens and logprobs of two ranks equal one rank's."""
    from tests.quantization import int4_writer

    config = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 64},
                                       num_attention_heads=4, num_key_value_heads=2,
                                       num_local_experts=4, num_experts_per_tok=2,
                                       swiglu_limit=1.5, sliding_window=12,
                                       layer_types=["sliding_attention", "full_attention"])
    save_model(config, tmp_path / "float", biases=True)
    int4_writer.write_mxfp4(tmp_path / "float", tmp_path / "mxfp4", tmp_path / "ref")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    outputs = {}
    for tp in (1, 2):
        llm = LLM(model=str(tmp_path / "mxfp4"), tensor_parallel_size=tp, **ENGINE)
        try:
            outputs[tp] = [o.outputs[0] for o in llm.generate(PROMPTS[:2], params,
                                                              use_tqdm=False)]
        finally:
            llm.engine.shutdown()
    for one, two in zip(outputs[1], outputs[2], strict=True):
        assert one.token_ids == two.token_ids
        for la, lb in zip(one.logprobs, two.logprobs, strict=True):
            assert la.keys() == lb.keys()
            for token, lp in la.items():
                assert lb[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
    _no_workers_left()


def test_start_up_failure_is_the_ranks_error(tmp_path):
    """Three query heads cannot split over two ranks: the error says so, and the worker
    started for rank 1 does not outlive it."""
    config = CONFIGS["qwen3"]()
    config.num_attention_heads, config.num_key_value_heads = 3, 1
    path = save_model(config, tmp_path / "three_heads")
    with pytest.raises(ValueError, match="attention heads divisible by 2, got 3"):
        LLM(model=path, tensor_parallel_size=2, **ENGINE)
    _no_workers_left()


@pytest.mark.slow  # safetensors cases cover the layers; GGUF adds its load only
def test_gguf_two_ranks_match_one(tmp_path, monkeypatch):
    """A GGUF is dequantized, then each rank takes its slices."""
    from tests.models.test_gguf_families import FAMILIES, random_model, write_gguf

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", "")  # no converted tokenizer kept
    family = FAMILIES["qwen3"]
    vocab = family.make_vocab()
    path = tmp_path / "tiny-qwen3.gguf"
    write_gguf(path, family, random_model(family.make_config(len(vocab.tokens)), False), vocab)
    expected = greedy(LLM(model=str(path), **ENGINE))
    llm = LLM(model=str(path), tensor_parallel_size=2, **ENGINE)
    try:
        assert greedy(llm) == expected
    finally:
        llm.engine.shutdown()


def guided_params(plain_tokens: int) -> list[SamplingParams]:
    """A JSON schema and a choice under greedy decoding, beside a plain greedy request."""
    from pagedserve.sampling_params import GuidedDecodingParams

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    return [SamplingParams(temperature=0, max_tokens=40,
                           guided_decoding=GuidedDecodingParams(json=schema)),
            SamplingParams(temperature=0, max_tokens=8,
                           guided_decoding=GuidedDecodingParams(choice=["left", "right"])),
            SamplingParams(temperature=0, max_tokens=plain_tokens, ignore_eos=True)]


# Slow (10 s): a guided request at two ranks, rank 0 masking alone, also runs in
# tests/distributed/test_tp_spec_decode.py's async case (with drafts turned off by batch size).
@pytest.mark.slow
def test_guided_decoding_with_two_ranks(tmp_path):
    """Rank 0 alone masks and samples (the others get requests without their matchers): a
    JSON schema and a choice under greedy decoding give TP=1's tokens, beside a plain request.
    TP=1 runs through the multiprocess executor too, whose collect waits on a guided step's
    samples, sampled only once its bitmask's fill is done."""
    from tests.utils.paged import tiny_chat_model

    model = str(tiny_chat_model(tmp_path / "tiny", init_std=0.2))
    params = guided_params(plain_tokens=10)
    outputs = {}
    for tp in (1, 2):
        llm = LLM(model=model, dtype="float32", kv_cache_memory="16MiB", max_model_len=128,
                  tensor_parallel_size=tp, distributed_executor_backend="mp")
        try:
            outs = llm.generate(["Answer:"] * 3, params, use_tqdm=False)
            outputs[tp] = [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]
            assert llm.engine.check_blocks_free()
        finally:
            llm.engine.shutdown()
    assert outputs[2] == outputs[1]
    assert set(json.loads(outputs[2][0][0])) == {"ok", "n"}
    assert outputs[2][1][0] in ("left", "right")
    _no_workers_left()


def test_an_unknown_start_method_is_refused(monkeypatch):
    from pagedserve.process_start import start_context

    monkeypatch.setenv("PAGEDSERVE_PROCESS_START_METHOD", "fork")
    with pytest.raises(ValueError, match="one of .*'spawn', 'forkserver'.*got 'fork'"):
        start_context()
