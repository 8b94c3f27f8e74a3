"""A plain LightningModule for causal language modelling with the reference decoders.

Nothing in it knows about parallelism: it is what a user writes, and the strategy does the rest.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F

from .models import GPT2, GPT2Config, Llama, LlamaConfig


def build_model(kind: str = "llama", **config: Any) -> torch.nn.Module:
    if kind == "llama":
        return Llama(LlamaConfig(**config))
    if kind == "gpt2":
        return GPT2(GPT2Config(**config))
    raise ValueError(f"model kind {kind!r}: must be 'llama' or 'gpt2'. HINT: --model.kind llama")


class CausalLM(L.LightningModule):
    """Next-token prediction on ``[batch, seq+1]`` token windows."""

    def __init__(self, kind: str = "llama", lr: float = 3e-3, weight_decay: float = 0.0,
                 optimizer: str = "adamw", momentum: float = 0.0, **config: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_model(kind, **config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self(x)  # [b, s, vocab]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch[:, :-1]).argmax(-1)

    def configure_optimizers(self) -> Any:
        h = self.hparams
        if h.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=h.lr, momentum=h.momentum, weight_decay=h.weight_decay)
        return torch.optim.AdamW(self.parameters(), lr=h.lr, weight_decay=h.weight_decay)
