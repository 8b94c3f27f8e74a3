"""How local is one sample's routing? Entropy statistics of recorded routing traces (input to P6's reading).

    flock /tmp/galv-cpu.lock python benchmarks/trace_locality.py    # prints the table, updates RESULTS.md

NetMoE's placement can only save inter-node bytes when a sample's tokens prefer some experts (hence some
nodes) more than the batch as a whole does. Per (step, MoE layer) of a trace, with ``p_s`` sample ``s``'s
share of its assignments per expert and ``p`` the batch's (their mean):

* ``H(batch)`` = H(p) and ``H(sample)`` = mean_s H(p_s), in bits (log2 8 = 3 is uniform over 8 experts);
* ``I(sample; expert)`` = H(batch) - H(sample): the information a sample's identity carries about where its
  tokens go (0 = every sample routes like the batch);
* ``null I``: the same statistic when every sample's ``n`` assignments are drawn i.i.d. from the batch's
  ``p`` (a multinomial): what finite samples show with *no* locality. Only the excess over it is locality;
* ``best-node share``: mean over samples of the largest share of its assignments held by one node under
  plain EP on 2 nodes x 4 ranks (one expert per rank; 0.5 = none, 1 = all on one node), next to the null's;
* on traces with domain labels (the mixed corpus), ``I(domain; expert)`` = H(batch) - sum_d w_d H(p_d) with
  ``p_d`` the mean routing of the step's samples from domain ``d``: how much of the locality is the domain.

All statistics are averaged over the (step, layer) problems of each step range.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from traces import load_trace  # noqa: E402

TRACES = ("corpus_moe.npz", "mixed_moe.npz", "mixed_moe_seq256.npz", "corpus_moe_seq256.npz", "mixed_moe_top1.npz")


def _entropy(p: np.ndarray) -> np.ndarray:
    """Entropy in bits along the last axis."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log2(p), 0.0).sum(-1)


def locality(counts: np.ndarray, domain: np.ndarray | None = None, nodes: int = 2, seed: int = 0) -> dict:
    """``counts [steps, layers, samples, experts]``; ``domain [steps, samples]`` or None. Means over problems."""
    if counts.ndim != 4 or counts.shape[-1] % nodes:
        raise ValueError(f"counts shape {counts.shape}: must be [steps, layers, samples, experts] with experts a "
                         f"multiple of nodes={nodes}. HINT: pass Trace.counts.")
    c = counts.astype(np.float64)
    n = c.sum(-1, keepdims=True)
    p_s = c / n
    p = p_s.mean(2)  # [steps, layers, E]
    h_batch = _entropy(p)
    h_sample = _entropy(p_s).mean(-1)
    e = c.shape[-1]
    node_share = p_s.reshape(*p_s.shape[:-1], nodes, e // nodes).sum(-1).max(-1).mean(-1)
    rng = np.random.default_rng(seed)
    flat_p = p.reshape(-1, e)
    null = np.stack([rng.multinomial(int(n.flat[0]), flat_p[i], size=c.shape[2]) for i in range(len(flat_p))])
    null = null.reshape(c.shape) / n
    null_i = h_batch - _entropy(null).mean(-1)
    null_node = null.reshape(*null.shape[:-1], nodes, e // nodes).sum(-1).max(-1).mean(-1)
    out = dict(h_batch=h_batch.mean(), h_sample=h_sample.mean(), mi=(h_batch - h_sample).mean(), null_mi=null_i.mean(),
               node=node_share.mean(), null_node=null_node.mean())
    if domain is not None:
        ids = np.unique(domain)
        h_dom = np.zeros(h_batch.shape)
        for d in ids:
            m = (domain == d).astype(np.float64)  # [steps, samples]
            w = m.mean(1)  # [steps]
            with np.errstate(invalid="ignore"):
                p_d = np.einsum("ts,tlse->tle", m, p_s) / m.sum(1)[:, None, None]
            h_dom += np.where(w[:, None] > 0, w[:, None] * _entropy(np.nan_to_num(p_d)), 0.0)
        out["dom_mi"] = (h_batch - h_dom).mean()
    return out


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", nargs="*", default=list(TRACES), help="files under benchmarks/traces/")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    rows = ["| trace (corpus, sample length, experts / top-k) | steps | H(batch) | H(sample) | I(sample; expert) | "
            "null I (no locality) | I(domain; expert) | best-node share (null) | loss at range end |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name in args.traces:
        path = HERE / "traces" / name
        if not path.is_file():
            raise ValueError(f"trace {path}: not found. HINT: record it with benchmarks/record_traces.py (see its "
                             "docstring), or pass --traces with the ones you have.")
        t = load_trace(path)
        with np.load(path) as d:
            dom = d["domain"].astype(np.int64) if "domain" in d.files else None
            loss = d["loss"]
        m = t.meta
        label = (f"{name}: {'mixed-domain' if 'domains' in m else 'shipped single-domain'} corpus, "
                 f"{m['seq']} tokens, {m['num_experts']} / top-{m['top_k']}")
        edges = sorted({0, t.steps} | {x for x in (50, t.steps // 2) if 0 < x < t.steps})
        for a, b in zip(edges[:-1], edges[1:]):
            r = locality(t.counts[a:b], None if dom is None else dom[a:b])
            dm = f"{r['dom_mi']:.3f}" if "dom_mi" in r else "n/a"
            rows.append(f"| {label} | {a}-{b - 1} | {r['h_batch']:.3f} | {r['h_sample']:.3f} | **{r['mi']:.3f}** | "
                        f"{r['null_mi']:.3f} | {dm} | {r['node']:.3f} ({r['null_node']:.3f}) | {loss[b - 1]:.3f} |")
            print(rows[-1], flush=True)
    body = ("## P6 traces: per-sample routing locality (benchmarks/trace_locality.py)\n\n"
            "Entropies in bits over the experts, averaged over every (step, MoE layer) of the step range. "
            "I(sample; expert) = H(batch) - H(sample); \"null I\" is the same statistic for samples drawn i.i.d. "
            "from the batch's routing (multinomial, same assignments per sample): locality is the excess over it. "
            "Best-node share: a sample's largest share of assignments on one of 2 nodes x 4 ranks (plain EP), mean "
            "over samples; the null's in brackets. I(domain; expert): the part explained by the window's majority "
            "domain (mixed corpus only). Traces recorded by benchmarks/record_traces.py (one CPU process, fixed "
            "seeds).\n\n" + "\n".join(rows) + "\n")
    print(body)
    if not args.no_write:
        from _results import write_section

        write_section("trace_locality", body)
    return body


if __name__ == "__main__":
    main()
