"""A GPT-2-style decoder: learned positions, LayerNorm, GELU MLP, multi-head attention."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..plan import ModelShape
from .common import CoreAttention, init_weights
from .dropout import KeyedDropout, assign_sites


@dataclass
class GPT2Config:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 64
    dropout: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.dim)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim)
        self.c_proj = nn.Linear(cfg.dim, cfg.dim)
        self.core = CoreAttention(None)
        self.drop = KeyedDropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)  # [b, s, local heads, d]
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        return self.drop(self.c_proj(self.core(q, k, v).reshape(b, s, -1)))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.c_proj = nn.Linear(4 * cfg.dim, cfg.dim)
        self.drop = KeyedDropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    galv_tp_plan = {
        "ln_1": "norm", "attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
        "attn.c_proj": "rowwise", "ln_2": "norm", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise",
    }
    galv_attention = "attn.core"

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads:
            raise ValueError(f"GPT2Config(dim={cfg.dim}, n_heads={cfg.n_heads}): dim must be divisible by "
                             "n_heads. HINT: e.g. dim=64, n_heads=4.")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.drop = KeyedDropout(cfg.dropout)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)  # untied: vocab-parallel friendly
        init_weights(self)
        assign_sites(self)

    @property
    def galv_blocks(self) -> nn.ModuleList:
        return self.h

    @property
    def galv_embedding(self) -> nn.Embedding:
        return self.wte

    @property
    def galv_final_norm(self) -> nn.Module:
        return self.ln_f

    @property
    def galv_head(self) -> nn.Linear:
        return self.lm_head

    def galv_shape(self, seq_len: int | None = None) -> ModelShape:
        c = self.cfg
        return ModelShape(c.n_layers, c.dim, c.n_heads, c.n_heads, 4 * c.dim, c.vocab_size,
                          seq_len or c.max_seq_len)

    def galv_embed_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token + position embedding (the first pipeline stage runs this part of forward)."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(pos))  # [b, s, dim] + [s, dim]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.galv_embed_forward(tokens)
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))  # [b, s, vocab]
