"""Every recipe under recipes/ trains as ``galv fit --config`` (in a subprocess, on CPU ranks, at a tiny size):
the loss goes down and the checkpoint it writes loads into a plain ``CausalLM`` with the trained weights."""

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
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
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


def test_every_recipe_is_covered() -> None:
    names = {p.name for p in RECIPES}
    assert {"tiny_cpu.yaml", "gpt2_hybrid.yaml", "moe_ep.yaml", "long_seq.yaml", "llama_1b_auto.yaml"} <= names
    assert set(TINY) <= names


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step\s+(\d+)\s+loss\s+([0-9.]+)", text, flags=re.M)}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_trains_and_its_checkpoint_loads(recipe: Path, tmp_path: Path) -> None:
    # a fresh launch: no rank variables from a Trainer this process may have run (they would make rank 0 wait
    # for an external launcher's other ranks)
    launch_vars = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                   "GROUP_RANK"}
    env = {**{k: v for k, v in os.environ.items() if k not in launch_vars},
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_DATASETS_OFFLINE": "1", "GALV_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "lightning_galv.cli", "fit", "--config", str(recipe), *TINY.get(recipe.name, []),
           "--trainer.max_steps", str(STEPS), "--trainer.default_root_dir", str(tmp_path / "run")]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    losses = _losses(out.stdout)
    assert {1, STEPS} <= set(losses), text[-3000:]
    assert losses[STEPS] < losses[1] - 0.3, losses

    from lightning_galv.demo.corpus import DEFAULT_CORPUS, load_byte_tokens
    from lightning_galv.demo.module import CausalLM

    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file(), sorted(str(p) for p in (tmp_path / "run").rglob("*"))
    model = CausalLM.load_from_checkpoint(ckpt, map_location="cpu")
    overrides = dict(zip(TINY.get(recipe.name, [])[::2], TINY.get(recipe.name, [])[1::2]))
    seq = int(overrides.get("--data.seq_len", yaml.safe_load(recipe.read_text())["data"]["seq_len"]))
    tokens = load_byte_tokens([DEFAULT_CORPUS])[: 8 * seq + 1]
    batch = torch.stack([tokens[i * seq:i * seq + seq + 1] for i in range(7)])
    model.eval()
    with torch.no_grad():
        loss = float(model._loss(batch))
    # the loaded weights are the trained ones: near the last logged loss, far below the first
    assert loss < losses[1] - 0.3, (loss, losses)
