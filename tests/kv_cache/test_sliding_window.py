"""Blocks that fall out of every layer's sliding window are freed while a request runs."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import SamplingParams
from pagedserve.kv_cache import KVCacheManager
from pagedserve.kv_cache.manager import OUT_OF_WINDOW
from pagedserve.scheduler import Request
from tests.utils.paged import hf_greedy

WINDOW, BLOCK = 8, 4


def _held(kv: KVCacheManager, request_id: str) -> list[int]:
    return [b.block_id for b in kv.req_to_blocks[request_id] if b is not OUT_OF_WINDOW]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_manager_frees_blocks_before_the_window(prefix_caching):
    kv = KVCacheManager(64, BLOCK, enable_prefix_caching=prefix_caching,
                        sliding_window=WINDOW)
    request = Request("r", list(range(1, 101)), SamplingParams(max_tokens=20))
    peak = 0
    for chunk in [16, 16, 16, 16, 16, 16, 4]:  # a chunked prefill of 100 tokens
        assert kv.allocate_slots(request, chunk) is not None
        held = _held(kv, "r")
        # The queries of this chunk see keys from num_computed - WINDOW + 1 on.
        first_needed = max(0, request.num_computed_tokens - WINDOW + 1) // BLOCK
        assert len(kv.req_to_blocks["r"]) == -(-(request.num_computed_tokens + chunk) // BLOCK)
        assert held == [b.block_id for b in kv.req_to_blocks["r"][first_needed:]]
        peak = max(peak, len(held))
        request.num_computed_tokens += chunk
    for _ in range(20):  # decodes: at most the window's blocks and the one being filled
        request.append_output_token(7)
        assert kv.allocate_slots(request, 1) is not None
        assert len(_held(kv, "r")) <= WINDOW // BLOCK + 1
        request.num_computed_tokens += 1
    # The largest chunk with the window behind it, not the 30 blocks of 120 tokens.
    assert peak <= (16 + WINDOW) // BLOCK + 1
    assert kv.num_free_blocks == 64 - len(_held(kv, "r"))
    kv.free(request)
    assert kv.all_free()


def _spec(window=None, heads=2):
    from pagedserve.kv_cache import FullAttentionSpec, SlidingWindowSpec

    if window is None:
        return FullAttentionSpec(BLOCK, heads, 16, torch.float32)
    return SlidingWindowSpec(BLOCK, heads, 16, torch.float32, sliding_window=window)


def test_one_kind_is_one_group_with_a_tensor_per_layer():
    from pagedserve.kv_cache import plan_kv_cache_groups

    for specs in ([_spec()] * 3, [_spec(8)] * 2, [_spec(), _spec(heads=4)]):
        layout = plan_kv_cache_groups(specs)
        assert len(layout.groups) == 1 and layout.tensor_of_layer == tuple(range(len(specs)))
        assert layout.bytes_per_block == sum(s.page_size_bytes for s in specs)
    assert plan_kv_cache_groups([_spec(8)] * 2).windows == [8]


def test_mixed_kinds_split_into_groups_sharing_tensors():
    from pagedserve.kv_cache import plan_kv_cache_groups
    from pagedserve.kv_cache.groups import choose_group_size

    page = _spec().page_size_bytes
    # Gemma 2: local, global, local. G = 1: three groups over one tensor.
    layout = plan_kv_cache_groups([_spec(12), _spec(), _spec(12)])
    assert [g.layer_ids for g in layout.groups] == [(0,), (2,), (1,)]
    assert layout.windows == [12, 12, None]
    assert layout.tensor_of_layer == (0, 0, 0) and layout.bytes_per_block == page
    # Gemma 3: five local to one global, twice. G = 2 pads nothing: 5 + 1 groups of 2.
    specs = [_spec(None if i % 6 == 5 else 32) for i in range(12)]
    layout = plan_kv_cache_groups(specs)
    assert layout.windows == [32] * 5 + [None]
    assert layout.groups[-1].layer_ids == (5, 11)
    assert layout.bytes_per_block == 2 * page
    for group in layout.groups:  # layer j of every group writes tensor j
        assert [layout.tensor_of_layer[i] for i in group.layer_ids] == [0, 1]
    # Windows of two sizes are two kinds.
    assert plan_kv_cache_groups([_spec(8), _spec(12)]).windows == [8, 12]
    # The largest size that pads at most a tenth of the layers.
    assert choose_group_size([6, 3]) == 3 and choose_group_size([7, 2]) == 1
    assert choose_group_size([8, 4]) == 4 and choose_group_size([52, 10]) == 6
    assert choose_group_size([40, 9]) == 5  # 9 pads 5 of 49 layers; 5 pads 1: 10 groups


def test_pages_of_different_shapes_keep_one_group(caplog):
    from pagedserve.kv_cache import plan_kv_cache_groups

    with caplog.at_level("INFO"):
        layout = plan_kv_cache_groups([_spec(12), _spec(heads=4)])
    assert layout.windows == [None] and layout.tensor_of_layer == (0, 1)
    assert "KV cache groups off" in caplog.text


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    config = transformers.MistralConfig(
        vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, sliding_window=WINDOW)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    path = tmp_path_factory.mktemp("mistral")
    model.eval().save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 211, (n,), generator=g).tolist() for n in (90, 5, 33)]
    return str(path), [hf_greedy(model, p, 12) for p in prompts], prompts


def test_long_prompt_holds_about_a_window_of_blocks(mistral, make_llm):
    """Greedy tokens equal transformers' while the long request holds only the blocks its
    window needs: the peak over the run, not the 26 blocks of its 102 tokens."""
    path, expected, prompts = mistral
    llm = make_llm(model=path, dtype="float32", device="cpu", block_size=BLOCK,
                   kv_cache_memory="4MiB", max_num_batched_tokens=16)
    engine = llm.engine
    assert engine.kv_cache.sliding_window == WINDOW
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("long", prompts[0], params)
    got, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        if "long" in engine.kv_cache.req_to_blocks:
            peak = max(peak, len(_held(engine.kv_cache, "long")))
    assert got["long"] == expected[0]
    assert peak <= (16 + WINDOW) // BLOCK + 1
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
