"""POST /v1/embeddings on a served tiny Qwen3 embedder (its engine core in a process of its own,
so pooling requests and embeddings cross the core's socket): the official openai client's
embeddings.create, base64 (its default) and float, equals sentence-transformers; dimensions,
token-id inputs, usage; and OpenAI-shaped 400s for what the model does not do."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.pooling.st_model import mixed_texts, tiny_qwen3_embedder
from tests.pooling.test_embed import TOL, st_encode
from tests.utils.server import ServerProcess

MODEL = "tiny-embedder"


@pytest.fixture(scope="module")
def texts():
    return mixed_texts(16, seed=1)


@pytest.fixture(scope="module")
def served(tmp_path_factory, texts):
    """(server, sentence-transformers' embeddings of `texts`), the reference computed while
    the server starts."""
    path = tiny_qwen3_embedder(tmp_path_factory.mktemp("embedder"))
    server = ServerProcess(["--model", str(path), "--device", "cpu", "--dtype", "float32",
                            "--kv-cache-memory", "16MiB", "--max-model-len", "128",
                            "--served-model-name", MODEL, "--engine-core-process"],
                           tmp_path_factory.mktemp("embedder_log") / "server.log", wait=False)
    yield server, server.healthy_after(lambda: st_encode(path, texts))
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)])


def test_openai_client_base64_and_float(served, client, texts):
    _, reference = served
    default = client.embeddings.create(model=MODEL, input=texts)  # base64 on the wire
    np.testing.assert_allclose(vectors(default), reference, atol=TOL, rtol=0)
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    np.testing.assert_allclose(vectors(floats), vectors(default), atol=0, rtol=0)
    num_tokens = sum(len(t.split()) + 1 for t in texts)  # each word a token, plus the end
    assert default.usage.prompt_tokens == default.usage.total_tokens == num_tokens
    assert default.model == MODEL and [d.index for d in default.data] == list(range(16))


def test_dimensions_and_token_ids(served, client, texts):
    _, reference = served
    short = client.embeddings.create(model=MODEL, input=texts[:3], dimensions=8)
    want = reference[:3, :8] / np.linalg.norm(reference[:3, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(vectors(short), want, atol=TOL, rtol=0)
    ids = [[int(w[1:]) + 3 for w in t.split()] + [2] for t in texts[:2]]  # st_model's vocab
    by_ids = client.embeddings.create(model=MODEL, input=ids)
    np.testing.assert_allclose(vectors(by_ids), reference[:2], atol=TOL, rtol=0)
    one = client.embeddings.create(model=MODEL, input=ids[0])
    np.testing.assert_allclose(vectors(one), reference[:1], atol=TOL, rtol=0)


def test_tokenize_counts_what_embeddings_feed(served, client, texts):
    """/tokenize on a pooling model adds the special tokens its inputs get (the end token
    last-token pooling reads), so its count is the usage of /v1/embeddings."""
    server, _ = served
    usage = client.embeddings.create(model=MODEL, input=texts[0]).usage.prompt_tokens
    r = httpx.post(server.url + "/tokenize", json={"prompt": texts[0]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == usage and r.json()["tokens"][-1] == 2  # st_model's end token
    bare = httpx.post(server.url + "/tokenize", json={"prompt": texts[0],
                                                      "add_special_tokens": False}, timeout=60)
    assert bare.json()["count"] == usage - 1


def test_errors_in_openai_shape(served, client):
    server, _ = served
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=MODEL, input=[list(range(3, 203))])
    error = exc.value.body
    assert "maximum context length is 128 tokens, but the input has 200 tokens" in \
        error["message"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    with pytest.raises(openai.BadRequestError) as exc:  # which of several is too long
        client.embeddings.create(model=MODEL, input=[[3, 4], list(range(3, 203))])
    assert exc.value.body["message"].startswith("input 1: this model's maximum context length")
    assert exc.value.body["code"] == "context_length_exceeded"
    kept = client.embeddings.create(model=MODEL, input=[list(range(3, 203))],
                                    extra_body={"truncate_prompt_tokens": 100})
    assert len(kept.data) == 1 and kept.usage.prompt_tokens == 100
    with pytest.raises(openai.BadRequestError, match="dimensions must be between 1 and the "
                                                     "model's embedding size 64, got 100"):
        client.embeddings.create(model=MODEL, input="w1", dimensions=100)
    with pytest.raises(openai.BadRequestError, match="token id 999 is out of range"):
        client.embeddings.create(model=MODEL, input=[[3, 999]])
    for path, body in [("/v1/completions", {"prompt": "w1", "max_tokens": 2}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "w1"}]})]:
        r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, r.text
        assert "pooling model" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": []},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(server.url + "/rerank", json={"query": "w1", "documents": ["w2"]},
                   timeout=60)
    assert r.status_code == 400 and "does not score pairs" in r.json()["error"]["message"]
    # Nothing is left running or holding blocks; the server still answers.
    assert client.embeddings.create(model=MODEL, input="w5 w6").data


def test_a_batch_larger_than_the_queue_is_a_400_not_a_503():
    """Every input of a batch is queued at once: one of more inputs than
    --max-waiting-requests could never be admitted, yet was a 503 saying "try again later"
    (a client that retries 503s retried for ever)."""
    import asyncio
    from types import SimpleNamespace

    from pagedserve.pooling import PoolingParams
    from pagedserve.server.common import ApiError
    from pagedserve.server.embeddings import add_pooling_requests

    async def never(*args, **kwargs):
        raise AssertionError("nothing is queued")

    state = SimpleNamespace(llm=SimpleNamespace(max_waiting_requests=3, add_request=never))
    prompts = [(None, [1, 2])] * 4
    with pytest.raises(ApiError) as refused:
        asyncio.run(add_pooling_requests(state, "embd-1", prompts, PoolingParams()))
    assert refused.value.status == 400 and refused.value.body.error.param == "input"
    assert "4 inputs, more than the 3 the server queues at once (--max-waiting-requests)" \
        in refused.value.body.error.message
