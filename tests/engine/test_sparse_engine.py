"""Sparse attention in the engine: dense while the past fits, a masked dense model otherwise (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oomb import Engine, OOMBConfig
from oomb.config import SparseConfig
from configs import engine_config
from oomb.models.hf import use_oomb_attention
from oomb.engine import sparse_state
from oomb.engine.sparse_state import SparseAttentionState
from oomb.ops.sparse_select import selection_mask
from tests.engine.test_engine import VOCAB, clone_model, tiny


def _step(model, ids, cu=None, **cfg):
    cfg.setdefault("attention_backend", "torch")
    engine = Engine(model, engine_config(**cfg))
    out = engine.step(ids, cu_seqlens=cu)
    return out, engine


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family,heads,kv_heads,head_dim,T,chunk,page", [
    ("qwen2", 4, 2, 8, 45, 12, 4),
    ("llama", 7, 1, 8, 40, 8, 4),  # GQA 7:1
    ("qwen3", 2, 2, 64, 33, 8, 8),  # head dim 64
])
def test_budget_covering_the_past_equals_dense_bitwise(family, heads, kv_heads, head_dim, T, chunk, page):
    torch.manual_seed(0)
    model = tiny(family, heads, kv_heads, head_dim).double()
    twin = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, T))
    n_pages = -(-T // page)
    dense, _ = _step(model, ids, chunk_size=chunk, page_size=page)
    sparse, _ = _step(twin, ids, chunk_size=chunk, page_size=page, sparse=True, page_budget=n_pages,
                      sink_pages=1, local_pages=1, sparse_block_size=4)
    assert sparse.loss == dense.loss
    for (name, a), b in zip(_grads(model).items(), _grads(twin).values()):
        assert torch.equal(a, b), name


def test_sparse_path_selecting_everything_matches_dense(monkeypatch):
    """The gather-based sparse path (dense shortcut off) with every page selected equals the dense step."""
    original = sparse_state.select_pages

    def never_dense(*a, **k):
        sel = original(*a, **k)
        sel.dense = False
        return sel

    monkeypatch.setattr(sparse_state, "select_pages", never_dense)
    torch.manual_seed(1)
    model = tiny("qwen2", 7, 1).double()
    twin = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, 41))
    dense, _ = _step(model, ids, chunk_size=8, page_size=4)
    sparse, _ = _step(twin, ids, chunk_size=8, page_size=4, sparse=True, page_budget=11, sink_pages=0, local_pages=0,
                      sparse_block_size=3)
    assert abs(sparse.loss - dense.loss) <= 1e-12 * dense.loss
    for (name, a), b in zip(_grads(model).items(), _grads(twin).values()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13, msg=name)


class _MaskedDenseCtx:
    """oomb_ctx for a full-sequence forward: dense attention restricted to the engine's stored selections."""

    def __init__(self, selections, T, chunk, page, doc_start=None):
        self.selections, self.T, self.C, self.S, self.doc = selections, T, chunk, page, doc_start

    def visible(self, layer, Hkv):
        T, C, S = self.T, self.C, self.S
        vis = torch.zeros(Hkv, T, T, dtype=torch.bool)
        for s in range(0, T, C):
            n = min(C, T - s)
            vis[:, s : s + n, s : s + n] = torch.ones(n, n, dtype=torch.bool).tril()
            if s:
                vis[:, s : s + n, :s] = selection_mask(self.selections[(s, layer)], n, s, S)
        if self.doc is not None:
            vis &= torch.arange(T)[None, None, :] >= self.doc[None, :, None]
        return vis

    def attend(self, layer, query, key, value, scaling):
        q, k, v = query[0], key[0], value[0]  # [H, T, D]
        G = q.shape[0] // k.shape[0]
        s = torch.matmul(q, k.repeat_interleave(G, 0).transpose(1, 2)) * scaling
        s = s.masked_fill(~self.visible(layer, k.shape[0]).repeat_interleave(G, 0), float("-inf"))
        out = torch.matmul(torch.softmax(s, -1), v.repeat_interleave(G, 0))
        return out.transpose(0, 1).unsqueeze(0)


def masked_reference(model, ids, selections, chunk, page, cu=None):
    use_oomb_attention(model)
    T = ids.shape[1]
    doc = None
    pos = torch.arange(T)
    targets = torch.cat([ids[0, 1:], torch.tensor([-100])])
    if cu is not None:
        doc = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
        pos = pos - doc
        targets[:-1][doc[1:] != doc[:-1]] = -100
    ctx = _MaskedDenseCtx(selections, T, chunk, page, doc)
    hidden = model.model(input_ids=ids, position_ids=pos[None], oomb_ctx=ctx).last_hidden_state[0]
    loss = F.cross_entropy(model.lm_head(hidden), targets, ignore_index=-100)
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("score,sink,local,ckpt,packed", [
    ("mean", 1, 1, False, False),
    ("quest", 0, 2, True, False),  # per-layer checkpointing recomputes the forward: same selection
    ("mean", 1, 0, False, True),  # packed documents
])
def test_small_budget_equals_masked_dense_model(monkeypatch, score, sink, local, ckpt, packed):
    monkeypatch.setattr(SparseAttentionState, "release", lambda self, start: None)  # keep every selection
    torch.manual_seed(2)
    T, chunk, page = 52, 12, 4
    model = tiny("qwen2", 4, 2, layers=2).double()
    ref = clone_model(model)
    dense_model = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, T))
    cu = torch.tensor([0, 7, 30, 52]) if packed else None
    cfg = dict(chunk_size=chunk, page_size=page, checkpoint_layers=ckpt)
    out, engine = _step(model, ids, cu, sparse=True, page_budget=1, sink_pages=sink, local_pages=local,
                        sparse_block_size=4, sparse_score=score, **cfg)
    dense, _ = _step(dense_model, ids, cu, **cfg)
    selections = engine.sparse_state.selections
    assert len(selections) == (T // chunk) * 2 + 2  # every (chunk, layer)
    assert any(not sel.dense for sel in selections.values())
    assert out.loss != dense.loss
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())

    ref_loss = masked_reference(ref, ids, selections, chunk, page, cu)
    assert abs(out.loss - ref_loss) <= 1e-12 * ref_loss, (out.loss, ref_loss)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        err = (p.grad - r.grad).norm() / r.grad.norm()
        assert err <= 1e-10, f"{name}: rel err {err:.3e}"


def test_packed_documents_that_fit_the_kept_pages_train_as_dense(monkeypatch):
    """Packed documents short enough that every page of a block's documents is kept (sink + local + budget) train
    exactly as dense attention, although the whole past is many times the kept pages: pages before a block's
    earliest document are masked anyway, and selection never spends the budget on them. (Short-row training stages
    are therefore the same in every attention mode.)"""
    monkeypatch.setattr(SparseAttentionState, "release", lambda self, start: None)  # keep every selection
    torch.manual_seed(3)
    T, chunk, page = 96, 16, 4
    lengths = [9, 12, 5, 12, 11, 7, 12, 10, 12, 6]  # <= 12 tokens: a 4-query block reaches <= 5 pages back
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    assert int(cu[-1]) == T
    model = tiny("qwen2", 4, 2, layers=2).double()
    dense_model = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, T))
    out, engine = _step(model, ids, cu, chunk_size=chunk, page_size=page, sparse=True, page_budget=2, sink_pages=1,
                        local_pages=2, sparse_block_size=4)
    dense, _ = _step(dense_model, ids, cu, chunk_size=chunk, page_size=page)
    assert any(not sel.dense for sel in engine.sparse_state.selections.values())  # the gather path ran
    assert abs(out.loss - dense.loss) <= 1e-12 * dense.loss, (out.loss, dense.loss)
    for (name, p), d in zip(model.named_parameters(), dense_model.parameters()):
        err = (p.grad - d.grad).norm() / d.grad.norm()
        assert err <= 1e-10, f"{name}: rel err {err:.3e}"


def test_selections_released_and_offload_store_gives_same_step():
    torch.manual_seed(4)
    model = tiny("llama", 4, 2).double()
    twin = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, 40))
    cfg = dict(chunk_size=8, page_size=4, sparse=True, page_budget=2, sink_pages=1, local_pages=1, sparse_block_size=4)
    out, engine = _step(model, ids, offload=False, **cfg)
    assert engine.sparse_state.selections == {}  # dropped chunk by chunk in Stage 2
    out_off, _ = _step(twin, ids, offload=True, **cfg)
    assert out.loss == out_off.loss
    for (name, a), b in zip(_grads(model).items(), _grads(twin).values()):
        assert torch.equal(a, b), name


def test_evaluate_sparse_matches_step_loss():
    torch.manual_seed(5)
    model = tiny("qwen2").double()
    ids = torch.randint(0, VOCAB, (1, 37))
    engine = Engine(model, OOMBConfig(chunk_size=8, page_size=4, attention_backend="torch", sparse=SparseConfig(page_budget=1, local_pages=0, block_size=4)))
    loss = engine.evaluate(ids)
    assert engine.sparse_state.selections == {}
    assert abs(engine.step(ids).loss - loss) <= 1e-12 * loss


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_grad_error_report(backend):
    """With 'sdpa' the dense reference runs on the sparse runs' kernels, so a covering budget is exactly 0 too."""
    from oomb.sparse_quality import sparse_grad_error

    torch.manual_seed(6)
    model = tiny("qwen2", layers=2).double()
    ids = torch.randint(0, VOCAB, (1, 48))
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # restored afterwards
    cfg = OOMBConfig(chunk_size=8, page_size=4, attention_backend=backend, sparse=SparseConfig(sink_pages=1, local_pages=1, block_size=4))
    report = sparse_grad_error(model, ids, cfg, budgets=[0, 2, 12])
    assert all((p.grad == 1).all() for p in model.parameters())
    assert report.rel_error(12) == 0.0 and report.sparse_loss[12] == report.dense_loss  # 12 pages cover the past
    assert report.rel_error(0) > report.rel_error(12) and report.rel_error(2) > 0
    table = report.table()
    assert "model.layers.*.self_attn.q_proj.weight" in table and "**all**" in table
    assert len(report.table(by="parameter").splitlines()) == 2 + len(report.names) + 2
    assert set(report.to_dict()["rel_error_all"]) == {"0", "2", "12"}
    with pytest.raises(ValueError, match="budgets"):
        sparse_grad_error(model, ids, cfg, budgets=[])


@pytest.mark.parametrize("score,page_budget", [("mean", 2), ("quest", 2), ("mean", 100)])
def test_planner_sparse_state_bytes_bounds_the_real_state(monkeypatch, score, page_budget):
    """The planner's sparse-state bytes equal the representatives' bytes plus a bound on every selection made; a
    page budget above the past pages counts only those (counting the budget itself would plan --page-budget 1000000
    as 427 GiB of selections and refuse runs that fit)."""
    from oomb.planner import ModelShape, sparse_state_bytes

    made = []
    real_select = sparse_state.select_pages

    def spy(*args, **kwargs):
        sel = real_select(*args, **kwargs)
        made.append(sel.page_idx.nbytes + sel.counts.nbytes)
        return sel

    monkeypatch.setattr("oomb.engine.sparse_state.select_pages", spy)
    model = tiny("qwen2", 4, 2, 16)
    cfg = OOMBConfig(chunk_size=32, page_size=8, sparse=SparseConfig(page_budget=page_budget, sink_pages=1, local_pages=1, block_size=16, score=score))
    engine = Engine(model, cfg)
    T = 160
    engine.step(torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(0)))
    shape = ModelShape.from_config(model.config)
    bound = sparse_state_bytes(shape, T, cfg, torch.float32)
    reps = engine.sparse_state.reps.nbytes
    assert made, "no selection was made"
    assert reps + sum(made) <= bound
    L, nb, Hkv = shape.num_layers, -(-T // 16), shape.num_kv_heads
    K = min(page_budget + 1 + 1, T // 8 - 1)  # at most the past pages (19 of the 20 pages)
    assert bound - reps == L * nb * Hkv * (K + 1) * 4  # selections: K ids + a count per row
    assert sparse_state_bytes(shape, T, engine_config(chunk_size=32, page_size=8), torch.float32) == 0


def test_engine_passes_its_kernel_settings_to_every_attention_call(monkeypatch):
    """The engine hands ``config.kernels`` (the same object) to the paged and the sparse attention, in Stage 1,
    the Stage-2 forward and the backward, so the kernels' settings come from the config and nowhere else."""
    import oomb.ops.paged_attention as pa
    import oomb.ops.sparse_attention as sa
    from oomb.config import KernelConfig

    seen = []

    def spy(mod, name, index):
        real = getattr(mod, name)

        def wrapped(*a, **k):
            seen.append((name, k["kernels"] if "kernels" in k else a[index]))
            return real(*a, **k)

        monkeypatch.setattr(mod, name, wrapped)

    spy(pa, "_fwd", 8)
    spy(pa, "_bwd", 12)
    spy(sa, "_sparse_fwd", 7)
    spy(sa, "_sparse_bwd", 10)
    kernels = KernelConfig(autotune="first", fwd_tma=False)
    torch.manual_seed(0)
    model = tiny("qwen2", 4, 2)
    cfg = engine_config(chunk_size=8, page_size=4, sparse=True, page_budget=1, sink_pages=1, local_pages=0,
                        sparse_block_size=4, kernels=kernels)
    Engine(model, cfg).step(torch.randint(0, VOCAB, (1, 40)))
    assert {name for name, _ in seen} == {"_fwd", "_bwd", "_sparse_fwd", "_sparse_bwd"}
    assert all(k is kernels for _, k in seen), {name for name, k in seen if k is not kernels}


def test_budget_lists_take_zero_as_the_sink_and_local_pages_only():
    """eval and grad-error take the page budgets SparseConfig takes: 0 (only the sink and local pages) is one."""
    from oomb.sparse_quality import check_budgets

    assert check_budgets((0, 4)) == [0, 4]
    for bad in ([-1], [1.5], [True]):
        with pytest.raises(ValueError, match="page counts >= 0"):
            check_budgets(bad)
