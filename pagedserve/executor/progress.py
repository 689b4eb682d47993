"""Whether every other rank keeps up with the commands rank 0 sends it: a rank that still
answers (its heartbeats arrive, its actor lives) but has not finished a command long after it
was sent is hung inside it (a deadlock, a GPU kernel or collective that never returns).

Rank 0 notes the time of each command it sends (one deque append); each rank reports how many
commands it has finished in all (its heartbeat, or its finished actor calls). Entries leave the
deque once every rank has finished them, so it holds only the commands still in flight.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Overdue:
    """The oldest command a rank has not finished: which step (counted from 1 per kind since
    the executor started) and how long ago it was sent."""

    rank: int
    kind: str
    step: int
    age_s: float

    def describe(self) -> str:
        what = f"step {self.step}" if self.kind == "launch" else f"step {self.step}'s {self.kind}"
        return f"has not finished {what} in {self.age_s:.0f} s"


class StepProgress:
    """The commands sent to the other ranks that some rank has not finished yet.

    One thread sends (`sent`), one other thread reads the ranks' reports (`done`, `overdue`):
    the sender only appends, the reader alone removes from the left and moves `_base`, so
    CPython's atomic deque operations make a lock unnecessary.
    """

    def __init__(self, ranks: Iterable[int]) -> None:
        self._finished = {rank: 0 for rank in ranks}  # commands each rank has finished
        self._sent: deque[tuple[float, str, int]] = deque()  # (time, kind, step), in order
        self._base = 0  # commands before _sent[0], finished by every rank
        self._counts: dict[str, int] = {}

    def sent(self, kind: str, now: float | None = None) -> None:
        """Rank 0 sent every other rank one command (`kind`: launch, collect)."""
        step = self._counts.get(kind, 0) + 1
        self._counts[kind] = step
        self._sent.append((time.monotonic() if now is None else now, kind, step))

    def done(self, rank: int, finished: int) -> None:
        """`rank` has finished `finished` commands in all (counts only grow)."""
        if finished <= self._finished[rank]:
            return
        self._finished[rank] = finished
        oldest = min(self._finished.values())
        while self._base < oldest and self._sent:
            self._sent.popleft()
            self._base += 1

    def forget(self, rank: int) -> None:
        """`rank` is gone (its failure is known): it holds no command back any more."""
        self._finished.pop(rank, None)

    def in_flight(self) -> int:
        """Commands some rank has not finished."""
        return len(self._sent)

    def overdue(self, timeout_s: float, now: float | None = None) -> Overdue | None:
        """The rank furthest behind, when its oldest unfinished command was sent more than
        `timeout_s` ago; else None."""
        if not self._finished or not self._sent:
            return None
        rank = min(self._finished, key=self._finished.__getitem__)
        index = self._finished[rank] - self._base
        if index >= len(self._sent):
            return None
        sent_at, kind, step = self._sent[index]
        age = (time.monotonic() if now is None else now) - sent_at
        return Overdue(rank, kind, step, age) if age > timeout_s else None
