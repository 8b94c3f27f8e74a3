"""Pieces shared by the reference decoders."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CoreAttention(nn.Module):
    """Causal scaled-dot-product attention on ``[batch, seq, heads, head_dim]`` tensors.

    Kept as its own module so sequence parallelism can wrap it (Ulysses exchanges heads for
    sequence around exactly this call). Rotary embedding is applied here, on the full sequence, so
    it is correct whatever the sequence sharding outside.
    """

    def __init__(self, rope: "Rotary | None" = None) -> None:
        super().__init__()
        self.rope = rope

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        rep = q.shape[2] // k.shape[2]  # grouped-query attention: share each kv head over `rep` q heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)  # [b, h, s, d]
        return out.transpose(1, 2)  # [b, s, h, d]


class Rotary(nn.Module):
    """Rotary position embedding (RoPE) with real cos/sin tables (DTensor-friendly)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        ang = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)  # [s, d/2]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        cos = self.cos[:s].to(x.dtype)[None, :, None, :]  # [1, s, 1, d/2]
        sin = self.sin[:s].to(x.dtype)[None, :, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # [b, s, h, d/2, 2]
        return out.flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
