"""Record MoE routing traces: tokens per (sample, expert) of every MoE layer at every training step.

    flock /tmp/galv-cpu.lock python benchmarks/record_traces.py     # writes benchmarks/traces/corpus_moe.npz

Why a recorded trace: the sample-placement (NetMoE) and expert re-layout (LAER-MoE) planners are only as
good as the routing they see, and routing on random tokens misstates both the skew over experts and how
concentrated one sample's tokens are. So we train the package's MoE reference (``CausalLM(kind="moe")``:
8 SwiGLU experts, top-2, dropless, every block MoE, the default aux/z-loss weights) on the shipped text
corpus (``lightning_galv.demo.corpus``, byte tokens) in one CPU process, and keep what the router chose.

How the per-sample matrix is obtained without touching ``models/moe.py``: :class:`RoutingStats` holds
counts per expert summed over the micro-batch, not per sample. A forward *pre*-hook on each ``MoELayer``
sees its input ``[b, s, dim]`` and re-runs ``layer.route`` on it under ``no_grad``; the router is a
deterministic function of its input, so the top-k ids are the ones the forward is about to use. Every
step checks that the per-sample counts, summed over samples, equal the layer's own ``RoutingStats``
(``routing_log``) exactly, so a mismatch cannot go unnoticed.

Saved (``np.savez_compressed``): ``counts [steps, layers, samples, experts]`` uint16, ``layers`` (block
indices), ``windows [steps, samples]`` (corpus window of each sample), ``loss`` / ``aux_loss [steps]``,
and the config as JSON in ``meta``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lightning_galv.demo.corpus import DEFAULT_CORPUS, TokenWindows, load_byte_tokens  # noqa: E402
from lightning_galv.demo.module import CausalLM  # noqa: E402
from lightning_galv.loss import cross_entropy  # noqa: E402

OUT = HERE / "traces" / "corpus_moe.npz"


def per_sample_recorder(model: torch.nn.Module) -> tuple[dict[int, np.ndarray], list]:
    """Install pre-hooks on every MoE layer; returns (layer index -> last [b, E] counts, hook handles)."""
    last: dict[int, np.ndarray] = {}
    handles = []

    def hook(layer, args):  # type: ignore[no-untyped-def]
        (x,) = args
        b, s, d = x.shape
        with torch.no_grad():
            _, _, _, ids = layer.route(x.reshape(b * s, d))  # [T, k], T row-major over (sample, position)
        per = torch.zeros(b, layer.num_experts, dtype=torch.int64)
        per.scatter_add_(1, ids.reshape(b, s * layer.top_k), torch.ones(b, s * layer.top_k, dtype=torch.int64))
        last[layer.layer_idx] = per.numpy()

    for layer in model.moe_layers:
        handles.append(layer.register_forward_pre_hook(hook))
    return last, handles


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    cfg = dict(kind="moe", vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128,
               max_seq_len=args.seq, num_experts=8, top_k=2, moe_every=1, lr=3e-3)
    module = CausalLM(**cfg)
    model = module.model
    model.set_aux_grad_scale(1.0)  # no accumulation: the injected aux gradient is scaled like the loss
    model.routing_log.enable()
    opt = module.configure_optimizers()
    data = TokenWindows(load_byte_tokens([DEFAULT_CORPUS]), args.seq)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(data), generator=gen)
    last, _ = per_sample_recorder(model)
    layers = sorted(m.layer_idx for m in model.moe_layers)
    e = cfg["num_experts"]
    counts = np.zeros((args.steps, len(layers), args.batch, e), np.uint16)
    windows = np.zeros((args.steps, args.batch), np.int32)
    losses, auxes = np.zeros(args.steps), np.zeros(args.steps)
    t0 = time.perf_counter()
    pos = 0
    for step in range(args.steps):
        if pos + args.batch > len(order):
            order, pos = torch.randperm(len(data), generator=gen), 0
        idx = order[pos:pos + args.batch]
        pos += args.batch
        batch = torch.stack([data[int(i)] for i in idx])  # [b, seq + 1]
        loss = cross_entropy(module(batch[:, :-1]), batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        stats = {s.layer: s for s in model.routing_log.drain()}
        for j, li in enumerate(layers):
            per = last[li]
            if tuple(per.sum(0).tolist()) != stats[li].routed_per_expert:  # the hook saw what the layer routed
                raise RuntimeError(f"step {step} layer {li}: per-sample counts {per.sum(0)} != RoutingStats "
                                   f"{stats[li].routed_per_expert}")
            counts[step, j] = per
        windows[step] = idx.numpy()
        losses[step] = loss.item()
        auxes[step] = float(model.aux_losses()["aux_loss"])
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[step]:.3f}  aux {auxes[step]:.3f}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    meta = dict(cfg, steps=args.steps, batch=args.batch, seq=args.seq, seed=args.seed, corpus=DEFAULT_CORPUS.name,
                aux_loss_weight=model.cfg.aux_loss_weight, z_loss_weight=model.cfg.z_loss_weight,
                optimizer="adamw", recorded_with="benchmarks/record_traces.py")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, counts=counts, layers=np.array(layers), windows=windows, loss=losses,
                        aux_loss=auxes, meta=np.array(json.dumps(meta)))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")
    return args.out


if __name__ == "__main__":
    main()
