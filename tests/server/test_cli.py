"""`pagedserve generate` and `pagedserve backends` from the command line."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import transformers

from pagedserve.arg_utils import engine_config
from pagedserve.cli import build_parser, main


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


ENGINE = ["--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "8MiB"]


def test_generate_file_reports_bad_lines_and_runs_the_rest(tiny_model_dir, tmp_path, capsys):
    lines = [
        {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
        "{not json",
        {"prompt": [5, 6], "max_tokens": -3},
        {"prompt": [5, 6], "colour": "blue"},
        {"prompt": [9, 10, 11, 12], "max_tokens": 3, "temperature": 0, "ignore_eos": True},
        {"prompt": [1], "messages": []},
        {"prompt": [500]},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    dst = tmp_path / "out.jsonl"
    # Bad lines fail the run (exit 1) so that a script can tell; the good ones still ran.
    assert main(["generate", "--model", tiny_model_dir, *ENGINE, "--input", str(src),
                 "--output", str(dst)]) == 1
    err = capsys.readouterr().err
    assert f"{src}:2: malformed JSON" in err
    assert f"{src}:3: max_tokens" in err and "-3" in err
    assert f"{src}:4: unknown sampling parameter 'colour'" in err
    assert f"{src}:6: give exactly one of 'prompt' or 'messages'" in err
    assert f"{src}:7: prompt token id 500 is out of range" in err
    results = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["line"] for r in results] == [1, 5]
    assert len(results[0]["token_ids"]) <= 4 and len(results[1]["token_ids"]) == 3


def test_generate_file_sends_the_images_of_its_messages(tmp_path, capsys):
    """A line's image parts reach a vision-language model as LLM.chat sends them (they were
    dropped: the template rendered the text only, and a bad image ran as text)."""
    import base64
    import io

    from pagedserve import LLM, SamplingParams
    from tests.multimodal.llava_models import image, tiny_llava

    model = tmp_path / "llava"
    tiny_llava(model)
    buf = io.BytesIO()
    image(0).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "w1 w2"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    remote = [{"role": "user", "content": [{"type": "image_url",
                                            "image_url": {"url": "http://example.com/a.png"}}]}]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": messages}) + "\n"
                   + json.dumps({"messages": remote}) + "\n")
    dst = tmp_path / "out.jsonl"
    assert main(["generate", str(model), *ENGINE, "--input", str(src), "--output", str(dst),
                 "--temperature", "0", "--max-tokens", "4"]) == 1
    assert f"{src}:2: remote image URLs are not fetched" in capsys.readouterr().err
    [result] = [json.loads(x) for x in dst.read_text().splitlines()]
    with LLM(model=str(model), dtype="float32", device="cpu", kv_cache_memory="8MiB") as llm:
        want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert result["token_ids"] == want[0].outputs[0].token_ids
    assert result["prompt"].count("<image>") == 9  # the image's tokens are in the prompt


def test_generate_refuses_stop_fields_over_the_engine_limits(tiny_model_dir, tmp_path, capsys):
    lines = [
        {"prompt": [5, 6, 7], "stop": ["ab", "cd", "ef"]},
        {"prompt": [5, 6, 7], "stop": ["abcdefghi"]},
        {"prompt": [5, 6, 7], "stop_token_ids": [1, 2, 3]},
        {"prompt": [5, 6, 7], "stop_token_ids": [1, 2], "max_tokens": 2},
        # Within the limits, but this model has no tokenizer to find stop strings with.
        {"prompt": [5, 6, 7], "stop": ["ab", "abcdefgh"], "max_tokens": 2},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["generate", "--model", tiny_model_dir, *ENGINE, "--input", str(src),
                 "--output", str(tmp_path / "out.jsonl"), "--max-stop-strings", "2",
                 "--max-stop-string-length", "8", "--max-stop-token-ids", "2"]) == 1
    err = capsys.readouterr().err
    assert f"{src}:1: stop must hold at most 2 strings (the engine's --max-stop-strings), " \
           "got 3" in err
    assert f"{src}:2: stop strings must be at most 8 characters long (the engine's " \
           "--max-stop-string-length), got one of 9" in err
    assert f"{src}:3: stop_token_ids must hold at most 2 ids (the engine's " \
           "--max-stop-token-ids), got 3" in err
    assert f"{src}:5: stop strings need a tokenizer" in err and "--tokenizer DIR" in err
    assert [json.loads(x)["line"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] \
        == [4]


@pytest.mark.parametrize("argv", [["generate", "some/model", "--prompt", "hi"],
                                  ["bench", "throughput", "some/model"]])
def test_model_as_positional_argument_as_serve_takes_it(argv):
    """`pagedserve generate MODEL` was refused as an unrecognized argument of `pagedserve`."""
    assert engine_config(build_parser().parse_args(argv)).model.model == "some/model"


def test_serve_on_a_port_in_use_fails_before_the_model_loads(tiny_model_dir, monkeypatch):
    from pagedserve.engine import llm_engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}: "):
            main(["serve", tiny_model_dir, *ENGINE, "--port", str(port)])


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--port", "99999", "port must be between 0 and 65535, got 99999"),
    ("--max-n", "0", "max_n must be >= 1, got 0"),
    ("--max-waiting-requests", "0", "max_waiting_requests must be >= 1, got 0"),
    ("--max-request-body-bytes", "0", "max_request_body_bytes must be >= 1, got 0"),
    ("--shutdown-timeout", "-1", "shutdown_timeout must be >= 0 seconds, got -1.0"),
])
def test_serve_refuses_bad_server_values_before_the_model_loads(tiny_model_dir, monkeypatch,
                                                                flag, value, message):
    """A port out of range was a traceback; the others started a server that refused every
    request (max_n 0, 0 waiting) or quietly took the default (a body limit of 0)."""
    from pagedserve.engine import llm_engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_load)
    with pytest.raises(SystemExit, match=f"^pagedserve serve: error: {message}$"):
        main(["serve", tiny_model_dir, *ENGINE, flag, value])


def test_generate_rejects_bad_engine_value(tiny_model_dir):
    with pytest.raises(SystemExit, match="block_size must be >= 1, got 0"):
        main(["generate", "--model", tiny_model_dir, *ENGINE, "--block-size", "0",
              "--input", "x.jsonl"])


def test_unknown_backend_lists_available(tiny_model_dir):
    with pytest.raises(SystemExit, match="(?s)unknown attention backend 'NOPE'.*available here"):
        main(["generate", "--model", tiny_model_dir, *ENGINE, "--attention-backend", "NOPE",
              "--prompt", "hi"])


def test_backends_table(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "CPU" in out and "FLASHINFER" in out and "auto-selection order" in out
    # The encoder-only column: which backends run bidirectional layers without a cache.
    encoder, name = {}, None
    for line in out.split("\n"):
        if line and not line.startswith(" "):
            name = line.split()[0]
        elif "encoder-only attention:" in line:
            encoder[name] = line.rsplit(" ", 1)[1]
    assert encoder["CPU"] == "yes" and encoder["TRITON"] == "yes"
    assert encoder["TURBOQUANT"] == "no" and encoder["CPU_MLA"] == "no"


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"],
                                     ["bench", "throughput"]])
def test_takes_vllms_common_engine_flags(command, caplog):
    """vLLM command lines pass -tp, --enable-chunked-prefill and --disable-log-stats as a
    habit; each was 'unrecognized arguments'."""
    args = build_parser().parse_args([*command, "some/model", "-tp", "1", "-dp", "1",
                                      "--enable-chunked-prefill", "--disable-log-stats"])
    config = engine_config(args)
    assert config.tensor_parallel_size == 1 and config.data_parallel_size == 1
    assert config.scheduler.enable_chunked_prefill and args.disable_log_stats
    with caplog.at_level("WARNING"):
        engine_config(build_parser().parse_args(
            [*command, "some/model", "--no-enable-chunked-prefill"]))
    assert "still prefill in chunks" in caplog.text


def test_serve_disable_log_stats_and_auto_tool_choice(tiny_model_dir, monkeypatch):
    from pagedserve.engine import llm_engine

    seen = {}

    def no_load(self, config, log_stats=False):
        seen["log_stats"] = log_stats
        raise ValueError("stop before loading")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_load)
    with pytest.raises(SystemExit, match="stop before loading"):
        main(["serve", tiny_model_dir, *ENGINE, "--disable-log-stats",
              "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert seen["log_stats"] is False
    # vLLM refuses auto tool choice without a parser to read the calls; so does this.
    with pytest.raises(SystemExit, match="^pagedserve serve: error: --enable-auto-tool-choice "
                                         "needs --tool-call-parser"):
        main(["serve", tiny_model_dir, *ENGINE, "--enable-auto-tool-choice"])


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "hi", "--output", "{missing}/out.jsonl"],
    ["bench", "throughput", "--num-prompts", "1", "--output-json", "{missing}/out.json"],
    ["bench", "serve", "--num-prompts", "1", "--output-json", "{missing}/out.json"],
    ["generate", "--prompt", "hi", "--output", "{tmp}"],
])
def test_an_unwritable_output_file_fails_before_the_run(tiny_model_dir, tmp_path, monkeypatch,
                                                        argv):
    """It was a traceback after the whole run, its results lost."""
    from pagedserve.engine import llm_engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_load)
    argv = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in argv]
    engine = [] if argv[1] == "serve" else [tiny_model_dir, *ENGINE]
    with pytest.raises(SystemExit, match=r"^pagedserve (generate|bench \w+): error: --output"):
        main([*argv, *engine, *(["--url", "http://127.0.0.1:1"] if argv[1] == "serve" else [])])


def test_generate_jsonl_carries_logprobs_and_every_sample(tiny_model_dir, tmp_path, capsys):
    """--logprobs and n > 1 were asked for and dropped: one sample's ids, no logprobs."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "seed": 1,
                               "prompt_logprobs": 1}) + "\n")
    assert main(["generate", "--model", tiny_model_dir, *ENGINE, "--input", str(src),
                 "--output", "-", "--logprobs", "2", "--temperature", "1"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[-1])
    samples = record["completions"]
    assert len(samples) == 2 and samples[0]["token_ids"] == record["token_ids"]
    for sample in samples:
        assert len(sample["logprobs"]) == len(sample["token_ids"]) == 3
        for token, position in zip(sample["token_ids"], sample["logprobs"], strict=True):
            assert str(token) in position and len(position) >= 2  # the sampled and the top 2
            assert all(v["logprob"] <= 0 for v in position.values())
        assert sample["cumulative_logprob"] == pytest.approx(sum(
            p[str(t)]["logprob"] for t, p in zip(sample["token_ids"], sample["logprobs"],
                                                 strict=True)))
    assert record["logprobs"] == samples[0]["logprobs"]
    assert record["prompt_logprobs"][0] is None and "6" in record["prompt_logprobs"][1]


def test_a_model_given_twice_is_refused():
    """`serve --model X --served-model-name a b` (vLLM takes several names) ran model 'b'."""
    args = build_parser().parse_args(["serve", "--model", "some/model", "--served-model-name",
                                      "a", "b"])
    with pytest.raises(ValueError, match="'b'.*'some/model'"):
        engine_config(args)
    args = build_parser().parse_args(["serve", "some/model", "--model", "some/model"])
    assert engine_config(args).model.model == "some/model"


def test_generate_lines_take_chat_template_kwargs():
    """Qwen3's enable_thinking and other template variables, per messages line."""
    from pagedserve.generate import parse_request_line, run_jobs

    line = {"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 2}
    job = parse_request_line(json.dumps(line))
    assert job.chat_template_kwargs == {"enable_thinking": False}
    assert "chat_template_kwargs" not in job.sampling
    for bad in ({"prompt": "hi", "chat_template_kwargs": {}},
                {**line, "chat_template_kwargs": ["enable_thinking"]}):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            parse_request_line(json.dumps(bad))

    class Rendered(Exception):
        pass

    class FakeLLM:
        def chat_prompt(self, messages, **kwargs):
            raise Rendered(kwargs)

    with pytest.raises(Rendered, match="'chat_template_kwargs': {'enable_thinking': False}"):
        run_jobs(FakeLLM(), [job], None)
