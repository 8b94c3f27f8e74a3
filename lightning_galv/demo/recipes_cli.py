"""LightningCLI entry for YAML recipes (``galv fit --config recipes/tiny_cpu.yaml``).

Two things differ from a bare ``LightningCLI``:

* **paths inside a recipe are relative to the recipe file**, not to the folder the command runs in, so a
  recipe works from anywhere (``galv fit --config ~/r/tiny_cpu.yaml``). This covers the inputs a recipe
  names (:data:`RECIPE_PATH_KEYS`: the strategy's plan file, the corpus files, the tokenizer file); a value
  given on the command line instead stays relative to the current folder, like any command-line path;
* runs without a progress bar print the training loss on rank 0 (:class:`~lightning_galv.callbacks.LossLog`);
* a recipe's ``model:`` may name a subclass of :class:`~lightning_galv.demo.module.CausalLM` with
  ``class_path`` / ``init_args`` (e.g. :class:`lightning_galv.hf.GalvHFCausalLM` over a Hugging Face model); the
  reference-model recipes give ``CausalLM``'s arguments directly, as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.cli import LightningCLI

import lightning_galv  # noqa: F401  (registers the strategies)

from ..callbacks.loss_log import LossLog
from .corpus import ByteCorpus
from .module import CausalLM

# dotted keys of a recipe whose values are input files (a string, or a list of strings)
# (outputs -- default_root_dir, data.cache_dir -- stay relative to the current folder, like Lightning's own)
RECIPE_PATH_KEYS = ("trainer.strategy.init_args.plan", "data.files", "data.tokenizer")

EXAMPLES = {
    "fit": "galv fit --config recipes/tiny_cpu.yaml [--trainer.max_steps 10]",
    "validate": "galv validate --config recipes/tiny_cpu.yaml --ckpt_path CKPT",
    "test": "galv test --config recipes/tiny_cpu.yaml --ckpt_path CKPT",
    "predict": "galv predict --config recipes/tiny_cpu.yaml --ckpt_path CKPT",
}


def _lookup(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _relative_to(base: Path, value: Any) -> Any:
    """``value`` (a path string or a list of them) with each relative path joined to ``base``."""
    if isinstance(value, str) and value and not os.path.isabs(value) and "\n" not in value:
        return str(base / value)
    if isinstance(value, list):
        return [_relative_to(base, v) for v in value]
    return value


def resolve_recipe_paths(config: Any) -> None:
    """Rewrite, in a parsed LightningCLI ``config``, each :data:`RECIPE_PATH_KEYS` value that a ``--config``
    file set (and nothing later overrode) to be relative to that file's folder."""
    for source in config.get("config") or []:
        path = Path(getattr(source, "absolute", None) or str(source))
        try:
            raw = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue  # jsonargparse already read it; a file it could not read failed there
        for key in RECIPE_PATH_KEYS:
            given = _lookup(raw, key)
            if given is not None and given == config.get(key):  # still the recipe's value
                config[key] = _relative_to(path.parent, given)


class GalvCLI(LightningCLI):
    """``LightningCLI`` with recipe-relative paths (see the module docstring)."""

    def before_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        resolve_recipe_paths(config)


def names_model_class(args: list[str]) -> bool:
    """Whether a ``--config`` file among ``args`` gives ``model:`` as ``class_path`` / ``init_args``: LightningCLI must
    then parse the model in subclass mode (decided before parsing, so it reads the recipe files itself)."""
    configs = [v for k, v in zip(args, args[1:]) if k == "--config"]
    configs += [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    for path in configs:
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue  # jsonargparse reports it
        if isinstance(raw, dict) and isinstance(raw.get("model"), dict) and "class_path" in raw["model"]:
            return True
    return False


def cli_main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    import sys

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    parser_kwargs: dict[str, Any] = {cmd: {"epilog": f"example: {ex}"} for cmd, ex in EXAMPLES.items()} if run else {}
    subclass = names_model_class(list(sys.argv[1:] if args is None else args))
    return GalvCLI(CausalLM, ByteCorpus, args=args, run=run, save_config_kwargs={"overwrite": True},
                   trainer_defaults={"callbacks": [LossLog(every=10)]}, parser_kwargs=parser_kwargs,
                   subclass_mode_model=subclass)


if __name__ == "__main__":
    cli_main()
