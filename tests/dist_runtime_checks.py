"""Functions that run inside gloo ranks (launched by lightning_galv.testing.run_distributed).

Each rank also trains the single-process reference itself (tiny models), so a check compares the
parallel run with an exact single-device run of the same data, in the same process.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_galv.layout import MeshFactory, RankLayout
from lightning_galv.models.dropout import DropoutCoords, restore_coords, set_dropout_key
from lightning_galv.models import GPT2, GPT2Config, Llama, LlamaConfig, MoEConfig, MoEDecoder
from lightning_galv.plan import ParallelPlan
from lightning_galv.testing import release_subgroups


def hf_config(family: str, layers: int = 3, dropout: float = 0.0) -> Any:
    """Tiny random Hugging Face configs (no hub) shaped like the reference models: vocab 64, hidden 32, seq 16.
    ``"mixtral_aux"``: Mixtral with HF's router load-balancing loss on (``output_router_logits``), weighted 0.5."""
    from transformers import AutoConfig

    if family == "mixtral_aux":
        cfg = hf_config("mixtral", layers, dropout)
        cfg.output_router_logits, cfg.router_aux_loss_coef = True, 0.5
        return cfg

    common = dict(vocab_size=64, num_hidden_layers=layers, tie_word_embeddings=False)
    if family == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=32, n_head=4, n_positions=16, resid_pdrop=dropout,
                                    embd_pdrop=dropout, attn_pdrop=0.0, **common)
    extra: dict[str, Any] = {"qwen2": {"use_sliding_window": False}, "mistral": {"sliding_window": 16},
                             "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
                                         "router_jitter_noise": 0.0}}.get(family, {})
    return AutoConfig.for_model(family, hidden_size=32, num_attention_heads=8, num_key_value_heads=4,
                                intermediate_size=64 if family != "mixtral" else 32, max_position_embeddings=16,
                                attention_dropout=0.0, **extra, **common)


def make_hf_model(family: str, layers: int = 3, seed: int = 0, dropout: float = 0.0,
                  attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A tiny ``AutoModelForCausalLM.from_config`` model of ``family`` under the lightning_galv adapter."""
    from transformers import AutoModelForCausalLM

    from lightning_galv.models.hf import galv_hf

    torch.manual_seed(seed)
    cfg = hf_config(family, layers, dropout)
    return galv_hf(AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation))


def make_model(kind: str, layers: int = 3, seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    if kind.startswith("hf_"):
        return make_hf_model(kind[3:], layers, seed, dropout)
    torch.manual_seed(seed)
    if kind == "moe":  # MoE blocks 0, 2, ... (dense in between), 4 experts top-2 + a gated shared expert
        return MoEDecoder(MoEConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=8, n_kv_heads=4, ffn_hidden=64,
                                    max_seq_len=16, dropout=dropout, num_experts=4, top_k=2, expert_hidden=32,
                                    shared_expert_hidden=16, moe_layers=tuple(range(0, layers, 2)),
                                    aux_loss_weight=0.1, z_loss_weight=0.01))
    if kind == "llama":
        return Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=8, n_kv_heads=4,
                                 ffn_hidden=64, max_seq_len=16, dropout=dropout))
    return GPT2(GPT2Config(vocab_size=64, dim=32, n_layers=layers, n_heads=4, max_seq_len=16, dropout=dropout))


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference tensor's scale.

    The scale is floored at 0.01 because some parameters have a true gradient of exactly zero (a
    key bias shifts every score of a softmax row equally), so they only carry ~1e-9 rounding noise;
    the floor turns rtol 1e-5 into an absolute 1e-7 for such tensors.
    """
    return float((a - b).abs().max() / max(float(b.abs().max()), 0.01))


def _ce(logits: torch.Tensor, y: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), label_smoothing=label_smoothing)


def grad_errors(model: torch.nn.Module, ref: torch.nn.Module) -> dict[str, float]:
    """Per-parameter relative error of the parallel gradient (gathered to full) against the reference's.

    Called right after the first backward + gradient sync, before clipping and the optimizer, so a wrong
    gradient of any single tensor shows up here even if ten steps of losses would hide it. A parameter
    whose gradient is missing on one side gets error ``inf``. Every rank calls it for the same parameters
    in the same order (``full_tensor`` is a collective).
    """
    want = dict(ref.named_parameters())
    out: dict[str, float] = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        r = want[name].grad if name in want else None
        out[name] = float("inf") if (g is None) != (r is None) else 0.0 if g is None else rel_err(g, r)
    return out


#: name -> (params, lr, momentum) -> optimizer. Both runs use the same kernel: the parallel run's groups mix
#: plain tensors and DTensors (which the multi-tensor ``foreach`` and ``fused`` kernels, CUDA's defaults, refuse
#: unless the runtime steps them apart), the reference's hold plain tensors only. Adam's steps are ~lr per element
#: whatever the gradient's size: its learning rate is 1/1000 of SGD's, and eps is 1e-4 -- with the default 1e-8 a
#: gradient element near 0 turns its ~1e-6 relative difference between the runs into a step of either sign
#: (tp2: weights 1.6e-5 apart after 10 steps; 1.7e-7 with eps 1e-4).
OPTIMIZERS: dict[str, Any] = {
    "sgd": lambda ps, lr, mom: torch.optim.SGD(ps, lr=lr, momentum=mom, foreach=False),
    "sgd_foreach": lambda ps, lr, mom: torch.optim.SGD(ps, lr=lr, momentum=mom, foreach=True),
    "adam_foreach": lambda ps, lr, mom: torch.optim.Adam(ps, lr=lr / 1000, eps=1e-4, foreach=True),
    "adamw_fused": lambda ps, lr, mom: torch.optim.AdamW(ps, lr=lr / 1000, eps=1e-4, weight_decay=0.1,
                                                            fused=True),
    # the rest of the optimizers the runtime steps on local shards (parallel/optim.py), eps as Adam's; RMSprop
    # has no bias correction (first step ~10 lr per element, ~34 lr by step 4 with momentum): lr / 10000 keeps its
    # steps Adam-sized. RAdam only rectifies (reads exp_avg_sq) from step 6: its random cases run 7 steps.
    "adagrad": lambda ps, lr, mom: torch.optim.Adagrad(ps, lr=lr / 1000, eps=1e-4, foreach=False),
    "rmsprop_foreach": lambda ps, lr, mom: torch.optim.RMSprop(ps, lr=lr / 10000, eps=1e-4, momentum=mom,
                                                               centered=True, foreach=True),
    "adamax": lambda ps, lr, mom: torch.optim.Adamax(ps, lr=lr / 1000, eps=1e-4, foreach=True),
    "nadam": lambda ps, lr, mom: torch.optim.NAdam(ps, lr=lr / 1000, eps=1e-4, foreach=False),
    "radam_foreach": lambda ps, lr, mom: torch.optim.RAdam(ps, lr=lr / 1000, eps=1e-4, weight_decay=0.01,
                                                           foreach=True),
}


class FSDPCollectiveCount:
    """Counts FSDP2's parameter all-gathers and gradient reductions (one call per unit each; a unit on a one-rank
    mesh skips the gather) while active, so a check can state per micro-step what the cost model assumes: ZeRO-2
    units gather in every micro-batch (FSDP2 re-shards after each backward) and reduce only in the last one's
    backward when accumulating. It patches torch-private names: if a torch release moves them, nothing is counted
    (the count assertions fail, the parity checks still run)."""

    def __init__(self) -> None:
        self.gathers = self.reduces = 0
        self._group: Any = None

    def __enter__(self) -> "FSDPCollectiveCount":
        try:
            import torch.distributed.fsdp._fully_shard._fsdp_param_group as group

            self._orig = (group.foreach_all_gather, group.foreach_reduce)
        except (ImportError, AttributeError):
            return self
        self._group = group
        gather, reduce = self._orig

        def counted_gather(*a: Any, **k: Any) -> Any:
            self.gathers += 1
            return gather(*a, **k)

        def counted_reduce(*a: Any, **k: Any) -> Any:
            self.reduces += 1
            return reduce(*a, **k)

        group.foreach_all_gather, group.foreach_reduce = counted_gather, counted_reduce
        return self

    def __exit__(self, *exc: object) -> None:
        if self._group is not None:
            self._group.foreach_all_gather, self._group.foreach_reduce = self._orig

    def take(self) -> tuple[int, int]:
        """(gathers, reductions) since the last take."""
        out = (self.gathers, self.reduces)
        self.gathers = self.reduces = 0
        return out


def train_compare(plan_dict: dict, kind: str = "llama", layers: int = 3, steps: int = 10,
                  global_batch: int = 8, seq: int = 16, clip: float | None = None, clip_algorithm: str = "norm",
                  norm_type: float = 2.0, accumulate: int = 1, dropout: float = 0.0, momentum: float = 0.9,
                  lr: float = 0.2, galv_loss: bool = False, label_smoothing: float = 0.0,
                  relayout: bool | int = False, placement: int | None = None,
                  placement_shuffle: bool | str = False, grad_bucket_bytes: int | None = None,
                  optimizer: str = "sgd", expert_sharding: str = "owner", sync_each: bool = False) -> dict[str, Any]:
    """Train under ``plan_dict`` and single-process side by side; compare losses, first-step gradients, weights.

    ``accumulate`` micro-steps (each of ``global_batch`` samples) make one optimizer step; gradient sync
    is off on all but the last, as under the Trainer. ``clip`` clips by global norm (``norm_type``) or by
    value, compared with ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on the reference; the
    global norm itself is compared too (``norm_err``). With ``dropout`` both models draw keyed masks with the
    same key per micro-step (the reference's batch is the shards concatenated in shard order). ``galv_loss``
    computes the parallel run's loss with lightning_galv.loss.cross_entropy (which a plan with
    vocab_parallel_loss needs), the reference's always with F.cross_entropy.

    Warnings raised in this rank while doing so are returned (``warnings``) so a launch can assert that
    none of them is FSDP2's "returned a view tensor" warning (see ``parallel/tensor.py``).

    ``relayout`` runs the LAER-MoE expert re-layout each optimizer step (``True``: default slots per rank,
    an int: that many), planned from the previous step's loads; its records come back as ``relayout``.
    ``placement`` (ranks per simulated node) runs NetMoE sample placement; per-step totals: ``placement``.
    ``placement_shuffle`` replaces its solver by a seeded random balanced placement, so that samples do move
    (on random tokens the solver rightly keeps most of them home) and every relocation path is exercised;
    ``"no_restore"`` also keeps the last layer of a run from sending samples home (a negative control).
    ``grad_bucket_bytes``: ZeRO-0/1 gradient bucket size (None: the runtime's default, 25 MiB).
    ``optimizer``: one of :data:`OPTIMIZERS` (per-tensor loop, multi-tensor ``foreach`` or ``fused`` kernels).
    ``expert_sharding``: ``"full"`` shards every expert over its EP group (LAER-MoE's FSEP) instead of keeping
    it whole on its owner.
    ``sync_each`` syncs gradients after every micro-step's backward, not only the last (manual optimization
    calling ``manual_backward`` several times before one ``step``), and once more before the step.
    """
    with warnings.catch_warnings(record=True) as caught, FSDPCollectiveCount() as counter:
        warnings.simplefilter("always")
        res = _train_compare(plan_dict, kind, layers, steps, global_batch, seq, clip, clip_algorithm, norm_type,
                             accumulate, dropout, momentum, lr, galv_loss, label_smoothing, relayout,
                             placement, placement_shuffle, grad_bucket_bytes, optimizer, expert_sharding, counter,
                             sync_each)
    res["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return res


def _train_compare(plan_dict: dict, kind: str, layers: int, steps: int, global_batch: int, seq: int,
                   clip: float | None, clip_algorithm: str, norm_type: float, accumulate: int, dropout: float,
                   momentum: float, lr: float, galv_loss: bool, label_smoothing: float,
                   relayout: bool | int = False, placement: int | None = None,
                   placement_shuffle: bool | str = False, grad_bucket_bytes: int | None = None,
                   optimizer: str = "sgd", expert_sharding: str = "owner",
                   counter: FSDPCollectiveCount | None = None, sync_each: bool = False) -> dict[str, Any]:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: must be one of {sorted(OPTIMIZERS)}. HINT: add it to OPTIMIZERS.")
    plan = ParallelPlan.from_dict(plan_dict)
    if sync_each and plan.pp > 1:
        raise ValueError("sync_each under a pipeline: its schedule runs every backward. HINT: use pp=1.")
    sharded_seen: list[bool] = []  # per loss call: did the loss get vocab-sharded logits?
    if galv_loss:
        from lightning_galv.loss import cross_entropy, is_vocab_sharded

        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            sharded_seen.append(is_vocab_sharded(logits))
            return cross_entropy(logits, y, label_smoothing=label_smoothing)
    else:
        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return _ce(logits, y, label_smoothing)
    rank = dist.get_rank()
    model = make_model(kind, layers, dropout=dropout)
    # MoE under a pipeline: the aux loss belongs to each micro-batch, so the reference runs the same global
    # micro-batches (micro-batch j = the j-th slice of every loader shard) one after another
    ref_micro = plan.micro_batches if isinstance(model, MoEDecoder) and plan.pp > 1 else 1
    if ref_micro > 1 and dropout:
        raise ValueError("MoE under pp with dropout: the micro-batched reference would draw other masks. "
                         "HINT: use dropout=0 for this check.")
    if hasattr(model, "set_aux_grad_scale"):  # the injected aux-loss gradient is scaled like the LM loss
        model.set_aux_grad_scale(1.0 / accumulate)  # (a pipeline schedule divides by its micro-batches itself)
    ref = copy.deepcopy(model)
    if ref_micro > 1:
        ref.set_aux_grad_scale(1.0 / (accumulate * ref_micro))
    factory = MeshFactory(RankLayout(plan.world_size, plan.pp), "cpu", rank)
    from lightning_galv.parallel.parallelize import parallelize

    rt = parallelize(model, plan, factory, expert_sharding=expert_sharding,
                     **({} if grad_bucket_bytes is None else {"grad_bucket_bytes": grad_bucket_bytes}))
    controller = None
    if relayout:
        from lightning_galv.parallel.expert_relayout import RelayoutController
        from lightning_galv.parallel.moe_step import attach_relayout

        controller = RelayoutController(attach_relayout(model, plan), None if relayout is True else int(relayout))
    relayout_records: list[dict] = []
    placer = None
    if placement:
        from lightning_galv.parallel.moe_step import attach_placement
        from lightning_galv.parallel.sample_placement import PlacementController

        placer = PlacementController(attach_placement(model, plan, int(placement),
                                                      _shuffle_solver() if placement_shuffle else None))
        if placement_shuffle == "no_restore":  # negative control: samples never go home (labels mismatch)
            for d in placer.dispatchers:
                d.restore = False
    placement_steps: list[dict] = []
    opt = OPTIMIZERS[optimizer](model.parameters(), lr, momentum)
    rt.wrap_optimizer(opt)
    ref_opt = OPTIMIZERS[optimizer](ref.parameters(), lr, momentum)
    shard, nshards = rt.data_shard
    gen = torch.Generator().manual_seed(123)
    losses, ref_losses, norm_errs, clipped = [], [], [], []
    fsdp_per_micro: list[tuple[int, int]] = []  # (all-gathers, reductions) of FSDP2 units per micro-step
    # (per schedule run under a pipeline)
    grad_err: dict[str, float] = {}
    grad_layouts: list[str] = []  # DTensor parameters whose first gradient is laid out unlike them
    routing: list[dict[str, bool]] = []
    params = [p for p in model.parameters() if p.requires_grad]

    def scaled_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, y) / accumulate

    for step in range(steps):
        if controller is not None:
            controller.before_step()
        if placer is not None:
            placer.before_step()
        total = torch.zeros(())
        for k in range(accumulate):
            data = torch.randint(0, 64, (global_batch, seq + 1), generator=gen)
            x, y = data[:, :-1], data[:, 1:]
            b = global_batch // nshards
            xl, yl = x[shard * b:(shard + 1) * b], y[shard * b:(shard + 1) * b]
            rt.set_gradient_sync(sync_each or k == accumulate - 1)
            key = len(ref_losses)  # one keyed-dropout key per micro-step, shared with the reference
            set_dropout_key(key)
            if rt.pipeline is not None:
                held = [p.grad for p in params]
                for p in params:
                    p.grad = None
                if counter is not None:
                    counter.take()
                loss, _ = rt.pipeline.run(xl, yl, scaled_loss, train=True)
                if counter is not None:  # under a pipeline: per run of the schedule (all its micro-batches)
                    fsdp_per_micro.append(counter.take())
                for p, h in zip(params, held):
                    if h is not None:
                        p.grad = h if p.grad is None else p.grad + h
                loss = loss * accumulate
            else:
                if counter is not None:
                    counter.take()
                loss = loss_fn(model(xl), yl)
                (loss / accumulate).backward()
                if sync_each:
                    rt.after_backward()
                if counter is not None:
                    fsdp_per_micro.append(counter.take())
            total += loss.detach()
            with restore_coords(DropoutCoords(key=key)):  # one process: rows 0..B-1, full sequence
                if ref_micro > 1:
                    mb = b // ref_micro
                    parts = []
                    for j in range(ref_micro):
                        rows = [r * b + j * mb + i for r in range(nshards) for i in range(mb)]
                        lj = _ce(ref(x[rows]), y[rows], label_smoothing)
                        (lj / (accumulate * ref_micro)).backward()
                        parts.append(lj.detach())
                    rloss = torch.stack(parts).mean()
                else:
                    rloss = _ce(ref(x), y, label_smoothing)
                    (rloss / accumulate).backward()
            ref_losses.append(float(rloss))
            if step == 0 and k == 0 and plan.pp == 1 and getattr(model, "moe_layers", None):
                routing = _routing_checks(model, ref, plan)
            g = loss.detach().clone()
            dist.all_reduce(g)
            losses.append(float(g) / dist.get_world_size())
        rt.sync_gradients()
        if step == 0 and plan.pp == 1:  # (under pp a stage holds only its layers; weights are compared below)
            grad_err = grad_errors(model, ref)
        if step == 0:  # every DTensor gradient laid out like its parameter (else the optimizer steps it whole)
            from torch.distributed.tensor import DTensor as _DT

            grad_layouts = sorted(n for n, p in model.named_parameters() if isinstance(p, _DT)
                                  and isinstance(p.grad, _DT) and p.grad.placements != p.placements)
        if clip is not None and clip_algorithm == "norm":
            norm = float(rt.clip_grad_norm_(clip, norm_type))
            ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip, norm_type))
            norm_errs.append(abs(norm - ref_norm) / ref_norm)
            clipped.append(ref_norm > clip)
        elif clip is not None:
            clipped.append(any(bool((p.grad.abs() > clip).any()) for p in ref.parameters() if p.grad is not None))
            rt.clip_grad_value_(clip)
            torch.nn.utils.clip_grad_value_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if controller is not None:
            relayout_records += [r.__dict__ for r in controller.after_step()]
        if placer is not None:
            placement_steps.append(placer.after_step().__dict__)
    got, want = full_state(model), dict(ref.named_parameters())
    if plan.pp > 1 or any(st.ep > 1 for st in plan.layers):
        # each stage holds its own layers, each EP rank its own experts: compare those, and check all were covered
        held_keys = sorted(got)
        everywhere: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everywhere, held_keys)
        covered = set().union(*map(set, everywhere))
        want = {k: v for k, v in want.items() if k in got} if covered == set(want) else want
    errs = {k: rel_err(got[k], want[k].detach()) for k in want}
    worst = max(errs, key=errs.get)
    weight_err = errs[worst]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    moe_layers = list(getattr(model, "moe_layers", None) or [])  # MoEDecoder's, or a HF model's (HFSparseMoE)
    from torch.distributed.fsdp import FSDPModule

    # the modules under FSDP2, grouped by state (a unit of several modules may share one), and which
    # states ended up roots ("" = the model itself)
    fsdp_states: dict[int, list[str]] = {}
    for n, m in model.named_modules():
        if isinstance(m, FSDPModule):
            fsdp_states.setdefault(id(m._get_fsdp_state()), []).append(n)
    fsdp_roots = sorted(n for n, m in model.named_modules()
                        if isinstance(m, FSDPModule) and m._get_fsdp_state()._is_root)
    names = {id(m): n for n, m in model.named_modules()}
    fsdp_prefetch = {n: [names[id(t._modules[0])] for t in m._get_fsdp_state()._states_to_forward_prefetch]
                     for n, m in model.named_modules() if isinstance(m, FSDPModule)}
    fsdp_prefetch = {n: t for n, t in fsdp_prefetch.items() if t}
    experts_held = [_experts_held(m) for m in moe_layers]
    all_to_all = [m.last_stats is not None and m.last_stats.send_splits is not None for m in moe_layers]
    # the user's parameter groups survive the steps (split copies only live inside a step)
    groups_kept = [[id(p) for p in g["params"]] for g in opt.param_groups] == [[id(p) for p in model.parameters()]]
    return {"loss_err": loss_err, "weight_err": weight_err, "losses": losses, "ref_losses": ref_losses,
            "grad_layouts": grad_layouts,
            "groups_kept": groups_kept,
            "experts_held": experts_held, "all_to_all": all_to_all, "routing": routing,
            "keys_equal": sorted(got) == sorted(want), "worst": worst, "grad_err": grad_err, "pp": plan.pp,
            "norm_err": max(norm_errs, default=0.0), "clipped": clipped, "sharded_seen": sharded_seen,
            "relayout": relayout_records, "placement": placement_steps, "fsdp_roots": fsdp_roots,
            "fsdp_states": sorted(fsdp_states.values()), "fsdp_prefetch": fsdp_prefetch,
            "fsdp_per_micro": fsdp_per_micro}


def _experts_held(layer: torch.nn.Module) -> int:
    """Experts whose weights this rank holds: expert modules with parameters (MoEDecoder), or for a HF layer's fused
    tensors the rows of this rank's shard on the mesh dim named "ep" (all of them when not expert-parallel)."""
    if isinstance(layer.experts, torch.nn.ModuleList):
        return sum(1 for e in layer.experts if any(True for _ in e.parameters()))
    p = layer.experts.gate_up_proj
    names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
    if "ep" not in names:
        return layer.num_experts
    i = names.index("ep")
    assert p.placements[i].is_shard(0), p.placements
    return layer.num_experts // p.device_mesh.size(i)


def _shuffle_solver() -> Any:
    """A placement policy moving samples to random ranks (each keeps its count), seeded by its input: a pure
    function of the routing, as a real policy must be, so every rank and every activation-checkpoint recompute
    (which solves again) gets the same placement."""
    from lightning_galv.planner.placement import PlacementPolicy

    class Shuffle(PlacementPolicy):
        def place(self, tokens: Any, current: Any, topo: Any, residual_tokens: Any = None) -> Any:
            import zlib

            import numpy as np

            rng = np.random.default_rng(zlib.crc32(np.ascontiguousarray(tokens).tobytes()))
            return rng.permutation(np.asarray(current))
    return Shuffle()


def _routing_checks(model: MoEDecoder, ref: MoEDecoder, plan: ParallelPlan) -> list[dict[str, bool]]:
    """Routing statistics of the first forward against the single process's (issue 11 item 3).

    ``total``: this rank's processed assignments are tokens * k. ``global``: summed over the ranks (each tp
    group holds the same tokens: divide by its size), the per-expert counts are those one process routes for
    the global batch. ``splits``: the all-to-all sent every assignment, received what the experts ran on, and
    this rank's row of the (source x expert) matrix is its own counts; the rows it received from equal the
    received split sizes."""
    out = []
    world = dist.get_world_size()
    for layer, rlayer in zip(model.moe_layers, ref.moe_layers):
        st, want = layer.last_stats, rlayer.last_stats
        s = plan.layers[layer.layer_idx]
        counts = torch.tensor(st.tokens_per_expert)
        dist.all_reduce(counts)
        glob = (counts // (world // s.data_group)).tolist() == list(want.tokens_per_expert)
        splits = True
        if st.send_splits is not None:
            table = st.source_expert_counts  # [EP sources][E]
            per = st.num_experts // len(table)
            mine = [row for row in table if list(row) == list(st.tokens_per_expert)]  # this rank's own row
            splits = (bool(mine) and sum(st.send_splits) == st.tokens * st.top_k
                      and sum(st.recv_splits) == sum(st.expert_splits)
                      and list(st.send_splits) == [sum(mine[0][r * per:(r + 1) * per]) for r in range(len(table))])
        out.append({"total": sum(st.tokens_per_expert) == st.tokens * st.top_k, "global": glob, "splits": splits})
    return out


def run_many(cases: list[tuple[str, dict, dict]]) -> dict[str, Any]:
    """Several plan checks in one launch (start-up dominates on CPU); each check's groups are released
    before the next (:func:`lightning_galv.testing.release_subgroups`)."""
    out = {}
    for name, plan, kw in cases:
        out[name] = train_compare(plan, **kw)
        dist.barrier()
        release_subgroups()
    return out



def vocab_loss_checks(vocab: int = 1024, batch: int = 8, seq: int = 32) -> dict[str, Any]:
    """On a tp group of all ranks: (1) the vocab-parallel loss equals F.cross_entropy in value and logit
    gradient for every option; (2) the saved activations of head + loss, measured with
    ``saved_tensors_hooks``, under the gathered head and under ``vocab_parallel_loss``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_galv.loss import cross_entropy
    from lightning_galv.parallel.redistribute import PENDING_ATTR, PendingRelayout

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(batch, seq, vocab, generator=g) * 4
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    targets[0, :3] = 5
    width = vocab // world
    formula: dict[str, float] = {}
    for name, kw in {"mean": {}, "sum": {"reduction": "sum"}, "none": {"reduction": "none"},
                     "ignore5": {"ignore_index": 5}, "smooth": {"label_smoothing": 0.1},
                     "ignore5_smooth_sum": {"ignore_index": 5, "label_smoothing": 0.3, "reduction": "sum"}}.items():
        full = logits.clone().requires_grad_()
        mine = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_()
        dt = DTensor.from_local(mine, mesh, (Shard(2),), run_check=False)
        setattr(dt, PENDING_ATTR, PendingRelayout())
        got = cross_entropy(dt, targets, **kw)
        want = F.cross_entropy(full.reshape(-1, vocab), targets.reshape(-1), **kw)
        got.sum().backward()
        want.sum().backward()
        err_v = float((got - want).abs().max() / want.abs().max())
        err_g = rel_err(mine.grad, full.grad[..., rank * width:(rank + 1) * width])
        formula[name] = max(err_v, err_g)

    # saved activations of head + loss, gathered vs vocab-parallel (Llama head, fp32)
    from lightning_galv.layout import MeshFactory, RankLayout
    from lightning_galv.parallel.parallelize import parallelize
    from lightning_galv.plan import LayerStrategy as L

    saved: dict[str, int] = {}
    for vpl in (False, True):
        torch.manual_seed(0)
        model = Llama(LlamaConfig(vocab_size=vocab, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                  ffn_hidden=64, max_seq_len=seq))
        plan = ParallelPlan(world, (L(tp=world),), embed=L(tp=world), head=L(tp=world), vocab_parallel_loss=vpl)
        parallelize(model, plan, MeshFactory(RankLayout(world, 1), "cpu", rank))
        h = model.norm(model.tok_embeddings(targets)).detach().requires_grad_()  # the head's input
        seen: dict[tuple, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            lt = t.to_local() if isinstance(t, DTensor) else t
            key = (lt.untyped_storage().data_ptr(), lt.storage_offset(), tuple(lt.shape))
            seen[key] = lt.numel() * lt.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model.output(h)
            loss = cross_entropy(out, targets)
        loss.backward()
        saved["vpl" if vpl else "gathered"] = sum(seen.values())
    return {"formula": formula, "saved": saved, "tokens": batch * seq, "vocab": vocab, "hidden": 32, "tp": world}


def grad_overlap_check(bucket_bytes: int = 4096) -> dict[str, Any]:
    """Two ZeRO-0 plans with small gradient buckets.

    ``uniform`` (dp over all ranks): how many buckets were already launched when backward returned (before
    sync), whether the gradients in flight are views of their bucket, and the synced gradients vs an explicit
    all-reduce mean of the local gradients.

    ``groups`` (4 ranks; embedding and head dp4, blocks dp2 x tp2: two data groups): how many of the blocks'
    buckets were launched by the time the embedding's gradient -- the last of backward -- arrived. Launching
    the buckets group after group would hold every block bucket behind the embedding's bucket. (The values
    of such plans' gradients are checked by the random-plan parity runs.)"""
    from lightning_galv.layout import MeshFactory, RankLayout
    from lightning_galv.parallel.data_parallel import local
    from lightning_galv.parallel.parallelize import parallelize
    from lightning_galv.plan import LayerStrategy as L

    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = {}
    for kind in ("uniform", "groups") if world == 4 else ("uniform",):
        model = make_model("llama", 3)
        if kind == "uniform":
            plan = ParallelPlan.uniform(world, 3, L(dp=world))
        else:
            plan = ParallelPlan(world, (L(dp=2, tp=2),) * 3, embed=L(dp=4), head=L(dp=4))
        local_grads: dict[str, torch.Tensor] = {}
        for n, p in model.named_parameters() if kind == "uniform" else ():  # before the runtime's hooks
            p.register_post_accumulate_grad_hook(lambda p, n=n: local_grads.__setitem__(n, p.grad.detach().clone()))
        emb = model.tok_embeddings.weight
        at_embedding: dict[str, int] = {}
        others: list[Any] = []  # filled below; the hook is registered now to run before the runtime's
        emb.register_post_accumulate_grad_hook(
            lambda p: at_embedding.__setitem__("others_launched", sum(b.work is not None for b in others)))
        rt = parallelize(model, plan, MeshFactory(RankLayout(world, 1), "cpu", rank), grad_bucket_bytes=bucket_bytes)
        buckets = rt.grad_sync.buckets()
        emb_group = next(b.group for b in buckets if any(p is emb for p in b.params))
        others += [b for b in buckets if b.group is not emb_group]
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 64, (2, 17), generator=g)
        logits = model(x[:, :-1])
        _ce(logits, x[:, 1:]).backward()
        r: dict[str, Any] = {"buckets": len(buckets), "launched_in_backward": sum(b.work is not None for b in buckets),
                             "others": len(others), "others_launched_at_embedding": at_embedding["others_launched"]}
        # in flight, the gradients are views of their bucket (no second copy of them exists)
        r["views"] = sum(local(p.grad).untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
                         for b in buckets if b.work is not None for p in b.params)
        r["in_flight"] = sum(len(b.params) for b in buckets if b.work is not None)
        rt.sync_gradients()
        if kind == "uniform":
            want = {}
            for n, t in local_grads.items():
                dist.all_reduce(t)
                want[n] = t / world
            r["err"] = max((p.grad - want[n]).abs().max().item() / max(want[n].abs().max().item(), 1e-12)
                           for n, p in model.named_parameters())
        out[kind] = r
    return out



def factory_close_check() -> dict[str, Any]:
    """MeshFactory.close twice over (2 ranks): a Ulysses data mesh and an expert mesh, used by DTensor ops, then
    closed; every group the factory made is gone (threads too, once the meshes are dropped), and a second factory with equal meshes works (DTensor's
    caches would otherwise hand it the first factory's destroyed groups)."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_galv.plan import LayerStrategy

    rank, world = dist.get_rank(), dist.get_world_size()
    import gc

    def threads() -> int:  # a gloo group runs its own threads until the C++ group object is freed
        return len(os.listdir("/proc/self/task"))

    before, threads0 = len(c10d._world.pg_map), threads()
    uly, ep = LayerStrategy(tp=world, sp="ulysses"), LayerStrategy(dp=world, ep=world)
    out: dict[str, Any] = {}
    for round_ in range(2):
        with MeshFactory(RankLayout(world), "cpu", rank) as factory:
            tp = factory.mesh(uly)["tp"]
            flat, experts = factory.data_mesh(uly), factory.expert_mesh(ep)
            built = len(c10d._world.pg_map) - before
            x = distribute_tensor(torch.arange(8.0).reshape(4, 2), tp, [Shard(0)])
            full = (x * 2).redistribute(tp, [Replicate()]).to_local()  # [4, 2] on every rank
            g = torch.full((1,), float(rank + 1))
            dist.all_reduce(g, group=flat.get_group())
            e = torch.full((1,), float(rank + 1))
            dist.all_reduce(e, group=experts["ep"].get_group())
            threads_open = threads()
        del factory, tp, flat, experts, x
        gc.collect()
        out[f"round{round_}"] = {"built": built, "left": len(c10d._world.pg_map) - before,
                                 "threads_open": threads_open - threads0, "threads_left": threads() - threads0,
                                 "full": full.tolist(), "flat_sum": g.item(), "ep_sum": e.item()}
    return out


def unused_param_check() -> dict[str, Any]:
    """GradientSync (ZeRO-0) on the world group, buckets launched at sync and during backward: ``a`` is used on
    every rank, ``b`` (plain) and ``d`` (a replicated DTensor) on rank 0 only, ``c`` nowhere. Every rank must end
    with the same reduced gradients (b and d too), and ``c`` without one (returns each rank's values)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from lightning_galv.parallel.data_parallel import GradientSync

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for mode in ("at_sync", "overlapped"):
        torch.manual_seed(0)
        a, b, c = (torch.nn.Parameter(torch.randn(5)) for _ in range(3))
        d = torch.nn.Parameter(distribute_tensor(torch.randn(5), mesh, [Replicate()]))
        gs = GradientSync(world, bucket_bytes=1 << 20)
        gs.add([a, b, c, d], dist.group.WORLD, world)
        if mode == "overlapped":
            gs.overlap_backward()
        x = torch.full((5,), float(rank + 1))
        loss = (a * x).sum()
        if rank == 0:
            loss = loss + (b * x * 3).sum() + (d.to_local() * x * 5).sum()
        loss.backward()
        gs.sync()
        out[mode] = {"a": a.grad.tolist(), "b": None if b.grad is None else b.grad.tolist(), "c": c.grad,
                     "d": None if d.grad is None else d.grad.full_tensor().tolist(),
                     "d_dtensor": hasattr(d.grad, "to_local")}
    return out
