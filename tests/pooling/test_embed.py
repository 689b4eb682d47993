"""LLM.embed on a tiny random Qwen3 embedder saved with sentence-transformers' files: the
embeddings equal sentence-transformers' own (float32, CPU) on 32 inputs of mixed lengths,
however the inputs are batched, ordered or scheduled; dimensions, truncation and the refusals
of what a pooling model does not do."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.pooling import PoolingParams
from tests.pooling.st_model import mixed_texts, tiny_qwen3_embedder

TOL = 1e-5


def st_encode(path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
    return model.encode(texts, batch_size=8, convert_to_numpy=True)


def embed(llm: LLM, prompts, params: PoolingParams | None = None) -> np.ndarray:
    return np.stack([o.outputs.data for o in llm.embed(prompts, params)])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_embedder(tmp_path_factory.mktemp("qwen3_embedder"))


@pytest.fixture(scope="module")
def texts():
    return mixed_texts()


@pytest.fixture(scope="module")
def reference(model_dir, texts):
    return st_encode(model_dir, texts)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory="16MiB",
             max_model_len=128) as llm:
        yield llm


def test_equals_sentence_transformers(llm, texts, reference):
    assert llm.engine.pooler_config.method == "last" and llm.engine.pooler_config.normalize
    lengths = {len(ids) for ids in llm.tokenizer(texts)["input_ids"]}
    assert len(lengths) > 20  # mixed lengths
    got = embed(llm, texts)
    np.testing.assert_allclose(got, reference, atol=TOL, rtol=0)
    # Outputs keep their prompts (vLLM's shape).
    out = llm.embed(texts[0])[0]
    assert out.prompt == texts[0] and out.prompt_token_ids[-1] == llm.tokenizer.eos_token_id
    assert len(out.outputs.embedding) == 64


def test_single_shuffled_and_token_ids_agree(llm, texts, reference):
    order = np.random.default_rng(0).permutation(len(texts))
    shuffled = embed(llm, [texts[i] for i in order])
    np.testing.assert_allclose(shuffled, reference[order], atol=TOL, rtol=0)
    for i in (0, 7, 19):  # one at a time
        np.testing.assert_allclose(embed(llm, texts[i])[0], reference[i], atol=TOL, rtol=0)
    ids = llm.tokenizer(texts[:4])["input_ids"]
    np.testing.assert_allclose(embed(llm, [{"prompt_token_ids": x} for x in ids]),
                               reference[:4], atol=TOL, rtol=0)


def test_texts_tokenized_in_chunks_beside_the_engine(llm, texts, reference, monkeypatch):
    """Texts join the engine chunk by chunk as a thread tokenizes them (token-id prompts at
    once): every result in prompt order; a bad text mid-way fails the call and leaves no
    request behind."""
    from pagedserve.pooling import front

    monkeypatch.setattr(front.ChunkedTokenizer, "chunk", 3)
    ids = llm.tokenizer(texts[5:7])["input_ids"]
    prompts = texts[:5] + [{"prompt_token_ids": ids[0]}, {"prompt_token_ids": ids[1]}] + \
        texts[7:]
    np.testing.assert_allclose(embed(llm, prompts), reference, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="maximum context length is 128 tokens"):
        llm.embed(texts[:8] + [" ".join(texts) * 4] + texts[8:])
    assert not llm.engine.has_unfinished_requests() and llm.engine.check_blocks_free()


def test_collector_paused_through_the_call_and_no_cycles_made(llm, texts, monkeypatch):
    """LLM.embed's steps run with the cyclic collector paused (engine/gc_heap.py), and it is
    running again after the call, a failed one too; the call leaves no reference cycles, which
    the pause would have kept alive until the next collection."""
    import gc

    embed(llm, texts)  # anything made once, on first use, is made
    enabled: list[bool] = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: enabled.append(gc.isenabled()) or step())
    assert gc.isenabled()
    got = embed(llm, texts + [{"prompt_token_ids": [5, 6, 7]}])
    assert got.shape[0] == len(texts) + 1
    assert enabled and not any(enabled) and gc.isenabled()
    with pytest.raises(ValueError, match="out of range"):
        llm.embed(texts[:3] + [[10 ** 6]])
    assert gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        embed(llm, texts)
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_tokenizing_through_the_backend_equals_the_tokenizers_call(llm, texts):
    """Without truncation, texts go straight to the fast tokenizer's backend: the same ids as
    transformers' call; a backend that truncates or pads of its own is left to that call."""
    from pagedserve.pooling.front import _plain_backend, tokenize_inputs

    tokenizer = llm.tokenizer
    want = [list(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]
    assert _plain_backend(tokenizer) is not None
    assert tokenize_inputs(tokenizer, texts) == want
    backend = tokenizer._tokenizer
    backend.enable_truncation(max_length=4)
    try:
        assert _plain_backend(tokenizer) is None
        assert tokenize_inputs(tokenizer, texts) == want  # transformers' call truncates not
    finally:
        backend.no_truncation()


def test_whole_prompts_under_a_small_token_budget(model_dir, texts, reference):
    """A step budget smaller than the batch: every prompt still runs whole, in one step (never
    a chunk), with async scheduling too; nothing is held afterwards."""
    with LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory="16MiB",
             max_model_len=128, max_num_batched_tokens=128, async_scheduling=True) as llm:
        scheduler, steps = llm.engine.scheduler, []
        schedule = scheduler.schedule
        scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
        got = embed(llm, texts)
        np.testing.assert_allclose(got, reference, atol=TOL, rtol=0)
        steps = [s for s in steps if not s.is_empty]
        assert len(steps) > 5
        for step in steps:
            assert (step.num_computed_tokens == 0).all()
            assert step.num_scheduled_tokens.tolist() == [r.num_prompt_tokens
                                                          for r in step.requests]
        assert llm.engine.check_blocks_free()
        assert not llm.engine.scheduler.has_unfinished_requests()


def test_async_steps_overlap(model_dir, texts, reference):
    """With async scheduling each pooling step is launched before the previous one's rows are
    collected (its outputs feed nothing the next step needs), so the device always has the
    next step queued while the host turns a step's rows into outputs."""
    with LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory="16MiB",
             max_model_len=128, max_num_batched_tokens=128, async_scheduling=True) as llm:
        runner, events = llm.engine.core.runner, []  # (kind, the step's PendingStep)
        launch, collect = runner.launch, runner.collect

        def launching(batch):
            events.append(("launch", launch(batch)))
            return events[-1][1]

        def collecting(pending):
            events.append(("collect", pending))
            return collect(pending)

        def at(kind, pending):
            return next(i for i, (k, p) in enumerate(events) if k == kind and p is pending)

        runner.launch, runner.collect = launching, collecting
        np.testing.assert_allclose(embed(llm, texts[:16]), reference[:16], atol=TOL, rtol=0)
        launched = [p for kind, p in events if kind == "launch"]
        assert len(launched) > 3
        for before, after in zip(launched, launched[1:], strict=False):
            assert at("launch", after) < at("collect", before)


def test_dimensions_truncate_then_normalise(llm, texts, reference):
    got = embed(llm, texts[:6], PoolingParams(dimensions=16))
    want = reference[:6, :16] / np.linalg.norm(reference[:6, :16], axis=1, keepdims=True)
    assert got.shape == (6, 16)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_too_long_input_refused_or_truncated(llm):
    ids = list(range(3, 3 + 200))
    with pytest.raises(ValueError, match="maximum context length is 128 tokens, but the input "
                                         "has 200 tokens"):
        llm.embed([ids])
    kept = embed(llm, [ids], PoolingParams(truncate_prompt_tokens=50))
    np.testing.assert_allclose(kept, embed(llm, [ids[-50:]]), atol=1e-6, rtol=0)
    whole = embed(llm, [ids], PoolingParams(truncate_prompt_tokens=-1))  # the context length
    np.testing.assert_allclose(whole, embed(llm, [ids[-128:]]), atol=1e-6, rtol=0)
    # vLLM's keyword, as classify and score take it too.
    by_keyword = np.stack([o.outputs.data for o in llm.embed([ids], truncate_prompt_tokens=50)])
    np.testing.assert_allclose(by_keyword, kept, atol=0, rtol=0)
    with pytest.raises(ValueError, match="dimensions must be between 1 and the model's "
                                         "embedding size 64, got 65"):
        llm.embed("w1", PoolingParams(dimensions=65))
    assert llm.engine.check_blocks_free()


def test_generation_refused(llm):
    with pytest.raises(ValueError, match="pooling model .* not generation"):
        llm.generate("w1 w2", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="scoring pairs needs a reranker"):
        llm.score("w1", ["w2"])


def test_generating_model_serves_no_embeddings(tmp_path):
    from tests.utils.paged import tiny_chat_model

    with LLM(str(tiny_chat_model(tmp_path / "chat")), device="cpu", dtype="float32",
             kv_cache_memory="16MiB") as llm:
        assert llm.engine.pooler_config is None
        with pytest.raises(ValueError, match="generates text: it serves no embeddings"):
            llm.embed("hello")


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_other_pooling_modes(tmp_path, texts, mode):
    path = tiny_qwen3_embedder(tmp_path / mode, pooling=mode, normalize=mode == "mean")
    reference = st_encode(path, texts)
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_memory="16MiB",
             max_model_len=128) as llm:
        assert llm.engine.pooler_config.method == mode
        np.testing.assert_allclose(embed(llm, texts), reference, atol=TOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_equals_sentence_transformers_on_cuda(tmp_path, texts, async_scheduling):
    """The device path: embeddings copied to pinned host memory behind the step, every backend
    the selector picks for the tiny model (float32, heads of 64 for CUDA's kernels)."""
    model_dir = tiny_qwen3_embedder(tmp_path, head_dim=64)
    reference = st_encode(model_dir, texts)
    with LLM(str(model_dir), device="cuda", dtype="float32", max_model_len=128,
             gpu_memory_utilization=0.05, max_num_batched_tokens=256,
             async_scheduling=async_scheduling) as llm:
        np.testing.assert_allclose(embed(llm, texts), reference, atol=1e-4, rtol=0)
        np.testing.assert_allclose(embed(llm, texts[:5], PoolingParams(dimensions=16)),
                                   reference[:5, :16] / np.linalg.norm(
                                       reference[:5, :16], axis=1, keepdims=True),
                                   atol=1e-4, rtol=0)
        assert llm.engine.check_blocks_free()
