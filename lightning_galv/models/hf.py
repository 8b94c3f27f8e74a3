"""Hugging Face ``transformers`` causal LMs under any plan, without rewriting them.

:func:`galv_hf` (or :class:`HFCausalLM`) takes an ``AutoModelForCausalLM`` instance and exposes the block
protocol (:mod:`.protocol`) on it. Nothing is copied or renamed: the adapter holds the model as its child
``hf``, so ``adapter.hf.state_dict()`` has the model's own keys and loads into (or from) any copy of it.

How the parts are found -- from the model's own structure and metadata, not from a table per class:

* **blocks**: the ``nn.ModuleList`` of the base model (``model.base_model``) whose modules are of the class
  the model names in ``_no_split_modules`` (``LlamaDecoderLayer``, ``GPT2Block``, ...);
* **embedding / head**: ``get_input_embeddings()`` / ``get_output_embeddings()``; **final norm**: the base
  model's direct child holding only ``[hidden]`` vectors (``norm``, ``ln_f``); learned **positions**: its
  other ``nn.Embedding`` (GPT-2's ``wpe``); **rotary** tables: its child with an ``inv_freq`` buffer;
* **sparse MoE blocks** (Mixtral's ``mlp``: a ``gate`` router and fused ``experts``): replaced, under the same
  name and with the same children, by :class:`~.hf_moe.HFSparseMoE`, an MoE layer of this package's runtime;
* **projections** (``galv_tp_plan``, set on every block): translated from ``config.base_model_tp_plan``:

  =====================================  ==============================================================
  Hugging Face entry                     lightning_galv entry (block-relative path, ``layers.*.`` cut)
  =====================================  ==============================================================
  ``"colwise"``                          ``"colwise"`` (Megatron column split of an ``nn.Linear``)
  ``"rowwise"``                          ``"rowwise"`` (Megatron row split)
  any entry inside the MoE block          the MoE block (parent of the ``base_model_ep_plan``'s
  (``mlp.experts*``: ``packed_colwise``,  ``"ep_router"``, e.g. ``mlp``) becomes ``"replicated"``: router
  ``moe_tp_experts``)                    and experts run whole on the full sequence on each tp rank
  anything else                          ``ValueError`` with a ``HINT`` (no silent guess)
  =====================================  ==============================================================

  and every other parameter-holding submodule of the block whose parameters are all ``[hidden]`` vectors
  (the RMSNorm / LayerNorm layers, which HF's plan does not list) becomes ``"norm"`` (sequence-sharded under
  Megatron-SP). A submodule with other parameters that the plan does not cover refuses tensor parallelism.
* **core attention** (``galv_attention``, for Ulysses): the adapter registers an attention function
  ``"galv"`` with transformers' ``AttentionInterface`` and selects it (``set_attn_implementation``). It
  hands ``q, k, v`` as ``[batch, seq, heads, head_dim]`` to a parameter-free ``galv_core`` module inside each
  attention module, which runs the model's original implementation (``sdpa`` / ``eager`` / ...). Ulysses
  hooks that module; rotary tables are cut to the positions a Ulysses rank holds (HF applies rotary before
  the attention function, on the sequence chunk).

What each family supports (``tests/test_hf_models.py`` trains each family under hybrid plans against one process,
fp32; its cases list which strategy ran on which family):

==========================  ==========================================================================
LLaMA, Qwen2, Mistral        everything: DP, ZeRO-1/2/3, TP, TP + Megatron-SP, Ulysses, checkpointing, pp,
                             vocab-parallel embedding / head (one structure; pp is exercised on LLaMA)
Mixtral (MoE)                the same, the MoE block replicated on tp ranks, and **expert parallelism**
                             (``ep > 1``) through this package's all-to-all EP, not HF's own (which
                             all-reduces replicated tokens): the sparse MoE block becomes an
                             :class:`~.hf_moe.HFSparseMoE` over HF's own router and fused experts, same keys
                             (:mod:`.hf_moe`). HF's router load-balancing loss is added (as a gradient) when
                             ``output_router_logits=True``; then pp is refused.
GPT-2                        DP, ZeRO, Ulysses, checkpointing, pp, vocab-parallel embedding / head;
                             Megatron TP / SP of the blocks is **refused**: GPT-2 publishes no TP plan and
                             fuses q/k/v in one ``Conv1D`` (``c_attn``) whose column split would have to keep
                             q, k and v of a head together on each rank
==========================  ==========================================================================

Other architectures raise a ``ValueError`` with a ``HINT``: the adapter composes the forward (embedding ->
blocks -> norm -> head) itself, and only the families above are verified to equal the model's own forward.

Limits, refused with an error rather than run wrongly: tied input/output embeddings (the two units may run
different strategies or pipeline stages; pass ``untie_embeddings=True`` to give the head its own copy), sequences
longer than a sliding attention window. ``forward(tokens)`` takes no padding mask: it is for causal training on
full windows. HF's own ``nn.Dropout`` layers become keyed dropout (the same masks under every plan);
attention-probability dropout is drawn by torch inside attention and is not keyed: keep ``attention_dropout``
(``attn_pdrop``) at 0 for plan-independent results.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any

import torch
from torch import nn

from ..plan import ModelShape, ParallelPlan
from .dropout import keyed_dropout_
from .hf_moe import HFSparseMoE, PooledRouterAux, swap_hf_moe
from .moe import RoutingLog

__all__ = ["HFCausalLM", "galv_hf", "SUPPORTED_FAMILIES", "TESTED_TRANSFORMERS"]

TESTED_TRANSFORMERS = (">=5.18", "<5.19")  # the range pyproject.toml's `hf` extra pins (tested: 5.18.0)
SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral", "mixtral", "gpt2")  # config.model_type, forward verified
NO_TP_PLAN = {"gpt2": "GPT-2 publishes no base_model_tp_plan and fuses q/k/v in one Conv1D (c_attn): a column "
                      "split would have to keep q, k and v of each head together on a rank"}
ATTN_NAME = "galv"  # the attention implementation registered with transformers' AttentionInterface


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - dev installs it
        raise ImportError("lightning_galv.models.hf needs the `transformers` package. "
                          "HINT: pip install 'lightning_galv[hf]'.") from exc
    from packaging.version import Version

    v = Version(transformers.__version__)
    lo, hi = (Version(s.lstrip("<>=")) for s in TESTED_TRANSFORMERS)
    if not lo <= v < hi:
        warnings.warn(f"transformers {v} is outside the tested range {','.join(TESTED_TRANSFORMERS)} of "
                      "lightning_galv.models.hf; parity with the model's own forward is only tested there.",
                      stacklevel=3)
    return transformers


# ---------------------------------------------------------------------------------------------------
# attention: one registered function, one parameter-free core module per attention module
# ---------------------------------------------------------------------------------------------------
class GalvCoreAttention(nn.Module):
    """``core(q, k, v)`` on ``[batch, seq, heads, head_dim]`` tensors, running the model's own attention
    implementation (``impl``). Without a mask it is causal over the sequence it is given -- under Ulysses the
    whole sequence, after the all-to-all -- which is what causal LM training on full windows needs."""

    def __init__(self, impl: str, eager: Any) -> None:
        super().__init__()
        self.impl = impl
        self._eager = eager  # the modelling file's eager_attention_forward (not a module)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: nn.Module | None = None,
                mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        from transformers import AttentionInterface

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # HF's layout: [b, heads, s, d]
        if self.impl == "eager":
            fn = self._eager
            if mask is None:  # the causal mask HF's eager path adds, for the sequence we hold
                s = qt.shape[2]
                mask = torch.full((s, s), float("-inf"), dtype=qt.dtype, device=qt.device).triu(1)[None, None]
            elif mask.dtype == torch.bool:  # the model's own forward built it with the "galv" (sdpa) mask function
                mask = torch.zeros(mask.shape, dtype=qt.dtype, device=qt.device).masked_fill(~mask, float("-inf"))
        else:
            fn = AttentionInterface().get_interface(self.impl, self._eager)
        out, _ = fn(owner, qt, kt, vt, mask, **kwargs)
        return out  # [b, s, heads, d]


def galv_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"galv"`` entry of transformers' ``AttentionInterface``: route through ``module.galv_core``."""
    core = module._modules.get("galv_core")
    if core is None:
        raise RuntimeError(f"{type(module).__name__}: attention implementation {ATTN_NAME!r} without a galv_core. "
                           "HINT: wrap the model with lightning_galv.models.hf.galv_hf, which installs it.")
    out = core(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), owner=module,
               mask=attention_mask, **kwargs)
    return out, None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, galv_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)  # the model's own forward keeps working


def _attention_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Instance ``forward`` of a rotary attention module: cut the rotary tables to the positions it holds.

    The block passes tables for the full sequence. Under Megatron TP / SP the attention module sees the full
    sequence (a DTensor's shape is global) and uses them whole; under Ulysses it sees this rank's chunk,
    which starts at the global position the sequence-parallel entry records (``coords().seq_offset``)."""
    pe = kwargs.get("position_embeddings")
    hs = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
    if pe is not None and hs is not None:
        cos, sin = pe
        n = hs.shape[1]
        if cos.shape[-2] != n:
            from .dropout import coords

            off = coords().seq_offset
            kwargs["position_embeddings"] = (cos[..., off:off + n, :], sin[..., off:off + n, :])
    return type(self).forward(self, *args, **kwargs)


def _drop_aux_pools(model: nn.Module, args: tuple) -> None:
    """Forward pre-hook of the HF model itself (its own forward, not the adapter's): no layer injects a router aux
    gradient from a pool of the adapter's (HF's forward computes and adds that loss itself)."""
    for m in model.modules():
        if isinstance(m, HFSparseMoE):
            m.aux_pool = None


def _block_pre_hook(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``block(x)`` -> the HF layer's call: rotary tables for the full sequence, no mask (causal in the core).

    A hook, not the caller's job, so every caller (the adapter's forward, pipeline stages) may call
    ``block(x)``; it runs before a sequence-parallel entry slices ``x``, so it sees the full sequence."""
    if len(args) != 1 or not isinstance(args[0], torch.Tensor):  # the model's own forward passes its extras
        return args, kwargs
    x = args[0]
    rotary = block.__dict__.get("_galv_rotary")
    kwargs = dict(kwargs)
    kwargs.setdefault("attention_mask", None)
    if rotary is not None and kwargs.get("position_embeddings") is None:
        pos = torch.arange(x.shape[1], device=x.device)[None]  # [1, s]
        kwargs["position_embeddings"] = rotary(x, pos)  # (cos, sin), each [1, s, head_dim]
    return args, kwargs


# ---------------------------------------------------------------------------------------------------
# finding the parts
# ---------------------------------------------------------------------------------------------------
def _unsupported(model: nn.Module, why: str) -> ValueError:
    return ValueError(f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', '?')!r}): {why}. "
                      f"HINT: lightning_galv.models.hf supports {', '.join(SUPPORTED_FAMILIES)} "
                      "(AutoModelForCausalLM); for another architecture expose the block protocol yourself "
                      "(lightning_galv.models.protocol), or use it unadapted with tp=1 and pp=1 (DP/ZeRO/"
                      "checkpointing find its blocks by themselves).")


def _is_vector_module(mod: nn.Module, hidden: int) -> bool:
    own = list(mod.parameters(recurse=False))
    return bool(own) and all(p.dim() == 1 and p.shape[0] == hidden for p in own)


def _find_blocks(model: nn.Module, base: nn.Module) -> tuple[str, nn.ModuleList]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [(n, m) for n, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m)
             and all(type(b).__name__ in names for b in m)]
    if len(found) != 1:
        raise _unsupported(model, f"found {len(found)} lists of decoder layers (classes {sorted(names)}) in the base "
                                  "model; need exactly one")
    return found[0]


def _attention_path(model: nn.Module, block: nn.Module) -> str:
    found = [n for n, m in block.named_modules() if n and hasattr(m, "head_dim") and hasattr(m, "is_causal")
             and type(m).__name__.endswith("Attention")]
    if len(found) != 1:
        raise _unsupported(model, f"block {type(block).__name__} has {len(found)} attention modules {found}; "
                                  "need exactly one (no cross-attention)")
    return found[0]


def derive_tp_plan(model: nn.Module, blocks_name: str, block: nn.Module, hidden: int) -> dict[str, str]:
    """``galv_tp_plan`` of one block, from ``config.base_model_tp_plan`` (translation in the module docstring)."""
    config = model.config
    hf_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = f"{blocks_name}.*."
    ep_plan = dict(getattr(config, "base_model_ep_plan", None) or {})
    moe = sorted({k[len(prefix):].rpartition(".")[0] for k, v in ep_plan.items()
                  if v == "ep_router" and k.startswith(prefix)})
    plan: dict[str, str] = {}
    for key, kind in hf_plan.items():
        if not key.startswith(prefix):
            raise ValueError(f"{type(model).__name__}: base_model_tp_plan entry {key!r}: {kind!r} is outside the "
                             f"decoder layers ({prefix}...). HINT: the embedding and head are split by the plan's "
                             "embed/head strategies; a model splitting other modules is not supported by the adapter.")
        path = key[len(prefix):]
        if any(path == m or path.startswith(m + ".") for m in moe):
            continue  # inside the MoE block, which runs whole (replicated) on each tp rank
        if kind not in ("colwise", "rowwise"):
            raise ValueError(f"{type(model).__name__}: base_model_tp_plan entry {key!r}: {kind!r} has no "
                             "lightning_galv equivalent (known: 'colwise', 'rowwise', and entries inside an MoE "
                             "block named by base_model_ep_plan). HINT: use tp=1 (or sp='ulysses') for this model's "
                             "layers.")
        plan[path] = kind
    for m in moe:
        plan[m] = "replicated"

    def covered(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in plan)

    for name, mod in block.named_modules():
        if not name or covered(name) or not list(mod.parameters(recurse=False)):
            continue
        if not _is_vector_module(mod, hidden):
            raise ValueError(f"{type(model).__name__}: block submodule {name!r} ({type(mod).__name__}) has parameters "
                             "that base_model_tp_plan does not split and that are not [hidden] norm vectors. "
                             "HINT: use tp=1 (or sp='ulysses') for this model's layers.")
        plan[name] = "norm"
    return plan


class HFCausalLM(nn.Module):
    """The block protocol (:mod:`.protocol`) on a Hugging Face causal LM (module docstring: what, how, limits).

    ``forward(tokens)`` -> logits ``[batch, seq, vocab]``, equal to ``hf(tokens).logits``. The HF model is the
    child ``hf``: its ``state_dict`` keys are unchanged.
    """

    def __init__(self, model: nn.Module, *, untie_embeddings: bool = False) -> None:
        super().__init__()
        _require_transformers()
        config = model.config
        family = getattr(config, "model_type", None)
        if family not in SUPPORTED_FAMILIES:
            raise _unsupported(model, "this architecture is not one the adapter knows how to split")
        if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
            raise _unsupported(model, "cross-attention")
        base = model.base_model
        blocks_name, blocks = _find_blocks(model, base)
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        if not isinstance(embedding, nn.Embedding) or not isinstance(head, nn.Linear):
            raise _unsupported(model, f"embedding {type(embedding).__name__} / head {type(head).__name__}: need "
                                      "nn.Embedding / nn.Linear")
        if head.weight is embedding.weight:
            if not untie_embeddings:
                raise ValueError(f"{type(model).__name__}: the output head shares its weight with the input "
                                 "embedding (tie_word_embeddings=True); the two belong to different units of a plan "
                                 "(strategies, pipeline stages). HINT: build it with tie_word_embeddings=False, or "
                                 "pass untie_embeddings=True to give the head its own copy (it then trains apart).")
            head.weight = nn.Parameter(embedding.weight.detach().clone())
            config.tie_word_embeddings = False
        hidden = embedding.embedding_dim
        self.hf = model
        # HF's nn.Dropout layers (GPT-2's embedding / residual dropout) draw keyed masks, as the reference models'
        # do: the same masks under every plan, and ordinary dropout outside the strategy (models/dropout.py)
        keyed_dropout_(self)
        self.family = family
        self._blocks_name = blocks_name
        parts: dict[str, nn.Module | None] = {"norm": None, "positions": None, "drop": None, "rotary": None}
        for name, child in base.named_children():
            if child is blocks or child is embedding:
                continue
            if isinstance(child, nn.Embedding):
                parts["positions"] = child
            elif isinstance(child, nn.Dropout):
                parts["drop"] = child
            elif _is_vector_module(child, hidden) and not list(child.children()):
                parts["norm"] = child
            elif "inv_freq" in dict(child.named_buffers(recurse=False)):
                parts["rotary"] = child
            elif list(child.parameters()):
                raise _unsupported(model, f"base model child {name!r} ({type(child).__name__}) holds parameters "
                                          "the adapter does not place")
        if parts["norm"] is None:
            raise _unsupported(model, "no final norm found in the base model")
        # paths, not references: pipeline stages and keyed dropout replace modules in the tree by name
        prefix = f"hf.{type(model).base_model_prefix}." if base is not model else "hf."
        names = {id(m): n for n, m in base.named_children()}
        self._paths = {k: (prefix + names[id(m)] if m is not None else None) for k, m in parts.items()}
        rotary = parts["rotary"]

        # attention: the model's own implementation behind the registered "galv" function
        impl = config._attn_implementation or "eager"
        _register_attention()
        attn_path = _attention_path(model, blocks[0])
        eager = getattr(sys.modules[type(blocks[0].get_submodule(attn_path)).__module__],
                        "eager_attention_forward", None)
        if impl != ATTN_NAME:
            self._impl = impl
            model.set_attn_implementation(ATTN_NAME)
        else:  # already adapted once (a deepcopy of an adapted model, or a second adapter over it)
            self._impl = getattr(model, "_galv_impl", "sdpa")
        model.__dict__["_galv_impl"] = self._impl

        # sparse MoE blocks (Mixtral's) run through this package's MoE runtime: same keys, HF's router and
        # fused experts, all-to-all expert parallelism (models/hf_moe.py)
        self.routing_log = RoutingLog()
        self._moe_paths = sorted({p for i, block in enumerate(blocks) for p in swap_hf_moe(block, i, self.routing_log)})
        # HF adds router_aux_loss_coef x its pooled load-balancing loss when output_router_logits is on
        self._router_aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) \
            if self._moe_paths and getattr(config, "output_router_logits", False) else 0.0
        for layer in self.moe_layers:
            layer.router_aux_coef = self._router_aux_coef
        self._aux_pool: PooledRouterAux | None = None
        if self._router_aux_coef and not getattr(model, "_galv_aux_hook", False):
            # the model's own forward adds HF's aux loss to its own loss: no pool of ours may inject it again
            model.register_forward_pre_hook(_drop_aux_pools)
            model._galv_aux_hook = True

        self._tp_refusal: str | None = None  # why Megatron TP / SP of the blocks is refused, if it is
        if not getattr(config, "base_model_tp_plan", None):
            self._tp_refusal = NO_TP_PLAN.get(family, f"{type(model).__name__} publishes no base_model_tp_plan")
        tp_plan = derive_tp_plan(model, blocks_name, blocks[0], hidden) if self._tp_refusal is None else None
        for block in blocks:
            attn = block.get_submodule(attn_path)
            if "galv_core" not in attn._modules:
                attn.galv_core = GalvCoreAttention(self._impl, eager)
            if tp_plan is not None:
                block.galv_tp_plan = dict(tp_plan)
            block.galv_attention = f"{attn_path}.galv_core"
            if rotary is not None:
                block.__dict__["_galv_rotary"] = rotary  # not registered: no second name for it
                attn.forward = types.MethodType(_attention_forward, attn)
            if not getattr(block, "_galv_hf_hook", False):
                block.register_forward_pre_hook(_block_pre_hook, with_kwargs=True)
                block._galv_hf_hook = True

    # -- the block protocol ------------------------------------------------------------------------
    @property
    def galv_blocks(self) -> nn.ModuleList:
        return getattr(self.hf.base_model, self._blocks_name)

    @property
    def galv_embedding(self) -> nn.Embedding:
        return self.hf.get_input_embeddings()

    @property
    def galv_final_norm(self) -> nn.Module:
        return self._part("norm")  # type: ignore[return-value]

    @property
    def galv_head(self) -> nn.Linear:
        return self.hf.get_output_embeddings()

    @property
    def moe_layers(self) -> list[HFSparseMoE]:
        """The MoE layers present in this process (pipeline placeholders skipped), in block order."""
        return [m for m in self.galv_blocks.modules() if isinstance(m, HFSparseMoE)]

    def set_aux_grad_scale(self, scale: float) -> None:
        """Scale of the injected router-aux gradient; must match the LM loss's (``1 / accumulate_grad_batches``)."""
        for layer in self.moe_layers:
            layer.aux_grad_scale = float(scale)

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """HF's (unweighted) load-balancing loss of the last forward, when ``output_router_logits`` is on (for
        logging; its gradient, weighted by ``router_aux_loss_coef``, is injected in backward)."""
        pool = self._aux_pool
        return {"aux_loss": pool.value()} if pool is not None and pool.counts is not None else {}

    def _part(self, key: str) -> nn.Module | None:
        path = self._paths[key]
        return None if path is None else self.get_submodule(path)

    def galv_shape(self, seq_len: int | None = None) -> ModelShape:
        c = self.hf.config
        heads = c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size
        seq = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)
        return ModelShape(c.num_hidden_layers, c.hidden_size, heads, kv, ffn, c.vocab_size, seq_len or seq)

    @property
    def galv_sp_modes(self) -> tuple[str, ...]:
        """Sequence modes the blocks run with tp > 1 (what automatic mode may search): Ulysses only when Megatron
        TP / SP of the blocks is refused (GPT-2), else all of them."""
        from ..plan import SP_MODES

        return ("ulysses",) if self._tp_refusal is not None else tuple(SP_MODES)

    def galv_check_plan(self, plan: ParallelPlan) -> None:
        """Refuse what this family cannot run (see the module docstring), before anything is applied."""
        if plan.pp > 1 and self._router_aux_coef:
            raise ValueError(f"pp={plan.pp} with output_router_logits=True: HF's router load-balancing loss pools every "
                             "MoE layer of a forward, which pipeline stages run apart. HINT: use pp=1, or build the "
                             "config with output_router_logits=False (no router aux loss).")
        for i, s in enumerate(plan.layers):
            if s.tp > 1 and not s.ulysses and self._tp_refusal is not None:
                raise ValueError(f"layers[{i}] strategy {s.short()}: Megatron tensor / sequence parallelism of "
                                 f"{type(self.hf).__name__} blocks is not supported: {self._tp_refusal}. HINT: use "
                                 "sp='ulysses' (sequence parallel, weights whole) or tp=1 for its layers; the "
                                 "embedding and head may still use tp.")

    def galv_embed_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the model's own forward does before the first layer (token + learned positions, dropout)."""
        s = tokens.shape[1]
        window = getattr(self.hf.config, "sliding_window", None)
        if window is not None and (getattr(self.hf.config, "use_sliding_window", True) is not False) and s > window:
            raise ValueError(f"sequence of {s} tokens > sliding_window={window}: the adapter's attention is plain "
                             "causal. HINT: train on windows of at most sliding_window tokens.")
        if self._router_aux_coef:  # a fresh pool per forward: each layer's backward reads the one it joined
            self._aux_pool = PooledRouterAux(self.moe_layers[0].num_experts)
            for layer in self.moe_layers:
                layer.aux_pool = self._aux_pool
        h = self.galv_embedding(tokens)  # [b, s, hidden]
        positions, drop = self._part("positions"), self._part("drop")
        if positions is not None:
            h = h + positions(torch.arange(s, device=tokens.device))  # + [s, hidden]
        if drop is not None:
            h = drop(h)
        return h

    def galv_head_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.galv_head(self.galv_final_norm(h))  # [b, s, vocab]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.galv_embed_forward(tokens)
        for block in self.galv_blocks:
            h = block(h)
        return self.galv_head_forward(h)


def galv_hf(model: Any, *, untie_embeddings: bool = False) -> HFCausalLM:
    """An :class:`HFCausalLM` over ``model``: an ``AutoModelForCausalLM`` instance, or a ``transformers`` config
    (built with ``AutoModelForCausalLM.from_config``, random weights, no hub)."""
    transformers = _require_transformers()
    if isinstance(model, transformers.PretrainedConfig):
        model = transformers.AutoModelForCausalLM.from_config(model)
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"galv_hf({type(model).__name__}): needs a transformers causal LM or its config. "
                        "HINT: galv_hf(AutoModelForCausalLM.from_config(AutoConfig.for_model('llama', ...))).")
    return HFCausalLM(model, untie_embeddings=untie_embeddings)
