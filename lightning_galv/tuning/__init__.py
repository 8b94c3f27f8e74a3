"""The Optuna tuner: the analytic search's best plans and their neighbours, measured by real short runs.

``tune(...)`` (:mod:`.tuner`) drives an Optuna study whose trials are plans; :mod:`.trial` is what runs
inside a trial's ranks; ``largest_batch(...)`` (:mod:`.batch`) finds the largest batch a plan fits, by the
same trials. Imports Optuna and Lightning lazily: ``import lightning_galv.tuning`` is cheap.
"""

from .batch import BatchSearch, BatchTrial, largest_batch
from .tuner import TuneResult, neighbours, tune

__all__ = ["BatchSearch", "BatchTrial", "TuneResult", "largest_batch", "neighbours", "tune"]
