"""OnlineProfiler (issue 13) in one process: sampled steps only, per-layer times that add up, clear bad input."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_galv.callbacks import OnlineProfiler, PlanMonitor
from lightning_galv.demo.module import CausalLM


def _fit(profiler: OnlineProfiler, steps: int = 7, checkpoint: bool = False) -> CausalLM:
    torch.manual_seed(0)
    module = CausalLM(kind="llama", vocab_size=64, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=512,
                      max_seq_len=64, optimizer="sgd", lr=0.01)
    data = torch.randint(0, 64, (steps * 8, 65))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[profiler])
    trainer.fit(module, DataLoader(data, batch_size=8))
    return module


def test_samples_every_nth_step_and_layer_times_add_up_to_the_step() -> None:
    prof = OnlineProfiler(every_n_steps=3, warmup_steps=1, collectives=True, log=False)
    _fit(prof)
    assert [r.step for r in prof.records] == [1, 4]  # steps 1 and 4 of 0..6, nothing else touched
    for r in prof.records:
        assert set(r.layer_forward_s) == {"embed", "layers.0", "layers.1", "layers.2", "head"}
        assert set(r.layer_backward_s) >= {"layers.0", "layers.1", "layers.2", "head"}
        assert r.samples == 8 and r.tokens == 8 * 65 and r.peak_memory_bytes > 0
        # the layers are most of the step; the rest is the loss, the optimizer and Lightning's loop.
        # Stated tolerance: layer times never exceed the step (they are disjoint parts of it) and cover >= 40 %.
        assert 0.4 * r.step_time_s <= r.layer_time_s <= 1.02 * r.step_time_s, (r.layer_time_s, r.step_time_s)
        assert r.collective_s == {}  # one process: no backend collectives


def test_bad_arguments_are_refused_with_a_hint() -> None:
    with pytest.raises(ValueError, match=r"every_n_steps=0.*HINT"):
        OnlineProfiler(every_n_steps=0)
    with pytest.raises(ValueError, match=r"MFU needs both or neither.*HINT"):
        OnlineProfiler(flops_per_sample=1e9)
    with pytest.raises(TypeError, match=r"must be an OnlineProfiler.*HINT"):
        PlanMonitor(object())  # type: ignore[arg-type]
    prof = OnlineProfiler()
    with pytest.raises(ValueError, match=r"PlanMonitor compares a Galvatron plan.*HINT"):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[prof, PlanMonitor(prof)])
        trainer.fit(CausalLM(kind="llama", vocab_size=64, dim=32, n_layers=1, n_heads=4, max_seq_len=16),
                    DataLoader(torch.randint(0, 64, (8, 17)), batch_size=4))
