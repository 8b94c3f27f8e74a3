"""lightning_galv: automatic hybrid parallelism (Galvatron-style plans) for PyTorch Lightning."""

from .plan import LayerStrategy, ModelShape, ParallelPlan, Prediction

__all__ = ["LayerStrategy", "ModelShape", "ParallelPlan", "Prediction"]
__version__ = "0.1.0"
