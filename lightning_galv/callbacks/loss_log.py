"""A per-step loss line on rank 0 for runs without a progress bar.

``galv fit`` recipes and the demo run several processes whose output is interleaved or piped to a file,
where Lightning's progress bar is off or unreadable; without this callback such a run printed no loss at
all. It prints only when the Trainer has no progress bar (else the bar already shows ``train_loss``), only
on global rank 0, and only plain lines (greppable, fine in CI logs).
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as L


class LossLog(L.Callback):
    """Print ``step N  loss X`` on rank 0 every ``every`` optimizer steps (and at the first and last step).

    ``bar=True`` adds a bar of ``#`` proportional to the loss (the demo's curve). The value is the logged
    ``metric`` (``train_loss`` by default, what :class:`~lightning_galv.demo.module.CausalLM` logs), else
    the loss the training step returned.
    """

    def __init__(self, every: int = 10, metric: str = "train_loss", bar: bool = False) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r}: must be a positive int. HINT: LossLog(every=10).")
        self.every, self.metric, self.bar = every, metric, bar
        self.points: list[tuple[int, float]] = []
        self._start = 0.0
        self._last_printed = -1

    def _active(self, trainer: L.Trainer) -> bool:
        return trainer.is_global_zero and trainer.progress_bar_callback is None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._active(trainer):
            return
        step = trainer.global_step
        last = trainer.max_steps is not None and step == trainer.max_steps
        if step == self._last_printed or not (step == 1 or step % self.every == 0 or last):
            return
        value = trainer.callback_metrics.get(self.metric)
        if value is None and isinstance(outputs, dict) and "loss" in outputs:
            value = outputs["loss"]
        if value is None:
            return
        loss = float(value)
        self.points.append((step, loss))
        self._last_printed = step
        bar = ("  " + "#" * max(1, int(loss * 8))) if self.bar and math.isfinite(loss) else ""
        print(f"step {step:4d}  loss {loss:6.3f}{bar}", flush=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._active(trainer):
            print(f"trained {trainer.global_step} steps in {time.perf_counter() - self._start:.1f}s", flush=True)
