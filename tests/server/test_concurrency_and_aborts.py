"""64 concurrent streams batch and match the offline text; a client that disconnects aborts
its request; every KV block comes back."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.openai_server import GREEDY, MODEL, PROMPTS, assert_all_blocks_free, post
from tests.utils.server import read_metrics, wait_for_metrics

# The core-process variants run with `-m slow` only (see test_completions_api.py).
CORE_PROCESS_SLOW = {
    "test_64_concurrent_streams_batch_and_free_all_blocks",
    "test_client_disconnect_aborts_and_frees_blocks", "test_bench_serve_runs_against_both",
}

def test_64_concurrent_streams_batch_and_free_all_blocks(any_server, ref):
    server = any_server
    lengths = [2, 4, 6, 8]
    jobs = [(i, k) for k in lengths for i in range(len(PROMPTS))]
    assert len(jobs) == 64
    seen_running = []

    async def one(client: httpx.AsyncClient, i: int, k: int) -> tuple[str, dict]:
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": k, "stream": True,
                "stream_options": {"include_usage": True}, **GREEDY}
        text, usage = "", None
        async with client.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                else:
                    usage = chunk["usage"]
        return text, usage

    async def sample_metrics(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            text = (await client.get(server.url + "/metrics")).text
            for line in text.splitlines():
                if line.startswith("pagedserve:num_requests_running "):
                    seen_running.append(float(line.split()[-1]))
            await asyncio.sleep(0.05)

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_metrics(client, stop))
            results = await asyncio.gather(*(one(client, i, k) for i, k in jobs))
            stop.set()
            await sampler
            return results

    results = asyncio.run(main())
    for (i, k), (text, usage) in zip(jobs, results, strict=True):
        assert text == ref.texts[i][k], (PROMPTS[i], k)
        assert usage["completion_tokens"] == k
        assert usage["prompt_tokens"] == ref.prompt_lens[i]
    m = assert_all_blocks_free(server.url)
    assert m["pagedserve:max_num_requests_running"] > 1
    assert max(seen_running) > 1, seen_running


def test_client_disconnect_aborts_and_frees_blocks(any_server, ref):
    server = any_server
    before = read_metrics(server.url)
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 4000, "stream": True,
            **GREEDY}
    with httpx.Client(timeout=600) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            received = 0
            for line in resp.iter_lines():
                received += line.startswith("data: ")
                if received == 3:
                    break
    # The client is gone: the engine must drop the request and free its blocks.
    aborted = "pagedserve:num_aborted_requests_total"
    m = wait_for_metrics(server.url, lambda m: m[aborted] == before[aborted] + 1, timeout=60)
    assert m[aborted] == before[aborted] + 1
    # A non-streamed request whose client gives up is aborted too.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=2)
    m = wait_for_metrics(server.url, lambda m: m[aborted] == before[aborted] + 2, timeout=60)
    assert m[aborted] == before[aborted] + 2
    m = assert_all_blocks_free(server.url)
    generated = (m["pagedserve:generation_tokens_total"]
                 - before["pagedserve:generation_tokens_total"])
    assert generated < 4000
    resp = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, **GREEDY})
    assert resp.json()["choices"][0]["text"] == ref.texts[0][4]


def test_bench_serve_runs_against_both(any_server, capsys):
    from pagedserve.cli import main

    rc = main(["bench", "serve", "--url", any_server.url, "--num-prompts", "4",
               "--input-len", "8", "--output-len", "4", "--max-concurrency", "2"])
    assert rc == 0, capsys.readouterr()
    assert_all_blocks_free(any_server.url)
