"""A plain LightningModule for causal language modelling with the reference decoders.

Nothing in it knows about parallelism: it is what a user writes, and the strategy does the rest. The one
concession is the loss: :func:`lightning_galv.loss.cross_entropy` is ``F.cross_entropy`` on plain logits,
and computes the same loss on vocab-sharded logits, so the module declares ``galv_vocab_parallel_loss``.

``kind="moe"`` builds :class:`~lightning_galv.models.moe.MoEDecoder`. Its load-balancing and z-losses do
not enter the returned loss: each MoE layer injects their gradient in backward (see the model's module
docstring), scaled like the LM loss (``1 / accumulate_grad_batches``, set before every training batch);
the loss returned and logged as ``train_loss`` stays the pure cross entropy, the aux values are logged as
``train_aux_loss`` / ``train_z_loss`` (unweighted, summed over MoE layers).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch

from ..loss import cross_entropy
from ..models import GPT2, GPT2Config, Llama, LlamaConfig, MoEConfig, MoEDecoder

MOE_OPTIONS = ("num_experts", "top_k", "expert_hidden", "renormalize", "shared_expert_hidden", "shared_expert_gate",
               "moe_every", "moe_layers", "capacity_factor", "aux_loss_weight", "z_loss_weight")


def build_model(kind: str = "llama", **config: Any) -> torch.nn.Module:
    """``kind`` in {"llama", "gpt2", "moe"}; ``None`` values mean the config's default."""
    config = {k: v for k, v in config.items() if v is not None}
    if kind == "moe":
        return MoEDecoder(MoEConfig(**config))
    moe = sorted(k for k in config if k in MOE_OPTIONS)
    if moe:
        raise ValueError(f"model kind {kind!r} with MoE options {moe}: only kind='moe' has experts. "
                         "HINT: --model.kind moe, or drop the MoE options.")
    if kind == "llama":
        return Llama(LlamaConfig(**config))
    if kind == "gpt2":
        config.pop("n_kv_heads", None)
        config.pop("ffn_hidden", None)
        return GPT2(GPT2Config(**config))
    raise ValueError(f"model kind {kind!r}: must be 'llama', 'gpt2' or 'moe'. HINT: --model.kind llama")


class CausalLM(L.LightningModule):
    """Next-token prediction on ``[batch, seq+1]`` token windows."""

    # Every training loss below goes through lightning_galv.loss.cross_entropy, so a vocab-parallel head
    # may hand it vocab-sharded logits (GalvatronStrategy reads this unless told otherwise).
    galv_vocab_parallel_loss = True

    def __init__(self, kind: str = "llama", vocab_size: int = 256, dim: int = 64, n_layers: int = 4,
                 n_heads: int = 4, n_kv_heads: int | None = None, ffn_hidden: int | None = None,
                 max_seq_len: int = 64, lr: float = 3e-3, weight_decay: float = 0.0, optimizer: str = "adamw",
                 momentum: float = 0.0, dropout: float = 0.0,
                 num_experts: int | None = None, top_k: int | None = None, expert_hidden: int | None = None,
                 renormalize: bool | None = None, shared_expert_hidden: int | None = None,
                 shared_expert_gate: bool | None = None, moe_every: int | None = None,
                 moe_layers: tuple[int, ...] | None = None, capacity_factor: float | None = None,
                 aux_loss_weight: float | None = None, z_loss_weight: float | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer={optimizer!r}: must be 'adamw' or 'sgd'. HINT: --model.optimizer adamw")
        moe = {k: getattr(self.hparams, k) for k in MOE_OPTIONS}  # None = MoEConfig default (kind='moe' only)
        self.model = build_model(kind, vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads,
                                 n_kv_heads=n_kv_heads, ffn_hidden=ffn_hidden, max_seq_len=max_seq_len,
                                 dropout=dropout, **moe)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        return cross_entropy(self(x), y)  # logits [b, s, vocab] (maybe vocab-sharded), targets [b, s]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # MoE aux-loss gradients are injected in backward, outside the loss Lightning divides by the
        # accumulation factor: scale them the same way (pipelines also divide every gradient by their
        # micro-batch count, which covers the injected part as well). Under manual optimization the loss is
        # scaled by the user's own code, so the aux scale is theirs to set too (``model.set_aux_grad_scale``,
        # like the factor they divide the loss by); it is left as they set it.
        set_scale = getattr(self.model, "set_aux_grad_scale", None)
        if callable(set_scale) and self.automatic_optimization:
            set_scale(1.0 / self.trainer.accumulate_grad_batches)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        aux = getattr(self.model, "aux_losses", None)
        for name, value in (aux() if callable(aux) else {}).items():
            self.log(f"train_{name}", value, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch[:, :-1]).argmax(-1)

    # -- pipeline protocol (used by GalvatronStrategy when the plan has pp > 1) --
    def galv_pipeline_batch(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[:, :-1], batch[:, 1:]

    def galv_pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, targets)

    def galv_pipeline_predict(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)

    def on_pipeline_loss(self, loss: torch.Tensor, stage: str) -> None:
        self.log(f"{stage}_loss", loss, prog_bar=stage == "train", sync_dist=True)

    def configure_optimizers(self) -> Any:
        h = self.hparams
        if h.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=h.lr, momentum=h.momentum, weight_decay=h.weight_decay)
        return torch.optim.AdamW(self.parameters(), lr=h.lr, weight_decay=h.weight_decay)
