"""The main job and its parts: what a user of the package would write, in one place.

* ``corpus.py`` -- :class:`ByteCorpus`, a ``LightningDataModule`` over local text / JSON / parquet files read
  through Hugging Face ``datasets`` (``corpus.txt``, generated and shipped, is the default), tokenized once
  into a ``Dataset.map`` cache: bytes by default, or a local ``tokenizer.json``;
* ``factories.py`` -- importable model / data factories for ``galv tune`` recipes (``recipes/tune_tiny.yaml``);
* ``module.py`` -- :class:`CausalLM`, a plain ``LightningModule`` around the reference decoders;
* ``run.py`` -- the demo (``galv demo`` / ``python -m lightning_galv.demo``): 4 CPU ranks, a heterogeneous plan;
* ``recipes_cli.py`` -- the ``LightningCLI`` behind ``galv fit --config recipes/*.yaml``.

Nothing here is imported by the package root, so ``import lightning_galv`` stays light.
"""
