"""The guided-decoding fill thread: jobs run in order, errors reach the caller, and the
switch interval is lowered only while a job of any engine in the process runs."""

import sys
import threading

import pytest

from pagedserve.structured_output.manager import FillThread


def test_jobs_run_on_the_thread_and_the_interval_comes_back() -> None:
    before = sys.getswitchinterval()
    threads: list[str] = []
    fills = [FillThread(), FillThread()]  # two engines of one process
    try:
        for _ in range(3):
            fills[0].submit(lambda: threads.append(threading.current_thread().name))
            fills[1].submit(lambda: threads.append(threading.current_thread().name))
            assert sys.getswitchinterval() <= FillThread.SWITCH_INTERVAL_S
            fills[0].wait()
            assert sys.getswitchinterval() <= FillThread.SWITCH_INTERVAL_S  # one still runs
            fills[1].wait()
            assert sys.getswitchinterval() == before
        assert threads == ["bitmask-fill"] * 6
    finally:
        for fill in fills:
            fill.shutdown()


def test_a_job_error_reaches_the_waiter_and_an_unwaited_job_is_waited_for() -> None:
    fill = FillThread()
    ran: list[int] = []
    try:
        fill.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            fill.wait()
        fill.submit(lambda: ran.append(1))
        fill.submit(lambda: ran.append(2))  # the first one is waited for first
        fill.wait()
        fill.wait()  # nothing running: returns at once
        assert ran == [1, 2]
    finally:
        fill.shutdown()
