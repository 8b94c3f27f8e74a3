"""Every recipe under recipes/ trains as ``galv fit --config`` (run from outside the repository, on CPU ranks, at a
tiny size): the shipped demo recipe (tiny_cpu) as a user starts it -- one ``galv`` process whose Lightning
launcher starts the other ranks as fresh interpreters -- and the others torchrun-style, every rank running the
command itself, forked from the suite's servers that have torch and Lightning imported (a fresh ``import
lightning`` costs ~11 s of CPU per rank: 20-30 s of each recipe's run on 2 cores). Either way
the loss goes down and the checkpoint it writes loads into a plain ``CausalLM`` (or the ``CausalLM`` subclass the
recipe names with ``class_path``, e.g. ``GalvHFCausalLM``) with the trained weights.
Tuning recipes (``module_factory:`` keys, read by ``galv tune --config``) run their study and write the best
plan; a recipe may point its data at local JSON Lines / parquet files and a local tokenizer.json."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _is_tune_config(path: Path) -> bool:
    return "module_factory" in (yaml.safe_load(path.read_text()) or {})


RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if not _is_tune_config(p))
TUNE_RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if _is_tune_config(p))
STEPS = 10
# what makes a recipe tiny enough for CPU ranks; recipes not listed run as written
TINY: dict[str, list[str]] = {
    "llama_1b_auto.yaml": ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.precision", "32-true",
                           "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
                           "--model.n_kv_heads", "2", "--model.ffn_hidden", "128", "--model.max_seq_len", "64",
                           "--model.lr", "0.003", "--model.weight_decay", "0.0", "--data.seq_len", "64",
                           "--trainer.strategy.init_args.save_distributed_checkpoint", "false"],
    "long_seq.yaml": ["--model.max_seq_len", "256", "--data.seq_len", "256"],
}
# more options for one recipe's run: the shipped demo recipe also validates mid-fit (every 5 training batches)
EXTRA: dict[str, list[str]] = {"tiny_cpu.yaml": ["--trainer.val_check_interval", "5"]}
LEAFSPEC = "`isinstance(treespec, LeafSpec)` is deprecated"  # known_warnings.KNOWN_WARNINGS[0]: once, rank 0


def test_every_recipe_is_covered() -> None:
    names = {p.name for p in RECIPES}
    assert {"tiny_cpu.yaml", "gpt2_hybrid.yaml", "moe_ep.yaml", "long_seq.yaml", "llama_1b_auto.yaml",
            "hf_mixtral_ep.yaml"} <= names
    assert set(TINY) <= names
    assert {p.name for p in TUNE_RECIPES} == {"tune_tiny.yaml"}


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step\s+(\d+)\s+loss\s+([0-9.]+)", text, flags=re.M)}


def _env(tmp_path: Path) -> dict[str, str]:
    """A fresh launch's environment: no rank variables from a Trainer this process may have run (they would make
    rank 0 wait for an external launcher's other ranks), this worktree first on the path, caches in tmp_path."""
    launch_vars = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                   "GROUP_RANK"}
    return {**{k: v for k, v in os.environ.items() if k not in launch_vars},
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "HF_DATASETS_OFFLINE": "1", "GALV_CACHE_DIR": str(tmp_path / "cache")}


def galv_fit_rank(args: list[str]) -> None:
    """One rank of a torchrun-style ``galv fit`` (run by ``run_distributed``: the launch variables are set)."""
    from lightning_galv.cli import main

    main(["fit", *args])


def _devices(recipe: Path) -> int:
    over = TINY.get(recipe.name, [])
    if "--trainer.devices" in over:
        return int(over[over.index("--trainer.devices") + 1])
    return int(yaml.safe_load(recipe.read_text())["trainer"]["devices"])


#: run by Lightning's own launcher, as the README's first command runs it
LAUNCHED_BY_LIGHTNING = {"tiny_cpu.yaml"}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_trains_and_its_checkpoint_loads(recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    args = ["--config", str(recipe), *TINY.get(recipe.name, []), *EXTRA.get(recipe.name, []),
            "--trainer.max_steps", str(STEPS), "--trainer.default_root_dir", str(tmp_path / "run")]
    if recipe.name in LAUNCHED_BY_LIGHTNING:
        out = subprocess.run([sys.executable, "-m", "lightning_galv.cli", "fit", *args], cwd=tmp_path,
                             env=_env(tmp_path), capture_output=True, text=True, timeout=600)  # outside the repo
        text, rank0 = out.stdout + out.stderr, out.stdout
        assert out.returncode == 0, text[-5000:]
    else:
        from lightning_galv.testing import run_distributed

        monkeypatch.chdir(tmp_path)  # outside the repo
        monkeypatch.setenv("GALV_CACHE_DIR", str(tmp_path / "cache"))
        logs: list[str] = []
        run_distributed(f"{__file__}::galv_fit_rank", _devices(recipe), (args,), init_process_group=False,
                        timeout=600, rank_logs=logs)
        text, rank0 = "\n".join(logs), logs[0]
    # known third-party warnings are printed once (rank 0), jsonargparse's own complaint never
    assert text.count(LEAFSPEC) <= 1 and "args parameter is intended" not in text, text[-5000:]
    if recipe.name == "tiny_cpu.yaml":
        assert text.count(LEAFSPEC) == 1, text[-5000:]
    losses = _losses(rank0)
    assert {1, STEPS} <= set(losses), text[-3000:]
    assert losses[STEPS] < losses[1] - 0.3, losses

    from lightning_galv.demo.corpus import DEFAULT_CORPUS, load_byte_tokens
    from lightning_galv.demo.module import CausalLM

    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file(), sorted(str(p) for p in (tmp_path / "run").rglob("*"))
    named = (yaml.safe_load(recipe.read_text())["model"] or {}).get("class_path")
    cls = CausalLM
    if named:  # a CausalLM subclass (GalvHFCausalLM rebuilds its HF model from the saved config dict)
        import importlib

        module_name, _, cls_name = named.rpartition(".")
        cls = getattr(importlib.import_module(module_name), cls_name)
        assert issubclass(cls, CausalLM), named
    model = cls.load_from_checkpoint(ckpt, map_location="cpu")
    if named and hasattr(model.model, "hf"):  # the HF model's own keys and full shapes (EP shards gathered)
        from transformers import AutoModelForCausalLM

        fresh = AutoModelForCausalLM.from_config(model.model.hf.config)
        assert {k: v.shape for k, v in model.model.hf.state_dict().items()} == \
            {k: v.shape for k, v in fresh.state_dict().items()}
    overrides = dict(zip(TINY.get(recipe.name, [])[::2], TINY.get(recipe.name, [])[1::2]))
    seq = int(overrides.get("--data.seq_len", yaml.safe_load(recipe.read_text())["data"]["seq_len"]))
    tokens = load_byte_tokens([DEFAULT_CORPUS])[: 8 * seq + 1]
    batch = torch.stack([tokens[i * seq:i * seq + seq + 1] for i in range(7)])
    model.eval()
    with torch.no_grad():
        loss = float(model._loss(batch))
    # the loaded weights are the trained ones: near the last logged loss, far below the first
    assert loss < losses[1] - 0.3, (loss, losses)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", TUNE_RECIPES, ids=lambda p: p.stem)
def test_tuning_recipe_completes_and_writes_the_best_plan(recipe: Path, tmp_path: Path) -> None:
    """``galv tune --config`` as written (2 trials on 2 CPU ranks), from another folder: the study completes
    its trials and the best measured plan is written and loads."""
    from lightning_galv.plan import ParallelPlan

    cfg = yaml.safe_load(recipe.read_text())
    cmd = [sys.executable, "-m", "lightning_galv.cli", "tune", "--config", str(recipe), "--out", "best.yaml"]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("| ") and ln[2:3].isdigit()]
    assert len(rows) == cfg["n_trials"] and sum("COMPLETE" in r for r in rows) >= 1, out.stdout
    plan = ParallelPlan.load(tmp_path / "best.yaml")
    assert plan.world_size == cfg["devices"] and "best:" in out.stdout and "best.yaml" in out.stdout
    assert (tmp_path / "galv-tune.db").is_file()  # the study's storage, relative to the current folder


@pytest.mark.slow
def test_a_recipe_reads_local_parquet_with_a_local_tokenizer(tmp_path: Path) -> None:
    """A recipe (in its own folder) names a parquet file, its text column and a tokenizer.json trained here
    (no hub), relative to itself; ``galv fit`` on 2 CPU ranks trains on those tokens (vocab 320), and the
    token cache goes where ``data.cache_dir`` says."""
    pytest.importorskip("tokenizers")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_galv.demo.corpus import DEFAULT_CORPUS
    from lightning_galv.plan import LayerStrategy, ParallelPlan
    from test_corpus import _train_tokenizer

    folder = tmp_path / "recipe"
    folder.mkdir()
    lines = DEFAULT_CORPUS.read_text(encoding="utf-8").split("\n")
    pq.write_table(pa.table({"body": lines, "n": list(range(len(lines)))}), folder / "corpus.parquet")
    _train_tokenizer(folder / "tokenizer.json", 320)
    ParallelPlan.uniform(2, 4, LayerStrategy(dp=2)).save(folder / "dp2.yaml")
    recipe = yaml.safe_load((ROOT / "recipes" / "tiny_cpu.yaml").read_text())
    recipe["trainer"]["devices"] = 2
    recipe["trainer"].pop("callbacks")  # no checkpoints here (LossLog, a default, still prints the loss)
    recipe["trainer"]["strategy"]["init_args"]["plan"] = "dp2.yaml"
    recipe["model"]["vocab_size"] = 320
    recipe["data"].update(files="corpus.parquet", text_field="body", tokenizer="tokenizer.json",
                          cache_dir=str(tmp_path / "tokens"))
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "lightning_galv.cli", "fit", "--config", str(folder / "recipe.yaml"),
           "--trainer.max_steps", str(STEPS), "--trainer.default_root_dir", str(tmp_path / "run"),
           "--trainer.enable_checkpointing", "false"]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    losses = _losses(out.stdout)
    assert {1, STEPS} <= set(losses) and losses[STEPS] < losses[1], losses
    assert losses[1] > 5.0, losses  # ~ln(320): the model predicts over the tokenizer's 320 ids
    assert len(list((tmp_path / "tokens" / "lightning_galv_tokens").glob("tokens-*.arrow"))) == 1
