"""Factories the tuner benchmark's trials import (trials run in fresh processes)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from lightning_galv.demo.module import CausalLM


def module() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(kind="llama", vocab_size=256, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=384,
                    max_seq_len=64, optimizer="adamw", lr=1e-3)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(torch.randint(0, 256, (512, 65), generator=g), batch_size=4)
