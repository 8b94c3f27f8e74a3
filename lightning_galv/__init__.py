"""lightning_galv: automatic hybrid parallelism (Galvatron-style plans) for PyTorch Lightning.

``import lightning_galv`` registers ``strategy="galvatron"`` and its presets with Lightning, without
importing torch or Lightning itself: plans and the planner are pure Python, so ``galv --help``,
``galv plan show`` and ``import lightning_galv.planner`` stay fast and work where torch is absent. The
strategy class is imported on first use (``lightning_galv.GalvatronStrategy``, or when a Trainer asks
the registry for ``"galvatron"``); the registration happens as soon as Lightning's strategy registry
exists (now, if Lightning is already imported, else right after Lightning imports it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from .plan import LayerStrategy, ModelShape, ParallelPlan, Prediction

__all__ = ["GalvatronStrategy", "LayerStrategy", "ModelShape", "ParallelPlan", "Prediction", "cross_entropy", "loss"]
__version__ = "0.1.0"

# registered names -> the uniform-plan shortcut each stands for ("galvatron" alone means automatic)
PRESETS: dict[str, dict[str, Any]] = {
    "galvatron": {},
    "galvatron_dp": dict(zero=0), "galvatron_zero1": dict(zero=1), "galvatron_zero2": dict(zero=2),
    "galvatron_zero3": dict(zero=3), "galvatron_tp": dict(tp=2), "galvatron_tp_sp": dict(tp=2, sp="megatron"),
    "galvatron_ulysses": dict(tp=2, sp="ulysses"),
}

# public names imported on first use: name -> (module, attribute or None for the module itself)
_LAZY = {"GalvatronStrategy": ("lightning_galv.strategies.galvatron", "GalvatronStrategy"),
         "cross_entropy": ("lightning_galv.loss", "cross_entropy"), "loss": ("lightning_galv.loss", None)}
_REGISTRY_MODULE = "lightning.pytorch.strategies"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'lightning_galv' has no attribute {name!r}")


def _make_strategy(**kwargs: Any) -> Any:
    """What the registry calls for a registered name (imports the strategy only then)."""
    from .strategies.galvatron import GalvatronStrategy

    return GalvatronStrategy(**kwargs)


def register(registry: Any) -> None:
    """Add ``galvatron`` and its presets to a Lightning strategy registry (idempotent)."""
    for name, kw in PRESETS.items():
        if name not in registry:
            what = "automatic plan" if not kw else f"uniform plan {kw}"
            registry.register(name, _make_strategy, description=f"Galvatron hybrid parallelism ({what})", **kw)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers the strategies right after Lightning's strategy registry module has executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)  # one shot; also lets the real finders answer below
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        inner = loader.exec_module

        def exec_module(module: Any) -> None:
            inner(module)
            register(module.StrategyRegistry)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _REGISTRY_MODULE in sys.modules:
    register(sys.modules[_REGISTRY_MODULE].StrategyRegistry)
elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterImport())
