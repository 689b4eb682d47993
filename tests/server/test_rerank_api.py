"""POST /score, /rerank and /v1/rerank over a tiny reranker (Qwen3-Reranker's form, saved by
sentence-transformers' CrossEncoder), the app in a thread of this process: scores equal
CrossEncoder.predict, results come best first in Jina's and Cohere's shape, and the routes a
reranker does not serve answer OpenAI-shaped 400s."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import LLMEngine
from tests.pooling.st_model import mixed_texts, tiny_qwen3_reranker
from tests.utils.server import app_in_thread

TOL = 1e-5
QUERY = "w10 w11 w12"


@pytest.fixture(scope="module")
def documents():
    return mixed_texts(6, seed=4, longest=30)


@pytest.fixture(scope="module")
def served(tmp_path_factory, documents):
    """(url, CrossEncoder's scores of QUERY against `documents`)."""
    from sentence_transformers import CrossEncoder

    path = tiny_qwen3_reranker(tmp_path_factory.mktemp("reranker") / "model")
    reference = CrossEncoder(str(path), device="cpu", local_files_only=True).predict(
        [(QUERY, d) for d in documents], convert_to_numpy=True)
    engine = LLMEngine.from_kwargs(model=str(path), device="cpu", dtype="float32",
                                   kv_cache_memory="16MiB", max_model_len=128)
    with app_in_thread(AsyncLLM(engine), "reranker") as url:
        yield url, reference


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_rerank_best_first(served, documents):
    url, reference = served
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):  # vLLM's paths
        r = post(url, path, {"model": "reranker", "query": QUERY, "documents": documents,
                             "top_n": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        order = np.argsort(-reference)[:3].tolist()
        assert [x["index"] for x in body["results"]] == order
        np.testing.assert_allclose([x["relevance_score"] for x in body["results"]],
                                   reference[order], atol=TOL, rtol=0)
        assert [x["document"]["text"] for x in body["results"]] == [documents[i]
                                                                   for i in order]
        assert body["usage"]["total_tokens"] > 0
    bare = post(url, "/rerank", {"query": QUERY, "documents": documents[:2],
                                 "return_documents": False}).json()
    assert len(bare["results"]) == 2 and "document" not in bare["results"][0]


def test_an_over_long_pair_names_the_documents(served):
    """The 400 named `input`, a field these routes do not have."""
    long_doc = " ".join(["w1"] * 200)
    for path, body, param in [
            ("/rerank", {"query": QUERY, "documents": ["w2", long_doc]}, "documents"),
            ("/score", {"text_1": QUERY, "text_2": ["w2", long_doc]}, "text_2"),
            ("/score", {"queries": QUERY, "documents": ["w2", long_doc]}, "documents")]:
        r = post(served[0], path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"].startswith("pair 1: this model's maximum context length")
        assert (error["param"], error["code"]) == (param, "context_length_exceeded")


def test_truncation_keeps_the_template_and_the_query(served):
    """truncate_prompt_tokens cuts a templated pair's document, not its instruction and
    query: the score is the truncated document's (the rendered prompt's last k were kept)."""
    document = " ".join(f"w{i}" for i in range(20, 80))
    overhead = 3 + len(QUERY.split())  # "w1 <query> w2 <document> w3"
    kept = " ".join(document.split()[:20 - overhead])
    r = post(served[0], "/rerank", {"query": QUERY, "documents": [document],
                                    "truncate_prompt_tokens": 20})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20
    direct = post(served[0], "/rerank", {"query": QUERY, "documents": [kept]}).json()
    assert direct["usage"]["prompt_tokens"] == 20
    np.testing.assert_allclose(r.json()["results"][0]["relevance_score"],
                               direct["results"][0]["relevance_score"], atol=1e-6, rtol=0)


def test_top_n_zero_is_every_document(served, documents):
    """vLLM's default top_n is 0, read as all of them (a client that sends it gets them)."""
    url, reference = served
    r = post(url, "/v1/rerank", {"query": QUERY, "documents": documents, "top_n": 0})
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()["results"]] == np.argsort(-reference).tolist()


def test_score_both_shapes(served, documents):
    url, reference = served
    for path, body in (("/score", {"text_1": QUERY, "text_2": documents}),
                       ("/v1/score", {"queries": [QUERY] * len(documents),
                                      "documents": documents})):
        r = post(url, path, body)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["index"] for d in data] == list(range(len(documents)))
        np.testing.assert_allclose([d["score"] for d in data], reference, atol=TOL, rtol=0)


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/score", {"text_1": "w1", "text_2": "w2", "queries": "w1", "documents": "w2"},
     "text_1 and text_2, or queries and documents"),
    ("/score", {"text_1": ["w1", "w2"], "text_2": ["w3", "w4", "w5"]},
     "text_1 has 2 texts and text_2 3"),
    ("/rerank", {"query": "w1", "documents": []}, "documents is empty"),
    ("/v1/embeddings", {"input": "w1"}, "this model is a reranker"),
    ("/v1/completions", {"prompt": "w1"}, "pooling model"),
])
def test_refusals(served, path, body, words):
    r = post(served[0], path, body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
