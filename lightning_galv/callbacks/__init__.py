"""Lightning callbacks: online profiling, the predicted-vs-measured plan monitor (issue 13), a loss log.

Imports Lightning (unlike the planner); nothing here is imported by the package root.
"""

from .loss_log import LossLog
from .monitor import PlanMonitor, calibration_path
from .online_profiler import OnlineProfiler, StepRecord

__all__ = ["LossLog", "OnlineProfiler", "PlanMonitor", "StepRecord", "calibration_path"]
