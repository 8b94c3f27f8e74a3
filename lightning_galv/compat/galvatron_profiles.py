"""Galvatron's model profiles, in every layout Hetu-Galvatron 2.4.0 ships, as a :class:`ModelProfile`.

Galvatron (PKU DAIR lab, Apache-2.0) has changed its profile files over the releases; the 2.4.0 sdist
ships all of these side by side, and a user coming from Galvatron has whichever one their release wrote:

* **legacy** (2.0-2.3), ``{kind}_profiling_{prec}_hidden{H}_head{A}_seqlen{S}.json``: forward ms per
  sample in ``layertype_0`` (one batch size, "static") or a batch sweep ``layertype_0_bsz{B}`` +
  ``layertype_other_0_bsz{B}``; memory in ``layertype_0`` / ``other_memory_pp_{off,on_first,on_last}``
  (scalars: vocab-tp 1 only) and Megatron-SP runs in ``*_sp`` (per vocab-tp dicts);
* **2.4**, ``..._hidden{H}_head{A}.json`` or ``..._{model}.json``: keys ``layertype_{i}_bsz{B}_seq{S}``
  and ``layertype_other[_{i}]_bsz{B}_seq{S or [S1,S2,..]}``, memory nested by sequence length
  (``layertype_{i}[_sp] -> {S: ...}``, ``other_memory_*[_sp] -> {S: {model_states: {vtp: MB}, ...}}``);
* **raw** memory measurements only (``{pp}_{tp}_{dp}[_c][_vtp][_sp] -> layernum[..]_bsz.._seq.._rank{r}_{ms,act,act_peak}``),
  which Galvatron post-processes at search time; :func:`process_raw_memory` does the same arithmetic.

Time fits follow what Galvatron's search does with each layout (``search_engine.py``
``get_profiled_model_configs``): a batch sweep is fitted as total time = per-sample slope x batch + fixed
overhead (least squares), a sequence sweep at batch 1 as a quadratic in sequence length (a linear one for
the embedding/head time), a single point is time per sample. Backward is 2x forward, recomputation one
more forward (Galvatron's ``bct_fct_coe = 2``).

Content the reader does not understand raises ``ValueError`` naming the file and key with a ``HINT:``;
nothing unknown becomes a silent 0.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import bad_value
from ..plan import ModelShape
from ..planner.profiles import EndsProfile, LayerTypeProfile, ModelProfile, TimeFit, act_key

MB = float(2**20)
PLACES = {"pp_off": "other_memory_pp_off", "first": "other_memory_pp_on_first", "last": "other_memory_pp_on_last"}
_RAW_MEM = re.compile(r"layernum\[([\d,]+)\]_bsz(\d+)(?:_seq(\d+|\[[\d,]+\]))?_rank(\d+)_(ms|act|act_peak)")
_STRATEGY = re.compile(r"(\d+)_(\d+)_(\d+)(_c)?(_vtp)?(_sp)?")


def load_json(path: str | Path) -> dict[str, Any]:
    """A Galvatron JSON object, or a ValueError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise bad_value(str(p), "file does not exist", "point at Galvatron's configs/ or hardware_configs/ directory.")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise bad_value(str(p), f"is not valid JSON ({exc})", "re-copy the file from Galvatron.") from exc
    if not isinstance(data, dict):
        raise bad_value(str(p), "top level must be a JSON object", "is this a Galvatron profile?")
    return data


def _num(path: Path | str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_value(f"{path}: {key}={value!r}", "must be a finite number", "re-copy the file from Galvatron.")
    return float(value)


# ---------------------------------------------------------------------------------------------------
# meta configs
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerGroup:
    """One Galvatron layer type as the meta config describes it: ``count`` blocks of width ``hidden`` on
    sequences of ``seq`` tokens (T5: encoder, decoder; Swin: its four stages)."""

    count: int
    hidden: int
    seq: int


@dataclass(frozen=True)
class MetaConfig:
    """A Galvatron meta config: the shape the planner checks plans against, and Galvatron's layer types."""

    family: str
    shape: ModelShape
    groups: tuple[LayerGroup, ...]


def _llama_ffn(dim: int, multiple_of: int) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4*dim, rounded up to ``multiple_of`` (LLaMA, Touvron et al. '23, model.py)."""
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def read_meta(path: str | Path, seq_len: int | None = None) -> MetaConfig:
    """Any meta config the 2.4.0 sdist ships: GPT (``n_embd``), LLaMA / Qwen (``dim``), BERT and ViT
    (``hidden_size``), T5 (``d_model``), Swin (``depths``). ``seq_len`` overrides the sequence length
    (of the first layer type for models with several)."""
    d = load_json(path)
    p = str(path)
    try:
        if "n_embd" in d:
            h, heads = int(d["n_embd"]), int(d["n_head"])
            s = int(seq_len or d["n_positions"])
            shape = ModelShape(int(d["n_layer"]), h, heads, int(d.get("n_kv_head", heads)),
                               int(d.get("n_inner") or 4 * h), int(d["vocab_size"]), s)
            return MetaConfig("gpt", shape, (LayerGroup(shape.num_layers, h, s),))
        if "dim" in d:
            h, heads = int(d["dim"]), int(d["n_heads"])
            s = int(seq_len or d["n_positions"])
            ffn = int(d["ffn_dim"]) if "ffn_dim" in d else _llama_ffn(h, int(d.get("multiple_of", 256)))
            shape = ModelShape(int(d["n_layers"]), h, heads, int(d.get("n_kv_heads") or heads), ffn,
                               int(d["vocab_size"]), s)
            return MetaConfig("llama", shape, (LayerGroup(shape.num_layers, h, s),))
        if "d_model" in d:  # T5: encoder blocks, then decoder blocks (two layer types)
            h, heads = int(d["d_model"]), int(d["num_heads"])
            enc, dec = int(d["num_layers"]), int(d.get("num_decoder_layers") or d["num_layers"])
            s_enc = int(seq_len or d["n_positions"])
            s_dec = int(d.get("n_decoder_positions") or d["n_positions"])
            shape = ModelShape(enc + dec, h, heads, heads, int(d["d_ff"]), int(d["vocab_size"]), s_enc)
            return MetaConfig("t5", shape, (LayerGroup(enc, h, s_enc), LayerGroup(dec, h, s_dec)))
        if "depths" in d:  # Swin: stage i has depths[i] blocks of width embed_dim*2^i on (image/patch/2^i)^2 tokens
            depths, heads_list = [int(x) for x in d["depths"]], [int(x) for x in d["num_heads"]]
            e, side = int(d["embed_dim"]), int(d["image_size"]) // int(d["patch_size"])
            groups = tuple(LayerGroup(n, e * 2**i, (side // 2**i) ** 2) for i, n in enumerate(depths))
            heads = math.gcd(*heads_list)  # a tp degree must split every stage's heads
            shape = ModelShape(sum(depths), groups[-1].hidden, heads, heads, int(d.get("mlp_ratio", 4)) * e,
                               int(d.get("num_labels", 1000)), int(seq_len or groups[0].seq))
            return MetaConfig("swin", shape, groups)
        if "hidden_size" in d:  # BERT (max_position_embeddings) or ViT (image/patch + class token)
            h, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            if "image_size" in d:
                s = int(seq_len or (int(d["image_size"]) // int(d["patch_size"])) ** 2 + 1)
                family, vocab = "vit", int(d.get("num_labels", 1000))
            else:
                s = int(seq_len or d["max_position_embeddings"])
                family, vocab = "bert", int(d["vocab_size"])
            shape = ModelShape(int(d["num_hidden_layers"]), h, heads, heads, int(d.get("intermediate_size") or 4 * h),
                               vocab, s)
            return MetaConfig(family, shape, (LayerGroup(shape.num_layers, h, s),))
    except KeyError as exc:
        raise bad_value(p, f"meta config lacks {exc}", "compare with the meta config Galvatron ships for this "
                        "model family (galvatron/models/<family>/meta_configs).") from None
    except (TypeError, ValueError) as exc:
        raise bad_value(p, f"meta config has a malformed value ({exc})", "sizes must be integers.") from None
    raise bad_value(p, f"unknown meta config (keys {sorted(d)[:8]}...)",
                    "expected a GPT (n_embd), LLaMA (dim), BERT/ViT (hidden_size), T5 (d_model) or Swin (depths) "
                    "meta config; build a ModelShape by hand otherwise.")


# ---------------------------------------------------------------------------------------------------
# locating the files
# ---------------------------------------------------------------------------------------------------
LAYOUTS = ("auto", "legacy", "2.4")


def profile_candidates(config_dir: str | Path, meta_path: str | Path, meta: MetaConfig, precision: str,
                       layout: str = "auto") -> list[tuple[Path, Path]]:
    """(computation, memory) file pairs a model's profile may live in, most preferred first: the 2.4
    names (``hidden{H}_head{A}``, the model name, its first two dash-separated parts: ``swin-huge``),
    then the legacy ``..._seqlen{S}`` name (``layout="auto"``)."""
    if layout not in LAYOUTS:
        raise bad_value(f"layout={layout}", f"must be one of {LAYOUTS}", "use 'auto' to take what exists.")
    d, sh = Path(config_dir), meta.shape
    stem = Path(meta_path).stem
    new = [f"hidden{sh.hidden}_head{sh.num_heads}", stem, "-".join(stem.split("-")[:2])]
    if meta.family == "swin":
        new = [stem, "-".join(stem.split("-")[:2])]
    old = [f"hidden{sh.hidden}_head{sh.num_heads}_seqlen{meta.groups[0].seq}"]
    names = {"auto": new + old, "legacy": old, "2.4": new}[layout]
    out = []
    for n in dict.fromkeys(names):
        out.append((d / f"computation_profiling_{precision}_{n}.json", d / f"memory_profiling_{precision}_{n}.json"))
    return out


def find_profile_files(config_dir: str | Path, meta_path: str | Path, meta: MetaConfig, precision: str = "bf16",
                       layout: str = "auto") -> tuple[Path, Path]:
    """The first candidate pair (:func:`profile_candidates`) of which both files exist."""
    cands = profile_candidates(config_dir, meta_path, meta, precision, layout)
    for comp, mem in cands:
        if comp.is_file() and mem.is_file():
            return comp, mem
    raise bad_value(str(config_dir), f"holds no computation + memory profile pair for this model (tried "
                    f"{[c.name for c, _ in cands]} and their memory_profiling_* twins)",
                    "profile the model with Galvatron's profiler, or pass computation= / memory= explicitly.")


# ---------------------------------------------------------------------------------------------------
# computation
# ---------------------------------------------------------------------------------------------------
def _lstsq(xs: Sequence[float], ys: Sequence[float], degree: int) -> list[float]:
    """Least-squares polynomial coefficients, highest power first (what Galvatron's ``curve_fit`` of a
    linear / quadratic function converges to)."""
    import numpy as np

    return [float(c) for c in np.polyfit(np.asarray(xs, float), np.asarray(ys, float), degree)]


def fit_batch_sweep(points: Mapping[int, float], seq: int) -> TimeFit:
    """Per-sample ms measured at several batch sizes as ``total = slope x batch + overhead`` (seconds),
    the linear fit of Galvatron's ``time_profile_mode == "batch"`` (search_engine.py get_profiled_model_configs)."""
    bs = sorted(points)
    slope, overhead = _lstsq(bs, [points[b] * b for b in bs], 1)
    return TimeFit(overhead / 1e3, slope / 1e3 / seq, 0.0)


def fit_sequence_sweep(points: Mapping[int, float], seq: int, degree: int) -> TimeFit:
    """Per-sample ms at batch 1 over sequence lengths: quadratic (blocks) or linear (embedding/head) in the
    length, as Galvatron's ``time_profile_mode == "sequence"`` (search_engine.py get_profiled_model_configs);
    exact at ``seq``, the quadratic part kept as the attention term."""
    ss = sorted(points)
    coef = _lstsq(ss, [points[s] for s in ss], degree)
    if degree == 2:  # per sample a s^2 + b s + c = per_token_ctx s^2 + per_token s at s = seq
        a, b, c = coef
        return TimeFit(0.0, (b + c / seq) / 1e3, a / 1e3)
    m, c = coef
    return TimeFit(0.0, (m * seq + c) / 1e3 / seq, 0.0)


def _time_points(comp: Mapping[str, Any], path: Path, prefix: str) -> dict[tuple[int, str], float]:
    """``{(batch, seq tag): ms per sample}`` of the keys ``{prefix}_bsz{B}[_seq{S}]`` (seq tag '' in the legacy layout)."""
    out = {}
    pat = re.compile(re.escape(prefix) + r"_bsz(\d+)(?:_seq(\d+|\[[\d,]+\]))?")
    for k, v in comp.items():
        mt = pat.fullmatch(k)
        if mt:
            out[(int(mt.group(1)), mt.group(2) or "")] = _num(path, k, v)
    return out


def _fit_points(points: dict[tuple[int, str], float], seq: int, seq_tag: str, path: Path, key: str,
                degree: int) -> tuple[TimeFit, str]:
    """The fit Galvatron would make of these points for a model at ``seq``: batch sweep at this sequence
    length, else a sequence sweep at batch 1, else the single point (time per sample)."""
    at_seq = {b: t for (b, s), t in points.items() if s in (seq_tag, "")}
    if len(at_seq) >= 2:
        return fit_batch_sweep(at_seq, seq), "batch"
    seqs = {int(s): t for (b, s), t in points.items() if b == 1 and s.isdigit()}
    if len(seqs) > degree:
        return fit_sequence_sweep(seqs, seq, degree), "sequence"
    if len(at_seq) == 1:
        return TimeFit(0.0, next(iter(at_seq.values())) / 1e3 / seq, 0.0), "static"
    raise bad_value(f"{path.name}: {key}_bsz*", f"has no measurement usable at sequence length {seq} "
                    f"(measured: {sorted(points)})", "profile at this sequence length, or pass seq_len= one "
                    "that was measured.")


def _seq_tag(groups: Sequence[LayerGroup]) -> str:
    return str(groups[0].seq) if len(groups) == 1 else "[" + ",".join(str(g.seq) for g in groups) + "]"


def read_computation(comp: Mapping[str, Any], path: Path, groups: Sequence[LayerGroup],
                     time_mode: str = "auto") -> tuple[list[TimeFit], TimeFit, str]:
    """Forward fits per layer type (for one sample of that type's sequence) and of the embedding/head
    ("other"), plus the mode used: ``batch`` / ``sequence`` / ``static`` (``time_mode="auto"``: a batch
    sweep at the model's sequence length, else a sequence sweep at batch 1, else the single point).

    A legacy file read in ``static`` mode takes its stored ``layertype_0`` and derives the embedding/head
    time from the pair of whole-model runs that value was computed from. A measured block time <= 0 or an
    embedding/head time < 0 (noise in some shipped sweeps), or a fit that predicts one, is refused.
    """
    s0 = groups[0].seq
    legacy_static = time_mode == "static" and "layertype_0" in comp
    fits, modes = [], []
    for i, g in enumerate(groups):
        pts = _time_points(comp, path, f"layertype_{i}")
        if i == 0 and "layertype_0" in comp and (legacy_static or not pts):  # legacy static: one per-sample value
            pts = {(0, ""): _num(path, "layertype_0", comp["layertype_0"])}
        if not pts:
            raise bad_value(f"{path.name}: layertype_{i}", "no forward time of this layer type",
                            f"the model has {len(groups)} layer type(s); profile each with Galvatron's profiler.")
        _check_points(pts, path, f"layertype_{i}", strict=True)
        fit, mode = _fit_mode(pts, g.seq, str(g.seq), path, f"layertype_{i}", 2, time_mode)
        if not fit(1, g.seq) > 0 or fit.per_token < 0:
            raise bad_value(f"{path.name}: layertype_{i}_*", f"the {mode} fit of the measurements predicts "
                            f"{fit(1, g.seq) * 1e3:.4g} ms for one sample", "re-profile, or read with "
                            "time_mode='static' (the stored per-sample value).")
        # the model's time fits are per token of the *first* type's sequence: rescale so that b samples
        # of this type cost what Galvatron measured
        fits.append(fit if g.seq == s0 else _reseq(fit, g.seq, s0))
        modes.append(mode)
    other = {} if legacy_static else (_time_points(comp, path, "layertype_other_0")
                                      or _time_points(comp, path, "layertype_other"))
    if not other:
        other = _legacy_other(comp, path, fits[0], s0, len(groups))
    if not other:
        raise bad_value(f"{path.name}: layertype_other*", "no embedding/head ('other') time and no whole-model "
                        "runs (layernum[..]_bsz..) to derive it from", "profile with Galvatron's profiler; the "
                        "reader does not assume the embedding and head are free.")
    _check_points(other, path, "layertype_other", strict=False)
    ofit, _ = _fit_mode(other, s0, _seq_tag(groups), path, "layertype_other", 1, time_mode)
    if ofit(1, s0) < 0:
        raise bad_value(f"{path.name}: layertype_other_*", f"the fit predicts {ofit(1, s0) * 1e3:.4g} ms per "
                        "sample for the embedding and head", "re-profile, or read with time_mode='static'.")
    mode = modes[0] if len(set(modes)) == 1 else "mixed"
    return fits, ofit, mode


def _check_points(points: Mapping[tuple[int, str], float], path: Path, key: str, strict: bool) -> None:
    for (b, s), t in points.items():
        if t < 0 or (strict and t == 0):
            raise bad_value(f"{path.name}: {key}_bsz{b}{'_seq' + s if s else ''}={t:.4g}",
                            "a measured forward time must be > 0" if strict else "a measured time must be >= 0",
                            "that measurement is noise: re-profile, or read with time_mode='static' to use the "
                            "stored per-sample value (legacy files) instead of the sweep.")


def _fit_mode(points: dict[tuple[int, str], float], seq: int, tag: str, path: Path, key: str, degree: int,
              time_mode: str) -> tuple[TimeFit, str]:
    if time_mode == "auto":
        return _fit_points(points, seq, tag, path, key, degree)
    if time_mode == "static":  # Galvatron's static mode: the first value of the key family
        first = next(iter(points.values()))
        return TimeFit(0.0, first / 1e3 / seq, 0.0), "static"
    if time_mode == "batch":
        at = {b: t for (b, s), t in points.items() if s in (tag, "")}
        if len(at) < 2:
            raise bad_value(f"{path.name}: {key}", "time_mode='batch' needs >= 2 batch sizes at this sequence length",
                            "use time_mode='auto'.")
        return fit_batch_sweep(at, seq), "batch"
    if time_mode == "sequence":
        seqs = {int(s): t for (b, s), t in points.items() if b == 1 and s.isdigit()}
        if len(seqs) <= degree:
            raise bad_value(f"{path.name}: {key}", f"time_mode='sequence' needs > {degree} sequence lengths at batch 1",
                            "use time_mode='auto'.")
        return fit_sequence_sweep(seqs, seq, degree), "sequence"
    raise bad_value(f"time_mode={time_mode}", "must be 'auto', 'static', 'batch' or 'sequence'", "use 'auto'.")


def _reseq(fit: TimeFit, seq: int, s0: int) -> TimeFit:
    """The same per-sample time expressed per token of length ``s0`` (fits are evaluated at the model's s0)."""
    k = seq / s0
    return TimeFit(fit.const, fit.per_token * k, fit.per_token_ctx * k * seq / s0)


def _legacy_other(comp: Mapping[str, Any], path: Path, layer: TimeFit, seq: int,
                  n_types: int) -> dict[tuple[int, str], float]:
    """Legacy static profiles store whole-model runs ``layernum[n]_bsz{b}`` but no embedding/head time.
    Galvatron derived the block time from two runs of the same batch as (t1 - t0) / b / (n1 - n0) and the
    rest as (t0 - n0 x block x b) / b per sample (model_profiler.py _process_computation_data); we take the
    pair that reproduces the stored block time (a file may also hold a batch sweep's runs)."""
    runs: dict[int, dict[int, float]] = {}
    for k, v in comp.items():
        mt = re.fullmatch(r"layernum\[(\d+)\]_bsz(\d+)", k)
        if mt:
            runs.setdefault(int(mt.group(2)), {})[int(mt.group(1))] = _num(path, k, v)
    if not runs or n_types != 1:
        return {}
    block = layer(1, seq) * 1e3  # ms per sample
    best = None
    for b, by_n in runs.items():
        ns = sorted(by_n)
        for j, n0 in enumerate(ns):
            for n1 in ns[j + 1:]:
                err = abs((by_n[n1] - by_n[n0]) / b / (n1 - n0) - block)
                if best is None or err < best[0]:
                    best = (err, b, n0, by_n[n0])
    if best is None:  # one run only: everything it holds beyond the blocks
        b, by_n = next(iter(runs.items()))
        n0 = min(by_n)
        best = (0.0, b, n0, by_n[n0])
    _, b, n0, t0 = best
    return {(b, ""): max(0.0, t0 / b - n0 * block)}


# ---------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------
def _seq_entry(table: Mapping[str, Any], tag: str) -> Any:
    """The entry of a 2.4 table for this sequence tag, or the table itself in the legacy layout."""
    if not isinstance(table, Mapping):
        return None
    if "parameter_size" in table or "model_states" in table:
        return table  # legacy: not nested by sequence length
    for k in (tag, tag.strip("[]")):
        if k in table:
            return table[k]
    return None


def _vtp_dict(value: Any, path: Path, key: str) -> dict[int, float]:
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not str(k).isdigit():
                raise bad_value(f"{path.name}: {key}[{k!r}]", "vocab-tp keys must be integers", "re-copy the file.")
            out[int(k)] = _num(path, f"{key}[{k}]", v)
        return out
    return {1: _num(path, key, value)}  # legacy scalar: measured at vocab-tp 1 only


@dataclass(frozen=True)
class MemoryTables:
    """One sequence length's processed memory profile (Galvatron's units: MB)."""

    params_mb: tuple[float, ...]  # per layer type: Galvatron's "parameter_size" (4 bytes per parameter)
    act_mb: tuple[Mapping[str, float], ...]  # per layer type: tp degree (str) or "checkpoint" -> MB per sample
    ends_ms: Mapping[str, Mapping[int, float]]  # place -> vtp -> MB
    ends_act: Mapping[str, Mapping[int, float]]  # place -> vtp -> MB per sample


def memory_tables(mem: Mapping[str, Any], path: Path, n_types: int, tag: str, sp: bool,
                  seq_tags: Sequence[str] | None = None) -> MemoryTables | None:
    """The processed tables for one sequence tag, with (``sp``) or without Megatron-SP; None when the file has
    none of that kind. ``seq_tags`` gives each layer type's own tag (its sequence length)."""
    suffix = "_sp" if sp else ""
    if f"layertype_0{suffix}" not in mem:
        return None
    params, acts = [], []
    for i in range(n_types):
        key = f"layertype_{i}{suffix}"
        entry = _seq_entry(mem.get(key), seq_tags[i] if seq_tags else tag)
        if entry is None:
            raise bad_value(f"{path.name}: {key}", f"has no entry for sequence length {seq_tags[i] if seq_tags else tag}"
                            f" (has {sorted(mem.get(key, {}))})", "pass seq_len= a profiled length, or "
                            "memory_mode='sequence' to scale the longest one as Galvatron does.")
        try:
            params.append(_num(path, f"{key}.parameter_size", entry["parameter_size"]))
            raw = entry["tp_activation_per_bsz_dict"]
        except KeyError as exc:
            raise bad_value(f"{path.name}: {key}", f"lacks {exc}", "re-copy the file from Galvatron.") from None
        acts.append({str(k): _num(path, f"{key}.tp_activation_per_bsz_dict[{k}]", v) for k, v in raw.items()})
    ends_ms, ends_act = {}, {}
    for place, key in PLACES.items():
        entry = _seq_entry(mem.get(key + suffix), tag)
        if entry is None:
            raise bad_value(f"{path.name}: {key}{suffix}", f"has no entry for {tag}",
                            "re-profile the embedding/head memory at this sequence length.")
        try:
            ends_ms[place] = _vtp_dict(entry["model_states"], path, f"{key}{suffix}.model_states")
            ends_act[place] = _vtp_dict(entry["activation"], path, f"{key}{suffix}.activation")
        except KeyError as exc:
            raise bad_value(f"{path.name}: {key}{suffix}", f"lacks {exc}", "re-copy the file from Galvatron.") from None
    return MemoryTables(tuple(params), tuple(acts), ends_ms, ends_act)


def sequence_scaled_tables(mem: Mapping[str, Any], path: Path, seq: int) -> MemoryTables:
    """Galvatron's ``memory_profile_mode == "sequence"`` (search_engine.py get_profiled_model_configs, one
    layer type, Megatron-SP): parameters from the shortest profiled length, activations of the longest
    scaled linearly to ``seq``; of the ends' activations the pipeline-off one is scaled by 2/3 + 1/3 x
    seq/longest, the first stage's kept, the last stage's scaled linearly."""
    layer = mem.get("layertype_0_sp")
    if not isinstance(layer, Mapping) or not layer or "parameter_size" in layer:
        raise bad_value(f"{path.name}: layertype_0_sp", "memory_mode='sequence' needs Megatron-SP tables nested by "
                        "sequence length", "use memory_mode='static'.")
    seqs = sorted(int(s) for s in layer)
    lo, hi = str(seqs[0]), str(seqs[-1])
    t_hi = memory_tables(mem, path, 1, hi, True)
    t_lo = memory_tables(mem, path, 1, lo, True)
    assert t_hi is not None and t_lo is not None
    k = seq / seqs[-1]
    acts = {t: v * k for t, v in t_hi.act_mb[0].items()}  # the checkpointed input too
    ends_act = {"pp_off": {t: v * (2 / 3 + k / 3) for t, v in t_hi.ends_act["pp_off"].items()},
                "first": dict(t_hi.ends_act["first"]),
                "last": {t: v * k for t, v in t_hi.ends_act["last"].items()}}
    return MemoryTables(t_lo.params_mb, (acts,), t_hi.ends_ms, ends_act)


def process_raw_memory(mem: Mapping[str, Any], path: Path, sp: bool,
                       profile_dp_type: str = "zero3") -> dict[str, Any]:
    """Galvatron's post-processing of raw memory runs into the 2.4 tables (model_profiler.py
    ``_process_single_sequence_config``), for one layer type, every sequence length with complete runs.

    Per layer: parameters = model-state growth per added layer / 4 (x dp when the runs used ZeRO-3),
    activation per sample = activation growth per layer / tp x world / batch, from the pp=1 runs of each tp
    (``_c`` runs: with checkpointing). Ends: what the run holds beyond its layers, on rank 0 (first stage)
    and the last rank, the least over the tp degrees run with the same vocab-tp. With Megatron-SP, tp / vtp
    degrees that were not run are filled by halving the next smaller one, as Galvatron does.
    """
    if profile_dp_type not in ("zero3", "ddp"):
        raise bad_value(f"profile_dp_type={profile_dp_type}", "must be 'zero3' or 'ddp'",
                        "Galvatron's profile_memory.sh scripts use zero3.")
    runs: dict[tuple[int, int, int, bool, bool], dict[tuple[int, int, int, str], float]] = {}
    bsz, layernums, seqs = set(), set(), set()
    for skey, block in mem.items():
        mt = _STRATEGY.fullmatch(skey)
        if not mt or not isinstance(block, Mapping) or bool(mt.group(6)) != sp:
            continue
        pp, tp, dp = int(mt.group(1)), int(mt.group(2)), int(mt.group(3))
        table = {}
        for k, v in block.items():
            r = _RAW_MEM.fullmatch(k)
            if r is None or "," in r.group(1):
                raise bad_value(f"{path.name}: {skey}.{k}", "not a raw single-layer-type memory run",
                                "only one layer type's raw runs can be processed; process the file with "
                                "Galvatron's profiler first.")
            n, b, s = int(r.group(1)), int(r.group(2)), int(r.group(3) or 0)
            table[(n, s, int(r.group(4)), r.group(5))] = _num(path, f"{skey}.{k}", v)
            bsz.add(b)
            seqs.add(s)
            if pp == 1:
                layernums.add(n)
        runs[(pp, tp, dp, bool(mt.group(4)), bool(mt.group(5)))] = table
    if not runs:
        raise bad_value(f"{path.name}", f"has no raw memory runs {'with' if sp else 'without'} Megatron-SP",
                        "check the file, or read the other variant.")
    if len(bsz) != 1 or len(layernums) < 2:
        raise bad_value(f"{path.name}", f"raw runs need one batch size and two layer counts (got batch {sorted(bsz)},"
                        f" layers {sorted(layernums)})", "re-run Galvatron's memory profiler.")
    B = bsz.pop()
    n0, n1 = min(layernums), max(layernums)
    world = next(iter(runs))[0] * next(iter(runs))[1] * next(iter(runs))[2]
    out: dict[str, Any] = {}
    sfx = "_sp" if sp else ""
    for s in sorted(seqs):
        try:
            tables = _process_one_seq(runs, B, n0, n1, world, s, sp, profile_dp_type)
        except KeyError:
            continue  # this sequence length was not run completely (Galvatron cannot process it either)
        params, acts, ends = tables
        out.setdefault(f"layertype_0{sfx}", {})[str(s)] = {"parameter_size": params, "tp_activation_per_bsz_dict": acts}
        for place, key in PLACES.items():
            out.setdefault(key + sfx, {})[str(s)] = ends[place]
    if not out:
        raise bad_value(f"{path.name}", "no sequence length has the complete raw runs (pp=1 at both layer counts, "
                        "checkpointed runs, pipeline runs)", "re-run Galvatron's memory profiler.")
    return out


def _process_one_seq(runs: Mapping[tuple, Mapping[tuple, float]], B: int, n0: int, n1: int, world: int, s: int,
                     sp: bool, zero: str) -> tuple[float, dict[str, float], dict[str, dict[str, dict[int, float]]]]:
    """Layer and end tables of one sequence length from the raw runs (KeyError when a run is missing)."""
    params: dict[int, float] = {}
    acts: dict[int, float] = {}
    ckpt = -1.0
    for (pp, tp, dp, c, vtp), r in runs.items():
        if pp != 1 or vtp:
            continue
        act = (r[(n1, s, 0, "act")] - r[(n0, s, 0, "act")]) / (n1 - n0) / tp * world / B
        if c:
            ckpt = max(ckpt, act)
            continue
        p = (r[(n1, s, 0, "ms")] - r[(n0, s, 0, "ms")]) / (n1 - n0) / 4
        params[tp] = p * (world // tp) if zero == "zero3" else p
        acts[tp] = act
    if not params or ckpt < 0:
        raise KeyError("pp=1 runs")
    ends: dict[str, dict[str, dict[int, float]]] = {pl: {"model_states": {}, "activation": {}} for pl in PLACES}
    for (pp, tp, dp, c, vtp), r in runs.items():
        if c or tp not in params:
            continue
        n = pp if pp > 1 else n0
        layer_ms, layer_act = params[tp] * 4 * n / pp, acts[tp] * n / pp
        ranks = [(0, "pp_off" if pp == 1 else "first")] + ([(world - 1, "last")] if pp > 1 else [])
        vdeg = tp if vtp else 1
        for rank, place in ranks:
            ms = r[(n, s, rank, "ms")]
            other_ms = (ms - layer_ms / (world // pp // tp)) * (world // pp) / vdeg if zero == "zero3" else ms - layer_ms
            peak = max(r[(n, s, rank, "act_peak")], r[(n, s, rank, "act")])
            other_act = (peak - layer_act * (B / (world // (pp * tp)))) / (B / world * pp * vdeg)
            for kind, v in (("model_states", other_ms), ("activation", other_act)):
                cur = ends[place][kind].get(vdeg)
                ends[place][kind][vdeg] = max(0.0, v) if cur is None else min(cur, max(0.0, v))
    if not ends["pp_off"]["model_states"] or not ends["first"]["model_states"]:
        raise KeyError("end runs")
    if sp:  # tp / vtp degrees not run: half of the next smaller one (model_profiler.py, sequence parallel)
        for t in (2, 4, 8):
            if t not in acts and t // 2 in acts:
                acts[t] = acts[t // 2] / 2
            for place in PLACES:
                for kind in ("model_states", "activation"):
                    d = ends[place][kind]
                    if t not in d and t // 2 in d:
                        d[t] = d[t // 2] / 2
    table: dict[str, float] = {str(t): v for t, v in sorted(acts.items())}
    table["checkpoint"] = ckpt
    return max(p * t for t, p in params.items()), table, ends


# ---------------------------------------------------------------------------------------------------
# the profile
# ---------------------------------------------------------------------------------------------------
def read_model_profile(meta_config: str | Path, config_dir: str | Path, precision: str = "bf16",
                       seq_len: int | None = None, name: str | None = None, *, layout: str = "auto",
                       computation: str | Path | None = None, memory: str | Path | None = None,
                       time_mode: str = "auto", memory_mode: str = "auto",
                       profile_dp_type: str = "zero3") -> ModelProfile:
    """A :class:`ModelProfile` from a Galvatron meta config and the computation / memory profiles next to it.

    ``layout`` picks which file names to look for (``auto``: the 2.4 names, then the legacy
    ``_seqlen{S}`` ones); ``computation`` / ``memory`` name the files directly. ``time_mode`` and
    ``memory_mode`` choose Galvatron's way of reading them (``auto``: batch sweep > sequence sweep >
    single point; a profiled sequence length's tables, else the longest one scaled); ``profile_dp_type``
    is how raw memory runs were made (Galvatron's scripts: ZeRO-3). Both Megatron-SP and plain memory
    tables are kept when present (``act_key(tp, "megatron", ...)`` and ``EndsProfile.*_sp``).
    """
    meta = read_meta(meta_config, seq_len)
    shape, groups = meta.shape, meta.groups
    if computation is None or memory is None:
        comp_path, mem_path = find_profile_files(config_dir, meta_config, meta, precision, layout)
        comp_path, mem_path = Path(computation or comp_path), Path(memory or mem_path)
    else:
        comp_path, mem_path = Path(computation), Path(memory)
    comp, mem = load_json(comp_path), load_json(mem_path)
    fits, other, mode = read_computation(comp, comp_path, groups, time_mode)
    n = len(groups)
    tag = _seq_tag(groups)
    seq_tags = [str(g.seq) for g in groups]
    if memory_mode not in ("auto", "static", "sequence"):
        raise bad_value(f"memory_mode={memory_mode}", "must be 'auto', 'static' or 'sequence'", "use 'auto'.")
    processed = mem
    if "layertype_0" not in mem and "layertype_0_sp" not in mem:  # raw runs only: process them
        processed = {}
        for sp in (False, True):
            if any(_STRATEGY.fullmatch(k) and k.endswith("_sp") == sp for k in mem):
                processed.update(process_raw_memory(mem, mem_path, sp, profile_dp_type))
    tables: dict[bool, MemoryTables] = {}
    for sp in (False, True):
        if memory_mode == "sequence" and sp:
            tables[sp] = sequence_scaled_tables(processed, mem_path, groups[0].seq)
            continue
        try:
            t = memory_tables(processed, mem_path, n, tag, sp, seq_tags)
        except ValueError:
            if memory_mode == "auto" and sp and n == 1 and f"layertype_0_sp" in processed:
                t = sequence_scaled_tables(processed, mem_path, groups[0].seq)
            else:
                raise
        if t is not None:
            tables[sp] = t
    if not tables:
        raise bad_value(f"{mem_path.name}", "has neither 'layertype_0' nor 'layertype_0_sp' tables",
                        "is this a Galvatron memory profile?")
    plain, with_sp = tables.get(False), tables.get(True)
    base = plain or with_sp
    assert base is not None
    layers = []
    for i, g in enumerate(groups):
        acts: dict[str, float] = {}
        for sp, t in ((False, plain), (True, with_sp)):
            if t is None:
                continue
            for k, v in t.act_mb[i].items():
                if k == "checkpoint":
                    continue
                if not k.isdigit():
                    raise bad_value(f"{mem_path.name}: layertype_{i}.tp_activation_per_bsz_dict[{k!r}]",
                                    "keys are tp degrees or 'checkpoint'", "re-copy the file from Galvatron.")
                # Megatron-SP runs are kept under their own keys, tp 1 included (Galvatron prices every tp
                # from the SP table when --sequence_parallel is on); tp 1 is the plain layer when no plain run exists
                acts[act_key(int(k), "megatron" if sp else "none", False)] = v * MB
                if sp and k == "1":
                    acts.setdefault(act_key(1, "none", False), v * MB)
            if "checkpoint" in t.act_mb[i]:
                ck = t.act_mb[i]["checkpoint"] * MB
                acts[act_key(1, "megatron" if sp else "none", True)] = ck
                if sp:  # Galvatron divides the checkpointed input by tp under Megatron-SP (cost_model.py)
                    acts.setdefault(act_key(1, "none", True), ck)
                    for k in t.act_mb[i]:
                        if k.isdigit() and int(k) > 1:
                            acts[act_key(int(k), "megatron", True)] = ck / int(k)
        if act_key(1, "none", False) not in acts:
            raise bad_value(f"{mem_path.name}: layertype_{i}", "has no activation at tp 1",
                            "profile the unsharded layer too.")
        params = int(round(base.params_mb[i] * MB / 4))  # parameter_size: MB at 4 bytes per parameter
        # the SP table's own parameter_size, which Galvatron's search reads under --sequence_parallel
        # (search_engine.py get_profiled_model_configs: layertype_{i}_sp); kept only where it differs
        params_sp = None if plain is None or with_sp is None else int(round(with_sp.params_mb[i] * MB / 4))
        fwd = fits[i]
        layers.append(LayerTypeProfile(f"layertype_{i}", fwd, fwd.scaled(2.0), params, acts,
                                       g.hidden * g.seq // groups[0].seq,
                                       params_sp=None if params_sp == params else params_sp))
    type_of = tuple(i for i, g in enumerate(groups) for _ in range(g.count))
    if len(type_of) != shape.num_layers:
        raise bad_value(f"{meta_config}", f"layer groups count {len(type_of)} blocks, the shape {shape.num_layers}",
                        "check the meta config.")
    ends = EndsProfile(model_states={p: {t: v * MB for t, v in d.items()} for p, d in plain.ends_ms.items()} if plain else {},
                       activation={p: {t: v * MB for t, v in d.items()} for p, d in plain.ends_act.items()} if plain else {},
                       model_states_sp={p: {t: v * MB for t, v in d.items()} for p, d in with_sp.ends_ms.items()} if with_sp else {},
                       activation_sp={p: {t: v * MB for t, v in d.items()} for p, d in with_sp.ends_act.items()} if with_sp else {},
                       forward=other)
    if other(1, shape.seq_len) <= 0:
        warnings.warn(f"{comp_path.name}: the embedding/head ('other') forward time is {other(1, shape.seq_len):.3g}"
                      " s per sample as measured (Galvatron clamps negative differences to 0)", stacklevel=2)
    return _with_ends(ModelProfile(name or Path(meta_config).stem, shape, tuple(layers), type_of, precision,
                                   framework_bytes=0.0, source=f"galvatron:{comp_path.name}+{mem_path.name}:{mode}",
                                   ends=ends))


def _with_ends(profile: ModelProfile) -> ModelProfile:
    """Fill the native model's embed_* / head_* fields from the Galvatron end tables at vocab-tp 1: states
    of the first / last stage (16 bytes per parameter at ZeRO-0), their activations, the forward time split
    in halves between the two ends (Galvatron's OtherTimeCostModel gives each end stage half)."""
    ends = profile.ends
    assert ends is not None
    ms, act = ends.table("model_states", False), ends.table("activation", False)
    embed_params = int(ms["first"][1] / 16.0)  # model states at ZeRO-0: 4 x (4-byte) parameter size
    head_params = int(ms["last"][1] / 16.0)
    embed_act = act["first"][1]
    head_act = max(act["last"][1], act["pp_off"][1] - act["first"][1])
    f = ends.forward
    half = TimeFit(f.const / 2, f.per_token / 2, f.per_token_ctx / 2)
    return profile.with_(embed_params=embed_params, head_params=head_params, embed_act_bytes=embed_act,
                         head_act_bytes=head_act, embed_forward=half, head_forward=half)


# ---------------------------------------------------------------------------------------------------
# writing back (2.4 processed layout)
# ---------------------------------------------------------------------------------------------------
def write_model_profile(profile: ModelProfile, meta: MetaConfig | None = None) -> tuple[dict, dict]:
    """(computation, memory) JSON objects in Galvatron 2.4's processed layout that read back to ``profile``.

    The time fits are written as a two-point batch sweep at the profile's sequence length (batch 1 and 2,
    total = slope x batch + overhead, exact for a linear fit) or, for fits with an attention term, a
    three-point sequence sweep at batch 1; memory as the 2.4 tables at that length.
    Needs the Galvatron end tables (``profile.ends``): a profile of another origin has no per-vtp ends.
    ``meta`` (:func:`read_meta`) gives each layer type's own sequence length (T5, Swin); without it every
    type is written at the profile's.
    """
    if profile.ends is None:
        raise bad_value(profile.name, "has no Galvatron end tables (ModelProfile.ends)", "only profiles read from "
                        "Galvatron files can be written back in its layout.")
    n_types = len(profile.layer_types)
    s0 = profile.seq_len
    groups: Sequence[LayerGroup] = meta.groups if meta is not None else []
    if len(groups) != n_types:
        groups = [LayerGroup(profile.layer_type_of.count(i), lt.hidden, s0) for i, lt in enumerate(profile.layer_types)]
    comp: dict[str, float] = {}
    for i, (lt, g) in enumerate(zip(profile.layer_types, groups)):
        if lt.backward != lt.forward.scaled(2.0) or (lt.forward.per_token_ctx and (lt.forward.const or g.seq != s0)):
            raise bad_value(f"{lt.name}", "has a measured backward (or an attention term with a per-call "
                            "overhead), which Galvatron's layouts cannot hold", "write profiles read from Galvatron "
                            "files only.")
        if lt.forward.per_token_ctx:  # a sequence sweep at batch 1 (quadratic in the length, exact at s0)
            for x in (s0 // 2, s0, 2 * s0):
                comp[f"layertype_{i}_bsz1_seq{x}"] = (lt.forward.per_token * x + lt.forward.per_token_ctx * x * x) * 1e3
            continue
        for b in (1, 2):
            comp[f"layertype_{i}_bsz{b}_seq{g.seq}"] = lt.forward(b, s0) / b * 1e3
    f = profile.ends.forward
    tag = _seq_tag(groups)
    for b in (1, 2):
        comp[f"layertype_other_bsz{b}_seq{tag}"] = f(b, s0) / b * 1e3
    mem: dict[str, Any] = {}
    e = profile.ends
    for sp, ms_t, act_t in ((False, e.model_states, e.activation), (True, e.model_states_sp, e.activation_sp)):
        if not ms_t:
            continue
        sfx = "_sp" if sp else ""
        for i, (lt, g) in enumerate(zip(profile.layer_types, groups)):
            kind = "megatron" if sp else "none"
            acts = {}
            for k, v in lt.activation_bytes.items():
                tp_s, k_kind, *ck = k.split("/")
                if k_kind == kind and not ck:
                    acts[tp_s[2:]] = v / MB
            ck = lt.activation_bytes.get(act_key(1, kind, True))
            if ck is not None:
                acts["checkpoint"] = ck / MB
            n_params = lt.params_sp if sp and lt.params_sp is not None else lt.params
            mem.setdefault(f"layertype_{i}{sfx}", {})[str(g.seq)] = {"parameter_size": n_params * 4 / MB,
                                                                      "tp_activation_per_bsz_dict": acts}
        for place, key in PLACES.items():
            mem[key + sfx] = {tag: {"model_states": {str(t): v / MB for t, v in ms_t[place].items()},
                                    "activation": {str(t): v / MB for t, v in act_t[place].items()}}}
    return comp, mem
