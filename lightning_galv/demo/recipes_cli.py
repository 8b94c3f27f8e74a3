"""LightningCLI entry for YAML recipes (``galv fit --config recipes/tiny_cpu.yaml``)."""

from __future__ import annotations

import os

from lightning.pytorch.cli import LightningCLI

import lightning_galv  # noqa: F401  (registers the strategies)

from .corpus import ByteCorpus
from .module import CausalLM


def cli_main(args: list[str] | None = None) -> LightningCLI:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return LightningCLI(CausalLM, ByteCorpus, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    cli_main()
