"""Pictures of a plan and of what the cost model predicts for it (PNG files; also callable from Python).

Why pictures: a hybrid plan is a table of per-layer degrees whose meaning -- which ranks hold which shard of
which layer, where the pipeline waits -- is spatial. Four figures, each a function that returns the
matplotlib ``Figure`` and writes a PNG when given a path:

* :func:`plan_diagram` -- units (embedding, blocks, head) x ranks, coloured by strategy, each cell labelled
  with the rank's tensor-parallel and data-parallel index, pipeline stages as bands;
* :func:`pipeline_timeline` -- the schedule (GPipe or 1F1B) of one step per stage, drawn from the cost model's
  per-micro-batch stage times (or from measured ones), with the per-step tail (gradient sync, optimizer);
* :func:`measured_timeline` -- the same picture from what a run did: the online profiler's record of every
  micro-batch's forward and backward on every stage of a sampled step;
* :func:`cost_breakdown` -- per unit the predicted forward, backward (recompute included) and per-step time;
* :func:`tuner_scatter` -- the tuner's trials, predicted vs measured throughput.

matplotlib is optional (``pip install "lightning_galv[plots]"``); it is imported on first use, with the Agg
backend (no display needed). Nothing here imports ``torch.distributed`` or Lightning.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .errors import bad_value
from .layout import RankLayout
from .plan import LayerStrategy, ParallelPlan

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from .planner.cost import CostModel, PlanCost

FWD_SHARE = 1.0 / 3.0  # forward : backward = 1 : 2 when only a micro-batch's total is known (Narayanan et al. SC'21)


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a cluster node
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("lightning_galv.plots needs matplotlib. HINT: pip install \"lightning_galv[plots]\" "
                          "(or pip install matplotlib).") from exc
    return plt


def _save(fig: "Figure", path: str | Path | None) -> "Figure":
    if path is not None:
        p = Path(path)
        if p.suffix.lower() != ".png":
            raise bad_value(f"path={str(path)!r}", "pictures are written as PNG files", "give a path ending in .png.")
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=120, bbox_inches="tight")
    return fig


def _units(plan: ParallelPlan) -> list[tuple[str, LayerStrategy, int]]:
    """(label, strategy, stage) of every unit in model order: the embedding, each block, the head."""
    assert plan.embed is not None and plan.head is not None
    stage_of_layer = {}
    for chunk in range(plan.pp * plan.virtual_stages):
        for i in plan.stage_layers(chunk):
            stage_of_layer[i] = chunk % plan.pp
    return ([("embed", plan.embed, 0)] + [(f"L{i}", s, stage_of_layer[i]) for i, s in enumerate(plan.layers)]
            + [("head", plan.head, plan.pp - 1)])


def plan_diagram(plan: ParallelPlan, path: str | Path | None = None, title: str | None = None) -> "Figure":
    """Units x ranks: a cell is coloured by the unit's strategy on that rank's stage (blank: another stage
    holds the unit) and labelled ``t<tp index> d<dp index>`` (``e<ep index>`` under expert parallelism)."""
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan={type(plan).__name__}: expected a ParallelPlan. HINT: ParallelPlan.load(path).")
    plt = _plt()
    from matplotlib.patches import Patch, Rectangle

    layout = RankLayout(plan.world_size, plan.pp)
    units = _units(plan)
    kinds = sorted({s.short() for _, s, _ in units})
    cmap = plt.get_cmap("tab20")
    colour = {k: cmap(i % 20) for i, k in enumerate(kinds)}
    width = max(6.0, 0.55 * len(units) + 2.0)
    height = max(2.5, 0.42 * plan.world_size + 1.5)
    fig, ax = plt.subplots(figsize=(width, height))
    small = len(units) <= 40 and plan.world_size <= 32  # labels only where they stay readable
    for x, (_, s, stage) in enumerate(units):
        for rank in layout.stage_ranks(stage):
            ax.add_patch(Rectangle((x, rank), 1, 1, facecolor=colour[s.short()], edgecolor="white", linewidth=0.8))
            if small:
                d, t = layout.coords(s, rank)
                label = (f"t{t}" if s.tp > 1 else "") + (f" d{d}" if s.dp > 1 else "")
                if s.ep > 1:
                    label += f" e{d % s.ep}"
                ax.text(x + 0.5, rank + 0.5, label.strip(), ha="center", va="center", fontsize=6)
    for stage in range(1, plan.pp):  # stage bands
        ax.axhline(stage * layout.stage_size, color="black", linewidth=1.5)
    ax.set_xlim(0, len(units))
    ax.set_ylim(plan.world_size, 0)
    ax.set_xticks([x + 0.5 for x in range(len(units))], [u for u, _, _ in units], rotation=90 if len(units) > 16 else 0,
                  fontsize=7)
    ax.set_yticks([r + 0.5 for r in range(plan.world_size)], [f"rank {r}" for r in range(plan.world_size)],
                  fontsize=7)
    ax.legend(handles=[Patch(color=colour[k], label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=7, title="strategy", title_fontsize=8)
    sched = f", {plan.pipeline_schedule}" if plan.pp > 1 else ""
    ax.set_title(title or f"{plan.world_size} ranks, pp={plan.pp}{sched}, {plan.micro_batches} micro-batches, "
                 f"global batch {plan.global_batch}", fontsize=9)
    return _save(fig, path)


def schedule(p: int, m: int, kind: str, fwd: Sequence[float], bwd: Sequence[float]) -> list[list[tuple[str, int, float, float]]]:
    """Per stage the ops of one step as (``"F"``/``"B"``, micro-batch, start, end): each stage runs its ops in
    the schedule's order, F(s, i) after F(s-1, i), B(s, i) after B(s+1, i); sends are free (the cost model
    prices them inside the stage times)."""
    if kind not in ("gpipe", "1f1b"):
        raise bad_value(f"pipeline_schedule={kind!r}", "the timeline draws 'gpipe' and '1f1b'",
                        "draw an interleaved plan with virtual_stages=1 for the picture.")
    orders = []
    for s in range(p):
        if kind == "gpipe":
            orders.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        else:  # 1F1B: p - s warm-up forwards, then one forward / one backward, then the remaining backwards
            warm = min(m, p - s)
            order = [("F", i) for i in range(warm)]
            f, b = warm, 0
            while b < m:
                order.append(("B", b))
                b += 1
                if f < m:
                    order.append(("F", f))
                    f += 1
            orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    clock, idx = [0.0] * p, [0] * p
    out: list[list[tuple[str, int, float, float]]] = [[] for _ in range(p)]
    while any(idx[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while idx[s] < len(orders[s]):
                k, i = orders[s][idx[s]]
                dep = ("F", s - 1, i) if k == "F" and s > 0 else ("B", s + 1, i) if k == "B" and s < p - 1 else None
                if k == "B" and s == p - 1:
                    dep = ("F", s, i)
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] if dep else 0.0)
                end = start + (fwd[s] if k == "F" else bwd[s])
                done[(k, s, i)] = clock[s] = end
                out[s].append((k, i, start, end))
                idx[s] += 1
                moved = True
        if not moved:  # pragma: no cover - the orders above are valid schedules
            raise RuntimeError("pipeline schedule deadlocked")
    return out


def pipeline_timeline(plan: ParallelPlan, cost: "PlanCost", path: str | Path | None = None,
                      fwd_share: float = FWD_SHARE, measured: bool = False) -> "Figure":
    """One step of ``plan``'s schedule per stage from ``cost`` (``CostModel.evaluate(plan)``, or a measured
    ``PlanCost``): per micro-batch the stage's time split ``fwd_share`` : ``1 - fwd_share`` into forward and
    backward, then the stage's per-step tail (gradient sync, optimizer)."""
    if len(cost.stage_mb_time_s) != plan.pp:
        raise bad_value(f"{len(cost.stage_mb_time_s)} stage times", f"the plan has pp={plan.pp} stages",
                        "pass the cost of this plan: cost_model.evaluate(plan).")
    if not 0.0 < fwd_share < 1.0:
        raise bad_value(f"fwd_share={fwd_share}", "must be in (0, 1)", "the default 1/3 is forward : backward = 1 : 2.")
    plt = _plt()
    kind = plan.pipeline_schedule if plan.pp > 1 else "gpipe"
    fwd = [t * fwd_share for t in cost.stage_mb_time_s]
    bwd = [t * (1.0 - fwd_share) for t in cost.stage_mb_time_s]
    ops = schedule(plan.pp, plan.micro_batches, kind, fwd, bwd)
    fig, ax = plt.subplots(figsize=(10, 0.6 * plan.pp + 1.6))
    end = max(e for stage in ops for *_, e in stage)
    for s, stage in enumerate(ops):
        for k, i, a, b in stage:
            ax.barh(s, b - a, left=a, height=0.8,
                    color="#4c72b0" if k == "F" else "#dd8452", edgecolor="white", linewidth=0.5)
            if plan.micro_batches <= 16:
                ax.text((a + b) / 2, s, f"{k}{i}", ha="center", va="center", fontsize=6, color="white")
        tail = cost.stage_extra_s[s]
        ax.barh(s, tail, left=end, height=0.8, color="#8c8c8c", edgecolor="white", linewidth=0.5)
    busy = sum(cost.stage_mb_time_s) * plan.micro_batches
    bubble = 1.0 - busy / (plan.pp * end) if end > 0 else 0.0
    ax.set_yticks(range(plan.pp), [f"stage {s}" for s in range(plan.pp)])
    ax.set_ylim(plan.pp - 0.5, -0.5)
    ax.set_xlabel("seconds (grey: gradient sync + optimizer)")
    what = "measured" if measured else "predicted"
    ax.set_title(f"{what} {kind if plan.pp > 1 else 'no pipeline'}: pp={plan.pp}, m={plan.micro_batches}, "
                 f"step {cost.step_time_s * 1e3:.1f} ms, bubble {bubble:.1%}", fontsize=9)
    return _save(fig, path)


def measured_timeline(record: Any, path: str | Path | None = None, title: str | None = None) -> "Figure":
    """One measured step of a pipelined plan: per pipeline rank the forward (blue) and backward (orange) of
    each micro-batch as it ran, from ``record`` -- an :class:`~lightning_galv.callbacks.OnlineProfiler`
    ``StepRecord`` (its ``pipeline_ops``) or the ops themselves, ``(rank, "F" | "B", chunk, micro-batch,
    start s, end s)``. Gaps are waits: the bubble, sends and receives, and the other stages' slowness. The
    bubble printed is ``1 - busy / (ranks x span)`` over the drawn ops (the per-step tail is not in them)."""
    ops = list(getattr(record, "pipeline_ops", record))
    if not ops:
        raise bad_value("pipeline_ops=[]", "the measured timeline needs the ops of a pipelined step",
                        "use a plan with pp > 1 and an OnlineProfiler whose sampled step has run "
                        "(profiler.records[-1]).")
    for op in ops:
        if len(op) != 6 or op[1] not in ("F", "B") or not op[5] >= op[4]:
            raise bad_value(f"pipeline op {op!r}", "must be (rank, 'F'|'B', chunk, micro-batch, start, end) with "
                            "end >= start", "pass OnlineProfiler.records[i] or its pipeline_ops.")
    plt = _plt()
    first_chunk: dict[int, int] = {}
    for r, _, c, *_ in ops:
        first_chunk[r] = min(c, first_chunk.get(r, c))
    ranks = sorted(first_chunk, key=lambda r: (first_chunk[r], r))  # rows in stage order
    row = {r: k for k, r in enumerate(ranks)}
    chunks_per_rank = {r: len({c for rr, _, c, *_ in ops if rr == r}) for r in ranks}
    origin = min(op[4] for op in ops)
    span = max(op[5] for op in ops) - origin
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.6))
    shades = {"F": ("#4c72b0", "#7f9fd0"), "B": ("#dd8452", "#eab08e")}
    micro = {i for *_, i, _, _ in ops}
    for r, k, c, i, a, b in ops:
        colour = shades[k][(c // len(ranks)) % 2]  # interleaved: a rank's second chunk is lighter
        ax.barh(row[r], b - a, left=a - origin, height=0.8, color=colour, edgecolor="white", linewidth=0.5)
        if len(micro) <= 16:
            label = f"{k}{i}" if chunks_per_rank[r] == 1 else f"{k}{i}.{c}"
            ax.text((a + b) / 2 - origin, row[r], label, ha="center", va="center", fontsize=6, color="white")
    busy = sum(b - a for *_, a, b in ops)
    bubble = 1.0 - busy / (len(ranks) * span) if span > 0 else 0.0
    ax.set_yticks(range(len(ranks)), [f"rank {r} (stage {first_chunk[r]})" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlabel("seconds from the step's start (measured; gaps are waits)")
    ax.set_title(title or f"measured: {len(ranks)} stages, {len(micro)} micro-batches, span {span * 1e3:.1f} ms, "
                 f"bubble {bubble:.1%}", fontsize=9)
    return _save(fig, path)


def cost_breakdown(plan: ParallelPlan, cost_model: "CostModel", path: str | Path | None = None) -> "Figure":
    """Per unit the predicted forward and backward time over the step's micro-batches and its per-step part
    (gradient sync not hidden by backward, optimizer step), stacked, from ``cost_model``'s own layer prices."""
    from .planner.cost import StageContext

    plt = _plt()
    assert plan.global_batch is not None and plan.embed is not None and plan.head is not None
    m = plan.micro_batches
    rows = []
    for label, s, stage in _units(plan):
        ctx = StageContext(plan.stage_size, plan.global_batch // m, m, plan.pp, stage, plan.pipeline_schedule,
                           plan.virtual_stages)
        if label == "embed":
            c = cost_model.end_cost(s, ctx, True, False)  # type: ignore[attr-defined]
        elif label == "head":
            c = cost_model.end_cost(s, ctx, False, True, plan.vocab_parallel_loss)  # type: ignore[attr-defined]
        else:
            c = cost_model.layer_cost(int(label[1:]), s, ctx)  # type: ignore[attr-defined]
        rows.append((label, c.fwd * m, c.bwd * m, c.step_extra))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows) + 2.0), 3.6))
    xs = range(len(rows))
    f = [r[1] * 1e3 for r in rows]
    b = [r[2] * 1e3 for r in rows]
    e = [r[3] * 1e3 for r in rows]
    ax.bar(xs, f, color="#4c72b0", label="forward (all micro-batches)")
    ax.bar(xs, b, bottom=f, color="#dd8452", label="backward (+ recompute)")
    ax.bar(xs, e, bottom=[x + y for x, y in zip(f, b)], color="#8c8c8c", label="per step: sync + optimizer")
    ax.set_xticks(list(xs), [r[0] for r in rows], rotation=90 if len(rows) > 16 else 0, fontsize=7)
    ax.set_ylabel("ms per step")
    total = cost_model.evaluate(plan).step_time_s
    ax.set_title(f"predicted cost per unit; step {total * 1e3:.1f} ms (stages overlap in a pipeline)", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def tuner_scatter(trials: Sequence[dict[str, Any]] | Any, path: str | Path | None = None) -> "Figure":
    """Predicted vs measured throughput of the tuner's completed trials (``TuneResult`` or its ``trials``);
    points above the diagonal ran faster than predicted."""
    rows = getattr(trials, "trials", trials)
    pts = [(t["predicted_throughput"], t["throughput"], t.get("summary", "?")) for t in rows
           if t.get("state") == "COMPLETE" and t.get("throughput") and t.get("predicted_throughput")]
    if not pts:
        raise bad_value("no completed trial with a prediction", "the scatter needs measured and predicted throughput",
                        "run the tuner until at least one trial completes.")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 5.0))
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    ax.scatter(xs, ys, color="#4c72b0")
    for x, y, label in pts:
        ax.annotate(label, (x, y), fontsize=5, alpha=0.8)
    lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted samples/s")
    ax.set_ylabel("measured samples/s")
    ax.set_title(f"tuner: {len(pts)} completed trials", fontsize=9)
    return _save(fig, path)
