"""The galv command: recipes, help, one-line errors, and (in subprocesses, a few CPU ranks) demo, fit,
profile and search as a new user would run them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_galv import GalvatronStrategy, LayerStrategy
from lightning_galv.cli import main as galv
from lightning_galv.plan import ParallelPlan

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"


LEAFSPEC = "`isinstance(treespec, LeafSpec)` is deprecated"  # known_warnings.KNOWN_WARNINGS[0]: once, rank 0

def _cli(args: list[str]):  # type: ignore[no-untyped-def]
    from lightning_galv.demo.recipes_cli import cli_main

    return cli_main(args, run=False)


def test_recipe_builds_the_strategy_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe names its plan relative to itself: it loads from a folder that is not the repository."""
    monkeypatch.chdir(tmp_path)
    cli = _cli(["--config", str(RECIPE)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, GalvatronStrategy)
    assert strategy._plan_spec == ParallelPlan.load(ROOT / "recipes/plans/hetero4.yaml")
    assert cli.model.hparams.n_heads == 8 and cli.datamodule.batch_size == 4


def test_recipe_paths_follow_the_file_and_command_line_paths_the_folder(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    sub = tmp_path / "r"
    sub.mkdir()
    ParallelPlan.uniform(4, 4, LayerStrategy(dp=4)).save(sub / "dp4.yaml")
    (sub / "recipe.yaml").write_text(RECIPE.read_text().replace("plans/hetero4.yaml", "dp4.yaml")
                                     + "  files: [my.txt]\n")
    monkeypatch.chdir(tmp_path)
    cli = _cli(["--config", "r/recipe.yaml"])
    assert cli.trainer.strategy._plan_spec.layers[0] == LayerStrategy(dp=4)
    assert cli.datamodule.files == [str(sub.resolve() / "my.txt")]
    # a plan given on the command line is relative to the current folder, like any command-line path
    ParallelPlan.uniform(4, 4, LayerStrategy(tp=2, dp=2)).save(tmp_path / "tp2.yaml")
    cli = _cli(["--config", "r/recipe.yaml", "--trainer.strategy.init_args.plan", "tp2.yaml"])
    assert cli.trainer.strategy._plan_spec.layers[0] == LayerStrategy(tp=2, dp=2)


def test_galv_plan_show(capsys: pytest.CaptureFixture[str]) -> None:
    galv(["plan", "show", str(ROOT / "recipes/plans/hetero4.yaml")])
    out = capsys.readouterr().out
    assert "tp+sp4" in out and "ulysses2·dp2" in out


def test_galv_unknown_command() -> None:
    with pytest.raises(SystemExit, match="HINT"):
        galv(["frobnicate"])


@pytest.mark.parametrize("argv", [["plan", "--help"], ["plan"], ["plan", "show", "--help"]])
def test_galv_plan_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    galv(argv)
    out = capsys.readouterr().out
    assert "usage: galv plan show PLAN" in out and "examples:" in out and "--png" in out


@pytest.mark.parametrize("cmd", ["demo", "profile", "search", "tune", "fit", "validate"])
def test_every_command_help_has_an_example(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        galv([cmd, "--help"])
    assert done.value.code in (0, None)
    out = capsys.readouterr().out
    assert f"galv {cmd}" in out and "example" in out, out[-2000:]


def _galv(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess:
    penv = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "HF_DATASETS_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "lightning_galv.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or ROOT, env=penv)


def test_errors_are_one_line_with_a_hint_unless_debug(tmp_path: Path) -> None:
    out = _galv("plan", "show", str(tmp_path / "missing.yaml"))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("galv plan: error:") and "HINT:" in lines[0], out.stderr
    debug = _galv("plan", "show", str(tmp_path / "missing.yaml"), "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_a_closed_pipe_ends_quietly() -> None:
    """``galv plan show X | head -0``: the reader is gone before galv writes; no traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "lightning_galv.cli", "plan", "show",
                             str(ROOT / "recipes/plans/hetero4.yaml")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_demo_refuses_steps_below_one(steps: str) -> None:
    with pytest.raises(SystemExit, match=rf"'--steps {steps}': must be >= 1.*HINT"):
        galv(["demo", "--steps", steps])


def test_search_refuses_a_galvatron_export_it_cannot_express(tmp_path: Path) -> None:
    """The YAML is written; the Galvatron writer's own error is reported, not a traceback."""
    from lightning_galv.planning_cli import write_outputs

    plan = ParallelPlan(4, layers=(LayerStrategy(dp=2),) * 4, pp=2, micro_batches=4, global_batch=8,
                        pipeline_schedule="interleaved_1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match=r"--galvatron .*not written.*Galvatron plans know GPipe and 1F1B only.*HINT"):
        write_outputs(plan, 1, tmp_path / "p.yaml", tmp_path / "p.json")
    assert ParallelPlan.load(tmp_path / "p.yaml") == plan and not (tmp_path / "p.json").exists()


def test_profile_then_search_write_the_cache_the_table_and_the_plan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """2 CPU ranks: galv profile fills the cache and prints its table; galv search (a new process, as a user
    runs it next) reuses it, prints the top-k with predictions, and writes the plan YAML and Galvatron JSON
    (which read back as the same plan). The profile runs in this process (its ranks fork from the suite's
    servers); the progress-bar test below runs both in-process, test_errors_* the one-line errors."""
    from lightning_galv.compat.galvatron import read_plan, write_plan

    env = {"GALV_CACHE_DIR": str(tmp_path / "cache")}
    monkeypatch.setenv("GALV_CACHE_DIR", env["GALV_CACHE_DIR"])
    monkeypatch.delenv("GALV_PROFILE_BUDGET_S")  # the default budget, as a user's first profile runs (conftest sets 0)
    monkeypatch.chdir(tmp_path)
    galv(["profile", "--devices", "2"])
    prof = capsys.readouterr().out
    assert "fwd ms/sample" in prof and "allreduce/2/consec" in prof, prof
    assert "4 interleaved rounds (up to 16 within 20 s)" in prof, prof
    # rank 0's progress is shown as it measures (not a terminal here: lines, no bar)
    assert "[galv profile] allreduce group 2" in prof and "[galv profile] block fwd+bwd" in prof, prof
    cached = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").glob("*.json"))
    assert "hardware" in cached and "model" in cached, cached
    out = _galv("search", "--devices", "2", "--top-k", "3", "--out", "plan.yaml", "--galvatron", "plan.json",
                cwd=tmp_path, env=env)
    assert "ms/step" in out.stdout and "samples/s" in out.stdout and "peak memory per stage" in out.stdout
    assert "[galv profile] model profile from cache" in out.stdout, out.stdout
    rows = [ln for ln in out.stdout.splitlines() if ln.strip()[:2].strip().isdigit() and "[" in ln]
    assert 1 <= len(rows) <= 3, out.stdout
    plan = ParallelPlan.load(tmp_path / "plan.yaml")
    # the demo's loader batch is 4 per data shard, and a pp-stage pipeline has 2 / pp shards
    assert plan.world_size == 2 and plan.prediction is not None and plan.global_batch == 4 * 2 // plan.pp
    # which plan wins depends on this machine's timings; Galvatron can express some plans only
    try:
        write_plan(plan)
    except ValueError as exc:  # refused: the writer's own error on one line, the YAML still written
        assert out.returncode == 1 and not (tmp_path / "plan.json").exists(), out.stderr
        assert out.stderr.strip() == f"galv search: error: --galvatron plan.json: not written, Galvatron cannot " \
                                     f"express plan #1 (plan.yaml was written): {exc}"
    else:
        assert out.returncode == 0, out.stderr[-3000:]
        assert read_plan(json.loads((tmp_path / "plan.json").read_text()), 2).layers == plan.layers


def test_demo_auto_beyond_one_epoch_prints_its_plan_once_and_the_loss(tmp_path: Path) -> None:
    """2 CPU ranks, automatic mode, 4 steps of a 2-batch epoch: the plan is printed once, the loss every step
    shown, the known per-step library warning shows once (rank 0, first step) instead of per rank and step, and the
    run ends with its final loss -- and, its batch being larger than the validation split, says why it has no
    validation loss."""
    out = _galv("demo", "--devices", "2", "--auto", "--batch-size", "1024", "--steps", "4", cwd=tmp_path,
                env={"GALV_CACHE_DIR": str(tmp_path / "cache")})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert text.count("ParallelPlan: world 2") == 1, text
    assert "step    4  loss" in text and "final train_loss" in text, text
    assert text.count(LEAFSPEC) == 1, text
    # 512 samples per rank: the validation split has no full batch, and the run says so (once printed a NaN loss
    # after Lightning's "Total length of `DataLoader` across ranks is zero")
    m = re.search(r"no val_loss: the validation split's (\d+) windows give (\d+) per data shard, fewer than one "
                  r"batch of 512 \(HINT: a --batch-size of at most (\d+) validates\)", text)
    assert m and -(-int(m[1]) // 2) == int(m[2]) < 512 and int(m[3]) == 2 * int(m[2]), text[-3000:]
    assert "nan" not in text.split("final train_loss")[1] and "across ranks is zero" not in text, text[-3000:]
    # the session's GALV_PROFILE_BUDGET_S=0 (conftest) reached the ranks: the minimum rounds, no budget
    assert re.search(r"\[galv profile\] timing .* 4 interleaved rounds$", text, re.M), text


def test_fit_error_is_one_line_per_rank(tmp_path: Path) -> None:
    """A plan for 4 ranks on 2: each rank says so in one line (rank 1 marked), no traceback."""
    out = _galv("fit", "--config", str(RECIPE), "--trainer.devices", "2", cwd=tmp_path)
    errors = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert errors[0].startswith("galv fit: error: plan world_size=4") and "HINT:" in errors[0], errors
    assert all(e.startswith(("galv fit: error:", "galv fit [rank 1]: error:")) for e in errors), errors


def test_messages_and_docs_name_only_commands_that_exist() -> None:
    """Every ``galv WORD`` in the package's text and the README is a real command (HINTs once named a
    ``galv search`` that did not exist)."""
    import re

    from lightning_galv.cli import COMMANDS

    named = set()
    for path in [*sorted((ROOT / "lightning_galv").rglob("*.py")), ROOT / "README.md"]:
        named |= {(m, path.name) for m in re.findall(r"\bgalv ([a-z]+)\b", path.read_text())}
    unknown = sorted((word, where) for word, where in named if word not in COMMANDS)
    assert not unknown, unknown
    assert {"search", "profile"} <= {word for word, _ in named}


def test_profile_and_search_progress_bars_render_on_stderr_and_leave_the_tables_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """As on a terminal (2 CPU ranks): galv profile draws a bar over the measurements and galv search one over
    the configurations it searches, on stderr; stdout keeps the tables, with no bar and no carriage return in
    them. --quiet draws no bar and prints no progress line."""
    from lightning_galv import planning_cli

    monkeypatch.setenv("GALV_CACHE_DIR", str(tmp_path / "cache"))
    # the ranks import this checkout, offline: conftest's session environment (shared with every launch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(planning_cli, "_interactive", lambda: True)
    galv(["profile", "--devices", "2"])
    out, err = capsys.readouterr()
    import re

    counts = [int(n) for n in re.findall(r"galv profile: (\d+) measurements", err)]
    assert counts and max(counts) >= 10, err[-2000:]  # collectives, blocks, sharded blocks: counted as they come
    assert "fwd ms/sample" in out and "allreduce/2/consec" in out and "\r" not in out, out
    assert "[galv profile] allreduce" not in out  # the bar shows the lines, stdout does not repeat them
    galv(["search", "--devices", "2", "--top-k", "2", "--out", "plan.yaml"])
    out, err = capsys.readouterr()
    assert "galv search" in err and "config" in err and "100%" in err and "pp=1" in err, err[-2000:]
    assert "ms/step" in out and "peak memory per stage" in out and "\r" not in out, out
    galv(["search", "--devices", "2", "--top-k", "2", "--out", "plan.yaml", "--quiet"])
    out, err = capsys.readouterr()
    assert "ms/step" in out and "%" not in err and "[galv profile]" not in out and "[galv search] (" not in out, out
    # --seq-len: the same cached profile carried to twice the demo's 64 tokens prices every plan higher per sample,
    # so the best plan found has fewer samples/s than the best at the profiled length (the two may differ in their
    # pipeline degree, hence in their global batch: compare per sample)
    galv(["search", "--devices", "2", "--top-k", "2", "--out", "plan128.yaml", "--quiet", "--seq-len", "128"])
    out, err = capsys.readouterr()
    assert "priced at 128 tokens per sample from the profile measured at 64" in out, out
    at64, at128 = ParallelPlan.load(tmp_path / "plan.yaml"), ParallelPlan.load(tmp_path / "plan128.yaml")
    assert at64.prediction is not None and at128.prediction is not None
    assert 1.1 * at128.prediction.throughput < at64.prediction.throughput, (at64.prediction, at128.prediction)


@pytest.mark.parametrize("value", ["0", "-64"])
def test_search_refuses_a_sequence_length_below_one(value: str) -> None:
    with pytest.raises(SystemExit, match=rf"--seq-len {value}.*positive number of tokens.*HINT"):
        galv(["search", "--seq-len", value])


def test_measure_progress_without_a_terminal_prints_the_lines() -> None:
    from lightning_galv.planning_cli import MeasureProgress

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        p = MeasureProgress(bars=False)
        p.line("[galv profile] p2p")
        p.line("[galv search] (0/2) pp=1 global batch 8 micro-batches [1]")
        p.line("something else")
        p.close()
        MeasureProgress(bars=False, quiet=True).line("[galv profile] p2p")
    assert buf.getvalue().splitlines() == ["[galv profile] p2p", "[galv search] (0/2) pp=1 global batch 8 micro-batches [1]"]
