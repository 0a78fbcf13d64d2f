"""Weight gradients accumulated inside the GEMM (oomb.engine.fused_wgrad) equal autograd's default path."""

from __future__ import annotations

import pytest
import torch

import oomb.engine.fused_wgrad as fw
from oomb.engine.fused_wgrad import FusedWeightGradAccumulation, _LinearAccumulateGrad

from tests.engine.test_engine import clone_model, run_parity, tiny


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 5), (2, 3, 5)])
def test_function_equals_linear_and_adds_into_grad(bias, shape):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(5, 4, bias=bias).double()
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(*shape[:-1], 4, generator=g, dtype=torch.float64)
    # the default path twice (two chunks): .grad = g1 + g2
    for _ in range(2):
        torch.nn.functional.linear(x, lin.weight, lin.bias).backward(dy)
    want_w, want_b, want_x = lin.weight.grad.clone(), None if not bias else lin.bias.grad.clone(), x.grad.clone()
    lin.zero_grad(set_to_none=True)
    x.grad = None
    before = None
    for i in range(2):  # first: .grad created by autograd; second: added in place by the GEMM
        y = _LinearAccumulateGrad.apply(x, lin.weight, lin.bias)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
        y.backward(dy)
        if i == 0:
            before = lin.weight.grad
    assert lin.weight.grad is before  # the same tensor, added into
    torch.testing.assert_close(lin.weight.grad, want_w, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(x.grad, want_x, rtol=1e-14, atol=1e-14)
    if bias:
        torch.testing.assert_close(lin.bias.grad, want_b, rtol=1e-14, atol=1e-14)


def test_context_patches_only_plain_trainable_unhooked_linears_and_restores():
    class Sub(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), Sub(3, 3), torch.nn.Linear(3, 3))
    model[1].weight.requires_grad_(False)
    handle = model[3].weight.register_post_accumulate_grad_hook(lambda p: None)
    with FusedWeightGradAccumulation(model) as ctx:
        assert ctx._patched == [model[0]]
        assert "forward" in model[0].__dict__ and "forward" not in model[2].__dict__
    assert all("forward" not in m.__dict__ for m in model)
    handle.remove()
    with pytest.raises(RuntimeError, match="boom"):
        with FusedWeightGradAccumulation(model):
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in model)


def test_switched_off_by_its_argument():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with FusedWeightGradAccumulation(model, enabled=False) as ctx:
        assert ctx._patched == [] and "forward" not in model[0].__dict__
    with FusedWeightGradAccumulation(model, enabled=True) as ctx:
        assert ctx._patched == [model[0]]
    with pytest.raises(ValueError, match="enabled must be True or False; got '0'"):
        FusedWeightGradAccumulation(model, enabled="0")


def test_engine_uses_it_and_matches_full_sequence(monkeypatch):
    """Every Linear weight after the first Stage-2 chunk goes through the fused add; gradients stay exact (fp64)."""
    calls = {"fused": 0}
    orig = fw._fusable

    def counting(w):
        ok = orig(w)
        calls["fused"] += ok
        return ok

    monkeypatch.setattr(fw, "_fusable", counting)
    out, ref_loss, (err, where), _ = run_parity(tiny("qwen2", 4, 2), 48, 16, 8)
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"
    n_linear = 2 * 7 + 1  # per layer q, k, v, o, gate, up, down; plus lm_head
    # 3 chunks: the last one (first in Stage 2) creates .grad, the two after it add in the GEMM;
    # lm_head's backward runs once per loss block (one per chunk here).
    assert calls["fused"] == 2 * n_linear


def test_engine_same_gradients_with_and_without(monkeypatch):
    """KernelConfig.fused_wgrad=False (the engine passes it as ``enabled``) keeps autograd's default path: no weight
    goes through the fused add, and the gradients match the fused run's."""
    calls = {"fused": 0}
    orig = fw._fusable

    def counting(w):
        ok = orig(w)
        calls["fused"] += ok
        return ok

    monkeypatch.setattr(fw, "_fusable", counting)
    torch.manual_seed(5)
    m1 = tiny("llama", 4, 2)
    m2 = clone_model(m1)
    a = run_parity(m1, 40, 8, 4, dtype=torch.float32, seed=3)
    assert calls["fused"] > 0
    calls["fused"] = 0
    b = run_parity(m2, 40, 8, 4, dtype=torch.float32, seed=3, fused_wgrad=False)
    assert calls["fused"] == 0
    assert a[0].loss == b[0].loss  # the forward is the same
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)
    assert a[2][0] <= 1e-5 and b[2][0] <= 1e-5


def test_autocast_keeps_the_default_path():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with FusedWeightGradAccumulation(lin):
        lin(x).sum().backward()  # creates .grad
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        assert y.dtype == torch.bfloat16 and y.grad_fn.name() != "_LinearAccumulateGradBackward"
        y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32
