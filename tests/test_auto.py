"""Automatic mode, pure parts: which pipeline configurations a run can execute, and the budget margin."""

from __future__ import annotations

from lightning_galv.auto import run_configs
from lightning_galv.testing import count_refused


def test_run_configs_follow_the_loader_batch() -> None:
    # 4 ranks, 3 layers, loader batch 4 per shard, pipeline hooks present
    got = run_configs(4, 3, 4, pipeline=True)
    # pp=4 > 3 layers is impossible; pp=1 never splits the batch (no micro-batching without a pipeline)
    assert got == [(1, 16, (1,)), (2, 8, (1, 2, 4))]
    # every micro-batch count divides the per-shard batch, and global batch = loader batch x world / pp
    for pp, gb, ms in run_configs(8, 8, 6, pipeline=True):
        assert gb == 6 * 8 // pp and all(6 % m == 0 for m in ms)


def test_profile_batch_sizes_cover_the_loader_batch() -> None:
    """Automatic mode times blocks at 1 and 2 samples and at the loader's per-shard batch (capped at 8), so a
    data-parallel layer's size is measured, not extrapolated."""
    from lightning_galv.auto import profile_batch_sizes

    assert profile_batch_sizes(None) == (1, 2) and profile_batch_sizes(1) == (1, 2) and profile_batch_sizes(2) == (1, 2)
    assert profile_batch_sizes(4) == (1, 2, 4) and profile_batch_sizes(6) == (1, 2, 6)
    assert profile_batch_sizes(64) == (1, 2, 8)


def test_tp_variants_are_profiled_at_the_batch_a_tp_block_runs() -> None:
    """At global batch = loader batch x world (run_configs, pp 1) a tp-t block's data group is world / t, so each
    rank runs t x the loader batch; automatic mode times the tp-t variants there (capped at 8 x t), not only at
    the tp-1 counts a line would extrapolate from."""
    from lightning_galv.auto import profile_batch_sizes, tp_batch_sizes

    assert profile_batch_sizes(2, 2) == (1, 2, 4) and profile_batch_sizes(1, 2) == (1, 2)
    assert profile_batch_sizes(4, 4) == (1, 2, 16) and profile_batch_sizes(64, 2) == (1, 2, 16)
    assert tp_batch_sizes(2, 4) == {2: (1, 2, 4), 4: (1, 2, 8)}
    assert tp_batch_sizes(4, 2) == {2: (1, 2, 8)} and tp_batch_sizes(3, 1) == {}
    assert tp_batch_sizes(None, 2) == {2: (1, 2, 4)}  # the loader batch the search then assumes (2)
    for world in (2, 4, 8):
        for loader in (1, 2, 3, 4):
            gb = run_configs(world, 8, loader, pipeline=False)[0][1]
            for t, sizes in tp_batch_sizes(loader, world).items():
                assert gb // (world // t) in sizes or gb // (world // t) <= 2


def test_run_configs_without_hooks_or_batch() -> None:
    assert run_configs(4, 8, 4, pipeline=False) == [(1, 16, (1,))]
    # unknown loader batch: only what runs with any batch size
    assert run_configs(4, 8, None, pipeline=True) == [(1, 8, (1,))]


def test_no_plan_fits_names_the_smallest_budget_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every pipeline degree fails: one line naming the smallest fitting budget in readable units, one HINT."""
    import pytest

    from lightning_galv.auto import search_run_plans
    from lightning_galv.plan import ModelShape
    from lightning_galv.planner import HardwareProfile, ModelProfile

    shape = ModelShape(num_layers=4, hidden=64, num_heads=4, num_kv_heads=4, ffn_hidden=128, vocab_size=256,
                       seq_len=64)
    profile, hw = ModelProfile.from_shape(shape), HardwareProfile.uniform(1, 4, 1e9)
    with pytest.raises(ValueError) as err:
        search_run_plans(profile, hw, 4, 4, 1000.0, 0.02, 4, True, False, cache_dir=tmp_path)
    msg = str(err.value)
    assert msg.count("HINT:") == 1 and msg.count("smallest memory that would fit") == 1, msg
    assert "by pipeline degree: pp=1 " in msg and "pp=2 " in msg and "0.00 GiB" not in msg, msg
    assert "\n" not in msg
    assert "pipeline hooks" not in msg  # pipelines were searched (pipeline=True): the HINT does not suggest them
    with pytest.raises(ValueError, match=r"HINT: .*or give the LightningModule the pipeline hooks"):
        search_run_plans(profile, hw, 4, 4, 1000.0, 0.02, 4, False, False, cache_dir=tmp_path)


def test_search_keeps_to_what_the_model_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An adapted HF GPT-2 runs tp > 1 blocks only under Ulysses (``galv_sp_modes``) and refuses the rest
    (``galv_check_plan``): the search restricted by both returns only plans it accepts, and still splits blocks by
    Ulysses; unrestricted, the search space offers strategies it refuses (what auto mode used to pick from). A
    plan the model's check refuses is dropped whatever its rank."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_galv.auto import search_run_plans
    from lightning_galv.models.hf import galv_hf
    from lightning_galv.models.protocol import find_parts
    from lightning_galv.planner import HardwareProfile, ModelProfile

    cfg = AutoConfig.for_model("gpt2", vocab_size=64, n_embd=64, n_head=4, n_layer=4, n_positions=64,
                               tie_word_embeddings=False)
    parts = find_parts(galv_hf(AutoModelForCausalLM.from_config(cfg)))
    assert parts.sp_modes == ("ulysses",)
    profile, hw = ModelProfile.from_shape(parts.shape), HardwareProfile.uniform(1, 4, 1e9)

    def refused(plans: list) -> int:
        return count_refused(parts, plans)

    from lightning_galv.plan import LayerStrategy, ParallelPlan
    from lightning_galv.planner import SearchSpace
    from lightning_galv.planner.space import candidate_strategies

    def offered(space: SearchSpace) -> list:  # each layer strategy the space offers, as a uniform plan
        return [ParallelPlan.uniform(4, 4, s, embed=LayerStrategy(dp=4), head=LayerStrategy(dp=4))
                for s in candidate_strategies(parts.shape, 4, 4, space)]

    limited_space = offered(SearchSpace(sp_modes=parts.sp_modes))
    assert refused(offered(SearchSpace())) > 0 and refused(limited_space) == 0
    assert any(p.layers[0].tp > 1 and p.layers[0].ulysses for p in limited_space)
    args = (profile, hw, 4, 4, 8e9, 0.02, 4, True, False)
    limited = search_run_plans(*args, top_k=50, cache_dir=tmp_path, sp_modes=parts.sp_modes,
                               check_plan=parts.check_plan)
    assert limited.plans and refused(limited.plans) == 0
    # the model's check drops plans whatever their rank: refuse the unrestricted search's best one
    best = search_run_plans(*args, top_k=3, cache_dir=tmp_path).plans[0]

    def not_best(plan: object) -> None:
        if plan == best:
            raise ValueError("refused. HINT: none")

    dropped = search_run_plans(*args, top_k=3, cache_dir=tmp_path, check_plan=not_best)
    assert best not in dropped.plans and dropped.plans and any("refuses dropped" in n for n in dropped.notes)
    # a check that refuses everything: a ValueError naming the refusal, not an empty pick
    import pytest

    def refuse_all(plan: object) -> None:
        raise ValueError("nothing runs here. HINT: none")

    with pytest.raises(ValueError, match="the model refused every plan.*HINT"):
        search_run_plans(*args, top_k=3, cache_dir=tmp_path, check_plan=refuse_all)


def test_automatic_profiles_price_the_ends(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The model profile automatic mode takes times the final norm + output projection + loss (it was zero, so no
    plan paid for its head) and the token embedding (it was zero too), forward and backward, on copies: the
    model's own weights are untouched. Dense, MoE and an HF model (GPT-2, whose final norm is a LayerNorm)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_galv.auto import embed_maker, head_maker, profile_model
    from lightning_galv.models import Llama, LlamaConfig, MoEConfig, MoEDecoder
    from lightning_galv.models.hf import galv_hf
    from lightning_galv.models.protocol import find_parts

    small = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)
    gpt2 = AutoConfig.for_model("gpt2", vocab_size=64, n_embd=32, n_head=4, n_layer=2, n_positions=16,
                                tie_word_embeddings=False)
    for model in (Llama(LlamaConfig(**small)), MoEDecoder(MoEConfig(**small, num_experts=4)),
                  galv_hf(AutoModelForCausalLM.from_config(gpt2))):
        parts = find_parts(model)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        head = head_maker(parts)
        assert head is not None and head() is not parts.head and head()(torch.randn(2, 16, 32)).shape == (2, 16, 64)
        embed = embed_maker(parts)
        assert embed is not None and embed() is not parts.embedding
        assert embed()(torch.randint(0, 64, (2, 16))).shape == (2, 16, 32)
        prof = profile_model(model, parts, batch_sizes=(1, 2))
        name = type(model).__name__
        for fit in (prof.head_forward, prof.head_backward, prof.embed_forward, prof.embed_backward):
            assert fit is not None and fit(1, 16) > 0 and fit(2, 16) > 0, (name, prof)
        again = type(prof).from_json(prof.to_json())  # the measured backwards travel with the profile
        assert (again.head_backward, again.embed_backward) == (prof.head_backward, prof.embed_backward)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_automatic_mode_profiles_on_the_training_device(tmp_path, monkeypatch, one_rank_group) -> None:  # type: ignore[no-untyped-def]
    """The device automatic mode trains on reaches every profiler: a GPU run profiled its blocks and ends on the
    CPU (the ModelProfiler's and ShardedLayerProfiler's default), and the sharded profiler's meshes took the
    device's full name where DeviceMesh wants its type. No GPU here: the profilers are spied on, not run there."""
    import torch

    from lightning_galv import auto
    from lightning_galv.models import Llama, LlamaConfig
    from lightning_galv.models.protocol import find_parts
    from lightning_galv.planner import HardwareProfile, ProfileCache
    from lightning_galv.profiling import profilers

    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                              max_seq_len=16))
    parts = find_parts(model)
    gpu = torch.device("cuda", 1)
    assert auto.model_profiler(model, parts, device=gpu).device == gpu
    # a profile timed beside other busy ranks is cached for that rank count only (one rank keeps its old key)
    keys = {n: auto.model_profiler(model, parts, busy_ranks=n).key() for n in (1, 2, 4)}
    assert len(set(keys.values())) == 3 and keys[1] == auto.model_profiler(model, parts).key()
    seen: list[object] = []
    real = auto.model_profiler

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        seen.append(kw.pop("device", args[5] if len(args) > 5 else None))
        return real(*args[:5], **kw)  # measured on the CPU here

    monkeypatch.setattr(auto, "model_profiler", spy)
    profile, hw = auto.measure_profiles(model, parts, 1, 1e9, verbose=False, cache=ProfileCache(tmp_path),
                                        device=gpu)
    assert seen == [gpu] and hw is None and profile.head_backward is not None

    class Stop(Exception):
        pass

    class Sharded:  # records what sharded_profile builds, then stops before any timing
        def __init__(self, *args, **kw):  # type: ignore[no-untyped-def]
            seen.append(kw["device"])
            raise Stop

    monkeypatch.setattr(profilers, "ShardedLayerProfiler", Sharded)
    with __import__("pytest").raises(Stop):
        auto.sharded_profile(model, parts, profile, HardwareProfile.uniform(1, 2, 1e10), None, False, device=gpu)
    assert seen[-1] == "cuda:1"
