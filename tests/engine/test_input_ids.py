"""The previous step's samples patched into this step's input ids on the device (async
scheduling): in order, reordered, and behind a new request's prefill."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedserve.engine.input_batch import InputIds


def _batch(computed: list[int], scheduled: list[int], is_new: list[bool]) -> SimpleNamespace:
    return SimpleNamespace(num_computed_tokens=np.array(computed, dtype=np.int32),
                           num_scheduled_tokens=np.array(scheduled, dtype=np.int32),
                           will_sample=np.ones(len(computed), dtype=bool), is_new=is_new)


# The previous step: rows 3, 5, 1 decoded at 10, 20, 30 cached tokens and sampled 103, 105, 101.
PREV_ROWS = np.array([3, 5, 1])
PREV = _batch([10, 20, 30], [1, 1, 1], [False] * 3)
SAMPLED = torch.tensor([103, 105, 101])


@pytest.mark.parametrize("case,rows,computed,scheduled,is_new,kind", [
    ("same batch", [3, 5, 1], [11, 21, 31], [1, 1, 1], [False] * 3, (True, True)),
    ("reordered", [1, 3, 5], [31, 11, 21], [1, 1, 1], [False] * 3, (True, False)),
    ("after a prefill", [6, 3, 5, 1], [0, 11, 21, 31], [4, 1, 1, 1], [True] + [False] * 3,
     (False, False)),
])
def test_patch_puts_each_sample_at_its_requests_next_input(case, rows, computed, scheduled,
                                                           is_new, kind):
    ids = InputIds(16, 8, torch.device("cpu"))
    batch = _batch(computed, scheduled, is_new)
    qsl = np.concatenate([[0], np.cumsum(scheduled)])
    ids.host[:] = -1  # the host's placeholders for the samples not yet known
    n = ids.queue_patch(PREV, PREV_ROWS, batch, np.array(rows), qsl)
    assert n == 3
    assert (ids._into_first, ids._in_order) == kind  # the launch each case takes
    ids.apply_patch(n, SAMPLED)
    sample_of_row = {3: 103, 5: 105, 1: 101}
    for i, row in enumerate(rows):
        want = sample_of_row.get(row, -1)  # the new request's prompt is not patched
        assert int(ids.device[qsl[i]]) == want, (case, i)
