"""The planner: profiles -> cost model -> search (pure Python + numpy; no torch.distributed, no Lightning).

``profiles`` (what was measured), ``cost`` (the :class:`CostModel` interface and the Galvatron-style
model), ``galvatron_model`` (Galvatron 2.4's own accounting as a cost model, opt-in), ``contract`` (what
any cost model must satisfy), and the search in steps: ``space`` (what may be chosen), ``pareto`` (dominance), ``layer_dp`` (strategies per layer), ``partition`` (layers per
stage), ``searcher`` (one pipeline configuration), ``search`` (the outer loop), ``explain`` (the account).
"""

from .cost import CostModel, GalvatronCostModel, PlanCost
from .galvatron_model import Galvatron24CostModel, galvatron_search
from .profiles import HardwareProfile, ModelProfile, ProfileCache
from .search import SearchResult, search
from .space import SearchSpace

__all__ = ["CostModel", "Galvatron24CostModel", "GalvatronCostModel", "HardwareProfile", "ModelProfile", "PlanCost", "ProfileCache",
           "SearchResult", "SearchSpace", "galvatron_search", "search"]
