"""The 'sdpa' attention backend: split-and-merge over PyTorch's fused SDPA kernels (oomb.ops.sdpa_attention).

On the CPU the primitives are PyTorch's CPU flash kernel and its backward; the split into past and own keys,
the log-sum-exp merge, the backward with the final out/lse, the in-place past dK/dV and the engine's choice
of calls are what these tests check (fp64 tight, fp32 close). The cuDNN primitives are checked on the GPU by
benchmarks/bench_sdpa_attention.py and the CUDA test at the end.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import oomb.ops.sdpa_attention as sa
from oomb import Engine
from configs import engine_config
from oomb.engine.kv_store import PagedKVStore
from oomb.ops.attention_ref import paged_attention_bwd_ref, paged_attention_fwd_ref
from oomb.ops.paged_attention import paged_backend, resolve_backend

from tests.engine.test_engine import VOCAB, packed_parity, run_parity, tiny

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(C, Hq, Hkv, D, past_len, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    return dict(q=rn(C, Hq, D), k=rn(C, Hkv, D), v=rn(C, Hkv, D), dout=rn(C, Hq, D),
                past_k=rn(past_len, Hkv, D), past_v=rn(past_len, Hkv, D),
                base_dk=rn(past_len, Hkv, D).to(torch.float64 if dtype == torch.float64 else torch.float32),
                base_dv=rn(past_len, Hkv, D).to(torch.float64 if dtype == torch.float64 else torch.float32))


def _reference(x, scale):
    """The PyTorch reference with the past as pages of one token each (so any past_len is one page table)."""
    C, Hkv, D = x["k"].shape
    P = x["past_k"].shape[0]
    kc, vc = x["past_k"].reshape(P, 1, Hkv, D), x["past_v"].reshape(P, 1, Hkv, D)
    bt = torch.arange(P, dtype=torch.int32)
    out, lse = paged_attention_fwd_ref(x["q"], x["k"], x["v"], kc, vc, bt, P, scale)
    dkc, dvc = x["base_dk"].clone().reshape(P, 1, Hkv, D), x["base_dv"].clone().reshape(P, 1, Hkv, D)
    dq, dk, dv = paged_attention_bwd_ref(x["dout"], x["q"], x["k"], x["v"], out, lse, kc, vc, bt, P, dkc, dvc, scale)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, past_dk=dkc.reshape(P, Hkv, D), past_dv=dvc.reshape(P, Hkv, D))


def _runs(t, splits):
    """[P, Hkv, D] -> views of its runs, cut at the token positions ``splits``."""
    return [t[a:b] for a, b in itertools.pairwise([0, *splits, t.shape[0]])]


def _sdpa(x, scale, splits=()):
    P = x["past_k"].shape[0]
    past = list(zip(_runs(x["past_k"], splits), _runs(x["past_v"], splits))) if P else []
    out, lse = sa.sdpa_attention_fwd(x["q"], x["k"], x["v"], past, scale)
    pdk, pdv = x["base_dk"].clone(), x["base_dv"].clone()
    grads = list(zip(_runs(pdk, splits), _runs(pdv, splits))) if P else []
    dq, dk, dv = sa.sdpa_attention_bwd(x["dout"], x["q"], x["k"], x["v"], out, lse, past, grads, scale)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, past_dk=pdk, past_dv=pdv)


SHAPES = [
    # C, Hq, Hkv, D, past_len
    (8, 4, 2, 16, 24),
    (13, 7, 1, 16, 37),  # GQA 7:1, odd sizes
    (9, 4, 4, 8, 0),  # no past
    (1, 6, 2, 8, 5),  # one query
    (16, 8, 2, 32, 1),  # one past token
]


def _splits(past_len, runs):
    """Token positions that cut a past of ``past_len`` tokens into ``runs`` uneven runs (fewer for a short past)."""
    cuts = {1: [], 2: [past_len // 3], 3: [1, past_len // 2]}[runs]
    return sorted({c for c in cuts if 0 < c < past_len})


@pytest.mark.parametrize("C,Hq,Hkv,D,past_len", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("runs", [1, 2, 3])
def test_split_merge_matches_reference(C, Hq, Hkv, D, past_len, dtype, tol, runs):
    """One call per past run and one over the own keys, merged: the reference's out, lse and gradients, the past
    gradient ADDED into each run's views (one run: the engine's contiguous store; 2-3: an offloaded segment)."""
    x = _inputs(C, Hq, Hkv, D, past_len, dtype, seed=C + past_len)
    scale = 0.37
    splits = _splits(past_len, runs)
    assert past_len < 3 or len(splits) == runs - 1
    want, got = _reference(x, scale), _sdpa(x, scale, splits)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        err = ((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"
    # The past gradient is ADDED to what the storage held (later chunks' sums), not written over it.
    if past_len:
        assert not torch.allclose(got["past_dk"], got["past_dk"] - x["base_dk"])


@pytest.mark.parametrize("runs", [1, 2])
def test_runs_longer_than_one_call_are_split(monkeypatch, runs):
    """A run longer than MAX_RUN_TOKENS is read by several calls (pieces of at most that many tokens), merged:
    the reference's results, and that many more primitive calls."""
    x = _inputs(8, 4, 2, 16, 37, torch.float64, seed=9)
    calls = []
    part_fwd = sa._part_fwd
    monkeypatch.setattr(sa, "_part_fwd", lambda *a: (calls.append(a[1].shape[2]), part_fwd(*a))[1])
    monkeypatch.setattr(sa, "MAX_RUN_TOKENS", 5)
    want, got = _reference(x, 0.3), _sdpa(x, 0.3, _splits(37, runs))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)
    assert max(calls[:-1]) == 5 and sum(calls[:-1]) == 37 and calls[-1] == 8  # the past in pieces, then the own keys
    assert len(calls) == 1 + sum(-(-len(r) // 5) for r in _runs(torch.empty(37), _splits(37, runs)))


def test_strided_past_views_are_read_as_such():
    """The engine passes [past, Hkv, D] views of a [pages, page_size, Hkv, D] pool: same results as copies."""
    x = _inputs(8, 4, 2, 16, 32, torch.float64, seed=3)
    pool_k = torch.zeros(10, 4, 2, 16, dtype=torch.float64)
    pool_v = torch.zeros_like(pool_k)
    pool_k[2:10] = x["past_k"].reshape(8, 4, 2, 16)
    pool_v[2:10] = x["past_v"].reshape(8, 4, 2, 16)
    y = dict(x, past_k=pool_k[2:10].flatten(0, 1), past_v=pool_v[2:10].flatten(0, 1))
    a, b = _sdpa(x, 0.25), _sdpa(y, 0.25)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-13)


def test_backend_names():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "sdpa"
    assert resolve_backend("sdpa", torch.device("cpu")) == "sdpa"
    assert paged_backend("sdpa", torch.device("cpu")) == "torch"
    assert paged_backend("triton", torch.device("cpu")) == "triton"
    assert paged_backend("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="attention_backend is .cudnn.; pass one of"):
        engine_config(attention_backend="cudnn")


def test_store_hands_each_layer_consecutive_pages():
    L, S, Hkv, D = 3, 4, 2, 8
    store = PagedKVStore(L, Hkv, D, S, L * 5, torch.float64, "cpu")
    g = torch.Generator().manual_seed(0)
    for start in (0, 8):  # two chunks of 8 tokens per layer, written layer by layer as the engine does
        for layer in range(L):
            kv = [torch.randn(8, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2)]
            store.write(layer, start, *kv)
    for layer in range(L):
        view = store.attention_view(layer, 2, 16, 4, True)
        (past_k, _), = view.past_runs
        assert past_k.shape == (16, Hkv, D)
        gathered = store.k_cache[store.block_table[layer, :4].long()].flatten(0, 1)
        assert torch.equal(past_k, gathered)
        assert view.past_grad_runs[0][0].data_ptr() == store.dk_cache[layer * 5].data_ptr()  # a view into the pool
        assert store.attention_view(layer, 1, 8, 8, False).past_grad_runs == ()  # Stage 1: no gradient views
        assert store.attention_view(layer, 1, 0, 8, False).past_runs == ()  # no past
    # Released from the end and written again (the next step): still consecutive.
    for layer in range(L):
        store.release_from(layer, 8)
        store.write(layer, 8, torch.zeros(4, Hkv, D, dtype=torch.float64), torch.zeros(4, Hkv, D, dtype=torch.float64))
        assert store.attention_view(layer, 2, 12, 4, True).past_runs[0][0].shape == (12, Hkv, D)
    # Shuffled pages: no view, the block table serves the call.
    store.reset()
    store.shuffle_free_list(torch.Generator().manual_seed(1))
    for layer in range(L):
        store.write(layer, 0, torch.zeros(16, Hkv, D, dtype=torch.float64), torch.zeros(16, Hkv, D, dtype=torch.float64))
    assert any(store.attention_view(layer, 2, 16, 4, True).past_runs == () for layer in range(L))


class _Count:
    def __init__(self, monkeypatch):
        self.fwd = self.bwd = 0
        f, b = sa.sdpa_attention_fwd, sa.sdpa_attention_bwd

        self.runs = []  # past runs of each backward call with a past

        def fwd(*a, **k):
            self.fwd += len(a[3]) > 0  # calls with a past
            return f(*a, **k)

        def bwd(*a, **k):
            self.bwd += len(a[6]) > 0
            if a[6]:
                self.runs.append(len(a[6]))
            return b(*a, **k)

        monkeypatch.setattr(sa, "sdpa_attention_fwd", fwd)
        monkeypatch.setattr(sa, "sdpa_attention_bwd", bwd)


@pytest.mark.parametrize("family,heads,kv_heads,T,chunk,page", [
    ("qwen2", 4, 2, 64, 16, 4),
    ("qwen2", 7, 1, 45, 12, 4),  # GQA 7:1, a partial last chunk and page
    ("qwen3", 4, 2, 33, 8, 8),
])
def test_engine_with_sdpa_equals_full_sequence_fp64(monkeypatch, family, heads, kv_heads, T, chunk, page):
    count = _Count(monkeypatch)
    out, ref_loss, (err, where), _ = run_parity(tiny(family, heads, kv_heads), T, chunk, page, shuffle_pages=False,
                                                attention_backend="sdpa")
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"
    n_chunks, layers = -(-T // chunk), 2
    # Every call with a past went through the split SDPA path: Stage 1 (chunks 1 .. N-2; the last chunk has no
    # Stage 1), the Stage-2 recompute forward and the backward (chunks 1 .. N-1).
    assert count.fwd == (2 * n_chunks - 3) * layers and count.bwd == (n_chunks - 1) * layers


def test_engine_with_sdpa_falls_back_on_scattered_pages(monkeypatch):
    count = _Count(monkeypatch)
    out, ref_loss, (err, _), _ = run_parity(tiny("llama", 4, 2), 40, 8, 4, shuffle_pages=True, attention_backend="sdpa")
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss) and err <= 1e-10
    assert count.bwd < 4 * 2  # some (usually all) calls read their past through the block table


def test_engine_with_sdpa_packed_documents_use_the_paged_path(monkeypatch):
    count = _Count(monkeypatch)
    out, ref_loss, _, (err, _), _ = packed_parity("qwen2", [7, 12, 1, 20], 8, 4, backend="sdpa")
    assert abs(out.loss - ref_loss) <= 1e-10 * out.loss and err <= 1e-10
    assert count.fwd == 0 and count.bwd == 0


def test_engine_with_sdpa_fp32_close():
    out, ref_loss, (err, where), _ = run_parity(tiny("qwen2", 4, 2), 48, 16, 8, dtype=torch.float32,
                                                shuffle_pages=False, attention_backend="sdpa")
    assert abs(out.loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert err <= 1e-4, f"worst gradient {where}: rel err {err:.3e}"


@pytest.mark.cuda(reason="cuDNN attention needs CUDA")
def test_cudnn_primitives_bf16_within_twice_the_bf16_reference():
    """On the GPU: the cuDNN split path against an fp32 reference, within 2x of the reference run in bf16.

    The past dK/dV are compared with the bf16 reference's past dK/dV rounded to bf16 once, as every
    full-sequence bf16 training's key gradients are (cuDNN returns them in bf16 before they are added
    into the float32 pages)."""
    if not sa.sdpa_available(torch.empty(1, 4, 128, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("cuDNN fused attention (cuDNN >= 9, sm90+) not available")
    x = _inputs(256, 28, 4, 128, 1024, torch.bfloat16, seed=5, device="cuda")
    x["base_dk"].zero_()
    x["base_dv"].zero_()
    scale = 128 ** -0.5
    x32 = {n: t.float() for n, t in x.items()}
    want = _reference({n: t.cpu() for n, t in x32.items()}, scale)
    lp = _reference({n: t.cpu() for n, t in x.items()}, scale)
    got = _sdpa(x, scale)
    for name in want:
        ref_lp = lp[name].to(torch.bfloat16) if name.startswith("past_") else lp[name]
        e_lp = ((ref_lp.double() - want[name].double()).norm() / want[name].double().norm()).item()
        e = ((got[name].cpu().double() - want[name].double()).norm() / want[name].double().norm()).item()
        assert torch.isfinite(got[name]).all(), name
        # lse: the bf16 reference computes it in fp32 from the same rounded inputs (error 0), hence the floor
        assert e <= 2 * e_lp + 1e-6, f"{name}: {e:.2e} > 2 x {e_lp:.2e}"


def test_planner_counts_the_sdpa_transients():
    from oomb.memory import ModelShape, activation_bytes

    shape = ModelShape.from_config(tiny("qwen2", 4, 2).config)
    C, past = 64, 4096
    t = activation_bytes(shape, C, torch.bfloat16, attention_backend="triton", max_past=past)["attention_temp"]
    s = activation_bytes(shape, C, torch.bfloat16, attention_backend="sdpa", max_past=past)["attention_temp"]
    # the past's dK/dV, with GQA dK/dV of every query head, and the part outputs, in bf16
    assert s - t == 2 * past * (shape.kv_dim + shape.q_dim) * 2 + 2 * C * shape.q_dim * 2
    long = activation_bytes(shape, C, torch.bfloat16, attention_backend="sdpa", max_past=10 * sa.MAX_RUN_TOKENS)
    assert long["attention_temp"] - t == 2 * sa.MAX_RUN_TOKENS * (shape.kv_dim + shape.q_dim) * 2 + 2 * C * shape.q_dim * 2


@pytest.mark.parametrize("C,Hq,D,dtype", [(37, 3, 16, torch.float32), (64, 4, 80, torch.float32),
                                          (5, 2, 128, torch.bfloat16)])
def test_triton_lse_merge_equals_the_torch_merge(C, Hq, D, dtype):
    """The one-pass merge kernel (interpreter on the CPU) against merge_parts, with strided parts as cuDNN returns."""
    pytest.importorskip("triton")
    from oomb.ops.triton.lse_merge import lse_merge

    g = torch.Generator().manual_seed(C)
    dev = DEVICE
    a = torch.randn(C, Hq, D, generator=g).to(dev, dtype).transpose(0, 1)  # [Hq, C, D] view of [C, Hq, D]
    b = torch.randn(Hq, C, D, generator=g).to(dev, dtype)
    la, lb = (torch.randn(Hq, C, generator=g) * 4).to(dev), (torch.randn(Hq, C, generator=g) * 4).to(dev)
    out, lse = lse_merge(a, la, b, lb, dtype)
    want_out, want_lse = sa.merge_parts(a, la, b, lb, dtype)
    assert out.shape == (C, Hq, D) and out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the same float32 value, up to 1 ulp apart
    torch.testing.assert_close(out.float(), want_out.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="do not match"):
        lse_merge(a, la, b[:, :-1], lb, dtype)


def test_autocast_bf16_queries_over_a_float32_store_use_the_paged_path(monkeypatch):
    """Under CPU autocast q/k/v are bf16 while the store keeps the model's float32: the 'sdpa' backend hands those
    calls to the block-table path (which reads mixed dtypes) instead of failing; same loss as the 'torch' backend."""
    losses = []
    for backend in ("torch", "sdpa"):
        torch.manual_seed(2)
        model = tiny("qwen2", 4, 2)
        engine = Engine(model, engine_config(chunk_size=16, page_size=8, attention_backend=backend))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(engine.step(torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(0))).loss)
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert losses[0] == losses[1]
