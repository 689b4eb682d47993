"""Only guided requests need xgrammar: on a machine without it the engine starts (grammar worker
processes asked for or not), `bench throughput` runs, unguided requests generate, and a guided
request is refused naming the package: a ValueError offline, a 400 in OpenAI's shape from a real
`pagedserve serve` (its engine core in a process of its own, where xgrammar is missing too)."""

from __future__ import annotations

import os
import sys
import textwrap

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cli import main
from pagedserve.sampling_params import GuidedDecodingParams, specs_parsed_by_sender
from tests.utils.paged import tiny_chat_model
from tests.utils.server import ServerProcess

MODEL = "tiny"
CPU = {"device": "cpu", "dtype": "float32", "kv_cache_memory": "16MiB"}
MISSING = "guided decoding needs the xgrammar package"
# Imported by the server's processes before anything else (sitecustomize): `import xgrammar`
# fails there, as on a machine without it.
HIDE_XGRAMMAR = textwrap.dedent('''
    import sys

    sys.modules["xgrammar"] = None
''')


@pytest.fixture
def no_xgrammar(monkeypatch) -> None:
    # None in sys.modules: `import xgrammar` raises ImportError and find_spec finds nothing.
    monkeypatch.setitem(sys.modules, "xgrammar", None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")))


def test_offline_engine_runs_and_refuses_only_guided_requests(no_xgrammar, model_dir) -> None:
    with LLM(model=model_dir, guided_decoding_workers=1, **CPU) as llm:
        assert llm.engine.core.structured_output.num_workers == 0  # none started, none needed
        plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        assert len(llm.generate("Hello", plain, use_tqdm=False)[0].outputs[0].token_ids) == 4
        with pytest.raises(ValueError, match=f"{MISSING}.*pip install xgrammar"):
            SamplingParams(guided_decoding={"choice": ["yes", "no"]})
        # A spec parsed elsewhere (as the engine core takes the front's) meets the engine's own
        # check before the request reaches the core.
        with specs_parsed_by_sender():
            guided = GuidedDecodingParams(choice=["yes", "no"])
        with pytest.raises(ValueError, match=MISSING):
            llm.generate("Hello", SamplingParams(max_tokens=4, guided_decoding=guided),
                         use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert len(llm.generate("Hello", plain, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_bench_throughput_runs(no_xgrammar, capsys) -> None:
    assert main(["bench", "throughput", "--model", "random:tiny", "--device", "cpu",
                 "--kv-cache-memory", "16MiB", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "3", "--no-warmup"]) == 0
    assert "Total num output tokens: 6" in capsys.readouterr().out


def test_server_refuses_guided_requests_with_a_400(model_dir, tmp_path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_XGRAMMAR)
    env = {"PYTHONPATH": os.pathsep.join([str(site), *sys.path]), "OMP_NUM_THREADS": "1"}
    server = ServerProcess(["--model", model_dir, "--served-model-name", MODEL, "--device",
                            "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB",
                            "--engine-core-process", "--guided-decoding-workers", "1"],
                           tmp_path / "server.log", env=env)
    try:
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 4, **body},
                              timeout=60)

        guided = [("/v1/completions", {"prompt": "hi", "guided_choice": ["yes", "no"]},
                   "guided_choice"),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                            "response_format": {"type": "json_object"}},
                   "response_format")]
        for path, body, field in guided:
            reply = post(path, body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert MISSING in error["message"] and error["param"] == field, error
        reply = post("/v1/completions", {"prompt": "hi", "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
    assert "Traceback" not in server.log()
