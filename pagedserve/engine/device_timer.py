"""The device's busy time, from CUDA events around each step's device work.

A step's span runs from its forward (queued once the host has built the step's inputs) to its
samples' copy to the host. Steps run on one stream, so spans never overlap: their sum over
the wall time is the share of it the GPU was busy, and what is left is the GPU waiting for
the host. The events are read as they complete (`Event.query`, which does not wait), so a
long run keeps only the few spans still in flight.

A guided step's sampling is queued by the next launch, once its grammar mask is filled
(engine/guided.py): its span includes the device's wait for that launch, so with guided
requests the share overstates how busy the device was.
"""

from __future__ import annotations

from collections import deque

import torch


class DeviceTimer:
    def __init__(self, keep_spans: bool = False) -> None:
        self.busy_seconds = 0.0  # summed spans of the steps completed so far
        self.num_spans = 0
        self._begin: torch.cuda.Event | None = None
        self._open: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        # Every span's events, for benchmarks that look at steps one by one.
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = (
            [] if keep_spans else None)

    def start(self) -> None:
        """A step's device work begins here in the stream."""
        self._begin = torch.cuda.Event(enable_timing=True)
        self._begin.record()

    def stop(self) -> None:
        """The step started last ends here in the stream."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((self._begin, end))
        if self.spans is not None:
            self.spans.append((self._begin, end))
        self._drain()

    def total_seconds(self) -> float:
        """Busy seconds of every span that has completed by now."""
        self._drain()
        return self.busy_seconds

    def _drain(self) -> None:
        while self._open and self._open[0][1].query():
            begin, end = self._open.popleft()
            self.busy_seconds += begin.elapsed_time(end) / 1e3
            self.num_spans += 1
