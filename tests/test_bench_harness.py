"""The benchmark harness (benchmarks/_results.py, _stats.py): stamped sections, replaced in place; t-intervals; the
step-parts diagnostic's predicted split."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _results import _is_output, stamp, write_section  # noqa: E402
from _stats import interval, launch_offsets, t95  # noqa: E402


def test_sections_are_stamped_and_replaced_without_touching_the_others(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    write_section("a", "## A\n\nfirst", path)
    write_section("b", "## B\n\nother", path)
    write_section("a", "## A\n\nsecond", path)
    text = path.read_text()
    assert "first" not in text and "second" in text and "other" in text
    assert text.index("## A") < text.index("## B")  # replaced where it was
    a = text[text.index("<!-- a:start -->"):text.index("<!-- a:end -->")]
    assert a.splitlines()[1] == "## A" and a.splitlines()[3].startswith("*Run at commit ")
    assert "load average over the last 1 / 5 / 15 min" in a and "python " in a


def test_stamp_names_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the package's settings that change a measurement in front (conftest sets the profile budget); where
    caches go does not."""
    monkeypatch.delenv("GALV_PROFILE_BUDGET_S", raising=False)
    monkeypatch.setenv("GALV_CACHE_DIR", "/tmp/somewhere")
    line = stamp(["benchmarks/x.py", "--launches", "5", "--only", "2r dp2"])
    assert "command `python benchmarks/x.py --launches 5 --only '2r dp2'`" in line
    monkeypatch.setenv("GALV_PROFILE_BUDGET_S", "0")
    line = stamp(["benchmarks/x.py", "--launches", "5"])
    assert "command `GALV_PROFILE_BUDGET_S=0 python benchmarks/x.py --launches 5`" in line


def test_only_benchmark_outputs_do_not_count_as_uncommitted_code() -> None:
    assert _is_output(" M benchmarks/RESULTS.md") and _is_output(" M benchmarks/data/costmodel_moe.json")
    assert not _is_output(" M benchmarks/_results.py") and not _is_output(" M lightning_galv/plan.py")


def test_t_interval_uses_students_t() -> None:
    assert t95(5) == pytest.approx(2.78) and t95(40) == pytest.approx(2.0227, abs=1e-3)
    m, lo, hi = interval([1.0, 2.0, 3.0])
    assert m == 2.0 and hi - m == pytest.approx(4.30 * 1.0 / 3 ** 0.5)


def test_launch_offsets_split_a_shared_shift_from_each_plan_s_own_error() -> None:
    """Four plans, two launches: launch 1's profile priced everything 10 % high, plan 3 is 5 % low on its own.
    The offsets find the shift, the residuals the plan's own error (leave-one-out: not judged against itself)."""
    errors = [[0.0, 0.10], [0.0, 0.10], [0.0, 0.10], [-0.05, 1.10 * 0.95 - 1]]
    offsets, residuals = launch_offsets(errors)
    assert offsets == pytest.approx([0.0, 0.10])
    assert residuals[0] == pytest.approx([0.0, 0.0])
    assert residuals[3] == pytest.approx([-0.05, -0.05])
    with pytest.raises(ValueError, match="HINT"):
        launch_offsets([[0.0], [0.0, 0.1]])


def test_step_parts_prediction_adds_up_to_the_step_for_every_stored_plan() -> None:
    """moe_step_parts.py compares the cost model's split of a step (blocks' fwd / bwd, ends, after backward) with a
    measured one: the split must hold everything evaluate() prices -- re-layouts between blocks of different
    strategies and the stage's gradient-sync part included (the hetero plans have both) -- or a part reads low
    for what another holds. Every one-stage, one-micro-batch plan of the accuracy benchmark, dense and MoE, from
    the stored profiles of its first launch."""
    import json

    from costmodel_accuracy import profile_for
    from costmodel_repredict import _cases, _load
    from moe_step_parts import predicted_parts

    from lightning_galv.planner.profiles import HardwareProfile, ModelProfile

    data_dir = Path(__file__).resolve().parents[1] / "benchmarks" / "data"
    checked = 0
    for model in ("llama", "moe"):
        cases = _cases(model)
        profiles = json.loads((data_dir / f"costmodel_{model}_profiles.json").read_text())
        for r in json.loads((data_dir / f"costmodel_{model}.json").read_text()):
            case = cases[r["name"]]
            if case.plan.pp > 1 or case.plan.micro_batches > 1:
                continue
            m, h = profiles[r["runs"][0]["launch"]][str(r["world"])][:2]
            parts = predicted_parts(profile_for(_load(m, ModelProfile), case), _load(h, HardwareProfile), case.plan)
            assert parts["fwd"] + parts["bwd"] + parts["ends"] + parts["extra"] == pytest.approx(parts["step"],
                                                                                                rel=1e-9)
            checked += 1
    assert checked >= 50  # 39 dense (held-out shapes too) and 11 MoE plans when written


def test_the_raw_timing_recorder_passes_the_profilers_extra_runs_through(one_rank_group: None) -> None:
    """costmodel_ranks._raw_timings wraps ShardedLayerProfiler._time_blocks to record its raw medians; the wrapper
    must take what the profiler passes (the matmul probe's run since e53e399: a 15-launch accuracy run stopped at
    its first profile when it did not) and record every run, the probe's included."""
    import torch

    import costmodel_ranks
    from lightning_galv.plan import ModelShape
    from lightning_galv.planner.profiles import HardwareProfile
    from lightning_galv.profiling.profilers import ShardedLayerProfiler, _MatmulProbe

    shape = ModelShape(1, 4, 1, 1, 8, 8, 2)
    prof = ShardedLayerProfiler(lambda: torch.nn.Linear(4, 4), shape, HardwareProfile.uniform(1, 1, 1e9),
                                batch_sizes=(1,), repeats=1, progress=False)
    with costmodel_ranks._raw_timings() as (calls, rounds):
        out = prof._time_blocks([("tp1/none", torch.nn.Linear(4, 4))],
                                [(_MatmulProbe.KEY, _MatmulProbe(4, 8, torch.float32, "cpu"), 3)])
    assert set(out) == {("tp1/none", 1), ("matmul", 3)} and calls == [out] and rounds == [1]
    assert "recording" not in ShardedLayerProfiler._time_blocks.__qualname__  # the profiler's own again


def test_routing_skew_takes_the_busiest_rank_of_the_worst_ep_group() -> None:
    """profiling.routing.skew_of (moe_routing_skew.py's rule): per EP group (consecutive data shards) the busiest
    owner's routed copies over the group's mean; experts owned in consecutive runs of E / ep, as the runtime's
    dispatcher places them."""
    from lightning_galv.profiling.routing import skew_of as skew

    # 4 samples, 4 experts; samples 0-1 route to experts 0 and 1 only, samples 2-3 evenly
    counts = [[3, 1, 0, 0], [2, 2, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert skew(counts, 2, 2) == pytest.approx(12 / 8)  # one group of 4 samples: owner 0 has 3+1+2+2+1+1+1+1 = 12
    assert skew(counts, 2, 4) == pytest.approx(8 / 4)  # group 0 (samples 0-1): owner 0 holds all 8 copies
    assert skew(counts, 4, 4) == pytest.approx(7 / 4)  # expert 0 alone: 3+2+1+1 of 16 / 4
    assert skew([[1, 1, 1, 1]] * 4, 4, 4) == 1.0
