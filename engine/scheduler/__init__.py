"""The turn-level scheduler: priority slots, retry budgets, and partial rollout across weight updates."""

from engine.scheduler.partial import VersionClock, mask_offpolicy
from engine.scheduler.queue import Phase, Policy, PriorityLimiter, SchedulerStatistics
from engine.scheduler.reference import run_trajectory
from engine.scheduler.retry import CircuitBreaker, RetryBudget, RetryPolicy
from engine.scheduler.scheduler import Scheduler

__all__ = [
    "CircuitBreaker",
    "Phase",
    "Policy",
    "PriorityLimiter",
    "RetryBudget",
    "RetryPolicy",
    "Scheduler",
    "SchedulerStatistics",
    "VersionClock",
    "mask_offpolicy",
    "run_trajectory",
]
