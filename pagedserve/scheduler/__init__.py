"""Continuous-batching scheduler: which requests run each step, with how many tokens."""

from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.scheduler.request import Request, RequestStatus, ScoringTask
from pagedserve.scheduler.scheduler import Scheduler

__all__ = [
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "ScoringTask",
]
