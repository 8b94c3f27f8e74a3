"""The planner: profiles -> cost model -> search (pure Python + numpy; no torch.distributed, no Lightning)."""

from .cost import CostModel, GalvatronCostModel, PlanCost
from .profiles import HardwareProfile, ModelProfile, ProfileCache
from .search import SearchResult, SearchSpace, search

__all__ = ["CostModel", "GalvatronCostModel", "HardwareProfile", "ModelProfile", "PlanCost", "ProfileCache",
           "SearchResult", "SearchSpace", "search"]
