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
from tests.utils.conformance import BATCHES, Case, run_case
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


@pytest.mark.parametrize("block_size", [16, pytest.param(1, marks=pytest.mark.slow)])
def test_tiny_llama_greedy_matches_transformers(tmp_path, make_llm, block_size):
    config = transformers.LlamaConfig(
        vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf.eval()
    hf.save_pretrained(tmp_path)
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
