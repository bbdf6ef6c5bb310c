from kvstrata.engine.scheduler.base import Scheduler, SchedulerOutput
from kvstrata.engine.scheduler.prefill_first import PrefillFirstScheduler, StaticScheduler
from kvstrata.engine.scheduler.sarathi import SarathiScheduler

SCHEDULERS = ("sarathi", "prefill-first", "static")

__all__ = ["SCHEDULERS", "PrefillFirstScheduler", "SarathiScheduler", "Scheduler", "SchedulerOutput", "StaticScheduler"]
