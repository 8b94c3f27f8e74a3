"""Checks that run inside gloo ranks (launched by tests/test_tensor_parallel.py).

One launch runs every check and returns, per rank, a dict ``{check name: result}``, where a parity
result is ``{"err": max abs error, "ok": allclose, "what": ...}`` and an error check records the
exception type and message. The pytest side asserts on these numbers.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_galv.layout import MeshFactory, RankLayout
from lightning_galv.models.common import RMSNorm
from lightning_galv.models.gpt2 import GPT2, GPT2Block, GPT2Config
from lightning_galv.models.llama import Llama, LlamaBlock, LlamaConfig
from lightning_galv.parallel.block import apply_block
from lightning_galv.parallel.sequence import apply_ulysses
from lightning_galv.parallel.tensor import apply_tp, apply_tp_embedding, apply_tp_head
from lightning_galv.plan import LayerStrategy

RTOL = 1e-5
ATOL = 1e-5
BATCH, SEQ = 2, 8

LLAMA = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=64, max_seq_len=16)
GPT = GPT2Config(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def _randomize(module: nn.Module, seed: int) -> None:
    """Large random weights (and nonzero biases / norm gains) so every gradient is far from zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln" in name):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _llama_block() -> nn.Module:
    torch.manual_seed(0)
    block = Llama(LLAMA).layers[0]
    _randomize(block, 1)
    return block


def _gpt_block() -> nn.Module:
    torch.manual_seed(0)
    block = GPT2(GPT).h[0]
    _randomize(block, 2)
    return block


def _cmp(a: torch.Tensor, b: torch.Tensor, what: str) -> dict[str, Any]:
    if isinstance(a, DTensor):
        return {"err": float("inf"), "rel": float("inf"), "ok": False,
                "what": f"{what}: got a DTensor, expected a plain tensor"}
    if a.shape != b.shape:
        return {"err": float("inf"), "rel": float("inf"), "ok": False,
                "what": f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"}
    # Tensor-wise tolerance: |a - b| <= ATOL + RTOL * max|b| everywhere. Element-wise allclose would
    # demand 1e-5 relative accuracy of entries that are tiny next to their tensor (fp32 summation order
    # alone moves those by ~1e-7 * max|b|), while this still catches any wrong shard, scale or sum.
    # `rel` is reported relative to max(1, max|b|) (some true gradients are exactly 0).
    err = (a.detach() - b.detach()).abs().max().item()
    scale = b.detach().abs().max().item()
    return {"err": err, "rel": err / max(scale, 1.0), "ok": err <= ATOL + RTOL * scale, "what": what,
            "scale": scale}


def _worst(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge several comparisons: ok only if all are, err is the max, `what` names the failures."""
    bad = [r["what"] for r in results if not r["ok"]]
    return {"err": max(r["err"] for r in results), "rel": max(r["rel"] for r in results), "ok": not bad,
            "what": "; ".join(bad) or f"{len(results)} tensors", "n": len(results)}


def _grad_of(p: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Full gradient of parameter ``p`` as a plain tensor (summed over ``group`` for Ulysses)."""
    g = p.grad
    assert g is not None, "missing gradient"
    if isinstance(g, DTensor):
        if all(pl.is_replicate() for pl in g.placements):
            return g.to_local()  # must already be the full gradient on this rank: no collective allowed
        return g.full_tensor()
    if group is not None:
        g = g.clone()
        dist.all_reduce(g, group=group)
    return g


def block_parity(make: Callable[[], nn.Module], strategy: LayerStrategy, factory: MeshFactory,
                 steps: int = 1, checkpoint: bool = False, sum_ulysses_grads: bool = True,
                 perturb: bool = False) -> dict[str, Any]:
    """Single-device block vs the parallelized copy: output, input grad, every parameter's full grad.

    ``steps > 1`` accumulates gradients over several forward/backward passes (different inputs);
    ``checkpoint`` wraps the parallelized block in a non-reentrant activation-checkpoint wrapper, the
    order the runtime uses (parallelize first, then wrap), so the collectives run again in recompute.
    ``sum_ulysses_grads=False`` and ``perturb`` (nudge one weight shard on rank 0) are negative controls:
    the comparison must then fail, which shows the check can.
    """
    ref = make()
    par = copy.deepcopy(ref)
    mesh = factory.mesh(strategy)
    apply_block(par, mesh, strategy)  # what parallelize() and the profiler call: picks TP / Megatron-SP / Ulysses
    if perturb:
        with torch.no_grad():
            w = next(p for p in par.parameters() if p.dim() == 2)
            local = w.to_local() if isinstance(w, DTensor) else w
            if dist.get_rank() == 0:
                local[0, 0] += 1e-3
    # Hooks registered *after* parallelizing (as the batch re-layout between layers is) must see the
    # full-sequence boundary tensors, not this rank's sequence chunk.
    hook_shapes: list[tuple[int, ...]] = []
    par.register_forward_pre_hook(lambda m, args: hook_shapes.append(tuple(args[0].shape)))
    par.register_forward_hook(lambda m, args, out: hook_shapes.append(tuple(out.shape)))
    run_par: nn.Module = par
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        run_par = checkpoint_wrapper(par)

    g = torch.Generator().manual_seed(123)
    dim = LLAMA.dim
    results = []
    for step in range(steps):
        x = torch.randn(BATCH, SEQ, dim, generator=g)
        gy = torch.randn(BATCH, SEQ, dim, generator=g)  # a random upstream gradient

        x_ref = x.clone().requires_grad_()
        y_ref = ref(x_ref)
        y_ref.backward(gy)

        x_par = x.clone().requires_grad_()
        y_par = run_par(x_par)
        y_par.backward(gy)
        results += [_cmp(y_par, y_ref, f"output (step {step})"), _cmp(x_par.grad, x_ref.grad, f"input grad (step {step})")]

    group = mesh["tp"].get_group() if strategy.ulysses and sum_ulysses_grads else None
    ref_params = dict(ref.named_parameters())
    n_dtensor = 0
    bad_placement = []
    for name, p in par.named_parameters():
        n_dtensor += isinstance(p, DTensor)
        if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            bad_placement.append(f"{name}: grad {p.grad.placements} vs param {p.placements}")
        results.append(_cmp(_grad_of(p, group), ref_params[name].grad, f"grad {name}"))
    out = _worst(results)
    if any(shape != (BATCH, SEQ, dim) for shape in hook_shapes):
        out["ok"] = False
        out["what"] += f"; outer hooks saw {hook_shapes}, expected full {(BATCH, SEQ, dim)}"
    out["n_params"] = len(ref_params)
    out["n_dtensor_params"] = n_dtensor
    out["bad_grad_placements"] = bad_placement
    if bad_placement:
        out["ok"] = False
        out["what"] += "; grad placements differ from param placements: " + ", ".join(bad_placement)
    return out


def embedding_head_parity(tp: int, factory: MeshFactory) -> dict[str, Any]:
    """Vocab-parallel embedding and head (with replicated final norm) vs single device, with a real loss."""
    s = LayerStrategy(tp=tp, dp=4 // tp)
    mesh = factory.mesh(s)
    torch.manual_seed(0)
    emb_ref = nn.Embedding(LLAMA.vocab_size, LLAMA.dim)
    norm_ref = RMSNorm(LLAMA.dim)
    head_ref = nn.Linear(LLAMA.dim, LLAMA.vocab_size, bias=False)
    for i, m in enumerate((emb_ref, norm_ref, head_ref)):
        _randomize(nn.ModuleDict({"norm" if m is norm_ref else "w": m}), 10 + i)
    emb, norm, head = copy.deepcopy(emb_ref), copy.deepcopy(norm_ref), copy.deepcopy(head_ref)
    apply_tp_embedding(emb, mesh, s)
    apply_tp_head(norm, head, mesh, s)

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, LLAMA.vocab_size, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, LLAMA.vocab_size, (BATCH, SEQ), generator=g)

    def run(e: nn.Module, n: nn.Module, h: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = e(tokens)  # [b, s, dim]
        hidden.retain_grad()
        logits = h(n(hidden))  # [b, s, vocab]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))  # plain loss
        loss.backward()
        return hidden, logits, loss

    h_ref, l_ref, loss_ref = run(emb_ref, norm_ref, head_ref)
    h_par, l_par, loss_par = run(emb, norm, head)
    results = [_cmp(h_par, h_ref, "embedding output"), _cmp(l_par, l_ref, "logits"),
               _cmp(loss_par, loss_ref, "loss"), _cmp(h_par.grad, h_ref.grad, "hidden grad"),
               _cmp(_grad_of(emb.weight, None), emb_ref.weight.grad, "embedding weight grad"),
               _cmp(_grad_of(norm.weight, None), norm_ref.weight.grad, "final norm weight grad"),
               _cmp(_grad_of(head.weight, None), head_ref.weight.grad, "head weight grad")]
    out = _worst(results)
    out["sharded"] = [isinstance(emb.weight, DTensor), isinstance(head.weight, DTensor)]
    return out


def model_parity(factory: MeshFactory) -> dict[str, Any]:
    """A whole 2-layer LLaMA with a different strategy per part, vs single device (loss + all grads)."""
    torch.manual_seed(0)
    ref = Llama(LLAMA)
    _randomize(ref, 3)
    par = copy.deepcopy(ref)
    strategies = {"embed": LayerStrategy(tp=4), "l0": LayerStrategy(tp=4, sp="megatron"),
                  "l1": LayerStrategy(tp=2, dp=2), "head": LayerStrategy(tp=2, dp=2)}
    apply_tp_embedding(par.tok_embeddings, factory.mesh(strategies["embed"]), strategies["embed"])
    apply_tp(par.layers[0], factory.mesh(strategies["l0"]), strategies["l0"])
    apply_tp(par.layers[1], factory.mesh(strategies["l1"]), strategies["l1"])
    apply_tp_head(par.norm, par.output, factory.mesh(strategies["head"]), strategies["head"])
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, LLAMA.vocab_size, (BATCH, SEQ + 1), generator=g)
    losses = []
    for m in (ref, par):
        logits = m(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss)
    results = [_cmp(losses[1], losses[0], "loss")]
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        results.append(_cmp(_grad_of(p, None), ref_params[name].grad, f"grad {name}"))
    return _worst(results)


class _NoProtocolBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _expect_error(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return {"raised": type(exc).__name__, "msg": str(exc)}
    return {"raised": None, "msg": ""}


def error_checks(factory: MeshFactory) -> dict[str, dict[str, Any]]:
    """Bad inputs: each must raise ValueError/TypeError with a HINT, on every rank alike (no hang)."""
    tp4, uly4, meg4 = LayerStrategy(tp=4), LayerStrategy(tp=4, sp="ulysses"), LayerStrategy(tp=4, sp="megatron")
    tp2 = LayerStrategy(tp=2, dp=2)
    out: dict[str, dict[str, Any]] = {}
    out["tp_no_protocol"] = _expect_error(lambda: apply_tp(_NoProtocolBlock(), factory.mesh(tp4), tp4))
    out["megatron_no_protocol"] = _expect_error(lambda: apply_tp(_NoProtocolBlock(), factory.mesh(meg4), meg4))
    out["ulysses_no_protocol"] = _expect_error(lambda: apply_ulysses(_NoProtocolBlock(), factory.mesh(uly4), uly4))
    # 2 heads cannot be split 4 ways: caught when applying TP (the weights would be split mid-head)
    two_heads = GPT2Config(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
    out["tp_heads"] = _expect_error(lambda: apply_tp(GPT2Block(two_heads), factory.mesh(tp4), tp4))
    # ... and at the first forward under Ulysses (before any collective, identically on every rank)
    def ulysses_heads() -> None:
        b = GPT2Block(two_heads)
        apply_ulysses(b, factory.mesh(uly4), uly4)
        b(torch.randn(BATCH, SEQ, 32))
    out["ulysses_heads"] = _expect_error(ulysses_heads)
    def ulysses_seq() -> None:
        b = _gpt_block()
        apply_ulysses(b, factory.mesh(uly4), uly4)
        b(torch.randn(BATCH, 6, 32))
    out["ulysses_seq"] = _expect_error(ulysses_seq)
    def megatron_seq() -> None:
        b = _llama_block()
        apply_tp(b, factory.mesh(meg4), meg4)
        b(torch.randn(BATCH, 6, 32))
    out["megatron_seq"] = _expect_error(megatron_seq)
    out["mesh_mismatch"] = _expect_error(lambda: apply_tp(_llama_block(), factory.mesh(tp2), tp4))
    def twice() -> None:
        b = _llama_block()
        apply_tp(b, factory.mesh(tp2), tp2)
        apply_tp(b, factory.mesh(tp2), tp2)
    out["twice"] = _expect_error(twice)
    out["head_vocab"] = _expect_error(lambda: apply_tp_head(None, nn.Linear(32, 62), factory.mesh(tp4), tp4))
    out["embed_vocab"] = _expect_error(lambda: apply_tp_embedding(nn.Embedding(62, 32), factory.mesh(tp4), tp4))
    out["embed_ulysses"] = _expect_error(lambda: apply_tp_embedding(nn.Embedding(64, 32), factory.mesh(uly4), uly4))
    return out


BLOCK_STRATEGIES = {
    "tp2": LayerStrategy(tp=2, dp=2),
    "tp4": LayerStrategy(tp=4),
    "tp2_megatron": LayerStrategy(tp=2, dp=2, sp="megatron"),
    "tp4_megatron": LayerStrategy(tp=4, sp="megatron"),
    "ulysses2": LayerStrategy(tp=2, dp=2, sp="ulysses"),
    "ulysses4": LayerStrategy(tp=4, sp="ulysses"),
    "tp2_strided": LayerStrategy(tp=2, dp=2, tp_consecutive=False),
}


def run_all() -> dict[str, Any]:
    """Every check, in the same order on every rank (collectives must line up)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "these checks are written for 4 ranks"
    factory = MeshFactory(RankLayout(world), "cpu", rank)
    out: dict[str, Any] = {}
    timings: dict[str, float] = {}
    for model, make in (("llama", _llama_block), ("gpt2", _gpt_block)):
        for label, s in BLOCK_STRATEGIES.items():
            t0 = time.perf_counter()
            out[f"{model}/{label}"] = block_parity(make, s, factory)
            timings[f"{model}/{label}"] = time.perf_counter() - t0
    for model, make in (("llama", _llama_block), ("gpt2", _gpt_block)):
        for label in ("tp4_megatron", "ulysses2"):
            s = BLOCK_STRATEGIES[label]
            out[f"{model}/{label}/accumulate"] = block_parity(make, s, factory, steps=2)
            out[f"{model}/{label}/checkpoint"] = block_parity(make, s, factory, checkpoint=True)
    out["negative/ulysses2_unsummed_grads"] = block_parity(_llama_block, BLOCK_STRATEGIES["ulysses2"], factory,
                                                           sum_ulysses_grads=False)
    out["negative/tp4_perturbed_shard"] = block_parity(_gpt_block, BLOCK_STRATEGIES["tp4"], factory, perturb=True)
    t0 = time.perf_counter()
    for tp in (2, 4):
        out[f"embed_head/tp{tp}"] = embedding_head_parity(tp, factory)
    out["model/mixed"] = model_parity(factory)
    timings["embed_head+model"] = time.perf_counter() - t0
    out["errors"] = error_checks(factory)
    out["timings"] = timings
    return out
