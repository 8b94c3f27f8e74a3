"""Importable factories and fault-injecting callbacks for the tuner tests (trials run in fresh processes)."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

from lightning_galv.demo.module import CausalLM


def tiny_module() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(kind="llama", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                    max_seq_len=16, optimizer="sgd", lr=0.01)


def tiny_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(torch.randint(0, 64, (64, 17), generator=g), batch_size=4)


class Faults(L.Callback):
    """By plan: checkpointing -> slow (pruned), ZeRO-3 -> crash, tp > 1 -> out of memory, Ulysses -> hang."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        layers = trainer.strategy.plan.layers
        if any(s.checkpoint for s in layers):
            time.sleep(1.5)
        if any(s.zero == 3 for s in layers):
            raise RuntimeError("injected crash (ZeRO-3 plan)")
        if any(s.ulysses for s in layers):
            time.sleep(3600)
        if any(s.tp > 1 and not s.ulysses for s in layers):
            raise torch.OutOfMemoryError("injected: out of memory (tp plan)")


def faults() -> Faults:
    return Faults()


class AbortOnce(L.Callback):
    """Rank 1 dies of SIGABRT at its first batch, once per marker file (a launch fault the tuner relaunches)."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        import os
        from pathlib import Path

        marker = Path(os.environ["GALV_TEST_ABORT_MARKER"])
        if trainer.global_rank == 1 and trainer.global_step == 0 and not marker.exists():
            marker.write_text("aborted once")
            os.abort()


def abort_once() -> AbortOnce:
    return AbortOnce()


def wide_module() -> CausalLM:
    """Most of its memory is the logits (vocab 4096 x 64 positions, ~1 MiB per sample): peak memory grows
    with the batch by much more than the few-MiB noise of a CPU process' resident-set high-water mark."""
    torch.manual_seed(0)
    return CausalLM(kind="llama", vocab_size=4096, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                    max_seq_len=64, optimizer="sgd", lr=0.01)


def wide_data(batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(torch.randint(0, 4096, (256, 65), generator=g), batch_size=batch_size)


def _faulty_collate(rows: list[torch.Tensor]) -> torch.Tensor:
    """By batch size: >= 8 a crash (a bug, not memory), >= 4 out of memory, else the batch."""
    if len(rows) >= 8:
        raise RuntimeError(f"injected crash at batch {len(rows)}")
    if len(rows) >= 4:
        raise torch.OutOfMemoryError(f"injected: out of memory at batch {len(rows)}")
    return torch.stack(rows)


def faulty_data(batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(torch.randint(0, 64, (64, 17), generator=g), batch_size=batch_size, collate_fn=_faulty_collate)
