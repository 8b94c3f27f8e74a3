"""``tune()``: the analytic search proposes, real short runs decide (an Optuna study over plans).

Why: an analytic planner picks well but not best (its cost model is an approximation of a noisy machine).
The tuner measures. Its study's search space is the *plan space*: every trial is one ``ParallelPlan``,
identified by an integer ``plan_id`` whose plan is stored with the study (and as a user attribute of the
trial, in YAML, so ``optuna-dashboard`` shows it):

1. **Analytic first.** The planner's top plans (for every pipeline degree / micro-batch count the run can
   execute, ranked like automatic mode ranks them) are enqueued in predicted order.
2. **Measured second.** Once they are measured, the neighbours of the best measured plans (one dimension
   changed: tp/dp split, Megatron/Ulysses SP, ZeRO stage, checkpointing, of all layers at once; the expert-
   parallel degree of the MoE layers; the embedding / head strategy; the micro-batch count) are predicted with the *calibrated* cost model and the
   best unmeasured one is enqueued next.
3. **Every trial is a real run** in new processes (``lightning_galv.tuning.trial``): ``warmup_steps`` then
   ``steps`` measured steps of ``Trainer.fit`` with ``GalvatronStrategy(plan=...)``. Each measured step is
   reported to Optuna as the running throughput, so the pruner can stop a hopeless plan early (its ranks are
   killed; default: below the 25th percentile of earlier trials at the same step, after two trials -- a
   median rule would drop plans only slightly slower than the first one measured). A trial that runs out of memory is a *completed* trial whose constraint (peak memory minus
   budget) is violated; a crash, a hang (``trial_timeout``) or an exception is ``FAIL`` with the reason and
   the log tail as user attributes; the study goes on.
4. **Feedback.** After every completed trial a :class:`~lightning_galv.planner.calibration.Calibration` is fitted
   on all measured plans and the remaining candidates are re-ranked with it.
5. **Resumable, many workers.** SQLite by default; any Optuna storage URL works, and several ``tune()`` calls
   (processes, machines) may share one study. RDB storages get Optuna's heartbeats; storages without them
   (``journal:<file>``) get the tuner's own (a timestamp in the running trial's system attributes). Either way
   a trial left RUNNING by a killed tuner is marked failed and retried once when a tuner next starts, and
   completed trials are kept. Plan ids are a hash of the plan, so workers registering the same plan agree on
   its id; a trial that pops a plan another worker already runs or ran is closed as PRUNED with
   ``duplicate_of`` and not run again.
"""

from __future__ import annotations

import json
import math
import os
import warnings
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import bad_value
from ..plan import LayerStrategy, ParallelPlan, divisors

HEARTBEAT_S = 30  # default heartbeat period of RDB storages; a RUNNING trial silent for 2x that is stale
PLAN_PARAM = "plan_id"
MAX_PLANS = 1_000_000


@dataclass
class TuneResult:
    """What a tuning run found: the best measured plan (None if nothing completed within budget) and all trials."""

    best_plan: ParallelPlan | None
    best_throughput: float
    analytic_plan: ParallelPlan
    trials: list[dict[str, Any]] = field(default_factory=list)
    study_name: str = ""
    storage: str = ""

    def table(self) -> str:
        rows = ["| # | state | plan | predicted samples/s | measured samples/s | measured / predicted | peak MiB |",
                "|---|---|---|---|---|---|---|"]
        for t in self.trials:
            pred, meas = t.get("predicted_throughput"), t.get("throughput")
            ratio = f"{meas / pred:.2f}" if pred and meas else "-"
            peak = f"{t['peak_bytes'] / 2**20:.0f}" if t.get("peak_bytes") not in (None, math.inf) else "-"
            rows.append(f"| {t['number']} | {t['state']} | {t['summary']} | {pred or 0:.2f} | "
                        f"{(meas or 0):.2f} | {ratio} | {peak} |")
        return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------------------------------
def summary(plan: ParallelPlan) -> str:
    layers = sorted({s.short() for s in plan.layers})
    return (f"pp{plan.pp}·m{plan.micro_batches} [{', '.join(layers)}] embed {plan.embed.short()} "
            f"head {plan.head.short()}")


def neighbours(plan: ParallelPlan, model: Any) -> list[ParallelPlan]:
    """Valid plans one dimension away from ``plan`` (every layer changed alike, or the ends, or micro-batches).

    ``model`` is the model's :class:`~lightning_galv.plan.ModelShape`, or its
    :class:`~lightning_galv.planner.profiles.ModelProfile` -- which also says which layers have experts, so
    that for an MoE model the expert-parallel degree is one more dimension: every MoE layer takes the same
    new ep (one that divides its data group and its expert count), dense layers keep ep=1 (the runtime and
    the cost model refuse ep on them). A tp/sp change keeps each layer's ep where the new data group still
    divides by it (else ep=1), so it stays a change of one dimension wherever the plan allows it.
    """
    from ..plan import ModelShape

    shape = model if isinstance(model, ModelShape) else model.shape
    experts = ([lt.moe.num_experts if lt.moe is not None else 0 for lt in map(model.layer, range(len(plan.layers)))]
               if not isinstance(model, ModelShape) and len(plan.layers) == model.num_layers else None)
    stage = plan.world_size // plan.pp
    out: list[ParallelPlan] = []

    def add(**changes: Any) -> None:
        try:
            p = replace(plan, prediction=None, **changes)
            p.check_model(shape)
        except (ValueError, TypeError):
            return
        if p != plan and p not in out:
            out.append(p)

    def all_layers(f: Callable[[LayerStrategy], LayerStrategy]) -> None:
        try:
            add(layers=tuple(f(s) for s in plan.layers))
        except (ValueError, TypeError):
            pass

    def refactor(s: LayerStrategy, tp: int, sp: str) -> LayerStrategy:
        moved = replace(s, tp=tp, dp=stage // tp, sp=sp if tp > 1 else "none", ep=1)
        return replace(moved, ep=s.ep) if moved.data_group % s.ep == 0 else moved

    for tp in divisors(stage):
        for sp in ("none", "megatron", "ulysses"):
            all_layers(lambda s, tp=tp, sp=sp: refactor(s, tp, sp))
    if experts is not None and any(experts):
        moe = [i for i, e in enumerate(experts) if e]
        for ep in sorted({d for i in moe for d in divisors(plan.layers[i].data_group)}):
            if all(experts[i] % ep == 0 and plan.layers[i].data_group % ep == 0 for i in moe):
                add(layers=tuple(replace(s, ep=ep) if experts[i] else s for i, s in enumerate(plan.layers)))
    for zero in range(4):
        all_layers(lambda s, zero=zero: replace(s, zero=zero))
    all_layers(lambda s: replace(s, checkpoint=not s.checkpoint))
    for tp in divisors(stage):
        for end in ("embed", "head"):
            try:
                add(**{end: replace(getattr(plan, end), tp=tp, dp=stage // tp, sp="none")})
            except (ValueError, TypeError):
                pass
    if plan.pp > 1:
        per_shard = plan.global_batch // plan.data_parallel_size if plan.global_batch else 0
        for m in divisors(per_shard) if per_shard else ():
            add(micro_batches=m)
    return out


# ---------------------------------------------------------------------------------------------------
# the study
# ---------------------------------------------------------------------------------------------------
def _storage(url: str | None, study_name: str, heartbeat_s: int = HEARTBEAT_S) -> Any:
    import warnings

    import optuna
    from optuna.storages import RDBStorage

    retry = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback

    url = url or f"sqlite:///{Path(study_name + '.db').resolve()}"
    if url.startswith(("sqlite:", "postgresql", "mysql")):
        with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna 5, and the feature we need
            warnings.simplefilter("ignore")
            return RDBStorage(url, heartbeat_interval=heartbeat_s, grace_period=2 * heartbeat_s,
                              heartbeat_stale_trial_callback=retry(max_retry=1)), url
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(url[len("journal:"):])), url
    return optuna.storages.get_storage(url), url


def _registry(study: Any) -> dict[int, dict]:
    return {int(k[5:]): v for k, v in study.user_attrs.items() if k.startswith("plan:")}


def _register(study: Any, plan: ParallelPlan) -> int:
    """The plan's id in the study: a hash of its content, so two workers registering the same plan at the same
    time write the same key and value (a counter would give both the same next id for different plans)."""
    import hashlib

    reg = _registry(study)
    d = plan.with_(prediction=None).to_dict()
    for i, known in reg.items():
        if known == d:
            return i
    i = int(hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest(), 16) % MAX_PLANS
    while i in reg:  # a hash collision with another plan: the next free id
        i = (i + 1) % MAX_PLANS
    study.set_user_attr(f"plan:{i}", d)
    return i


GALV_HEARTBEAT = "galv_heartbeat"  # system attribute: wall-clock time of a running trial's last sign of life


def _has_native_heartbeat(storage: Any) -> bool:
    from optuna.storages._heartbeat import BaseHeartbeat

    return isinstance(storage, BaseHeartbeat) and storage.get_heartbeat_interval() is not None


def _beat(storage: Any, trial_id: int) -> None:
    """A sign of life of a running trial: Optuna's heartbeat where the storage has one, ours otherwise."""
    if _has_native_heartbeat(storage):
        storage.record_heartbeat(trial_id)
    else:
        storage.set_trial_system_attr(trial_id, GALV_HEARTBEAT, time.time())


def fail_stale_trials(study: Any, grace_s: float) -> list[int]:
    """Mark RUNNING trials with no sign of life for ``grace_s`` FAIL and retry each once (a WAITING copy), on
    storages without Optuna's heartbeat (journal files); what ``optuna.storages.fail_stale_trials`` does for RDB
    storages. A trial's last sign of life is its latest :func:`_beat`, else its start. Returns the failed
    trial numbers."""
    import optuna
    from optuna.trial import TrialState

    if _has_native_heartbeat(study._storage):
        return _fail_stale_rdb(study)
    now, failed = time.time(), []
    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback
    with warnings.catch_warnings():  # "experimental" in Optuna 5
        warnings.simplefilter("ignore")
        retry = cls(max_retry=1)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        last = t.system_attrs.get(GALV_HEARTBEAT, t.datetime_start.timestamp() if t.datetime_start else now)
        if now - float(last) <= grace_s:
            continue
        try:  # the reason first: a finished trial takes no more attributes
            study._storage.set_trial_user_attr(t._trial_id, "fail_reason",
                                               f"stale: no sign of life for {now - float(last):.0f} s (its tuner "
                                               "was killed?)")
            if not study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker got there first
        failed.append(t.number)
        if PLAN_PARAM in t.params:  # a trial killed before it chose its plan has nothing to retry
            retry(study, study._storage.get_trial(t._trial_id))
    return failed


def _fail_stale_rdb(study: Any) -> list[int]:
    import optuna
    from optuna.trial import TrialState

    before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))}
    with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna 5
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)  # Optuna's: FAIL, and its retry callback enqueues a copy
    return sorted({t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))} - before)


def _scheduled(study: Any) -> set[int]:
    """Plan ids of every trial so far, whatever its state: the tuner never enqueues a plan twice. (A trial a
    killed tuner left RUNNING is retried once by Optuna's heartbeat callback, as a WAITING copy.)"""
    out = set()
    for t in study.get_trials(deepcopy=False):
        pid = t.params.get(PLAN_PARAM, t.system_attrs.get("fixed_params", {}).get(PLAN_PARAM))
        if pid is not None:
            out.add(int(pid))
    return out


def tune(module_factory: str, data_factory: str, devices: int, n_trials: int = 10, *, storage: str | None = None,
         study_name: str = "galv-tune", top_k: int = 3, warmup_steps: int = 2, steps: int = 5,
         memory_budget: str | int | float | None = None, trial_timeout: float = 600.0, pruner: Any = None,
         extra_callbacks: Sequence[str] = (), best_plan_path: str | Path | None = None,
         candidates: Sequence[ParallelPlan] | None = None, heartbeat_s: int = HEARTBEAT_S,
         verbose: bool = True) -> TuneResult:
    """Measure the planner's best plans and their neighbours with real short runs (see the module docstring).

    ``module_factory`` / ``data_factory`` are import paths (``"pkg.mod:fn"``) of functions returning the
    LightningModule and a DataLoader or LightningDataModule -- trials run in new processes. ``n_trials``
    counts every trial of the study, earlier sessions included (resuming continues up to it).
    ``candidates`` replaces the analytic search (tests, or plans of your own), in the order given.
    """
    import optuna
    from optuna.trial import TrialState

    from ..testing import run_distributed
    from .trial import load_object

    for name, value in (("devices", devices), ("n_trials", n_trials), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad_value(f"{name}={value!r}", "must be an int >= 1", "e.g. tune(..., devices=4, n_trials=10).")
    load_object(module_factory), load_object(data_factory)  # fail here, not in every trial
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store, url = _storage(storage, study_name, heartbeat_s)
    study = optuna.create_study(storage=store, study_name=study_name, direction="maximize", load_if_exists=True,
                                sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=pruner or optuna.pruners.PercentilePruner(25.0, n_startup_trials=2,
                                                                                   n_warmup_steps=1))
    fail_stale_trials(study, 2 * heartbeat_s)  # a killed tuner's RUNNING trials: FAIL, re-enqueued once
    profiles = _profiles(study, module_factory, data_factory, devices, memory_budget, trial_timeout)
    model, hw, budget = profiles
    if candidates is None:
        if "analytic" not in study.user_attrs:
            study.set_user_attr("analytic", [p.to_dict() for p in _analytic(model, hw, devices, budget, top_k,
                                                                             study.user_attrs["loader_batch"],
                                                                             study.user_attrs["pipeline"])])
        candidates = [ParallelPlan.from_dict(d) for d in study.user_attrs["analytic"]]
    candidates = list(candidates)
    if not candidates:
        raise bad_value("no candidate plans", "the analytic search found nothing to measure",
                        "raise memory_budget or pass candidates=[...].")
    calibration = _calibrate(study, model, hw)
    bar = _Progress(verbose, study, n_trials)

    def choose() -> tuple[int, dict[str, Any]] | None:
        nxt = _next_plan(study, candidates, model, hw, calibration, budget)
        if nxt is None:
            return None
        attrs: dict[str, Any] = {"plan": nxt.to_yaml()}
        if nxt not in candidates and "next_base" in study.user_attrs:
            attrs["base"] = study.user_attrs["next_base"]  # which measured plan it neighbours
        return _register(study, nxt), attrs

    while len(study.get_trials(deepcopy=False)) < n_trials or _waiting(study):
        if not _waiting(study):
            chosen = choose()
            if chosen is None:
                break
            study.enqueue_trial({PLAN_PARAM: chosen[0]}, user_attrs=chosen[1])
        with warnings.catch_warnings():  # Optuna warns that heartbeats are meant for optimize(); the tuner beats itself
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = study.ask()
        if PLAN_PARAM not in trial._fixed_params:
            # another worker popped the plan this one queued, so ask() opened a fresh trial: give it the next plan
            chosen = choose()
            if chosen is None:
                trial.set_user_attr("duplicate_of", "none: nothing left to measure")
                study.tell(trial, state=TrialState.PRUNED)
                break
            _claim(study, trial, *chosen)
        pid = trial.suggest_int(PLAN_PARAM, 0, MAX_PLANS)
        plan = ParallelPlan.from_dict(_registry(study)[pid])
        first = _earlier_trial_of(study, trial, pid)
        if first is not None:  # another worker enqueued the same plan at the same time: run it once
            trial.set_user_attr("duplicate_of", first)
            study.tell(trial, state=TrialState.PRUNED)
            continue
        _run_one(study, trial, plan, pid, module_factory, data_factory, devices, warmup_steps, steps, budget,
                 trial_timeout, extra_callbacks, model, hw, calibration, run_distributed, verbose, heartbeat_s)
        calibration = _calibrate(study, model, hw)
        bar.update(study, n_trials)
    bar.close()
    result = _result(study, url, candidates[0])
    if best_plan_path is not None and result.best_plan is not None:
        result.best_plan.save(best_plan_path)
    return result


def _claim(study: Any, trial: Any, pid: int, attrs: dict[str, Any]) -> None:
    """Make a freshly opened trial measure plan ``pid``, as if it had been enqueued with it (Optuna 5 reads a
    queued trial's value from ``Trial._fixed_params``; the storage copy keeps :func:`_scheduled` right)."""
    trial._fixed_params = {**trial._fixed_params, PLAN_PARAM: pid}
    study._storage.set_trial_system_attr(trial._trial_id, "fixed_params", dict(trial._fixed_params))
    for k, v in attrs.items():
        trial.set_user_attr(k, v)


def _earlier_trial_of(study: Any, trial: Any, pid: int) -> int | None:
    """The number of an earlier trial with the same plan that ran, runs or will run (not a failed one: a retry of
    a failed trial is meant to run), if any."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False):
        if t.number >= trial.number or t.state == TrialState.FAIL:
            continue
        if t.state == TrialState.PRUNED and "duplicate_of" in t.user_attrs:
            continue
        other = t.params.get(PLAN_PARAM, t.system_attrs.get("fixed_params", {}).get(PLAN_PARAM))
        if other is not None and int(other) == pid:
            return t.number
    return None


def _waiting(study: Any) -> bool:
    from optuna.trial import TrialState

    return any(t.state == TrialState.WAITING for t in study.get_trials(deepcopy=False))


def _cost(model: Any, hw: Any, calibration: Any) -> Any:
    from ..planner import GalvatronCostModel
    from ..planner.space import SearchSpace

    if calibration is not None:
        model, hw = calibration.apply(model, hw)
    return GalvatronCostModel(model, hw, SearchSpace().default_embed_zero, runtime="native")


def _next_plan(study: Any, candidates: list[ParallelPlan], model: Any, hw: Any, calibration: Any,
               budget: float) -> ParallelPlan | None:
    """The next plan to measure: the analytic candidates in order, then a neighbour of one of the three best
    measured plans -- the base that has had the fewest neighbours measured (ties: the faster base), and its
    neighbour the calibrated model predicts fastest. Rotating over bases keeps one mispriced region (the
    model is least reliable exactly where it was wrong before) from absorbing every remaining trial."""
    reg = _registry(study)
    seen = {ParallelPlan.from_dict(reg[i]).with_(prediction=None) for i in _scheduled(study) if i in reg}
    for p in candidates:
        if p.with_(prediction=None) not in seen:
            return p
    cost = _cost(model, hw, calibration)
    best = sorted(_completed(study), key=lambda t: -(t.value or 0.0))[:3]
    tried: dict[int, int] = {}
    for t in study.get_trials(deepcopy=False):
        if "base" in t.user_attrs:
            tried[int(t.user_attrs["base"])] = tried.get(int(t.user_attrs["base"]), 0) + 1
    options = []
    for rank, t in enumerate(best):
        bid = int(t.params[PLAN_PARAM])
        base = ParallelPlan.from_dict(reg[bid])
        pool = []
        for nb in neighbours(base, model):
            if nb.with_(prediction=None) in seen:
                continue
            try:
                pc = cost.evaluate(nb)
            except ValueError:
                continue
            if pc.peak_memory_bytes <= budget:
                pool.append((pc.step_time_s, nb))
        if pool:
            options.append(((tried.get(bid, 0), rank), bid, min(pool, key=lambda x: x[0])[1]))
    if not options:
        return None
    _, bid, plan = min(options, key=lambda o: o[0])
    study.set_user_attr("next_base", bid)
    return plan


def _completed(study: Any) -> list[Any]:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE
            and all(c <= 0 for c in t.user_attrs.get("constraint", (0.0,)))]


def _calibrate(study: Any, model: Any, hw: Any) -> Any:
    """Calibration from every completed, in-budget trial (None before the first)."""
    from ..planner import GalvatronCostModel
    from ..planner.calibration import Calibration

    reg = _registry(study)
    measured = [(ParallelPlan.from_dict(reg[int(t.params[PLAN_PARAM])]), t.user_attrs["measured_step_s"], None)
                for t in _completed(study) if "measured_step_s" in t.user_attrs]
    if not measured:
        return None
    return Calibration.fit_plans(lambda m, h: GalvatronCostModel(m, h, runtime="native"), model, hw, measured)


def _run_one(study: Any, trial: Any, plan: ParallelPlan, pid: int, module_factory: str, data_factory: str,
             devices: int, warmup: int, steps: int, budget: float, timeout: float, extra: Sequence[str],
             model: Any, hw: Any, calibration: Any, run_distributed: Callable[..., Any], verbose: bool,
             heartbeat_s: float = HEARTBEAT_S) -> None:
    import optuna
    from optuna.trial import TrialState

    from ..testing import RankCrashed

    import socket

    pred = _cost(model, hw, calibration).evaluate(plan) if plan.global_batch else None
    trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")  # which tune() ran it (many may share a study)
    trial.set_user_attr("plan", plan.to_yaml())
    trial.set_user_attr("summary", summary(plan))
    if pred is not None:
        trial.set_user_attr("predicted_step_s", pred.step_time_s)
        trial.set_user_attr("predicted_peak_bytes", pred.peak_memory_bytes)
    report = tempfile.NamedTemporaryFile(prefix="galv_trial_", suffix=".jsonl", delete=False).name
    seen = [0]
    storage = study._storage
    _beat(storage, trial._trial_id)
    beat = [time.monotonic()]

    def poll() -> None:
        if time.monotonic() - beat[0] > heartbeat_s / 2:
            _beat(storage, trial._trial_id)
            beat[0] = time.monotonic()
        drain(prune=True)

    def drain(prune: bool) -> None:
        """Report the measured steps rank 0 appended since the last call (and prune, while the trial runs)."""
        lines = Path(report).read_text().splitlines() if os.path.exists(report) else []
        for line in lines[seen[0]:]:
            if not line.endswith("}"):
                break  # a line still being written
            r = json.loads(line)
            trial.report(r["samples"] / r["seconds"], r["step"])
            seen[0] += 1
            if prune and trial.should_prune():
                raise optuna.TrialPruned(f"step {r['step']}: {r['samples'] / r['seconds']:.2f} samples/s")

    tail: list[str] = []
    t0 = time.monotonic()
    try:
        for attempt in range(1 + LAUNCH_RETRIES):
            tail.clear()
            try:
                out = run_distributed("lightning_galv.tuning.trial:run_trial", devices,
                                      (plan.to_dict(), module_factory, data_factory, warmup, steps, report, tuple(extra)),
                                      init_process_group=False, timeout=timeout, poll=poll, log_tail=tail)[0]
                # steps written just before the ranks exited: the pruner of later trials compares against them
                drain(prune=False)
                break
            except RankCrashed as exc:
                if attempt == LAUNCH_RETRIES or not _transient(exc, seen[0]):
                    raise
                # a rank killed by a signal before any measured step, with no Python error in its log: a
                # launch fault (gloo's TCP transport can abort while pairs connect), not the plan's doing
                trial.set_user_attr(f"relaunched_{attempt}", f"{str(exc).splitlines()[0][:200]}\n{tail[0][-1500:] if tail else ''}")
                _say(verbose, f"trial {trial.number}: {str(exc).splitlines()[0][:120]} before its first step; relaunching")
                if os.path.exists(report):
                    os.unlink(report)
    except optuna.TrialPruned as exc:
        trial.set_user_attr("pruned_at", str(exc))
        study.tell(trial, state=TrialState.PRUNED)
        _say(verbose, f"trial {trial.number} pruned ({exc}): {summary(plan)}")
        return
    except (RuntimeError, TimeoutError, OSError) as exc:
        kind = "timeout (hang)" if isinstance(exc, TimeoutError) else "crash"
        cause = _last_error(tail[0] if tail else str(exc))
        trial.set_user_attr("fail_reason", f"{kind}: {str(exc).splitlines()[0][:200]}" + (f" -- {cause}" if cause else ""))
        trial.set_user_attr("log_tail", (tail[0] if tail else str(exc))[-2000:])
        study.tell(trial, state=TrialState.FAIL)
        _say(verbose, f"trial {trial.number} failed ({kind}): {summary(plan)}")
        return
    finally:
        if os.path.exists(report):
            os.unlink(report)
    trial.set_user_attr("wall_s", time.monotonic() - t0)
    peak = out["peak_bytes"]
    trial.set_user_attr("peak_bytes", peak)
    constraint = (peak - budget if math.isfinite(peak) else 1e30,)
    trial.set_user_attr("constraint", constraint)
    trial.set_constraint("peak_memory_minus_budget_bytes", constraint[0])  # Optuna's own record: samplers learn where memory ends
    if out["oom"] or not out["step_times"]:
        trial.set_user_attr("fail_reason", "out of memory" if out["oom"] else "no measured step")
        study.tell(trial, 0.0)
        return
    step = statistics.median(out["step_times"])
    trial.set_user_attr("measured_step_s", step)
    value = out["samples"] / step
    study.tell(trial, value)
    _say(verbose, f"trial {trial.number}: {value:.2f} samples/s ({summary(plan)})")


LAUNCH_RETRIES = 1  # relaunches of a trial whose ranks died of a signal before their first measured step


def _transient(exc: Any, measured_steps: int) -> bool:
    """A crash worth one relaunch: signal-killed, before any measured step, no Python error in its own log.

    (The surviving ranks' logs do show errors -- their peer vanished -- so only the dead rank's log counts.)
    """
    return exc.by_signal and measured_steps == 0 and _last_error(exc.own_log) is None


def _last_error(log: str) -> str | None:
    """The last ``SomethingError: message`` line of a rank log (what actually went wrong)."""
    import re

    found = re.findall(r"(?m)^(?:\[rank\d+\]:\s*)?([A-Za-z_.]*(?:Error|Exception|Interrupt)\b.*)$", log)
    return found[-1][:300] if found else None


def _result(study: Any, url: str, analytic: ParallelPlan) -> TuneResult:
    reg = _registry(study)
    trials = []
    for t in study.get_trials(deepcopy=False):
        pid = t.params.get(PLAN_PARAM)
        pred = t.user_attrs.get("predicted_step_s")
        plan = ParallelPlan.from_dict(reg[int(pid)]) if pid is not None and int(pid) in reg else None
        gb = plan.global_batch if plan is not None and plan.global_batch else None
        trials.append({"number": t.number, "state": t.state.name, "summary": t.user_attrs.get("summary", "?"),
                       "throughput": t.value, "predicted_throughput": gb / pred if gb and pred else None,
                       "peak_bytes": t.user_attrs.get("peak_bytes"), "reason": t.user_attrs.get("fail_reason")})
    done = _completed(study)
    if not done:
        return TuneResult(None, 0.0, analytic, trials, study.study_name, url)
    best = max(done, key=lambda t: t.value or 0.0)
    return TuneResult(ParallelPlan.from_dict(reg[int(best.params[PLAN_PARAM])]), float(best.value), analytic, trials,
                      study.study_name, url)


# ---------------------------------------------------------------------------------------------------
# profiles and the analytic search
# ---------------------------------------------------------------------------------------------------
def _profiles(study: Any, module_factory: str, data_factory: str, devices: int, memory_budget: Any,
              timeout: float) -> tuple[Any, Any, float]:
    """Model and hardware profiles of this machine (measured once per study, stored with it)."""
    from ..planner import HardwareProfile, ModelProfile
    from ..testing import run_distributed

    if "model_profile" not in study.user_attrs:
        r = run_distributed("lightning_galv.tuning.trial:profile_run", devices,
                            (module_factory, data_factory, memory_budget), timeout=timeout)[0]
        for k in ("model_profile", "hardware_profile", "budget", "loader_batch", "pipeline"):
            study.set_user_attr(k, r[k])
    a = study.user_attrs
    hw = HardwareProfile.from_json(a["hardware_profile"]) if a["hardware_profile"] else None
    return ModelProfile.from_json(a["model_profile"]), hw, float(a["budget"])


def _analytic(model: Any, hw: Any, world: int, budget: float, top_k: int, loader_batch: int | None,
              pipeline: bool) -> list[ParallelPlan]:
    from ..auto import run_configs
    from ..planner import SearchSpace, search
    from ..planner.search import rank_key

    found: list[ParallelPlan] = []
    cost = _cost(model, hw, None)
    for pp, gb, ms in run_configs(world, model.shape.num_layers, loader_batch, pipeline):
        try:
            found += search(model, hw, world, budget, global_batch=gb, top_k=top_k,
                            space=SearchSpace(pp_degrees=(pp,), micro_batches=ms), cost_model=cost)
        except ValueError:
            continue
    found.sort(key=rank_key)
    return found[:max(top_k, 1)]


def _say(enabled: bool, msg: str) -> None:
    if enabled:
        from tqdm import tqdm

        tqdm.write(f"[lightning_galv.tune] {msg}")  # above the progress bar, which stays at the bottom


class _Progress:
    """A progress bar over the study's finished trials (tqdm, on stderr) with the best throughput so far.

    Counts every finished trial of the study -- earlier sessions' and other workers' too, since ``n_trials``
    counts them -- so a resumed study starts where it stopped. Silent unless ``enabled``."""

    def __init__(self, enabled: bool, study: Any, total: int) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=min(_finished(study), total), desc="galv tune", unit="trial",
                             dynamic_ncols=True)

    def update(self, study: Any, total: int) -> None:
        if self._bar is None:
            return
        done = _finished(study)
        self._bar.total = max(total, done)
        self._bar.n = done
        best = max((t.value or 0.0 for t in _completed(study)), default=0.0)
        if best:
            self._bar.set_postfix_str(f"best {best:.2f} samples/s", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _finished(study: Any) -> int:
    return sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))
