"""Reference decoders addressed block by block by a ParallelPlan (see `protocol`)."""

from .gpt2 import GPT2, GPT2Config
from .llama import Llama, LlamaConfig
from .moe import MoEConfig, MoEDecoder, RoutingLog, RoutingStats
from .protocol import ModelParts, find_parts

__all__ = ["GPT2", "GPT2Config", "Llama", "LlamaConfig", "MoEConfig", "MoEDecoder", "ModelParts", "RoutingLog",
           "RoutingStats", "find_parts"]
