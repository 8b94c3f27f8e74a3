"""Data parallelism and ZeRO 1/2/3 for one unit (block, embedding, head) of a plan.

* ZeRO-2/3: FSDP2 ``fully_shard`` on the unit's data-parallel mesh, ``reshard_after_forward`` False/True
  (ZeRO, Rajbhandari et al. SC'20: stage 2 shards gradients+optimizer state, stage 3 also parameters).
* ZeRO-0/1: parameters stay replicated; :class:`GradientSync` sums their gradients over the unit's
  data group in each backward that syncs (the last of a step under accumulation; bucketed, overlapped with backward
  when pp = 1). ZeRO-1 additionally gives each parameter one owner in
  its group (:class:`OptimizerStateSharding`): only the owner keeps optimizer state and updates it,
  then broadcasts the new value.

Gradient scale. Layers of one plan may split the batch ``dp`` ways with different ``dp``; the loss each
rank back-propagates is the mean over the shard the data loader gave it (``plan.data_parallel_size``
shards). Summing a layer's gradient over its data group and dividing by ``data_parallel_size`` (not by
the layer's own ``dp``) therefore gives every layer the gradient of the global mean loss.

:class:`GradientSync` splits that division so a sync can be repeated: each incoming gradient is scaled by
``k / data_parallel_size`` (``k`` its group's size; only where they differ) before autograd accumulates it, and
a sync averages over the group (divides by ``k``). An average of what the group already agrees on -- gradients
synced by an earlier backward of the same step -- leaves it unchanged, as in DDP, so two synced backwards
before one optimizer step (manual optimization) add up right; dividing the whole accumulated gradient by
``data_parallel_size`` at each sync shrank the first backward's part again on groups smaller than that.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..plan import LayerStrategy
from ..planner.cost import GRAD_BUCKET_BYTES


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a tensor or DTensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def wrap_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``, this rank's part of a tensor laid out as DTensor ``like`` (same local shape), as a
    DTensor with ``like``'s mesh, placements and global shape; not differentiable.

    Why not ``DTensor.from_local``: that is an autograd function rebuilding the layout, ~100 us per tensor on
    CPU (10 ms for 96 tensors), paid per parameter per step on gradients; here the layout is reused as is."""
    from torch.distributed.tensor import DTensor

    if t.dtype != like.dtype:  # the layout records the dtype: build one for t's
        return DTensor.from_local(t, like.device_mesh, like.placements, run_check=False,  # type: ignore[attr-defined]
                                  shape=like.shape, stride=like.stride())
    return DTensor(t, like._spec, requires_grad=False)  # type: ignore[attr-defined,call-arg]


def apply_fsdp(modules: nn.Module | list[nn.Module], mesh: Any, strategy: LayerStrategy, divide_factor: int,
               mp_policy: Any | None = None, ignored_params: set[nn.Parameter] | None = None) -> None:
    """ZeRO-2/3 for one unit via FSDP2 on its 1-D data mesh.

    Gradients are summed over the mesh and divided by ``divide_factor`` (the loader's dp, see the module
    docstring). On a mesh of one rank (e.g. a tp=4, dp=1 layer in a plan whose other layers are dp=4)
    torch 2.13's FSDP2 divides *twice* when a divide factor is set (``foreach_reduce``: the single-rank
    copy divides by the factor and the post-divide divides again), giving 1/factor of the right
    gradient. Forced sums cause the second division, and a one-rank mesh has no collective to force a
    sum on, so there only the factor is set (FSDP2 then divides exactly once).

    ``ignored_params``: parameters inside ``modules`` that stay outside this state (plain tensors, synced by
    :class:`GradientSync` if at all): routed experts whose expert-data group is one rank (``parallelize``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": strategy.zero == 3}
    kwargs["mp_policy"] = mp_policy or MixedPrecisionPolicy()
    if ignored_params:  # torch only tests membership: parameters outside ``modules`` are harmless
        kwargs["ignored_params"] = set(ignored_params)
    fully_shard(modules, **kwargs)
    fsdp_mod: Any = modules if isinstance(modules, nn.Module) else modules[0]  # a list shares one state
    # sum then divide by the loader's dp (see module docstring); sum-only collectives also run on gloo.
    # On a one-rank data group FSDP2 (torch 2.13) skips the reduce-scatter and divides by the factor
    # itself, then divides again after "the reduction" when sums are forced: the gradient would come out
    # divide_factor times too small. There is no collective to force a sum on, so only the factor is set.
    if mesh.size() > 1:
        fsdp_mod.set_force_sum_reduction_for_comms(True)
    fsdp_mod.set_gradient_divide_factor(float(divide_factor))


def _is_lightning_module(module: nn.Module) -> bool:
    """Whether ``module`` is a LightningModule (checked without importing Lightning: if it is not imported,
    no object can be one)."""
    import sys

    for name in ("lightning.pytorch", "pytorch_lightning"):
        pkg = sys.modules.get(name)
        cls = getattr(pkg, "LightningModule", None) if pkg is not None else None
        if cls is not None and isinstance(module, cls):
            return True
    return False


def _common_container(model: nn.Module, modules: list[nn.Module]) -> nn.Module | None:
    """The innermost module of ``model`` containing every module of ``modules`` whose ``forward`` can run.

    Containers without a forward (``nn.ModuleList``/``ModuleDict``) are skipped upwards: an FSDP2 root's
    pre-forward hook would never fire on them. ``None`` when a module is not inside ``model`` or no
    ancestor has a forward."""
    names: dict[int, str] = {id(m): n for n, m in model.named_modules()}
    paths: list[list[str]] = []
    for m in modules:
        if id(m) not in names:
            return None
        paths.append(names[id(m)].split(".") if names[id(m)] else [])
    prefix: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    while True:
        container = model.get_submodule(".".join(prefix))
        if type(container).forward is not nn.Module.forward:
            return container
        if not prefix:
            return None
        prefix.pop()


def shared_root_container(model: nn.Module, modules: list[nn.Module]) -> nn.Module | None:
    """Where the ZeRO-2/3 ``modules`` of a ``pp == 1`` plan get their shared FSDP2 root, or ``None`` when
    they keep one root each.

    The root is the innermost module containing them all (see :func:`_common_container`). ``None`` when
    there are fewer than two modules, when that module is one of them or already has an FSDP state
    (nothing to share), or when it is the model handed to ``parallelize`` and that is a LightningModule:
    ``fully_shard`` swaps the object's class, and ``GalvatronStrategy.switch_plan`` rebuilds that same
    LightningModule's children and parallelizes it again.
    """
    from torch.distributed.fsdp import FSDPModule

    if len(modules) < 2:
        return None
    container = _common_container(model, modules)
    if container is None or isinstance(container, FSDPModule) or any(container is m for m in modules):
        return None
    if container is model and _is_lightning_module(model):
        return None
    return container


def apply_shared_root(container: nn.Module, units: list[nn.Module], mesh: Any) -> None:
    """Make ``container`` the FSDP2 root of the units' states (``units``: the modules ``apply_fsdp`` sharded
    inside it), managing no parameters itself.

    Why: ``fully_shard`` on sibling modules leaves each one its own root at lazy init, with its own state
    context: no implicit backward prefetch across units (the post-forward order is per root), a root
    pre-forward and a post-backward final callback per unit, and a unit of several modules (final norm +
    head) needs one state per module, since a state over several modules cannot be a root. ``fully_shard``
    on the container (Lightning's FSDP2 recipe does the same on its model) makes it the root and the units
    its children, sharing one context. Everything the units' states do not manage (ZeRO-0/1 units, loose
    parameters: :class:`GradientSync` and :class:`OptimizerStateSharding` keep them) is passed as
    ``ignored_params``, so the root has no parameter group: no collective of its own, nothing for the
    gradient divide factor or forced sums (``apply_fsdp``) to apply to, and the units keep their own
    meshes (children of one root may shard on different data meshes: torch 2.13 runs every collective on
    the parameter group's own process group). ``mesh`` only names the device type and must be valid on
    every rank (the stage's world mesh). The root's mixed-precision policy is the default (no input or
    output casts), so outputs are cast exactly as before, by the units' own policies.

    Lazy init. FSDP2 decides roots at the first forward through a state: if some code ran a unit's forward
    before the container's, that unit would make itself a root and the container's first forward would then
    fail. A one-shot pre-forward hook on every unit therefore initializes the shared root first, whichever
    forward comes first (a unit running alone is then only that forward's "iteration root", which torch
    supports, e.g. for encoder-only evaluation).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    managed = {id(p) for m in container.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    ignored = {p for p in container.parameters() if id(p) not in managed}
    # no parameters: nothing to reshard after forward (an explicit value also keeps lazy init from
    # re-deciding it for the root)
    fully_shard(container, mesh=mesh, reshard_after_forward=False, mp_policy=MixedPrecisionPolicy(),
                ignored_params=ignored)
    state = container._get_fsdp_state()  # type: ignore[operator]
    if state._fsdp_param_groups:
        raise RuntimeError(f"shared FSDP2 root {type(container).__name__} took parameters of its own "
                           "(expected every parameter either in a unit's state or ignored). HINT: this is a "
                           "lightning_galv bug, please report it with the plan and the model.")
    if mesh.device_type == "cpu":
        _overlap_all_gathers(container, units)
    handles: list[Any] = []

    def init_root(*_: Any) -> None:
        if state._is_root is None:  # torch 2.13 FSDPState: None until lazily initialized
            state._lazy_init()
        for h in handles:
            h.remove()
        handles.clear()

    for u in units:
        handles.append(u.register_forward_pre_hook(init_root, prepend=True))


def _overlap_all_gathers(root: nn.Module, units: list[nn.Module]) -> None:
    """CPU: run prefetched all-gathers asynchronously, and prefetch the next unit in forward.

    Why: FSDP2 overlaps a prefetched all-gather with compute through CUDA streams; on CPU its streams are
    no-ops and its default synchronous all-gather blocks the rank, so a prefetch (the shared root's implicit
    one in backward) only moves the wait. With ``async_op`` unshards (torch 2.13's ``_set_unshard_async_op``,
    recursive over the root's states) gloo runs a prefetched all-gather on its own thread while this rank
    computes: unit ``i-1``'s during unit ``i``'s backward (implicit, from the shared post-forward order),
    and, with an explicit forward prefetch (as torchtitan sets), unit ``i+1``'s during unit ``i``'s forward.
    Values are the same all-gathered shards as before (exactness unchanged); every rank issues the same
    collectives in the same order, so ranks agree on each group's sequence. ``units`` come in flow order.
    """
    root._set_unshard_async_op(True)  # type: ignore[operator]
    chain: list[nn.Module] = []
    seen: set[int] = set()
    for u in units:  # one entry per state (final norm + head share one)
        state = u._get_fsdp_state()  # type: ignore[operator]
        if id(state) not in seen:
            seen.add(id(state))
            chain.append(u)
    for cur, nxt in zip(chain, chain[1:]):
        cur.set_modules_to_forward_prefetch([nxt])  # type: ignore[operator]


DEFAULT_BUCKET_BYTES = GRAD_BUCKET_BYTES  # DDP's default bucket_cap_mb; the cost model prices the same buckets


@dataclass
class _Bucket:
    """Gradients reduced by one flat all-reduce: same group, same dtype, neighbours in backward order."""

    group: Any
    size: int
    params: list[nn.Parameter]
    nbytes: int = 0
    numels: list[int] = field(default_factory=list)  # slot sizes: the parameters' local sizes
    offsets: list[int] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)  # id(param) -> slot
    ready: int = 0
    work: Any = None
    flat: torch.Tensor | None = None  # this step's flat gradients (being filled / reduced)
    buffer: torch.Tensor | None = None  # the flat storage kept between steps (the gradients are views of it)
    views: bool = True  # False once a gradient's local size differs from its slot: flatten at launch instead
    # this launch's (offset, numel) of every parameter's gradient in ``flat``, whose last ``len(params)`` elements
    # count the ranks that had each gradient (see GradientSync.sync)
    slots: list[tuple[int, int]] = field(default_factory=list)


def _as_grad_view(p: nn.Parameter, flat_slice: torch.Tensor) -> None:
    """Replace ``p.grad`` by ``flat_slice`` (its values already copied there), keeping a DTensor gradient's
    wrapper (mesh, placements) around the view; the separate gradient tensor is dropped."""
    g = p.grad
    assert g is not None
    view = flat_slice.view_as(local(g))
    p.grad = wrap_like(view, g) if hasattr(g, "to_local") else view


def _move_into_bucket(b: _Bucket, p: nn.Parameter) -> None:
    """Make ``p``'s gradient a view of its slot in the bucket's flat tensor (allocated at the bucket's first
    gradient of the step, or the buffer kept from the last step), copying it there unless it already is one.

    Why (DDP's ``gradient_as_bucket_view``): a bucket launched during backward is reduced in place until
    :meth:`GradientSync.sync` waits for it. With the gradients as separate tensors, flattening at launch would
    hold every replicated gradient twice at the end of backward -- +1x their bytes at the step's peak, +20 %
    for a checkpointed model whose activations are small by then -- and sync would copy them all back. Moved
    one by one as autograd finishes them, the flat tensor is their only storage (at most one gradient is
    briefly held twice), the all-reduce sums them in place, and nothing is copied back."""
    g = p.grad
    if g is None or not b.views:
        return
    i = b.index[id(p)]
    g_local = local(g)
    if g_local.numel() != b.numels[i]:
        b.views = False  # a gradient laid out unlike its parameter: this bucket flattens at launch from now on
        return
    if b.flat is None:
        reuse = b.buffer is not None and b.buffer.dtype == g_local.dtype and b.buffer.device == g_local.device
        b.flat = b.buffer if reuse else torch.empty(sum(b.numels) + len(b.params), dtype=g_local.dtype,
                                                     device=g_local.device)  # + one presence count per gradient
    slot = b.flat[b.offsets[i]:b.offsets[i] + b.numels[i]]
    if g_local.data_ptr() != slot.data_ptr():  # accumulated into the view already: nothing to move
        slot.copy_(g_local.reshape(-1))
        _as_grad_view(p, slot)


@dataclass
class GradientSync:
    """Sums replicated (ZeRO-0/1) gradients over each unit's data group, divided by the loader's dp.

    Gradients are reduced in buckets of about ``bucket_bytes``, formed per data group in reverse flow order
    (:meth:`set_flow_order`; registration order by default), so buckets fill in backward order, as DDP's
    do. With :meth:`overlap_backward` a bucket's all-reduce starts, asynchronously, as soon as its last gradient is
    accumulated in the syncing backward, while backward goes on; :meth:`sync` then only waits. Buckets are
    launched strictly in one list order on every rank (a bucket that is ready early waits for its
    predecessors), so ranks issue their collectives in one order whatever order autograd finishes gradients
    in -- on each group, and across the groups a rank shares with others (NCCL can deadlock when ranks start
    collectives on two communicators in different orders).

    Why the list interleaves the groups in backward order (the bucket whose gradient earliest in the forward
    flow comes latest in backward goes last; see :meth:`set_flow_order`) rather than group after group: a
    plan with several data groups
    (layers with different data degrees, MoE experts and their dense neighbours) would otherwise launch no
    later group's bucket until the first group's last bucket is full -- the one holding the embedding, whose
    gradient comes at the very end of backward -- and nothing of those groups would overlap backward. This
    assumes the ranks of a stage run the same backward graph (the built-in MoE runs every local expert, even
    on no tokens): a bucket then starts between the same tensor-parallel / all-to-all collectives everywhere.
    """

    divide_factor: int
    groups: dict[Any, list[nn.Parameter]] = field(default_factory=lambda: defaultdict(list))
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    enabled: bool = True  # False on the non-final micro-batches of an accumulation (no sync, no launch)
    _buckets: list[_Bucket] | None = None
    _bucket_of: dict[int, _Bucket] = field(default_factory=dict)
    _next: int = 0  # buckets launched so far in this backward
    _hooks: list[Any] = field(default_factory=list)
    _flow: dict[int, int] = field(default_factory=dict)  # id(param) -> forward-flow index (all groups)

    def add(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, group_size: int) -> None:
        """Sync ``params`` over ``group`` (``group_size`` ranks); on a group of another size than
        ``divide_factor`` their incoming gradients are scaled by ``group_size / divide_factor`` (module doc)."""
        if self._buckets is not None:
            raise RuntimeError("GradientSync.add after buckets were formed. HINT: register every unit before the "
                               "first backward (parallelize() does).")
        scale = group_size / self.divide_factor
        for p in params:
            if p.requires_grad:
                self.groups[(group, group_size)].append(p)
                self._flow.setdefault(id(p), len(self._flow))  # registration order unless set_flow_order
                if group_size != self.divide_factor:
                    self._hooks.append(p.register_hook(functools.partial(_scaled, scale=scale)))

    def set_flow_order(self, params: Iterable[nn.Parameter]) -> None:
        """The order the forward uses the parameters in, which the bucket list follows backwards (units in
        flow order, each unit's parameters in module order). Why not the registration order: a MoE unit
        registers its experts (own group) before its attention (the block's group), but backward finishes the
        experts first. Call before :meth:`add`, with the same order on every rank."""
        if self.groups:
            raise RuntimeError("GradientSync.set_flow_order after add. HINT: set the order before registering units.")
        self._flow = {}
        for p in params:
            self._flow.setdefault(id(p), len(self._flow))

    def buckets(self) -> list[_Bucket]:
        """Formed once, identically on every rank of a group (same flow order), and ordered as backward
        fills them (see the class doc)."""
        if self._buckets is None:
            self._buckets = []
            for (group, size), params in self.groups.items():
                current: dict[torch.dtype, _Bucket] = {}
                for p in sorted(params, key=lambda p: -self._flow[id(p)]):  # backward order
                    dt = local(p).dtype
                    b = current.get(dt)
                    if b is None or b.nbytes >= self.bucket_bytes:
                        b = current[dt] = _Bucket(group, size, [])
                        self._buckets.append(b)
                    b.index[id(p)] = len(b.params)
                    b.offsets.append(sum(b.numels))
                    b.numels.append(local(p).numel())
                    b.params.append(p)
                    b.nbytes += local(p).numel() * local(p).element_size()
                    self._bucket_of[id(p)] = b
            # a bucket is full when its gradient earliest in the flow arrives: the later that comes in
            # backward, the later in the list. Stable; the order it puts one group's buckets in depends only on
            # the flow order of that group's parameters, which its ranks share (same units, same modules).
            self._buckets.sort(key=lambda b: -min(self._flow[id(p)] for p in b.params))
        return self._buckets

    def overlap_backward(self) -> None:
        """Start each bucket's all-reduce during backward (post-accumulate-grad hooks; see the class doc)."""
        for b in self.buckets():
            if b.size == 1:
                continue  # nothing to reduce: the scaling hook did the division already
            for p in b.params:
                # through a weak reference: a hook lives in C++ on the parameter, where the garbage collector
                # cannot see it, so a bound method would make sync -> params -> hook -> sync a cycle nobody
                # frees (and with it every mesh and gloo thread of the model, once the Trainer is gone)
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    functools.partial(_grad_ready_weak, weakref.ref(self))))

    def _grad_ready(self, p: torch.Tensor) -> None:  # via _grad_ready_weak
        if not self.enabled:
            return
        b = self._bucket_of[id(p)]
        with torch.no_grad():
            _move_into_bucket(b, p)
        b.ready += 1
        buckets = self.buckets()
        while self._next < len(buckets) and (buckets[self._next].size == 1
                                             or buckets[self._next].ready >= len(buckets[self._next].params)):
            self._launch(buckets[self._next])
            self._next += 1

    @staticmethod
    def _launch(b: _Bucket) -> None:
        if b.size == 1 or b.work is not None:
            return
        with torch.no_grad():
            for p in b.params:  # those autograd finished outside the hooks (pipelines: every one)
                _move_into_bucket(b, p)
            if b.views and b.flat is not None:
                for p, o, n in zip(b.params, b.offsets, b.numels):
                    if p.grad is None:  # no gradient on this rank: zeros, so every rank's layout is the same
                        b.flat[o:o + n].zero_()
                b.slots = list(zip(b.offsets, b.numels))
            else:  # a gradient's local shard differs from its parameter's (or none has one): flatten them
                parts = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in b.params]
                b.flat = torch.cat([t.reshape(-1) for t in parts] + [parts[0].new_empty(len(parts))])
                offset = 0
                b.slots = []
                for p, t in zip(b.params, parts):
                    if p.grad is not None:
                        _as_grad_view(p, b.flat[offset:offset + t.numel()])
                    b.slots.append((offset, t.numel()))
                    offset += t.numel()
                del parts
            n = len(b.params)
            b.flat[-n:] = torch.tensor([float(p.grad is not None) for p in b.params], dtype=b.flat.dtype)
            b.work = dist.all_reduce(b.flat, group=b.group, async_op=True)

    @torch.no_grad()
    def sync(self) -> None:
        buckets = self.buckets()
        for b in buckets[self._next:]:  # not (all) launched during backward: in index order now
            self._launch(b)
        for b in buckets:
            if b.size == 1:
                continue  # scaled as autograd produced them: nothing left to do
            assert b.work is not None and b.flat is not None
            b.work.wait()
            b.flat.div_(b.size)  # the group's average (gradients are views of it: reduced in place)
            if any(p.grad is None for p in b.params):  # (reading the counts waits for the device: only then)
                counts = b.flat[-len(b.params):].tolist()
                for p, (o, n), c in zip(b.params, b.slots, counts):
                    # a parameter unused on this rank but used on another (a model that skips an expert without
                    # tokens, a branch taken on some ranks only): it takes the reduced gradient like its replicas,
                    # which would otherwise step without it here and drift apart; unused on every rank: stays None
                    if p.grad is None and c > 0:
                        view = b.flat[o:o + n].view_as(local(p))
                        p.grad = wrap_like(view, p) if hasattr(p, "to_local") else view
            if b.views:
                b.buffer = b.flat  # kept: next step's gradients move into it (or accumulate in it, if kept)
            b.work = b.flat = None
            b.ready = 0
        self._next = 0


def _grad_ready_weak(sync_ref: "weakref.ref[GradientSync]", p: torch.Tensor) -> None:
    """Post-accumulate-grad hook of an overlapped bucket parameter (see :meth:`GradientSync.overlap_backward`)."""
    sync = sync_ref()
    if sync is not None:
        sync._grad_ready(p)


def _scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """``grad * scale`` (a tensor hook: autograd accumulates what it returns); a DTensor's local part is scaled
    and rewrapped in its own layout (no sharding propagation, see :func:`wrap_like`)."""
    if hasattr(grad, "to_local"):
        return wrap_like(local(grad) * scale, grad)
    return grad * scale


@dataclass
class OptimizerStateSharding:
    """ZeRO-1: each replicated parameter has one owner rank (global rank) in its data group."""

    owner: dict[nn.Parameter, tuple[int, Any]] = field(default_factory=dict)  # param -> (owner, group)

    def add(self, params: list[nn.Parameter], ranks: list[int], group: dist.ProcessGroup) -> None:
        """Greedy balance by element count (largest first), deterministic on every rank."""
        load = {r: 0 for r in ranks}
        order = sorted(range(len(params)), key=lambda i: (-local(params[i]).numel(), i))
        for i in order:
            r = min(load, key=lambda k: (load[k], k))
            load[r] += local(params[i]).numel()
            self.owner[params[i]] = (r, group)

    def owns(self, p: nn.Parameter) -> bool:
        return self.owner.get(p, (dist.get_rank(), None))[0] == dist.get_rank()

    def wrap(self, optimizer: torch.optim.Optimizer) -> None:
        """Patch ``optimizer.step`` so only owners update, then owners broadcast (any torch optimizer)."""
        if not self.owner or getattr(optimizer, "_galv_zero1", False):
            return
        inner_step = optimizer.step
        sharding = self

        def step(self: torch.optim.Optimizer, closure: Any = None, **kwargs: Any) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()  # forward, backward, gradient sync and clipping happen in here
            saved = {}
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p in sharding.owner and not sharding.owns(p):
                        saved[p], p.grad = p.grad, None  # torch optimizers skip params without grad
            inner_step(**kwargs)
            for p, g in saved.items():
                p.grad = g
            sharding.broadcast()
            return loss

        # a bound method, as torch's LR schedulers expect when they wrap ``step`` (created after this, too)
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        optimizer._galv_zero1 = True  # type: ignore[attr-defined]
        optimizer._galv_inner_step = inner_step  # type: ignore[attr-defined]

    @contextmanager
    def unsharded_steps(self, optimizers: list[torch.optim.Optimizer]) -> Iterator[None]:
        """Let every rank step every parameter (DCP builds optimizer-state templates with a fake step)."""
        patched = [o for o in optimizers if getattr(o, "_galv_zero1", False)]
        saved = [o.step for o in patched]
        for o in patched:
            o.step = o._galv_inner_step  # type: ignore[attr-defined,method-assign]
        try:
            yield
        finally:
            for o, st in zip(patched, saved):
                o.step = st  # type: ignore[method-assign]

    @torch.no_grad()
    def broadcast(self) -> None:
        """Owners send their updated parameters: one broadcast per (group, owner, dtype) of the parameters
        flattened together. One per parameter paid a collective's latency, and the wait for the slowest rank,
        dozens of times per step (2 CPU ranks: ZeRO-1's step took 8 ms longer than ZeRO-0's for 39 tensors)."""
        runs: dict[tuple[int, int, torch.dtype, torch.device], tuple[Any, list[torch.Tensor]]] = {}
        for p, (owner, group) in self.owner.items():  # the same order on every rank: registration order
            t = local(p.data)
            runs.setdefault((id(group), owner, t.dtype, t.device), (group, []))[1].append(t)
        me = dist.get_rank()
        for (_, owner, dtype, device), (group, tensors) in runs.items():
            if len(tensors) == 1:
                dist.broadcast(tensors[0], src=owner, group=group)
                continue
            sizes = [t.numel() for t in tensors]
            flat = (torch.cat([t.reshape(-1) for t in tensors]) if owner == me
                    else torch.empty(sum(sizes), dtype=dtype, device=device))  # [sum of numels]
            dist.broadcast(flat, src=owner, group=group)
            if owner != me:
                for t, piece in zip(tensors, flat.split(sizes)):
                    t.copy_(piece.view_as(t))

    def consolidate(self, optimizer: torch.optim.Optimizer) -> None:
        """Give every rank the optimizer state of every parameter (before saving a checkpoint).

        Tensors travel as rank-local buffers by ``broadcast`` and are re-wrapped on arrival in the layout the
        owner's state has (a pickled DTensor would carry the sender's process-group names). That layout is the
        state's own, not the parameter's: a state the optimizer built through DTensor's dispatch (a gradient laid
        out unlike its parameter, e.g. replicated) has the gradient's placements and global shape; wrapping it in
        the parameter's would make each rank's full copy a shard (a tensor twice its size, which DCP refused).
        The owner and the receivers share the parameter's mesh (one data group of the same tp layout).
        """
        ids = {id(q) for g in optimizer.param_groups for q in g["params"]}
        for p, (owner, group) in self.owner.items():
            if id(p) not in ids:
                continue
            me = dist.get_rank() == owner
            state = optimizer.state.get(p, {}) if me else {}
            meta: list[Any] = [None]
            if me:
                meta[0] = {k: (("tensor", tuple(local(v).shape), local(v).dtype,
                                (tuple(v.placements), tuple(v.shape), tuple(v.stride())) if hasattr(v, "to_local")
                                else None)
                               if isinstance(v, torch.Tensor) and (hasattr(v, "to_local") or v.numel() > 1)
                               else ("obj", v)) for k, v in state.items()}
            dist.broadcast_object_list(meta, src=owner, group=group)
            received: dict[str, Any] = {}
            for k, m in meta[0].items():
                if m[0] == "obj":  # python values and scalar tensors (e.g. Adam's step) travel pickled
                    received[k] = m[1]
                    continue
                _, shape, dtype, layout = m
                buf = local(state[k]).contiguous() if me else torch.empty(shape, dtype=dtype, device=local(p).device)
                dist.broadcast(buf, src=owner, group=group)
                if not me:
                    if layout is not None:
                        from torch.distributed.tensor import DTensor

                        placements, global_shape, stride = layout
                        buf = DTensor.from_local(buf, p.device_mesh, placements, run_check=False,  # type: ignore[attr-defined]
                                                 shape=torch.Size(global_shape), stride=stride)
                    received[k] = buf
            if not me and received:
                optimizer.state[p] = received

    def reshard(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the state of parameters this rank does not own (after loading a checkpoint)."""
        for p in list(optimizer.state):
            if p in self.owner and not self.owns(p):
                del optimizer.state[p]
