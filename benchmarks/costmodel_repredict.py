"""Re-predict stored cost-model measurements with this checkout's cost model (no processes, no measuring).

``costmodel_accuracy.py --fresh-profiles`` stores, per launch, the profiles it predicted from and what it measured
(``benchmarks/data/costmodel_llama.json`` + ``costmodel_llama_profiles.json``; ``--model moe``: the MoE run's). When only the cost model changes,
re-predicting those very measurements from those very profiles isolates the model's effect from the machine's
run-to-run spread (which a fresh 10-launch run mixes in). "stored" is the stored run's own prediction (as that
run printed it; re-predicting with the model of that run's commit gives it back exactly -- the check that this
script predicts as costmodel_accuracy.py does); "now" is this checkout's model. Errors are per launch (prediction /
measurement at profile speed - 1), median over launches, as in the accuracy table. Plans are rebuilt from
costmodel_accuracy.py's lists by name (they must not have changed since the stored run).

``--data`` / ``--profiles`` may name older runs (e.g. from the git history of benchmarks/data/) to check a model
change on measurements it was not designed from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import write_section  # noqa: E402
from costmodel_accuracy import (CFG, MODELS, SEQ, Case, heldout_cases, moe_plans, plans,  # noqa: E402
                                profile_for)

from lightning_galv.planner.cost import GalvatronCostModel  # noqa: E402
from lightning_galv.planner.profiles import HardwareProfile, ModelProfile  # noqa: E402


def _load(x: object, cls: type) -> object:
    return cls.from_dict(x) if isinstance(x, dict) else cls.from_json(x)  # type: ignore[attr-defined]


def _cases(model: str = "llama") -> dict[str, Case]:
    """Every plan costmodel_accuracy.py measures for ``model`` (its --model), by name: the dense ones (held-out
    ones too) for "llama", else the MoE plans on that MoE model (the MoE models share plan names)."""
    if model == "llama":
        return {n: Case(n, p, CFG, SEQ) for n, p in plans()} | {c.name: c for c in heldout_cases()}
    cfg, seq = MODELS[model][:2]
    return {n: Case(n, p, cfg, seq) for n, p in moe_plans()}


def repredict(data: list[dict], profiles: list[dict], model: str = "llama") -> list[tuple[str, str, float, float]]:
    """(plan, held out, stored median error, re-predicted median error) per stored plan of ``model``."""
    cases = _cases(model)
    out = []
    for r in data:
        if r["name"] not in cases:
            raise ValueError(f"stored plan {r['name']!r}: not among costmodel_accuracy.py's plans. HINT: re-predict "
                             "data written by the same version of costmodel_accuracy.py.")
        case = cases[r["name"]]
        stored, now = [], []
        for run in r["runs"]:
            m, h = profiles[run["launch"]][str(r["world"])][:2]
            model, hw = _load(m, ModelProfile), _load(h, HardwareProfile)
            pred = GalvatronCostModel(profile_for(model, case), hw, runtime="native").evaluate(case.plan).step_time_s
            stored.append(run["pred"] / run["mt"] - 1)
            now.append(pred / run["mt"] - 1)
        out.append((r["name"], r["heldout"], statistics.median(stored), statistics.median(now)))
    return out


def phases(data: list[dict], profiles: list[dict], model: str = "llama") -> list[tuple[str, list[float]]]:
    """Per plan without a pipeline, medians over launches (ms, at profile speed): fwd+bwd stored prediction, now,
    measured; per-step part stored prediction, now, measured."""
    cases = _cases(model)
    out = []
    for r in data:
        case = cases[r["name"]]
        runs = [x for x in r["runs"] if x.get("pfb") is not None and x.get("ph")]
        if case.plan.pp > 1 or not runs:
            continue
        cols: list[list[float]] = [[] for _ in range(6)]
        for run in runs:
            m, h = profiles[run["launch"]][str(r["world"])][:2]
            pred = GalvatronCostModel(profile_for(_load(m, ModelProfile), case), _load(h, HardwareProfile),
                                      runtime="native").evaluate(case.plan)
            fb, ex = pred.phases(0, case.plan.micro_batches)
            vals = (run["pfb"], fb, run["ph"][0], run["pex"], ex, run["ph"][1] + run["ph"][2])
            for c, v in zip(cols, vals):
                c.append(v * 1e3)
        out.append((r["name"], [statistics.median(c) for c in cols]))
    return out


def _rel(path: str) -> str:
    """A path as the repository names it, when it is inside the repository."""
    p = Path(path).resolve()
    return str(p.relative_to(HERE.parent)) if p.is_relative_to(HERE.parent) else path


def summary(rows: list[tuple[str, str, float, float]], col: int) -> str:
    parts = []
    for label, sel in (("in-sample", [x for x in rows if not x[1]]), ("held-out", [x for x in rows if x[1]])):
        v = [abs(x[col]) for x in sel]
        if v:
            parts.append(f"{label} median |err| {statistics.median(v) * 100:.1f}%, max {max(v) * 100:.1f}%")
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=tuple(MODELS), default="llama",
                    help="whose stored run to re-predict by default (costmodel_accuracy.py --model)")
    ap.add_argument("--data", help="default: benchmarks/data/costmodel_<model>.json")
    ap.add_argument("--profiles", help="default: benchmarks/data/costmodel_<model>_profiles.json")
    ap.add_argument("--label", default="", help="what the stored run was (e.g. its commit), for the table")
    ap.add_argument("--section", help="RESULTS.md section to (re)write (default: costmodel_repredict, "
                    "costmodel_repredict_moe for --model moe)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    args.data = args.data or str(HERE / "data" / f"costmodel_{args.model}.json")
    args.profiles = args.profiles or str(HERE / "data" / f"costmodel_{args.model}_profiles.json")
    args.section = args.section or ("costmodel_repredict" + ("" if args.model == "llama"
                                                             else "_" + args.model.replace("-", "_")))
    data, profs = json.loads(Path(args.data).read_text()), json.loads(Path(args.profiles).read_text())
    rows = repredict(data, profs, args.model)
    ph = phases(data, profs, args.model)
    ph_lines = ["| plan | fwd+bwd predicted: stored / now | measured | per step predicted: stored / now | measured |",
                "|---|---|---|---|---|"]
    ph_lines += [f"| {n} | {v[0]:.0f} / {v[1]:.0f} ms | {v[2]:.0f} ms | {v[3]:.0f} / {v[4]:.0f} ms | {v[5]:.0f} ms |"
                 for n, v in ph]
    lines = ["| plan | held out | stored run's error | re-predicted now |", "|---|---|---|---|"]
    lines += [f"| {n} | {h or '-'} | {a * 100:+.1f}% | {b * 100:+.1f}% |" for n, h, a, b in rows]
    body = "\n".join([
        "## Cost model re-predicting stored measurements (benchmarks/costmodel_repredict.py)"
        + (f": {args.label}" if args.label else ""),
        "",
        f"Measurements and profiles: `{_rel(args.data)}` / `{_rel(args.profiles)}`; the stamp's commit is the cost "
        "model that "
        "re-predicts "
        "them. Per launch prediction / measurement at profile speed - 1, median over launches; no calibration.",
        "",
        *lines,
        "",
        f"Stored: {summary(rows, 2)}. Now: {summary(rows, 3)}.",
        *(["",
           "Where the time goes (plans without a pipeline; medians over launches at profile speed): the prediction's "
           "micro-batch part (fwd+bwd) and per-step part against the stored measured phases. A stored run measured "
           "each phase on its own slowest rank (runs before 39e90d2), which counts the ranks' skew into the "
           "per-step part of data-parallel plans too (benchmarks/sync_wait.py); later runs measure along the "
           "critical path.", "", *ph_lines] if ph else []),
    ])
    print(body)
    if not args.no_write:
        write_section(args.section, body)


if __name__ == "__main__":
    main()
