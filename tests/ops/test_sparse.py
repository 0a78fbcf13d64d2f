"""Page selection and the sparse PyTorch reference against dense masked attention (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from oomb.ops.attention_ref import paged_attention_bwd_ref, paged_attention_fwd_ref
from oomb.ops.sparse_attention_ref import sparse_attention_bwd_ref, sparse_attention_fwd_ref
from oomb.ops.sparse_representatives import PageRepresentatives, page_representatives
from oomb.ops.sparse_select import select_pages, selection_mask


def make_case(C, Hq, Hkv, D, past_len, S, gen, extra_pages=3, dtype=torch.float64):
    n = -(-past_len // S)
    P = n + extra_pages
    k_cache = torch.randn(P, S, Hkv, D, generator=gen, dtype=dtype)
    v_cache = torch.randn(P, S, Hkv, D, generator=gen, dtype=dtype)
    block_table = torch.randperm(P, generator=gen)[:n].to(torch.int32)  # shuffled pool pages
    q = torch.randn(C, Hq, D, generator=gen, dtype=dtype)
    k = torch.randn(C, Hkv, D, generator=gen, dtype=dtype)
    v = torch.randn(C, Hkv, D, generator=gen, dtype=dtype)
    return q, k, v, k_cache, v_cache, block_table


def past_tokens(cache, block_table, past_len):
    Hkv, D = cache.shape[2], cache.shape[3]
    return cache[block_table.long()].reshape(-1, Hkv, D)[:past_len]


def reps_of(k_cache, block_table, past_len, S, score):
    return page_representatives(past_tokens(k_cache, block_table, past_len), S, score)


def masked_dense(q, k_all, v_all, past_len, scale, past_visible, doc=None):
    """Dense attention with autograd; past_visible: bool [Hkv, C, past_len] (True = may attend)."""
    C, Hq, D = q.shape
    Hkv = k_all.shape[1]
    G = Hq // Hkv
    s = torch.einsum("qhd,khd->hqk", q, k_all.repeat_interleave(G, 1)) * scale  # [Hq, C, T]
    T = k_all.shape[0]
    qpos = torch.arange(C)[:, None] + past_len
    kpos = torch.arange(T)[None, :]
    masked = (kpos > qpos)[None].expand(Hq, C, T).clone()
    masked[:, :, :past_len] |= ~past_visible.repeat_interleave(G, 0)
    if doc is not None:
        masked |= (kpos < doc[:, None].long())[None]
    s = s.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v_all.repeat_interleave(G, 1))
    return out, lse


def check_against_masked(q, k, v, k_cache, v_cache, bt, past_len, sel, doc=None, tol=1e-11):
    C, Hq, D = q.shape
    scale = 1.0 / math.sqrt(D)
    S = k_cache.shape[1]
    q_ = q.clone().requires_grad_()
    k_all = torch.cat([past_tokens(k_cache, bt, past_len), k]).requires_grad_()
    v_all = torch.cat([past_tokens(v_cache, bt, past_len), v]).requires_grad_()
    visible = selection_mask(sel, C, past_len, S)
    out_ref, lse_ref = masked_dense(q_, k_all, v_all, past_len, scale, visible, doc)
    dout = torch.randn_like(out_ref)
    out_ref.backward(dout)

    out, lse = sparse_attention_fwd_ref(q, k, v, k_cache, v_cache, bt, past_len, sel, scale, doc)
    torch.testing.assert_close(out, out_ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, lse_ref.detach(), rtol=tol, atol=tol)
    dk_cache, dv_cache = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    dq, dk, dv = sparse_attention_bwd_ref(dout, q, k, v, out, lse, k_cache, v_cache, bt, past_len, dk_cache, dv_cache, sel, scale, doc)
    torch.testing.assert_close(dq, q_.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(dk, k_all.grad[past_len:], rtol=tol, atol=tol)
    torch.testing.assert_close(dv, v_all.grad[past_len:], rtol=tol, atol=tol)
    if past_len:
        torch.testing.assert_close(past_tokens(dk_cache, bt, past_len), k_all.grad[:past_len], rtol=tol, atol=tol)
        torch.testing.assert_close(past_tokens(dv_cache, bt, past_len), v_all.grad[:past_len], rtol=tol, atol=tol)
    # Pages outside the block table, and pages never selected, are untouched.
    unused = torch.ones(k_cache.shape[0], dtype=torch.bool)
    unused[bt.long()] = False
    assert (dk_cache[unused] == 0).all() and (dv_cache[unused] == 0).all()
    return out, lse, dq, dk, dv, dk_cache, dv_cache


SPARSE_CASES = [
    # C, Hq, Hkv, D, past_len, S, block, budget, sink, local, score
    (12, 4, 2, 8, 40, 4, 4, 2, 1, 1, "mean"),
    (13, 7, 1, 16, 37, 4, 5, 3, 1, 2, "quest"),  # GQA 7:1, partial last page, partial last block
    (9, 2, 2, 64, 48, 8, 3, 1, 0, 0, "mean"),  # head dim 64, no sink/local
    (8, 4, 1, 8, 30, 5, 8, 0, 0, 0, "mean"),  # nothing from the past at all
    (10, 6, 3, 8, 64, 4, 2, 4, 2, 3, "quest"),
]


@pytest.mark.parametrize("C,Hq,Hkv,D,past_len,S,block,budget,sink,local,score", SPARSE_CASES)
def test_sparse_reference_matches_masked_dense(C, Hq, Hkv, D, past_len, S, block, budget, sink, local, score):
    gen = torch.Generator().manual_seed(C * 100 + past_len)
    q, k, v, k_cache, v_cache, bt = make_case(C, Hq, Hkv, D, past_len, S, gen)
    reps = reps_of(k_cache, bt, past_len, S, score)
    sel = select_pages(q, reps, past_len, S, budget, sink, local, block, score)
    assert not sel.dense
    check_against_masked(q, k, v, k_cache, v_cache, bt, past_len, sel)


def test_sparse_reference_packed_documents():
    gen = torch.Generator().manual_seed(5)
    C, Hq, Hkv, D, past_len, S = 12, 4, 2, 8, 32, 4
    q, k, v, k_cache, v_cache, bt = make_case(C, Hq, Hkv, D, past_len, S, gen)
    doc = torch.tensor([10] * 3 + [35] * 5 + [40] * 4, dtype=torch.int32)  # docs start in the past and in the chunk
    reps = reps_of(k_cache, bt, past_len, S, "mean")
    sel = select_pages(q, reps, past_len, S, 2, 1, 1, 4, "mean", q_doc_start=doc)
    # Pages wholly before the block's earliest document are never chosen; the sink is its first page.
    assert ((sel.page_idx[0] == -1) | (sel.page_idx[0] >= 2)).all()
    assert (sel.page_idx[0, :, 0] == 2).all()  # document 1 starts at token 10, page 2
    assert (sel.counts[1:] == 0).all()
    check_against_masked(q, k, v, k_cache, v_cache, bt, past_len, sel, doc)


@pytest.mark.parametrize(
    "C,Hq,Hkv,D,past_len,S,block",
    [(12, 4, 2, 8, 40, 4, 4), (9, 7, 1, 64, 37, 8, 4), (16, 4, 4, 64, 64, 16, 16)],
)
def test_budget_covering_the_past_is_dense(C, Hq, Hkv, D, past_len, S, block):
    gen = torch.Generator().manual_seed(past_len)
    q, k, v, k_cache, v_cache, bt = make_case(C, Hq, Hkv, D, past_len, S, gen)
    n = -(-past_len // S)
    reps = reps_of(k_cache, bt, past_len, S, "mean")
    sel = select_pages(q, reps, past_len, S, n - 2, 1, 1, block)  # budget + sink + local == n
    assert sel.dense and (sel.counts == n).all()
    assert (sel.page_idx == torch.arange(n, dtype=torch.int32)).all()
    scale = 1.0 / math.sqrt(D)
    out, lse, dq, dk, dv, dkc, dvc = check_against_masked(q, k, v, k_cache, v_cache, bt, past_len, sel)
    out_d, lse_d = paged_attention_fwd_ref(q, k, v, k_cache, v_cache, bt, past_len, scale)
    torch.testing.assert_close(out, out_d, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_d, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    dkc_d, dvc_d = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    dkc_s, dvc_s = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ref = paged_attention_bwd_ref(dout, q, k, v, out_d, lse_d, k_cache, v_cache, bt, past_len, dkc_d, dvc_d, scale)
    got = sparse_attention_bwd_ref(dout, q, k, v, out, lse, k_cache, v_cache, bt, past_len, dkc_s, dvc_s, sel, scale)
    for a, b in zip(got + (dkc_s, dvc_s), ref + (dkc_d, dvc_d)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------- selection
def _select(C=16, Hq=4, Hkv=2, D=8, past_len=64, S=4, budget=3, sink=1, local=2, block=4, score="mean", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, _, _, k_cache, _, bt = make_case(C, Hq, Hkv, D, past_len, S, gen)
    return select_pages(q, reps_of(k_cache, bt, past_len, S, score), past_len, S, budget, sink, local, block, score)


@pytest.mark.parametrize("score", ["mean", "quest"])
@pytest.mark.parametrize("budget,sink,local", [(3, 1, 2), (5, 0, 0), (0, 2, 3), (2, 3, 0), (4, 0, 1)])
def test_selection_invariants(score, budget, sink, local):
    past_len = 66  # 17 pages of 4 tokens, the last one partial
    n = 17
    sel = _select(past_len=past_len, budget=budget, sink=sink, local=local, score=score, C=14, block=4)
    nb, Hkv, K = sel.page_idx.shape
    assert (nb, Hkv, K) == (4, 2, min(n, budget + sink + local))
    assert sel.page_idx.dtype == torch.int32 and sel.counts.dtype == torch.int32
    assert (sel.counts == budget + sink + local).all()
    for b in range(nb):
        for h in range(Hkv):
            row = sel.page_idx[b, h]
            valid = row[row >= 0].tolist()
            assert len(valid) == sel.counts[b, h]
            assert valid == sorted(set(valid)), "ascending, no duplicates"
            assert all(0 <= p < n for p in valid), "nothing from the future"
            assert set(range(min(sink, n))) <= set(valid), "sink pages always present"
            assert set(range(n - local, n)) <= set(valid), "local pages always present"
            assert (row[len(valid):] == -1).all(), "padding at the end"


def test_selection_picks_highest_scores_and_breaks_ties_to_lower_index():
    S, Hkv, D, n = 2, 1, 4, 10
    mean = torch.zeros(n, Hkv, D, dtype=torch.float64)
    mean[:, 0, 0] = torch.tensor([0, 5, 1, 5, 2, 5, 0, 9, 0, 0], dtype=torch.float64)
    q = torch.zeros(3, 2, D, dtype=torch.float64)
    q[:, :, 0] = 1.0
    sel = select_pages(q, (mean,), n * S, S, 3, 0, 0, 8)
    assert sel.page_idx[0, 0].tolist() == [1, 3, 7]  # 9 first, then the three 5s: pages 1 and 3 win over 5
    # All scores equal: the lowest page indices win, and the result is the same every call.
    flat = (torch.ones(n, Hkv, D, dtype=torch.float64),)
    a = select_pages(q, flat, n * S, S, 3, 1, 1, 8)
    b = select_pages(q, flat, n * S, S, 3, 1, 1, 8)
    assert a.page_idx[0, 0].tolist() == [0, 1, 2, 3, 9] == b.page_idx[0, 0].tolist()


def test_quest_bound_and_per_head_selection():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(40, 2, 8, generator=gen, dtype=torch.float64)
    kmin, kmax = page_representatives(keys, 8, "quest")
    q = torch.randn(5, 4, 8, generator=gen, dtype=torch.float64)
    q_sum = q.view(5, 2, 2, 8).sum((0, 2))  # [Hkv, D]
    bound = (torch.maximum(q_sum[None] * kmin, q_sum[None] * kmax)).sum(-1)  # [pages, Hkv]
    actual = torch.einsum("hd,pshd->psh", q_sum, keys.view(5, 8, 2, 8)).amax(1)  # best key of each page
    assert (bound >= actual - 1e-12).all()
    sel = select_pages(q, (kmin, kmax), 40, 8, 1, 0, 0, 8, "quest")
    assert sel.page_idx[0, :, 0].tolist() == bound.argmax(0).tolist()  # each KV head chooses its own page


def test_partial_page_representatives_use_valid_tokens_only():
    keys = torch.arange(2 * 5 * 1 * 2, dtype=torch.float64).view(10, 1, 2)
    (mean,) = page_representatives(keys, 4, "mean")  # pages of 4, 4, 2 tokens
    torch.testing.assert_close(mean[2], keys[8:].mean(0))
    kmin, kmax = page_representatives(keys, 4, "quest")
    torch.testing.assert_close(kmin[2], keys[8:].amin(0))
    torch.testing.assert_close(kmax[2], keys[8:].amax(0))
    reps = PageRepresentatives(2, 1, 2, 3, 4, "mean", torch.float64, "cpu")
    reps.write(1, 0, keys)
    torch.testing.assert_close(reps.layer(1, 3)[0], mean)
    assert (reps.layer(0, 3)[0] == 0).all()
    with pytest.raises(ValueError, match="page-aligned"):
        reps.write(0, 2, keys)


def test_no_past_and_everything_fits():
    sel = _select(past_len=0)
    assert sel.dense and sel.page_idx.shape == (4, 2, 0)
    sel = _select(past_len=20, budget=2, sink=1, local=2)  # 5 pages == 2 + 1 + 2
    assert sel.dense and (sel.counts == 5).all()
    sel = _select(past_len=21, budget=2, sink=1, local=2)  # 6 pages
    assert not sel.dense and (sel.counts == 5).all()


def test_bad_selection_arguments():
    with pytest.raises(ValueError, match="page_budget must be >= 0"):
        _select(budget=-1)
    with pytest.raises(ValueError, match="score must be one of"):
        _select(score="max")
