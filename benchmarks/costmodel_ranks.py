"""Functions run inside gloo ranks by benchmarks/costmodel_accuracy.py (via lightning_galv.testing).

* :func:`profile_hardware` - HardwareProfiler on the launch's process group (plus per-tp block profiles).
* :func:`measure_plans` - for each plan: parallelize the reference LLaMA, train a few steps with Adam
  (no Lightning), time the steps and track the peak memory of one extra step.

What "memory" means here: the peak, over one training step (forward, backward, gradient sync,
optimizer step), of the bytes of all live tensor storages on the rank, as seen by torch's
``MemTracker`` (a TorchDispatchMode that follows every storage, resize included, so FSDP2's
gathered parameters count): parameters + gradients + optimizer states + activations + temporaries
(+ the RoPE buffers). In that step gradients are kept allocated between steps
(``zero_grad(set_to_none=False)``, persistent gradient buffers as in Megatron/Galvatron), which is what the
cost model's model-state term assumes; the timed steps free them as Lightning's ``zero_grad()`` does.
Process memory of the interpreter/libraries is not included (on a GPU it would be the
CUDA context; the profile's ``framework_bytes`` is 0 here).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_galv.layout import MeshFactory, RankLayout
from lightning_galv.models import Llama, LlamaConfig
from lightning_galv.plan import LayerStrategy, ParallelPlan


def make_model(cfg: dict, seed: int = 0) -> torch.nn.Module:
    """The reference LLaMA, or the MoE decoder when ``cfg`` has ``num_experts``."""
    torch.manual_seed(seed)
    if "num_experts" in cfg:
        from lightning_galv.models import MoEConfig, MoEDecoder

        return MoEDecoder(MoEConfig(**cfg))
    return Llama(LlamaConfig(**cfg))


def dense_cfg(cfg: dict) -> dict:
    """The LLaMA part of a (possibly MoE) config (attention sizes; the dense probe block)."""
    keys = LlamaConfig.__dataclass_fields__
    return {k: v for k, v in cfg.items() if k in keys}


@contextlib.contextmanager
def _raw_timings() -> Iterator[tuple[list[dict[tuple[str, int], tuple[float, float, float, float]]], list[int]]]:
    """Record what every ShardedLayerProfiler run in this block times: per ``fit``, each rank's raw medians
    (forward wall, backward wall, forward CPU, backward CPU) keyed ``(variant, batch)``, before any collective
    is subtracted or any fit is taken, and the rounds each timing took (benchmark instrumentation; the library is
    unchanged)."""
    from lightning_galv.profiling.profilers import ShardedLayerProfiler

    calls: list[dict[tuple[str, int], tuple[float, float, float, float]]] = []
    rounds: list[int] = []
    original = ShardedLayerProfiler._time_blocks

    def recording(self: ShardedLayerProfiler, blocks: Any, *extra: Any) -> Any:
        out = original(self, blocks, *extra)
        calls.append(dict(out))
        rounds.append(self.rounds_timed[-1])
        return out

    ShardedLayerProfiler._time_blocks = recording  # type: ignore[method-assign]
    try:
        yield calls, rounds
    finally:
        ShardedLayerProfiler._time_blocks = original  # type: ignore[method-assign]


def _raw_reference(calls: list[dict[tuple[str, int], tuple[float, float, float, float]]], b: int = 2) -> float:
    """The profile's interleaved timing (``interleaved_s``; the speed reference from 257c0e1 to 6565948, kept for the
    record, see :func:`_references`): the profile's own raw timing of the block the probe times (``tp1/none``,
    unsharded, at the probe's ``b`` samples): the median forward plus the median backward of each round's slowest
    rank (since a1d10ad; each rank's medians, then the slowest rank's, before), wall time, the collectives it runs
    included -- the very pass :func:`probe` repeats. Not the fit at ``b``: a straight line through 2/4/8 samples missed the b=2 median by -11 % to +6 %
    (4 ranks, /tmp, two profiles), and the MoE block's fit had its router-statistics all-reduce taken out as
    priced and added back as priced, not as run."""
    hits = [c[("tp1/none", b)] for c in calls if ("tp1/none", b) in c]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} ShardedLayerProfiler runs timed tp1/none at b={b}; the speed reference "
                         "needs exactly one. HINT: profile one block kind per launch (the benchmark's models have "
                         "one), or pick the run that profiled the probe's block.")
    fwd, bwd, _, _ = hits[0]
    t = torch.tensor([fwd, bwd], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.sum())


AROUND_PROBES = 3  # probes right before and right after a profile run: its speed reference


def _references(before: list[float], after: list[float],
                calls: list[dict[tuple[str, int], tuple[float, float, float, float]]]) -> dict[str, Any]:
    """The profile's two speed readings. ``interleaved_s``: the profiler's own raw timing of the pass the probe
    repeats (:func:`_raw_reference`), taken during the rounds that time every block variant -- the reference
    ``costmodel_accuracy.py`` scales by (from 257c0e1 to 6565948 and again since 2026-12-06). ``probe_s``: the
    median of :func:`probe` right before and right after the profile run, the reference from 6565948 to
    2026-12-06, kept beside it: read by the protocol of the probes around each measured step, but a minute or
    more away from the block timings (one 4-rank profile at 5e9ee88: interleaved 1.24x the probes around, and its
    launch's predictions +16 % against the other launches'). Until a1d10ad the probe reduced its passes otherwise
    and read ~8 % faster than the interleaved timing at equal speed (probe / it = 0.915 [0.865, 0.964] at 2
    ranks, 0.924 [0.900, 0.948] at 4, benchmarks/probe_offset.py at 6565948), the reason it was dropped then;
    since, the two agree at equal speed (1.003 / 0.987 over the 10 profiles per world at 5e9ee88)."""
    return {"probe_s": statistics.median(before + after), "interleaved_s": _raw_reference(calls),
            "probes_before_s": before, "probes_after_s": after}


def profile_machine_moe(sizes: tuple[int, ...], repeats: int, cfg: dict, seq: int) -> dict[str, Any]:
    """Profiles for the MoE decoder, the way automatic mode takes them: HardwareProfiler on this launch (the
    all-to-all included), the ModelProfiler per block kind (dense and MoE) through ``auto.profile_model``
    (which reads each MoE layer's facts: experts, top-k, expert parameters), then every block kind as the
    runtime shards it, timed on all ranks (``auto.sharded_profile``, as automatic mode does), at the sample
    counts automatic mode takes for a loader that gives every rank ``8 / world`` samples (the plans' global
    batch of 8; ``auto.profile_batch_sizes``, and for each tp degree the counts its blocks run at,
    ``auto.tp_batch_sizes``)."""
    from lightning_galv.auto import profile_batch_sizes, profile_model, sharded_profile, tp_batch_sizes
    from lightning_galv.models.protocol import find_parts
    from lightning_galv.profiling import HardwareProfiler

    before = [probe(cfg, seq) for _ in range(AROUND_PROBES)]
    hw = HardwareProfiler(sizes_bytes=sizes, repeats=repeats, progress=False).fit()
    model = make_model(cfg)
    parts = find_parts(model)
    dist.barrier()
    loader = 8 // dist.get_world_size()
    batches = profile_batch_sizes(loader)
    prof = profile_model(model, parts, batch_sizes=batches)
    with _raw_timings() as (calls, rounds):
        prof = sharded_profile(model, parts, prof, hw, None, False, batches,
                               tp_sizes=tp_batch_sizes(loader, dist.get_world_size()))
    bandwidth = prof.optimizer_bandwidth  # all ranks stepping at once (sharded_profile), as automatic mode prices it
    after = [probe(cfg, seq) for _ in range(AROUND_PROBES)]
    return {"hardware": hw.to_json(), "model": prof.to_json(), "optimizer_bandwidth": bandwidth, "rounds": rounds,
            **_references(before, after, calls)}


def profile_machine(sizes: tuple[int, ...], repeats: int, cfg: dict, seq: int, rounds: int = 5,
                    budget_s: float | None = None) -> dict[str, Any]:
    """Profiles measured with every rank of this launch busy at once (ranks share the CPU cores).

    * HardwareProfiler: collectives on every group size, consecutive and strided; overlap coefficient.
    * ModelProfiler on every rank concurrently: block fwd/bwd fits, embedding and head (with its loss) fwd/bwd,
      Adam step bandwidth.
    * ShardedLayerProfiler on the real parallelized block for every (tp, sp): per-rank compute,
      activation bytes with and without checkpointing, the recompute peak, FSDP2's own overhead; its variants
      timed interleaved over ``rounds`` rounds -- or, with ``budget_s``, more while they fit in that many seconds
      (up to ``auto.SHARDED_PROFILE_MAX_ROUNDS``, as automatic mode takes them).
    """
    from lightning_galv.models.common import Rotary
    from lightning_galv.models.llama import LlamaBlock
    from lightning_galv.profiling import HardwareProfiler, ModelProfiler
    from lightning_galv.profiling.profilers import ShardedLayerProfiler

    before = [probe(cfg, seq) for _ in range(AROUND_PROBES)]
    hw = HardwareProfiler(sizes_bytes=sizes, repeats=repeats, progress=False).fit()
    lcfg = LlamaConfig(**cfg)

    def block() -> torch.nn.Module:
        torch.manual_seed(0)
        return LlamaBlock(lcfg, Rotary(lcfg.dim // lcfg.n_heads, lcfg.max_seq_len))

    def head() -> torch.nn.Module:
        torch.manual_seed(0)
        m = make_model(cfg)
        return torch.nn.Sequential(m.norm, m.output)

    def embed() -> torch.nn.Module:
        torch.manual_seed(0)
        return make_model(cfg).tok_embeddings

    shape = make_model(cfg).galv_shape(seq)
    dist.barrier()
    prof = ModelProfiler(block, shape, batch_sizes=(1, 2, 4), seq_lens=(seq // 2, seq), repeats=3,
                         progress=False, make_head=head, make_embed=embed)
    model = prof.fit()
    from lightning_galv.auto import SHARDED_PROFILE_MAX_ROUNDS

    with _raw_timings() as (calls, taken):
        sharded = ShardedLayerProfiler(block, shape, hw, batch_sizes=(2, 4, 8), repeats=rounds, progress=False,
                                       time_budget_s=budget_s, max_repeats=max(rounds, SHARDED_PROFILE_MAX_ROUNDS))
        layer = sharded.fit(model.layer(0))
    # the optimizer step every rank takes at once, as automatic mode prices it (auto.sharded_profile)
    # and the matmul rate timed beside the variants, which with_width splits a block's time by
    model = model.with_(layer_types=(layer,), optimizer_bandwidth=sharded.optimizer_bandwidth,
                        matmul_flops=sharded.matmul_flops)
    after = [probe(cfg, seq) for _ in range(AROUND_PROBES)]
    return {"hardware": hw.to_json(), "model": model.to_json(), "optimizer_bandwidth": model.optimizer_bandwidth,
            "rounds": taken, **_references(before, after, calls)}


_PROBE_BLOCKS: dict[tuple[str, int], tuple[torch.nn.Module, int]] = {}


def _probe_block(cfg: dict) -> tuple[torch.nn.Module, int]:
    """The block :func:`probe` times, and its width."""
    from lightning_galv.models.common import Rotary
    from lightning_galv.models.llama import LlamaBlock

    lcfg = LlamaConfig(**dense_cfg(cfg))
    torch.manual_seed(0)
    if "num_experts" in cfg:  # the MoE decoder's own block (its first MoE layer), unsharded: local dispatch,
        from lightning_galv.parallel.expert import GlobalRouterStats, moe_layers

        model = make_model(cfg)
        blk = model.layers[model.cfg.moe_layer_ids()[0]]
        world = dist.get_world_size()
        for layer in moe_layers(blk):  # router statistics over the world, as the profile times the block
            layer.stats_reducer = GlobalRouterStats(dist.group.WORLD, world, world)
    else:
        blk = LlamaBlock(lcfg, Rotary(lcfg.dim // lcfg.n_heads, lcfg.max_seq_len))
    return blk, lcfg.dim


def probe(cfg: dict, seq: int, b: int = 2, repeats: int | None = None) -> float:
    """Fwd+bwd time of one block on every rank at once: how fast compute is *right now*.

    The machine is shared, so the same probe is taken at profiling time and before each plan; the
    benchmark reports predictions with the profile's compute times scaled by the ratio (load
    normalization) next to the raw ones. Per pass the slowest rank's forward + backward, then the median over
    ``repeats`` passes: the way the ShardedLayerProfiler reduces the passes of the profile's unsharded block
    (``_raw_reference``, the reference the probes are compared with since 2026-12-06, see ``_references``;
    before 2026-12-02 both took each rank's medians, then the slowest rank's, and that pass read ~8 % slower than
    the probe at equal speed). One probe's slowest rank
    partly tells which ranks the scheduler put on one core at that instant (in the d33f7cb run a factor
    from single probes ranged 0.81-1.21 while the 4-rank hetero plan's step stayed within 415-432 ms), so each
    step is scaled by the probes before and after it and the median over steps is taken
    (``costmodel_accuracy.py``). ``repeats`` = the profiler's rounds (default: 5 as ``profile_machine`` takes
    them; ``auto.SHARDED_PROFILE_ROUNDS`` for the MoE decoder, as automatic mode takes them): the slowest
    rank's median of fewer passes is a maximum over noisier numbers and reads higher (2 ranks, paired with
    profiler-style rounds: ratio 0.979 at 3 passes, 0.991 at 5).
    """
    key = (json.dumps({k: v for k, v in cfg.items() if k != "n_layers"}, sort_keys=True), dist.get_world_size())
    if key not in _PROBE_BLOCKS:  # one block per model and world, reused: a block built anew for every probe
        _PROBE_BLOCKS[key] = _probe_block(cfg)  # read ~1 % slower than the profiler's long-lived ones
    blk, dim = _PROBE_BLOCKS[key]
    if repeats is None:
        from lightning_galv.auto import SHARDED_PROFILE_ROUNDS

        repeats = SHARDED_PROFILE_ROUNDS if "num_experts" in cfg else 5
    # the ShardedLayerProfiler's protocol (``_time_interleaved``), pass for pass (not the passes around it), so
    # that a probe and the profile's reference time the same thing: a fresh input, all ranks starting together,
    # forward and backward timed apart (backward from a ones gradient, into freshly allocated parameter
    # gradients), the slowest rank's forward + backward of each pass, then the median. The probe
    # used to run ``blk(x).sum().backward()`` back to back on one input, accumulating gradients: it read ~3 % above the
    # reference at equal speed (2 ranks: median ratio 0.966 over 15 paired rounds), which scaled every
    # measured step down by that much (every run up to 228f1ba).
    fwd, bwd = [], []
    for _ in range(repeats + 1):
        x = torch.randn(b, seq, dim, requires_grad=True)
        dist.barrier()
        t0 = time.perf_counter()
        y = blk(x)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
        blk.zero_grad(set_to_none=True)
        del x, y
    # each pass's slowest rank, then the median over passes: how the ShardedLayerProfiler reduces its passes since
    # its v14 (``profilers._slowest_rank_medians``); each rank's median then the largest read a rank's lucky passes
    # when ranks outnumber cores
    t = torch.tensor([f + b for f, b in zip(fwd[1:], bwd[1:])], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # elementwise: pass i's slowest rank
    return statistics.median(t.tolist())


def _train_step(model, opt, rt, x, y, micro_batches: int, between=None, marks: list | None = None,
                keep_grads: bool = False) -> torch.Tensor:
    """One step; ``marks`` (if given) receives perf_counter() after fwd+bwd, after the gradient sync, after the
    optimizer.
    ``keep_grads``: zero the gradients in place (persistent buffers, the memory step) instead of freeing them as
    Lightning's ``optimizer.zero_grad()`` does between training steps."""
    loss_sum = torch.zeros(())
    mb = x.shape[0] // micro_batches
    for i in range(micro_batches):
        if i and between is not None:
            between()
        rt.set_gradient_sync(i == micro_batches - 1)
        logits = model(x[i * mb:(i + 1) * mb])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i * mb:(i + 1) * mb].reshape(-1))
        (loss / micro_batches).backward()
        del logits
        loss_sum += loss.detach()
    if marks is not None:
        marks.append(time.perf_counter())
    rt.sync_gradients()
    if marks is not None:
        marks.append(time.perf_counter())
    opt.step()
    opt.zero_grad(set_to_none=not keep_grads)  # (see module docstring)
    if marks is not None:
        marks.append(time.perf_counter())
    return loss_sum


def _status_kib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    return float("nan")


def _rss_reset() -> float:
    """Give freed heap back to the OS, restart the resident-set high-water mark; returns the RSS now (bytes).

    So that ``VmHWM - baseline`` after a plan is what that plan made the process hold at its peak (tensors,
    allocator and malloc slack, communication buffers), not what earlier plans in the same process left."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset the peak RSS of this process
    except OSError:
        return float("nan")
    return _status_kib("VmRSS")


def measure_plan(plan_dict: dict, cfg: dict, seq: int, warmup: int, steps: int,
                 track_memory: bool = True, probe_with: tuple[dict, int] | None = None) -> dict[str, Any]:
    """``probe_with``: the (model config, sequence length) the speed probes time (default: the plan's own); a
    plan at a held-out sequence length is probed at the profile's, so that its probes and the profile's
    reference time the same pass."""
    probe_cfg, probe_seq = probe_with if probe_with is not None else (cfg, seq)
    from torch.distributed._tools.mem_tracker import MemTracker

    from lightning_galv.parallel.parallelize import parallelize

    plan = ParallelPlan.from_dict(plan_dict)
    rank = dist.get_rank()
    rss0 = _rss_reset() if track_memory else float("nan")
    model = make_model(cfg)
    factory = MeshFactory(RankLayout(plan.world_size, plan.pp), "cpu", rank)
    rt = parallelize(model, plan, factory)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    rt.wrap_optimizer(opt)
    shard, nshards = rt.data_shard
    gen = torch.Generator().manual_seed(123)
    b = plan.global_batch // nshards
    data = torch.randint(0, cfg["vocab_size"], (plan.global_batch, seq + 1), generator=gen)
    x, y = data[shard * b:(shard + 1) * b, :-1], data[shard * b:(shard + 1) * b, 1:]
    times, probes, phases, every_probe = [], [], [], []
    marks_all: list[list[list[float]]] = []  # step -> rank -> [start, backward end, sync end, optimizer end]
    for i in range(warmup + steps):
        # the machine's speed drifts (a VM on a shared host: identical launches differ by up to 1.7x), so a
        # compute probe right before every step tells how fast the machine is at that moment
        p = probe(probe_cfg, probe_seq)
        every_probe.append(p)
        dist.barrier()
        t0 = time.perf_counter()
        marks: list[float] = []
        _train_step(model, opt, rt, x, y, plan.micro_batches, marks=marks)
        # every rank's own clock marks (perf_counter is CLOCK_MONOTONIC: one clock for all processes of the
        # machine): start after the barrier, backward end, gradient-sync end, optimizer end
        own = torch.tensor([t0, *marks], dtype=torch.float64)
        every = [torch.zeros_like(own) for _ in range(dist.get_world_size())]
        dist.all_gather(every, own)
        every_t = torch.stack(every)  # (ranks, 4)
        last = every_t[:, 1:].max(dim=0).values  # (3,): latest backward end, sync end, optimizer end
        if i >= warmup:
            # a step ends when the slowest rank ends. Phases along the critical path, so that they add up to the
            # step: what the sync still takes after the last rank's backward ends (its tail), the optimizer after
            # that, and fwd+bwd = the rest. (Each phase's own slowest rank would count the ranks' skew twice: the
            # rank that ends backward first waits longest for the sync -- benchmarks/sync_wait.py.)
            step = float((every_t[:, 3] - every_t[:, 0]).max())
            tail, opt_t = float(last[1] - last[0]), float(last[2] - last[1])
            times.append(step)
            probes.append(p)
            phases.append([step - tail - opt_t, tail, opt_t])
            marks_all.append(every_t.tolist())
    every_probe.append(probe(probe_cfg, probe_seq))  # so that every measured step has a probe after it too
    dist.barrier()
    rss_peak = _status_kib("VmHWM") - rss0 if track_memory else float("nan")  # before MemTracker's own bookkeeping
    by_kind: dict[str, float] = {}
    if track_memory:
        mt = MemTracker()
        mt.track_external(model, opt)
        _train_step(model, opt, rt, x, y, plan.micro_batches, keep_grads=True)  # gradients allocated from here on
        with mt:
            _train_step(model, opt, rt, x, y, plan.micro_batches, mt.reset_mod_stats, keep_grads=True)
        peak = mt.get_tracker_snapshot("peak")
        cpu = next(iter(peak.values())) if peak else {}
        by_kind = {(k.name if hasattr(k, "name") else str(k)): float(v) for k, v in cpu.items()}
    del model, opt, rt
    factory.close()  # the next plan runs without this one's idle gloo groups polling (a thread each)
    return {"step_s": statistics.median(times), "times": times, "probes": probes,
            "probes_after": every_probe[warmup + 1:], "phases": phases, "marks": marks_all,
            "peak_bytes": by_kind.get("Total", float("nan")), "rss_peak_bytes": rss_peak,
            "by_kind": by_kind}


def measure_plans(cases: list[tuple[str, dict, dict, int]], warmup: int, steps: int,
                  track_memory: bool = True, probe_with: tuple[dict, int] | None = None) -> dict[str, Any]:
    """``cases``: (name, plan dict, model config, sequence length), measured in this order; ``probe_with``: see
    :func:`measure_plan`."""
    out = {}
    # build the probe's blocks first (one per distinct model; a block built inside the first plan's measurement
    # would count in its RSS growth, and the order rotates over launches)
    probed = [probe_with] if probe_with is not None else [(cfg, seq) for _, _, cfg, seq in cases]
    for cfg_json, seq in sorted({(json.dumps(cfg, sort_keys=True), seq) for cfg, seq in probed}):
        probe(json.loads(cfg_json), seq)
    for name, plan, cfg, seq in cases:
        out[name] = measure_plan(plan, cfg, seq, warmup, steps, track_memory, probe_with)
        if dist.get_rank() == 0:
            print(f"[costmodel] {name}: {out[name]['step_s'] * 1e3:.1f} ms, "
                  f"{out[name]['peak_bytes'] / 2**20:.2f} MiB", flush=True)
    return out


def strategy(**kw: Any) -> dict:
    return LayerStrategy(**kw).to_dict()
