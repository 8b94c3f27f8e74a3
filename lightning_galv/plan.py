"""Hybrid-parallel plans as plain data.

A :class:`ParallelPlan` is what the planner produces and what the runtime consumes. It is a frozen
dataclass validated on creation, so a plan that exists is a plan that is internally consistent; checks
that need the model (heads divisible by tp, ...) live in :meth:`ParallelPlan.check_model`.

This module is pure: it imports neither torch nor Lightning, so the planner can build thousands of
plans cheaply and tests can construct them without processes.

Vocabulary (following Galvatron, VLDB'23):

* ``pp``: pipeline degree; the world is split into ``pp`` stages of ``world_size // pp`` ranks.
* Each layer has a :class:`LayerStrategy` that factorizes its stage's ranks as ``tp * dp``.
  ``tp`` is the size of the layer's *model-parallel group*: Megatron tensor parallelism when
  ``sp`` is ``"none"`` or ``"megatron"`` (the latter also shards norms/dropout on the sequence), and a
  Ulysses sequence-parallel group when ``sp == "ulysses"`` (weights replicated, attention heads
  exchanged by all-to-all).
* ``zero``: 0 = replicated DP, 1 = sharded optimizer state, 2 = + sharded gradients (parameters
  kept gathered from forward through backward, re-sharded after it: gathered in every micro-batch),
  3 = + parameters re-sharded after forward (gathered again for backward).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .errors import bad_value
from .units import format_bytes_list

SP_MODES = ("none", "megatron", "ulysses")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
BACKENDS = ("native", "deepspeed")


def _check_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: must be an int. HINT: write {name}: 2, not {name}: '2'.")
    if value < minimum:
        raise bad_value(f"{name}={value}", f"must be >= {minimum}", f"use a positive degree for {name}.")


@dataclass(frozen=True)
class LayerStrategy:
    """How one layer (or the embedding / head) is parallelized over its stage's ranks."""

    tp: int = 1
    dp: int = 1
    sp: str = "none"
    zero: int = 0
    checkpoint: bool = False
    tp_consecutive: bool = True
    ep: int = 1  # expert parallelism of an MoE layer, carved out of its data group (parallel/expert.py)

    def __post_init__(self) -> None:
        _check_int("tp", self.tp)
        _check_int("dp", self.dp)
        _check_int("zero", self.zero, minimum=0)
        _check_int("ep", self.ep)
        if self.data_group % self.ep:
            raise bad_value(f"ep={self.ep} with {self.short_dims()}",
                       f"expert parallelism splits the layer's data group ({self.data_group} ranks: dp"
                       f"{'*tp for Ulysses' if self.ulysses else ''}), so ep must divide it",
                       f"pick ep from the divisors of {self.data_group}, or raise dp.")
        if self.sp not in SP_MODES:
            raise bad_value(f"sp={self.sp}", f"must be one of {SP_MODES}", "use 'megatron' for TP with "
                            "sequence-sharded norms or 'ulysses' for all-to-all sequence parallelism.")
        if self.zero > 3:
            raise bad_value(f"zero={self.zero}", "ZeRO stage must be 0, 1, 2 or 3", "pick zero: 3 for full sharding.")
        if self.sp != "none" and self.tp == 1:
            raise bad_value(f"sp={self.sp} with tp=1", "sequence parallelism needs a group of size > 1",
                            "set tp to the sequence-parallel degree, or sp='none'.")
        for name in ("checkpoint", "tp_consecutive"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r}: must be a bool. HINT: write true/false.")

    @property
    def width(self) -> int:
        """Number of ranks the layer spans (its stage size)."""
        return self.tp * self.dp

    @property
    def ulysses(self) -> bool:
        return self.sp == "ulysses"

    @property
    def tensor_parallel(self) -> int:
        """Degree by which weights are split (Ulysses replicates weights)."""
        return 1 if self.ulysses else self.tp

    @property
    def data_group(self) -> int:
        """Ranks over which gradients are reduced: dp, or dp*sp for Ulysses (weights replicated)."""
        return self.dp * self.tp if self.ulysses else self.dp

    def short_dims(self) -> str:
        return f"tp={self.tp}, dp={self.dp}, sp={self.sp!r}"

    def short(self) -> str:
        parts = []
        if self.tp > 1:
            kind = {"none": "tp", "megatron": "tp+sp", "ulysses": "ulysses"}[self.sp]
            parts.append(f"{kind}{self.tp}{'' if self.tp_consecutive or self.dp == 1 else '(strided)'}")
        if self.dp > 1 or not parts:
            parts.append(f"dp{self.dp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.checkpoint:
            parts.append("ckpt")
        return "·".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "LayerStrategy") -> "LayerStrategy":
        if isinstance(data, LayerStrategy):
            return data
        if not isinstance(data, Mapping):
            raise TypeError(f"layer strategy {data!r}: must be a mapping. HINT: write {{tp: 2, dp: 2}}.")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise bad_value(sorted(unknown), f"unknown LayerStrategy keys (known: {sorted(known)})",
                            "check the spelling of the plan file.")
        return cls(**dict(data))


@dataclass(frozen=True)
class Prediction:
    """What the planner expects of a plan (filled in by the search, optional otherwise)."""

    step_time_s: float
    throughput: float  # samples per second
    stage_memory_bytes: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "throughput": self.throughput,
                "stage_memory_bytes": list(self.stage_memory_bytes)}


@dataclass(frozen=True)
class ParallelPlan:
    """A full hybrid-parallel plan: pipeline around per-layer strategies.

    ``layers[i]`` is the strategy of transformer block ``i``. ``embed`` and ``head`` are the
    strategies of the embedding and of the final norm + output projection (vocab-parallel when
    their ``tp > 1``). ``global_batch`` (samples per optimizer step, before gradient accumulation)
    may be ``None`` when the data loader decides it.

    ``vocab_parallel_loss`` says the training loss consumes vocab-sharded logits (through
    :func:`lightning_galv.loss.cross_entropy`): a vocab-parallel head (``head.tp > 1``) then hands the
    loss its local ``V/tp`` slice of the logits instead of gathering all ``V``. It is a plan field, not
    only a runtime switch, because it changes what the plan costs (the head's saved logits shrink by
    ``tp`` and an all-gather of logits becomes all-reduces of per-token statistics), so the cost model
    and the search must see it. It has no effect when ``head.tp == 1``.

    ``vocab_sp`` is Galvatron's ``vsp`` flag on ends without vocabulary parallelism (``vtp`` 1), which a
    :class:`LayerStrategy` cannot carry (Ulysses needs ``tp > 1``; with ``tp > 1`` a sequence-split end is
    ``sp='ulysses'``). Our runtime ignores it -- a 1-way split is no split -- but Galvatron's cost model does
    not: it admits the plan to its Ulysses-only search context and sizes the ends' gradients differently, so a
    Galvatron plan read and written back keeps it.
    """

    world_size: int
    layers: tuple[LayerStrategy, ...]
    pp: int = 1
    pp_division: tuple[int, ...] | None = None
    micro_batches: int = 1
    global_batch: int | None = None
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    embed: LayerStrategy | None = None
    head: LayerStrategy | None = None
    backend: str = "native"
    vocab_parallel_loss: bool = False
    prediction: Prediction | None = field(default=None, compare=False)
    vocab_sp: bool = False

    def __post_init__(self) -> None:
        _check_int("world_size", self.world_size)
        _check_int("pp", self.pp)
        _check_int("micro_batches", self.micro_batches)
        _check_int("virtual_stages", self.virtual_stages)
        if not isinstance(self.layers, tuple):
            object.__setattr__(self, "layers", tuple(LayerStrategy.from_dict(s) for s in self.layers))
        if not self.layers:
            raise bad_value("layers=()", "a plan needs one strategy per layer", "list at least one layer.")
        if self.world_size % self.pp:
            raise bad_value(f"world_size={self.world_size}, pp={self.pp}", "pp must divide the world size",
                            f"pick pp from the divisors of {self.world_size}: {divisors(self.world_size)}.")
        stage = self.world_size // self.pp
        default = LayerStrategy(dp=stage)
        for name in ("embed", "head"):
            value = getattr(self, name)
            object.__setattr__(self, name, default if value is None else LayerStrategy.from_dict(value))
        for i, s in enumerate(self.all_strategies()):
            label = {0: "embed", len(self.layers) + 1: "head"}.get(i, f"layers[{i - 1}]")
            if s.width != stage:
                raise bad_value(f"{label}: tp={s.tp} x dp={s.dp} = {s.width}",
                                f"each layer's tp*dp must equal world_size/pp = {self.world_size}/{self.pp} = {stage}",
                                f"factor {stage} as tp*dp, e.g. tp={divisors(stage)[-1]} dp=1 or tp=1 dp={stage}.")
        if self.pipeline_schedule not in SCHEDULES:
            raise bad_value(f"pipeline_schedule={self.pipeline_schedule}", f"must be one of {SCHEDULES}",
                            "use '1f1b' unless you know you need another schedule.")
        if not isinstance(self.vocab_parallel_loss, bool):
            raise TypeError(f"vocab_parallel_loss={self.vocab_parallel_loss!r}: must be a bool. HINT: true only when "
                            "the training loss uses lightning_galv.loss.cross_entropy on the head's output.")
        if not isinstance(self.vocab_sp, bool):
            raise TypeError(f"vocab_sp={self.vocab_sp!r}: must be a bool. HINT: Galvatron's vsp with vtp 1.")
        if self.vocab_sp and (self.embed.tp > 1 or self.head.tp > 1):  # type: ignore[union-attr]
            raise bad_value(f"vocab_sp=True with embed tp={self.embed.tp}, head tp={self.head.tp}",  # type: ignore[union-attr]
                            "vocab_sp marks Galvatron's vsp on ends with vtp 1 only",
                            "give tp > 1 ends sp='ulysses' to sequence-split them.")
        if self.backend not in BACKENDS:
            raise bad_value(f"backend={self.backend}", f"must be one of {BACKENDS}", "use 'native'.")
        if self.backend == "deepspeed":
            bad = [s.short() for s in self.all_strategies() if s.tp > 1]
            if bad or self.pp > 1:
                raise bad_value(f"backend=deepspeed with {bad or f'pp={self.pp}'}",
                                "the DeepSpeed backend runs pure data-parallel ZeRO plans only",
                                "use backend='native' for TP/SP/PP plans.")
            if len({s.zero for s in self.all_strategies()}) > 1:
                raise bad_value("backend=deepspeed with mixed ZeRO stages", "DeepSpeed applies one ZeRO stage "
                                "to the whole model", "give every layer the same zero stage.")
        if self.virtual_stages > 1 and self.pipeline_schedule != "interleaved_1f1b":
            raise bad_value(f"virtual_stages={self.virtual_stages} with {self.pipeline_schedule}",
                            "virtual stages exist only in the interleaved 1F1B schedule",
                            "set pipeline_schedule='interleaved_1f1b' or virtual_stages=1.")
        n_chunks = self.pp * self.virtual_stages
        if self.pp_division is None:
            if len(self.layers) < n_chunks:
                raise bad_value(f"{len(self.layers)} layers", f"fewer layers than pipeline chunks ({n_chunks})",
                                "lower pp or virtual_stages.")
            object.__setattr__(self, "pp_division", even_division(len(self.layers), n_chunks))
        else:
            division = tuple(self.pp_division)
            object.__setattr__(self, "pp_division", division)
            if len(division) != n_chunks or any((not isinstance(d, int)) or d < 1 for d in division):
                raise bad_value(f"pp_division={list(division)}", f"needs {n_chunks} positive layer counts "
                                f"(pp={self.pp} x virtual_stages={self.virtual_stages})",
                                f"e.g. {list(even_division(len(self.layers), n_chunks))}.")
            if sum(division) != len(self.layers):
                raise bad_value(f"pp_division={list(division)} (sum {sum(division)})",
                                f"must sum to the number of layers, {len(self.layers)}",
                                f"e.g. {list(even_division(len(self.layers), n_chunks))}.")
        if self.pp > 1:
            if self.pipeline_schedule != "gpipe" and self.micro_batches < self.pp:
                raise bad_value(f"micro_batches={self.micro_batches} with pp={self.pp}",
                                f"{self.pipeline_schedule} needs at least as many micro-batches as stages",
                                f"set micro_batches >= {self.pp} (2*pp keeps the bubble small).")
            if self.pipeline_schedule == "interleaved_1f1b" and self.micro_batches % self.pp:
                raise bad_value(f"micro_batches={self.micro_batches} with pp={self.pp}",
                                "interleaved 1F1B needs micro_batches divisible by pp",
                                f"use micro_batches={self.pp * max(1, self.micro_batches // self.pp)}.")
        if self.global_batch is not None:
            _check_int("global_batch", self.global_batch)
            unit = self.batch_unit
            if self.global_batch % unit:
                raise bad_value(f"global_batch={self.global_batch}",
                                f"must be divisible by micro_batches x lcm(dp degrees) = {unit}",
                                f"use a multiple of {unit}, e.g. {unit * max(1, round(self.global_batch / unit))}.")

    # -- derived facts ------------------------------------------------------------------------------
    @property
    def stage_size(self) -> int:
        return self.world_size // self.pp

    def all_strategies(self) -> tuple[LayerStrategy, ...]:
        """embed, layers..., head (the order activations flow in)."""
        assert self.embed is not None and self.head is not None  # set in __post_init__
        return (self.embed, *self.layers, self.head)

    @property
    def data_parallel_size(self) -> int:
        """How many different sample shards the data loader serves: the finest dp of any layer."""
        return max(s.dp for s in self.all_strategies())

    @property
    def batch_unit(self) -> int:
        """The global batch must be a multiple of this (every layer splits a micro-batch evenly)."""
        return self.micro_batches * math.lcm(*(s.dp for s in self.all_strategies()))

    def stage_layers(self, chunk: int) -> range:
        """Layer indices of pipeline chunk ``chunk`` (0 .. pp*virtual_stages-1)."""
        assert self.pp_division is not None
        start = sum(self.pp_division[:chunk])
        return range(start, start + self.pp_division[chunk])

    @property
    def is_homogeneous(self) -> bool:
        return len(set(self.all_strategies())) == 1

    # -- model checks -------------------------------------------------------------------------------
    def check_model(self, shape: "ModelShape") -> None:
        """Checks that need the model: layer count and divisibility of heads / hidden / sequence."""
        if len(self.layers) != shape.num_layers:
            raise bad_value(f"{len(self.layers)} layer strategies", f"the model has {shape.num_layers} layers",
                            "give one strategy per transformer block (or use ParallelPlan.uniform).")
        for label, s in [("embed", self.embed), *((f"layers[{i}]", s) for i, s in enumerate(self.layers)),
                         ("head", self.head)]:
            assert s is not None
            if s.tp == 1:
                continue
            if label in ("embed", "head"):
                if s.ulysses:
                    raise bad_value(f"{label}: sp=ulysses", "embedding/head cannot use Ulysses",
                                    "use tp with sp='none' (vocab-parallel) or tp=1 for the embedding/head.")
                if shape.vocab_size % s.tp:
                    raise bad_value(f"{label}: tp={s.tp}", f"must divide vocab_size={shape.vocab_size}",
                                    f"pad the vocabulary to a multiple of {s.tp} or lower tp.")
                continue
            checks = [("num_heads", shape.num_heads), ("num_kv_heads", shape.num_kv_heads)]
            if not s.ulysses:
                checks.append(("ffn_hidden", shape.ffn_hidden))
            if s.sp != "none":
                checks.append(("seq_len", shape.seq_len))
            for what, n in checks:
                if n % s.tp:
                    raise bad_value(f"{label}: tp={s.tp} ({s.sp})", f"must divide {what}={n}",
                                    f"choose tp from {divisors(n)} for this layer.")

    # -- construction helpers -------------------------------------------------------------------------
    @classmethod
    def uniform(cls, world_size: int, num_layers: int, strategy: LayerStrategy | None = None,
                **kwargs: Any) -> "ParallelPlan":
        """Every layer uses ``strategy`` (default: pure DP); the embedding and head use its tensor-parallel
        part (vocab-parallel, no sequence parallelism) with the same ZeRO stage."""
        pp = kwargs.get("pp", 1)
        stage = world_size // pp
        s = strategy or LayerStrategy(dp=stage)
        tp = 1 if s.ulysses else s.tp
        edge = LayerStrategy(tp=tp, dp=stage // tp, zero=s.zero, tp_consecutive=s.tp_consecutive)
        kwargs.setdefault("embed", edge)
        kwargs.setdefault("head", edge)
        return cls(world_size=world_size, layers=(s,) * num_layers, **kwargs)

    def with_(self, **changes: Any) -> "ParallelPlan":
        return replace(self, **changes)

    # -- serialization --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "world_size": self.world_size,
            "pp": self.pp,
            "pp_division": list(self.pp_division or ()),
            "micro_batches": self.micro_batches,
            "global_batch": self.global_batch,
            "pipeline_schedule": self.pipeline_schedule,
            "virtual_stages": self.virtual_stages,
            "backend": self.backend,
            "vocab_parallel_loss": self.vocab_parallel_loss,
            "embed": self.embed.to_dict() if self.embed else None,
            "head": self.head.to_dict() if self.head else None,
            "layers": [s.to_dict() for s in self.layers],
        }
        if self.vocab_sp:  # only when set: plans without it serialize as before
            out["vocab_sp"] = True
        if self.prediction is not None:
            out["prediction"] = self.prediction.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParallelPlan":
        if not isinstance(data, Mapping):
            raise TypeError(f"plan {type(data).__name__}: must be a mapping. HINT: a plan file is a YAML/JSON "
                            "object with keys world_size, layers, ...")
        data = dict(data)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise bad_value(sorted(unknown), f"unknown plan keys (known: {sorted(known)})",
                            "check the spelling of the plan file.")
        for key in ("world_size", "layers"):
            if key not in data:
                raise bad_value(sorted(data), f"a plan needs the key '{key}'",
                                "see ParallelPlan.to_dict() for the format.")
        layers = data.pop("layers")
        if not isinstance(layers, (list, tuple)):
            raise TypeError(f"layers={layers!r}: must be a list. HINT: one entry per transformer block.")
        data["layers"] = tuple(LayerStrategy.from_dict(s) for s in layers)
        for key in ("embed", "head"):
            if data.get(key) is not None:
                data[key] = LayerStrategy.from_dict(data[key])
        if data.get("pp_division"):
            data["pp_division"] = tuple(data["pp_division"])
        else:
            data["pp_division"] = None
        if data.get("prediction") is not None:
            p = data["prediction"]
            data["prediction"] = Prediction(p["step_time_s"], p["throughput"], tuple(p.get("stage_memory_bytes", ())))
        return cls(**data)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "ParallelPlan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"plan JSON: cannot parse ({exc}). HINT: validate the file with `python -m json.tool`.") from exc
        return cls.from_dict(data)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "ParallelPlan":
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"plan YAML: cannot parse ({exc}). HINT: check indentation and colons.") from exc
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.write_text(self.to_json() if path.suffix == ".json" else self.to_yaml())

    @classmethod
    def load(cls, path: str | Path) -> "ParallelPlan":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"plan file {str(path)!r}: does not exist. HINT: write one with "
                             "galv search --out PLAN.yaml, or ParallelPlan.save().")
        text = path.read_text()
        return cls.from_json(text) if path.suffix == ".json" else cls.from_yaml(text)

    def describe(self) -> str:
        """A few human lines: the pipeline, then runs of consecutive layers sharing a strategy."""
        lines = [f"ParallelPlan: world {self.world_size} = pp {self.pp} x {self.stage_size} ranks/stage, "
                 f"{len(self.layers)} layers, micro-batches {self.micro_batches}, "
                 f"global batch {self.global_batch if self.global_batch is not None else 'from loader'}"
                 + (f", backend {self.backend}" if self.backend != "native" else "")]
        if self.pp > 1:
            lines.append(f"  pipeline: {self.pipeline_schedule}"
                         + (f" x{self.virtual_stages} virtual" if self.virtual_stages > 1 else "")
                         + f", layers per chunk {list(self.pp_division or ())}")
        assert self.embed is not None and self.head is not None
        lines.append(f"  embed        {self.embed.short()}")
        for start, stop, s in _runs(self.layers):
            label = f"layer {start}" if stop - start == 1 else f"layers {start}-{stop - 1}"
            lines.append(f"  {label:<12} {s.short()}")
        lines.append(f"  head         {self.head.short()}"
                     + (" (vocab-parallel loss)" if self.vocab_parallel_loss and self.head.tp > 1 else ""))
        experts = [i for i, s in enumerate(self.layers) if s.ep > 1]
        if experts:
            lines.append(f"  expert parallel: layers {_ranges(experts)} (E/ep experts per rank; EP groups of ep "
                         "consecutive ranks of the layer's data group)")
        if self.prediction is not None:
            p = self.prediction
            mem = format_bytes_list(p.stage_memory_bytes)
            lines.append(f"  predicted: {p.step_time_s * 1e3:.1f} ms/step, {p.throughput:.1f} samples/s"
                         + (f", stage memory {mem}" if p.stage_memory_bytes else ""))
        return "\n".join(lines)


@dataclass(frozen=True)
class ModelShape:
    """The few model facts plans are checked against and the cost model is sized by."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    seq_len: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def even_division(num_layers: int, chunks: int) -> tuple[int, ...]:
    """Split layers as evenly as possible; the earlier chunks get the remainder."""
    base, extra = divmod(num_layers, chunks)
    return tuple(base + (1 if i < extra else 0) for i in range(chunks))


def divisors(n: int) -> list[int]:
    """Every degree that splits ``n`` ranks (or layers, heads, ...) evenly, ascending.

    The one copy: plan validation names them in its hints, the planner enumerates pipeline and
    tensor-parallel degrees from them, the test helpers draw random factorizations from them.
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def _ranges(indices: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    parts: list[str] = []
    start = prev = indices[0]
    for i in list(indices[1:]) + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def _runs(items: Sequence[LayerStrategy]) -> Iterable[tuple[int, int, LayerStrategy]]:
    start = 0
    for i in range(1, len(items) + 1):
        if i == len(items) or items[i] != items[start]:
            yield start, i, items[start]
            start = i


def parse_plan(plan: "ParallelPlan | Mapping[str, Any] | str | Path") -> ParallelPlan:
    """Accept a plan, a dict, a path to a YAML/JSON file, or YAML/JSON text."""
    if isinstance(plan, ParallelPlan):
        return plan
    if isinstance(plan, Mapping):
        return ParallelPlan.from_dict(plan)
    if isinstance(plan, (str, Path)):
        text = str(plan)
        if isinstance(plan, Path) or text.endswith((".yaml", ".yml", ".json")):
            return ParallelPlan.load(text)
        stripped = text.lstrip()
        if stripped.startswith("{"):
            return ParallelPlan.from_json(text)
        if "\n" in text or ":" in text:
            return ParallelPlan.from_yaml(text)
        raise ValueError(f"plan={text!r}: not a plan file, YAML or JSON. HINT: pass a path ending in .yaml/.json.")
    raise TypeError(f"plan of type {type(plan).__name__}: expected ParallelPlan, dict or path. "
                    "HINT: GalvatronStrategy(plan='plan.yaml').")


def loader_layout(plan: ParallelPlan) -> tuple[Any, ...]:
    """What a training data loader is built for under ``plan``: world size, pipeline degree, data-parallel
    size, global batch, micro-batches, layer count and backend. Two plans with equal layouts can take turns
    on one running loader (a mid-fit plan switch, :mod:`lightning_galv.strategies.switch`)."""
    return (plan.world_size, plan.pp, plan.data_parallel_size, plan.global_batch, plan.micro_batches,
            len(plan.layers), plan.backend)
