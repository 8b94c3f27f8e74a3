"""How lightning_galv imports: the planner, plans and the light CLI commands import and run where torch and
Lightning cannot be imported, and the package's import graph (function-level imports included) has no cycle."""

from __future__ import annotations

import ast
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


def test_every_planner_module_imports_without_torch() -> None:
    """Each module of ``planner/`` (found on disk, so a new module is covered the day it lands), the error
    helper and the plan import alone in a process where torch and Lightning cannot be imported."""
    planner = Path(__file__).resolve().parents[1] / "lightning_galv" / "planner"
    modules = sorted(f"lightning_galv.planner.{p.stem}" for p in planner.glob("*.py") if p.stem != "__init__")
    assert {"lightning_galv.planner.search", "lightning_galv.planner.searcher", "lightning_galv.planner.space",
            "lightning_galv.planner.layer_dp", "lightning_galv.planner.partition", "lightning_galv.planner.pareto",
            "lightning_galv.planner.explain", "lightning_galv.planner.contract"} <= set(modules), modules
    for name in modules + ["lightning_galv.errors", "lightning_galv.plan"]:
        out = _run(f"""
            import importlib, sys
            importlib.import_module({name!r})
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning"))
            assert not heavy, heavy
            print("OK")
        """)
        assert out.returncode == 0 and "OK" in out.stdout, (name, out.stderr[-3000:])


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
    orders = ("import lightning_galv\n        import lightning.pytorch",
              "import lightning.pytorch\n        import lightning_galv")
    # both fresh interpreters at once (each import is single-threaded: the second core would idle)
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code.format(first=first))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for first in orders]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for first, p, (stdout, stderr) in zip(orders, procs, outs):
        assert p.returncode == 0 and "OK" in stdout, (first, stderr[-3000:])


# ---------------------------------------------------------------------------------------------------
# the package's import graph has no cycle
# ---------------------------------------------------------------------------------------------------
PACKAGE_DIR = Path(__file__).resolve().parents[1] / "lightning_galv"


def import_graph(root: Path, package: str) -> dict[str, dict[str, str]]:
    """``{module: {imported module: "file:line" of the first such import}}`` within ``package`` at ``root``.

    Every ``import`` / ``from ... import`` statement counts wherever it sits (module level, inside a
    function, under ``if TYPE_CHECKING``): a function-level import only defers a cycle to run time, it
    does not remove the two modules' dependence on each other. Relative imports are resolved against the
    importing module (``__init__.py`` is its package). ``from pkg import name`` points at ``pkg.name`` when
    that is a module, else at ``pkg`` itself. Importing a submodule is not counted as importing its parent
    packages (every module would then depend on the root). Imports from outside ``package`` are ignored.
    """
    files: dict[str, tuple[Path, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        files[".".join((package, *(parts[:-1] if is_package else parts)))] = (path, is_package)

    def known(name: str) -> str | None:
        """The longest prefix of ``name`` that is a module of the package (``a.b.func`` -> ``a.b``)."""
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, str]] = {}
    for module, (path, is_package) in files.items():
        edges: dict[str, str] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module if is_package else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                hit = known(target)
                if hit is not None and hit != module:
                    edges.setdefault(hit, f"{path.relative_to(root.parent)}:{node.lineno}")
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One shortest cycle ``[a, b, ..., a]`` per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package is far too small for the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: set[str] = set()
            while not comp or v not in comp:
                comp.add(stack.pop())
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in components:
        start = min(comp)
        paths = {start: [start]}  # breadth-first inside the component, back to start
        frontier = [start]
        cycle: list[str] | None = None
        while cycle is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        cycle = paths[v] + [start]
                        break
                    if w in comp and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if cycle is not None:
                    break
            frontier = nxt
        cycles.append(cycle)
    return sorted(cycles)


def _describe(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    return "\n".join(f"  {a} -> {b}  ({graph[a][b]})" for a, b in zip(cycle, cycle[1:]))


def test_import_graph_has_no_cycle() -> None:
    """No two modules of lightning_galv depend on each other, even through function-level imports.

    A cycle means neither module can be understood (or imported, or moved) without the other; the
    function-level imports that make it load are the symptom. Break it by moving what both need into a
    module of its own (as ``parallel/boundary.py`` holds what TP and Ulysses share).
    """
    graph = import_graph(PACKAGE_DIR, "lightning_galv")
    assert len(graph) > 40 and "lightning_galv.parallel.block" in graph, sorted(graph)  # walked the package
    cycles = import_cycles(graph)
    assert not cycles, "import cycles in lightning_galv:\n" + "\n\n".join(_describe(c, graph) for c in cycles)


def test_cycle_finder_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    """Negative control: a cycle made of a function-level ``from .. import`` and a package-relative import
    is found, with its path; the acyclic rest of the toy package is not reported."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .plan import Plan\n")
    (pkg / "plan.py").write_text("import os\nclass Plan: ...\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "tensor.py").write_text("from ..plan import Plan\ndef f():\n    from .sequence import g\n")
    (pkg / "sub" / "sequence.py").write_text("from toy.sub import tensor\n")
    (pkg / "sub" / "leaf.py").write_text("from . import tensor\nfrom .. import plan\n")
    graph = import_graph(pkg, "toy")
    assert graph["toy"] == {"toy.plan": "toy/__init__.py:1"}
    assert set(graph["toy.sub.leaf"]) == {"toy.sub.tensor", "toy.plan"}
    assert graph["toy.sub.tensor"]["toy.sub.sequence"] == "toy/sub/tensor.py:3"
    cycles = import_cycles(graph)
    assert cycles == [["toy.sub.sequence", "toy.sub.tensor", "toy.sub.sequence"]], cycles
    assert "toy/sub/tensor.py:3" in _describe(cycles[0], graph)
