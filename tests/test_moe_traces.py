"""The routing trace shipped under benchmarks/ and its scaling (benchmarks/traces.py): pure numpy."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from traces import _dirichlet_multinomial, load_trace, rank_tokens, scale_trace  # noqa: E402


def test_recorded_trace_is_consistent() -> None:
    t = load_trace()
    assert t.counts.shape == (t.steps, len(t.layers), t.samples, t.experts) == (300, 4, 32, 8)
    # every sample routes each of its tokens to top_k distinct experts
    assert np.all(t.counts.sum(-1) == t.tokens_per_sample * t.top_k)
    assert np.all(t.counts <= t.tokens_per_sample)
    load = t.expert_load()
    assert (load.max(-1) / load.mean(-1)).max() > 1.5  # the corpus trace is skewed somewhere


def test_scale_trace_keeps_parent_totals() -> None:
    t = load_trace()
    sc = scale_trace(t, 16, 4, 64, steps=[0, 150], layers=[1, 3], seed=3)
    assert sc.counts.shape == (2, 2, 64, 64) and sc.layers == (t.layers[1], t.layers[3])
    assert np.all(sc.counts.sum(-1) == t.tokens_per_sample * t.top_k)
    parents = sc.counts.reshape(2, 2, 64, 8, 8).sum(-1)  # children e*8..e*8+7 add back to recorded expert e
    for i, step in enumerate((0, 150)):
        recorded = {tuple(row) for row in t.counts[step, [1, 3]].transpose(1, 0, 2).reshape(t.samples, -1)}
        drawn = parents[i].transpose(1, 0, 2).reshape(64, -1)  # a sample's two layers come from one recording
        assert all(tuple(row) in recorded for row in drawn)
    merged = scale_trace(t, 8, 4, 4, steps=[7], seed=0)  # fewer experts: exact merges of pairs
    assert np.all(merged.counts.sum(-1) == t.tokens_per_sample * t.top_k)
    assert rank_tokens(sc.counts[0, 0], 16).shape == (64, 16)
    with pytest.raises(ValueError, match="HINT:"):
        scale_trace(t, 4, 4, 12)


def test_dirichlet_multinomial_concentration() -> None:
    """Small alpha keeps a cell's tokens on one child, large alpha spreads them (mean share 1/g)."""
    rng = np.random.default_rng(0)
    n = np.full(4000, 16)
    tight = _dirichlet_multinomial(rng, n, 8, 0.01)
    loose = _dirichlet_multinomial(rng, n, 8, 100.0)
    assert np.all(tight.sum(1) == 16) and np.all(loose.sum(1) == 16)
    # Polya urn: all 16 tokens on one child with probability prod_{i=1..15} (alpha + i) / (g alpha + i)
    exact = float(np.prod([(0.01 + i) / (0.08 + i) for i in range(1, 16)]))  # 0.79
    assert (tight.max(1) == 16).mean() == pytest.approx(exact, abs=0.035)  # 5 sigma of 4000 draws
    assert loose.max(1).mean() < 6
    assert loose.mean(0) == pytest.approx(np.full(8, 2.0), rel=0.05)


# ---------------------------------------------------------------------------------------------------------------
# the mixed-domain corpus (benchmarks/mixed_corpus.py), recording on it, and the locality statistics
# ---------------------------------------------------------------------------------------------------------------
import json  # noqa: E402

import mixed_corpus  # noqa: E402
import record_traces  # noqa: E402
from trace_locality import locality  # noqa: E402


def test_mixed_corpus_is_deterministic_and_has_its_mix() -> None:
    docs = mixed_corpus.build_documents(0)
    assert docs == mixed_corpus.build_documents(0)
    assert docs != mixed_corpus.build_documents(1)  # the seed shuffles
    nbytes = {d: sum(len(t.encode()) + 1 for dd, t in docs if dd == d) for d in mixed_corpus.DOMAINS}
    total = sum(nbytes.values())
    for d, share in mixed_corpus.MIX.items():
        assert nbytes[d] / total == pytest.approx(share, abs=0.01), d
    shipped = mixed_corpus.read_documents()
    assert mixed_corpus.MIXED_CORPUS.stat().st_size < 1_000_000
    dom = mixed_corpus.domain_of_bytes(shipped)
    stream = "\n".join(t for _, t in shipped).encode()
    assert dom.size == len(stream)
    assert stream[np.flatnonzero(dom == mixed_corpus.DOMAINS.index("russian"))[0]] >= 0xC0  # Cyrillic lead byte


def test_mixed_corpus_rejects_a_foreign_row(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"domain": "poetry", "text": "x"}) + "\n")
    with pytest.raises(ValueError, match="HINT:"):
        mixed_corpus.read_documents(bad)


def test_record_traces_on_the_mixed_corpus_is_deterministic(tmp_path: Path) -> None:
    args = ["--corpus", "mixed", "--steps", "2", "--batch", "4", "--seq", "16"]
    a = record_traces.main(args + ["--out", str(tmp_path / "a.npz")])
    b = record_traces.main(args + ["--out", str(tmp_path / "b.npz")])
    with np.load(a) as x, np.load(b) as y:
        assert set(x.files) == set(y.files) and {"domain", "domain_purity"} <= set(x.files)
        for k in x.files:
            assert np.array_equal(x[k], y[k]), k
    t = load_trace(a)
    assert t.counts.shape == (2, 4, 4, 8) and np.all(t.counts.sum(-1) == 16 * 2)
    assert t.meta["corpus_sha256"] == mixed_corpus.sha256(mixed_corpus.MIXED_CORPUS)
    with np.load(a) as x:  # the label is the majority domain of the window's 16 input bytes
        dom = mixed_corpus.domain_of_bytes(mixed_corpus.read_documents())
        for w, d, pur in zip(x["windows"].ravel(), x["domain"].ravel(), x["domain_purity"].ravel()):
            share = np.bincount(dom[w * 16:(w + 1) * 16], minlength=4) / 16
            assert d == share.argmax() and float(pur) == pytest.approx(share.max(), abs=1e-3)
    with pytest.raises(ValueError, match="HINT:"):
        record_traces.main(["--corpus", str(tmp_path / "missing.txt")])
    with pytest.raises(ValueError, match="HINT:"):
        record_traces.main(["--corpus", "mixed", "--top-k", "9"])


def test_locality_statistics_tell_local_from_iid_samples() -> None:
    rng = np.random.default_rng(0)
    p = np.full(8, 1 / 8)
    iid = rng.multinomial(128, p, size=(3, 2, 32))  # [steps, layers, samples, E]
    one_expert = np.zeros((3, 2, 32, 8), np.int64)
    one_expert[np.arange(3)[:, None, None], np.arange(2)[None, :, None], np.arange(32)[None, None, :],
               np.arange(32)[None, None, :] % 8] = 128
    r_iid, r_loc = locality(iid), locality(one_expert, domain=np.tile(np.arange(32) % 8, (3, 1)))
    assert r_iid["mi"] == pytest.approx(r_iid["null_mi"], abs=0.02)  # no locality: as much as chance gives
    assert r_loc["h_sample"] == 0 and r_loc["mi"] == pytest.approx(3.0) and r_loc["null_mi"] < 0.1
    assert r_loc["dom_mi"] == pytest.approx(3.0) and r_loc["node"] == 1.0
    with pytest.raises(ValueError, match="HINT:"):
        locality(iid[0])


def test_shipped_mixed_traces_are_consistent() -> None:
    """The traces recorded on the mixed corpus: shapes, the recorded routing invariant, and their corpus file."""
    sha = mixed_corpus.sha256(mixed_corpus.MIXED_CORPUS)
    for name, top_k, seq in (("mixed_moe.npz", 2, 64), ("mixed_moe_top1.npz", 1, 64), ("mixed_moe_seq256.npz", 2, 256)):
        path = Path(record_traces.HERE) / "traces" / name
        t = load_trace(path)
        assert t.counts.shape == (300, 4, 32, 8) and (t.top_k, t.tokens_per_sample) == (top_k, seq), name
        assert np.all(t.counts.sum(-1) == seq * top_k) and np.all(t.counts <= seq)
        assert t.meta["corpus_sha256"] == sha and t.meta["domains"] == list(mixed_corpus.DOMAINS)
        with np.load(path) as d:
            assert d["domain"].shape == d["windows"].shape == (300, 32)
            assert set(np.unique(d["domain"])) == set(range(len(mixed_corpus.DOMAINS)))  # every domain is drawn
