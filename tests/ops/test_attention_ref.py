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


# ------------------------------------------------------------------ segmented past
class FakeSegments:
    """A PastSegments over one pool and block table (every segment read through the same table).

    Records the acquire/release order and checks that each segment is released before the next is acquired.
    """

    def __init__(self, k_cache, v_cache, block_table, dk_cache, dv_cache, bounds, own=None):
        self.pools = (k_cache, v_cache, block_table, dk_cache, dv_cache)
        self.bounds = bounds
        self.own = own
        self.log = []

    def acquire(self, index, grad):
        assert not self.log or self.log[-1][0] != "acquire", self.log
        self.log.append(("acquire", index, grad))
        kc, vc, bt, dkc, dvc = self.pools
        return kc, vc, bt, dkc if grad else None, dvc if grad else None

    def runs(self, index, grad):
        return (), ()  # no contiguous views: the block-table path

    def release(self, index, grad):
        assert self.log[-1] == ("acquire", index, grad), self.log
        self.log.append(("release", index, grad))

    def begin_backward(self):
        self.log.append(("backward",))

    def own_grad(self, n):
        return None if self.own is None else (self.own[0][:n], self.own[1][:n])


def check_segmented_equals_whole(backend, C, Hq, Hkv, D, past_len, S, cuts, starts=None, dtype=torch.float64,
                                 device="cpu", tol=1e-12, block=8):
    """paged_attention / paged_attention_forward with the past cut at token boundaries ``cuts`` equal the
    unsegmented call: out, lse, dq, dk, dv (own stored gradient added) and the past dK/dV pages."""
    from oomb.ops.paged_attention import PagedKV, paged_attention, paged_attention_forward

    gen = torch.Generator().manual_seed(C * 7 + past_len)
    q, k, v, k_cache, v_cache, bt = (t.to(device) for t in make_case(C, Hq, Hkv, D, past_len, S, gen, dtype=dtype))
    n_own = -(-C // S)
    own_pages = torch.arange(k_cache.shape[0], k_cache.shape[0] + n_own, dtype=torch.int32, device=device)
    k_cache = torch.cat([k_cache, torch.zeros(n_own, S, Hkv, D, dtype=dtype, device=device)])
    v_cache = torch.cat([v_cache, torch.zeros(n_own, S, Hkv, D, dtype=dtype, device=device)])
    gdt = torch.float64 if dtype == torch.float64 else torch.float32
    base_dk = torch.randn(k_cache.shape, generator=gen, dtype=gdt).to(device)  # already stored gradients
    base_dv = torch.randn(k_cache.shape, generator=gen, dtype=gdt).to(device)
    doc = None
    if starts is not None:
        doc_all = torch.zeros(past_len + C, dtype=torch.int32)
        for s0 in starts:
            doc_all[s0:] = s0
        doc = doc_all[past_len:].clone().to(device)
    dout = torch.randn(C, Hq, D, generator=gen, dtype=dtype).to(device)
    scale = D ** -0.5
    results = []
    for segmented in (False, True):
        dkc, dvc = base_dk.clone(), base_dv.clone()
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        if segmented:
            bounds = list(zip([0] + cuts, cuts + [past_len])) if past_len else []
            own = (dkc[own_pages.long()].flatten(0, 1), dvc[own_pages.long()].flatten(0, 1))
            segs = FakeSegments(k_cache, v_cache, bt, dkc, dvc, bounds, own)
            kv = PagedKV(None, None, None, past_len, q_doc_start=doc, segments=segs)
        else:
            kv = PagedKV(k_cache, v_cache, bt, past_len, dkc, dvc, own_pages, doc)
        out_nograd, lse = paged_attention_forward(q, k, v, kv, scale, backend, block)
        out = paged_attention(qq, kk, vv, kv, scale, backend, block)
        out.backward(dout)
        results.append((out_nograd, lse, out.detach(), qq.grad, kk.grad, vv.grad, dkc, dvc))
        if segmented and bounds:
            n = len(bounds)
            fwd = [("acquire", i, False) for i in range(n)]
            bwd = [("acquire", i, True) for i in reversed(range(n))]
            assert [e for e in segs.log if e[0] == "acquire"] == fwd + fwd + bwd, segs.log
    names = ["out (no grad)", "lse", "out", "dq", "dk", "dv", "past dK pages", "past dV pages"]
    for name, a, b in zip(names, *results):
        a, b = a.double().cpu(), b.double().cpu()
        fin = torch.isfinite(b)
        assert torch.equal(fin, torch.isfinite(a)), name
        err = ((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp_min(1e-30)).item() if fin.any() else 0.0
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"
    return results


SEGMENT_CASES = [
    # C, Hq, Hkv, D, past_len, S, cuts (token boundaries of the segments), document starts
    pytest.param(7, 4, 2, 8, 37, 4, [12, 20], None, id="gqa4:2-partial-last-page-cuts-off-chunk"),
    pytest.param(9, 7, 1, 8, 40, 4, [4, 8, 36], None, id="gqa7:1-one-page-segments"),
    pytest.param(5, 4, 2, 8, 23, 4, [20], None, id="last-segment-one-partial-page"),
    pytest.param(8, 4, 2, 8, 30, 4, [8, 16], [0, 10, 31, 35], id="docs-first-segment-fully-masked"),
    pytest.param(6, 4, 2, 8, 24, 4, [12], [0, 24], id="docs-whole-past-masked"),
    pytest.param(6, 4, 2, 8, 24, 4, [], [0, 5, 26], id="one-segment-docs"),
    pytest.param(6, 4, 2, 8, 0, 4, [], None, id="no-past"),
]


@pytest.mark.parametrize("C,Hq,Hkv,D,past_len,S,cuts,starts", SEGMENT_CASES)
def test_segmented_reference_equals_whole(C, Hq, Hkv, D, past_len, S, cuts, starts):
    results = check_segmented_equals_whole("torch", C, Hq, Hkv, D, past_len, S, cuts, starts)
    if len(cuts) == 0:  # one segment: the same call, bit for bit
        for a, b in zip(*results):
            assert torch.equal(a, b)


def test_reference_past_only_part_of_a_masked_row_is_zero_with_lse_minus_inf():
    gen = torch.Generator().manual_seed(3)
    q, k, v, k_cache, v_cache, bt = make_case(4, 2, 1, 8, 16, 4, gen)
    doc = torch.tensor([0, 9, 9, 9])
    out, lse = paged_attention_fwd_ref(q, k, v, k_cache, v_cache, bt, 8, q_doc_start=doc, past_start=4, include_own=False)
    assert torch.all(out[1:] == 0) and torch.all(torch.isneginf(lse[:, 1:])) and torch.isfinite(lse[:, 0]).all()
    with pytest.raises(ValueError, match="past_start"):
        paged_attention_fwd_ref(q, k, v, k_cache, v_cache, bt, 8, past_start=9)
    with pytest.raises(ValueError, match="include_own=False"):
        paged_attention_fwd_ref(q, k, v, k_cache, v_cache, bt, 8, past_start=8, include_own=False)
