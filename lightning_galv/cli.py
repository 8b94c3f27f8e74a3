"""``galv``: the command line.

    galv demo [--devices 4 --steps 40 --plan plan.yaml --auto]   train the tiny demo model
    galv plan show PLAN                                           print a plan file, validated
    galv fit --config recipes/tiny_cpu.yaml                        LightningCLI with our strategy
    galv tune --config tune.yaml [--out best.yaml]                 measure the planner's best plans (Optuna)

A tune config is YAML with the arguments of lightning_galv.tuning.tune, e.g.
    module_factory: my_pkg.train:make_module     # importable functions (trials run in fresh processes)
    data_factory: my_pkg.train:make_loader
    devices: 4
    n_trials: 10
    storage: sqlite:///galv-tune.db              # any Optuna storage URL; resuming continues the study
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


if __name__ == "__main__":
    main()


def _tune(args: list[str]) -> None:
    import argparse

    import yaml

    ap = argparse.ArgumentParser(prog="galv tune")
    ap.add_argument("--config", required=True, help="YAML with the arguments of lightning_galv.tuning.tune")
    ap.add_argument("--out", default="best_plan.yaml", help="where the best measured plan is written")
    ns = ap.parse_args(args)
    with open(ns.config) as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict) or not {"module_factory", "data_factory", "devices"} <= set(cfg):
        raise SystemExit(f"galv tune: {ns.config!r} must be a mapping with module_factory, data_factory and devices. "
                         "HINT: see galv --help for an example.")
    from .tuning import tune

    result = tune(**cfg, best_plan_path=ns.out)
    print(result.table())
    if result.best_plan is None:
        raise SystemExit("galv tune: no trial completed within the memory budget. HINT: see the trials' fail_reason.")
    print(f"best: {result.best_throughput:.2f} samples/s -> {ns.out} (GalvatronStrategy(plan={ns.out!r}))")
