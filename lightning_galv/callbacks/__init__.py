"""Lightning callbacks: online profiling and the predicted-vs-measured plan monitor (issue 13), the
per-step MoE callbacks (issue 12), and a rank-0 loss log for runs without a progress bar (issue 16).

Imports Lightning (unlike the planner); nothing here is imported by the package root.
"""

from .loss_log import LossLog
from .moe import ExpertRelayout, SamplePlacement
from .monitor import PlanMonitor, calibration_path
from .online_profiler import OnlineProfiler, StepRecord

__all__ = ["ExpertRelayout", "LossLog", "SamplePlacement", "OnlineProfiler", "PlanMonitor", "StepRecord",
           "calibration_path"]
