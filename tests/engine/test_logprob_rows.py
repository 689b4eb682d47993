"""The rows of a step's logprobs each result reads, against a plain loop over the results."""

import numpy as np

from pagedserve.engine.logprob_rows import logprob_rows


def _reference(seq_ids, row_of, width):
    seen: dict[str, int] = {}
    out = []
    for s in seq_ids:
        out.append(row_of[s] * width + seen.get(s, 0))
        seen[s] = seen.get(s, 0) + 1
    return out


def test_decode_step_rows_are_the_requests_rows():
    row_of = {"a": 2, "b": 0, "c": 1}
    rows = logprob_rows(["c", "a", "b"], row_of, np.zeros(3, np.int64))
    assert rows.tolist() == [1, 2, 0]


def test_verify_step_rows_count_each_requests_kept_tokens():
    rng = np.random.default_rng(0)
    row_of = {f"r{i}": i for i in range(7)}
    kept = rng.integers(0, 5, size=7)  # 0..4 kept tokens of a width-4+1 verify step
    seq_ids = [f"r{i}" for i in range(7) for _ in range(int(kept[i]))]
    rng.shuffle(seq_ids)  # results need not come grouped by request
    rows = logprob_rows(seq_ids, row_of, np.zeros((7, 5), np.int64))
    assert rows.tolist() == _reference(seq_ids, row_of, 5)


def test_empty_verify_step():
    assert logprob_rows([], {}, np.zeros((0, 3), np.int64)).size == 0
