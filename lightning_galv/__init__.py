"""lightning_galv: automatic hybrid parallelism (Galvatron-style plans) for PyTorch Lightning.

``import lightning_galv`` registers ``strategy="galvatron"`` and its presets with Lightning.
"""

from .plan import LayerStrategy, ModelShape, ParallelPlan, Prediction
from .strategies.galvatron import GalvatronStrategy

__all__ = ["GalvatronStrategy", "LayerStrategy", "ModelShape", "ParallelPlan", "Prediction", "cross_entropy", "loss"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``lightning_galv.cross_entropy`` / ``lightning_galv.loss``, imported on first use."""
    if name in ("cross_entropy", "loss"):
        import importlib

        module = importlib.import_module(".loss", __name__)
        return module if name == "loss" else module.cross_entropy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if "galvatron" not in StrategyRegistry:
        GalvatronStrategy.register_strategies(StrategyRegistry)


_register()
