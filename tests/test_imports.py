"""The planner, plans and the light CLI commands import and run where torch and Lightning cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

RECIPE_PLAN = Path(__file__).resolve().parents[1] / "recipes" / "plans" / "hetero4.yaml"

BLOCKED = textwrap.dedent("""
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("torch", "lightning", "pytorch_lightning"):
                raise ImportError(f"blocked for this test: {name}")

    sys.meta_path.insert(0, Block())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_the_blocker_blocks() -> None:
    """Guard against a blocker that lets torch through (then the next test would prove nothing)."""
    out = _run("import torch")
    assert out.returncode != 0 and "blocked for this test: torch" in out.stderr


def test_planner_and_plan_cli_without_torch() -> None:
    out = _run(f"""
        import lightning_galv
        from lightning_galv import LayerStrategy, ParallelPlan
        from lightning_galv.planner import HardwareProfile, SearchSpace, search
        from lightning_galv.plan import ModelShape
        shape = ModelShape(num_layers=8, hidden=1024, num_heads=16, num_kv_heads=16, ffn_hidden=4096,
                           vocab_size=32000, seq_len=1024)
        best = search(shape, HardwareProfile.uniform(1, 8, 40e9), 8, 40e9, global_batch=16, top_k=1)[0]
        assert best.world_size == 8, best
        from lightning_galv.cli import main
        main(["--help"])
        main(["plan", "show", {str(RECIPE_PLAN)!r}])
        import sys
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning"))
        assert not heavy, heavy
        print("OK", best.describe().splitlines()[0])
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK ParallelPlan: world 8" in out.stdout and "ParallelPlan: world 4" in out.stdout


def test_strategy_is_registered_whichever_is_imported_first() -> None:
    code = """
        import sys
        {first}
        from lightning.pytorch.strategies import StrategyRegistry
        names = sorted(k for k in StrategyRegistry if k.startswith("galvatron"))
        assert len(names) == 8 and "galvatron_zero3" in names, names
        s = StrategyRegistry.get("galvatron_zero3")
        assert type(s).__name__ == "GalvatronStrategy" and s._shortcuts == {{"zero": 3}}, s
        print("OK")
    """
    for first in ("import lightning_galv\n        import lightning.pytorch",
                  "import lightning.pytorch\n        import lightning_galv"):
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code.format(first=first))], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0 and "OK" in out.stdout, (first, out.stderr[-3000:])
