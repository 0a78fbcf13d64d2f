"""Triton paged attention kernels against the PyTorch reference (oomb.ops.attention_ref).

Runs on CUDA when present, else on CPU under the Triton interpreter (TRITON_INTERPRET=1 is
set here before triton is imported). Inputs are float32; the reference runs in float64.
Shapes are tiny and adversarial: odd chunk lengths, shuffled block tables, GQA 1/4/7,
partial last pages, page sizes below/equal/above the kernels' 16-token interpreter tile,
head dims that are not powers of two. Every output is poisoned with NaN before the call.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` to take effect

_PACKAGE = "oomb.ops.triton"
if (not torch.cuda.is_available() and "triton" in sys.modules
        and not getattr(sys.modules.get(_PACKAGE + ".interpreter"), "INTERPRET", False)):
    # Another test module imported triton before TRITON_INTERPRET was set, so triton.language's
    # own @jit helpers (tl.max, tl.sum, ...) were built for a GPU. Re-import triton's Python
    # modules (its compiled extension stays loaded) and the kernel modules under the interpreter.
    for _name in list(sys.modules):
        if _name == _PACKAGE or _name.startswith(_PACKAGE + ".") or (
                (_name == "triton" or _name.startswith("triton.")) and not _name.startswith("triton._C")):
            del sys.modules[_name]

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'oomb[triton]')")

from oomb.ops import attention_ref  # noqa: E402

from oomb.config import KernelConfig  # noqa: E402

tpa = importlib.import_module(_PACKAGE + ".paged_attention")
tune = importlib.import_module(_PACKAGE + ".autotune")
tma = importlib.import_module(_PACKAGE + ".tma")
bwd_kernels = importlib.import_module(_PACKAGE + ".paged_bwd_kernels")
fwd_kernels = importlib.import_module(_PACKAGE + ".paged_fwd_kernel")

# The interpreter itself triggers numpy's "array to scalar" deprecation on every program.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 1e-4
ATOL = 1e-5  # floor for outputs that are exactly 0 in exact arithmetic (e.g. dq with one visible key)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every tensor the launchers allocate starts as NaN, so an unwritten element shows."""
    monkeypatch.setattr(tpa, "_alloc_like", lambda x, dtype=None: torch.full_like(x, float("nan"), dtype=dtype))
    monkeypatch.setattr(tpa, "_alloc", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def make_case(C, Hq, Hkv, D, past_len, S, seed, extra_pages=2, transposed_q=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    n_pages = -(-past_len // S)
    P = n_pages + extra_pages
    k_cache = torch.randn(P, S, Hkv, D, generator=gen)
    v_cache = torch.randn(P, S, Hkv, D, generator=gen)
    block_table = torch.randperm(P, generator=gen)[:n_pages].to(torch.int32)
    if transposed_q:  # what the engine passes: query[0].transpose(0, 1) of HF's [1, H, C, D]
        q = torch.randn(Hq, C, D, generator=gen).transpose(0, 1)
        k = torch.randn(Hkv, C, D, generator=gen).transpose(0, 1)
        v = torch.randn(Hkv, C, D, generator=gen).transpose(0, 1)
    else:
        q = torch.randn(C, Hq, D, generator=gen)
        k = torch.randn(C, Hkv, D, generator=gen)
        v = torch.randn(C, Hkv, D, generator=gen)
    dout = torch.randn(C, Hq, D, generator=gen)
    to = lambda t: t.to(device=DEVICE, dtype=dtype)  # noqa: E731
    return dict(
        q=to(q), k=to(k), v=to(v), k_cache=to(k_cache), v_cache=to(v_cache),
        block_table=block_table.to(DEVICE), dout=to(dout),
    )


def assert_close(name, got, ref, rtol=RTOL):
    """Relative to the reference's largest magnitude; reports the worst element."""
    got = got.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values at {torch.nonzero(~torch.isfinite(got))[:5].tolist()}"
    err = (got - ref).abs()
    scale = ref.abs().max().clamp_min(1e-6)
    worst = int(err.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    rel_norm = (err.norm() / ref.norm().clamp_min(1e-12)).item()
    assert err.max() <= rtol * scale + ATOL, (
        f"{name}: max abs err {err.max().item():.3e} > {rtol:.0e} * {scale.item():.3e} + {ATOL:.0e} at {idx} "
        f"(got {got[idx].item():.6f}, ref {ref[idx].item():.6f}); rel norm err {rel_norm:.2e}"
    )


def run_both(case, past_len, dk_init=None, scale=None, q_doc_start=None):
    """Kernel (input dtype) and float64 reference on the same inputs; returns both results."""
    c = case
    doc_dev = None if q_doc_start is None else q_doc_start.to(DEVICE)
    out, lse = tpa.paged_attention_fwd(
        c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], past_len, scale, q_doc_start=doc_dev
    )
    dk_cache = torch.zeros(c["k_cache"].shape, dtype=torch.float32, device=DEVICE) if dk_init is None else dk_init[0].clone()
    dv_cache = torch.zeros(c["v_cache"].shape, dtype=torch.float32, device=DEVICE) if dk_init is None else dk_init[1].clone()
    dq, dk, dv = tpa.paged_attention_bwd(
        c["dout"], c["q"], c["k"], c["v"], out, lse, c["k_cache"], c["v_cache"], c["block_table"], past_len,
        dk_cache, dv_cache, scale, q_doc_start=doc_dev,
    )

    d = {name: t.double().cpu() for name, t in c.items() if name != "block_table"}
    bt = c["block_table"].cpu()
    out_r, lse_r = attention_ref.paged_attention_fwd_ref(
        d["q"], d["k"], d["v"], d["k_cache"], d["v_cache"], bt, past_len, scale, block_size=64, q_doc_start=q_doc_start
    )
    dk_cache_r = torch.zeros(d["k_cache"].shape, dtype=torch.float64)
    dv_cache_r = torch.zeros(d["v_cache"].shape, dtype=torch.float64)
    dq_r, dk_r, dv_r = attention_ref.paged_attention_bwd_ref(
        d["dout"], d["q"], d["k"], d["v"], out_r, lse_r, d["k_cache"], d["v_cache"], bt, past_len,
        dk_cache_r, dv_cache_r, scale, block_size=64, q_doc_start=q_doc_start,
    )
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dk_cache=dk_cache, dv_cache=dv_cache)
    ref = dict(out=out_r, lse=lse_r, dq=dq_r, dk=dk_r, dv=dv_r, dk_cache=dk_cache_r, dv_cache=dv_cache_r)
    return got, ref


CASES = [
    # C, Hq, Hkv, D, past_len, page_size, transposed_q     what it covers
    pytest.param(1, 2, 2, 64, 0, 16, False, id="C1-nopast-gqa1"),
    pytest.param(7, 4, 1, 64, 37, 16, False, id="C7-gqa4-partial-page"),
    pytest.param(33, 7, 1, 80, 50, 4, True, id="C33-gqa7-d80-page4-tile-spans-pages-strided"),
    pytest.param(17, 8, 2, 64, 64, 64, False, id="C17-gqa4-one-full-page-page-gt-tile"),
    pytest.param(5, 2, 1, 80, 203, 8, True, id="C5-many-pages-partial-strided"),
    pytest.param(33, 3, 3, 64, 16, 16, False, id="C33-gqa1-one-page-eq-tile"),
    pytest.param(2, 7, 1, 96, 1, 64, False, id="C2-gqa7-d96-past1"),
    pytest.param(20, 4, 2, 128, 45, 32, True, id="C20-d128-strided"),
]


@pytest.mark.parametrize("C,Hq,Hkv,D,past_len,S,transposed_q", CASES)
def test_kernels_match_reference(C, Hq, Hkv, D, past_len, S, transposed_q):
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=C * 131 + past_len, transposed_q=transposed_q)
    got, ref = run_both(case, past_len)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert_close(name, got[name], ref[name])
    assert got["out"].stride() == case["q"].stride() and got["dq"].stride() == case["q"].stride()
    if past_len:
        bt = case["block_table"].long().cpu()
        for name in ("dk_cache", "dv_cache"):
            g = got[name].cpu()[bt].reshape(-1, Hkv, D)
            r = ref[name][bt].reshape(-1, Hkv, D)
            assert_close(f"past {name}", g[:past_len], r[:past_len])
            assert torch.all(g[past_len:] == 0), f"{name}: tail of the partial last page was written"
        untouched = torch.ones(case["k_cache"].shape[0], dtype=torch.bool)
        untouched[bt] = False
        assert torch.all(got["dk_cache"].cpu()[untouched] == 0) and torch.all(got["dv_cache"].cpu()[untouched] == 0)


def test_backward_accumulates_in_place_and_is_deterministic():
    C, Hq, Hkv, D, past_len, S = 9, 4, 2, 64, 29, 8
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=7)
    gen = torch.Generator().manual_seed(8)
    base_k = torch.randn(case["k_cache"].shape, generator=gen).to(DEVICE)
    base_v = torch.randn(case["v_cache"].shape, generator=gen).to(DEVICE)
    got, ref = run_both(case, past_len, dk_init=(base_k, base_v))
    bt = case["block_table"].long().cpu()
    for name, base in (("dk_cache", base_k), ("dv_cache", base_v)):
        expect = base.double().cpu() + ref[name]
        assert_close(f"{name} accumulated", got[name].cpu()[bt].reshape(-1, Hkv, D)[:past_len],
                     expect[bt].reshape(-1, Hkv, D)[:past_len])
        # Outside the past tokens the existing values are bitwise untouched.
        g = got[name].cpu()[bt].reshape(-1, Hkv, D)[past_len:]
        assert torch.equal(g, base.cpu()[bt].reshape(-1, Hkv, D)[past_len:])
        untouched = torch.ones(base.shape[0], dtype=torch.bool)
        untouched[bt] = False
        assert torch.equal(got[name].cpu()[untouched], base.cpu()[untouched])
    # Same inputs, same bits (no atomics anywhere).
    got2, _ = run_both(case, past_len, dk_init=(base_k, base_v))
    for name in ("dq", "dk", "dv", "dk_cache", "dv_cache"):
        assert torch.equal(got[name], got2[name]), f"{name} differs between two identical runs"


def test_softmax_scale_and_bf16_path():
    """A non-default scale in fp32, and bf16 inputs (upcast products under the interpreter)."""
    case = make_case(11, 4, 1, 64, 21, 8, seed=3)
    got, ref = run_both(case, 21, scale=0.3)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert_close(name, got[name], ref[name])

    bf = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in case.items()}
    got, ref = run_both(bf, 21)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert_close(f"bf16 {name}", got[name], ref[name], rtol=3e-2)


def test_bad_inputs_raise():
    c = make_case(4, 4, 2, 64, 10, 8, seed=1)
    fwd = tpa.paged_attention_fwd
    with pytest.raises(ValueError, match="multiple of KV heads"):
        fwd(c["q"][:, :3], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], 10)
    with pytest.raises(ValueError, match="needs k_cache"):
        fwd(c["q"], c["k"], c["v"], None, None, None, 10)
    with pytest.raises(ValueError, match="int32"):
        fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"].long(), 10)
    with pytest.raises(ValueError, match=">= 2 pages"):
        fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"][:1], 10)
    with pytest.raises(ValueError, match="dtype"):
        fwd(c["q"].double(), c["k"].double(), c["v"].double(), None, None, None, 0)
    with pytest.raises(ValueError, match="share one dtype"):
        fwd(c["q"], c["k"].half(), c["v"], None, None, None, 0)
    out, lse = fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], 10)
    with pytest.raises(ValueError, match="dk_cache float32"):
        tpa.paged_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out, lse, c["k_cache"], c["v_cache"],
                                c["block_table"], 10, None, None)
    with pytest.raises(ValueError, match="lse must be float32"):
        tpa.paged_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out, lse[:, :2], None, None, None, 0, None, None)
    assert math.isfinite(float(lse.sum()))


PACKED = [
    # C, Hq, Hkv, D, past_len, S, document starts (absolute tokens)
    pytest.param(21, 4, 2, 64, 37, 8, [0, 5, 40, 41, 49], id="docs-in-past-and-chunk-one-token-doc"),
    pytest.param(19, 7, 1, 64, 48, 16, [0, 48], id="boundary-at-chunk-start-skips-past"),
    pytest.param(9, 4, 4, 80, 30, 8, [0, 3, 33], id="doc-spans-chunk-boundary"),
    pytest.param(40, 2, 1, 64, 0, 16, [0, 1, 2, 17, 39], id="no-past-many-docs"),
]


@pytest.mark.parametrize("C,Hq,Hkv,D,past_len,S,starts", PACKED)
def test_packed_documents_match_reference(C, Hq, Hkv, D, past_len, S, starts):
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=C + past_len, transposed_q=True)
    doc_all = torch.zeros(past_len + C, dtype=torch.int32)
    for s0 in starts:
        doc_all[s0:] = s0
    got, ref = run_both(case, past_len, q_doc_start=doc_all[past_len:].clone())
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert_close(name, got[name], ref[name])
    if past_len:
        bt = case["block_table"].long().cpu()
        for name in ("dk_cache", "dv_cache"):
            g = got[name].cpu()[bt].reshape(-1, Hkv, D)[:past_len]
            r = ref[name][bt].reshape(-1, Hkv, D)[:past_len]
            assert_close(f"past {name}", g, r)


# ------------------------------------------------------------------ segmented past
from test_attention_ref import SEGMENT_CASES, check_segmented_equals_whole  # noqa: E402


@pytest.mark.parametrize("C,Hq,Hkv,D,past_len,S,cuts,starts", SEGMENT_CASES)
def test_segmented_kernels_equal_whole(C, Hq, Hkv, D, past_len, S, cuts, starts):
    """Parts over [past_start, past_len) merged by log-sum-exp equal the one-call kernels (fp32, tight);
    segment cuts that are not multiples of the interpreter's 16-token tile included."""
    results = check_segmented_equals_whole("triton", C, Hq, Hkv, D, past_len, S, cuts, starts, dtype=torch.float32,
                                           device=DEVICE, tol=2e-6)
    if len(cuts) == 0:  # one segment: the same kernel calls, bit for bit
        for a, b in zip(*results):
            assert torch.equal(a, b)


def test_past_only_part_kernels_match_reference():
    """A past-only part (include_own=False, past_start > 0) of the kernels against the reference, incl. rows
    that see no key in it (out 0, lse -inf), and its backward with a final lse."""
    C, Hq, Hkv, D, past_len, S = 11, 4, 2, 16, 45, 4
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=5)
    doc = torch.tensor([0] * 4 + [30] * 7, dtype=torch.int32, device=DEVICE)
    args = (case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"], case["block_table"])
    out, lse = tpa.paged_attention_fwd(*args, 28, q_doc_start=doc, past_start=12, include_own=False, out_dtype=torch.float32)
    d = {n: t.double().cpu() for n, t in case.items() if n != "block_table"}
    bt = case["block_table"].cpu()
    ref_args = (d["q"], d["k"], d["v"], d["k_cache"], d["v_cache"], bt)
    out_r, lse_r = attention_ref.paged_attention_fwd_ref(*ref_args, 28, q_doc_start=doc.cpu(), past_start=12, include_own=False)
    assert out.dtype == torch.float32
    assert torch.all(out[4:] == 0) and torch.all(torch.isneginf(lse[:, 4:]))
    assert_close("part out", out, out_r)
    assert_close("part lse", lse[:, :4], lse_r[:, :4])
    # Backward of the part with the final out/lse of the whole attention.
    o_all, l_all = tpa.paged_attention_fwd(*args, past_len, q_doc_start=doc)
    o_r, l_r = attention_ref.paged_attention_fwd_ref(*ref_args, past_len, q_doc_start=doc.cpu())
    dkc = torch.zeros_like(case["k_cache"])
    dvc = torch.zeros_like(case["v_cache"])
    dq, dk, dv = tpa.paged_attention_bwd(case["dout"], *args[:3], o_all, l_all, *args[3:], 28, dkc, dvc, q_doc_start=doc,
                                         past_start=12, include_own=False, dq_dtype=torch.float32)
    dkc_r, dvc_r = torch.zeros_like(d["k_cache"]), torch.zeros_like(d["v_cache"])
    dq_r, _, _ = attention_ref.paged_attention_bwd_ref(d["dout"], *ref_args[:3], o_r, l_r, *ref_args[3:], 28, dkc_r, dvc_r,
                                                       q_doc_start=doc.cpu(), past_start=12, include_own=False)
    assert dk is None and dv is None and dq.dtype == torch.float32
    assert_close("part dq", dq, dq_r)
    assert_close("part dK pages", dkc, dkc_r)
    assert_close("part dV pages", dvc, dvc_r)
    # Pages of tokens before past_start are untouched.
    assert torch.all(dkc[bt[: 12 // S].long()] == 0)
    with pytest.raises(ValueError, match="include_own=False"):
        tpa.paged_attention_fwd(*args, 12, past_start=12, include_own=False)
    with pytest.raises(ValueError, match="out_dtype"):
        tpa.paged_attention_fwd(*args, 12, out_dtype=torch.float64)


# ------------------------------------------------------------------ dk/dv head-major row walk
DKDV_CASES = [
    # C, Hq, Hkv, D, past_len, S, transposed_q, doc starts (absolute) or None, past_start
    pytest.param(33, 7, 1, 80, 50, 4, True, None, 0, id="gqa7-d80-page4-strided"),
    pytest.param(20, 8, 2, 96, 45, 32, False, [0, 30, 52], 0, id="gqa4-d96-docs"),
    pytest.param(17, 3, 3, 64, 70, 16, True, None, 19, id="gqa1-segment-past_start19"),
]


@pytest.mark.parametrize("C,Hq,Hkv,D,past_len,S,transposed_q,starts,past_start", DKDV_CASES)
def test_dkdv_head_major_matches_reference(C, Hq, Hkv, D, past_len, S, transposed_q, starts, past_start):
    """The dk/dv kernel (query tiles walked head by head; 2-3 tiles per head with the interpreter's 16-row tiles)
    against the float64 reference: own dk/dv, and past dK/dV ADDED to non-zero gradient pages for tokens
    [past_start, past_len) only (GQA 7/4/1, head dims 80/96, packed documents, a past part with the final
    out/lse); two identical runs are bitwise equal."""
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=C * 7 + past_len, transposed_q=transposed_q)
    doc = None
    if starts is not None:
        doc_all = torch.zeros(past_len + C, dtype=torch.int32)
        for s0 in starts:
            doc_all[s0:] = s0
        doc = doc_all[past_len:].clone().to(DEVICE)
    args = (case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"], case["block_table"], past_len)
    out, lse = tpa.paged_attention_fwd(*args, q_doc_start=doc)
    gen = torch.Generator().manual_seed(1)
    base_k = torch.randn(case["k_cache"].shape, generator=gen).to(DEVICE)
    base_v = torch.randn(case["v_cache"].shape, generator=gen).to(DEVICE)
    runs = []
    for _ in range(2):
        dkc, dvc = base_k.clone(), base_v.clone()
        dq, dk, dv = tpa.paged_attention_bwd(case["dout"], *args[:3], out, lse, *args[3:], dkc, dvc, q_doc_start=doc,
                                             past_start=past_start)
        runs.append(dict(dq=dq, dk=dk, dv=dv, dk_cache=dkc, dv_cache=dvc))
    got = runs[0]
    for name in got:
        assert torch.equal(got[name], runs[1][name]), f"{name} differs between two identical runs"

    d = {n: t.double().cpu() for n, t in case.items() if n != "block_table"}
    bt = case["block_table"].cpu()
    doc_r = None if doc is None else doc.cpu()
    ref_args = (d["q"], d["k"], d["v"], d["k_cache"], d["v_cache"], bt, past_len)
    out_r, lse_r = attention_ref.paged_attention_fwd_ref(*ref_args, q_doc_start=doc_r)
    dkc_r, dvc_r = torch.zeros_like(d["k_cache"]), torch.zeros_like(d["v_cache"])
    dq_r, dk_r, dv_r = attention_ref.paged_attention_bwd_ref(d["dout"], *ref_args[:3], out_r, lse_r, *ref_args[3:], dkc_r, dvc_r,
                                                             q_doc_start=doc_r, past_start=past_start)
    assert_close("dq", got["dq"], dq_r)
    assert_close("dk", got["dk"], dk_r)
    assert_close("dv", got["dv"], dv_r)
    btl = bt.long()
    for name, base, ref in (("dk_cache", base_k, dkc_r), ("dv_cache", base_v, dvc_r)):
        g = got[name].cpu()[btl].reshape(-1, Hkv, D)
        b0 = base.cpu()[btl].reshape(-1, Hkv, D)
        assert_close(f"past {name} added", (g - b0)[past_start:past_len], ref[btl].reshape(-1, Hkv, D)[past_start:past_len])
        # Rows before past_start, the tail of the partial last page and pages outside the table are bitwise untouched.
        assert torch.equal(g[:past_start], b0[:past_start]), f"{name}: rows before past_start were written"
        assert torch.equal(g[past_len:], b0[past_len:]), f"{name}: tail of the partial last page was written"
        untouched = torch.ones(base.shape[0], dtype=torch.bool)
        untouched[btl] = False
        assert torch.equal(got[name].cpu()[untouched], base.cpu()[untouched])


def test_forward_tma_path_matches_gather_path(monkeypatch):
    """Full past tiles read through tensor descriptors (one page lookup, one box per tile) give the
    same bits as the per-token gather, with a shuffled block table and a partial last page; a pool
    that is not laid out densely, or KernelConfig(fwd_tma=False), takes the gather path."""
    configs = fwd_kernels._paged_attn_fwd_kernel["full"].configs
    S = max(c.kwargs["BLOCK_N"] for c in configs)  # 16 interpreted, 128 on a GPU
    C, Hq, Hkv, D, past_len = 19, 8, 2, 64, 2 * S + 19
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=11)
    args = (case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"], case["block_table"], past_len)
    assert tma.use_tma(case["k_cache"], case["v_cache"], D, S, configs)
    assert not tma.use_tma(case["k_cache"], case["v_cache"], D, S, configs, enabled=False)
    enabled = []  # the launcher's ``enabled`` argument of each use_tma call (made for page-aligned parts only)
    monkeypatch.setattr(tpa, "use_tma", lambda *a: enabled.append(a[5]) or tma.use_tma(*a))
    # Whole past; a part from a page boundary (TMA); a part from inside a page (its tiles straddle
    # pages, so the launcher keeps the gather).
    for past_start in (0, S, S + 3):
        out_tma, lse_tma = tpa.paged_attention_fwd(*args, past_start=past_start)
        out_gather, lse_gather = tpa.paged_attention_fwd(*args, past_start=past_start,
                                                         kernels=KernelConfig(fwd_tma=False))
        assert enabled == ([True, False] if past_start % S == 0 else []), past_start
        enabled.clear()
        if DEVICE == "cpu":  # the interpreter runs the same products in the same order
            assert torch.equal(out_tma, out_gather) and torch.equal(lse_tma, lse_gather), past_start
        else:
            assert_close(f"out (tma vs gather, past_start {past_start})", out_tma, out_gather.double())
            assert_close(f"lse (tma vs gather, past_start {past_start})", lse_tma, lse_gather.double())
    heads_outer = case["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)  # [P, S, Hkv, D] view, heads outer
    assert not tma.use_tma(heads_outer, heads_outer, D, S, configs)
    assert not tma.use_tma(case["k_cache"], case["v_cache"], D, S // 2, configs)  # a page smaller than a tile


@pytest.mark.parametrize("transposed_q", [False, True])
def test_backward_tma_paths_match_gather_paths(monkeypatch, transposed_q):
    """The dq kernel's full past tiles through tensor descriptors (KernelConfig.bwd_tma) and the dk/dv kernel's
    q/dout row tiles through [Hq, C, D] descriptors (KernelConfig.dkdv_tma; an odd C leaves a last row tile
    the descriptor must zero-fill) give the same bits as the gathers, for the whole past, a part from a
    page boundary and a part from inside a page (gather kept for the dq past tiles there), with
    gradient pages that already hold sums."""
    configs = bwd_kernels._paged_attn_bwd_dq_kernel["full"].configs
    S = max(c.kwargs["BLOCK_N"] for c in configs)  # 16 interpreted, 128 on a GPU
    C, Hq, Hkv, D, past_len = 19, 8, 2, 64, 2 * S + 19
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=12, transposed_q=transposed_q)
    args = (case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"], case["block_table"], past_len)
    assert tma.use_tma(case["k_cache"], case["v_cache"], D, S, configs)
    assert tma.qo_tma(case["q"], case["dout"], D)
    assert not tma.qo_tma(case["q"], case["dout"], D, enabled=False)
    enabled = []  # the launcher's ``enabled`` argument of each check (use_tma: page-aligned parts only)
    monkeypatch.setattr(tpa, "use_tma", lambda *a: enabled.append(("dq", a[5])) or tma.use_tma(*a))
    monkeypatch.setattr(tpa, "qo_tma", lambda *a: enabled.append(("dkdv", a[3])) or tma.qo_tma(*a))
    gen = torch.Generator().manual_seed(2)
    base_k = torch.randn(case["k_cache"].shape, generator=gen).to(DEVICE)
    base_v = torch.randn(case["v_cache"].shape, generator=gen).to(DEVICE)
    out, lse = tpa.paged_attention_fwd(*args)
    enabled.clear()  # the forward's check
    for past_start in (0, S, S + 3):
        got = {}
        for flag in ("1", "0"):
            kernels = KernelConfig(bwd_tma=flag == "1", dkdv_tma=flag == "1")
            dkc, dvc = base_k.clone(), base_v.clone()
            dq, dk, dv = tpa.paged_attention_bwd(case["dout"], *args[:3], out, lse, *args[3:], dkc, dvc, past_start=past_start,
                                                 kernels=kernels)
            got[flag] = dict(dq=dq, dk=dk, dv=dv, dk_cache=dkc, dv_cache=dvc)
        want = [("dq", True), ("dkdv", True), ("dq", False), ("dkdv", False)]
        assert enabled == (want if past_start % S == 0 else [w for w in want if w[0] == "dkdv"]), past_start
        enabled.clear()
        for name, with_tma in got["1"].items():
            gather = got["0"][name]
            if DEVICE == "cpu":  # the interpreter runs the same products in the same order
                assert torch.equal(with_tma, gather), (name, past_start)
            else:
                assert_close(f"{name} (tma vs gather, past_start {past_start})", with_tma, gather.double())
    strided = case["q"][:, :, ::2]  # innermost stride 2: no descriptor
    assert not tma.qo_tma(strided, strided, D // 2)


def test_tma_allocator_is_set_in_every_thread():
    """Triton keeps its allocator per thread (a ContextVar), and autograd runs the backward on its own
    thread: a launch with descriptors must set it in the thread that launches (on the H200 a backward
    failed with "no allocator was set" when only the main thread had it)."""
    import threading

    from triton.runtime import _allocation

    case = make_case(3, 2, 1, 64, 16, 16, seed=0)
    seen = {}

    def worker():
        seen["before"] = _allocation._allocator.get()
        tma.qo_tma(case["q"], case["dout"], 64)
        seen["after"] = _allocation._allocator.get()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert isinstance(seen["before"], _allocation.NullAllocator)
    assert seen["after"] is tma.tma_scratch


def test_fp32_inputs_get_their_own_small_tile():
    """On a GPU, autotuning sees only the fp32 tile for fp32 q and never sees it for bf16/fp16 q (the
    bf16-sized tiles took LLVM minutes to compile in fp32); autotune='first' keeps one bf16
    config (plus the fp32 tile)."""
    gpu = [(128, 64, 4, 3), (64, 64, 4, 3)]
    configs = tune.gpu_configs(gpu)
    assert len(configs) == 3
    for dtype, want in ((torch.float32, [tune.FP32_TILE[:2]]), (torch.bfloat16, [c[:2] for c in gpu]), (torch.float16, [c[:2] for c in gpu])):
        kept = tune.prune_by_dtype(configs, {"q_ptr": torch.empty(1, dtype=dtype)})
        assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept] == want, dtype
    # As the launchers call it: every argument by keyword, which Triton's autotuner passes to the
    # prune function in kwargs, not in named_args (looking only there kept every config for fp32).
    from triton.runtime.autotuner import Autotuner

    fn = bwd_kernels._paged_attn_bwd_dq_kernel.fn
    for dtype, want in ((torch.float32, [tune.FP32_TILE[:2]]), (torch.bfloat16, [c[:2] for c in gpu])):
        tuner = Autotuner(fn, fn.arg_names, configs, key=[], reset_to_zero=None, restore_value=None,
                          prune_configs_by=tune.PRUNE)
        tuner.nargs = dict(zip(fn.arg_names, ()))  # what Autotuner.run builds from no positional args
        kept = tuner.prune_configs({"q_ptr": torch.empty(1, dtype=dtype), "C": 1})
        assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept] == want, dtype
    first = tune.gpu_configs(gpu, "first")
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in first] == [(128, 64), tune.FP32_TILE[:2]]


def test_autotune_picks_the_config_list_per_launch():
    """KernelConfig.autotune chooses, per launch, the kernel tuned over its whole list ('full') or over the first
    entry ('first'); the two give the same results in the interpreter (one config each), and any other value raises
    a ValueError naming the argument."""
    kernel = fwd_kernels._paged_attn_fwd_kernel
    gpu = fwd_kernels.FWD_GPU_CONFIGS
    full, first = kernel._tuned["full"], kernel._tuned["first"]
    assert full is not first and full.fn is first.fn is kernel.fn
    if DEVICE == "cuda":
        assert len(full.configs) == len(gpu) + 1 and len(first.configs) == 2
    case = make_case(5, 4, 2, 16, 21, 8, seed=4)
    args = (case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"], case["block_table"], 21)
    out_full, lse_full = tpa.paged_attention_fwd(*args, kernels=KernelConfig(autotune="full"))
    out_first, lse_first = tpa.paged_attention_fwd(*args, kernels=KernelConfig(autotune="first"))
    assert_close("out (first vs full)", out_first, out_full.double())
    assert_close("lse (first vs full)", lse_first, lse_full.double())
    bad = KernelConfig()
    bad.autotune = "all"  # past the dataclass's own check
    with pytest.raises(ValueError, match="autotune must be 'full' or 'first'; got 'all'"):
        tpa.paged_attention_fwd(*args, kernels=bad)
    with pytest.raises(ValueError, match="autotune must be 'full' or 'first'"):
        tune.gpu_configs(gpu, "some")
