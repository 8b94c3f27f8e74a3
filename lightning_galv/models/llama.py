"""A LLaMA-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..plan import ModelShape
from .common import CoreAttention, RMSNorm, Rotary, init_weights
from .dropout import KeyedDropout, assign_sites


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128
    max_seq_len: int = 64
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    dropout: float = 0.0  # residual dropout after attention and feed-forward (keyed: same mask under any plan)

    def to_dict(self) -> dict:
        return asdict(self)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, rope: Rotary) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.core = CoreAttention(rope)
        self.drop = KeyedDropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)  # [b, s, local heads, d]
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        out = self.core(q, k, v)  # [b, s, local heads, d]
        return self.drop(self.wo(out.reshape(b, s, -1)))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.drop = KeyedDropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class LlamaBlock(nn.Module):
    galv_tp_plan = {
        "attention_norm": "norm", "attention.wq": "colwise", "attention.wk": "colwise",
        "attention.wv": "colwise", "attention.wo": "rowwise",
        "ffn_norm": "norm", "feed_forward.w1": "colwise", "feed_forward.w3": "colwise",
        "feed_forward.w2": "rowwise",
    }
    galv_attention = "attention.core"

    def __init__(self, cfg: LlamaConfig, rope: Rotary) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = LlamaAttention(cfg, rope)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.dim, cfg.ffn_hidden, cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class DecoderLayout(nn.Module):
    """The LLaMA layout -- ``tok_embeddings``, ``layers``, ``norm``, ``output`` -- with its forward and the block
    protocol (:mod:`.protocol`) on it. :class:`Llama` and the MoE decoder (``models/moe.py``) share it: they
    differ only in which blocks ``layers`` holds. Subclasses set ``cfg`` (n_layers, dim, n_heads, n_kv_heads,
    ffn_hidden, vocab_size, max_seq_len) and the four modules."""

    cfg: Any
    tok_embeddings: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    output: nn.Linear

    @property
    def galv_blocks(self) -> nn.ModuleList:
        return self.layers

    @property
    def galv_embedding(self) -> nn.Embedding:
        return self.tok_embeddings

    @property
    def galv_final_norm(self) -> nn.Module:
        return self.norm

    @property
    def galv_head(self) -> nn.Linear:
        return self.output

    def galv_shape(self, seq_len: int | None = None) -> ModelShape:
        """Dense facts: attention and the dense blocks' ffn width (an MoE decoder describes its experts apart)."""
        c = self.cfg
        return ModelShape(c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.ffn_hidden, c.vocab_size,
                          seq_len or c.max_seq_len)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # [b, s, dim]
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # [b, s, vocab]


class Llama(DecoderLayout):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"LlamaConfig(dim={cfg.dim}, n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}): "
                             "dim must be divisible by n_heads and n_heads by n_kv_heads. "
                             "HINT: e.g. dim=64, n_heads=4, n_kv_heads=2.")
        self.cfg = cfg
        rope = Rotary(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg, rope) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        init_weights(self)
        assign_sites(self)
