"""Encoder classifiers and cross-encoders (`BertForSequenceClassification`,
`XLMRobertaForSequenceClassification`): LLM.score equals sentence-transformers' CrossEncoder
(BERT's pair segments included), LLM.classify's logits and probabilities equal transformers'
own model, and each refuses what it does not serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import LLM
from tests.pooling.encoder_models import tiny_cross_encoder
from tests.pooling.st_model import mixed_texts

TOL = 1e-5
QUERY = "w10 w11 w12"


def open_llm(path):
    return LLM(str(path), device="cpu", dtype="float32")


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_scores_equal_cross_encoder(tmp_path, family):
    from sentence_transformers import CrossEncoder

    path = tiny_cross_encoder(tmp_path / family, family)
    documents = mixed_texts(12, seed=3, longest=40)
    pairs = [(QUERY, d) for d in documents]
    reference = CrossEncoder(str(path), device="cpu", local_files_only=True).predict(
        pairs, convert_to_numpy=True, batch_size=4)
    with open_llm(path) as llm:
        assert llm.engine.pooler_config.scores_pairs
        got = np.array([o.outputs.score for o in llm.score(QUERY, documents)])
        np.testing.assert_allclose(got, reference, atol=TOL, rtol=0)
        pairwise = llm.score([QUERY] * 3, documents[:3])
        np.testing.assert_allclose([o.outputs.score for o in pairwise], reference[:3],
                                   atol=TOL, rtol=0)
        if family == "bert":  # the document's segment matters: a BERT pair has two
            types = llm.tokenizer(QUERY, documents[0])["token_type_ids"]
            assert 1 in types
        with pytest.raises(ValueError, match="scores pairs"):
            llm.embed("w1 w2")


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "modernbert"])
def test_classify_equals_transformers(tmp_path, family):
    from transformers import AutoModelForSequenceClassification

    path = tiny_cross_encoder(tmp_path / family, family, num_labels=3)
    texts = mixed_texts(10, seed=5, longest=50)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, attn_implementation="eager").eval()
    with open_llm(path) as llm:
        reference = []
        for text in texts:  # one at a time: no padding in the reference
            enc = llm.tokenizer(text, return_tensors="pt")
            with torch.no_grad():
                reference.append(model(**enc).logits[0].numpy())
        reference = np.stack(reference)
        outputs = llm.classify(texts)
        logits = np.stack([o.outputs.logits for o in outputs])
        np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)
        probs = np.stack([o.outputs.probs for o in outputs])
        np.testing.assert_allclose(probs, torch.softmax(torch.tensor(reference), -1).numpy(),
                                   atol=TOL, rtol=0)
        assert outputs[0].outputs.num_classes == 3
        kept = llm.classify(texts[0], truncate_prompt_tokens=3)[0]
        ids = kept.prompt_token_ids
        assert len(ids) == 3 and ids[0] == llm.get_tokenizer().cls_token_id  # [CLS] kept
        with pytest.raises(ValueError, match="leaves no room for text"):
            llm.classify(texts[0], truncate_prompt_tokens=2)  # [CLS] [SEP] alone
        with pytest.raises(ValueError, match="classifies into 3 labels"):
            llm.score(QUERY, texts[:2])


@pytest.mark.gpu
def test_cross_encoder_on_cuda(tmp_path):
    """bf16 on CUDA (the automatic backend's encoder path) against CrossEncoder in float32."""
    from sentence_transformers import CrossEncoder

    path = tiny_cross_encoder(tmp_path / "ce", "xlm-roberta", heads=1)  # head size 64
    documents = mixed_texts(12, seed=3, longest=40)
    reference = CrossEncoder(str(path), device="cpu", local_files_only=True).predict(
        [(QUERY, d) for d in documents], convert_to_numpy=True)
    with LLM(str(path), device="cuda", dtype="bfloat16") as llm:
        got = np.array([o.outputs.score for o in llm.score(QUERY, documents)])
    np.testing.assert_allclose(got, reference, atol=2e-2, rtol=0)
