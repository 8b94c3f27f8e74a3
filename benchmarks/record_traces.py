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

Corpora (``--corpus``): ``shipped`` (default; the trace ``traces/corpus_moe.npz``), ``mixed`` (the
mixed-domain corpus of ``mixed_corpus.py``: prose, math/tables, Python code, Russian; default output
``traces/mixed_moe.npz``), or a path to a local ``.txt`` / ``.jsonl`` / ``.parquet`` corpus. On the mixed
corpus every sample's window is also labelled with the domain of most of its input bytes.

    flock /tmp/galv-cpu.lock python benchmarks/record_traces.py --corpus mixed

Saved (``np.savez_compressed``): ``counts [steps, layers, samples, experts]`` uint16, ``layers`` (block
indices), ``windows [steps, samples]`` (corpus window of each sample), ``loss`` / ``aux_loss [steps]``,
the config as JSON in ``meta`` (with the corpus file's sha256), and on the mixed corpus ``domain [steps,
samples]`` (index into ``meta["domains"]``) and ``domain_purity [steps, samples]`` (share of the window's
input bytes from that domain).
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
sys.path.insert(0, str(HERE))

import mixed_corpus  # noqa: E402

from lightning_galv.demo.corpus import DEFAULT_CORPUS, TokenWindows, load_tokens  # noqa: E402
from lightning_galv.demo.module import CausalLM  # noqa: E402
from lightning_galv.loss import cross_entropy  # noqa: E402

OUT = HERE / "traces" / "corpus_moe.npz"
OUTS = {"shipped": OUT, "mixed": HERE / "traces" / "mixed_moe.npz"}


def resolve_corpus(corpus: str) -> tuple[Path, bool]:
    """(file, is the mixed-domain corpus) for ``--corpus``: ``shipped``, ``mixed`` or an existing file."""
    if corpus == "shipped":
        return DEFAULT_CORPUS, False
    if corpus == "mixed":
        return mixed_corpus.MIXED_CORPUS, True
    p = Path(corpus).expanduser()
    if not p.is_file():
        raise ValueError(f"--corpus {corpus!r}: not 'shipped', 'mixed' or an existing file. HINT: pass --corpus mixed "
                         "for the mixed-domain corpus, or a local .txt / .jsonl / .parquet file.")
    return p, p.resolve() == mixed_corpus.MIXED_CORPUS.resolve()


def window_domains(dom: np.ndarray, n_windows: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Per window (``TokenWindows`` layout: window i's inputs are tokens ``[i seq, (i+1) seq)``): the domain of
    most of its input bytes and that domain's share."""
    d = dom[:n_windows * seq].reshape(n_windows, seq).astype(np.int64)
    share = np.stack([(d == j).mean(1) for j in range(len(mixed_corpus.DOMAINS))], 1)
    return share.argmax(1).astype(np.int8), share.max(1).astype(np.float32)


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
    ap.add_argument("--corpus", default="shipped", help="shipped | mixed | a path to a local corpus file")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="default: traces/corpus_moe.npz (shipped), "
                    "traces/mixed_moe.npz (mixed)")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "seq", "experts", "top_k"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1. HINT: e.g. --steps 300 "
                             "--batch 32 --seq 64 --experts 8 --top-k 2.")
    if args.top_k > args.experts:
        raise ValueError(f"--top-k {args.top_k} > --experts {args.experts}. HINT: top-k picks distinct experts.")
    corpus_file, is_mixed = resolve_corpus(args.corpus)
    out = args.out or OUTS.get(args.corpus)
    if out is None:
        raise ValueError(f"--corpus {args.corpus}: a custom corpus needs --out. HINT: e.g. --out "
                         "benchmarks/traces/my_moe.npz.")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    cfg = dict(kind="moe", vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128,
               max_seq_len=args.seq, num_experts=args.experts, top_k=args.top_k, moe_every=1, lr=3e-3)
    module = CausalLM(**cfg)
    model = module.model
    model.set_aux_grad_scale(1.0)  # no accumulation: the injected aux gradient is scaled like the loss
    model.routing_log.enable()
    opt = module.configure_optimizers()
    tokens = load_tokens([corpus_file], text_field="text")  # byte tokens, through the package's corpus loader
    data = TokenWindows(tokens, args.seq)
    if len(data) < args.batch:
        raise ValueError(f"corpus {corpus_file}: {len(data)} windows of {args.seq} tokens < --batch {args.batch}. "
                         "HINT: a smaller --seq or --batch, or a larger corpus.")
    win_dom = win_pur = None
    if is_mixed:
        docs = mixed_corpus.read_documents(corpus_file)
        dom = mixed_corpus.domain_of_bytes(docs)
        if dom.size != tokens.numel():
            raise RuntimeError(f"{corpus_file}: {tokens.numel()} tokens but {dom.size} bytes of documents")
        win_dom, win_pur = window_domains(dom, len(data), args.seq)
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
    meta = dict(cfg, steps=args.steps, batch=args.batch, seq=args.seq, seed=args.seed, corpus=corpus_file.name,
                corpus_sha256=mixed_corpus.sha256(corpus_file), aux_loss_weight=model.cfg.aux_loss_weight,
                z_loss_weight=model.cfg.z_loss_weight, optimizer="adamw", recorded_with="benchmarks/record_traces.py")
    extra = {}
    if is_mixed:
        meta["domains"] = list(mixed_corpus.DOMAINS)
        extra = dict(domain=win_dom[windows], domain_purity=win_pur[windows].astype(np.float16))
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, counts=counts, layers=np.array(layers), windows=windows, loss=losses,
                        aux_loss=auxes, meta=np.array(json.dumps(meta)), **extra)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    return out


if __name__ == "__main__":
    main()
