"""The MoE block under tensor / sequence parallelism, and globally reduced aux losses under data parallelism.

One 2-rank gloo launch (tests/dist_moe_checks.py::run_all); tolerance as in test_tensor_parallel
(``max|a - b| <= 1e-5 + 1e-5 * max|b|`` per tensor, fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

CHECKS = str(Path(__file__).parent / "dist_moe_checks.py") + "::run_all"
WORLD = 2


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    from lightning_galv.testing import run_distributed

    return run_distributed(CHECKS, WORLD, timeout=300)


def _ok(results: list[dict[str, Any]], key: str) -> None:
    for rank, out in enumerate(results):
        r = out[key]
        assert r["ok"], f"rank {rank} {key}: max abs err {r['err']:.3g}; failing: {r['what']}"


@pytest.mark.parametrize("key", ["tp2", "tp2_megatron", "ulysses2"])
def test_moe_block_parity(results: list[dict[str, Any]], key: str) -> None:
    """Attention split as in a LLaMA block, the MoE layer whole on every rank, aux gradient injected."""
    _ok(results, key)
    r = results[0][key]
    assert r["moe_dtensor_params"] == 0  # router and experts stay plain (EP is their axis, not tp)
    assert (r["n_dtensor_params"] > 0) == (key != "ulysses2")
    # Ulysses routes this rank's sequence chunk; Megatron-SP gathers the whole sequence for the MoE layer
    assert r["stats_tokens"] == (8 if key == "ulysses2" else 16)


def test_dp_aux_loss_from_globally_reduced_sums(results: list[dict[str, Any]]) -> None:
    _ok(results, "dp2_global_aux")


@pytest.mark.parametrize("key", ["negative/megatron_chunked_moe", "negative/ulysses2_local_aux",
                                 "negative/dp2_local_aux"])
def test_checks_can_fail(results: list[dict[str, Any]], key: str) -> None:
    """Without the 'replicated' entry, or with per-shard aux losses, the same comparison fails."""
    assert not any(out[key]["ok"] for out in results)
    if key == "negative/dp2_local_aux":
        assert not results[0][key]["router_ok"]


def test_one_rank_expert_data_group_gets_no_expert_states(results: list[dict[str, Any]]) -> None:
    """ep = dp under ZeRO-3 (parallel/parallelize.py): nothing to shard over a one-rank expert-data group, so the
    experts stay plain tensors while the blocks' dense parameters are FSDP2 DTensors; a parameter-casting
    mixed-precision policy keeps the per-expert states (the block's would cast activations, not ignored weights)."""
    for out in results:
        plain, cast = out["ep2_zero3_states"], out["ep2_zero3_states_bf16"]
        assert plain["experts"] > 0 and cast["experts"] == plain["experts"]
        assert plain["expert_fsdp_states"] == 0 and plain["expert_dtensors"] == 0 and plain["dense_dtensors"]
        assert cast["expert_fsdp_states"] == cast["experts"] and cast["dense_dtensors"]
        assert plain["finite"] and cast["finite"]
