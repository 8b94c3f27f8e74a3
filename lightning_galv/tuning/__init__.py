"""The Optuna tuner: the analytic search's best plans and their neighbours, measured by real short runs.

``tune(...)`` (:mod:`.tuner`) drives an Optuna study whose trials are plans; :mod:`.trial` is what runs
inside a trial's ranks. Imports Optuna and Lightning lazily: ``import lightning_galv.tuning`` is cheap.
"""

from .tuner import TuneResult, neighbours, tune

__all__ = ["TuneResult", "neighbours", "tune"]
