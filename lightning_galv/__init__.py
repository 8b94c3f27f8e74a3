"""lightning_galv: automatic hybrid parallelism (Galvatron-style plans) for PyTorch Lightning.

``import lightning_galv`` registers ``strategy="galvatron"`` and its presets with Lightning.
"""

from .plan import LayerStrategy, ModelShape, ParallelPlan, Prediction
from .strategies.galvatron import GalvatronStrategy

__all__ = ["GalvatronStrategy", "LayerStrategy", "ModelShape", "ParallelPlan", "Prediction"]
__version__ = "0.1.0"


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if "galvatron" not in StrategyRegistry:
        GalvatronStrategy.register_strategies(StrategyRegistry)


_register()
