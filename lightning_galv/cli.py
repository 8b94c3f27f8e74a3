"""``galv``: the command line.

    galv demo [--devices 4 --steps 40 --plan plan.yaml --auto]   train the tiny demo model
    galv plan show PLAN                                           print a plan file, validated
    galv fit --config recipes/tiny_cpu.yaml                        LightningCLI with our strategy
    galv tune --config tune.yaml [--out best.yaml]                 measure the planner's best plans (Optuna)
    galv tune --config tune.yaml --batch-size --plan P [--out o.yaml]  the largest batch plan P fits (real trials)

A tune config is YAML with the arguments of lightning_galv.tuning.tune, e.g.
    module_factory: my_pkg.train:make_module     # importable functions (trials run in fresh processes)
    data_factory: my_pkg.train:make_loader
    devices: 4
    n_trials: 10
    storage: sqlite:///galv-tune.db              # any Optuna storage URL; resuming continues the study
With --batch-size the same config is read for lightning_galv.tuning.largest_batch (module_factory,
data_factory, devices, memory_budget, trial_timeout, ...; the study's own keys are ignored); the plan given
is written with the largest global batch that fit (and the DataLoader batch_size to use is printed).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo.run import main as demo

        demo(rest)
    elif cmd == "plan" and rest[:1] == ["show"] and len(rest) == 2:
        from .plan import ParallelPlan

        print(ParallelPlan.load(rest[1]).describe())
    elif cmd == "tune":
        _tune(rest)
    elif cmd in ("fit", "validate", "test", "predict"):
        from .demo.recipes_cli import cli_main

        cli_main([cmd, *rest])
    else:
        raise SystemExit(f"galv: unknown command {' '.join(argv)!r}. HINT: galv --help")



def _tune(args: list[str]) -> None:
    import argparse

    import yaml

    ap = argparse.ArgumentParser(prog="galv tune")
    ap.add_argument("--config", required=True, help="YAML with the arguments of lightning_galv.tuning.tune")
    ap.add_argument("--out", default=None, help="where the plan is written (default best_plan.yaml, with "
                    "--batch-size largest_batch_plan.yaml)")
    ap.add_argument("--batch-size", action="store_true", help="find the largest batch --plan fits instead of tuning")
    ap.add_argument("--plan", default=None, help="with --batch-size: the plan file whose batch is searched")
    ns = ap.parse_args(args)
    with open(ns.config) as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict) or not {"module_factory", "data_factory", "devices"} <= set(cfg):
        raise SystemExit(f"galv tune: {ns.config!r} must be a mapping with module_factory, data_factory and devices. "
                         "HINT: see galv --help for an example.")
    if ns.batch_size:
        _batch_size(cfg, ns.plan, ns.out or "largest_batch_plan.yaml")
        return
    if ns.plan is not None:
        raise SystemExit("galv tune: --plan is only read with --batch-size. HINT: galv tune --config C --batch-size "
                         "--plan PLAN, or drop --plan to tune.")
    ns.out = ns.out or "best_plan.yaml"
    from .tuning import tune

    result = tune(**cfg, best_plan_path=ns.out)
    print(result.table())
    if result.best_plan is None:
        raise SystemExit("galv tune: no trial completed within the memory budget. HINT: see the trials' fail_reason.")
    print(f"best: {result.best_throughput:.2f} samples/s -> {ns.out} (GalvatronStrategy(plan={ns.out!r}))")


def _batch_size(cfg: dict, plan: str | None, out: str) -> None:
    """``galv tune --batch-size``: the tune config's run arguments, applied to one plan's batch search."""
    import inspect

    from .tuning import largest_batch, tune

    if plan is None:
        raise SystemExit("galv tune --batch-size: which plan? HINT: add --plan best_plan.yaml (e.g. what galv tune "
                         "wrote).")
    accepted = set(inspect.signature(largest_batch).parameters) - {"plan"}
    study_only = set(inspect.signature(tune).parameters) - accepted
    unknown = sorted(set(cfg) - accepted - study_only)
    if unknown:
        raise SystemExit(f"galv tune --batch-size: unknown config keys {unknown}. HINT: the keys are the arguments "
                         f"of lightning_galv.tuning.largest_batch: {sorted(accepted)}.")
    result = largest_batch(plan=plan, **{k: v for k, v in cfg.items() if k in accepted})
    print(result.table())
    result.plan.save(out)
    print(f"largest batch: global {result.global_batch} (micro-batch {result.micro_batch}; DataLoader batch_size="
          f"{result.shard_batch} per shard) after {result.n_trials} trials -> {out}"
          + (" (stopped at max_global_batch: larger may fit)" if result.capped else ""))


if __name__ == "__main__":  # last: ``python -m lightning_galv.cli tune`` needs the helpers above defined
    main()
