"""DeviceTimer's bookkeeping on the CPU, with stand-in CUDA events: spans are summed once
their end has completed, in order, and nothing else is waited for."""

import pytest

from pagedserve.engine import device_timer
from pagedserve.engine.device_timer import DeviceTimer


class FakeEvent:
    """A CUDA event whose completion and time the test decides."""

    clock = 0.0
    done_until = 0.0  # events recorded at or before this time have completed

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = FakeEvent.clock

    def query(self) -> bool:
        return self.at is not None and self.at <= FakeEvent.done_until

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query()
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


@pytest.fixture
def fake_events(monkeypatch):
    monkeypatch.setattr(device_timer.torch.cuda, "Event", FakeEvent)
    FakeEvent.clock = FakeEvent.done_until = 0.0
    return FakeEvent


def _step(timer: DeviceTimer, events, start: float, end: float) -> None:
    events.clock = start
    timer.start()
    events.clock = end
    timer.stop()


def test_spans_are_summed_as_they_complete(fake_events) -> None:
    timer = DeviceTimer(keep_spans=True)
    _step(timer, fake_events, 0.0, 0.002)
    _step(timer, fake_events, 0.003, 0.006)
    _step(timer, fake_events, 0.006, 0.007)
    assert timer.total_seconds() == 0.0  # nothing has completed on the device yet
    fake_events.done_until = 0.0065  # the first two steps have, the third has not
    assert timer.total_seconds() == pytest.approx(0.005)
    assert timer.num_spans == 2
    fake_events.done_until = 1.0
    assert timer.total_seconds() == pytest.approx(0.006)
    assert timer.num_spans == 3 and len(timer.spans) == 3


def test_the_runner_times_only_on_cuda_with_the_variable(monkeypatch) -> None:
    from pagedserve import LLM

    monkeypatch.setenv("PAGEDSERVE_DEVICE_TIMING", "1")
    llm = LLM(model="random:tiny", device="cpu", dtype="float32", attention_backend="CPU",
              kv_cache_memory="16MiB")
    assert llm.engine.runner.device_timer is None  # CUDA events only
    assert llm.engine.call_utility("stats").device_seconds == 0.0
