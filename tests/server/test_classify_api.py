"""POST /classify, /rerank and the refusals over a tiny BERT cross-encoder and a BERT embedder
(encoder-only attention), the app in a thread of this process: probabilities equal
transformers' softmax, rerank scores equal CrossEncoder, and a generation request, an over-long
input or a route the model does not serve gets an OpenAI-shaped 400."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import LLMEngine
from tests.pooling.encoder_models import (
    tiny_cross_encoder,
    tiny_encoder_embedder,
    tiny_encoder_tokenizer,
)
from tests.pooling.st_model import mixed_texts
from tests.utils.server import app_in_thread

TOL = 1e-5


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """(url, texts, transformers' probabilities, label names)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_cross_encoder(tmp_path_factory.mktemp("classifier") / "m", "bert", 3)
    texts = mixed_texts(5, seed=7, longest=30)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        probs = np.stack([torch.softmax(model(**tokenizer(t, return_tensors="pt")).logits[0],
                                        -1).numpy() for t in texts])
    engine = LLMEngine.from_kwargs(model=str(path), device="cpu", dtype="float32",
                                   max_model_len=64)
    with app_in_thread(AsyncLLM(engine), "classifier") as url:
        yield url, texts, probs, [model.config.id2label[i] for i in range(3)]


def test_classify_probabilities(classifier):
    url, texts, probs, labels = classifier
    r = post(url, "/classify", {"model": "classifier", "input": texts})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    np.testing.assert_allclose([d["probs"] for d in data], probs, atol=TOL, rtol=0)
    assert [d["label"] for d in data] == [labels[i] for i in probs.argmax(1)]
    assert data[0]["num_classes"] == 3 and r.json()["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("path,body,words", [
    ("/v1/completions", {"prompt": "w1"}, "pooling model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]},
     "pooling model"),
    ("/classify", {"input": " ".join(["w1"] * 70)},
     "maximum context length is 64 tokens, but the input has 72 tokens"),
    ("/classify", {"input": [5, 10**9]}, "out of range"),
    ("/rerank", {"query": "w1", "documents": ["w2"]}, "does not score pairs"),
    ("/v1/embeddings", {"input": "w1"}, "this model is a classifier"),
])
def test_classifier_refusals(classifier, path, body, words):
    r = post(classifier[0], path, body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_truncated_text_keeps_the_tokenizers_special_tokens(classifier):
    """truncate_prompt_tokens on text truncates through the tokenizer, as vLLM and
    sentence-transformers do: [CLS], which the classifier reads, stays first (the last k ids
    were kept, so it read a word)."""
    url, texts, _, _ = classifier
    long_text = " ".join(texts)
    r = post(url, "/classify", {"input": long_text, "truncate_prompt_tokens": 6})
    assert r.status_code == 200, r.text
    ids = tiny_encoder_tokenizer("bert")(long_text, truncation=True, max_length=6)["input_ids"]
    assert ids[0] == 2 and len(ids) == 6  # [CLS] first
    by_ids = post(url, "/classify", {"input": ids})
    assert r.json()["usage"]["prompt_tokens"] == 6
    np.testing.assert_allclose(r.json()["data"][0]["probs"], by_ids.json()["data"][0]["probs"],
                               atol=TOL, rtol=0)


def test_truncation_below_the_special_tokens_is_a_400(classifier):
    """k at or below [CLS] + [SEP]: the tokenizer would not truncate at all (it logs an error),
    so the request is refused rather than cut to its last k ids."""
    url, texts, _, _ = classifier
    for k in (1, 2):
        r = post(url, "/classify", {"input": " ".join(texts), "truncate_prompt_tokens": k})
        assert r.status_code == 400, r.text
        assert "leaves no room for text" in r.json()["error"]["message"]
    r = post(url, "/classify", {"input": " ".join(texts), "truncate_prompt_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


def test_rerank_with_a_bert_cross_encoder(tmp_path):
    from sentence_transformers import CrossEncoder

    path = tiny_cross_encoder(tmp_path / "ce", "bert")
    documents = mixed_texts(5, seed=8, longest=20)
    reference = CrossEncoder(str(path), device="cpu", local_files_only=True).predict(
        [("w4 w5", d) for d in documents], convert_to_numpy=True)
    # Truncated as CrossEncoder truncates: the longer text first, both segments kept.
    truncated = CrossEncoder(str(path), device="cpu", local_files_only=True,
                             max_length=9).predict([("w4 w5", d) for d in documents],
                                                   convert_to_numpy=True)
    engine = LLMEngine.from_kwargs(model=str(path), device="cpu", dtype="float32")
    with app_in_thread(AsyncLLM(engine), "ce") as url:
        r = post(url, "/rerank", {"query": "w4 w5", "documents": documents})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == np.argsort(-reference).tolist()
        np.testing.assert_allclose([x["relevance_score"] for x in results],
                                   np.sort(reference)[::-1], atol=TOL, rtol=0)
        r = post(url, "/rerank", {"query": "w4 w5", "documents": documents,
                                  "truncate_prompt_tokens": 9})
        assert r.status_code == 200, r.text
        results = sorted(r.json()["results"], key=lambda x: x["index"])
        np.testing.assert_allclose([x["relevance_score"] for x in results], truncated,
                                   atol=TOL, rtol=0)
        r = post(url, "/classify", {"input": "w1"})  # one label: the sigmoid
        assert r.status_code == 200 and r.json()["data"][0]["num_classes"] == 1


def test_embedder_refuses_generation_and_classify(tmp_path):
    path = tiny_encoder_embedder(tmp_path / "bert", "bert")
    engine = LLMEngine.from_kwargs(model=str(path), device="cpu", dtype="float32")
    with app_in_thread(AsyncLLM(engine), "bert") as url:
        r = post(url, "/v1/completions", {"prompt": "w1", "max_tokens": 2})
        assert r.status_code == 400 and "pooling model" in r.json()["error"]["message"]
        r = post(url, "/classify", {"input": "w1"})
        assert r.status_code == 400 and "does not classify" in r.json()["error"]["message"]
        r = post(url, "/v1/embeddings", {"input": ["w1 w2", "w3"]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2
