"""Bring your Hugging Face model: a LightningModule over any supported ``transformers`` causal LM.

::

    from lightning_galv.hf import GalvHFCausalLM
    module = GalvHFCausalLM(AutoModelForCausalLM.from_config(config))   # or a model you already have

then ``Trainer(strategy=GalvatronStrategy(plan=...)).fit(module, loader)`` as for the reference models: the
module is :class:`~lightning_galv.demo.module.CausalLM` (next-token loss on ``[batch, seq+1]`` windows,
vocab-parallel-loss aware, pipeline protocol, optimizers) over :func:`lightning_galv.models.hf.galv_hf`,
which exposes the block protocol on the model without copying or renaming a weight (``module.model.hf`` is
the model itself, with its own ``state_dict`` keys). Families, limits and what is refused:
:mod:`lightning_galv.models.hf`. Needs the ``hf`` extra (``pip install "lightning_galv[hf]"``).
"""

from __future__ import annotations

from typing import Any

from .demo.module import CausalLM
from .models.hf import HFCausalLM, galv_hf

__all__ = ["GalvHFCausalLM", "HFCausalLM", "galv_hf"]


class GalvHFCausalLM(CausalLM):
    """:class:`CausalLM` whose network is a Hugging Face causal LM (an instance, or a config to build one from).

    ``untie_embeddings``: give a model with tied input/output embeddings (GPT-2's default) a head of its own,
    since the two may run under different strategies or pipeline stages (otherwise it is refused).

    ``config`` instead of ``model``: the keyword arguments of ``AutoConfig.for_model`` (``model_type`` plus the
    sizes), for YAML recipes (``galv fit --config``) and checkpoints -- a plain dict is a saved hyperparameter, so
    ``GalvHFCausalLM.load_from_checkpoint(path)`` rebuilds the model (random weights, then the checkpoint's)."""

    def __init__(self, model: Any = None, lr: float = 3e-3, weight_decay: float = 0.0, optimizer: str = "adamw",
                 momentum: float = 0.0, untie_embeddings: bool = False, config: dict[str, Any] | None = None) -> None:
        # LightningModule's __init__, not CausalLM's (which builds a reference decoder from its arguments); through
        # super(), whose __class__ cell is what lets save_hyperparameters find these arguments
        super(CausalLM, self).__init__()
        self.save_hyperparameters(ignore=["model"])
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer={optimizer!r}: must be 'adamw' or 'sgd'. HINT: optimizer='adamw'")
        if (model is None) == (config is None):
            raise ValueError(f"GalvHFCausalLM(model={type(model).__name__}, config={config!r}): give exactly one of "
                             "them. HINT: a transformers model or config as `model`, or AutoConfig.for_model's "
                             "keyword arguments as `config` (e.g. {'model_type': 'llama', 'hidden_size': 64, ...}).")
        if config is not None:
            model = _config_from_dict(config)
        self.model: HFCausalLM = galv_hf(model, untie_embeddings=untie_embeddings)


def _config_from_dict(config: dict[str, Any]) -> Any:
    """``AutoConfig.for_model(**config)``; ``model_type`` is required (ValueError with a HINT otherwise)."""
    from transformers import AutoConfig

    kw = dict(config)
    model_type = kw.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(f"config={config!r}: needs a 'model_type' string (the transformers family). HINT: e.g. "
                         "{'model_type': 'mixtral', 'hidden_size': 64, 'num_hidden_layers': 4, ...}.")
    return AutoConfig.for_model(model_type, **kw)
