"""`pagedserve bench serve`'s streaming client: SSE lines end at \\n only (text may hold U+2028
and friends), and the first chunk that carries tokens, text or token ids, sets TTFT; a model
without a tokenizer streams a chunk per step with its token ids."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pagedserve.bench import _one_request, run_serve, sse_data
from tests.utils.server import ServerProcess, free_port

# Characters str.splitlines() breaks at that JSON does not escape.
LINE_BREAKERS = "\u2028\u2029\x85\x1c\x1d\x1e\x0b\x0c"


def _chunk(text: str, finish: str | None = None, usage: dict | None = None) -> str:
    body = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "stub",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        body["choices"], body["usage"] = [], usage
    return "data: " + json.dumps(body, ensure_ascii=False) + "\r\n\r\n"


def _stub_app(pieces: list[str], gap_s: float) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def body():
            for i, piece in enumerate(pieces):
                await asyncio.sleep(gap_s)
                yield _chunk(piece, "length" if i == len(pieces) - 1 else None)
            yield _chunk("", usage={"prompt_tokens": 4, "completion_tokens": len(pieces),
                                    "total_tokens": 4 + len(pieces)})
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    return app


@pytest.fixture
def stub_server():
    servers = []

    def start(pieces: list[str], gap_s: float = 0.0) -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(_stub_app(pieces, gap_s), host="127.0.0.1",
                                               port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def _args(url: str, **overrides) -> SimpleNamespace:
    args = dict(url=url, model=None, api_key=None, num_prompts=3, input_len=4, output_len=4,
                request_rate=float("inf"), max_concurrency=None, vocab_size=100,
                ignore_eos=True, seed=0, timeout=30.0)
    return SimpleNamespace(**{**args, **overrides})


def test_sse_lines_split_only_at_newlines(stub_server) -> None:
    pieces = [f"a{c}b" for c in LINE_BREAKERS]
    summary = asyncio.run(run_serve(_args(stub_server(pieces), output_len=len(pieces))))
    assert summary["failed"] == 0, summary["first_error"]
    assert summary["total_output_tokens"] == 3 * len(pieces)


def test_sse_data_yields_whole_events() -> None:
    class Body:
        def __init__(self, parts: list[str]) -> None:
            self.parts = parts

        async def aiter_text(self):
            for part in self.parts:
                yield part

    events = "".join(_chunk(f"x{c}y") for c in LINE_BREAKERS) + "data: [DONE]\n\n"
    # Split the body at every few characters, as the network might.
    parts = [events[i:i + 7] for i in range(0, len(events), 7)]

    async def collect() -> list[str]:
        return [data async for data in sse_data(Body(parts))]

    got = asyncio.run(collect())
    assert got[-1] == "[DONE]"
    texts = [json.loads(d)["choices"][0]["text"] for d in got[:-1]]
    assert texts == [f"x{c}y" for c in LINE_BREAKERS]


def test_ttft_is_the_first_chunk_with_tokens(stub_server) -> None:
    url = stub_server(["", "", "first", "second"], gap_s=0.15)

    async def one():
        async with httpx.AsyncClient(timeout=30) as client:
            return await _one_request(client, url, "stub", [1, 2, 3], 4, True)

    result = asyncio.run(one())
    assert result.ok, result.error
    # Two empty chunks come first: TTFT is at the third chunk (~0.45 s), not the first.
    assert 0.35 < result.ttft < result.latency
    assert len(result.itl) == 1


def test_tokenizer_less_model_streams_token_ids(tmp_path) -> None:
    server = ServerProcess(["--model", "random:tiny", "--device", "cpu", "--dtype", "float32",
                            "--attention-backend", "CPU", "--kv-cache-memory", "16MiB"],
                           tmp_path / "server.log")
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "stream": True}
        chunks = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        ids = [i for c in chunks for i in c["choices"][0]["token_ids"]]
        assert len(ids) == 6
        assert all(c["choices"][0]["text"] == "" for c in chunks)
        # Streamed as the steps come, not in one chunk at the end (a client slower than the
        # engine gets the steps it has not read merged into one chunk).
        assert sum(bool(c["choices"][0]["token_ids"]) for c in chunks) >= 2
        full = httpx.post(server.url + "/v1/completions", json={**body, "stream": False},
                          timeout=60).json()
        assert full["choices"][0]["token_ids"] == ids

        async def one():
            async with httpx.AsyncClient(timeout=60) as client:
                return await _one_request(client, server.url, None, [5, 6, 7], 24, True)

        result = asyncio.run(one())
        assert result.ok and result.output_tokens == 24
        assert result.ttft < result.latency and len(result.itl) >= 2
    finally:
        server.stop()
