"""Stop strings on a model served without a tokenizer: the text they would be found in is never
made, so they were silently never matched. A request giving them is refused with a 400 naming
`stop` and the way out (--tokenizer DIR), before the engine; stop_token_ids still stop it."""

from __future__ import annotations

import httpx
import pytest

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import STOP_NEEDS_TOKENIZER, LLMEngine
from tests.utils.server import app_in_thread


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine.from_kwargs(model="random:tiny", device="cpu", dtype="float32",
                                   kv_cache_memory="8MiB")
    llm = AsyncLLM(engine)
    with app_in_thread(llm, "tiny") as url:
        yield url, llm


def test_stop_strings_are_refused_before_the_engine(served, monkeypatch):
    url, llm = served
    queued = []
    original = AsyncLLM.add_request

    async def counting(self, *args, **kwargs):
        queued.append(args[0])
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(AsyncLLM, "add_request", counting)
    for stop in (["w"], "w"):
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": [5, 6, 7], "max_tokens": 4, "stop": stop})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"] == STOP_NEEDS_TOKENIZER
        assert (error["param"], error["type"]) == ("stop", "invalid_request_error")
        assert "--tokenizer DIR" in error["message"]
    assert queued == []
    # Stop token ids need no text: they still end the sequence.
    greedy = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = httpx.post(url + "/v1/completions", json=greedy, timeout=60).json()
    token = first["choices"][0]["token_ids"][2]
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={**greedy, "stop_token_ids": [token]})
    assert r.status_code == 200, r.text
    choice, free = r.json()["choices"][0], first["choices"][0]["token_ids"]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == free[:free.index(token) + 1]
    assert len(queued) == 2  # the two greedy requests only
