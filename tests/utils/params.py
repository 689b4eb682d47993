"""Parameter grids whose redundant cases run only with `-m slow`, so CI meets every code path
once without paying for every combination."""

from __future__ import annotations

import pytest


def diagonal(shapes: list[tuple], values: list) -> list:
    """Every shape with every value appended, but CI runs each shape with one value only (in
    turn, so every value is still met when there are as many shapes): the other pairs are
    `slow`."""
    return [pytest.param(*shape, value,
                         marks=() if j == i % len(values) else (pytest.mark.slow,))
            for i, shape in enumerate(shapes) for j, value in enumerate(values)]


def only_in_ci(values: list, fast: set) -> list:
    """The values in `fast` run in CI; the others only with -m slow."""
    return [pytest.param(v, marks=() if v in fast else (pytest.mark.slow,)) for v in values]


def slow_unless(rows: list, fast: set[int]) -> list:
    """The rows whose index is in `fast` run in CI; the others only with -m slow."""
    return [pytest.param(*(row if isinstance(row, tuple) else (row,)),
                         marks=() if i in fast else (pytest.mark.slow,))
            for i, row in enumerate(rows)]
