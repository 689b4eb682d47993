"""`pagedserve serve --tensor-parallel-size 2`: a completion's greedy tokens equal one rank's,
and stopping the server leaves no worker behind."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from pagedserve import LLM
from tests.distributed.test_tensor_parallel import CONFIGS, ENGINE, GREEDY, PROMPTS, save_model
from tests.utils.server import ServerProcess, child_pids


def test_serve_with_two_ranks(tmp_path):
    path = save_model(CONFIGS["qwen3"](), tmp_path / "model")
    server = ServerProcess(["--model", path, "--tensor-parallel-size", "2", "--dtype", "float32",
                            "--device", "cpu", "--kv-cache-memory", "16MiB",
                            "--max-model-len", "128", "--block-size", "4"],
                           tmp_path / "server.log", wait=False,
                           env={"PAGEDSERVE_PROCESS_START_METHOD": "spawn"})  # the default
    try:
        llm = LLM(model=path, **ENGINE)
        expected = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        server.wait_healthy()
        workers = child_pids(server.proc.pid)
        assert workers, "no worker process under the server"
        body = {"model": Path(path).name, "prompt": PROMPTS[0], "max_tokens": GREEDY.max_tokens,
                "temperature": 0, "ignore_eos": True}
        resp = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == expected
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
