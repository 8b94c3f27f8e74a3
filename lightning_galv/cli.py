"""``galv``: the command line.

    galv demo [--devices 4 --steps 40 --plan plan.yaml --auto]   train the tiny demo model
    galv plan show PLAN                                           print a plan file, validated
    galv fit --config recipes/tiny_cpu.yaml                        LightningCLI with our strategy
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
    elif cmd in ("fit", "validate", "test", "predict"):
        from .demo.recipes_cli import cli_main

        cli_main([cmd, *rest])
    else:
        raise SystemExit(f"galv: unknown command {' '.join(argv)!r}. HINT: galv --help")


if __name__ == "__main__":
    main()
