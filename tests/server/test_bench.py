"""CPU tests for `pagedserve bench`, random-weight models and the decode-graph padding:

- `bench throughput` on a tiny random model runs and prints vLLM's figures;
- a `random:<yaml>` model builds the configured shape, and the engine's greedy tokens on it
  equal transformers' on the very same weights (through `hf_state_dict`);
- graph sizes and padded-size selection; `--enforce-eager` parsing;
- pure-decode steps padded to a captured size (run eagerly here: `DecodeGraphs(capture=False)`)
  give the same greedy tokens as unpadded steps, on the CPU backend and on Triton's kernels.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.arg_utils import engine_kwargs
from pagedserve.bench import (
    RequestResult,
    arrival_delays,
    error_message,
    random_prompts,
    summarize,
)
from pagedserve.cli import build_parser, main
from pagedserve.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, padded_batch_size
from pagedserve.models.checkpoint_loading import hf_state_dict
from pagedserve.models.loader import load_random_model

CPU_ARGS = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.parametrize("mode", [
    "--no-engine-core-process",
    pytest.param("--engine-core-process", marks=pytest.mark.slow),  # test_core_process covers it
])
def test_bench_throughput_prints_figures(capsys: pytest.CaptureFixture[str], mode: str) -> None:
    rc = main(["bench", "throughput", "--model", "random:tiny", "--device", "cpu",
               "--attention-backend", "CPU", "--kv-cache-memory", "16MiB", "--num-prompts", "3",
               "--input-len", "12", "--output-len", "5", "--no-warmup", mode])
    out = capsys.readouterr().out
    assert rc == 0
    assert "requests/s" in out and "total tokens/s" in out and "output tokens/s" in out
    assert "Total num output tokens: 15" in out  # ignore_eos by default: exactly 3 x 5
    assert "Elapsed:" in out
    # The core's own line: 1 prefill step + 4 decodes (the step that samples the last token
    # is the fifth), its host time per step and the wait for the device (none on the CPU).
    line = next(x for x in out.splitlines() if x.startswith("Engine core:"))
    assert line.startswith("Engine core: 5 steps, ") and "0.000 ms waiting" in line
    assert "GPU busy" not in out  # CUDA events only, with PAGEDSERVE_DEVICE_TIMING


@pytest.mark.parametrize(("argv", "message"), [
    (["throughput", "--input-len", "0"],
     "argument --input-len/--random-input-len: must be > 0, got '0'"),
    (["throughput", "--num-prompts", "-2"], "argument --num-prompts: must be > 0, got '-2'"),
    (["throughput", "--output-len", "0"],
     "argument --output-len/--random-output-len: must be > 0, got '0'"),
    (["serve", "--request-rate", "-1"], "argument --request-rate: must be > 0, got '-1'"),
    (["serve", "--num-prompts", "x"], "argument --num-prompts: invalid int value: 'x'"),
])
def test_bench_refuses_bad_workload_values_in_one_line(capsys, argv, message) -> None:
    """They were tracebacks from numpy or the engine (throughput), or were found only after
    connecting to a server (serve)."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(message)


def test_a_failed_request_reads_as_the_servers_message() -> None:
    """It was the body's bytes repr cut at 200 characters (a pooling server's refusal lost its
    end)."""
    message = "this is a pooling model (--runner pooling): " + "x" * 300
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"}})
    assert error_message(body.encode()) == message
    assert error_message(b"<html>Bad Gateway</html>") == "<html>Bad Gateway</html>"


@pytest.mark.parametrize(("flags", "message"), [
    (["--input-len", "40", "--max-model-len", "32"],
     "the prompt has 40 tokens, but the model's context length is 32 tokens"),
    (["--runner", "pooling"], "this is a pooling model"),
])
def test_bench_throughput_refusal_is_one_line(flags, message) -> None:
    with pytest.raises(SystemExit, match=f"^pagedserve bench throughput: error: {message}"):
        main(["bench", "throughput", "--model", "random:tiny", "--device", "cpu",
              "--attention-backend", "CPU", "--kv-cache-memory", "16MiB", "--num-prompts", "2",
              "--input-len", "12", "--output-len", "2", "--no-warmup", *flags])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_throughput_reports_the_gpus_busy_share(capsys, monkeypatch) -> None:
    """PAGEDSERVE_DEVICE_TIMING: CUDA events around each step's device work, summed as they
    complete; their share of the run is printed, and it cannot exceed the run."""
    from pagedserve.bench import run_throughput

    monkeypatch.setenv("PAGEDSERVE_DEVICE_TIMING", "1")
    llm = LLM(model="random:tiny", device="cuda", attention_backend="TRITON",
              gpu_memory_utilization=0.2, engine_core_process=False)
    assert llm.engine.runner.device_timer is not None
    result = run_throughput(llm, random_prompts(8, 16, 512), 32)
    assert 0 < result["gpu_busy"] <= 1.0
    assert 0 < result["gpu_ms_per_step"] <= 1e3 * result["elapsed_s"] / result["core_steps"]
    llm.engine.shutdown()


def test_random_yaml_model_matches_transformers(tmp_path) -> None:
    spec = tmp_path / "shape.yaml"
    spec.write_text("base: tiny\nnum_hidden_layers: 3\nhidden_size: 64\nintermediate_size: 96\n"
                    "num_attention_heads: 4\nnum_key_value_heads: 2\nrope_theta: 5000.0\n")
    loaded = load_random_model(str(spec), torch.float32, torch.device("cpu"), seed=1)
    cfg = loaded.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (3, 64, 512)
    assert loaded.tokenizer is None and loaded.max_model_len == 1024
    assert len(loaded.model.model.layers) == 3

    llm = LLM(model=f"random:{spec}", attention_backend="CPU", **CPU_ARGS)
    prompts = random_prompts(3, 9, cfg.vocab_size, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    # transformers on the engine's own weights (the engine's seed is 0).
    hf = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(llm.engine.runner.model),
                                             strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    for prompt, tokens in zip(prompts, ours, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(tokens) == ref


def test_random_json_model_reads_exponents_as_numbers(tmp_path) -> None:
    """A JSON config's `1e-05` is a float (YAML 1.1 would read it as a string)."""
    spec = tmp_path / "shape.json"
    spec.write_text('{"base": "tiny", "num_hidden_layers": 1, "rms_norm_eps": 1e-05}')
    cfg = load_random_model(str(spec), torch.float32, torch.device("cpu")).hf_config
    assert cfg.rms_norm_eps == 1e-05 and isinstance(cfg.rms_norm_eps, float)


def test_graph_sizes_and_padding_choice() -> None:
    assert graph_batch_sizes(32, 2048) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(12, 2048) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(256, 64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(64, 2048, [48, 4, 1, 100]) == [1, 4, 48]
    sizes = [1, 2, 4, 8, 16]
    assert [padded_batch_size(sizes, n) for n in (1, 2, 3, 5, 8, 9, 16, 17)] == \
        [1, 2, 4, 8, 8, 16, 16, None]


def test_enforce_eager_flag_parses() -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "throughput", "--enforce-eager", "--model", "random:tiny"])
    assert engine_kwargs(args)["enforce_eager"] is True
    assert args.num_prompts == 1000 and args.input_len == 1024 and args.output_len == 128
    assert args.ignore_eos is True
    args = parser.parse_args(["bench", "throughput"])
    assert "enforce_eager" not in engine_kwargs(args)
    args = parser.parse_args(["bench", "serve", "--request-rate", "4", "--max-concurrency", "8"])
    assert args.request_rate == 4.0 and args.max_concurrency == 8


def test_serve_summary_and_arrivals() -> None:
    results = [RequestResult(True, ttft=0.1, latency=1.1, output_tokens=11, itl=[0.1] * 10),
               RequestResult(True, ttft=0.3, latency=2.3, output_tokens=11, itl=[0.2] * 10),
               RequestResult(False, error="500: boom")]
    s = summarize(results, wall_s=4.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["first_error"] == "500: boom"
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(22 / 4)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx(150.0)
    assert s["p50_itl_ms"] == pytest.approx(150.0)
    assert s["mean_e2el_ms"] == pytest.approx(1700.0)
    assert arrival_delays(3, math.inf, 0) == [0.0, 0.0, 0.0]
    gaps = arrival_delays(4000, 10.0, 0)
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.1)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int,
              temperature: float = 0.0) -> list[list[int]]:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                            seed=7)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("backend", ["CPU", "TRITON"])
def test_padded_decode_matches_unpadded(backend: str) -> None:
    prompts = [random_prompts(1, n, 512, seed=n)[0] for n in (5, 21, 11)]
    new = 6 if backend == "TRITON" else 10  # the Triton interpreter is slow
    # Few blocks, so page 0 (what padding rows read) belongs to a live request.
    llm = LLM(model="random:tiny", attention_backend=backend, max_num_seqs=8,
              num_gpu_blocks_override=5, enable_prefix_caching=False, **CPU_ARGS)
    eager = _generate(llm, prompts, new)
    eager_sampled = _generate(llm, prompts, new, temperature=0.8)
    runner = llm.engine.runner
    assert runner.decode_graphs is None  # never on the CPU
    graphs = DecodeGraphs(runner.graph_inputs(), graph_batch_sizes(8, runner.max_num_tokens),
                          capture=False)
    runner.decode_graphs = graphs
    runner.step_log = []
    heads = []  # the head's argmax over the padded hidden states samples the graphed steps
    greedy_tokens = graphs.greedy_tokens
    graphs.greedy_tokens = lambda n: heads.append(n) or greedy_tokens(n)
    logits = []  # and the head's logits of the padded hidden states the sampled ones
    head_logits = graphs.head_logits
    graphs.head_logits = lambda n: logits.append(n) or head_logits(n)
    padded = _generate(llm, prompts, new)
    assert padded == eager
    assert heads and all(n <= 3 for n in heads) and not logits
    assert _generate(llm, prompts, new, temperature=0.8) == eager_sampled
    assert logits and all(n <= 3 for n in logits)
    assert graphs.replays[4] > 0  # 3 decodes ran padded to 4
    assert any(ran for *_, ran in runner.step_log)
    assert not any(ran for _, _, prefills, ran in runner.step_log if prefills)


def test_head_check_refuses_tokens_below_the_maximum() -> None:
    """The start-up check of the head graphs (runs on the CPU): the argmax passes, ties and
    rounding pass, a token far below its row's maximum does not."""
    from pagedserve.engine.head_graphs import check_greedy_tokens

    logits = torch.tensor([[0.5, 3.0, 2.9], [1.0, 1.0, -2.0]])
    check_greedy_tokens(torch.tensor([1, 0]), logits)
    check_greedy_tokens(torch.tensor([1, 1]), logits)  # a tie
    with pytest.raises(RuntimeError, match="below the eager maximum"):
        check_greedy_tokens(torch.tensor([0, 0]), logits)


def test_schedule_floor_counts_steps_and_floors() -> None:
    """benchmarks/schedule_floor.py runs the real scheduler: 8 prompts of 64 tokens fit one
    prefill step, which samples each first token; 3 decode steps give the other 3; with
    samples back one step late no step is wasted. The serial floor is a sum where the strict
    floor takes a max, so it is never below it."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "schedule_floor.py"
    spec = importlib.util.spec_from_file_location("schedule_floor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    log = module.schedule_log(8, 64, 4, max_num_seqs=8, max_num_batched_tokens=1024,
                              num_blocks=64)
    assert [int(n.sum()) for _, n, _, _ in log] == [512, 8, 8, 8]
    assert [only for *_, only in log] == [False, True, True, True]
    assert [c.tolist() for c, *_ in log][1:] == [[64] * 8, [65] * 8, [66] * 8]
    shape = module.model_shape("llama3-8b")
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    rates = (800e12, 4.24e12)
    strict, serial = shape.floor_s(log, *rates), shape.serial_floor_s(log, *rates)
    assert 0 < strict <= serial
    # A decode step of 8 requests is memory-bound: weights plus their KV at copy bandwidth.
    c, n, *_ = log[1]
    assert shape.issue_floor_s([log[1]], *rates) == pytest.approx(
        (shape.weight_bytes + shape.kv_bytes_per_token * float((c + n).sum())) / 4.24e12)
