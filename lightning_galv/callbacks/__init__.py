"""Lightning callbacks: online profiling and the predicted-vs-measured plan monitor (issue 13), and the
per-step MoE callbacks (issue 12).

Imports Lightning (unlike the planner); nothing here is imported by the package root.
"""

from .moe import ExpertRelayout, SamplePlacement
from .monitor import PlanMonitor, calibration_path
from .online_profiler import OnlineProfiler, StepRecord

__all__ = ["ExpertRelayout", "SamplePlacement", "OnlineProfiler", "PlanMonitor", "StepRecord", "calibration_path"]
