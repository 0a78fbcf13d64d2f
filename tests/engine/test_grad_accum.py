"""Float32 accumulation of the per-chunk parameter gradients (OOMBConfig.grad_accum_dtype='float32').

bf16 on CPU: with many chunks, summing each chunk's gradient into a bf16 ``.grad`` rounds once per
chunk; the float32 sum rounds once per step, like full-sequence training. Both are compared with a
float64 full-sequence reference and with full-sequence training in bf16 (the error the chunked step
should not exceed).
"""

from __future__ import annotations

import pytest
import torch

from oomb import Engine
from configs import engine_config
from oomb.engine import engine as engine_mod
from oomb.engine.grad_accum import Float32GradAccumulator, extra_grad_bytes
from oomb.planner import plan
from tests.engine.test_engine import VOCAB, clone_model, reference_step, tiny


def _errors(model, ref):
    return {n: ((p.grad.double() - r.grad).norm() / r.grad.norm()).item()
            for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters())}


@pytest.fixture(scope="module")
def bf16_case():
    torch.manual_seed(0)
    base = tiny("qwen2", 4, 2, head_dim=16)
    ids = torch.randint(0, VOCAB, (1, 512))
    ref = clone_model(base).double()
    reference_step(ref, ids, ids.clone())
    hf = clone_model(base).bfloat16()
    reference_step(hf, ids, ids.clone())
    return base, ids, ref, _errors(hf, ref)


def _chunked(base, ids, mode, chunk=4):
    m = clone_model(base).bfloat16()
    Engine(m, engine_config(chunk_size=chunk, page_size=chunk, attention_backend="torch", grad_accum_dtype=mode)).step(ids)
    return m


def test_float32_sums_match_full_sequence_bf16_error(bf16_case):
    """128 chunks in bf16: the float32 sums keep every gradient within 1.25x of full-sequence bf16 training's own
    error (against float64), where summing in bf16 does worse."""
    base, ids, ref, e_hf = bf16_case
    ratio = {}
    for mode in ("param", "float32"):
        e = _errors(_chunked(base, ids, mode), ref)
        ratio[mode] = max(e[n] / e_hf[n] for n in e)
    assert ratio["float32"] <= 1.25, ratio
    assert ratio["float32"] < ratio["param"], ratio


def test_grads_are_param_dtype_hooks_removed_and_sequences_accumulate(bf16_case):
    """After the step .grad has the parameter dtype and no hook is left; a second step() adds to the first's
    gradients (a gradient-accumulation step over two sequences)."""
    base, ids, _, _ = bf16_case
    m = clone_model(base).bfloat16()
    eng = Engine(m, engine_config(chunk_size=64, page_size=64, attention_backend="torch", grad_accum_dtype="float32"))
    eng.step(ids)
    once = {n: p.grad.clone() for n, p in m.named_parameters()}
    for p in m.parameters():
        assert p.grad.dtype == torch.bfloat16 and not p._post_accumulate_grad_hooks
    eng.step(ids)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad.float(), 2 * once[n].float(), rtol=1e-2, atol=1e-6)


def test_float32_parameters_are_untouched():
    """float32 (and frozen) parameters: no hook, the same bits as grad_accum_dtype='param'."""
    torch.manual_seed(1)
    base = tiny("llama", 4, 2, head_dim=8)
    ids = torch.randint(0, VOCAB, (1, 40))
    grads = []
    for mode in ("param", "float32"):
        m = clone_model(base)
        Engine(m, engine_config(chunk_size=8, page_size=4, attention_backend="torch", grad_accum_dtype=mode)).step(ids)
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert Float32GradAccumulator(base.parameters()).params == []
    assert extra_grad_bytes(base.parameters()) == 0


def test_error_in_stage2_removes_hooks_and_keeps_partial_grads(monkeypatch, bf16_case):
    base, ids, _, _ = bf16_case
    m = clone_model(base).bfloat16()
    real = engine_mod.chunked_cross_entropy_sum
    calls = []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*a, **k)

    monkeypatch.setattr(engine_mod, "chunked_cross_entropy_sum", failing)
    eng = Engine(m, engine_config(chunk_size=128, page_size=128, attention_backend="torch", grad_accum_dtype="float32"))
    with pytest.raises(RuntimeError, match="boom"):
        eng.step(ids)
    for p in m.parameters():
        assert not p._post_accumulate_grad_hooks
        assert p.grad is not None and p.grad.dtype == torch.bfloat16  # the last chunk's gradients, rounded


def test_config_and_planner():
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        engine_config(grad_accum_dtype="bf16")
    from oomb.planner import Machine

    machine = Machine(80 * 2**30, 80 * 2**30, 200 * 2**30, 200 * 2**30, "test")
    a = plan("qwen2.5-7b", 32768, machine=machine)
    b = plan("qwen2.5-7b", 32768, machine=machine, grad_accum_dtype="float32")
    assert b.grads == 2 * a.grads and b.gpu_peak - a.gpu_peak == a.grads
    assert "gradients (float32 sums)" in b.table() and "float32 sums" not in a.table()
    lora_a = plan("qwen2.5-7b", 32768, machine=machine, lora_rank=8)
    lora_b = plan("qwen2.5-7b", 32768, machine=machine, lora_rank=8, grad_accum_dtype="float32")
    assert lora_a.grads == lora_b.grads  # peft's adapters are float32 already


def test_extra_grad_bytes_counts_the_float32_sums():
    """4 bytes per element of a bf16/fp16 trainable parameter, less the gradient it already holds; nothing for
    float32 or frozen ones (what the engine's offload budget reserves)."""
    a = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.zeros(6, dtype=torch.float16))
    b.grad = torch.zeros_like(b)
    c = torch.nn.Parameter(torch.zeros(5))
    d = torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16), requires_grad=False)
    assert extra_grad_bytes([a, b, c, d, a]) == 4 * 10 + (4 * 6 - 2 * 6)
