"""`bench throughput` prints speculative decoding's figures; /metrics exports its counters
under vLLM's names."""

from __future__ import annotations

import pytest

from pagedserve.cli import main

SPEC = ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 2, "rejection_sample_method": "synthetic", '
        '"synthetic_acceptance_rate": 1.0}')


def test_bench_throughput_prints_acceptance(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "throughput", "--model", "random:tiny", "--device", "cpu",
               "--kv-cache-memory", "16MiB", "--num-prompts", "3", "--input-len", "12",
               "--output-len", "12", "--no-warmup", "--no-engine-core-process",
               "--speculative-config", SPEC])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Total num output tokens: 36" in out
    line = next(x for x in out.splitlines() if x.startswith("Speculative decoding:"))
    # Every draft kept (synthetic rate 1.0); a lookup may find fewer than K tokens to draft.
    assert "acceptance rate 100.0%, per position 1.000, " in line
    assert "mean acceptance length " in line and "drafts, " in line
    assert "% of the engine core's step time" in line


def test_backends_list_says_how_drafts_are_verified(capsys: pytest.CaptureFixture[str]):
    assert main(["backends"]) == 0
    assert "verifies a request's 1+K drafted tokens as a chunked prefill" in \
        capsys.readouterr().out


def test_metrics_export_the_counters_under_vllms_names() -> None:
    from types import SimpleNamespace

    from pagedserve.engine.async_llm import EngineSnapshot
    from pagedserve.engine.llm_engine import EngineStats
    from pagedserve.server.metrics import EngineCollector

    def families(**spec):
        stats = EngineStats(1, 0, 0.5, 0, 10, 4, 100, 50, **spec)
        snap = EngineSnapshot(stats, 64, 32, 2, 9, 0, 3)
        return {m.name: m for m in EngineCollector(SimpleNamespace(snapshot=snap)).collect()}

    off = families()
    assert not any("spec_decode" in name for name in off)
    on = families(spec_decode_num_drafts=5, spec_decode_num_draft_tokens=15,
                  spec_decode_num_accepted_tokens=7,
                  spec_decode_num_accepted_tokens_per_pos=[4, 2, 1])
    assert on["pagedserve:spec_decode_num_drafts"].samples[0].value == 5
    assert on["pagedserve:spec_decode_num_draft_tokens"].samples[0].value == 15
    assert on["pagedserve:spec_decode_num_accepted_tokens"].samples[0].value == 7
    per_pos = on["pagedserve:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [(s.labels["position"], s.value) for s in per_pos] == [("0", 4), ("1", 2), ("2", 1)]


def test_bench_serve_prints_acceptance(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Read from the server's /metrics before and after the run."""
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm_engine import LLMEngine
    from tests.utils.paged import tiny_chat_model
    from tests.utils.server import app_in_thread

    model = str(tiny_chat_model(tmp_path / "tiny"))
    engine = LLMEngine.from_kwargs(model=model, dtype="float32", kv_cache_memory="16MiB",
                                   speculative_config=SPEC)
    llm = AsyncLLM(engine)
    with app_in_thread(llm, "tiny") as url:
        rc = main(["bench", "serve", "--url", url, "--num-prompts", "3", "--input-len", "12",
                   "--output-len", "16", "--vocab-size", "50", "--request-rate", "inf"])
    llm.shutdown()
    out = capsys.readouterr().out
    assert rc == 0 and "Successful requests: 3" in out
    line = next(x for x in out.splitlines() if x.startswith("Speculative decoding:"))
    assert "acceptance rate 100.0%, per position 1.000, " in line
