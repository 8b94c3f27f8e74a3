"""The reference MoE decoder in one process: routing against a per-token loop, the documented capacity rule,
aux / z-losses against hand computations, the aux-gradient injection against plain autograd, routing
statistics, mixed dense/MoE configs, a few training steps, and config errors.

Exactness checks run in float64 so ``1e-6`` is a statement about the algorithm, not about fp32 rounding.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_galv.models.common import Rotary
from lightning_galv.models.llama import LlamaAttention, LlamaBlock
from lightning_galv.models.moe import (
    MoEBlock,
    MoEConfig,
    MoEDecoder,
    MoELayer,
    RouterSums,
    RoutingStats,
    capacity_for,
)
from lightning_galv.models.protocol import find_parts
from lightning_galv.demo.module import CausalLM, build_model

SMALL = dict(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=16)


def _layer(seed: int = 0, **cfg: Any) -> MoELayer:
    """A float64 MoE layer with router weights large enough that routing is far from uniform."""
    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig(**{**SMALL, **cfg}), layer_idx=1).double()
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 1.0)
        for p in layer.experts.parameters():
            p.normal_(0.0, 0.3)
        if layer.shared_expert is not None:
            for p in layer.shared_expert.parameters():
                p.normal_(0.0, 0.3)
        if layer.shared_gate is not None:
            layer.shared_gate.weight.normal_(0.0, 1.0)
    return layer


def _x(b: int = 3, s: int = 5, d: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, d, generator=g, dtype=torch.float64)


def _naive(layer: MoELayer, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Token by token, in token order: softmax, the k most probable experts (Python sort, not torch.topk),
    Mixtral renormalization for k = 2, each expert on the single token, capacity as documented."""
    b, s, d = x.shape
    flat = x.reshape(b * s, d)
    used = [0] * layer.num_experts
    rows = []
    for t in range(flat.shape[0]):
        xt = flat[t:t + 1]  # [1, d]
        p = torch.softmax(xt @ layer.router.weight.T, dim=-1)[0]  # [E]
        chosen = sorted(range(layer.num_experts), key=lambda e: -float(p[e].detach()))[:layer.top_k]
        w = [p[e] for e in chosen]
        if layer.top_k == 2 and layer.renormalize:
            w = [wi / (w[0] + w[1]) for wi in w]
        out = torch.zeros(1, d, dtype=x.dtype)
        for e, wi in zip(chosen, w):
            if capacity is not None and used[e] >= capacity:
                continue  # over capacity: dropped, contributes zero
            used[e] += 1
            out = out + wi * layer.experts[e](xt)
        if layer.shared_expert is not None:
            sh = layer.shared_expert(xt)
            if layer.shared_gate is not None:
                sh = torch.sigmoid(layer.shared_gate(xt)) * sh
            out = out + sh
        rows.append(out)
    return torch.cat(rows).view(b, s, d)


# ---------------------------------------------------------------------------------------------------
# forward / backward and routing exactness
# ---------------------------------------------------------------------------------------------------
def test_forward_backward_shapes_and_every_parameter_gets_a_gradient() -> None:
    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(**{**SMALL, "num_experts": 8, "top_k": 1, "shared_expert_hidden": 8}))
    tokens = torch.randint(0, 32, (2, 3))  # 6 tokens, 8 experts: some expert gets no token
    logits = model(tokens)
    assert logits.shape == (2, 3, 32)
    F.cross_entropy(logits.reshape(-1, 32), tokens.reshape(-1)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing  # idle experts get zero gradients, never None (gradient sync needs them)
    idle = [e for e, n in enumerate(model.layers[0].moe.last_stats.tokens_per_expert) if n == 0]
    assert idle and all(model.layers[0].moe.experts[e].w1.weight.grad.abs().sum() == 0 for e in idle)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("shared", ["none", "gated", "ungated"])
def test_dropless_routing_matches_per_token_loop(top_k: int, shared: str) -> None:
    cfg = dict(num_experts=4, top_k=top_k, shared_expert_hidden=0 if shared == "none" else 12,
               shared_expert_gate=shared == "gated", aux_loss_weight=0.0, z_loss_weight=0.0)
    layer = _layer(**cfg)
    ref = copy.deepcopy(layer)
    x = _x()
    gy = _x(seed=2)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = layer(x1)
    want = _naive(ref, x2)
    assert (out - want).abs().max() <= 1e-6
    (out * gy).sum().backward()
    (want * gy).sum().backward()
    assert (x1.grad - x2.grad).abs().max() <= 1e-6
    for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-6, name
    assert layer.last_stats.dropped == 0


def test_k1_keeps_raw_probability_and_k2_without_renormalize() -> None:
    """k = 1 is never renormalized (the router would get no LM gradient); renormalize=False keeps raw top-2."""
    for cfg in (dict(top_k=1), dict(top_k=2, renormalize=False)):
        layer = _layer(**cfg)
        x = _x()
        _, probs, weights, ids = layer.route(x.reshape(-1, 16))
        assert torch.equal(weights, probs.gather(1, ids))
        assert (layer(x) - _naive(layer, x)).abs().max() <= 1e-6


# ---------------------------------------------------------------------------------------------------
# capacity
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k,cf", [(1, 1.0), (2, 0.5), (2, 1.0), (1, 0.3)])
def test_capacity_drops_exactly_the_documented_tokens(top_k: int, cf: float) -> None:
    layer = _layer(num_experts=4, top_k=top_k, capacity_factor=cf)
    x = _x(b=4, s=6)
    t = 24
    cap = math.ceil(cf * t * top_k / 4)
    assert capacity_for(t, top_k, 4, cf) == cap
    out = layer(x)
    # rule, restated: walk tokens in (batch, seq) row-major order; an expert takes a token while it has room
    _, _, _, ids = layer.route(x.reshape(t, 16))
    used, keep, dropped = [0] * 4, [], [0] * 4
    for tok in range(t):
        for e in ids[tok].tolist():
            keep.append(used[e] < cap)
            if used[e] < cap:
                used[e] += 1
            else:
                dropped[e] += 1
    mask, got_cap = layer.keep_mask(ids.reshape(-1), t)
    assert got_cap == cap and mask.tolist() == keep
    stats = layer.last_stats
    assert stats.capacity == cap and list(stats.dropped_per_expert) == dropped
    assert list(stats.tokens_per_expert) == used and max(used) <= cap
    assert sum(stats.tokens_per_expert) == t * top_k - stats.dropped
    assert (out - _naive(layer, x, capacity=cap)).abs().max() <= 1e-6
    if cf < 1.0:
        assert stats.dropped > 0  # the case really drops something


def test_dropped_token_passes_through_the_residual() -> None:
    """A token dropped by every expert it chose leaves the MoE block as it left attention."""
    torch.manual_seed(0)
    cfg = MoEConfig(**{**SMALL, "top_k": 1, "num_experts": 2, "capacity_factor": 0.01})  # capacity 1
    block = MoEBlock(cfg, Rotary(4, 16)).double()
    x = _x(b=1, s=6)
    h = x + block.attention(block.attention_norm(x))
    out = block(x)
    stats = block.moe.last_stats
    assert stats.capacity == 1 and stats.dropped == 4
    _, _, _, ids = block.moe.route(block.ffn_norm(h).reshape(6, 16))
    first = {e: ids[:, 0].tolist().index(e) for e in set(ids[:, 0].tolist())}
    for t in range(6):
        if first[int(ids[t, 0])] != t:
            assert torch.equal(out[0, t], h[0, t])


# ---------------------------------------------------------------------------------------------------
# aux losses
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_and_z_loss_equal_hand_computation(top_k: int) -> None:
    layer = _layer(num_experts=4, top_k=top_k, capacity_factor=0.5)  # aux uses routed (pre-drop) counts
    x = _x()
    layer(x)
    flat = x.reshape(-1, 16)
    t = flat.shape[0]
    logits = flat @ layer.router.weight.T
    probs = torch.softmax(logits, -1)
    counts = [0.0] * 4
    for tok in range(t):
        for e in sorted(range(4), key=lambda e: -float(probs[tok, e]))[:top_k]:
            counts[e] += 1
    f = [c / (t * top_k) for c in counts]
    p = [float(probs[:, e].sum()) / t for e in range(4)]
    aux = 4 * sum(fe * pe for fe, pe in zip(f, p))
    z = sum(float(torch.log(torch.exp(logits[tok]).sum())) ** 2 for tok in range(t)) / t
    assert abs(float(layer.last_aux_loss) - aux) <= 1e-9
    assert abs(float(layer.last_z_loss) - z) <= 1e-9


def test_aux_loss_is_one_when_balanced_and_E_times_p_when_collapsed() -> None:
    layer = _layer(num_experts=4, top_k=1)
    e = 4
    # perfectly balanced sums: f_e = P_e = 1/E -> aux = 1
    sums = RouterSums(torch.tensor([3, 3, 3, 3]), torch.full((4,), 3.0, dtype=torch.float64), torch.tensor(0.0),
                      torch.tensor(12))
    assert float(layer.aux_losses(sums)[0]) == pytest.approx(1.0)
    # every token on expert 0 with probability p: aux = E * 1 * p
    x = torch.ones(1, 5, 16, dtype=torch.float64)
    layer(x)
    p = torch.softmax(x[0, 0] @ layer.router.weight.T, -1)
    top = int(p.argmax())
    assert layer.last_stats.routed_per_expert[top] == 5
    assert float(layer.last_aux_loss) == pytest.approx(e * float(p[top]), abs=1e-12)


def test_stats_reducer_hook_sees_local_sums_and_defines_the_aux_loss() -> None:
    """The reducer is the seam for global aux losses: it gets additive sums; what it returns is what counts."""
    layer = _layer(num_experts=4, top_k=2)
    seen: list[RouterSums] = []

    def doubled_by_a_twin_rank(s: RouterSums) -> RouterSums:  # as if a second rank had routed the same tokens
        seen.append(s)
        return RouterSums(s.counts * 2, s.prob_sum * 2, s.z_sum * 2, s.tokens * 2)

    x = _x()
    layer(x)
    aux_local, z_local = layer.last_aux_loss, layer.last_z_loss
    layer.stats_reducer = doubled_by_a_twin_rank
    layer(x)
    assert len(seen) == 1 and int(seen[0].tokens) == 15 and int(seen[0].counts.sum()) == 30
    assert seen[0].prob_sum.requires_grad  # P_e is differentiable, f_e is not
    assert not seen[0].counts.is_floating_point()
    assert torch.allclose(layer.last_aux_loss, aux_local) and torch.allclose(layer.last_z_loss, z_local)


def test_async_reducer_starts_after_routing_and_finishes_after_the_experts() -> None:
    """A reducer with ``start`` (GlobalRouterStats) is started before any expert runs and its result taken
    after the last one (so its collective hides behind the experts); the aux losses are what it returns."""
    layer = _layer(num_experts=4, top_k=2)
    events: list[str] = []
    for i, expert in enumerate(layer.experts):
        expert.register_forward_hook(lambda *_, i=i: events.append(f"expert{i}"))

    class Twin:
        def __call__(self, s: RouterSums) -> RouterSums:
            raise AssertionError("an async reducer is not called synchronously")

        def start(self, s: RouterSums):  # noqa: ANN201
            events.append("start")

            def finish() -> RouterSums:
                events.append("finish")
                return RouterSums(s.counts * 2, s.prob_sum * 2, s.z_sum * 2, s.tokens * 2)
            return finish

    x = _x()
    layer(x)
    aux_local = layer.last_aux_loss
    layer.stats_reducer = Twin()
    events.clear()
    layer(x)
    experts = [i for i, ev in enumerate(events) if ev.startswith("expert")]
    assert events.count("start") == events.count("finish") == 1 and experts
    assert events.index("start") < experts[0] and events.index("finish") > experts[-1]
    assert torch.allclose(layer.last_aux_loss, aux_local)


# ---------------------------------------------------------------------------------------------------
# aux-gradient injection
# ---------------------------------------------------------------------------------------------------
def _capture_aux(model: MoEDecoder) -> list[torch.Tensor]:
    """Record the (non-detached) weighted aux term of every MoE layer of ``model``."""
    terms: list[torch.Tensor] = []
    for layer in model.moe_layers:
        orig = layer.aux_losses

        def wrapped(sums: RouterSums, orig: Any = orig, layer: MoELayer = layer) -> tuple[torch.Tensor, torch.Tensor]:
            aux, z = orig(sums)
            terms.append(layer.aux_loss_weight * aux + layer.z_loss_weight * z)
            return aux, z
        layer.aux_losses = wrapped  # type: ignore[method-assign]
    return terms


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_injected_aux_gradient_equals_autograd_of_lm_plus_weighted_aux(scale: float) -> None:
    """``scale`` plays the accumulation factor: backward of ``scale * lm`` with injection scale ``scale`` must
    equal autograd of ``scale * (lm + sum_l w_aux * aux_l + w_z * z_l)``."""
    torch.manual_seed(0)
    cfg = MoEConfig(**{**SMALL, "n_layers": 3, "moe_every": 1, "aux_loss_weight": 0.3, "z_loss_weight": 0.05})
    model = MoEDecoder(cfg).double()
    with torch.no_grad():
        for layer in model.moe_layers:
            layer.router.weight.normal_(0.0, 0.5)
    ref = copy.deepcopy(model)
    terms = _capture_aux(ref)  # reference: the aux terms go into the loss explicitly ...
    for layer in ref.moe_layers:
        layer.aux_grad_scale = 0.0  # ... and the injection contributes nothing
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))

    model.set_aux_grad_scale(scale)
    lm = F.cross_entropy(model(tokens).reshape(-1, 32), tokens.reshape(-1))
    (scale * lm).backward()

    lm_ref = F.cross_entropy(ref(tokens).reshape(-1, 32), tokens.reshape(-1))
    assert len(terms) == 3
    (scale * (lm_ref + torch.stack(terms).sum())).backward()

    assert float(lm) == pytest.approx(float(lm_ref), abs=1e-12)  # the returned loss is pure cross entropy
    router_grads = 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-6 * max(1.0, float(q.grad.abs().max())), name
        router_grads += "router" in name
    assert router_grads == 3
    # and the aux term really moves the router: without it the router gradient differs
    plain = copy.deepcopy(model)
    plain.zero_grad()
    for layer in plain.moe_layers:
        layer.aux_loss_weight = layer.z_loss_weight = 0.0
    (scale * F.cross_entropy(plain(tokens).reshape(-1, 32), tokens.reshape(-1))).backward()
    r = model.moe_layers[0].router.weight.grad
    assert (plain.moe_layers[0].router.weight.grad - r).abs().max() > 1e-4 * r.abs().max()


def test_attach_aux_loss_output_is_not_a_view_and_without_grad_nothing_is_attached() -> None:
    layer = _layer()
    out = layer(_x())
    assert out._base is None and out.grad_fn is not None
    with torch.no_grad():
        assert layer(_x()).grad_fn is None


# ---------------------------------------------------------------------------------------------------
# routing statistics
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k,cf", [(1, None), (2, None), (2, 0.75)])
def test_stats_counts_sum_to_tokens_times_k(top_k: int, cf: float | None) -> None:
    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(**{**SMALL, "n_layers": 4, "moe_every": 2, "top_k": top_k, "capacity_factor": cf}))
    assert not model.routing_log.enabled  # off unless a reader turns it on: no unbounded growth
    model(torch.randint(0, 32, (2, 8)))
    assert len(model.routing_log) == 0
    model.routing_log.enable()
    model(torch.randint(0, 32, (2, 8)))
    model(torch.randint(0, 32, (1, 8)))
    entries = model.routing_log.drain()
    assert len(model.routing_log) == 0
    assert [s.layer for s in entries] == [1, 3, 1, 3] and [s.tokens for s in entries] == [16, 16, 8, 8]
    for s in entries:
        assert isinstance(s, RoutingStats)
        assert sum(s.routed_per_expert) == s.tokens * top_k
        assert sum(s.tokens_per_expert) == s.tokens * top_k - s.dropped
        assert s.source_expert_counts == (s.tokens_per_expert,)  # one source row in one process
        assert s.source_expert_tensor().shape == (1, 4)
        assert s.expert_splits == s.tokens_per_expert and s.send_splits is None and s.recv_splits is None
        assert (cf is None) == (s.capacity is None)
        if cf is None:
            assert s.dropped == 0 and s.tokens_per_expert == s.routed_per_expert
    assert entries[-1] is model.layers[3].moe.last_stats
    with pytest.raises(Exception):
        entries[0].tokens = 3  # type: ignore[misc]  # frozen


@pytest.mark.parametrize("early_stop", [True, False])
def test_checkpoint_recompute_records_once_and_gives_the_same_gradients(early_stop: bool) -> None:
    """With early stop (torch's default) the recompute ends before the stats are recorded anyway; without it
    the recompute runs the whole block again, inside backward, and must not record a second time."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from lightning_galv.parallel.activation_checkpoint import apply_checkpointing

    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(**{**SMALL, "aux_loss_weight": 0.1}))
    ckpt = copy.deepcopy(model)
    for block in ckpt.layers:
        apply_checkpointing(block)
    tokens = torch.randint(0, 32, (2, 8))
    for m in (model, ckpt):
        m.routing_log.enable()
        with set_checkpoint_early_stop(early_stop):
            F.cross_entropy(m(tokens).reshape(-1, 32), tokens.reshape(-1)).backward()
    assert len(ckpt.routing_log) == len(model.routing_log) == 2
    for (name, p), q in zip(model.named_parameters(), ckpt.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


# ---------------------------------------------------------------------------------------------------
# protocol, mixed blocks, registration
# ---------------------------------------------------------------------------------------------------
def test_mixed_dense_and_moe_blocks_follow_the_protocol() -> None:
    model = MoEDecoder(MoEConfig(**{**SMALL, "n_layers": 4, "moe_every": 2}))
    assert [type(b) for b in model.layers] == [LlamaBlock, MoEBlock, LlamaBlock, MoEBlock]
    assert MoEConfig(**{**SMALL, "n_layers": 5, "moe_layers": [4, 0]}).moe_layer_ids() == (0, 4)
    assert MoEConfig(**{**SMALL, "n_layers": 6, "moe_every": 3}).moe_layer_ids() == (2, 5)
    parts = find_parts(model)
    assert parts.understood and parts.blocks is model.layers
    moe_plan, dense_plan = type(parts.blocks[1]).galv_tp_plan, type(parts.blocks[0]).galv_tp_plan
    assert moe_plan.pop("moe") == "replicated"
    assert {k: v for k, v in dense_plan.items() if k.startswith("attention")} == \
        {k: v for k, v in moe_plan.items() if k.startswith("attention")}
    assert type(parts.blocks[1]).galv_attention == type(parts.blocks[0]).galv_attention == "attention.core"
    assert type(model.layers[1].attention) is LlamaAttention  # reused, not duplicated
    shape = model.galv_shape(seq_len=8)
    assert (shape.num_layers, shape.hidden, shape.ffn_hidden, shape.seq_len) == (4, 16, 24, 8)
    ms = model.galv_moe_shape()
    assert (ms.moe_layers, ms.num_experts, ms.top_k, ms.expert_hidden) == ((1, 3), 4, 2, 24)
    keys = set(model.state_dict())
    assert "layers.1.moe.experts.3.w1.weight" in keys and "layers.1.moe.router.weight" in keys


def test_causal_lm_builds_moe_and_rejects_moe_options_elsewhere() -> None:
    lm = CausalLM(kind="moe", **SMALL, num_experts=3, top_k=1, moe_every=2, shared_expert_hidden=8)
    assert isinstance(lm.model, MoEDecoder)
    assert lm.model.cfg.num_experts == 3 and lm.model.cfg.top_k == 1 and lm.model.cfg.moe_layer_ids() == (1,)
    with pytest.raises(ValueError, match="HINT:.*kind moe"):
        build_model("llama", dim=16, n_heads=4, num_experts=4)
    with pytest.raises(ValueError, match="'llama', 'gpt2' or 'moe'"):
        build_model("mixtral")


def test_causal_lm_fit_scales_aux_gradient_by_accumulation_and_logs_aux() -> None:
    import lightning.pytorch as L

    torch.manual_seed(0)
    lm = CausalLMForTest(kind="moe", **SMALL, num_experts=4, top_k=2, lr=1e-2)
    data = torch.randint(0, 32, (8, 9), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer = L.Trainer(max_steps=2, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lm, loader)
    assert lm.scales and set(lm.scales) == {0.5}
    assert "train_aux_loss" in trainer.callback_metrics and "train_z_loss" in trainer.callback_metrics
    assert float(trainer.callback_metrics["train_aux_loss"]) > 0



class CausalLMForTest(CausalLM):
    """Records the aux-gradient scale its MoE layers use in each training step."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.scales: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.scales += [m.aux_grad_scale for m in self.model.moe_layers]
        return super().training_step(batch, batch_idx)


def test_tiny_model_trains() -> None:
    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(**{**SMALL, "moe_every": 1, "shared_expert_hidden": 8}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, 32), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.6 * losses[0], losses
    assert all(b < a for a, b in zip(losses[:5], losses[1:6])), losses


# ---------------------------------------------------------------------------------------------------
# config errors
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,words", [
    (dict(top_k=3), ["top_k=3", "1 (Switch) or 2"]),
    (dict(top_k=0), ["top_k=0", "1 (Switch) or 2"]),
    (dict(top_k=2, num_experts=1), ["top_k=2, num_experts=1", "cannot exceed"]),
    (dict(num_experts=0), ["num_experts=0", "at least one"]),
    (dict(capacity_factor=0.0), ["capacity_factor=0.0", "> 0"]),
    (dict(capacity_factor=-1.5), ["capacity_factor=-1.5", "> 0"]),
    (dict(moe_layers=(0, 2)), ["moe_layers=(0, 2)", "[2]", "outside 0..1"]),
    (dict(moe_layers=(-1,)), ["moe_layers=(-1,)", "outside"]),
    (dict(moe_layers=(1, 1)), ["moe_layers=(1, 1)", "distinct"]),
    (dict(moe_every=0), ["moe_every=0", "1..n_layers=2"]),
    (dict(moe_every=3), ["moe_every=3", "1..n_layers=2"]),
    (dict(shared_expert_hidden=-1), ["shared_expert_hidden=-1", ">= 0"]),
    (dict(aux_loss_weight=-0.1), ["aux_loss_weight=-0.1", ">= 0"]),
    (dict(n_heads=3), ["n_heads=3", "divisible"]),
])
def test_bad_config_names_value_rule_and_hint(bad: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        MoEConfig(**{**SMALL, **bad})
    msg = str(err.value)
    assert "HINT:" in msg
    for w in words:
        assert w in msg, (w, msg)


def test_model_revalidates_a_mutated_config() -> None:
    cfg = MoEConfig(**SMALL)
    cfg.top_k = 5
    with pytest.raises(ValueError, match="top_k=5.*HINT:"):
        MoEDecoder(cfg)


def test_block_dropout_runs_and_is_keyed() -> None:
    from lightning_galv.models.dropout import dropout_key

    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(**{**SMALL, "dropout": 0.2}))
    tokens = torch.randint(0, 32, (2, 8))
    with dropout_key(7):
        a = model(tokens)
    with dropout_key(7):
        b = model(tokens)
    with dropout_key(8):
        c = model(tokens)
    assert torch.equal(a, b) and not torch.equal(a, c)
    model.eval()
    assert torch.equal(model(tokens), model(tokens))


def test_module_types() -> None:
    model = MoEDecoder(MoEConfig(**SMALL))
    assert all(isinstance(m, MoELayer) for m in model.moe_layers) and len(model.moe_layers) == 2
    assert isinstance(model.layers[0].moe.experts, nn.ModuleList)


def test_expert_parallel_plans_are_validated_at_creation_and_against_the_model() -> None:
    """Issue 11: ep must divide the layer's data group (plan creation), the layer's experts, and may only sit
    on MoE layers (checked against the model before any collective)."""
    from lightning_galv.models.protocol import find_parts
    from lightning_galv.parallel.parallelize import check_plan_for_model
    from lightning_galv.plan import LayerStrategy, ParallelPlan

    with pytest.raises(ValueError, match=r"ep=3 with tp=1, dp=4.*must divide it.*HINT: pick ep from the divisors of 4"):
        LayerStrategy(dp=4, ep=3)
    with pytest.raises(ValueError, match=r"ep=4 with tp=2, dp=2.*HINT"):
        LayerStrategy(tp=2, dp=2, ep=4)  # TP ranks hold the same tokens: the data group is dp=2
    assert LayerStrategy(tp=2, dp=2, sp="ulysses", ep=4).ep == 4  # Ulysses: the data group is dp*tp=4
    assert LayerStrategy.from_dict(LayerStrategy(dp=4, ep=2).to_dict()) == LayerStrategy(dp=4, ep=2)
    assert "ep2" in LayerStrategy(dp=4, ep=2).short()

    model = MoEDecoder(MoEConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                 max_seq_len=16, num_experts=6, moe_layers=(0, 2)))
    parts = find_parts(model)
    ok = ParallelPlan(4, (LayerStrategy(dp=4, ep=2), LayerStrategy(dp=4), LayerStrategy(dp=4, ep=2)))
    check_plan_for_model(ok, parts)
    with pytest.raises(ValueError, match=r"block layers.1: ep=2 but the block has no MoE layer.*HINT"):
        check_plan_for_model(ParallelPlan(4, (LayerStrategy(dp=4), LayerStrategy(dp=4, ep=2), LayerStrategy(dp=4))),
                             parts)
    with pytest.raises(ValueError, match=r"block layers.0: ep=4 does not divide its 6 experts.*HINT"):
        check_plan_for_model(ParallelPlan(4, (LayerStrategy(dp=4, ep=4), LayerStrategy(dp=4), LayerStrategy(dp=4))),
                             parts)
    with pytest.raises(ValueError, match=r"head strategy ep=2: expert parallelism applies to MoE layers only"):
        check_plan_for_model(ParallelPlan(4, (LayerStrategy(dp=4),) * 3, head=LayerStrategy(dp=4, ep=2)), parts)


def test_routing_skew_is_the_busiest_ep_ranks_share_over_the_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    """profiling.measure_routing_skew routes one global batch and reads, per ep, the busiest rank's routed copies
    over its EP group's mean (EP groups = consecutive data shards, rank r owning experts [r E/ep, (r+1) E/ep)).
    A router that sends samples 0-1 to experts 0 and 1 and samples 2-3 to experts 2 and 3 loads one rank of each
    2-shard EP group with everything (2.0) and is balanced over 4 ranks (1.0) or over one group of 2 shards."""
    from lightning_galv.profiling import measure_routing_skew

    torch.manual_seed(0)
    model = MoEDecoder(MoEConfig(**{**SMALL, "num_experts": 4, "top_k": 2}))
    seq, real = 8, MoELayer.route

    def halves(self: MoELayer, x: torch.Tensor) -> Any:
        logits, probs, weights, ids = real(self, x)  # [T, E], [T, E], [T, k], [T, k]
        first = torch.arange(x.shape[0]) // seq < 2  # [T] tokens of samples 0 and 1
        ids = torch.where(first[:, None], torch.tensor([0, 1]), torch.tensor([2, 3]))  # [T, 2]
        return logits, probs, torch.full_like(weights, 0.5), ids

    monkeypatch.setattr(MoELayer, "route", halves)
    tokens = torch.randint(0, SMALL["vocab_size"], (4, seq))
    assert measure_routing_skew(model, lambda: model(tokens), 4, 4) == {2: 2.0, 4: 1.0}
    assert measure_routing_skew(model, lambda: model(tokens), 4, 2) == {2: 1.0}
    assert measure_routing_skew(model, lambda: model(tokens), 4, 4, ep_degrees=(2,)) == {2: 2.0}
    assert all("route" not in layer.__dict__ for layer in model.modules() if isinstance(layer, MoELayer))
    monkeypatch.undo()
    balanced = measure_routing_skew(model, lambda: model(tokens), 4, 4)  # the real (untrained) router
    assert set(balanced) == {2, 4} and all(v >= 1.0 for v in balanced.values())
    with pytest.raises(ValueError, match="shards must split.*HINT:"):
        measure_routing_skew(model, lambda: model(tokens), 4, 3)
    with pytest.raises(ValueError, match="ep=3.*HINT:"):
        measure_routing_skew(model, lambda: model(tokens), 4, 4, ep_degrees=(3,))
    with pytest.raises(ValueError, match="exactly once.*HINT:"):
        measure_routing_skew(model, lambda: None, 4, 4)
    with pytest.raises(ValueError, match="no MoELayer.*HINT:"):
        measure_routing_skew(nn.Linear(2, 2), lambda: None, 4, 4)
