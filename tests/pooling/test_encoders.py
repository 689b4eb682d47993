"""BERT and XLM-RoBERTa encoders (encoder-only attention, no KV cache) through LLM.embed: equal
to sentence-transformers' own embeddings (float32, CPU) on 32 inputs of mixed lengths, CLS and
mean pooling, normalised or not; batched, single and shuffled inputs agree; over-long inputs
and generation are refused with the numbers."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.pooling import PoolingParams
from tests.pooling.encoder_models import tiny_encoder_embedder
from tests.pooling.st_model import mixed_texts

TOL = 1e-5


def st_encode(path, texts):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
    return model.encode(texts, batch_size=8, convert_to_numpy=True)


def embed(llm, prompts, params=None):
    return np.stack([o.outputs.data for o in llm.embed(prompts, params)])


def open_llm(path, **kwargs):
    return LLM(str(path), device="cpu", dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def texts():
    return mixed_texts(longest=100)


@pytest.mark.parametrize("family,pooling,normalize", [
    ("bert", "cls", True), ("bert", "mean", False), ("xlm-roberta", "mean", True),
    ("xlm-roberta", "cls", False), ("modernbert", "mean", True)])
def test_equals_sentence_transformers(tmp_path, texts, family, pooling, normalize):
    path = tiny_encoder_embedder(tmp_path / family, family, pooling, normalize)
    reference = st_encode(path, texts)
    with open_llm(path) as llm:
        engine = llm.engine
        assert engine.pooler_config.method == pooling
        assert engine.pooler_config.normalize == normalize
        assert engine.runner.encoder_only and engine.kv_cache.num_blocks == 0
        assert engine.runner.kv_caches == []  # no KV cache at all
        lengths = {len(ids) for ids in llm.tokenizer(texts)["input_ids"]}
        assert len(lengths) > 20
        got = embed(llm, texts)
        np.testing.assert_allclose(got, reference, atol=TOL, rtol=0)
        order = np.random.default_rng(0).permutation(len(texts))
        np.testing.assert_allclose(embed(llm, [texts[i] for i in order]), reference[order],
                                   atol=TOL, rtol=0)
        for i in (0, 5):
            np.testing.assert_allclose(embed(llm, texts[i])[0], reference[i], atol=TOL, rtol=0)


def test_small_token_budget_and_refusals(tmp_path, texts):
    path = tiny_encoder_embedder(tmp_path / "bert", "bert")
    reference = st_encode(path, texts)
    with open_llm(path, max_num_batched_tokens=128, max_model_len=128) as llm:
        steps = []
        schedule = llm.engine.scheduler.schedule

        def recording():
            out = schedule()
            steps.append(out.num_scheduled_tokens.sum())
            # Never a chunk: every request in the step runs its whole prompt.
            assert all(n == r.num_prompt_tokens
                       for n, r in zip(out.num_scheduled_tokens, out.requests, strict=True))
            return out

        llm.engine.scheduler.schedule = recording
        np.testing.assert_allclose(embed(llm, texts), reference, atol=TOL, rtol=0)
        assert len(steps) > 3 and max(steps) <= 128
        llm.engine.scheduler.schedule = schedule
        long_text = " ".join(["w1"] * 200)
        with pytest.raises(ValueError, match="maximum context length is 128 tokens, but the "
                                             "input has 202 tokens"):
            llm.embed(long_text)
        kept = llm.embed(long_text, PoolingParams(truncate_prompt_tokens=100))[0]
        assert len(kept.prompt_token_ids) == 100
        with pytest.raises(ValueError, match="pooling model"):
            llm.generate(["w1 w2"], SamplingParams(max_tokens=2))


def test_runner_generate_refused(tmp_path):
    path = tiny_encoder_embedder(tmp_path / "bert", "bert")
    with pytest.raises(ValueError, match="cannot generate"):
        open_llm(path, runner="generate")


@pytest.mark.parametrize("backend", ["TRITON", "FLEX_ATTENTION"])
def test_other_backends_through_the_engine(tmp_path, backend):
    """The same embeddings with the encoder layers on TRITON (Triton's interpreter) and
    FLEX_ATTENTION (eager) as on the CPU backend's reference."""
    path = tiny_encoder_embedder(tmp_path / "bert", "bert", "mean", heads=1)  # head size 64
    texts = mixed_texts(6, seed=2, longest=40)
    reference = st_encode(path, texts)
    with open_llm(path, attention_backend=backend) as llm:
        assert llm.engine.runner.backend.get_name() == backend
        np.testing.assert_allclose(embed(llm, texts), reference, atol=TOL, rtol=0)
