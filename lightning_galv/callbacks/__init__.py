"""Lightning callbacks: online profiling and the predicted-vs-measured plan monitor (issue 13).

Imports Lightning (unlike the planner); nothing here is imported by the package root.
"""

from .monitor import PlanMonitor, calibration_path
from .online_profiler import OnlineProfiler, StepRecord

__all__ = ["OnlineProfiler", "PlanMonitor", "StepRecord", "calibration_path"]
