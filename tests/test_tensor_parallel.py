"""Tensor parallelism, Megatron-SP and Ulysses SP: numerical parity with a single device.

One 4-rank gloo launch (tests/dist_tp_checks.py::run_all) runs every check; the tests below assert on
the numbers it returns. Each block check builds the single-device block with a fixed seed, copies it,
parallelizes the copy, runs forward + backward on the same input and upstream gradient on every rank,
and compares output, input gradient and every parameter's full gradient (``full_tensor()`` for sharded
DTensors; replicated DTensor gradients must already be full locally; Ulysses' partial plain gradients
summed over the group) with the reference: ``max|a - b| <= 1e-5 + 1e-5 * max|b|`` per tensor, fp32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from lightning_galv.plan import LayerStrategy

CHECKS = str(Path(__file__).parent / "dist_tp_checks.py") + "::run_all"
WORLD = 4

BLOCKS = [f"{m}/{s}" for m in ("llama", "gpt2") for s in
          ("tp2", "tp4", "tp2_megatron", "tp4_megatron", "ulysses2", "ulysses4", "tp2_strided")]
BLOCKS += [f"{m}/{s}/{v}" for m in ("llama", "gpt2") for s in ("tp4_megatron", "ulysses2")
           for v in ("accumulate", "checkpoint")]
ERRORS = {  # check name -> words the message must contain besides "HINT:"
    "tp_no_protocol": ["_NoProtocolBlock", "galv_tp_plan"],
    "megatron_no_protocol": ["_NoProtocolBlock", "galv_tp_plan"],
    "ulysses_no_protocol": ["_NoProtocolBlock", "galv_attention"],
    "tp_heads": ["2 heads", "tp=4"],
    "ulysses_heads": ["num_heads=2", "4"],
    "ulysses_seq": ["(2, 6, 32)", "divisible by 4"],
    "megatron_seq": ["(2, 6, 32)", "divisible by 4"],
    "mesh_mismatch": ["size 2", "tp=4"],
    "twice": ["already parallelized"],
    "head_vocab": ["vocab_size=62", "tp=4"],
    "embed_vocab": ["vocab_size=62", "tp=4"],
    "embed_ulysses": ["ulysses"],
}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    from lightning_galv.testing import run_distributed

    return run_distributed(CHECKS, WORLD, timeout=300)


def _assert_ok(results: list[dict[str, Any]], key: str) -> None:
    for rank, out in enumerate(results):
        r = out[key]
        assert r["ok"], f"rank {rank} {key}: max abs err {r['err']:.3g} (rel {r['rel']:.3g}); failing: {r['what']}"


@pytest.mark.parametrize("key", BLOCKS)
def test_block_parity(results: list[dict[str, Any]], key: str) -> None:
    _assert_ok(results, key)
    r = results[0][key]
    assert r["n"] >= r["n_params"] + 2  # output, input grad, and one comparison per parameter
    if "ulysses" in key:
        assert r["n_dtensor_params"] == 0, "Ulysses must leave the weights plain and replicated"
    else:
        assert r["n_dtensor_params"] > 0, "TP must shard the weights"
        assert not r["bad_grad_placements"]


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_and_head(results: list[dict[str, Any]], tp: int) -> None:
    _assert_ok(results, f"embed_head/tp{tp}")
    assert results[0][f"embed_head/tp{tp}"]["sharded"] == [True, True]


def test_whole_model_mixed_strategies(results: list[dict[str, Any]]) -> None:
    _assert_ok(results, "model/mixed")


@pytest.mark.parametrize("key", ["negative/ulysses2_unsummed_grads", "negative/tp4_perturbed_shard"])
def test_checks_can_fail(results: list[dict[str, Any]], key: str) -> None:
    """Negative controls: a real bug (unsummed Ulysses grads, a 1e-3 weight change) must be caught."""
    for rank, out in enumerate(results):
        assert not out[key]["ok"], f"rank {rank}: {key} passed but should have failed"


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_bad_inputs_raise_with_hint(results: list[dict[str, Any]], name: str) -> None:
    for rank, out in enumerate(results):
        e = out["errors"][name]
        assert e["raised"] in ("ValueError", "TypeError"), f"rank {rank} {name}: nothing raised"
        assert "HINT:" in e["msg"], e["msg"]
        for word in ERRORS[name]:
            assert word in e["msg"], f"{name}: {word!r} not in {e['msg']!r}"


def test_no_protocol_fails_before_touching_the_mesh() -> None:
    """In-process: the protocol check comes first, so it needs no process group at all."""
    from lightning_galv.parallel.sequence import apply_ulysses
    from lightning_galv.parallel.tensor import apply_tp

    block = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="galv_tp_plan.*HINT:"):
        apply_tp(block, None, LayerStrategy(tp=2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="galv_attention.*HINT:"):
        apply_ulysses(block, None, LayerStrategy(tp=2, sp="ulysses"))  # type: ignore[arg-type]
    apply_tp(block, None, LayerStrategy(tp=1))  # tp=1 is a no-op
    assert not hasattr(block, "_galv_parallel")


def test_only_apply_block_chooses_the_mode() -> None:
    """``apply_block`` is the one place that maps ``sp`` to a mode: each mode's own entry point refuses the
    other's strategies (before any check that needs a mesh) instead of silently delegating."""
    from lightning_galv.parallel.block import apply_block
    from lightning_galv.parallel.sequence import apply_ulysses
    from lightning_galv.parallel.tensor import apply_tp

    block = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="apply_tp.*HINT: use apply_block"):
        apply_tp(block, None, LayerStrategy(tp=2, sp="ulysses"))  # type: ignore[arg-type]
    for sp in ("none", "megatron"):
        with pytest.raises(ValueError, match="apply_ulysses.*HINT: use apply_block"):
            apply_ulysses(block, None, LayerStrategy(tp=2, sp=sp))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no mesh.*HINT: pass MeshFactory.mesh"):
        apply_block(block, None, LayerStrategy(tp=2, sp="ulysses"))
    apply_block(block, None, LayerStrategy(tp=1))  # tp=1 splits nothing and needs no mesh
    assert not hasattr(block, "_galv_parallel")


def test_forward_wrapper_survives_deepcopy() -> None:
    """The entry/exit wrapper is a bound method: a deep copy must call its own forward, not the original's."""
    import copy

    import torch

    from lightning_galv.parallel.boundary import wrap_block_forward

    block = nn.Linear(3, 3)
    wrap_block_forward(block, lambda args: (args[0] * 2, *args[1:]), lambda out: out + 1)
    clone = copy.deepcopy(block)
    with torch.no_grad():
        clone.weight.zero_()
        clone.bias.zero_()
    x = torch.ones(1, 3)
    assert torch.equal(clone(x), torch.ones(1, 3))  # 0 * (2x) + 0 + 1, via the clone's own weights
    assert torch.allclose(block(x), torch.nn.functional.linear(2 * x, block.weight, block.bias) + 1)
