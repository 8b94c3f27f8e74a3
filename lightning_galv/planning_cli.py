"""``galv profile`` and ``galv search``: the automatic mode's profile and search, run by hand.

Both build the model (and data module) of a recipe -- ``--config`` a LightningCLI YAML, default the demo's
tiny model -- on ``--devices`` CPU ranks (gloo), and measure exactly what automatic mode
(``Trainer(strategy="galvatron")``) measures, through the same functions (:func:`lightning_galv.auto.
measure_profiles`, :func:`lightning_galv.auto.search_run_plans`) and the same cache (``$GALV_CACHE_DIR``):
a ``galv profile`` run makes the next ``galv search`` and the next automatic fit skip profiling.

``galv search`` searches what the recipe's run can execute (global batch = the data module's
``batch_size`` x data shards, pipelines only when the LightningModule has the pipeline hooks), prints the
top-k plans with predicted step time, throughput and per-stage memory, writes the chosen plan as YAML
(``GalvatronStrategy(plan=...)`` or a recipe's ``trainer.strategy.init_args.plan``) and, with
``--galvatron``, as Galvatron JSON. ``--seq-len n`` prices the plans at n tokens per sample from the profile
measured at the recipe's length (:meth:`~lightning_galv.planner.ModelProfile.with_seq_len`), so a long-sequence
plan needs no long-sequence profile.

Measurements run on CPU processes: on a GPU machine this prices CPU collectives. There, let automatic
mode profile the GPUs inside the Trainer (it caches the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from .errors import bad_value
from .plan import ParallelPlan
from .units import format_bytes

PROFILE_EXAMPLE = """examples:
  galv profile                                   # the demo model on 4 CPU ranks
  galv profile --config recipes/tiny_cpu.yaml --devices 4
  GALV_CACHE_DIR=/tmp/c galv profile              # measure into another cache folder"""

SEARCH_EXAMPLE = """examples:
  galv search --config recipes/tiny_cpu.yaml --top-k 5 --out plan.yaml
  galv search --memory-budget 512MiB --galvatron galvatron_plan.json
  galv search --seq-len 256                      # plans priced at 256 tokens per sample
  galv fit --config recipes/tiny_cpu.yaml --trainer.strategy.init_args.plan plan.yaml"""


def _parser(prog: str, description: str, epilog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="a LightningCLI recipe (model: / data: sections); default: the demo's tiny model")
    p.add_argument("--devices", type=int, default=None,
                   help="CPU ranks to measure on (default: the recipe's trainer.devices, else 4)")
    p.add_argument("--memory-budget", default=None,
                   help="memory per rank, e.g. 2GB or 512MiB (default: this machine's RAM / devices)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the measuring ranks are stopped")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar and no per-measurement lines (the tables are still printed)")
    return p


def _recipe(config: str | None) -> dict[str, Any]:
    """The recipe's YAML as a dict ({} without one); a bad path fails here, before any process starts."""
    if config is None:
        return {}
    import yaml

    path = Path(config)
    if not path.is_file():
        raise bad_value(config, "recipe file not found", "pass a LightningCLI YAML, e.g. --config recipes/tiny_cpu.yaml")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise bad_value(config, "a recipe must be a YAML mapping", "see recipes/tiny_cpu.yaml")
    return data


def _devices(ns: argparse.Namespace, recipe: dict[str, Any]) -> int:
    devices = ns.devices
    if devices is None:
        devices = (recipe.get("trainer") or {}).get("devices", 4)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise bad_value(f"--devices {devices}", "must be a positive int (a number of CPU ranks)", "e.g. --devices 4")
    return devices


def build_module_and_batch(config: str | None) -> tuple[Any, int | None]:
    """The LightningModule of ``config`` (or the demo's) and its per-shard loader batch (None if unknown)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if config is None:
        from .demo.module import CausalLM
        from .demo.run import DEMO_MODEL

        return CausalLM(**DEMO_MODEL), 4
    from .demo.recipes_cli import cli_main

    cli = cli_main(["--config", str(config), "--trainer.devices", "1", "--trainer.strategy", "auto",
                    "--trainer.logger", "false"], run=False)
    batch = getattr(cli.datamodule, "batch_size", None)
    return cli.model, batch if isinstance(batch, int) and batch > 0 else None


def _measure_worker(config: str | None, budget: float | None, search: dict[str, Any] | None) -> Any:
    """One rank of ``galv profile`` / ``galv search``: profiles (all ranks), then the search (rank 0).

    Returns ``("ok", payload)`` on rank 0 (None elsewhere) or ``("error", kind, message)`` on every rank
    for a user error, so the parent prints one line instead of four tracebacks.
    """
    import torch
    import torch.distributed as dist

    from .auto import device_memory, measure_profiles, search_run_plans
    from .models.protocol import find_parts
    from .parallel.pipeline import PIPELINE_HOOKS
    from .planner import ProfileCache
    from .planner.search import DEFAULT_MEMORY_MARGIN

    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        module, loader_batch = build_module_and_batch(config)
        parts = find_parts(module)
        if not parts.understood or parts.shape is None:
            raise bad_value(type(module).__name__, "the model does not implement the block protocol, so there "
                            "is nothing to profile or search (automatic mode trains it data-parallel)",
                            "expose galv_blocks / galv_shape (lightning_galv.models.protocol)")
        cap = budget if budget is not None else device_memory(torch.device("cpu"))
        profile, hw = measure_profiles(module, parts, world, cap, verbose=rank == 0, loader_batch=loader_batch)
        if rank != 0:
            return None
        payload: dict[str, Any] = {"model": profile.to_json(), "hardware": hw.to_json() if hw else None,
                                   "cache": str(ProfileCache().directory), "budget": cap,
                                   "loader_batch": loader_batch}
        if search is not None:
            notes: list[str] = []
            if search.get("seq_len") not in (None, profile.seq_len):
                # a profile carried to a length it was not measured at (first order, issue 17's held-out check)
                measured = profile.seq_len
                profile = profile.with_seq_len(search["seq_len"])
                notes.append(f"priced at {profile.seq_len} tokens per sample from the profile measured at "
                             f"{measured} (ModelProfile.with_seq_len, first order): the model must run that length")
            pipeline = all(callable(getattr(module, n, None)) for n in PIPELINE_HOOKS)

            def searching(i: int, n: int, what: str) -> None:  # read by the parent's progress bar
                print(f"{SEARCH_LINE} ({i}/{n}) {what}", file=sys.stderr, flush=True)

            found = search_run_plans(profile, hw, world, len(parts.blocks), cap, DEFAULT_MEMORY_MARGIN,
                                     loader_batch, pipeline, bool(getattr(module, "galv_vocab_parallel_loss", False)),
                                     top_k=search["top_k"], progress=searching, sp_modes=parts.sp_modes,
                                     check_plan=parts.check_plan)
            payload.update(plans=[p.to_dict() for p in found.plans], notes=notes + list(found.notes),
                           seq_len=profile.shape.seq_len)
        return ("ok", payload)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return ("error", type(exc).__name__, str(exc))


PROFILE_LINE = "[galv profile]"  # the profilers' progress lines (lightning_galv.profiling.profilers._progress)
SEARCH_LINE = "[galv search]"  # the search's: "[galv search] (i/n) what", one per configuration searched


def _interactive() -> bool:
    """Progress bars only where a person watches: a terminal on stderr (logs and pipes get plain lines)."""
    return sys.stderr.isatty()


class MeasureProgress:
    """``galv profile`` / ``galv search`` progress in the parent process, fed by rank 0's lines (the only
    rank that reports; the parent is the only process that draws).

    With ``bars`` (a terminal): a tqdm bar on stderr over the measurements -- a count, since which of them
    the profile cache already holds is known only as they come -- showing the current one, then a bar over
    the search's configurations (pipeline degrees / micro-batch counts). Without: the lines themselves, on
    stdout, as before the bars existed (a log keeps them). ``quiet``: neither. The style is the tuner's
    (:class:`lightning_galv.tuning.tuner._Progress`).
    """

    def __init__(self, bars: bool, quiet: bool = False) -> None:
        self.bars, self.quiet = bars and not quiet, quiet
        self._measure: Any = None
        self._search: Any = None
        self.measurements = 0

    def line(self, line: str) -> None:
        if self.quiet or not line.startswith((PROFILE_LINE, SEARCH_LINE)):
            return
        if not self.bars:
            print(line, flush=True)
            return
        from tqdm import tqdm

        if line.startswith(PROFILE_LINE):
            what = line[len(PROFILE_LINE):].strip()
            if self._measure is None:
                self._measure = tqdm(total=None, desc="galv profile", unit=" measurements", dynamic_ncols=True)
            self.measurements += 1
            self._measure.set_postfix_str(what, refresh=False)
            self._measure.update(1)
            return
        m = re.match(r"\s*\((\d+)/(\d+)\)\s*(.*)", line[len(SEARCH_LINE):])
        if m is None:
            return
        i, n, what = int(m.group(1)), int(m.group(2)), m.group(3)
        self._close_measure()
        if self._search is None:
            self._search = tqdm(total=n, desc="galv search", unit="config", dynamic_ncols=True)
        self._search.n = i
        self._search.set_postfix_str(what, refresh=False)
        self._search.refresh()

    def _close_measure(self) -> None:
        if self._measure is not None:
            self._measure.close()
            self._measure = None

    def close(self) -> None:
        """Finish the bars (the search's at 100 %: its last configuration was searched) before the tables."""
        self._close_measure()
        if self._search is not None:
            self._search.n = self._search.total
            self._search.refresh()
            self._search.close()
            self._search = None


def _launch(ns: argparse.Namespace, what: str, search: dict[str, Any] | None) -> dict[str, Any]:
    from .auto import parse_bytes
    from .testing import run_distributed

    recipe = _recipe(ns.config)
    devices = _devices(ns, recipe)
    budget = parse_bytes(ns.memory_budget) if ns.memory_budget is not None else None
    config = str(Path(ns.config).resolve()) if ns.config else None
    print(f"[galv {what}] {'the demo model' if config is None else config} on {devices} CPU rank(s); cached "
          "profiles are reused", flush=True)
    progress = MeasureProgress(_interactive(), ns.quiet)
    try:
        results = run_distributed("lightning_galv.planning_cli:_measure_worker", devices, (config, budget, search),
                                  timeout=ns.timeout, rank0_lines=progress.line)
    finally:
        progress.close()
    for r in results:
        if r is not None and r[0] == "error":
            _, kind, message = r
            raise (TypeError if kind == "TypeError" else ValueError)(message)
    assert results[0] is not None
    return results[0][1]


def profile_command(argv: list[str]) -> None:
    """``galv profile``: measure, cache, print a table."""
    p = _parser("galv profile", "Measure this machine's collectives and the model's blocks (time, memory, "
                "sharded variants) the way automatic mode does, store them in the profile cache "
                "($GALV_CACHE_DIR, default ~/.cache/lightning_galv), and print them.", PROFILE_EXAMPLE)
    ns = p.parse_args(argv)
    out = _launch(ns, "profile", None)
    print(profile_table(out["model"], out["hardware"]))
    print(f"cached in {out['cache']} (GALV_CACHE_DIR); galv search and Trainer(strategy='galvatron') reuse it")


def profile_table(model_json: str, hardware_json: str | None) -> str:
    """The profiles as a table: per layer type time and memory, per collective latency and bandwidth."""
    from .planner import HardwareProfile, ModelProfile

    m = ModelProfile.from_json(model_json)
    s = m.shape
    tokens = s.seq_len  # one sample
    lines = [f"model {m.name}: {s.num_layers} layers, hidden {s.hidden}, seq {s.seq_len}, vocab {s.vocab_size}, "
             f"{m.precision}",
             f"  {'layer type':<28} {'layers':>6} {'params':>10} {'fwd ms/sample':>14} {'bwd ms/sample':>14} "
             f"{'activations/sample':>19}"]
    for j, lt in enumerate(m.layer_types):
        count = sum(1 for t in m.layer_type_of if t == j)
        act = lt.activation_bytes.get("tp1/none", 0.0)
        lines.append(f"  {lt.name[:28]:<28} {count:>6} {lt.params:>10,} {lt.forward(1, tokens) * 1e3:>14.3f} "
                     f"{lt.backward(1, tokens) * 1e3:>14.3f} {format_bytes(act):>19}")
    lines.append(f"  embedding {m.embed_params:,} params, head {m.head_params:,} params, per-rank fixed "
                 f"{format_bytes(m.framework_bytes)}")
    if hardware_json is None:
        lines.append("hardware: one rank, no collectives to measure")
        return "\n".join(lines)
    hw = HardwareProfile.from_json(hardware_json)
    lines += [f"hardware {hw.name}: {hw.num_nodes} node(s) x {hw.gpus_per_node} ranks, overlap slowdown "
              f"{hw.overlap_slowdown:.2f}",
              f"  {'collective / group':<34} {'latency us':>11} {'bandwidth':>14}"]
    for key, fit in sorted(hw.links.items()):
        lines.append(f"  {key:<34} {fit.latency_s * 1e6:>11.1f} {format_bytes(fit.bandwidth) + '/s':>14}")
    for key, fit in sorted(hw.p2p.items()):
        lines.append(f"  {'p2p ' + key:<34} {fit.latency_s * 1e6:>11.1f} {format_bytes(fit.bandwidth) + '/s':>14}")
    return "\n".join(lines)


def search_command(argv: list[str]) -> None:
    """``galv search``: top-k plans with predictions; write the chosen one."""
    p = _parser("galv search", "Search the fastest plans for a recipe's model on this machine (profiling first, "
                "or reading the profile cache), print the top-k with predicted step time, throughput and "
                "memory, and write the chosen plan.", SEARCH_EXAMPLE)
    p.add_argument("--top-k", type=int, default=5, help="plans to print (default 5)")
    p.add_argument("--pick", type=int, default=1, help="which of the printed plans to write (default 1: the best)")
    p.add_argument("--out", default="galv_plan.yaml", help="where the chosen plan is written as YAML")
    p.add_argument("--galvatron", default=None, metavar="JSON",
                   help="also write the chosen plan as a Galvatron plan JSON (if Galvatron can express it)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="price the plans at N tokens per sample, carrying the profile measured at the recipe's "
                        "length there (ModelProfile.with_seq_len: first order; default: the profiled length)")
    ns = p.parse_args(argv)
    if ns.seq_len is not None and ns.seq_len < 1:
        raise bad_value(f"--seq-len {ns.seq_len}", "must be a positive number of tokens per sample",
                        "e.g. --seq-len 256, or leave it out to plan at the profiled length")
    if ns.top_k < 1:
        raise bad_value(f"--top-k {ns.top_k}", "must be >= 1", "e.g. --top-k 5")
    if not 1 <= ns.pick <= ns.top_k:
        raise bad_value(f"--pick {ns.pick}", f"must be between 1 and --top-k ({ns.top_k})", "e.g. --pick 1")
    out = _launch(ns, "search", {"top_k": ns.top_k, "seq_len": ns.seq_len})
    plans = [ParallelPlan.from_dict(d) for d in out["plans"]][: ns.top_k]
    print("\n".join(f"  {n}" for n in out["notes"]))
    print(plan_table(plans, out["seq_len"], out["budget"]))
    if ns.pick > len(plans):
        raise bad_value(f"--pick {ns.pick}", f"only {len(plans)} plans fit", f"pick one of 1..{len(plans)}")
    chosen = plans[ns.pick - 1]
    print(chosen.describe())
    write_outputs(chosen, ns.pick, ns.out, ns.galvatron)


def write_outputs(plan: ParallelPlan, pick: int, out: str | Path, galvatron: str | Path | None) -> None:
    """Write ``plan`` as YAML to ``out`` and, if asked, as Galvatron JSON; the YAML is written first, so a
    plan Galvatron cannot express (its writer raises ``ValueError``) still leaves a usable plan file."""
    plan.save(out)
    print(f"wrote plan #{pick} to {out} (GalvatronStrategy(plan={str(out)!r}), or a recipe's "
          "trainer.strategy.init_args.plan)")
    if galvatron:
        from .compat.galvatron import write_plan

        try:
            data = write_plan(plan)
        except ValueError as exc:
            raise ValueError(f"--galvatron {galvatron}: not written, Galvatron cannot express plan #{pick} "
                             f"({out} was written): {exc}") from exc
        Path(galvatron).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote plan #{pick} as Galvatron JSON to {galvatron}")


def plan_table(plans: list[ParallelPlan], seq_len: int, budget: float) -> str:
    """One row per plan: shape, layer strategies, predicted step time, throughput and per-stage memory."""
    from .planner.explain import summary

    lines = [f"top {len(plans)} plans (budget {format_bytes(budget)} per rank):",
             f"  {'#':>2} {'pp':>3} {'schedule':<16} {'m':>3} {'batch':>6} {'layers':<28} {'ms/step':>9} "
             f"{'samples/s':>10} {'tokens/s':>10}  peak memory per stage"]
    for i, plan in enumerate(plans, start=1):
        pred = plan.prediction
        assert pred is not None
        mem = ", ".join(format_bytes(m) for m in pred.stage_memory_bytes)
        lines.append(f"  {i:>2} {plan.pp:>3} {plan.pipeline_schedule:<16} {plan.micro_batches:>3} "
                     f"{plan.global_batch or 0:>6} {summary(plan)[:28]:<28} {pred.step_time_s * 1e3:>9.2f} "
                     f"{pred.throughput:>10.1f} {pred.throughput * seq_len:>10.0f}  [{mem}]")
    return "\n".join(lines)
