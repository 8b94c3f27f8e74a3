"""How unevenly real data routes over expert-parallel ranks (imports torch).

The ShardedLayerProfiler times an MoE block on random hidden states, which an untrained router spreads nearly
evenly over the experts, so the block fits price balanced routing. Training data does not route evenly, and under
expert parallelism the busiest rank of an EP group sets its pace (the others wait for it in the combine
all-to-all). :func:`measure_routing_skew` routes one real global batch through the model's MoE layers and returns
what ``ModelProfile.with_routing_skew`` / ``MoELayerFacts.routing_skew`` take: per EP degree, the busiest rank's
routed copies over its group's mean, placed as the runtime places them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import bad_value


def skew_of(counts: list[list[int]], ep: int, shards: int) -> float:
    """Busiest EP rank's routed copies over its group's mean, the worst EP group: ``counts[sample][expert]`` of a
    global batch cut into ``shards`` equal data shards, EP groups of ``ep`` consecutive shards (as
    ``RankLayout.expert_grid`` forms them), rank r of a group owning experts [r E/ep, (r+1) E/ep) (as
    ``parallel.expert``'s dispatcher places them)."""
    e = len(counts[0])
    per_shard = len(counts) // shards
    worst = 0.0
    for g in range(shards // ep):
        rows = counts[g * ep * per_shard:(g + 1) * ep * per_shard]
        per_expert = [sum(c[x] for c in rows) for x in range(e)]
        loads = [sum(per_expert[r * e // ep:(r + 1) * e // ep]) for r in range(ep)]
        total = sum(loads)
        worst = max(worst, max(loads) / (total / ep) if total else 1.0)
    return worst


def routed_counts(model: nn.Module, run: Callable[[], Any], samples: int) -> list[list[list[int]]]:
    """Routed copies per expert of each sample, per MoE layer: ``[layer][sample][expert]``, from one ``run()`` of
    the model's forward on a batch of ``samples`` samples (no gradient; no capacity applied, so it does not depend
    on the plan). The layers' ``route`` is spied on for the call and restored after."""
    from ..models.moe import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise bad_value(f"{type(model).__name__}", "has no MoELayer to route through",
                        "measure the routing skew of an MoE model (lightning_galv.models.MoEDecoder, HF Mixtral).")
    caught: list[torch.Tensor] = []
    own = {id(layer): layer.__dict__["route"] for layer in layers if "route" in layer.__dict__}  # restored after
    for layer in layers:
        route = layer.route

        def spy(x: torch.Tensor, route: Callable = route) -> Any:
            out = route(x)
            caught.append(out[3].detach())  # [T, k] expert ids, tokens row-major over (sample, position)
            return out

        layer.route = spy  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            run()
    finally:
        for layer in layers:
            del layer.route  # the class's method again, or the instance's own
            if id(layer) in own:
                layer.route = own[id(layer)]  # type: ignore[method-assign]
    if len(caught) != len(layers):
        raise bad_value(f"{len(caught)} routings for {len(layers)} MoE layers", "run() must call the model's "
                        "forward exactly once", "pass e.g. lambda: model(tokens).")
    out = []
    for layer, ids in zip(layers, caught):
        if ids.numel() % samples:
            raise bad_value(f"{ids.shape[0]} routed tokens", f"not a whole number per sample of {samples}",
                            "pass the sample count of the batch run() feeds the model.")
        rows = ids.reshape(samples, -1)  # [samples, tokens per sample x k]
        out.append([torch.bincount(r, minlength=layer.num_experts).tolist() for r in rows])
    return out


def measure_routing_skew(model: nn.Module, run: Callable[[], Any], samples: int, data_shards: int,
                         ep_degrees: tuple[int, ...] | None = None) -> dict[int, float]:
    """{ep: busiest rank's routed copies over the mean}, averaged over the model's MoE layers, for one global batch.

    ``run()`` runs the model's forward on one global batch of ``samples`` samples (no gradient needed; e.g.
    ``lambda: model(tokens)``); ``data_shards``: how many data shards the plans split it into (the data-parallel
    ranks; a plan's EP groups take consecutive shards). ``ep_degrees``: default every degree >= 2 that divides
    both the shards and the experts. Routing does not depend on the plan (no capacity is applied here), so one
    process suffices. The mean over layers is what the cost model needs: each layer adds (skew - 1) of its work.
    """
    if samples < 1 or data_shards < 1 or samples % data_shards:
        raise bad_value(f"samples={samples}, data_shards={data_shards}", "the shards must split the batch evenly",
                        "pass the global batch's sample count and a data-shard count that divides it.")
    counts = routed_counts(model, run, samples)
    experts = [len(layer[0]) for layer in counts]
    degrees = ep_degrees if ep_degrees is not None else tuple(
        e for e in range(2, data_shards + 1) if data_shards % e == 0 and all(n % e == 0 for n in experts))
    for e in degrees:
        if e < 2 or data_shards % e or any(n % e for n in experts):
            raise bad_value(f"ep={e}", f"must be >= 2 and divide the {data_shards} data shards and every MoE "
                            "layer's experts", "pick ep_degrees from the plans' expert-parallel degrees.")
    return {e: statistics.fmean(skew_of(c, e, data_shards) for c in counts) for e in degrees}
