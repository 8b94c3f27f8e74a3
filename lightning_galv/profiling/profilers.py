"""Measure this machine and this model, and emit planner profiles (the only planner-side torch user).

:class:`ModelProfiler` runs real transformer blocks forward and backward in-process at several
micro-batch sizes and sequence lengths, fits :class:`~lightning_galv.planner.profiles.TimeFit` s, and
counts activation memory with a saved-tensor hook (what autograd keeps for backward: exactly the
activation memory, on any device, CPU included). :class:`HardwareProfiler` times collectives on the
current default process group (any backend, gloo here) for each group size, consecutive and strided.
Both cache their result by a fingerprint of what was measured.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import bad_value
from ..plan import ModelShape, divisors
from ..planner.cost import overlap_slowdown_from, overlapped
from ..planner.profiles import (COLLECTIVES, HardwareProfile, LayerTypeProfile, LinkFit, ModelProfile, MoELayerFacts,
                                ProfileCache, TimeFit, act_key, fingerprint, link_key, time_key,
                                transient_key)


Comm = Callable[[int], tuple[float, float]]  # samples -> predicted (forward, backward) collective seconds


class _CollectiveBytes(TorchDispatchMode):
    """Records the payload bytes of every collective dispatched while active -- c10d and
    functional ones, waits excluded -- in order, including those DTensor issues inside its ops: a DTensor op is
    handed back to DTensor (``NotImplemented``, as torch's ``CommDebugMode`` does), whose local ops and
    collectives then come through here; and those autograd runs in backward (the mode is thread state the
    engine carries to its workers)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[float] = []  # payload bytes per collective, in dispatch order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if "c10d" in name and "wait_tensor" not in name and "wrap_tensor" not in name:
            self.ops.append(_payload_bytes(args, kwargs or {}, out))
        return out


def _tensor_bytes(tree: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)))


def _payload_bytes(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> float:
    """A collective's size as the cost model prices it, the unsharded tensor: the largest single argument (each
    summed over its tensors) or the result. c10d ops take their output buffers as arguments
    (``alltoall_base_(output, input)``, ``allgather_(outputs, inputs)``), so summing all arguments would count an
    all-to-all twice; an all-gather's input and a reduce-scatter's output are shards, the other side whole."""
    return max([_tensor_bytes(out)] + [_tensor_bytes(a) for a in (*args, *kwargs.values())])


CKPT_SUFFIX = "/ckpt"  # a timed block's key + this: the same variant, checkpointed
NOSYNC_SUFFIX = "/nosync"  # a ZeRO key + this: the same FSDP2 block with gradient sync off (accumulation)
# FSDP2 units the ShardedLayerProfiler chains under one shared root to time a ZeRO-2/3 block (see _UnitChain)
ZERO_CHAIN_UNITS = 2
ALONE_SUFFIX = "/alone"  # a ZeRO key + this: one such block alone, its own FSDP2 root (a plan's only ZeRO-2/3 unit)


class _UnitChain(nn.Module):
    """``n`` copies of a block run one after the other, each its own FSDP2 unit under this module as their shared
    root, as ``parallelize()`` wraps two or more ZeRO-2/3 blocks (``data_parallel.apply_shared_root``).

    Why a chain and not one unit: a lone FSDP2 unit is its own root, and what a root does per forward and backward
    (its pre-forward, the post-backward final callback, no prefetch: every gather inline) was charged per layer.
    Measured (the accuracy benchmark's LLaMA block under ZeRO-3 at 2, 4 and 8 samples, one launch each): two
    chained units took less than two lone ones by more than prefetching hides at the profiled overlap slowdown --
    per pass 1-2 ms of forward at 2 gloo ranks, 9 ms of backward at 4 -- while the cost model, fed lone units,
    priced every ZeRO-3 plan 3-7 % slow (costmodel_accuracy.py at 773eeb5 and f194874)."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.units = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return x


def _progress(msg: str, enabled: bool) -> None:
    if enabled:
        print(f"[galv profile] {msg}", file=sys.stderr, flush=True)


class _SavedBytes:
    """Bytes autograd saves for backward (distinct storages), i.e. the activation memory of a forward."""

    def __init__(self, exclude: set[int] | None = None) -> None:
        self.seen: dict[int, int] = {}
        self.exclude = exclude or set()  # parameter/buffer storages: saved for backward but not activations

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()  # DTensor: its local shard
        if st.data_ptr() not in self.exclude:
            self.seen[st.data_ptr()] = st.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _storages(module: nn.Module) -> set[int]:
    """Storages of parameters and buffers: autograd saves them (weights, RoPE table slices), but they are
    not activations -- they exist once per rank whatever the batch, and are counted elsewhere."""
    return {(t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr()
            for t in (*module.parameters(), *module.buffers())}


def buffer_bytes(module: nn.Module) -> float:
    """Bytes of ``module``'s buffers, each storage once (blocks sharing one RoPE table count it once).

    Buffers are not parameters, so neither model states nor saved activations include them, yet every
    rank holds them for the whole step; the planner books them as fixed memory (``framework_bytes``).
    """
    seen: dict[int, int] = {}
    for b in module.buffers():
        t = b.to_local() if hasattr(b, "to_local") else b
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return float(sum(seen.values()))


def moe_facts(block: nn.Module) -> MoELayerFacts | None:
    """The planner's description of ``block``'s MoE layer (:class:`~lightning_galv.models.moe.MoELayer`), or
    None for a dense block. Read from the module, not measured: how parameters split under expert
    parallelism and how wide the all-to-all rows are is structure, not speed."""
    from ..models.moe import MoELayer

    layers = [m for m in block.modules() if isinstance(m, MoELayer)]
    if not layers:
        return None
    if len(layers) > 1:
        raise ValueError(f"{type(block).__name__}: {len(layers)} MoE layers in one block. HINT: the planner prices "
                         "one MoE layer per block; split the block or profile it with a custom LayerTypeProfile.")
    layer = layers[0]

    def count(m: nn.Module | None) -> int:
        return 0 if m is None else sum(p.numel() for p in m.parameters())

    # a Hugging Face layer (models/hf_moe.py) keeps its experts fused: one row of each tensor per expert
    per_expert = layer.expert_numel() if hasattr(layer, "expert_numel") else count(layer.experts[0])
    dim = getattr(layer, "hidden_dim", None) or layer.router.in_features
    expert_tensors = sum(1 for _ in layer.experts.parameters())
    return MoELayerFacts(layer.num_experts, layer.top_k, per_expert, dim,
                         count(layer.shared_expert) + count(layer.shared_gate), count(layer.router),
                         layer.capacity_factor, expert_tensors / max(1, sum(1 for _ in block.parameters())))


#: Fewest Adam steps the ModelProfiler times for the optimizer bandwidth (their median).
OPTIMIZER_REPEATS = 5


@dataclass
class _Ends:
    """What :meth:`ModelProfiler._time_ends` measured (fits stay as in an unmeasured profile where there was
    nothing to time)."""

    head_act: float
    buffers: float = 0.0
    embed_forward: TimeFit = field(default_factory=TimeFit)
    embed_backward: TimeFit | None = None
    head_forward: TimeFit = field(default_factory=TimeFit)
    head_backward: TimeFit | None = None


class ModelProfiler:
    """Profile the block types of a model: ``make_block()`` builds a block called as ``block(x)`` on
    ``[b, s, h]``; a sequence of them builds one block per layer type, ``layer_type_of`` saying which type
    each of the model's blocks is (dense and MoE blocks of one model are different types: different time,
    memory, and only MoE types may take expert parallelism)."""

    def __init__(self, make_block: Callable[[], nn.Module] | Sequence[Callable[[], nn.Module]], shape: ModelShape,
                 batch_sizes: Sequence[int] = (1, 2, 4),
                 seq_lens: Sequence[int] | None = None, repeats: int = 3, dtype: torch.dtype = torch.float32,
                 cache: ProfileCache | None = None, progress: bool = True,
                 make_head: Callable[[], nn.Module] | None = None, buffer_bytes: float | None = None,
                 device: str = "cpu", layer_type_of: Sequence[int] | None = None,
                 kinds: Sequence[str] | None = None, make_embed: Callable[[], nn.Module] | None = None,
                 time_optimizer: bool = True, busy_ranks: int = 1) -> None:
        """``make_head`` / ``make_embed``: copies of the model's ends (final norm + output projection, called on
        ``[b, s, h]``; the token embedding, called on ``[b, s]`` token ids), timed forward and backward so that the
        cost model prices them (None: that end's fits stay zero).

        ``buffer_bytes``: bytes of the model's buffers (non-parameter tensors such as RoPE cos/sin
        tables) one rank holds, when the caller knows the whole model (automatic mode counts its distinct
        buffer storages). ``None`` counts the buffers of one block, the embedding and the head once: the reference models
        share one RoPE table across blocks, so a per-block count would overstate them L times.

        ``kinds``: a name per layer type that says what the block is (class, parameter shapes), part of the
        cache key -- without it two models of one shape share a cached profile whatever their blocks are.

        ``time_optimizer=False`` leaves the Adam-step bandwidth at 0: automatic mode on several ranks takes the
        one :class:`ShardedLayerProfiler` measures with every rank stepping at once, and this one's copies of up to
        64 Mi parameters with their Adam states cost memory and time on every rank for nothing.

        ``busy_ranks``: how many ranks run this profiler at once (automatic mode: every rank of the run), part of
        the cache key -- ranks that share cores and memory time slower together, so a profile taken beside 1 other
        rank must not price a run of 4."""
        makes = [make_block] if callable(make_block) else list(make_block)
        type_of = tuple(layer_type_of) if layer_type_of is not None else (0,) * shape.num_layers
        if not makes or len(type_of) != shape.num_layers or sorted(set(type_of)) != list(range(len(makes))):
            raise ValueError(f"ModelProfiler: {len(makes)} block builders, layer_type_of={list(type_of)}. HINT: give "
                             f"one builder per layer type and one type index (0..{len(makes) - 1}, each used) per "
                             f"block of the {shape.num_layers}.")
        if kinds is not None and len(kinds) != len(makes):
            raise ValueError(f"ModelProfiler: kinds={list(kinds)} for {len(makes)} layer types. HINT: one name each.")
        self.makes, self.layer_type_of, self.kinds = makes, type_of, None if kinds is None else tuple(kinds)
        self.make_block, self.shape = makes[0], shape
        self.buffer_bytes = buffer_bytes
        self.device = torch.device(device)  # time the block where training will run it
        self.make_head = make_head  # final norm + output projection, called on [b, s, h] -> logits
        self.make_embed = make_embed  # token ids [b, s] -> [b, s, h]
        self.optimizer_bandwidth = 0.0  # bytes/s of a memory-bound Adam step, set by fit() (also in the profile)
        self.batch_sizes = tuple(batch_sizes)
        self.seq_lens = tuple(seq_lens or (max(1, shape.seq_len // 2), shape.seq_len))
        self.repeats, self.dtype, self.cache, self.progress = repeats, dtype, cache, progress
        self.time_optimizer, self.busy_ranks = time_optimizer, busy_ranks

    def key(self) -> str:
        # "v": bump when the profile gains fields, so older cache files are measured again instead of
        # loading with defaults (v2: optimizer_bandwidth; v3: buffers in framework_bytes; v4: median
        # times, optimizer bandwidth on the whole model's parameter volume; v5: the step timed after a backward;
        # v6: the embedding and the head's backward measured; v7: fits keep their measured points, TimeFit.points;
        # v8: the ends timed in situ, behind a block)
        facts = {"v": 8, "buffers": self.buffer_bytes, "shape": self.shape.to_dict(), "b": self.batch_sizes,
                 "s": self.seq_lens, "dtype": str(self.dtype), "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "head": self.make_head is not None,
                 "embed": self.make_embed is not None, "device": self.device.type}
        if len(self.makes) > 1 or self.kinds is not None:  # one unnamed block type keeps its old key
            facts["types"] = {"kinds": self.kinds, "layer_type_of": self.layer_type_of}
        if not self.time_optimizer:  # (keys of profiles with the bandwidth unchanged)
            facts["optimizer"] = False
        if self.busy_ranks > 1:  # (one rank's keys unchanged)
            facts["busy_ranks"] = self.busy_ranks
        return fingerprint(facts)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def cached(self) -> ModelProfile | None:
        """The profile :meth:`fit` would return from the cache, if it holds one (None: fit measures)."""
        hit = self.cache.load("model", self.key()) if self.cache is not None else None
        if not isinstance(hit, ModelProfile):
            return None
        _progress("model profile from cache", self.progress)
        self.optimizer_bandwidth = hit.optimizer_bandwidth
        return hit

    def fit(self) -> ModelProfile:
        hit = self.cached()
        if hit is not None:
            return hit
        h = self.shape.hidden
        points = [(b, s) for s in self.seq_lens for b in self.batch_sizes]
        layers: list[LayerTypeProfile] = []
        for t, make in enumerate(self.makes):
            name = "block" if len(self.makes) == 1 else (self.kinds[t] if self.kinds else f"type{t}")
            lt, built = self._measure(make, name, points, f" type {t + 1}/{len(self.makes)}" if t else "")
            if t == 0:
                block = built  # the optimizer step and the buffers are measured on the first type's block
            layers.append(lt)
        fixed = buffer_bytes(block) if self.buffer_bytes is None else float(self.buffer_bytes)
        el = torch.finfo(self.dtype).bits // 8
        # Adam step on the block's parameters after a backward: memory bound, priced by the cost model as
        # OPTIMIZER_TRAFFIC_BYTES per parameter / bandwidth, so report the bandwidth that reproduces it.
        from ..planner.cost import OPTIMIZER_TRAFFIC_BYTES

        # at least OPTIMIZER_REPEATS steps: one costs a b=1 forward and backward plus the step, and with automatic
        # mode's 2 repeats the stored MoE accuracy profiles' bandwidths spread 2.3-7.6 GB/s over launches at 4 ranks
        if self.time_optimizer:
            self.optimizer_bandwidth = _optimizer_bandwidth(block, self.shape.num_layers,
                                                            max(self.repeats, OPTIMIZER_REPEATS),
                                                            OPTIMIZER_TRAFFIC_BYTES, (1, self.shape.seq_len, h),
                                                            self._sync)
        ends = self._time_ends(points, block)
        if self.buffer_bytes is None:
            fixed += ends.buffers
        prof = ModelProfile("profiled", self.shape, tuple(layers), self.layer_type_of,
                            "fp32" if self.dtype == torch.float32 else "bf16",
                            embed_params=self.shape.vocab_size * h, head_params=self.shape.vocab_size * h,
                            embed_act_bytes=float(el * self.shape.seq_len * h),
                            head_act_bytes=float(ends.head_act), embed_forward=ends.embed_forward,
                            embed_backward=ends.embed_backward, head_forward=ends.head_forward,
                            head_backward=ends.head_backward, framework_bytes=fixed, source="ModelProfiler",
                            optimizer_bandwidth=self.optimizer_bandwidth)
        if self.cache is not None:
            self.cache.save("model", self.key(), prof)
        return prof

    def _time_ends(self, points: list[tuple[int, int]], block: nn.Module) -> "_Ends":
        """Forward and backward fits of the embedding (``make_embed``: tokens ``[b, s]`` -> ``[b, s, h]``) and of
        the head with its loss (``make_head``: ``[b, s, h]`` -> logits, then cross entropy), timed *in situ*: each
        pass runs tokens -> embedding -> ``block`` (the first layer type's) -> head -> loss and back, as a step
        does, and splits it with clock reads around the ends in forward and, in backward, where the gradient
        reaches the block's output and where it leaves the block's input. Also the head's saved activation bytes.

        Why measured rather than derived from the forward: the embedding was priced at 0 (its backward writes a
        dense ``V x h`` gradient, not free with a large vocabulary), and the head's backward at 2x its forward, a
        matmul count that leaves out the loss and the launch overheads. Why in situ (profile v8): timed on their
        own in a tight loop, the ends took about half of what they take inside a training step --
        ``benchmarks/moe_step_parts.py --model dense`` found the step's ends (what fwd+bwd takes beyond its
        blocks) predicted at 0.46-0.58 of measured in 6 of its 8 plans over 5 launches, and one process of the
        dense benchmark model ran its head and loss forward and backward in 4.9 ms alone, 6.2 ms behind one block
        and 6.9 ms at the end of the 4-block model (1 thread, 4 samples). Behind a block the head meets caches and
        an allocator the block has churned; which of these costs it is not pinned down, and timing the head where
        it runs takes it in either way. The price is memory: the embedding, the head and their gradients are alive
        together (timed apart, one end's copy was freed before the other's was built). A frozen embedding has no
        backward (fit zero); without an embedding the block takes a random hidden state."""
        h, v = self.shape.hidden, self.shape.vocab_size
        el = torch.finfo(self.dtype).bits // 8
        out = _Ends(head_act=float((4 + el) * self.shape.seq_len * v))
        emb = self.make_embed().to(self.device, self.dtype) if self.make_embed is not None else None
        head = self.make_head().to(self.device, self.dtype) if self.make_head is not None else None
        if emb is None and head is None:
            return out
        out.buffers += sum(buffer_bytes(m) for m in (emb, head) if m is not None)
        rows = getattr(emb, "num_embeddings", v)
        grads_at: dict[str, float] = {}

        def stamp(key: str) -> Callable[[torch.Tensor], None]:
            def hook(_grad: torch.Tensor) -> None:
                self._sync()
                grads_at[key] = time.perf_counter()
            return hook

        def one_pass(b: int, s: int) -> tuple[float, float, float, float]:
            grads_at.clear()
            tokens = torch.randint(0, rows, (b, s), device=self.device)
            tgt = torch.randint(0, v, (b * s,), device=self.device)
            self._sync()
            t0 = time.perf_counter()
            if emb is not None:
                x = emb(tokens)  # [b, s, h]
            else:
                x = torch.randn(b, s, h, dtype=self.dtype, device=self.device, requires_grad=True)
            self._sync()
            t1 = time.perf_counter()
            if x.requires_grad:  # a frozen embedding's output takes no gradient
                x.register_hook(stamp("input"))
            y = block(x)  # [b, s, h]
            self._sync()
            t2 = time.perf_counter()
            if head is not None:
                if y.requires_grad:  # (frozen blocks behind a frozen embedding: the head's backward is all there is)
                    y.register_hook(stamp("output"))
                saved = _SavedBytes(_storages(head))
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    logits = head(y)
                    loss = torch.nn.functional.cross_entropy(logits.reshape(b * s, -1), tgt)  # [b*s, V]
                self._sync()
                t3 = time.perf_counter()
                loss.backward()
                if s == self.shape.seq_len:  # the last such pass is at the largest batch
                    # saved for backward + the logits the loop holds + their gradient at the start of backward
                    out.head_act = saved.total / b + 2 * el * s * v
            else:
                t3 = grads_at["output"] = time.perf_counter()
                if y.requires_grad:
                    y.backward(torch.ones_like(y))
            self._sync()
            t4 = time.perf_counter()
            for m in (emb, block, head):
                if m is not None:
                    m.zero_grad(set_to_none=True)
            embed_bwd = t4 - grads_at["input"] if emb is not None and "input" in grads_at else 0.0
            return t1 - t0, embed_bwd, t3 - t2, grads_at.get("output", t4) - t3

        fits = self._fit_passes(points, one_pass)
        if emb is not None:
            out.embed_forward, out.embed_backward = fits[0], fits[1]
        if head is not None:
            out.head_forward, out.head_backward = fits[2], fits[3]
        return out

    def _fit_passes(self, points: list[tuple[int, int]], one_pass: Callable[[int, int], tuple[float, ...]]
                    ) -> tuple[TimeFit, ...]:
        """One fit per value ``one_pass(b, s)`` returns (seconds): its median over ``repeats`` passes per point,
        after one that warms up."""
        per_point = []
        for b, s in points:
            times = [one_pass(b, s) for _ in range(self.repeats + 1)][1:]
            per_point.append((b, s, [statistics.median(t[k] for t in times) for k in range(len(times[0]))]))
        return tuple(TimeFit.fit([(b, s, ts[k]) for b, s, ts in per_point]) for k in range(len(per_point[0][2])))

    def _measure(self, make: Callable[[], nn.Module], name: str, points: list[tuple[int, int]],
                 label: str) -> tuple[LayerTypeProfile, nn.Module]:
        """Forward / backward time fits and saved activations of one block type, measured whole. An MoE block
        runs with its local dispatcher (every expert here): with balanced routing a rank computes tokens x
        top_k expert rows whatever the expert-parallel degree, so this is the per-rank compute under any ep;
        the load-balancing and z-loss terms are part of the timed forward and backward."""
        block = make().to(self.device, self.dtype)
        params = sum(p.numel() for p in block.parameters())
        h = self.shape.hidden
        fwd, bwd, act_at_s = [], [], 0.0
        for i, (b, s) in enumerate(points):
            _progress(f"block{label} fwd+bwd b={b} s={s} ({i + 1}/{len(points)})", self.progress)
            tfs, tbs = [], []
            for _ in range(self.repeats + 1):  # first run warms up
                x = torch.randn(b, s, h, dtype=self.dtype, device=self.device, requires_grad=True)
                saved = _SavedBytes(_storages(block))
                self._sync()
                t0 = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    y = block(x)
                self._sync()
                t1 = time.perf_counter()
                y.backward(torch.ones_like(y))
                self._sync()
                t2 = time.perf_counter()
                tfs.append(t1 - t0)
                tbs.append(t2 - t1)
                block.zero_grad(set_to_none=True)
            # median, not min: a training step runs at the machine's typical speed, not its best moment
            fwd.append((b, s, statistics.median(tfs[1:])))
            bwd.append((b, s, statistics.median(tbs[1:])))
            if s == self.shape.seq_len:
                act_at_s = max(act_at_s, saved.total / b)
        el = torch.finfo(self.dtype).bits // 8
        acts = {act_key(1, "none", False): act_at_s, act_key(1, "none", True): float(el * self.shape.seq_len * h)}
        lt = LayerTypeProfile(name, TimeFit.fit(fwd), TimeFit.fit(bwd), params, acts, h, moe=moe_facts(block))
        return lt, block


def _step_after_backward(blocks: Sequence[nn.Module], x_shape: tuple[int, ...], repeats: int,
                         sync: Callable[[], None], together: bool = False) -> float:
    """Median seconds of an Adam step over ``blocks``' parameters taken right after a forward and backward
    through them, as a training step takes it (torch's default kernel for the device).

    Why not step repeatedly on made-up gradients: the step that follows a backward meets gradients just
    written and caches the backward has filled with activations, and runs slower (2 CPU ranks: a model's
    in-training step 12-20 % longer than the same step repeated on the spot). Gradients are set to None
    after each step, as Lightning's ``zero_grad`` does. ``together``: every rank starts each step at once.
    """
    from ..parallel.optim import step_on_local_shards

    ref = next(p for b in blocks for p in b.parameters())
    params = [p for b in blocks for p in b.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-6)
    step_on_local_shards(opt)  # as the runtime steps them (DTensors on their local shards)
    times = []
    for _ in range(repeats + 1):  # the first step creates the moments
        h = torch.randn(x_shape, dtype=ref.dtype, device=ref.device)
        for b in blocks:
            h = b(h)
        h.backward(torch.ones_like(h))
        sync()
        if together:
            dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def _optimizer_bandwidth(block: nn.Module, num_layers: int, repeats: int, traffic_per_param: float,
                         x_shape: tuple[int, ...], sync: Callable[[], None], cap_params: int = 64 * 2**20) -> float:
    """Bytes/s of an Adam step over the whole model's parameter volume (``num_layers`` blocks, capped).

    One block's parameters can sit in the CPU caches and update ~2x faster than a model's worth, so
    the step is timed on as many copies of the block as the model has blocks (up to ``cap_params``
    parameters), right after a forward and backward through them (:func:`_step_after_backward`).
    """
    per_block = sum(p.numel() for p in block.parameters())
    copies = max(1, min(num_layers, cap_params // max(1, per_block)))
    blocks = [copy.deepcopy(block) for _ in range(copies)]
    seconds = _step_after_backward(blocks, x_shape, repeats, sync)
    return traffic_per_param * per_block * copies / seconds


class ShardedLayerProfiler:
    """Per-rank compute of one block *as the runtime shards it*, for every tp degree and sp kind (and, for
    an MoE block, every expert-parallel degree at tp 1).

    Why: the cost model's fallback divides the unsharded block's time by tp, which assumes sharding
    costs nothing. DTensor dispatch, Megatron-SP's re-sharding and Ulysses' head shuffles add work that
    does not shrink with tp (on CPU it outweighs the saved math). So the real parallelized block is
    timed on real tp groups, with every rank busy at once (ranks that share cores share them here too),
    and the collectives' predicted time (from ``hw``) is subtracted so that the cost model can price
    them per placement. Every rank must call :meth:`fit` together.
    """

    def __init__(self, make_block: Callable[[], nn.Module], shape: ModelShape, hw: HardwareProfile,
                 batch_sizes: Sequence[int] = (1, 2, 4), repeats: int = 3, device: str = "cpu",
                 sp_kinds: Sequence[str] = ("none", "megatron", "ulysses"), progress: bool = True,
                 interleave: bool = True, checkpoint: bool = True,
                 tp_batch_sizes: Mapping[int, Sequence[int]] | None = None, time_budget_s: float | None = None,
                 max_repeats: int = 16) -> None:
        """``tp_batch_sizes``: per tp degree t > 1, the sample counts its (tp, sp) variants are timed and fitted at
        instead of ``batch_sizes`` -- the per-rank batch a tp-t block runs is t times a tp-1 block's at equal
        global batch, and a line fitted below it extrapolates low (``auto.profile_batch_sizes``). ``interleave``: time all variants interleaved over rounds (see :meth:`_time_interleaved`), which keeps
        every variant's block alive at once (about 6 blocks' worth per rank at 8 ranks with ``checkpoint``, more
        for an MoE block, whose experts are replicated over tp, and which adds four blocks per expert-parallel
        degree: plain, checkpointed, and under ZeRO-2 and ZeRO-3); False times each as soon as it is built and
        frees it -- one block's memory, at the price of a slow spell of a shared machine landing on one variant
        only. ``checkpoint``: also time each (tp, sp) variant checkpointed, for the ``checkpoint_forward`` and
        ``recompute`` fits and the share of collectives a recompute repeats (False leaves them out, and the cost
        model prices a recompute as one more forward, collectives and all). ``time_budget_s``: time more rounds than
        ``repeats`` -- up to ``max_repeats`` -- while they fit in that many seconds of timing per
        :meth:`_time_interleaved` call (the whole interleaved set; each block's own timing with ``interleave`` off),
        judged by the first timed round's duration on the slowest rank (:func:`rounds_within_budget`); None: exactly
        ``repeats``."""
        if not dist.is_initialized():
            raise ValueError("process group: not initialized. HINT: call torch.distributed.init_process_group first.")
        self.make_block, self.shape, self.hw = make_block, shape, hw
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise bad_value(f"repeats={repeats!r}", "the timed rounds must be an int >= 1", "e.g. repeats=4.")
        if time_budget_s is not None:
            rounds_within_budget(1.0, time_budget_s, repeats, max_repeats)  # validates the budget and the bounds
        self.batch_sizes, self.repeats, self.device = tuple(batch_sizes), repeats, device
        self.time_budget_s, self.max_repeats = time_budget_s, max_repeats
        self.rounds_timed: list[int] = []  # rounds each _time_interleaved call took (for reports and tests)
        self.tp_batch_sizes = {int(t): tuple(v) for t, v in (tp_batch_sizes or {}).items()}
        self.sp_kinds, self.interleave, self.checkpoint = tuple(sp_kinds), interleave, checkpoint
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.progress = progress and self.rank == 0
        # bytes/s of an Adam step over unsharded copies of the block, every rank stepping at once and the slowest
        # one read (0 until fit() has measured it; one rank measures nothing). See :meth:`_optimizer_overhead`.
        self.optimizer_bandwidth = 0.0
        # FLOP/s of one dense matmul of the block's FFN shape, timed in the same interleaved rounds as the block
        # variants (0 until fit() has measured it). See :class:`_MatmulProbe`.
        self.matmul_flops = 0.0
        # per ZeRO key, one unit's (forward, backward) gather seconds the runtime prefetches beside compute
        # (filled by :meth:`_zero_blocks`, read by :meth:`_zero_overhead`)
        self._prefetched: dict[str, tuple[float, float]] = {}

    def _sync(self) -> None:
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def sizes(self, key: str) -> tuple[int, ...]:
        """Sample counts the variant ``key`` (a time key, its checkpointed twin or a ZeRO key) is timed at: its
        tp degree's entry of ``tp_batch_sizes``, else ``batch_sizes`` (ZeRO and expert-parallel variants are tp 1).
        A ZeRO chain's twins (gradient sync off, one block alone) are timed at the smallest count only: what they
        add to or save from the chain is FSDP2's per-unit, per-step work (the reduce-scatter's copies, a root's
        hooks), which does not grow with the batch (:meth:`_zero_overhead` carries it to the others), and timing
        them at every count made a 4-rank MoE profile's round so long that 4 rounds fitted the budget, not 7."""
        if key.endswith((NOSYNC_SUFFIX, ALONE_SUFFIX)):
            return (min(self.batch_sizes),)
        m = re.match(r"tp([0-9]+)/", key)
        return self.tp_batch_sizes.get(int(m.group(1)), self.batch_sizes) if m else self.batch_sizes

    def variants(self) -> list[tuple[int, str]]:
        """(tp, sp) pairs this model and world allow (the rules of ``ParallelPlan.check_model``)."""
        from ..plan import LayerStrategy, ParallelPlan

        out = [(1, "none")]
        for tp in (d for d in range(2, self.world + 1) if self.world % d == 0):
            for sp in self.sp_kinds:
                s = LayerStrategy(tp=tp, dp=self.world // tp, sp=sp)
                try:
                    ParallelPlan.uniform(self.world, self.shape.num_layers, s).check_model(self.shape)
                except ValueError:
                    continue
                out.append((tp, sp))
        return out

    def _factory(self) -> Any:
        """A mesh factory for the profiled blocks, kept open until :meth:`_close_factories` (the blocks are
        timed after the generators that build them have finished, when ``interleave`` is on)."""
        from ..layout import MeshFactory, RankLayout

        factory = MeshFactory(RankLayout(self.world), torch.device(self.device).type, self.rank)
        self.__dict__.setdefault("_open_factories", []).append(factory)
        return factory

    def _close_factories(self) -> None:
        """Destroy the profiled blocks' process groups (each idle gloo group keeps a thread polling its sockets,
        which slowed every later measurement in the process: the next layer's, the Trainer's own steps)."""
        for factory in self.__dict__.pop("_open_factories", []):
            factory.close()

    def fit(self, layer: LayerTypeProfile) -> LayerTypeProfile:
        """``layer`` (from :class:`ModelProfiler`) with ``sharded``, ``activation_bytes`` for every
        (tp, sp, checkpoint) and, for an MoE block, every (ep, checkpoint) at tp 1, the recompute transients, the
        share of collectives a recompute repeats (``recompute_comm``) and ``zero_overhead`` filled in from real
        runs."""
        acts = dict(layer.activation_bytes)
        repeated: dict[str, float] = {}  # time_key -> share of the forward's collectives a recompute repeats
        seq = self.shape.seq_len
        blocks = itertools.chain(self._variant_blocks(layer, acts, repeated),
                                 self._ep_blocks(layer, acts, repeated) if layer.moe is not None else (),
                                 self._zero_blocks(layer))
        comms: dict[str, Comm] = {}
        held: list[tuple[str, nn.Module]] = []
        measured: dict[tuple[str, int], tuple[float, float, float, float]] = {}
        for key, block, comm in blocks:  # the same keys in the same order on every rank
            comms[key] = comm
            if self.interleave:
                held.append((key, block))
            else:
                measured.update(self._time_blocks([(key, block)]))
            del block
        probe_b = max(self.batch_sizes)
        fresh = self.make_block().to(self.device)  # one more block: the probes' dtype and core attention
        probe = [(_MatmulProbe.KEY, _MatmulProbe(self.shape.hidden, self.shape.ffn_hidden,
                                                 next(fresh.parameters()).dtype, self.device), probe_b)]
        attention = self._attention_probes(fresh)
        del fresh
        probe += [(key, module, probe_b) for key, module in attention]
        if held:
            _progress(f"timing {len(held)} blocks x {max(len(self.sizes(k)) for k, _ in held)} batch sizes, "
                      f"{self.repeats} interleaved rounds" + (
                          f" (up to {self.max_repeats} within {self.time_budget_s:g} s)" if self.time_budget_s else ""),
                      self.progress)
            measured.update(self._time_blocks(held, probe))
        else:
            measured.update(self._time_blocks([], probe))
        del held
        tf, tb, _, _ = measured.pop((_MatmulProbe.KEY, probe_b))
        self.matmul_flops = probe[0][1].flops(probe_b * self.shape.seq_len) / max(tf + tb, 1e-12)
        span = 0.0
        if attention:
            whole, halves = (sum(measured.pop((key, probe_b))[:2]) for key, _ in attention)
            blk = measured.get((time_key(1, "none"), probe_b))
            span = span_share(whole, halves, blk[0] + blk[1]) if blk is not None else 0.0
        self._close_factories()
        computed: dict[tuple[str, int], tuple[float, float]] = {}
        for key, comm_of in comms.items():
            if key.startswith("zero"):
                continue
            for b in self.sizes(key):
                tf, tb, cf, cb = measured[(key, b)]
                comm_f, comm_b = comm_of(b)
                # compute = wall minus the collectives' predicted share, but on CPU never below the rank's own CPU
                # time (a GPU rank's CPU time is no floor: it busy-waits in synchronize, collectives included)
                if torch.device(self.device).type == "cpu":
                    times = _max_over_ranks([max(tf - comm_f, cf), max(tb - comm_b, cb)], self.device)
                else:
                    times = _max_over_ranks([max(tf - comm_f, 0.0), max(tb - comm_b, 0.0)], self.device)
                # the slowest rank sets the pace
                computed[(key, b)] = (float(times[0]), float(times[1]))
        sharded: dict[str, dict[str, TimeFit]] = {}
        for key in comms:
            if key.startswith("zero") or key.endswith(CKPT_SUFFIX):
                continue
            sizes = self.sizes(key)
            fits = {"forward": TimeFit.fit([(b, seq, computed[(key, b)][0]) for b in sizes]),
                    "backward": TimeFit.fit([(b, seq, computed[(key, b)][1]) for b in sizes])}
            if key + CKPT_SUFFIX in comms:
                # the checkpointed block's forward, and what its backward takes beyond the plain one's: the
                # recompute as it really runs (non-reentrant checkpointing stops once the last saved tensor is
                # back, and adds bookkeeping of its own), rather than one more plain forward
                ck = [computed[(key + CKPT_SUFFIX, b)] for b in sizes]
                fits["checkpoint_forward"] = TimeFit.fit([(b, seq, f) for b, (f, _) in zip(sizes, ck)])
                fits["recompute"] = TimeFit.fit([(b, seq, max(0.0, bw - computed[(key, b)][1]))
                                                 for b, (_, bw) in zip(sizes, ck)])
            sharded[key] = fits
        zero = self._zero_overhead(sharded, {k: c for k, c in comms.items() if k.startswith("zero")}, measured)
        prof = replace(layer, sharded=sharded, activation_bytes=acts, recompute_comm=repeated, span_share=span)
        return replace(prof, zero_overhead=zero, optimizer_overhead=self._optimizer_overhead(layer))

    def _attention_probes(self, block: nn.Module) -> list[tuple[str, nn.Module]]:
        """``block``'s core attention at the full sequence and in halves (:class:`_AttentionProbe`), or none when
        the block names no core attention (``galv_attention``) or the sequence does not halve: then the cost model
        carries the block to other sequence lengths by FLOPs."""
        path = getattr(block, "galv_attention", None)
        sh = self.shape
        if not isinstance(path, str) or sh.seq_len < 2 or sh.seq_len % 2 or sh.hidden % sh.num_heads:
            return []
        try:
            core = block.get_submodule(path)
        except AttributeError:
            return []
        d = sh.hidden // sh.num_heads
        probes = [(f"attention/{k}", _AttentionProbe(core, sh.num_heads, sh.num_kv_heads, d, k)) for k in (1, 2)]
        x = torch.randn(1, sh.seq_len, sh.hidden, device=self.device)
        try:  # a core attention that takes other inputs than the protocol's (q, k, v) is not probed
            with torch.no_grad():
                for _, probe in probes:
                    probe(x)
        except (RuntimeError, ValueError, TypeError):
            return []
        return probes

    def _variant_blocks(self, layer: LayerTypeProfile, acts: dict[str, float], repeated: dict[str, float]
                        ) -> Iterator[tuple[str, nn.Module, Comm]]:
        """The block as the runtime shards it for every (tp, sp) of :meth:`variants`, keyed like
        ``LayerTypeProfile.sharded``, with its predicted collective seconds, each followed by the same variant
        checkpointed (key + ``/ckpt``; unless ``checkpoint`` is off); records into ``acts`` the saved activations
        with and without checkpointing and the recompute peak of each (measured as it is built), and into
        ``repeated`` the share of the forward's collectives a recompute runs again (:meth:`_repeated_share`)."""
        from ..parallel.activation_checkpoint import apply_checkpointing
        from ..parallel.block import apply_block
        from ..plan import LayerStrategy
        from ..planner.cost import block_comm_time, moe_layer_comm
        from ..planner.profiles import act_key, time_key

        factory = self._factory()  # closed by fit() once its blocks are timed
        seq, h = self.shape.seq_len, self.shape.hidden
        for tp, sp in self.variants():
            _progress(f"sharded block tp={tp} sp={sp}", self.progress)
            s = LayerStrategy(tp=tp, dp=self.world // tp, sp=sp)

            def build(checkpointed: bool) -> nn.Module:
                block = self.make_block().to(self.device)
                # the very code parallelize() runs; no mesh for tp=1 (building one is a collective)
                apply_block(block, factory.mesh(s) if tp > 1 else None, s)
                self._global_router_stats(block, layer, factory, s)
                if checkpointed:
                    apply_checkpointing(block)
                return block

            block = build(False)
            el = next(block.parameters()).element_size()  # activations travel in the block's dtype

            def comm(b: int, s: LayerStrategy = s, el: int = el) -> tuple[float, float]:
                t = block_comm_time(self.hw, self.shape, s, b * seq * h * el, layer.moe)  # MoE: replicated over tp
                stride = 1 if (s.ulysses or s.tp == 1 or not s.tp_consecutive) else s.tp  # as the cost model's
                stats, _ = moe_layer_comm(self.hw, layer, s, b, seq, el, stride)  # router statistics (MoE only)
                return t + stats, t

            b = max(self.batch_sizes)
            acts[act_key(tp, sp, False)] = self._saved_per_sample(block, b)
            ckpt = build(True)
            acts[act_key(tp, sp, True)] = self._saved_per_sample(ckpt, b)
            acts[transient_key(tp, sp)] = self._backward_peak_per_sample(ckpt, b)
            yield time_key(tp, sp), block, comm
            if self.checkpoint:
                # a sequence-sharding mode gathers the block's output at exit (the boundary contract): compute in
                # the fits, not a priced collective, and last, so never repeated
                exit_gathers = 1 if tp > 1 and sp != "none" else 0
                yield time_key(tp, sp) + CKPT_SUFFIX, ckpt, self._recompute_comm(block, ckpt, comm, time_key(tp, sp),
                                                                             repeated, exit_gathers)
            del block, ckpt

    def _recompute_comm(self, plain: nn.Module, ckpt: nn.Module, comm: Comm, key: str,
                        repeated: dict[str, float], exit_gathers: int = 0) -> Comm:
        """The predicted collectives of ``ckpt`` (``plain`` checkpointed): the backward's, plus the share of the
        forward's that its recompute repeats, counted now (:meth:`_repeated_share`) and recorded in
        ``repeated[key]`` -- the very rule the cost model prices a checkpointed layer by, so the recompute fit
        left after subtracting them is compute only."""
        share = self._repeated_share(plain, ckpt, exit_gathers)
        if share is not None:
            repeated[key] = share
        r = 1.0 if share is None else share

        def comm_ckpt(b: int) -> tuple[float, float]:
            f, bw = comm(b)
            return f, bw + r * f

        return comm_ckpt

    def _repeated_share(self, plain: nn.Module, ckpt: nn.Module, exit_gathers: int = 0) -> float | None:
        """Share, by payload bytes, of the forward's priced collectives (all but the last ``exit_gathers``, which
        the cost model does not price as the block's) that the checkpointed block's backward issues beyond the
        plain one's, i.e. that its recompute repeats (None: the block has none). Measured, not assumed:
        non-reentrant checkpointing stops once the last saved tensor is back, so a collective after it is
        skipped -- a Megatron block's closing row-parallel all-reduce -- unless something saved for backward
        follows it (dropout's mask), and an MoE block's attention collectives are repeated because the MoE layer
        after them saves. Bytes rather than counts: an MoE block mixes tiny statistics all-reduces with
        activation-sized all-to-alls. Each rank's share, maxed over ranks, so every rank records one number."""
        x = torch.randn(1, self.shape.seq_len, self.shape.hidden, device=self.device, requires_grad=True)
        sums = []
        for block in (plain, ckpt):
            with _CollectiveBytes() as fwd:
                y = block(x)
            with _CollectiveBytes() as bwd:
                y.backward(torch.ones_like(y))
            block.zero_grad(set_to_none=True)
            priced = fwd.ops[:len(fwd.ops) - exit_gathers] if exit_gathers else fwd.ops
            sums += [sum(priced), sum(bwd.ops)]
        forward, plain_bwd, _, ckpt_bwd = sums
        share = min(1.0, max(0.0, (ckpt_bwd - plain_bwd) / forward)) if forward > 0 else -1.0
        t = _max_over_ranks([share], self.device)[0]  # each rank's own share, the largest: one number everywhere
        return None if t < 0 else t

    def _time_blocks(self, blocks: Sequence[tuple[str, nn.Module]],
                     extra: Sequence[tuple[str, nn.Module, int]] = ()
                     ) -> dict[tuple[str, int], tuple[float, float, float, float]]:
        """:meth:`_time_interleaved` over every block at every batch size, and the ``extra`` (key, module, batch)
        runs at theirs, in the same rounds, keyed ``(key, batch)``."""
        runs = [(key, block, b) for key, block in blocks for b in self.sizes(key)] + list(extra)
        walls = self._time_interleaved([(block, b) for _, block, b in runs])
        return {(key, b): w for (key, _, b), w in zip(runs, walls)}

    def _time_interleaved(self, runs: Sequence[tuple[nn.Module, int]]) -> list[tuple[float, float, float, float]]:
        """Median over rounds of the slowest rank's (forward wall, backward wall, forward CPU, backward CPU)
        seconds of each ``(block, batch)`` in ``runs``, every rank starting each pass together (the same numbers on
        every rank). CPU = this thread's time: compute without the waits.

        Why the slowest rank of each pass, then the median (since automatic mode's sharded-profile cache v14;
        before, each rank's own median, then the largest): a step waits for its slowest rank, pass by pass. With more ranks than cores,
        which ranks share a core changes from pass to pass, so each rank's median is taken mostly from the passes
        it had a core to itself and the largest of those medians under-reads what a step pays.
        ``benchmarks/pass_reduction.py`` (RESULTS.md, 5 launches; 4 gloo ranks on 2 cores, one LLaMA block of the
        accuracy benchmark at 2 samples, against its model's 4 blocks run back to back, as a data-parallel step
        runs them): each rank's median, then the largest, read 0.894 [0.856, 0.931] of the blocks back to back;
        the slowest rank per pass, then the median, 1.023 [0.976, 1.070]. With a core per rank (2 ranks) the two
        agree within 1.5 %. A variant whose collectives make its ranks wait for each other reads alike either way.

        Why interleaved: the machine's speed drifts in spells of seconds (a shared host; the same block ran
        45 and 75 ms per forward minutes apart). Timing one variant's repeats back to back put a whole
        variant into one spell, so one profile run could price, say, the unsharded block 30 % slow and every
        other variant normally, and plans using it moved against the rest. Here round ``r`` times every
        entry once (in an order rotated by one each round), so a spell shorter than a round touches one
        sample of each entry and the medians over rounds drop it. Round 0 warms every entry up.
        """
        rec: list[list[tuple[float, float, float, float]]] = [[] for _ in runs]
        n = len(runs)
        rounds, r = self.repeats, 0
        while r <= rounds:
            started = time.perf_counter()
            for i in (list(range(n))[r % n:] + list(range(n))[:r % n]) if n else []:
                block, b = runs[i]
                x = torch.randn(b, self.shape.seq_len, self.shape.hidden, device=self.device, requires_grad=True)
                dist.barrier()
                c0, t0 = time.thread_time(), time.perf_counter()
                y = block(x)
                self._sync()
                c1, t1 = time.thread_time(), time.perf_counter()
                y.backward(torch.ones_like(y))
                self._sync()
                if r:
                    rec[i].append((t1 - t0, time.perf_counter() - t1, c1 - c0, time.thread_time() - c1))
                block.zero_grad(set_to_none=True)
                del x, y
            if r == 1 and self.time_budget_s is not None and n:  # the first timed round (round 0 warms up)
                took = _max_over_ranks([time.perf_counter() - started], self.device)[0]  # one number on every rank
                rounds = rounds_within_budget(max(took, 1e-9), self.time_budget_s, self.repeats, self.max_repeats)
            r += 1
        self.rounds_timed.append(rounds)
        return _slowest_rank_medians(rec, self.device)

    def _optimizer_overhead(self, layer: LayerTypeProfile, cap_params: int = 64 * 2**20) -> dict[str, float]:
        """``{"tp": s, "zero": s}`` for :class:`LayerTypeProfile`.optimizer_overhead: per layer, what an Adam
        step over its parameters takes beyond its memory traffic when they are DTensors.

        Why: the cost model prices the update by bytes moved (the optimizer bandwidth: with several ranks the plain
        step timed here, :attr:`optimizer_bandwidth`; on one rank ``ModelProfiler``'s), which
        holds for plain tensors. Split by tp or sharded by FSDP2, every parameter is a DTensor; stepped through
        DTensor's ops, each of its ~10 update ops dispatched through sharding propagation and on CPU a tp2
        model's step took as long as the unsharded one, at half the bytes. The runtime now steps elementwise
        optimizers on the local shards (``parallel/optim.py``), and so does this measurement: what is left is
        the per-tensor bookkeeping of that (and any optimizer the runtime cannot step locally pays more). Timed here on all ranks at once, as many blocks as the model has (up to
        ``cap_params`` parameters, so that the step runs from memory as the real one does), sharded like the
        widest tp variant with sp none and like ZeRO-3 over the world; the same blocks unsharded, timed beside
        them and scaled to the sharded byte count, are subtracted, so contention and cache effects cancel. Each
        step is timed right after a forward and backward through its blocks (:func:`_step_after_backward`).
        """
        from ..layout import MeshFactory, RankLayout
        from ..parallel.block import apply_block
        from ..parallel.data_parallel import apply_fsdp
        from ..plan import LayerStrategy

        if self.world == 1:
            return {}
        # its groups go with it: an idle gloo group's thread would slow the later measurements
        with MeshFactory(RankLayout(self.world), torch.device(self.device).type, self.rank) as factory:
            copies = max(1, min(self.shape.num_layers, cap_params // max(1, layer.params)))
            tps = [tp for tp, sp in self.variants() if tp > 1 and sp == "none"]
            shardings: dict[str, LayerStrategy | None] = {"plain": None}
            if tps:
                shardings["tp"] = LayerStrategy(tp=max(tps), dp=self.world // max(tps))
            shardings["zero"] = LayerStrategy(dp=self.world, zero=3)
            out: dict[str, tuple[float, int]] = {}
            for name, s in shardings.items():
                _progress(f"optimizer step {name}", self.progress)
                blocks = []
                for _ in range(copies):
                    block = self.make_block().to(self.device)
                    if name == "tp":
                        apply_block(block, factory.mesh(s), s)
                    elif name == "zero":
                        apply_fsdp(block, factory.data_mesh(s), s, self.world)
                    blocks.append(block)
                t = _max_over_ranks([_step_after_backward(blocks, (1, self.shape.seq_len, self.shape.hidden),
                                                          max(self.repeats, OPTIMIZER_REPEATS), self._sync, together=True)],
                                    self.device)[0]  # the slowest rank sets the pace
                params = [p for b in blocks for p in b.parameters() if p.requires_grad]
                numel = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
                out[name] = (float(t), numel)
                del params, blocks
            plain_s, plain_n = out.pop("plain")
            # the plain step is the one every rank of a data-parallel step takes at once, after the gradient sync:
            # the bandwidth it reaches is what the cost model should price the update with. ModelProfiler's, timed on
            # rank 0 alone in automatic mode, ran 1.2x (2 ranks) to 2.3-3x (4 ranks on 2 cores) faster in a one-off
            # check on the MoE accuracy benchmark's block; the in-step optimizer phase matched this one
            from ..planner.cost import OPTIMIZER_TRAFFIC_BYTES

            self.optimizer_bandwidth = OPTIMIZER_TRAFFIC_BYTES * plain_n / plain_s if plain_s > 0 else 0.0
            return {name: max(0.0, (sec - plain_s * n / plain_n) / copies) for name, (sec, n) in out.items()}

    def ep_degrees(self, layer: LayerTypeProfile) -> list[int]:
        """Expert-parallel degrees > 1 this world can run the layer's experts at (tp 1, ep | world and | E)."""
        if layer.moe is None:
            return []
        return [e for e in divisors(self.world) if e > 1 and layer.moe.num_experts % e == 0]

    def _ep_blocks(self, layer: LayerTypeProfile, acts: dict[str, float], repeated: dict[str, float]
                   ) -> Iterator[tuple[str, nn.Module, Comm]]:
        """An MoE block with its experts split over ``ep`` ranks (tp 1) for every ep degree, keyed
        ``tp1/none/ep<k>``, each with its predicted (forward, backward) all-to-all seconds at ``b`` samples, and
        followed by the same block checkpointed (unless ``checkpoint`` is off); records into ``acts`` and
        ``repeated`` what :meth:`_variant_blocks` does, under ep keys.

        Why: balanced routing gives every rank ``tokens x top_k`` expert rows whatever ``ep`` is, so the cost
        model used to price ep as the unsharded block plus its all-to-alls -- but the dispatcher's own work
        (grouping rows by expert and rank, the index copies on both sides, the uneven split bookkeeping,
        waiting for the slowest sender) is none of those. The measured all-to-alls and count exchange are
        subtracted as predicted (in :meth:`fit`), the way the tp variants subtract theirs, so the cost model
        still prices them per placement."""
        from ..parallel.activation_checkpoint import apply_checkpointing
        from ..parallel.expert import apply_ep
        from ..plan import LayerStrategy
        from ..planner.cost import moe_layer_comm
        from ..planner.profiles import time_key

        moe = layer.moe
        if moe is None:
            raise ValueError("layer.moe: None. HINT: expert-parallel variants exist for MoE layer types only.")
        factory = self._factory()  # closed by fit() once its blocks are timed
        seq = self.shape.seq_len
        for ep in self.ep_degrees(layer):
            _progress(f"sharded block ep={ep}", self.progress)
            s = LayerStrategy(dp=self.world, ep=ep)

            def build(checkpointed: bool, s: LayerStrategy = s) -> nn.Module:
                block = self.make_block().to(self.device)
                self._global_router_stats(block, layer, factory, s)
                apply_ep(block, factory.expert_mesh(s), s, "profiled block")  # the runtime's own dispatch
                if checkpointed:
                    apply_checkpointing(block)
                return block

            block = build(False)
            el = next(block.parameters()).element_size()

            def comm(b: int, s: LayerStrategy = s, el: int = el) -> tuple[float, float]:
                # the count exchange and all-to-alls, and the router statistics, as the cost model prices them
                return moe_layer_comm(self.hw, layer, s, b, seq, el, 1)

            # saved activations and the recompute peak at this ep (the dispatcher keeps buffers of its own); the
            # largest over ranks, which routing loads unevenly, so every rank records the same profile
            b = max(self.batch_sizes)
            ckpt = build(True)
            acts[act_key(1, "none", False, ep)] = _max_over_ranks([self._saved_per_sample(block, b)], self.device)[0]
            acts[act_key(1, "none", True, ep)] = _max_over_ranks([self._saved_per_sample(ckpt, b)], self.device)[0]
            acts[transient_key(1, "none", ep)] = self._backward_peak_per_sample(ckpt, b)
            key = time_key(1, "none", ep)
            yield key, block, comm
            if self.checkpoint:
                yield key + CKPT_SUFFIX, ckpt, self._recompute_comm(block, ckpt, comm, key, repeated)
            del block, ckpt

    @staticmethod
    def _global_router_stats(block: nn.Module, layer: LayerTypeProfile, factory: object, s: object) -> None:
        """An MoE block's router statistics summed over the variant's data group, as ``parallelize()`` wires
        them (``GlobalRouterStats``): the all-reduce is a sync point in every MoE layer's forward, where each
        rank waits for the slowest. Timed without it, the MoE accuracy benchmark's data-parallel plans ran their
        forward + backward 14 % (2 ranks) and 19 % (4 ranks) slower than predicted (10-launch run at a2e181e);
        with it, 7 % and 4 % (at dd67226). The collective itself is subtracted as the cost model prices it
        (``cost.router_stats_time``)."""
        if layer.moe is None:
            return
        from ..parallel.expert import GlobalRouterStats, moe_layers

        data_mesh = factory.data_mesh(s)  # type: ignore[attr-defined]
        for moe_layer in moe_layers(block):
            moe_layer.stats_reducer = GlobalRouterStats(data_mesh.get_group(), data_mesh.size(), s.dp)  # type: ignore[attr-defined]

    def _saved_per_sample(self, block: nn.Module, b: int) -> float:
        """Bytes autograd keeps for backward per sample (this rank's shard), parameters/buffers excluded."""
        x = torch.randn(b, self.shape.seq_len, self.shape.hidden, device=self.device, requires_grad=True)
        saved = _SavedBytes(_storages(block))
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            y = block(x)
        y.backward(torch.ones_like(y))
        block.zero_grad(set_to_none=True)
        return float(saved.total) / b

    def _backward_peak_per_sample(self, block: nn.Module, b: int) -> float:
        """Peak bytes of activations + temporaries while a checkpointed block recomputes and runs its
        backward, per sample: the recomputed activations plus the gradients of the intermediate tensors
        (which the forward-only count above cannot see)."""
        from torch.distributed._tools.mem_tracker import MemTracker

        x = torch.randn(b, self.shape.seq_len, self.shape.hidden, device=self.device, requires_grad=True)
        y = block(x)
        g = torch.ones_like(y)
        mt = MemTracker()
        mt.track_external(block)
        with mt:
            y.backward(g)
        block.zero_grad(set_to_none=True)
        peak = mt.get_tracker_snapshot("peak")
        kinds = next(iter(peak.values())) if peak else {}
        live = sum(float(v) for k, v in kinds.items() if getattr(k, "name", str(k)) in ("ACT", "TEMP"))
        return _max_over_ranks([live / b], self.device)[0]

    def _zero_blocks(self, layer: LayerTypeProfile | None = None) -> Iterator[tuple[str, nn.Module, Comm]]:
        """The block under FSDP2 with the whole world as its data group, ZeRO-2 and ZeRO-3, keyed
        :func:`~lightning_galv.planner.profiles.zero_key`: a chain of ``ZERO_CHAIN_UNITS`` such blocks under one
        shared root (:class:`_UnitChain`), each with its predicted (forward, backward) seconds of the collectives
        one unit runs, all inline: the all-gathers / reduce-scatters (and an MoE block's router statistics over
        that group, as in its ``tp1/none`` variant), which :meth:`_zero_overhead` subtracts with the compute; the
        part of the gathers the runtime prefetches beside compute is kept in ``self._prefetched[key]``.

        An MoE block is also built for every expert-parallel degree as ``parallelize()`` wraps it: experts split
        by ``apply_ep`` (the all-to-alls too are subtracted), each an FSDP2 unit of its own over the expert-data
        group when that has two or more ranks, else plain tensors the block's state ignores. FSDP2's work is
        largely per unit and per tensor, so the whole block's overhead scaled down to the part FSDP2 still
        manages priced those layouts low (``cost.zero_overhead_entry``).

        Each is followed by its twin with gradient sync off (key + ``NOSYNC_SUFFIX``), timed for the
        ``backward_nosync`` overhead: the micro-batches before the last of an accumulation, and by one block alone
        (key + ``ALONE_SUFFIX``: its own root, every gather inline), timed for a plan's only ZeRO-2/3 unit."""
        from ..plan import LayerStrategy
        from ..planner.cost import moe_layer_comm
        from ..planner.profiles import zero_key

        if self.world == 1:
            return
        factory = self._factory()  # closed by fit() once its blocks are timed
        eps = [1] + (self.ep_degrees(layer) if layer is not None else [])
        n = ZERO_CHAIN_UNITS
        # the share of a unit's gathers prefetched beside compute, as the cost model prices a model of n such
        # blocks (``cost._data_parallel_groups``' ``prefetched``): where collectives run inline (gloo) the runtime
        # issues the next unit's asynchronously, so all but the first unit of each direction gather beside compute
        hidden = 0.0 if self.hw.async_collectives else 1.0 - 1.0 / n
        for ep in eps:
            edp = self.world // ep
            for zero in (2, 3):
                _progress(f"sharded block zero={zero}" + (f" ep={ep}" if ep > 1 else ""), self.progress)
                s = LayerStrategy(dp=self.world, zero=zero, ep=ep)
                chain, units = self._zero_chain(layer, factory, s, n)
                el = next(chain.parameters()).element_size()
                gathers = [self.hw.collective_time("allgather", b, g, st) for b, g, st in units]
                gather = sum(gathers)
                scatter = sum(self.hw.collective_time("reducescatter", b, g, st) for b, g, st in units)
                # forward: the block's own state only (nested expert units gather inline, outside the prefetch
                # chain); backward (ZeRO-3): every state, in post-forward order
                key = zero_key(zero, ep, edp)
                self._prefetched[key] = (gathers[0] * hidden, gather * hidden if zero == 3 else 0.0)

                def comm(b: int, f: float = gather, bw: float = scatter + (gather if zero == 3 else 0.0),
                         s: LayerStrategy = s, el: int = el) -> tuple[float, float]:
                    if layer is None:
                        return f, bw
                    # router statistics (and at ep > 1 the count exchange and all-to-alls) as the cost model
                    # prices them
                    mf, mb = moe_layer_comm(self.hw, layer, s, b, self.shape.seq_len, el, 1)
                    return f + mf, bw + mb

                def comm_nosync(b: int, comm: Comm = comm, scatter: float = scatter) -> tuple[float, float]:
                    f, bw = comm(b)
                    return f, bw - scatter

                yield key, chain, comm
                del chain
                # the same chain as the micro-batches before the last of an accumulation run it: no
                # reduce-scatter, and none of FSDP2's copies around it (the cost model's "backward_nosync")
                twin, _ = self._zero_chain(layer, factory, s, n)
                twin.set_requires_gradient_sync(False)  # type: ignore[operator]  # recurses into every unit
                self._prefetched[key + NOSYNC_SUFFIX] = self._prefetched[key]
                yield key + NOSYNC_SUFFIX, twin, comm_nosync
                del twin
                # one block alone, its own root: every gather inline, the root's work on this one unit (a plan
                # whose only ZeRO-2/3 unit it is runs it so: cost.GalvatronCostModel.lone_unit_time)
                alone, _ = self._zero_block(layer, factory, s)
                self._prefetched[key + ALONE_SUFFIX] = (0.0, 0.0)
                yield key + ALONE_SUFFIX, alone, comm
                del alone

    def _zero_chain(self, layer: LayerTypeProfile | None, factory: Any, s: Any, n: int
                    ) -> tuple[nn.Module, list[tuple[float, int, int]]]:
        """``n`` blocks each wrapped by :meth:`_zero_block`, chained under a shared FSDP2 root as ``parallelize()``
        makes one (:func:`~lightning_galv.parallel.data_parallel.apply_shared_root`, which on CPU also issues the
        prefetched gathers asynchronously), and one block's collectives."""
        from ..parallel.data_parallel import apply_shared_root

        built = [self._zero_block(layer, factory, s) for _ in range(n)]
        chain = _UnitChain([block for block, _ in built])
        apply_shared_root(chain, list(chain.units), factory.data_mesh(s))
        return chain, built[0][1]

    def _zero_block(self, layer: LayerTypeProfile | None, factory: Any, s: Any
                    ) -> tuple[nn.Module, list[tuple[float, int, int]]]:
        """A block wrapped as ``parallelize()`` wraps a ZeRO-2/3 layer of strategy ``s`` (experts split by
        ``apply_ep`` at ep > 1, each an FSDP2 unit of its own over a two-or-more-rank expert-data group), and the
        (bytes, ranks, stride) of every FSDP2 unit's collectives, as the cost model's groups."""
        from ..parallel.data_parallel import apply_fsdp
        from ..parallel.expert import apply_ep

        block = self.make_block().to(self.device)
        if layer is not None:
            self._global_router_stats(block, layer, factory, s)
        experts: list[nn.Module] = apply_ep(block, factory.expert_mesh(s), s, "profiled block") if s.ep > 1 else []
        expert_ids = {id(p) for m in experts for p in m.parameters()}
        dense_bytes = sum(p.numel() * p.element_size() for p in block.parameters() if id(p) not in expert_ids)
        units = [(float(dense_bytes), self.world, 1)]
        ignored: set[nn.Parameter] = set()
        edp = self.world // s.ep
        if edp > 1:
            for m in experts:
                apply_fsdp(m, factory.expert_mesh(s)["edp"], s, self.world)
                units.append((float(sum(p.numel() * p.element_size() for p in m.parameters())), edp, s.ep))
        else:
            ignored = {p for m in experts for p in m.parameters()}
        apply_fsdp(block, factory.data_mesh(s), s, self.world, ignored_params=ignored)
        return block, units

    def _zero_overhead(self, sharded: Mapping[str, Mapping[str, TimeFit]], comms: Mapping[str, Comm],
                       measured: Mapping[tuple[str, int], tuple[float, float, float, float]]
                       ) -> dict[str, dict[str, TimeFit]]:
        """``{zero_key: {"forward": fit, "backward": fit, "backward_nosync": fit}}`` for
        :class:`LayerTypeProfile`.zero_overhead: FSDP2's own work per unit (flat-buffer copies, hooks, its root's
        share), beyond the compute and the collectives the cost model prices; "forward_alone" / "backward_alone":
        the same for a unit that is its own root (the ``ALONE_SUFFIX`` block, its gathers inline).

        The chains of :meth:`_zero_blocks`, timed (in ``measured``) like the sharded variants; per unit, minus the
        compute of the same block without FSDP2 (``sharded``: the ``tp1/none`` fits, or ``tp1/none/ep<k>`` at
        ep k) and its collectives as the cost model prices a unit of a model of ``ZERO_CHAIN_UNITS`` such blocks:
        inline, but for the prefetched gathers (``self._prefetched``), which overlap the compute at the
        all-gather's slowdown (``HardwareProfile.gather_slowdown``). The twins (gradient sync off, alone) are
        timed at one batch (:meth:`sizes`): their fits are the chained unit's, shifted by the difference there."""
        from ..planner.profiles import parse_zero_key, time_key

        seq = self.shape.seq_len
        slow = self.hw.gather_slowdown

        def per_unit(key: str, comm: Comm, b: int) -> tuple[float, float]:
            # one unit as priced: compute + inline collectives + the prefetched gathers beside the compute
            n = 1 if key.endswith(ALONE_SUFFIX) else ZERO_CHAIN_UNITS
            base = key.removesuffix(NOSYNC_SUFFIX).removesuffix(ALONE_SUFFIX)
            _, ep, _ = parse_zero_key(base)  # type: ignore[misc]  # keys from zero_key
            plain = sharded[time_key(1, "none", ep)]
            hid_f, hid_b = self._prefetched[key]
            tf, tb, _, _ = measured[(key, b)]
            comm_f, comm_b = comm(b)
            c_f, c_b = plain["forward"](b, seq), plain["backward"](b, seq)
            t = _max_over_ranks([max(0.0, tf / n - (comm_f - hid_f) - overlapped(c_f, hid_f, slow)),
                                 max(0.0, tb / n - (comm_b - hid_b) - overlapped(c_b, hid_b, slow))], self.device)
            return float(t[0]), float(t[1])

        chained = {key: {b: per_unit(key, comm, b) for b in self.batch_sizes}
                   for key, comm in comms.items() if not key.endswith((NOSYNC_SUFFIX, ALONE_SUFFIX))}
        out: dict[str, dict[str, TimeFit]] = {
            key: {"forward": TimeFit.fit([(b, seq, f) for b, (f, _) in per_b.items()]),
                  "backward": TimeFit.fit([(b, seq, bw) for b, (_, bw) in per_b.items()])}
            for key, per_b in chained.items()}
        for key, comm in comms.items():
            base = key.removesuffix(NOSYNC_SUFFIX).removesuffix(ALONE_SUFFIX)
            if key == base:
                continue
            # a twin is timed at one count (:meth:`sizes`): its difference from the chained unit there, carried to
            # every count of the chain's fit (FSDP2's per-unit work does not grow with the batch)
            (b0,) = self.sizes(key)
            f0, bw0 = per_unit(key, comm, b0)
            df, db = f0 - chained[base][b0][0], bw0 - chained[base][b0][1]
            shifted = [(b, seq, max(0.0, f + df), max(0.0, bw + db)) for b, (f, bw) in chained[base].items()]
            if key.endswith(ALONE_SUFFIX):
                out[base]["forward_alone"] = TimeFit.fit([(b, s, f) for b, s, f, _ in shifted])
                out[base]["backward_alone"] = TimeFit.fit([(b, s, bw) for b, s, _, bw in shifted])
            else:  # its forward is the synced chain's: only the backward differs
                out[base]["backward_nosync"] = TimeFit.fit([(b, s, bw) for b, s, _, bw in shifted])
        return out


class HardwareProfiler:
    """Time collectives on the default process group. Every rank must call :meth:`fit` together."""

    def __init__(self, gpus_per_node: int | None = None, sizes_bytes: Sequence[int] = (1 << 16, 1 << 20, 1 << 22, 1 << 24),
                 repeats: int = 3, device_memory_bytes: float | None = None, cache: ProfileCache | None = None,
                 progress: bool = True, device: str | None = None) -> None:
        """``device``: where the timed buffers live; default ``cuda`` under NCCL, else ``cpu``."""
        if not dist.is_initialized():
            raise ValueError("process group: not initialized. HINT: call torch.distributed.init_process_group first.")
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        self.device = torch.device(device)
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.gpus_per_node = gpus_per_node or self.world
        self.sizes, self.repeats, self.cache = tuple(sizes_bytes), repeats, cache
        self.progress = progress and self.rank == 0
        self.device_memory_bytes = device_memory_bytes or 8 * 2**30

    def key(self) -> str:
        # v3: the overlap coefficient as the inverse of cost.overlapped (see _overlap); v4: an all-gather's too
        return fingerprint({"v": 4, "world": self.world, "backend": dist.get_backend(), "sizes": self.sizes,
                            "node": self.gpus_per_node, "torch": torch.__version__})

    def _time(self, fn: Callable[[], None]) -> float:
        fn()
        times = []
        for _ in range(self.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t0)
        return _max_over_ranks([statistics.median(times)], self.device)[0]

    def _groups(self, size: int, consecutive: bool) -> tuple[list[list[int]], int]:
        stride = 1 if consecutive else self.world // size
        if consecutive:
            ranks = [list(range(s, s + size)) for s in range(0, self.world, size)]
        else:
            ranks = [list(range(o, self.world, stride)) for o in range(stride)]
        return ranks, stride

    def fit(self) -> HardwareProfile:
        if self.cache is not None:
            hit = self.cache.load("hardware", self.key())
            if isinstance(hit, HardwareProfile):
                return hit
        links: dict[str, LinkFit] = {}
        sizes = divisors(self.world)[1:]  # every group size but 1
        for size in sizes:
            for consecutive in ((True,) if size == self.world else (True, False)):
                ranks, stride = self._groups(size, consecutive)
                groups = [dist.new_group(r) for r in ranks]  # every rank creates every group, in order
                mine = next(g for g, r in zip(groups, ranks) if self.rank in r)
                intra = size * stride <= self.gpus_per_node
                for op in COLLECTIVES:
                    _progress(f"{op} group {size} {'consec' if consecutive else 'strided'}", self.progress)
                    pts = []
                    for nbytes in self.sizes:
                        n = max(size, nbytes // 4 // size * size)
                        buf = torch.ones(n, device=self.device)
                        out = [torch.empty(n // size, device=self.device) for _ in range(size)]
                        fn = {"allreduce": lambda: dist.all_reduce(buf, group=mine),
                              "allgather": lambda: dist.all_gather(out, buf[: n // size], group=mine),
                              "reducescatter": lambda: _reduce_scatter(out[0], buf, size, mine),
                              "alltoall": lambda: _all_to_all(buf, size, mine)}[op]
                        factor = 2 * (size - 1) / size if op == "allreduce" else (size - 1) / size
                        pts.append((factor * n * 4, self._time(fn)))
                    links[link_key(op, size, consecutive, intra)] = LinkFit.fit(pts)
                dist.barrier()  # then free the group: an idle gloo group's thread would slow the next measurements
                dist.destroy_process_group(mine)  # (the other entries are non-member placeholders)
        p2p = {}
        if self.world >= 2:
            _progress("p2p", self.progress)
            pts = []
            for nbytes in self.sizes:
                buf = torch.ones(nbytes // 4, device=self.device)
                pts.append((nbytes, self._time(lambda: _pingpong(buf, self.rank)) / 2))
            p2p["intra" if self.world <= self.gpus_per_node else "inter"] = LinkFit.fit(pts)
        buf = torch.ones(1 << 22, device=self.device)  # 16 MiB: a gradient bucket's size (4 MiB read 1.0-5.3 per round)
        overlap = self._overlap("all-reduce", lambda op: dist.all_reduce(buf, async_op=op))
        # an FSDP2 unit's all-gather of 16 MiB (each rank's 1/world of it in, the whole out), as its async unshard
        shard = torch.ones((1 << 22) // self.world, device=self.device)
        gathered = torch.empty(shard.numel() * self.world, device=self.device)
        gather_overlap = self._overlap("all-gather", lambda op: dist.all_gather_into_tensor(gathered, shard,
                                                                                            async_op=op))
        # FSDP2 and DTensor issue collectives on a side CUDA stream; on CPU they run inline (no overlap)
        prof = HardwareProfile(max(1, self.world // self.gpus_per_node), min(self.gpus_per_node, self.world),
                               self.device_memory_bytes, links, p2p, overlap, 0.0, name=f"profiled:{dist.get_backend()}",
                               async_collectives=self.device.type == "cuda", gather_overlap_slowdown=gather_overlap)
        if self.cache is not None and self.rank == 0:
            self.cache.save("hardware", self.key(), prof)
        return prof

    def _overlap(self, what: str, collective: Callable[[bool], Any]) -> float:
        """Galvatron's overlap coefficient (VLDB'23, Sec. 3.3), measured as the cost model uses it: ``s`` such that
        a compute phase of ``t_c`` beside a collective of ``t_m`` (``collective(async_op)``: an all-reduce for
        ``overlap_slowdown``, an all-gather for ``gather_overlap_slowdown``) takes ``max + (s - 1) * min``
        (:func:`~lightning_galv.planner.cost.overlap_slowdown_from`, the inverse of ``cost.overlapped``).

        Why this estimator (hardware cache v3): the one before took ``t_both / max(t_c, t_m)``, which equals
        ``overlapped``'s ``s`` only when ``t_c == t_m`` and otherwise reads low -- at ``t_c = 2 t_m`` a serial
        pair gave 1.5 where ``overlapped`` needs 2 -- so a profile's ``s`` moved with how long 20 matmuls
        happened to take next to one all-reduce (1.25-2.47 over the 20 profiles of the a0545da accuracy run).
        Here the compute is sized to last about as long as the all-reduce, where the inverse is least sensitive
        to noise, and compute alone, the all-reduce alone and both together are timed interleaved over rounds
        (a slow spell of a shared host touches one sample of each), each pass from a barrier, its slowest
        rank's time; ``s`` is the median of the rounds' values."""
        _progress(f"overlap coefficient ({what})", self.progress)
        a = torch.randn(256, 256, device=self.device)
        t_m = self._time(lambda: collective(False))
        t_one = self._time(lambda: (a @ a, None)[1]) or 1e-9
        reps = max(1, min(10_000, round(t_m / t_one)))  # the same on every rank: both times are maxed over ranks

        def compute() -> None:
            for _ in range(reps):
                a @ a

        def both() -> None:
            w = collective(True)
            compute()
            w.wait()

        runs = [compute, lambda: collective(False), both]
        rounds = max(15, self.repeats)
        rec = []
        for r in range(rounds + 1):  # round 0 warms up
            row = [0.0] * len(runs)
            for i in [(r + k) % len(runs) for k in range(len(runs))]:
                dist.barrier()
                t0 = time.perf_counter()
                runs[i]()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                row[i] = time.perf_counter() - t0
            if r > 0:
                rec.append(_max_over_ranks(row, self.device))  # [compute, all-reduce, both]: slowest rank each
        return statistics.median(overlap_slowdown_from(c, m, b) for c, m, b in rec)


class _MatmulProbe(nn.Module):
    """One bias-free linear layer of a block's FFN shape (``hidden -> ffn_hidden``), timed forward and backward
    (input and weight gradients: 6 FLOPs per weight and token) in the rounds that time the block variants.

    Why: ``ModelProfile.with_width`` carries a block's time to another width. Taking all of it as proportional to
    FLOPs over-priced widening and under-priced narrowing on CPU (costmodel_accuracy.py at b2ebb39, 2 ranks: width
    384 +5.5 % and +10.0 %, width 192 -7.0 %, the last in all 10 launches), while a matmul's rate barely moves with
    its size here (105-110 GFLOP/s on one core from 64 to 768 wide): the block's time is matmul work plus work
    that grows with the width only (norms, activations, residuals, softmax). The rate measured here splits the
    two. Timed beside the variants, so a slow spell touches both alike; its wall time, slowest rank, as theirs."""

    KEY = "matmul"

    def __init__(self, hidden: int, ffn_hidden: int, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, ffn_hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))  # [b, s, hidden] -> [b, s, ffn_hidden]

    def flops(self, tokens: int) -> float:
        """Forward + backward FLOPs at ``tokens`` tokens: 2 per weight and token forward, 4 backward."""
        return 6.0 * tokens * self.proj.weight.numel()


class _AttentionProbe(nn.Module):
    """A copy of a block's core attention (the submodule its ``galv_attention`` names, called ``core(q, k, v)`` on
    ``[b, s, heads, head_dim]``), fed from the timer's ``[b, s, hidden]`` input cut into ``pieces`` shorter
    sequences: ``[b * pieces, s / pieces, hidden]`` -- the same tokens over a ``pieces`` times shorter span.

    Why: ``LayerTypeProfile.span_factor`` carries a block's time to another sequence length, and only the
    attention's work per token grows with the span. Timed whole at two spans over the same tokens, the core
    attention's difference is that growth (RoPE, the head copies and the kernel's per-row work cancel); timing
    the whole block at two spans would leave the same few-percent difference inside the block's own noise.
    Timed in the rounds that time the block variants (every rank busy), as :class:`_MatmulProbe`."""

    def __init__(self, core: nn.Module, heads: int, kv_heads: int, head_dim: int, pieces: int) -> None:
        super().__init__()
        self.core, self.heads, self.kv_heads, self.head_dim, self.pieces = core, heads, kv_heads, head_dim, pieces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        x = x.reshape(b * self.pieces, s // self.pieces, -1)  # [b * pieces, s / pieces, hidden]
        q = x[..., : self.heads * self.head_dim].unflatten(-1, (self.heads, self.head_dim))  # [b', s', heads, d]
        kv = x[..., : self.kv_heads * self.head_dim].unflatten(-1, (self.kv_heads, self.head_dim))  # [b', s', kv, d]
        return self.core(q, kv, kv)


def span_share(whole_s: float, halves_s: float, block_s: float) -> float:
    """Share of a block pass's time that grows in proportion to the sequence length, from its core attention
    timed over the same tokens at the full span (``whole_s``) and at half of it (``halves_s``), and the block's
    own pass (``block_s``) at those tokens: per token the attention takes ``a + c * s``, so ``c * s`` -- what
    doubling the span adds -- is twice the difference. Clamped to [0, 0.9] (noise can invert a tiny difference)."""
    if not block_s > 0:
        return 0.0
    return min(0.9, max(0.0, 2.0 * (whole_s - halves_s) / block_s))


def rounds_within_budget(round_s: float, budget_s: float, least: int, most: int) -> int:
    """Timed rounds for an interleaved profile whose rounds take ``round_s`` seconds each: as many as fit in
    ``budget_s``, but at least ``least`` and at most ``most``.

    Why a budget rather than a fixed count: the median over rounds is what a profiled entry is worth, and its
    noise falls with the rounds taken, while their cost is the block's. A fixed count either wastes time on a
    large block or leaves a small one noisy: at 4 rounds one plan of the MoE accuracy benchmark (decoder dim 128,
    2 ranks) was predicted at 56-92 ms across fresh profiles (benchmarks/RESULTS.md, section costmodel_moe, at
    bc8c2c3); with 20 s its 2-rank profiles took 13 [9, 16] rounds, the dense model's (dim 256) 8 [7, 9], and
    both models' 4-rank profiles 5 (the runs at 7d8f6cb and 54ac423). On a GPU a round of a real block is
    milliseconds, so the budget buys the upper bound."""
    for name, v in (("round_s", round_s), ("budget_s", budget_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise bad_value(f"{name}={v!r}", "must be a finite number of seconds > 0",
                            "e.g. time_budget_s=20.0, or None for a fixed number of rounds.")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (least, most)) or not 1 <= least <= most:
        raise bad_value(f"least={least!r}, most={most!r}", "rounds: ints with 1 <= least <= most",
                        "e.g. repeats=4, max_repeats=16.")
    return max(least, min(most, int(budget_s / round_s)))


def _max_over_ranks(values: Sequence[float], device: str | torch.device = "cpu") -> list[float]:
    """Elementwise largest of ``values`` over the default group's ranks (one all-reduce on ``device``: NCCL
    reduces CUDA tensors only); ``values`` itself without a process group."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.cpu()]


def _slowest_rank_medians(rec: list[list[tuple[float, float, float, float]]], device: str | torch.device = "cpu"
                          ) -> list[tuple[float, float, float, float]]:
    """Per entry of ``rec`` (its rounds' (forward wall, backward wall, forward CPU, backward CPU) on this rank):
    in every round the record of the rank whose forward + backward wall was longest, then each field's median
    over the rounds -- the same on every rank (one all-gather, on ``device``: NCCL gathers CUDA tensors only). See
    :meth:`ShardedLayerProfiler._time_interleaved`."""
    if not rec:
        return []
    rounds = len(rec[0])
    if any(len(r) != rounds for r in rec):
        raise ValueError(f"timed rounds per entry: {[len(r) for r in rec]}; every entry needs the same count. "
                         "HINT: time every entry once per round (ShardedLayerProfiler._time_interleaved).")
    mine = torch.tensor(rec, dtype=torch.float64, device=device)  # [entries, rounds, 4]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        allr = torch.stack(every)  # [world, entries, rounds, 4]
    else:
        allr = mine.unsqueeze(0)
    slowest = (allr[..., 0] + allr[..., 1]).argmax(dim=0)  # [entries, rounds]: the rank whose pass took longest
    idx = slowest[None, :, :, None].expand(1, *allr.shape[1:])
    per_round = allr.gather(0, idx)[0]  # [entries, rounds, 4]
    per_round = per_round.cpu()
    return [tuple(statistics.median(per_round[e, :, k].tolist()) for k in range(4)) for e in range(len(rec))]  # type: ignore[misc]


def _reduce_scatter(out: torch.Tensor, buf: torch.Tensor, size: int, group: object) -> None:
    # no fallback: timing an all-reduce under the name "reducescatter" would corrupt the profile
    # (gloo, NCCL and MPI all provide it in torch 2.13; reduce_scatter_tensor is its deprecated name)
    dist.reduce_scatter_single(out, buf, group=group)


def _all_to_all(buf: torch.Tensor, size: int, group: object) -> None:
    out = torch.empty_like(buf)
    dist.all_to_all_single(out, buf, group=group)


def _pingpong(buf: torch.Tensor, rank: int) -> None:
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    elif rank == 1:
        dist.recv(buf, 0)
        dist.send(buf, 0)
