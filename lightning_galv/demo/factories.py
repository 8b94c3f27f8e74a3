"""Importable factories for ``galv tune`` recipes (``recipes/tune_tiny.yaml``).

Why factories and not a LightningCLI recipe: every tuning trial is a fresh set of processes
(:mod:`lightning_galv.tuning.trial`), which rebuild the model and the data from import paths. These build the
demo's tiny LLaMA-style model and windows over the shipped corpus (tokenized once, then read from the
token cache by every trial).
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from .corpus import TokenWindows, load_tokens
from .module import CausalLM

TINY = dict(kind="llama", vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
            max_seq_len=32)


def tiny_module() -> CausalLM:
    """A 2-block model small enough for a trial of a few steps on CPU ranks (seeded: every trial starts alike)."""
    torch.manual_seed(0)
    return CausalLM(lr=3e-3, **TINY)


def corpus_loader(batch_size: int = 4) -> DataLoader:
    """Token windows of the shipped corpus, ``batch_size`` per data shard (the batch-size search resizes it)."""
    return DataLoader(TokenWindows(load_tokens(), int(TINY["max_seq_len"])), batch_size=batch_size, shuffle=True,
                      drop_last=True)
