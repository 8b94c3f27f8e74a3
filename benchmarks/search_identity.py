"""Check that a change to the search leaves its results alone: the 16 configurations of vs_galvatron.py.

Runs ``galvatron_search`` (Galvatron 2.4's cost model, once per search context) on every configuration of
:mod:`vs_galvatron` and records, per configuration, the best plan of every context and the overall best
(``ParallelPlan.to_dict`` with its prediction: floats are written by ``repr``, so a JSON round trip is
bit-exact). Save the results of the base commit, change the code, compare:

    flock /tmp/galv-cpu.lock python benchmarks/search_identity.py --save /tmp/old.json    # on the base commit
    flock /tmp/galv-cpu.lock python benchmarks/search_identity.py --compare /tmp/old.json

``--compare`` prints per configuration whether every context's plan and prediction are identical (and the
search time of both runs), and exits non-zero when any differs. Speed-ups belong in vs_galvatron.py; the
times here are one run each, for orientation only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_galvatron import CASES, DATA, MODELS  # noqa: E402

from lightning_galv.compat.galvatron import (read_galvatron_hardware, read_hardware_profile,  # noqa: E402
                                             read_model_profile)
from lightning_galv.planner.galvatron_model import galvatron_search  # noqa: E402


def run_case(name: str, nodes: int, mem: int, bsz: int) -> dict:
    """One configuration: every context's best plan (or None), the chosen context, the search's wall time."""
    fam, kw, sp = MODELS[name]
    prof = read_model_profile(DATA / "models" / fam / "meta_configs" / f"{name}.json", DATA / "models" / fam / "configs",
                              **kw)
    ghw = read_galvatron_hardware(DATA / "hardware", nodes, 8)
    hw = read_hardware_profile(DATA / "hardware", nodes, 8)
    t0 = time.perf_counter()
    res = galvatron_search(prof, hw, ghw, mem, bsz, sequence_parallel=sp)
    wall = time.perf_counter() - t0
    return {"context": list(res.context) if res.context else None,
            "plan": res.plan.to_dict() if res.plan is not None else None,
            "contexts": [{"min_tp": c.min_tp, "max_tp": c.max_tp,
                          "plan": c.plan.to_dict() if c.plan is not None else None} for c in res.contexts],
            "wall_s": wall}


def key(case: tuple) -> str:
    name, nodes, mem, bsz = case
    return f"{name} {nodes}x8 {mem}GB b{bsz}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path, help="write the results of this checkout here")
    g.add_argument("--compare", type=Path, help="compare this checkout's results with a saved file")
    ap.add_argument("--only", help="substring of the configuration name, e.g. 'gpt-6.7b 1x8'")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.only or args.only in key(c)]
    old = json.loads(args.compare.read_text()) if args.compare else None
    out, bad = {}, 0
    for case in cases:
        k = key(case)
        got = out[k] = run_case(*case)
        if old is None:
            print(f"{k}: {got['wall_s']:.3f} s, context {got['context']}", flush=True)
            continue
        ref = old[k]
        same = all(got[f] == ref[f] for f in ("context", "plan", "contexts"))
        diff = [f"({a['min_tp']},{a['max_tp']})" for a, b in zip(got["contexts"], ref["contexts"]) if a != b]
        bad += not same
        print(f"{k}: {'IDENTICAL' if same else 'DIFFERS ' + ' '.join(diff)}  "
              f"old {ref['wall_s']:.3f} s, new {got['wall_s']:.3f} s", flush=True)
    if args.save:
        args.save.write_text(json.dumps(out, indent=1))
    if old is not None:
        print(f"{len(cases) - bad} of {len(cases)} configurations identical")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
