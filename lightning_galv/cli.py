"""``galv``: the command line.

    galv demo [--devices 4 --steps 40 --plan plan.yaml --auto]   train the tiny demo model on CPU processes
    galv profile [--config R.yaml] [--devices 4] [--quiet]        measure this machine and the model; cache it
    galv search [--config R.yaml] [--devices 4] [--top-k 5]      top plans with predictions; write the best
                [--out plan.yaml] [--galvatron plan.json] [--quiet]
    galv plan show PLAN [--png OUT.png]                           print a plan file, validated; draw it
    galv fit --config recipes/tiny_cpu.yaml                        LightningCLI with our strategy
                                                                  (also validate / test / predict)
    galv tune --config recipes/tune_tiny.yaml [--out best.yaml]    measure the planner's best plans (Optuna)
    galv tune --config tune.yaml --batch-size --plan P [--out o.yaml]  the largest batch plan P fits (real trials)

Every command explains itself with an example: galv COMMAND --help. Errors print one line with a HINT;
add --debug (anywhere) for the full traceback. profile, search and tune draw progress bars on a terminal
(--quiet: none).

A tune config is YAML with the arguments of lightning_galv.tuning.tune (recipes/tune_tiny.yaml is one), e.g.
    module_factory: my_pkg.train:make_module     # importable functions (trials run in new processes)
    data_factory: my_pkg.train:make_loader
    devices: 4
    n_trials: 10
    storage: sqlite:///galv-tune.db              # any Optuna storage URL; resuming continues the study
With --batch-size the same config is read for lightning_galv.tuning.largest_batch (module_factory,
data_factory, devices, memory_budget, trial_timeout, ...; the study's own keys are ignored); the plan given
is written with the largest global batch that fit (and the DataLoader batch_size to use is printed).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

# errors a user causes (bad input, a missing file): one line with a HINT instead of a traceback
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, FileNotFoundError, IsADirectoryError,
                                                PermissionError)

PLAN_HELP = """\
usage: galv plan show PLAN [--png OUT.png]

Print a plan file (YAML or JSON, as written by galv search, ParallelPlan.save or the tuner), validated:
one line per run of layers with the same strategy, and the prediction when the file carries one.
--png also draws it: layers x ranks coloured by strategy, each cell with the rank's tp / dp index,
pipeline stages as bands (needs matplotlib: pip install "lightning_galv[plots]").

examples:
  galv plan show recipes/plans/hetero4.yaml
  galv plan show recipes/plans/hetero4.yaml --png hetero4.png
"""


def main(argv: list[str] | None = None) -> None:
    """Run one ``galv`` command; user errors exit with status 1 and one line on stderr (``--debug``: raise)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    cmd, rest = argv[0], argv[1:]
    handler = COMMANDS.get(cmd)
    if handler is None:
        raise SystemExit(f"galv: unknown command {' '.join(argv)!r}. HINT: galv --help lists the commands.")
    if debug:
        handler(rest)
        return
    try:
        handler(rest)
    except BrokenPipeError:  # the reader closed the pipe (galv plan show X | head): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        raise SystemExit(1) from None
    except USER_ERRORS as exc:
        rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK")
        where = f" [rank {rank}]" if rank not in (None, "0") else ""  # a multi-process run: every rank reports
        raise SystemExit(one_line_error(f"galv {cmd}{where}", exc)) from None


def one_line_error(prefix: str, exc: BaseException) -> str:
    """``prefix: error: message`` on one line; a HINT pointing at ``--debug`` when the message has none."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if "HINT:" not in text:
        text += " HINT: rerun with --debug for the traceback."
    return f"{prefix}: error: {text}"


def _plan(args: list[str]) -> None:
    if not args or args[0] in ("-h", "--help") or (args[0] == "show" and args[1:2] in (["-h"], ["--help"])):
        print(PLAN_HELP)
        return
    png = None
    if "--png" in args:
        i = args.index("--png")
        if i + 1 >= len(args):
            raise ValueError("galv plan show --png: missing the output file. HINT: galv plan show PLAN --png plan.png")
        png, args = args[i + 1], args[:i] + args[i + 2:]
    if args[0] != "show" or len(args) != 2:
        raise ValueError(f"galv plan {' '.join(args)!r}: expected 'show PLAN [--png OUT.png]'. HINT: galv plan show "
                         "recipes/plans/hetero4.yaml")
    from .plan import ParallelPlan

    plan = ParallelPlan.load(args[1])
    print(plan.describe())
    if png is not None:
        from .plots import plan_diagram

        plan_diagram(plan, png, title=f"{args[1]}: {plan.world_size} ranks, pp={plan.pp}")
        print(f"wrote {png}")


def _demo(args: list[str]) -> None:
    from .demo.run import main as demo

    demo(args)


def _lightning(cmd: str) -> Callable[[list[str]], None]:
    def run(args: list[str]) -> None:
        import warnings

        from .demo.recipes_cli import cli_main

        with warnings.catch_warnings():
            # LightningCLI gets this command's own arguments (sys.argv less the program and --debug), which
            # Lightning warns about as if they could disagree with sys.argv
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            cli_main([cmd, *args])

    return run


def _profile(args: list[str]) -> None:
    from .planning_cli import profile_command

    profile_command(args)


def _search(args: list[str]) -> None:
    from .planning_cli import search_command

    search_command(args)


def _tune(args: list[str]) -> None:
    import yaml

    ap = argparse.ArgumentParser(prog="galv tune", description="Measure the planner's best plans in real short "
                                 "runs (an Optuna study) and write the best measured plan.",
                                 epilog="example: galv tune --config recipes/tune_tiny.yaml --out best.yaml "
                                        "(see galv --help for the config's keys)")
    ap.add_argument("--config", required=True, help="YAML with the arguments of lightning_galv.tuning.tune")
    ap.add_argument("--out", default=None, help="where the plan is written (default best_plan.yaml, with "
                    "--batch-size largest_batch_plan.yaml)")
    ap.add_argument("--batch-size", action="store_true", help="find the largest batch --plan fits instead of tuning")
    ap.add_argument("--plan", default=None, help="with --batch-size: the plan file whose batch is searched")
    ap.add_argument("--quiet", action="store_true", help="no progress bar or per-trial lines (tables still print)")
    ns = ap.parse_args(args)
    with open(ns.config) as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict) or not {"module_factory", "data_factory", "devices"} <= set(cfg):
        raise ValueError(f"{ns.config!r}: must be a mapping with module_factory, data_factory and devices. "
                         "HINT: see galv --help for an example.")
    if ns.batch_size:
        _batch_size(cfg, ns.plan, ns.out or "largest_batch_plan.yaml")
        return
    if ns.plan is not None:
        raise SystemExit("galv tune: --plan is only read with --batch-size. HINT: galv tune --config C --batch-size "
                         "--plan PLAN, or drop --plan to tune.")
    ns.out = ns.out or "best_plan.yaml"
    from .tuning import tune

    if ns.quiet:
        cfg = {**cfg, "verbose": False}
    result = tune(**cfg, best_plan_path=ns.out)
    print(result.table())
    if result.best_plan is None:
        raise ValueError("galv tune: no trial completed within the memory budget. HINT: see the trials' fail_reason.")
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


COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "demo": _demo, "profile": _profile, "search": _search, "plan": _plan, "tune": _tune,
    **{cmd: _lightning(cmd) for cmd in ("fit", "validate", "test", "predict")},
}


if __name__ == "__main__":  # last: ``python -m lightning_galv.cli tune`` needs the helpers above defined
    main()
