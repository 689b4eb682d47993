"""Continuous-batching scheduler and the per-step metadata it emits."""

from pagedserve.scheduler.metadata import BlockTable, CommonAttentionMetadata, CommonMetadataBuilder
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.scheduler import Scheduler

__all__ = [
    "BlockTable",
    "CommonAttentionMetadata",
    "CommonMetadataBuilder",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
]
