"""`bench throughput` prints speculative decoding's figures."""

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
