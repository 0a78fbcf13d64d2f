"""The PyTorch paged reference against dense causal attention with autograd (float64)."""

import math

import pytest
import torch

from oomb.ops.attention_ref import paged_attention_bwd_ref, paged_attention_fwd_ref


def dense_attention(q_all, k_all, v_all, past_len, scale):
    """q_all: [C, Hq, D] queries at positions past_len..; k_all/v_all: [past_len + C, Hkv, D]."""
    C, Hq, D = q_all.shape
    Hkv = k_all.shape[1]
    G = Hq // Hkv
    k = k_all.repeat_interleave(G, dim=1)
    v = v_all.repeat_interleave(G, dim=1)
    s = torch.einsum("qhd,khd->hqk", q_all, k) * scale
    qpos = torch.arange(C)[:, None] + past_len
    kpos = torch.arange(k_all.shape[0])[None, :]
    s = s.masked_fill(kpos > qpos, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    return out, lse


def make_case(C, Hq, Hkv, D, past_len, S, gen, shuffle=True, extra_pages=3, dtype=torch.float64):
    n_past_pages = -(-past_len // S)
    P = n_past_pages + extra_pages
    k_cache = torch.randn(P, S, Hkv, D, generator=gen, dtype=dtype)
    v_cache = torch.randn(P, S, Hkv, D, generator=gen, dtype=dtype)
    perm = torch.randperm(P, generator=gen) if shuffle else torch.arange(P)
    block_table = perm[:n_past_pages].to(torch.int32)
    q = torch.randn(C, Hq, D, generator=gen, dtype=dtype)
    k = torch.randn(C, Hkv, D, generator=gen, dtype=dtype)
    v = torch.randn(C, Hkv, D, generator=gen, dtype=dtype)
    return q, k, v, k_cache, v_cache, block_table


@pytest.mark.parametrize(
    "C,Hq,Hkv,D,past_len,S,block",
    [
        (5, 2, 2, 8, 0, 4, 8),  # no past
        (7, 4, 1, 16, 13, 4, 8),  # partial last page, GQA 4, block not page aligned in tokens? (8 = 2 pages)
        (16, 7, 1, 8, 37, 8, 16),  # GQA 7, odd past
        (3, 4, 2, 8, 64, 16, 64),  # one block covering the past
        (9, 6, 3, 4, 50, 5, 7),  # block size not a multiple of page size
    ],
)
def test_reference_matches_dense(C, Hq, Hkv, D, past_len, S, block):
    gen = torch.Generator().manual_seed(C * 1000 + past_len)
    q, k, v, k_cache, v_cache, bt = make_case(C, Hq, Hkv, D, past_len, S, gen)
    scale = 1.0 / math.sqrt(D)
    past_k = k_cache[bt.long()].reshape(-1, Hkv, D)[:past_len]
    past_v = v_cache[bt.long()].reshape(-1, Hkv, D)[:past_len]

    q_ = q.clone().requires_grad_()
    k_all = torch.cat([past_k, k]).requires_grad_()
    v_all = torch.cat([past_v, v]).requires_grad_()
    out_ref, lse_ref = dense_attention(q_, k_all, v_all, past_len, scale)
    dout = torch.randn_like(out_ref)
    out_ref.backward(dout)

    out, lse = paged_attention_fwd_ref(q, k, v, k_cache, v_cache, bt, past_len, scale, block_size=block)
    torch.testing.assert_close(out, out_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref.detach(), rtol=1e-12, atol=1e-12)

    dk_cache = torch.zeros_like(k_cache)
    dv_cache = torch.zeros_like(v_cache)
    dq, dk, dv = paged_attention_bwd_ref(
        dout, q, k, v, out, lse, k_cache, v_cache, bt, past_len, dk_cache, dv_cache, scale, block_size=block
    )
    torch.testing.assert_close(dq, q_.grad, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(dk, k_all.grad[past_len:], rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(dv, v_all.grad[past_len:], rtol=1e-11, atol=1e-11)
    if past_len:
        got_dk = dk_cache[bt.long()].reshape(-1, Hkv, D)
        got_dv = dv_cache[bt.long()].reshape(-1, Hkv, D)
        torch.testing.assert_close(got_dk[:past_len], k_all.grad[:past_len], rtol=1e-11, atol=1e-11)
        torch.testing.assert_close(got_dv[:past_len], v_all.grad[:past_len], rtol=1e-11, atol=1e-11)
        # The tail of a partial last page and pages outside the table stay untouched.
        assert torch.all(got_dk[past_len:] == 0)
        untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
        untouched[bt.long()] = False
        assert torch.all(dk_cache[untouched] == 0) and torch.all(dv_cache[untouched] == 0)


def test_backward_accumulates_in_place():
    gen = torch.Generator().manual_seed(0)
    q, k, v, k_cache, v_cache, bt = make_case(4, 2, 1, 8, 12, 4, gen)
    out, lse = paged_attention_fwd_ref(q, k, v, k_cache, v_cache, bt, 12)
    dout = torch.randn_like(out)
    dk1, dv1 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    paged_attention_bwd_ref(dout, q, k, v, out, lse, k_cache, v_cache, bt, 12, dk1, dv1)
    dk2, dv2 = dk1.clone(), dv1.clone()
    paged_attention_bwd_ref(dout, q, k, v, out, lse, k_cache, v_cache, bt, 12, dk2, dv2)
    torch.testing.assert_close(dk2, 2 * dk1)
    torch.testing.assert_close(dv2, 2 * dv1)


def test_bad_shapes_raise():
    q = torch.randn(4, 3, 8)
    k = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention_fwd_ref(q, k, k, None, None, None, 0)
    q = torch.randn(4, 4, 8)
    with pytest.raises(ValueError, match="needs k_cache"):
        paged_attention_fwd_ref(q, k, k, None, None, None, 5)


@pytest.mark.parametrize("C,past_len,S,block,starts", [
    (9, 13, 4, 8, [0, 5, 14, 15, 20]),  # docs ending mid-page, a one-token doc, a doc starting in the chunk
    (6, 16, 4, 4, [0, 16]),  # document boundary exactly at the chunk start: the whole past is skipped
    (7, 21, 4, 8, [0, 18]),  # a document spanning the chunk boundary
])
def test_reference_packed_documents(C, past_len, S, block, starts):
    Hq, Hkv, D = 4, 2, 8
    gen = torch.Generator().manual_seed(7)
    q, k, v, k_cache, v_cache, bt = make_case(C, Hq, Hkv, D, past_len, S, gen)
    T = past_len + C
    doc_start_all = torch.zeros(T, dtype=torch.long)
    for s0 in starts:
        doc_start_all[s0:] = s0
    q_doc_start = doc_start_all[past_len:]
    scale = D ** -0.5
    past_k = k_cache[bt.long()].reshape(-1, Hkv, D)[:past_len]
    past_v = v_cache[bt.long()].reshape(-1, Hkv, D)[:past_len]
    q_ = q.clone().requires_grad_()
    k_all = torch.cat([past_k, k]).requires_grad_()
    v_all = torch.cat([past_v, v]).requires_grad_()
    G = Hq // Hkv
    s = torch.einsum("qhd,khd->hqk", q_, k_all.repeat_interleave(G, 1)) * scale
    qpos = torch.arange(C)[:, None] + past_len
    kpos = torch.arange(T)[None, :]
    s = s.masked_fill((kpos > qpos) | (kpos < q_doc_start[:, None]), float("-inf"))
    out_ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v_all.repeat_interleave(G, 1))
    dout = torch.randn_like(out_ref)
    out_ref.backward(dout)

    out, lse = paged_attention_fwd_ref(q, k, v, k_cache, v_cache, bt, past_len, scale, block, q_doc_start)
    torch.testing.assert_close(out, out_ref.detach(), rtol=1e-12, atol=1e-12)
    dk_cache, dv_cache = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    dq, dk, dv = paged_attention_bwd_ref(dout, q, k, v, out, lse, k_cache, v_cache, bt, past_len, dk_cache, dv_cache,
                                         scale, block, q_doc_start)
    torch.testing.assert_close(dq, q_.grad, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(dk, k_all.grad[past_len:], rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(dv, v_all.grad[past_len:], rtol=1e-11, atol=1e-11)
    got_dk = dk_cache[bt.long()].reshape(-1, Hkv, D)[:past_len]
    torch.testing.assert_close(got_dk, k_all.grad[:past_len], rtol=1e-11, atol=1e-11)
