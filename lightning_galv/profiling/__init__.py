"""Profilers that measure this machine and model and emit planner profiles (imports torch)."""

from .profilers import HardwareProfiler, ModelProfiler

__all__ = ["HardwareProfiler", "ModelProfiler"]
