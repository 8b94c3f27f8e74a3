"""Profilers that measure this machine and model and emit planner profiles (imports torch)."""

from .profilers import HardwareProfiler, ModelProfiler
from .routing import measure_routing_skew

__all__ = ["HardwareProfiler", "ModelProfiler", "measure_routing_skew"]
