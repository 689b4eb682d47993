"""A causal cross-encoder (Qwen3-Reranker's form: Transformer + LogitScore over "yes"/"no"),
saved by sentence-transformers' CrossEncoder: LLM.score's pair scores equal
CrossEncoder.predict on pairs of mixed lengths, and what a reranker does not do is refused."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve import LLM
from pagedserve.pooling import PoolingParams
from tests.pooling.st_model import mixed_texts, tiny_qwen3_reranker

TOL = 1e-5


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return tiny_qwen3_reranker(tmp_path_factory.mktemp("reranker") / "model")


@pytest.fixture(scope="module")
def pairs():
    queries, documents = mixed_texts(16, seed=2, longest=20), mixed_texts(16, seed=3)
    return list(zip(queries, documents, strict=True))


@pytest.fixture(scope="module")
def reference(reranker_dir, pairs):
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(reranker_dir), device="cpu", local_files_only=True)
    return model.predict(pairs, batch_size=8, convert_to_numpy=True)


@pytest.fixture(scope="module")
def llm(reranker_dir):
    with LLM(str(reranker_dir), device="cpu", dtype="float32", kv_cache_memory="16MiB",
             max_model_len=128) as llm:
        yield llm


def test_scores_equal_cross_encoder(llm, pairs, reference):
    pooler = llm.engine.pooler_config
    assert pooler.task == "score" and pooler.activation == "sigmoid"
    outs = llm.score([q for q, _ in pairs], [d for _, d in pairs])
    np.testing.assert_allclose([o.outputs.score for o in outs], reference, atol=TOL, rtol=0)
    # One query against several documents; one pair at a time.
    query = pairs[0][0]
    docs = [d for _, d in pairs[:4]]
    many = [o.outputs.score for o in llm.score(query, docs)]
    single = [llm.score(query, d)[0].outputs.score for d in docs]
    np.testing.assert_allclose(many, single, atol=1e-6, rtol=0)
    np.testing.assert_allclose(many[0], reference[0], atol=TOL, rtol=0)


def test_reranker_refusals(llm):
    with pytest.raises(ValueError, match="this model is a reranker"):
        llm.embed("w1")
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(["w1", "w2"], ["w3", "w4", "w5"])
    with pytest.raises(ValueError, match="dimensions applies to embeddings"):
        llm.engine.add_pooling_request("x", [3, 4], PoolingParams(dimensions=4))
    assert llm.engine.check_blocks_free()


def test_template_without_pair_roles_refused(llm):
    tokenizer = llm.engine.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}"
                               "{{ m['content'] }}{% endif %}{% endfor %}")
    try:
        with pytest.raises(ValueError, match="does not render the 'query' and 'document'"):
            llm.score("w1", "w2")
    finally:
        tokenizer.chat_template = saved


def test_truncation_cuts_the_document_then_the_query(llm):
    """truncate_prompt_tokens on a templated pair cuts the document's end (then the query's):
    the template's prefix and suffix and the query stay, and the score is the score of the
    pair built from the truncated document (keeping the rendered prompt's last k tokens
    dropped the instruction and the query)."""
    from pagedserve.pooling.scoring import pair_token_ids

    tokenizer = llm.engine.tokenizer
    query, document = "w10 w11 w12", " ".join(f"w{i}" for i in range(20, 80))

    def render(q: str, d: str) -> list[int]:
        return pair_token_ids(tokenizer, [(q, d)])[0]

    full = render(query, document)
    prefix, suffix = render(query, "")[:-1], render(query, "")[-1:]  # "w1 q w2", "w3"
    assert len(full) == len(prefix) + 60 + len(suffix)
    k = 20
    kept = " ".join(document.split()[:k - len(prefix) - len(suffix)])
    out = llm.score(query, document, truncate_prompt_tokens=k)[0]
    assert out.prompt_token_ids == render(query, kept)
    assert len(out.prompt_token_ids) == k
    assert out.prompt_token_ids[:len(prefix)] == prefix
    assert out.prompt_token_ids[-1:] == suffix
    np.testing.assert_allclose(out.outputs.score, llm.score(query, kept)[0].outputs.score,
                               atol=1e-6, rtol=0)
    # -1: the context length (128), a pair over it fits by its document.
    long_document = " ".join(f"w{i}" for i in range(20, 220))
    out = llm.score(query, long_document, truncate_prompt_tokens=-1)[0]
    assert len(out.prompt_token_ids) == 128 and out.prompt_token_ids[:len(prefix)] == prefix
    # The document alone cannot make it fit: it goes, then the query's end.
    out = llm.score(query, document, truncate_prompt_tokens=4)[0]
    assert out.prompt_token_ids == render("w10", "")
    with pytest.raises(ValueError, match="template takes 3 tokens"):
        llm.score(query, document, truncate_prompt_tokens=2)
    assert llm.engine.check_blocks_free()
