"""Pictures (lightning_galv/plots.py, issue 16): each renders from a tiny plan; the timeline's schedule is exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_galv.cli import main as galv
from lightning_galv.plan import LayerStrategy as L
from lightning_galv.plan import ModelShape, ParallelPlan
from lightning_galv.planner import GalvatronCostModel, HardwareProfile, ModelProfile
from lightning_galv.plots import (cost_breakdown, measured_timeline, pipeline_timeline, plan_diagram, schedule,
                                  tuner_scatter)

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ModelShape(4, 256, 8, 4, 768, 512, 128)


def _png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000


def _cost() -> GalvatronCostModel:
    return GalvatronCostModel(ModelProfile.from_shape(SHAPE), HardwareProfile.uniform(1, 4, 16 * 2**30))


def test_plan_diagram_draws_every_unit_on_its_stage(tmp_path: Path) -> None:
    from matplotlib.patches import Rectangle

    plan = ParallelPlan(4, (L(tp=2), L(dp=2), L(tp=2, sp="ulysses"), L(dp=2, zero=3)), pp=2, micro_batches=2,
                        global_batch=8)
    fig = plan_diagram(plan, tmp_path / "p.png")
    cells = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    assert len(cells) == (4 + 2) * 2  # every unit (embed, 4 blocks, head) on the 2 ranks of its stage
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert {"t0", "t1", "d0", "d1"} <= labels
    assert _png(tmp_path / "p.png")
    with pytest.raises(ValueError, match="PNG"):
        plan_diagram(plan, tmp_path / "p.jpg")


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_schedule_of_equal_stages_has_the_textbook_bubble(kind: str) -> None:
    p, m = 3, 4
    ops = schedule(p, m, kind, [1.0] * p, [2.0] * p)
    makespan = max(e for stage in ops for *_, e in stage)
    assert makespan == pytest.approx((m + p - 1) * 3.0)  # (p-1)/(m+p-1) idle per stage
    if kind == "1f1b":
        assert [f"{k}{i}" for k, i, _, _ in ops[0]] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    for s in range(1, p):  # a forward never starts before the previous stage finished it
        ends = {(k, i): e for k, i, _, e in ops[s - 1]}
        assert all(a >= ends[("F", i)] for k, i, a, _ in ops[s] if k == "F")


def test_timeline_breakdown_and_scatter_render(tmp_path: Path) -> None:
    cm = _cost()
    plan = ParallelPlan(4, (L(dp=2),) * 4, pp=2, micro_batches=4, global_batch=16)
    fig = pipeline_timeline(plan, cm.evaluate(plan), tmp_path / "t.png")
    assert "bubble" in fig.axes[0].get_title() and _png(tmp_path / "t.png")
    flat = ParallelPlan.uniform(4, 4, L(tp=2, dp=2), global_batch=16)
    fig = cost_breakdown(flat, cm, tmp_path / "c.png")
    assert len(fig.axes[0].patches) == 3 * 6 and _png(tmp_path / "c.png")  # 3 stacked bars x 6 units
    trials = [{"state": "COMPLETE", "throughput": 10.0, "predicted_throughput": 12.0, "summary": "a"},
              {"state": "PRUNED", "throughput": None, "predicted_throughput": 9.0, "summary": "b"}]
    tuner_scatter(trials, tmp_path / "s.png")
    assert _png(tmp_path / "s.png")
    with pytest.raises(ValueError, match="HINT"):
        tuner_scatter(trials[1:])


def test_galv_plan_show_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    galv(["plan", "show", str(ROOT / "recipes/plans/hetero4.yaml"), "--png", str(tmp_path / "h.png")])
    assert "wrote" in capsys.readouterr().out and _png(tmp_path / "h.png")


def test_measured_timeline_draws_the_recorded_ops(tmp_path: Path) -> None:
    """Ops as the online profiler records them, here the textbook GPipe schedule on 2 stages (rank 3 holds
    stage 0, rank 1 stage 1): one bar per op, rows in stage order, the bubble of the drawn ops."""
    from lightning_galv.callbacks.online_profiler import StepRecord

    ops = [(3 if s == 0 else 1, k, s, i, a, b) for s, stage in enumerate(schedule(2, 2, "gpipe", [1.0, 1.0],
                                                                                   [2.0, 2.0]))
           for k, i, a, b in stage]
    fig = measured_timeline(StepRecord(0, 0, 8.0, 4, None, pipeline_ops=ops), tmp_path / "m.png")
    ax = fig.axes[0]
    assert len(ax.patches) == 8 and _png(tmp_path / "m.png")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 3 (stage 0)", "rank 1 (stage 1)"]
    assert "bubble 33.3%" in ax.get_title()  # busy 2 x (1 + 1 + 2 + 2) of 2 stages x span 9
    with pytest.raises(ValueError, match="pipeline_ops=.*HINT"):
        measured_timeline([])
    with pytest.raises(ValueError, match="end >= start.*HINT"):
        measured_timeline([(0, "F", 0, 0, 2.0, 1.0)])
