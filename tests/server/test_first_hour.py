"""What a new user meets first, through the real `pagedserve` console script: mistakes answered
by one line naming the bad value (no traceback) before any model loads, vLLM's habits that work
here, and output a person reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pagedserve import LLM, __version__
from tests.utils.paged import tiny_chat_model
from tests.utils.server import ServerProcess, free_port

CPU = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB"]


def pagedserve(*args: str, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    exe = shutil.which("pagedserve", path=os.path.dirname(sys.executable)) or "pagedserve"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


def loaded(result: subprocess.CompletedProcess) -> bool:
    return "loaded " in result.stderr  # the engine's log line after the weights load


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")))


@pytest.mark.slow  # process start-ups; the other first-hour tests run the same parser
def test_version_and_log_level_after_the_subcommand() -> None:
    result = pagedserve("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"pagedserve {__version__}"
    result = pagedserve("backends", "--log-level", "warning")
    assert result.returncode == 0 and "CPU" in result.stdout


def _mistakes(model_dir: str, tmp_path) -> list[tuple[list[str], dict[str, str], tuple]]:
    return [
        (["generate", "--model", model_dir, *CPU, "--input", str(tmp_path / "missing.jsonl")],
         {}, ("missing.jsonl", "No such file")),
        (["generate", "--model", "meta-llama/Llama-3.1-8B", *CPU, "--prompt", "hi"], {},
         ("meta-llama/Llama-3.1-8B", "huggingface-cli download")),
        (["generate", "--model", model_dir, "--device", "cuda", "--prompt", "hi"], {},
         ("device 'cuda'", "--device cpu")),
        (["generate", "--model", model_dir, *CPU, "--prompt", "hi"],
         {"PAGEDSERVE_ATTENTION_BACKEND": "NOPE"}, ("'NOPE'", "$PAGEDSERVE_ATTENTION_BACKEND")),
        (["generate", "--model", model_dir, *CPU, "--trust-remote-code", "--prompt", "hi"], {},
         ("trust_remote_code",)),
        (["generate", "--model", model_dir, *CPU, "--temperature", "-1", "--prompt", "hi"], {},
         ("temperature", "-1")),
        (["generate", "--config", "nope", "--prompt", "hi"], {}, ("'nope'", "cpu")),
        (["generate", "--model", model_dir, *CPU, "--guided-decoding-workers", "-1",
          "--prompt", "hi"], {}, ("guided_decoding_workers", "-1")),
        (["bench", "serve", "--url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1"],
         {}, ("is a server running there?",)),
        (["generate", "--model", model_dir, *CPU, "--attention-backend", "CPU",
          "--kv-cache-dtype", "tq_4bit", "--prompt", "hi"], {},
         ("CPU does not store kv_cache_dtype 'tq_4bit'", "TURBOQUANT")),
        (["generate", "--model", model_dir, *CPU, "--kv-cache-dtype", "int4", "--prompt", "hi"],
         {}, ("'int4'", "valid values: auto, fp8, tq_k8v4")),
    ]


def pagedserve_runs(*runs: tuple[list[str], dict[str, str]]) -> list[subprocess.CompletedProcess]:
    """`pagedserve(*args, env=env)` of each run, two at a time: a start-up is mostly one
    core's imports, and the machine has two."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda run: pagedserve(*run[0], env=run[1]), runs))


# Each case is a process start-up (~3 s): half run by default, the rest with -m slow.
@pytest.mark.parametrize("half", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_mistakes_are_one_line_before_the_model_loads(model_dir, tmp_path, half) -> None:
    cases = _mistakes(model_dir, tmp_path)[half::2]
    results = pagedserve_runs(*[(args, env) for args, env, _ in cases])
    for (args, _, needles), result in zip(cases, results, strict=True):
        one_line_error(result, *needles)
        assert not loaded(result), args


def test_bad_lines_fail_the_run_and_are_found_before_loading(model_dir, tmp_path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        json.dumps({"prompt": "hello", "max_tokens": 3, "temperature": 0}),
        "{not json",
        json.dumps({"prompt": "hi", "colour": "blue"}),
        json.dumps({"messages": [{"role": "user", "content": "What is 2+2?"}],
                    "max_tokens": 3}),
    ]) + "\n")
    dst = tmp_path / "out.jsonl"
    result, to_file = pagedserve_runs(
        (["generate", "--model", model_dir, *CPU, "--input", str(src)], {}),
        (["generate", "--model", model_dir, *CPU, "--input", str(src), "--output", str(dst),
          "--log-level", "warning"], {}))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    err = result.stderr
    assert err.index(f"{src}:2: malformed JSON") < err.index("loaded ")
    assert err.index(f"{src}:3: unknown sampling parameter 'colour'") < err.index("loaded ")
    # A person reads the answers: each prompt, then its answer; no JSON.
    out = result.stdout
    assert out.startswith("[1] hello\n") and "[4] What is 2+2?\n" in out
    assert not any(line.startswith('{"line"') for line in out.splitlines())
    assert to_file.returncode == 1
    assert [json.loads(x)["line"] for x in dst.read_text().splitlines()] == [1, 4]


@pytest.mark.slow  # process start-ups; test_cli checks the parser's flags in process
def test_help_shows_every_flag_with_its_default() -> None:
    generate = pagedserve("generate", "--help").stdout
    for text in ("--temperature", "(default: 1.0)", "--max-tokens", "(default: 16)",
                 "--sample-seed", "--stop-token-ids", "--block-size"):
        assert text in generate, text
    assert "--served-model-name" not in generate  # a server setting
    serve = pagedserve("serve", "--help").stdout
    assert "--served-model-name" in serve and "(default: 8000)" in serve
    bench = pagedserve("bench", "serve", "--help").stdout
    for text in ("--base-url", "--random-input-len", "(default: 200)", "$PAGEDSERVE_API_KEY"):
        assert text in bench, text


@pytest.mark.slow  # twelve process start-ups
def test_vllm_habits(model_dir, tmp_path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                        "{% endfor %}<assistant>")
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    result = pagedserve("generate", "--model", model_dir, *CPU[:2], "--dtype", "float",
                        "--kv-cache-memory", "16MiB", "--attention-backend", "TORCH_SDPA",
                        "--tokenizer", model_dir, "--chat-template", str(template),
                        "--generation-config", str(tmp_path / "gen"), "--max-logprobs", "2",
                        "--chat", "--prompt", "hi", "--max-tokens", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "default sampling settings from the model's generation config" in result.stderr
    result = pagedserve("generate", "--model", model_dir, *CPU, "--max-logprobs", "2",
                        "--logprobs", "3", "--prompt", "hi")
    assert result.returncode != 0 and "logprobs must be <= 2" in result.stderr

    llm = LLM(model=model_dir, device="cpu", dtype="half", kv_cache_memory="16MiB",
              attention_backend="TRITON_ATTN" if os.environ.get("TRITON_INTERPRET") else "CPU",
              chat_template=str(template))
    assert llm.get_tokenizer() is llm.tokenizer
    assert llm.tokenizer.decode(llm.apply_chat_template(
        [{"role": "user", "content": "hi"}])) == "<user>hi<assistant>"
    scores = llm.score(["The capital of France is"], [" Paris"])
    assert scores[0].shape[0] == len(llm.tokenizer.encode(" Paris", add_special_tokens=False))
    with pytest.raises(ValueError, match="prompt 0 must be a string or a list of token ids"):
        llm.score([3.5], [[1]])


@pytest.mark.slow  # a process start-up for one warning
def test_settings_for_another_device_warn(model_dir) -> None:
    result = pagedserve("generate", "--model", model_dir, *CPU, "--gpu-memory-utilization",
                        "0.5", "--prompt", "hi", "--max-tokens", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--gpu-memory-utilization does not apply on cpu" in result.stderr


@pytest.mark.slow  # a server start-up; test_server runs bench serve against its server
def test_bench_serve_against_a_keyed_server(tmp_path) -> None:
    server = ServerProcess(["--model", "random:tiny", *CPU, "--attention-backend", "CPU",
                            "--api-key", "sk-test", "--disable-log-requests"],
                           tmp_path / "server.log")
    try:
        start = time.monotonic()
        result = pagedserve("bench", "serve", "--base-url", server.url, "--num-prompts", "4",
                            "--random-input-len", "8", "--random-output-len", "4",
                            "--vocab-size", "500",
                            env={"PAGEDSERVE_API_KEY": "sk-test"})
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Successful requests: 4" in result.stdout
        assert "HTTP Request" not in result.stderr  # httpx's per-request INFO lines
        assert time.monotonic() - start < 120
        unauthorized = httpx.get(server.url + "/v1/models", timeout=30)
        assert unauthorized.status_code == 401
    finally:
        server.stop()
    assert "prompt +" not in server.log()  # --disable-log-requests: no per-request lines


def test_default_server_answers_the_readme_model_name() -> None:
    from pagedserve.models.loader import DEFAULT_MODEL_NAME

    assert DEFAULT_MODEL_NAME == "smollm2"
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert '"model": "smollm2"' in readme and 'model="smollm2"' in readme
