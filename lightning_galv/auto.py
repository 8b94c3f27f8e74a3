"""Automatic mode: profile (or load cached profiles) -> search -> one plan, identical on every rank.

Hardware is profiled by all ranks together (collectives need everyone); the model is profiled and
the plan searched on rank 0 only, then broadcast, because per-rank timings differ slightly and every
rank must apply the same plan.

The search is restricted to what *this run* can execute, not to what the planner can describe:

* the data loader's batch size ``b`` is fixed by the user, so a plan with ``D`` data shards trains on a
  global batch of ``b * D`` samples. Every plan the search emits serves ``D = world / pp`` shards (its
  embedding is data-parallel over the whole stage), so a pipeline degree ``pp`` means a global batch
  of ``b * world / pp``;
* the pipeline schedule splits each rank's loader batch into ``micro_batches``, so ``micro_batches``
  must divide ``b``; without a pipeline (pp = 1) the runtime does not split the batch at all (gradient
  accumulation is Lightning's ``accumulate_grad_batches``), so pp = 1 means one micro-batch;
* pp > 1 needs the LightningModule's pipeline hooks (``galv_pipeline_batch`` / ``galv_pipeline_loss``).

Plans are priced with ``GalvatronCostModel(runtime="native")``: what lightning_galv's runtime does
(FSDP2 keeps gathered parameters, ZeRO-1 owners broadcast), not the textbook model.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from .errors import bad_value
from .models.protocol import ModelParts
from .plan import SP_MODES, LayerStrategy, ParallelPlan
from .units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .planner import HardwareProfile, ModelProfile, ProfileCache
    from .planner.cost import GalvatronCostModel
    from .profiling import ModelProfiler

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
# loader batch assumed when it cannot be read (a loader without a batch_size, several loaders): only
# pp = 1 with one micro-batch is searched then, which runs with any batch size
_ASSUMED_LOADER_BATCH = 2
# Rounds over which the ShardedLayerProfiler times every variant (interleaved; medians over rounds). With 2 an
# entry's median was the mean of two passes, so one pass in a slow spell of a shared host moved it whole: the MoE
# accuracy benchmark's predictions of one plan spread over 64-92 ms across fresh profiles (2r moe ep2, run at
# 02612fb). From 4 on, a single outlying pass no longer sets an entry's median.
SHARDED_PROFILE_ROUNDS = 4
# ... and more rounds, up to SHARDED_PROFILE_MAX_ROUNDS, while they fit in SHARDED_PROFILE_BUDGET_S seconds of timing
# per layer type (profiling.profilers.rounds_within_budget): a small block's entries are cheap and noisy, so it
# takes many (the MoE accuracy benchmark's decoder at 2 ranks: 13 [9, 16] rounds), a large one keeps the minimum.
SHARDED_PROFILE_BUDGET_S = 20.0
SHARDED_PROFILE_MAX_ROUNDS = 16
# a user's budget instead, in seconds (0: SHARDED_PROFILE_ROUNDS rounds, no more): see profile_budget_s()
PROFILE_BUDGET_ENV = "GALV_PROFILE_BUDGET_S"


def profile_budget_s() -> float | None:
    """Seconds of timing per layer type that automatic mode's sharded profile may fill with more rounds:
    ``$GALV_PROFILE_BUDGET_S`` if set, else :data:`SHARDED_PROFILE_BUDGET_S`; ``None`` (from ``0``) for exactly
    :data:`SHARDED_PROFILE_ROUNDS` rounds.

    Why a knob: the extra rounds buy precision for small, cheap blocks (a noisy entry's median), and cost up to the
    budget per layer type on every fresh profile -- 20 s of a 2-rank ``galv demo --auto`` whose training takes
    14 s on a 2-core VM. Someone iterating on a small model, or a test suite that checks behaviour rather than the
    profile's precision, can trade that precision away; the benchmarks keep the default. An environment variable
    rather than an argument because every way in reads it alike (the strategy, ``galv profile`` / ``search``,
    the tuner's trials, recipes), as ``$GALV_CACHE_DIR`` is read. Profiles taken under different budgets are
    cached apart (the budget is part of the key)."""
    raw = os.environ.get(PROFILE_BUDGET_ENV, "").strip()
    if not raw:
        return SHARDED_PROFILE_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):  # (NaN fails the first test)
        raise bad_value(f"{PROFILE_BUDGET_ENV}={raw}", "must be a number of seconds >= 0",
                        f"e.g. {PROFILE_BUDGET_ENV}=20 (the default), or 0 for exactly {SHARDED_PROFILE_ROUNDS} timed "
                        "rounds per layer type; unset it for the default")
    return value or None


def parse_bytes(value: str | int | float) -> float:
    """``"20GB"`` -> 2e10, ``"512MiB"`` -> 536870912, numbers pass through."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"memory_budget={value}: must be > 0. HINT: e.g. memory_budget='20GB'.")
        return float(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory_budget={value!r}: not a size. HINT: write e.g. '20GB', '512MiB' or a byte count.")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def device_memory(device: torch.device) -> float:
    """Capacity per rank: the GPU's memory, or on CPU this machine's RAM shared by its local ranks."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return float(psutil.virtual_memory().total) / max(1, local)


def run_configs(world_size: int, num_layers: int, loader_batch: int | None,
                pipeline: bool) -> list[tuple[int, int, tuple[int, ...]]]:
    """``(pp, global_batch, micro_batch counts)`` this run can execute (see the module docstring)."""
    if loader_batch is None:
        return [(1, _ASSUMED_LOADER_BATCH * world_size, (1,))]
    out = []
    for pp in range(1, world_size + 1):
        if world_size % pp or pp > num_layers or (pp > 1 and not pipeline):
            continue
        ms = (1,) if pp == 1 else tuple(m for m in range(1, loader_batch + 1) if loader_batch % m == 0)
        out.append((pp, loader_batch * (world_size // pp), ms))
    return out


def block_types(blocks: "list[nn.Module] | nn.ModuleList") -> tuple[list[int], list[int], list[str]]:
    """Group a model's blocks into layer types: (type of each block, first block of each type, type names).

    Blocks are one type when they have the same class, the same parameter shapes and the same MoE layer (if
    any): then they take the same time and memory, and the search prices one and reuses it. A model mixing
    dense and MoE blocks (``MoEDecoder`` with ``moe_every > 1``) gets two types -- and only the MoE one may
    take expert parallelism. The names say what a type is; they key the profile cache.
    """
    from .profiling.profilers import moe_facts

    keys: dict[tuple, int] = {}
    type_of: list[int] = []
    first: list[int] = []
    names: list[str] = []
    for i, block in enumerate(blocks):
        facts = moe_facts(block)
        key = (type(block).__qualname__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()), facts)
        if key not in keys:
            keys[key] = len(keys)
            first.append(i)
            moe = "" if facts is None else (f"[E{facts.num_experts} top{facts.top_k} expert{facts.expert_params} "
                                            f"shared{facts.shared_params}]")
            names.append(f"{type(block).__name__}{moe}#{len(names)}")
        type_of.append(keys[key])
    return type_of, first, names


def profile_batch_sizes(loader_batch: int | None, ways: int = 1) -> tuple[int, ...]:
    """Samples per block the model profiles time: 1 and 2 (cheap, and they pin the fit's constant), plus the
    per-rank batch the block runs at when it is larger: a data-parallel layer runs at exactly the training
    loader's per-shard batch, so its time is measured rather than read off an affine fit of two small, noisy
    runs. (In the MoE accuracy benchmark this did not by itself close the gap of the plans without ep: the
    2-rank dp2 plan stayed ~33 % under-predicted when its 4-sample block was measured directly -- the missing
    time is outside the block's own fwd/bwd.)

    ``ways``: the block's tensor-parallel degree. A tp-t block's data group is t times smaller than the loader's
    shards, so each of its ranks runs ``t x loader_batch`` samples (:func:`run_configs`: global batch = loader
    batch x stage size; a pipeline's micro-batches split that); the sharded profiler times such a variant at that
    count (capped at ``8 x ways``: as many samples' worth of tp-split math per rank as a tp-1 block's cap). Why:
    what one more sample costs grows with the batch on CPU (caches), so a line through 1 and 2 samples priced a
    block run at 4 samples ~8 % low and at 8 ~18 % low (MoE block, one rank), and tp plans looked cheaper than
    they are."""
    sizes = {1, 2}
    if loader_batch is not None and loader_batch * ways > 2:
        sizes.add(min(int(loader_batch) * ways, 8 * ways))
    return tuple(sorted(sizes))


def tp_batch_sizes(loader_batch: int | None, world_size: int) -> dict[int, tuple[int, ...]]:
    """Per tensor-parallel degree t > 1 of this world, the sample counts its sharded variants are timed at
    (:func:`profile_batch_sizes` with ``ways=t``); an unknown loader batch is taken as the one the search then
    assumes."""
    loader = _ASSUMED_LOADER_BATCH if loader_batch is None else loader_batch
    return {t: profile_batch_sizes(loader, t) for t in range(2, world_size + 1) if world_size % t == 0}


def profile_model(model: nn.Module, parts: ModelParts, cache: "ProfileCache | None" = None,
                  verbose: bool = False, batch_sizes: tuple[int, ...] = (1, 2),
                  device: "torch.device | str" = "cpu") -> "ModelProfile":
    """The model profile automatic mode searches with (from ``cache`` when these blocks were measured
    before): one layer type per kind of block (:func:`block_types`), each measured on its first block at
    ``batch_sizes`` samples (:func:`profile_batch_sizes`), on ``device`` (where training runs)."""
    return model_profiler(model, parts, cache, verbose, batch_sizes, device).fit()


def model_profiler(model: nn.Module, parts: ModelParts, cache: "ProfileCache | None" = None,
                   verbose: bool = False, batch_sizes: tuple[int, ...] = (1, 2),
                   device: "torch.device | str" = "cpu", time_optimizer: bool = True,
                   busy_ranks: int = 1) -> "ModelProfiler":
    """The ModelProfiler :func:`profile_model` runs (its ``key()`` tells a cached profile without measuring);
    ``time_optimizer=False`` when :func:`sharded_profile` will measure the optimizer step (several ranks);
    ``busy_ranks``: how many ranks run it at once."""
    from .profiling import ModelProfiler
    from .profiling.profilers import buffer_bytes

    if parts.shape is None:
        raise bad_value(f"{type(model).__name__}: no galv_shape", "profiling needs the model's shape",
                        "implement the block protocol (lightning_galv.models.protocol)")
    type_of, first, names = block_types(parts.blocks)
    makes = [lambda b=parts.blocks[i]: copy.deepcopy(b).float() for i in first]
    common = dict(batch_sizes=batch_sizes, repeats=2, cache=cache, progress=verbose, buffer_bytes=buffer_bytes(model),
                  make_head=head_maker(parts), make_embed=embed_maker(parts), device=str(torch.device(device)),
                  time_optimizer=time_optimizer, busy_ranks=busy_ranks)
    if len(makes) == 1 and "[" not in names[0]:  # a dense model of one block kind: one unnamed layer type
        return ModelProfiler(makes[0], parts.shape, **common)
    return ModelProfiler(makes, parts.shape, layer_type_of=type_of, kinds=names, **common)


def head_maker(parts: ModelParts) -> Callable[[], nn.Module] | None:
    """A copy of the final norm + output projection as one module, ``[b, s, h] -> logits``, for the ModelProfiler
    to time the head with its loss, forward and backward.

    Why: without it the profile's head fit is zero and every plan's head goes unpriced (before 4cfcf3f automatic
    mode never passed one, so every automatic-mode profile priced the head at 0 ms)."""
    if parts.head is None:
        return None
    mods = [m for m in (parts.final_norm, parts.head) if m is not None]
    return lambda: copy.deepcopy(nn.Sequential(*mods)).float()


def embed_maker(parts: ModelParts) -> Callable[[], nn.Module] | None:
    """A copy of the token embedding, ``[b, s]`` ids -> ``[b, s, h]``, for the ModelProfiler to time its lookup and
    its backward (which writes a whole ``vocab x hidden`` gradient: not free with a large vocabulary)."""
    if parts.embedding is None:
        return None
    emb = parts.embedding
    return lambda: copy.deepcopy(emb).float()


def priced_hardware(model: "ModelProfile", hw: "HardwareProfile | None", budget: float) -> "HardwareProfile":
    """The hardware profile plans are priced with: the measured collectives (a single-rank stand-in when
    there is nothing to measure) and, as memory bandwidth, the optimizer bandwidth the model profile
    measured -- the HardwareProfiler does not time optimizer steps, and the value travels with the
    cached model profile, so a cache hit prices the optimizer step exactly like the first run."""
    from dataclasses import replace

    from .planner import HardwareProfile

    if hw is None:
        hw = HardwareProfile.uniform(1, 1, budget, memory_bandwidth=0.0, name="single-rank")
    return replace(hw, memory_bandwidth=model.optimizer_bandwidth)


@dataclass(frozen=True)
class AutoSearch:
    """What automatic mode chose and what it chose from (the same on every rank)."""

    plan: ParallelPlan
    model: "ModelProfile | None"  # None: a model without the block protocol (plain DP, nothing searched)
    hardware: "HardwareProfile | None"
    budget: float  # bytes per rank given to the search
    memory_margin: float  # plans were searched to fit budget * (1 - memory_margin)
    loader_batch: int | None  # samples per data shard per step, None when it could not be read
    explanation: str

    def cost_model(self) -> "GalvatronCostModel":
        """The cost model the search priced plans with (to predict other plans the same way)."""
        from .planner import GalvatronCostModel
        from .planner.space import SearchSpace

        if self.model is None or self.hardware is None:
            raise ValueError("AutoSearch.model=None: the model has no block protocol, so nothing was priced. "
                             "HINT: implement the protocol (lightning_galv.models.protocol) to get predictions.")
        return GalvatronCostModel(self.model, self.hardware, SearchSpace().default_embed_zero, runtime="native")


def auto_plan(model: nn.Module, parts: ModelParts, world_size: int, device: torch.device,
              memory_budget: str | int | float | None = None, loader_batch: int | None = None,
              pipeline: bool = False, memory_margin: float | None = None, verbose: bool = True,
              vocab_parallel_loss: bool = False, routing_skew: "Mapping[int, float] | None" = None) -> AutoSearch:
    """Search a plan for ``model`` on this machine over every pipeline degree and micro-batch count the
    run supports; ``loader_batch`` is the per-shard batch of the training loader, ``pipeline`` whether
    the LightningModule implements the pipeline hooks, ``memory_margin`` the fraction of the budget the
    search keeps free (None: the planner's default, 2 %), ``vocab_parallel_loss`` whether the loss takes
    vocab-sharded logits (priced, and set on the plan), ``routing_skew`` the busiest EP rank's routed copies over
    the mean per ep on the training data (``profiling.measure_routing_skew``; priced for the MoE layer types,
    ``ModelProfile.with_routing_skew``; None: balanced routing). Models without the block protocol get a plain
    data-parallel plan (no profile, no search)."""
    from .planner import HardwareProfile
    from .planner.search import DEFAULT_MEMORY_MARGIN

    budget = parse_bytes(memory_budget) if memory_budget is not None else device_memory(device)
    margin = DEFAULT_MEMORY_MARGIN if memory_margin is None else memory_margin
    rank = dist.get_rank()
    n_layers = len(parts.blocks)
    if not parts.understood or parts.shape is None:
        # no protocol: only data parallelism applies; shard when replicas would not fit
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        zero = 3 if 4 * params > budget else 0  # weights + grads + 2 Adam moments
        plan = ParallelPlan.uniform(world_size, n_layers, LayerStrategy(dp=world_size, zero=zero))
        _say(verbose and rank == 0, f"auto plan (model without the block protocol): {plan.layers[0].short()}")
        return AutoSearch(plan, None, None, budget, margin, loader_batch, "model without the block protocol: data parallel")
    profile, hw = measure_profiles(model, parts, world_size, budget, verbose, loader_batch=loader_batch,
                                   device=device)
    if routing_skew:  # the same profile on every rank: all raise alike for a model without MoE layer types
        profile = profile.with_routing_skew(routing_skew)
    box: list[Any] = [None]
    error: BaseException | None = None
    if rank == 0:
        try:
            found = search_run_plans(profile, hw, world_size, n_layers, budget, margin, loader_batch, pipeline,
                                     vocab_parallel_loss, sp_modes=parts.sp_modes, check_plan=parts.check_plan)
            best = found.plans[0]
            box[0] = (best.to_dict(), found.model.to_json(), found.hardware.to_json(), "\n".join(found.notes))
            if verbose:
                _say(True, f"auto plan, searched under {format_bytes(budget)} per rank less a {margin:.0%} margin:\n  "
                     + "\n  ".join(found.notes) + "\n" + best.describe())
        except Exception as exc:  # noqa: BLE001 - every kind must reach the other ranks, not only ValueError
            error = exc
            box[0] = ("error", type(exc).__name__, str(exc))
    # Rank 0 decides alone, so its failure is broadcast like its plan: every rank raises the same error
    # instead of the others dying later in a collective rank 0 never joins ("connection closed").
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0][0] == "error":
        _, kind, message = box[0]
        raise _RANK0_ERRORS.get(kind, RuntimeError)(
            message if kind in _RANK0_ERRORS else f"rank 0 failed while planning ({kind}): {message} HINT: see "
            "rank 0's traceback for where.")
    from .planner import ModelProfile

    plan_d, model_json, hw_json, notes_text = box[0]
    return AutoSearch(ParallelPlan.from_dict(plan_d), ModelProfile.from_json(model_json),
                      HardwareProfile.from_json(hw_json), budget, margin, loader_batch, notes_text)


def measure_profiles(model: nn.Module, parts: ModelParts, world_size: int, budget: float, verbose: bool = True,
                     cache: "ProfileCache | None" = None, loader_batch: int | None = None,
                     device: "torch.device | str | None" = None) -> "tuple[ModelProfile, HardwareProfile | None]":
    """The profiles automatic mode (and ``galv profile`` / ``galv search``) plans with, measured or read from
    ``cache`` (default: ``$GALV_CACHE_DIR``): collectives on all ranks (None on one rank), the model's block
    types and ends (rank 0's measurement, shared with every rank), then the runtime's sharded blocks on all
    ranks, at the sample counts of :func:`profile_batch_sizes` (``loader_batch``: the training loader's
    per-shard batch, if known), each rank on ``device`` (where training runs; None: this rank's GPU under NCCL,
    else the CPU).
    Every rank of the default process group must call it together.

    Why every rank runs the ModelProfiler while only rank 0's result is kept: in training every rank computes at
    once, and ranks that share cores and memory are slower together (4 CPU ranks on 2 cores: rank 0 alone timed
    Adam steps 2.3-3x faster). The ends (embedding, head + loss) are priced from this profiler only. The cost:
    every rank holds the profiler's copies of one block per kind, the embedding and the head at once (on a CPU
    host with a large vocabulary, a V x h copy and its gradient per rank), where only rank 0 did before."""
    from .planner import ModelProfile, ProfileCache
    from .profiling import HardwareProfiler

    cache = cache if cache is not None else ProfileCache()
    rank = dist.get_rank()
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    hw = HardwareProfiler(sizes_bytes=(1 << 14, 1 << 18), repeats=2, device_memory_bytes=budget, cache=cache,
                          progress=verbose, device=str(torch.device(device))).fit() if world_size > 1 else None
    sizes = profile_batch_sizes(loader_batch)
    # rank 0 reads the cache and saves to it; a miss is measured on every rank at once
    profiler = model_profiler(model, parts, cache if rank == 0 else None, verbose and rank == 0, sizes, device,
                              time_optimizer=hw is None, busy_ranks=dist.get_world_size())
    hit = _shared(rank, lambda: (lambda p: None if p is None else p.to_json())(profiler.cached()))
    if hit is None:
        mine = _on_every_rank(profiler.fit)  # every rank measures beside the others; rank 0's is kept (and cached)
        hit = _shared(rank, mine.to_json)
    profile = ModelProfile.from_json(hit)
    if hw is not None:  # every rank: the runtime's own sharded blocks, timed on real tp groups (issue 13)
        profile = sharded_profile(model, parts, profile, hw, cache, verbose, sizes, device,
                                  tp_batch_sizes(loader_batch, world_size))
    return profile, hw


def _on_every_rank(make: Callable[[], Any]) -> Any:
    """``make()`` on every rank at once; an error on any rank is raised on every rank (none waits for a peer that
    failed). Returns this rank's value."""
    value, mine = None, None
    try:
        value = make()
    except Exception as exc:  # noqa: BLE001 - every kind must reach the other ranks
        mine = exc
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if mine is None else (type(mine).__name__, str(mine)))
    if mine is not None:
        raise mine
    failed = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if failed is not None:
        (r, (kind, message)) = failed
        raise _RANK0_ERRORS.get(kind, RuntimeError)(
            message if kind in _RANK0_ERRORS else f"rank {r} failed while profiling ({kind}): {message}")
    return value


@dataclass(frozen=True)
class PlanSearch:
    """What :func:`search_run_plans` found: every fitting plan (best first) and how the search went."""

    plans: list[ParallelPlan]
    notes: list[str]  # one line per pipeline degree searched, plus what was not searched and why
    model: "ModelProfile"  # as priced (a stored calibration applied)
    hardware: "HardwareProfile"


def search_run_plans(profile: "ModelProfile", hw: "HardwareProfile | None", world_size: int, n_layers: int,
                     budget: float, margin: float, loader_batch: int | None, pipeline: bool,
                     vocab_parallel_loss: bool, top_k: int = 3, cache_dir: "str | os.PathLike[str] | None" = None,
                     progress: "Callable[[int, int, str], None] | None" = None,
                     sp_modes: tuple[str, ...] | None = None,
                     check_plan: "Callable[[ParallelPlan], None] | None" = None) -> PlanSearch:
    """Search every configuration this run can execute (:func:`run_configs`), ``top_k`` plans each, priced
    like the runtime runs them; a calibration stored in the cache folder corrects the profiles first. Pure
    (no collectives): automatic mode calls it on rank 0. Raises ``ValueError`` when no plan fits.

    ``progress(i, n, what)`` is called before each of the ``n`` configurations (``galv search`` draws its
    progress bar from it: a search over many pipeline degrees and micro-batch counts takes a while).

    What the model cannot run is never searched or returned: ``sp_modes`` (the model's ``galv_sp_modes``, e.g. an
    adapted HF GPT-2 runs tp > 1 blocks only under Ulysses) restricts the space, and ``check_plan`` (the model's
    ``galv_check_plan``) drops any remaining plan it refuses, so the runtime never receives a plan it rejects."""
    from .planner import GalvatronCostModel, ProfileCache, SearchSpace, search
    from .planner.calibration import Calibration, calibration_path
    from .planner.search import rank_key

    hw = priced_hardware(profile, hw, budget)
    directory = ProfileCache(cache_dir).directory
    calibration = Calibration.load(calibration_path(directory))
    notes: list[str] = []
    if calibration is not None:  # what an earlier run measured (PlanMonitor): corrected copies of the inputs
        profile, hw = calibration.apply(profile, hw)
        notes.append(f"calibrated by {calibration.observations} measurements of an earlier run")
    cost = GalvatronCostModel(profile, hw, SearchSpace().default_embed_zero, runtime="native")
    found: list[ParallelPlan] = []
    failures: list[tuple[int, float, str, str]] = []  # (pp, smallest fitting budget, its configuration, error)
    configs = run_configs(world_size, n_layers, loader_batch, pipeline)
    for i, (pp, gb, ms) in enumerate(configs):
        if progress is not None:
            progress(i, len(configs), f"pp={pp} global batch {gb} micro-batches {list(ms)}")
        modes = {} if sp_modes is None else {"sp_modes": tuple(sp_modes)}
        space = SearchSpace(pp_degrees=(pp,), micro_batches=ms, vocab_parallel_loss=vocab_parallel_loss, **modes)
        try:
            result = search(profile, hw, world_size, budget, global_batch=gb, top_k=top_k, space=space,
                            cost_model=cost, memory_margin=margin)
        except ValueError as exc:  # nothing of this pipeline degree fits: others may
            need, how = getattr(exc, "smallest_fit", (float("inf"), "none"))
            failures.append((pp, need, how, str(exc)))
            notes.append(f"pp={pp} (global batch {gb}, micro-batches {list(ms)}): no plan fits")
            continue
        refused = []
        for plan in result:
            try:
                if check_plan is not None:
                    check_plan(plan)
            except ValueError as exc:
                refused.append(str(exc))
            else:
                found.append(plan)
        if refused:
            notes.append(f"pp={pp}: {len(refused)} plan(s) the model refuses dropped (first: {refused[0][:160]})")
        notes.append(f"pp={pp} (global batch {gb}, micro-batches {list(ms)}): {result.explanation.splitlines()[0]}")
    if not found and not failures:  # plans fitted, but the model refused every one of them
        raise ValueError(f"no plan this run can execute: the model refused every plan the search found "
                         f"({'; '.join(notes)}). HINT: give a plan by hand (GalvatronStrategy(plan=...)), or widen "
                         "the search (more ranks, another loader batch).")
    if not found:
        pp, need, how, first = min(failures, key=lambda f: f[1])
        if need == float("inf"):  # no degree could name a fitting budget: its own error says why
            raise ValueError(f"memory_budget={budget:.0f} bytes ({format_bytes(budget)}): no plan fits this run: "
                             f"{first}")
        per_pp = ", ".join(f"pp={p} {format_bytes(n)}" for p, n, _, _ in failures)
        # pipeline stages were searched when the module has the hooks: then suggesting them would mislead
        hooks = "" if pipeline else ", or give the LightningModule the pipeline hooks so pipeline stages can be searched"
        raise ValueError(f"memory_budget={budget:.0f} bytes ({format_bytes(budget)}): no plan fits this run; the "
                         f"smallest memory that would fit is {format_bytes(need)} ({how}; by pipeline degree: "
                         f"{per_pp}). HINT: raise memory_budget to at least {format_bytes(need)} or lower the batch "
                         f"size{hooks}.")
    found.sort(key=rank_key)
    if loader_batch is None:
        notes.append(f"loader batch unknown: assumed {_ASSUMED_LOADER_BATCH} per shard, pipelines not searched")
    elif not pipeline:
        notes.append("pipelines not searched: the LightningModule lacks galv_pipeline_batch/galv_pipeline_loss")
    return PlanSearch(found, notes, profile, hw)


@dataclass(frozen=True)
class Replan:
    """What a mid-fit re-search found (:func:`replan_search`): the best plan the running loader can take."""

    plan: ParallelPlan | None  # None: nothing the loader can take is predicted faster by the margin
    current_s: float  # the running plan's step time under the calibrated cost model
    best_s: float  # the best candidate's (== current_s when the running plan is the best)
    candidates: int  # plans searched that keep the loader's layout

    def describe(self) -> str:
        gain = 1 - self.best_s / self.current_s if self.current_s > 0 else 0.0
        return (f"running plan {self.current_s * 1e3:.1f} ms/step calibrated, best of {self.candidates} candidates "
                f"{self.best_s * 1e3:.1f} ms ({gain:+.0%})")


def replan_search(current: ParallelPlan, profile: "ModelProfile", hw: "HardwareProfile | None", budget: float,
                  margin: float, calibration: Any = None, min_gain: float = 0.1, top_k: int = 8) -> Replan:
    """Search again, with ``calibration`` applied to the profiles, among plans that keep ``current``'s loader
    layout (pipeline degree, data-parallel size, global batch, micro-batches); propose the best if it is
    predicted faster than ``current`` by ``min_gain``. Pure: :class:`PlanMonitor` runs it on rank 0."""
    from .planner import GalvatronCostModel, SearchSpace, search
    from .plan import loader_layout

    hw = priced_hardware(profile, hw, budget)
    if calibration is not None:
        profile, hw = calibration.apply(profile, hw)
    cost = GalvatronCostModel(profile, hw, SearchSpace().default_embed_zero, runtime="native")
    space = SearchSpace(pp_degrees=(current.pp,), micro_batches=(current.micro_batches,),
                        vocab_parallel_loss=current.vocab_parallel_loss)
    assert current.global_batch is not None
    now = cost.evaluate(current).step_time_s
    try:
        found = search(profile, hw, current.world_size, budget, global_batch=current.global_batch, top_k=top_k,
                       space=space, cost_model=cost, memory_margin=margin)
    except ValueError:  # nothing fits under the calibrated memory: keep the running plan
        return Replan(None, now, now, 0)
    same = [p for p in found if loader_layout(p) == loader_layout(current)]
    if not same:
        return Replan(None, now, now, 0)
    best = min(same, key=lambda p: cost.evaluate(p).step_time_s)
    best_s = cost.evaluate(best).step_time_s
    if best.layers == current.layers and best.embed == current.embed and best.head == current.head:
        return Replan(None, now, best_s, len(same))
    return Replan(best if best_s < now * (1 - min_gain) else None, now, best_s, len(same))


_RANK0_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}


def _shared(rank: int, make: Any) -> Any:
    """``make()`` on rank 0, its value (or its error, raised on every rank) everywhere."""
    box: list[Any] = [None]
    error: BaseException | None = None
    if rank == 0:
        try:
            box[0] = ("ok", make())
        except Exception as exc:  # noqa: BLE001 - every kind must reach the other ranks
            error, box[0] = exc, ("error", type(exc).__name__, str(exc))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0][0] == "error":
        _, kind, message = box[0]
        raise _RANK0_ERRORS.get(kind, RuntimeError)(message if kind in _RANK0_ERRORS else
                                                    f"rank 0 failed while profiling ({kind}): {message}")
    return box[0][1]


def sharded_profile(model: nn.Module, parts: ModelParts, profile: "ModelProfile", hw: "HardwareProfile",
                    cache: "ProfileCache | None", verbose: bool,
                    batch_sizes: tuple[int, ...] = (1, 2), device: "torch.device | str" = "cpu",
                    tp_sizes: "Mapping[int, tuple[int, ...]] | None" = None) -> "ModelProfile":
    """``profile`` with every layer type's sharded fits measured by :class:`ShardedLayerProfiler` (all ranks
    together; cached by what was measured); ``tp_sizes``: per tp degree, the sample counts its variants are timed
    at instead of ``batch_sizes`` (:func:`tp_batch_sizes`). The block-only ModelProfiler divides compute by tp, which on
    CPU under-prices tensor parallelism by up to ~20 % (benchmarks/RESULTS.md, cost-model accuracy)."""
    from .planner import ModelProfile
    from .planner.profiles import LayerTypeProfile, fingerprint
    from .profiling.profilers import ShardedLayerProfiler

    world, rank = dist.get_world_size(), dist.get_rank()
    budget_s = profile_budget_s()  # (before any collective: a bad value raises alike on every rank, nothing waits)
    links = {k: v for k, v in hw.to_dict().items() if k not in ("device_memory_bytes", "memory_bandwidth", "name")}
    # v2: MoE layer types also carry fits measured under expert parallelism (tp1/none/ep<k>)
    # v3: and the optimizer step's DTensor overhead (LayerTypeProfile.optimizer_overhead); v4: timed after a backward;
    # v5: timed as the runtime steps DTensors (on their local shards, parallel/optim.py); v6: variants timed
    # interleaved over rounds (a slow spell of a shared machine no longer prices one sharding alone); v7: each
    # variant also timed checkpointed (its own forward and recompute fits); v8: an MoE block timed with its router
    # statistics all-reduced over the variant's data group, as parallelize() wires them; v9: the recompute fit net
    # of the collectives a recompute really repeats (counted), and expert-parallel variants timed checkpointed;
    # v10: that share weighted by payload bytes, and an MoE block's saved activations and recompute peak measured
    # per expert-parallel degree; v11: SHARDED_PROFILE_ROUNDS rounds (was 2), and an MoE block's FSDP2 overhead per
    # expert-parallel degree as the runtime wraps it; v12: the optimizer bandwidth of an Adam step every rank takes
    # at once (ShardedLayerProfiler.optimizer_bandwidth) replaces the one rank 0 measured alone; v13: tp variants
    # timed at the per-rank batch they run (``tp_sizes``), and every fit keeps its measured points (TimeFit.points);
    # v14: each pass's slowest rank, then the median over rounds (was each rank's median, then the largest); v15: more
    # rounds while they fit in a time budget (profile_budget_s(), up to SHARDED_PROFILE_MAX_ROUNDS); v16: FSDP2's
    # backward overhead with gradient sync off too (zero_overhead "backward_nosync"); v17: the profile carries the
    # matmul rate timed beside the variants (ModelProfile.matmul_flops, for with_width); v18: FSDP2's overhead per
    # unit of a chain of units under a shared root, as parallelize() runs them (was one unit, its own root); v19:
    # and one unit alone, its own root (zero_overhead "forward_alone" / "backward_alone": a plan's only ZeRO unit); v20:
    # the chain's twins (sync off, alone) timed at the smallest batch only, their difference carried to the others;
    # v21: the block's core attention timed at two spans over the same tokens (LayerTypeProfile.span_share)
    what = {"v": 21, "profile": profile.to_dict(), "hw": links, "world": world, "rounds": SHARDED_PROFILE_ROUNDS,
            "budget_s": budget_s, "max_rounds": SHARDED_PROFILE_MAX_ROUNDS}
    if tuple(parts.sp_modes) != tuple(SP_MODES):  # measured only for what the model runs (keys unchanged otherwise)
        what["sp_modes"] = list(parts.sp_modes)
    if tuple(batch_sizes) != (1, 2):
        what["batch_sizes"] = list(batch_sizes)
    if tp_sizes:
        what["tp_sizes"] = {str(t): list(v) for t, v in sorted(tp_sizes.items())}
    if torch.device(device).type != "cpu":  # (CPU keys unchanged)
        what["device"] = torch.device(device).type
    key = fingerprint(what)

    def cached() -> str | None:  # rank 0 decides, so every rank takes the same branch (profiling is collective)
        hit = cache.load("model", key) if cache is not None else None
        return hit.to_json() if isinstance(hit, ModelProfile) else None

    hit = _shared(rank, cached)
    if hit is not None:
        return ModelProfile.from_json(hit)
    sp_kinds = parts.sp_modes if tuple(parts.sp_modes) != tuple(SP_MODES) else ("none", "megatron", "ulysses")
    types: list[LayerTypeProfile] = []
    bandwidth, matmul = profile.optimizer_bandwidth, profile.matmul_flops
    for j, lt in enumerate(profile.layer_types):
        block = parts.blocks[profile.layer_type_of.index(j)]
        profiler = ShardedLayerProfiler(lambda b=block: copy.deepcopy(b).float(), profile.shape, hw,
                                        batch_sizes=batch_sizes, tp_batch_sizes=tp_sizes,
                                        repeats=SHARDED_PROFILE_ROUNDS, time_budget_s=budget_s,
                                        max_repeats=SHARDED_PROFILE_MAX_ROUNDS,
                                        progress=verbose, sp_kinds=sp_kinds, device=str(torch.device(device)))
        types.append(profiler.fit(lt))
        if j == 0 and profiler.optimizer_bandwidth > 0:  # the first block type's, as the ModelProfiler measures
            # the optimizer step: rank 0 took that alone while the other ranks waited, which on a machine whose
            # ranks share cores and memory is not the speed of a step every rank takes at once
            bandwidth = profiler.optimizer_bandwidth
        if j == 0 and profiler.matmul_flops > 0:  # timed beside the first block type's variants
            matmul = profiler.matmul_flops
    out = profile.with_(layer_types=tuple(types), optimizer_bandwidth=bandwidth, matmul_flops=matmul)
    if cache is not None and rank == 0:
        cache.save("model", key, out)
    return out


def _say(enabled: bool, msg: str) -> None:
    if enabled:
        print(f"[lightning_galv] {msg}", flush=True)
