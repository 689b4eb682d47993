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


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_fused_encoder_path(tmp_path, family, monkeypatch):
    """The fused path of a 16-bit CUDA step, on the CPU in float32: the MLP's first projection
    and GELU as one torch._addmm_activation (asked for an erf model with
    PAGEDSERVE_APPROXIMATE_GELU; exact GELU on the CPU, cuBLASLt's tanh form on CUDA). The
    embeddings equal sentence-transformers' as the torch path's do."""
    from pagedserve.models import bert

    monkeypatch.setenv("PAGEDSERVE_APPROXIMATE_GELU", "1")
    path = tiny_encoder_embedder(tmp_path / family, family, "cls")
    texts = mixed_texts(5, seed=3, longest=30)
    reference = st_encode(path, texts)
    calls = {"epilogue": 0}

    def epilogue(x):
        calls["epilogue"] += 1
        return True

    monkeypatch.setattr(bert, "epilogue_runs", epilogue)
    with open_llm(path) as llm:
        calls.update(epilogue=0)  # start-up's dummy forwards
        np.testing.assert_allclose(embed(llm, texts), reference, atol=TOL, rtol=0)
        layers = llm.engine.runner.model.config.num_hidden_layers
        steps = calls["epilogue"] // layers
        assert steps >= 1 and calls["epilogue"] == steps * layers


def test_gelu_epilogue_choice(monkeypatch):
    """The tanh GELUs always take the epilogue; the erf GELU only with
    PAGEDSERVE_APPROXIMATE_GELU; any other activation never."""
    from transformers import BertConfig

    from pagedserve.models.bert import gelu_in_epilogue

    monkeypatch.delenv("PAGEDSERVE_APPROXIMATE_GELU", raising=False)
    chosen = {act: gelu_in_epilogue(BertConfig(hidden_act=act))
              for act in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")}
    assert chosen == {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "relu": False}
    monkeypatch.setenv("PAGEDSERVE_APPROXIMATE_GELU", "1")
    assert gelu_in_epilogue(BertConfig(hidden_act="gelu"))
    assert not gelu_in_epilogue(BertConfig(hidden_act="relu"))


@pytest.mark.gpu
def test_gelu_epilogue_on_cuda():
    """On CUDA in bf16 the epilogue is the tanh GELU of the float32 sums, rounded once: within
    one bf16 rounding step of eager's erf GELU of the rounded GEMM output."""
    import torch
    from transformers import BertConfig

    from pagedserve.models.bert import BertLayer

    torch.manual_seed(0)
    config = BertConfig(hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                        hidden_act="gelu_pytorch_tanh")
    layer = BertLayer(config, 0).to("cuda", torch.bfloat16)
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    assert layer.gelu_epilogue
    with torch.no_grad():
        got = layer.mlp_in(x)
        tanh = torch.nn.functional.gelu(x.float() @ layer.intermediate.weight.float().t()
                                        + layer.intermediate.bias.float(), approximate="tanh")
        eager = layer.act(layer.intermediate(x))
    torch.testing.assert_close(got.float(), tanh, rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(got, eager, rtol=2 ** -6, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("exact_gelu", [False, True])
def test_bert_on_cuda(tmp_path, texts, exact_gelu, monkeypatch):
    """bf16 on CUDA (the erf GELU, or the tanh one in the GEMM's epilogue with
    PAGEDSERVE_APPROXIMATE_GELU) against sentence-transformers in float32 on the CPU."""
    if not exact_gelu:
        monkeypatch.setenv("PAGEDSERVE_APPROXIMATE_GELU", "1")
    path = tiny_encoder_embedder(tmp_path / "bert", "bert", "cls", heads=1)  # head size 64
    reference = st_encode(path, texts)
    with LLM(str(path), device="cuda", dtype="bfloat16") as llm:
        layer = llm.engine.runner.model.layers[0]
        assert layer.gelu_epilogue != exact_gelu
        got = embed(llm, texts)
    np.testing.assert_allclose(got, reference, atol=2e-2, rtol=0)
