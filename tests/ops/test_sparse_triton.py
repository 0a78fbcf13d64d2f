"""Triton sparse attention kernels against the sparse PyTorch reference (interpreter on CPU).

Inputs float32, reference float64; every launcher output is poisoned with NaN first. Shapes
are tiny: GQA 1/4/7, head dims 64 and 80, page sizes below and above the interpreter's
16-token tile, a partial last page, query blocks that split tiles, blocks selecting nothing,
packed documents, a strided q.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from configs import engine_config

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'oomb[triton]')")

from oomb.ops.sparse_attention_ref import sparse_attention_bwd_ref, sparse_attention_fwd_ref  # noqa: E402
from oomb.ops.sparse_representatives import page_representatives  # noqa: E402
from oomb.ops.sparse_select import select_pages  # noqa: E402
from tests.ops.test_triton_kernels import DEVICE, assert_close, make_case  # noqa: E402

tpa = importlib.import_module("oomb.ops.triton.paged_attention")
tsa = importlib.import_module("oomb.ops.triton.sparse_attention")
inputs = importlib.import_module("oomb.ops.triton.inputs")
paged_bwd = importlib.import_module("oomb.ops.triton.paged_bwd_kernels")
sparse_kernels = importlib.import_module("oomb.ops.triton.sparse_kernels")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    def full_like(x, dtype=None):
        return torch.full_like(x, float("nan"), dtype=dtype)

    def full(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    for mod in (tpa, tsa):
        monkeypatch.setattr(mod, "_alloc", full)
    monkeypatch.setattr(tpa, "_alloc_like", full_like)


def _selection(case, past_len, S, budget, sink, local, block, score, doc=None, device=DEVICE):
    Hkv, D = case["k_cache"].shape[2], case["k_cache"].shape[3]
    bt = case["block_table"].long().cpu()
    keys = case["k_cache"].cpu().double()[bt].reshape(-1, Hkv, D)[:past_len]
    sel = select_pages(case["q"].cpu().double(), page_representatives(keys, S, score), past_len, S, budget, sink, local,
                       block, score, doc)
    on_dev = type(sel)(sel.page_idx.to(device), sel.counts.to(device), sel.block_size, sel.n_past_pages, sel.dense)
    return sel, on_dev


CASES = [
    # C, Hq, Hkv, D, past_len, S, block, budget, sink, local, score, transposed
    pytest.param(9, 4, 1, 64, 37, 4, 4, 2, 1, 1, "mean", False, id="gqa4-page4-partial-page"),
    pytest.param(11, 7, 1, 64, 70, 32, 3, 1, 0, 0, "quest", True, id="gqa7-page32-strided"),
    pytest.param(13, 2, 2, 80, 40, 8, 5, 1, 1, 1, "mean", False, id="gqa1-d80-block5"),
    pytest.param(6, 4, 2, 64, 24, 8, 4, 0, 0, 0, "mean", False, id="nothing-selected"),
]


@pytest.mark.parametrize("C,Hq,Hkv,D,past_len,S,block,budget,sink,local,score,transposed", CASES)
def test_sparse_kernels_match_reference(C, Hq, Hkv, D, past_len, S, block, budget, sink, local, score, transposed):
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=C * 7 + past_len, transposed_q=transposed)
    sel_cpu, sel = _selection(case, past_len, S, budget, sink, local, block, score)
    assert not sel.dense
    _run_and_compare(case, past_len, sel_cpu, sel)


def test_sparse_kernels_packed_documents():
    C, Hq, Hkv, D, past_len, S = 10, 4, 2, 64, 32, 8
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=3)
    doc = torch.tensor([12] * 3 + [34] * 4 + [39] * 3, dtype=torch.int32)
    sel_cpu, sel = _selection(case, past_len, S, 1, 1, 1, 4, "mean", doc)
    _run_and_compare(case, past_len, sel_cpu, sel, doc)


def _run_and_compare(case, past_len, sel_cpu, sel, doc=None):
    c = case
    doc_dev = None if doc is None else doc.to(DEVICE)
    out, lse = tsa.sparse_attention_fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], past_len, sel,
                                        q_doc_start=doc_dev)
    dk_cache = torch.zeros(c["k_cache"].shape, dtype=torch.float32, device=DEVICE)
    dv_cache = torch.zeros_like(dk_cache)
    dq, dk, dv = tsa.sparse_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out, lse, c["k_cache"], c["v_cache"],
                                          c["block_table"], past_len, dk_cache, dv_cache, sel, q_doc_start=doc_dev)
    d = {name: t.double().cpu() for name, t in c.items() if name != "block_table"}
    bt = c["block_table"].cpu()
    out_r, lse_r = sparse_attention_fwd_ref(d["q"], d["k"], d["v"], d["k_cache"], d["v_cache"], bt, past_len, sel_cpu,
                                            q_doc_start=doc)
    dkc_r, dvc_r = torch.zeros_like(d["k_cache"]), torch.zeros_like(d["v_cache"])
    dq_r, dk_r, dv_r = sparse_attention_bwd_ref(d["dout"], d["q"], d["k"], d["v"], out_r, lse_r, d["k_cache"], d["v_cache"],
                                                bt, past_len, dkc_r, dvc_r, sel_cpu, q_doc_start=doc)
    for name, g, r in (("out", out, out_r), ("lse", lse, lse_r), ("dq", dq, dq_r), ("dk", dk, dk_r), ("dv", dv, dv_r),
                       ("dk_cache", dk_cache, dkc_r), ("dv_cache", dv_cache, dvc_r)):
        assert_close(name, g, r)
    # Exactly the rows the reference touched changed (selected pages, below past_len).
    assert torch.equal(dk_cache.cpu() != 0, dkc_r != 0)


@pytest.mark.parametrize("pages,block", [(2.2, 3), (3, 16)], ids=["partial-last-page-block3", "full-pages-block16"])
def test_descriptor_tiles_equal_gathered_tiles(monkeypatch, pages, block):
    """Full-page K/V tiles (forward, dq) and q/dout row tiles (dk/dv) through tensor descriptors give the gathered
    tiles' results (bitwise under the interpreter, to fp32 rounding compiled), with a partial last page and query
    blocks that end inside a row tile."""
    from oomb.config.engine import KernelConfig

    used = []
    for name in ("use_tma", "qo_tma"):
        real = getattr(tsa, name)
        monkeypatch.setattr(tsa, name, lambda *a, _real=real, _name=name, **kw: used.append((_name, _real(*a, **kw))) or used[-1][1])
    C, Hq, Hkv, D = 19, 7, 1, 64
    S = 128 if DEVICE == "cuda" else 32  # pages a multiple of every autotuned BLOCK_N (GPU configs: up to 128)
    past_len = int(pages * S)
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=5, transposed_q=True)
    _, sel = _selection(case, past_len, S, 1, 1, 0, block, "mean")
    assert not sel.dense
    c = case
    results = []
    for kc in (KernelConfig(), KernelConfig(fwd_tma=False, bwd_tma=False, dkdv_tma=False)):
        used.clear()
        out, lse = tsa.sparse_attention_fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], past_len,
                                            sel, kernels=kc)
        dkc = torch.zeros(c["k_cache"].shape, dtype=torch.float32, device=DEVICE)
        dvc = torch.zeros_like(dkc)
        grads = tsa.sparse_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out, lse, c["k_cache"], c["v_cache"],
                                         c["block_table"], past_len, dkc, dvc, sel, kernels=kc)
        results.append((out, lse, *grads, dkc, dvc))
        assert [u for _, u in used] == ([True] * 3 if kc.fwd_tma else [False] * 3), used
    for got, want in zip(*results):
        if DEVICE == "cpu":
            assert torch.equal(got, want)
        else:  # compiled, the two loops may round differently
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kernel_backward_is_deterministic_and_accumulates():
    C, Hq, Hkv, D, past_len, S = 8, 4, 2, 64, 48, 8
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=11)
    _, sel = _selection(case, past_len, S, 2, 1, 0, 4, "mean")
    c = case
    out, lse = tsa.sparse_attention_fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], past_len, sel)
    base = torch.randn(c["k_cache"].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    results = []
    for _ in range(2):
        dkc, dvc = base.clone(), base.clone()
        tsa.sparse_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out, lse, c["k_cache"], c["v_cache"], c["block_table"],
                                 past_len, dkc, dvc, sel)
        results.append((dkc, dvc))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    zero_k = torch.zeros_like(base)
    tsa.sparse_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out, lse, c["k_cache"], c["v_cache"], c["block_table"],
                             past_len, zero_k, torch.zeros_like(base), sel)
    torch.testing.assert_close(results[0][0], base + zero_k, rtol=1e-6, atol=1e-6)


def test_bad_selection_is_refused():
    case = make_case(8, 4, 2, 64, 32, 8, seed=2)
    _, sel = _selection(case, 32, 8, 1, 0, 0, 4, "mean")
    c = case
    with pytest.raises(ValueError, match="query blocks"):
        tsa.sparse_attention_fwd(c["q"][:3], c["k"][:3], c["v"][:3], c["k_cache"], c["v_cache"], c["block_table"], 32, sel)
    with pytest.raises(ValueError, match="past pages"):
        tsa.sparse_attention_fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], 16, sel)


def test_engine_step_triton_equals_torch_sparse():
    from oomb import Engine
    from tests.engine.test_engine import VOCAB, clone_model, tiny

    torch.manual_seed(0)
    model = tiny("qwen2", 4, 2, head_dim=16).float().to(DEVICE)  # the GPU when there is one, else the interpreter
    twin = clone_model(model)
    ids = torch.randint(0, VOCAB, (1, 44)).to(DEVICE)
    cfg = dict(chunk_size=16, page_size=4, sparse=True, page_budget=2, sink_pages=1, local_pages=0, sparse_block_size=8)
    ref = Engine(model, engine_config(attention_backend="torch", **cfg)).step(ids)
    engine = Engine(twin, engine_config(attention_backend="triton", **cfg))
    got = engine.step(ids)
    assert abs(got.loss - ref.loss) <= 1e-5 * ref.loss
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        err = ((a.grad - b.grad).norm() / a.grad.norm()).item()
        assert err <= 1e-5, f"{name}: rel err {err:.3e}"


def test_inverse_selection_lists_each_pages_blocks():
    case = make_case(20, 4, 2, 64, 64, 4, seed=9)
    sel, _ = _selection(case, 64, 4, 3, 1, 1, 3, "quest")
    offsets, blocks = tsa._inverse_selection(sel.page_idx, 16)
    nb, Hkv, _ = sel.page_idx.shape
    for h in range(Hkv):
        for p in range(16):
            want = [b for b in range(nb) if p in sel.page_idx[b, h].tolist()]
            got = blocks[offsets[h * 16 + p] : offsets[h * 16 + p + 1]].tolist()
            assert got == want, (h, p)
    assert int(offsets[-1]) == int(sel.counts.sum())


@pytest.mark.parametrize("Hq,Hkv,D", [(7, 1, 64), (4, 2, 64)])
def test_full_selection_equals_dense_kernels(Hq, Hkv, D):
    """Every past page selected (gather path, not the dense shortcut) == the dense kernels, GQA 7:1 and d=64."""
    C, past_len, S = 10, 40, 8
    case = make_case(C, Hq, Hkv, D, past_len, S, seed=Hq)
    _, sel = _selection(case, past_len, S, 5, 0, 0, 4, "mean")
    assert sel.dense and (sel.counts == 5).all()
    sel.dense = False  # the kernels do not look at the flag; the engine would have taken the dense path
    c = case
    out, lse = tsa.sparse_attention_fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], past_len, sel)
    out_d, lse_d = tpa.paged_attention_fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], past_len)
    assert_close("out", out, out_d)
    assert_close("lse", lse, lse_d)
    caches = [torch.zeros(c["k_cache"].shape, dtype=torch.float32, device=DEVICE) for _ in range(4)]
    got = tsa.sparse_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out, lse, c["k_cache"], c["v_cache"], c["block_table"],
                                   past_len, caches[0], caches[1], sel)
    ref = tpa.paged_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out_d, lse_d, c["k_cache"], c["v_cache"],
                                  c["block_table"], past_len, caches[2], caches[3])
    for name, g, r in zip(("dq", "dk", "dv", "dk_cache", "dv_cache"), got + tuple(caches[:2]), ref + tuple(caches[2:])):
        assert_close(name, g, r)


def test_streams_drained_before_the_first_tune_of_each_key(monkeypatch):
    """The dK/dV kernels' autotuning restores the whole pool it ran on; the first launch per autotune key waits for
    every stream first (a copy stream's prefetch into the pool would be undone), later launches do not."""
    calls = []
    monkeypatch.setattr(inputs.torch.cuda, "synchronize", lambda device=None: calls.append(device))
    monkeypatch.setattr(inputs, "_TUNE_KEYS_SEEN", set())

    class CudaQ:  # what the helper reads of q
        is_cuda, dtype, device = True, torch.bfloat16, "cuda:0"

    key = dict(G=7, HEAD_DIM=128, PAGE_SIZE=128, BLOCK_Q=128, HAS_DOC=False)
    for _ in range(3):
        tsa._drain_streams_before_first_tune("sparse_dkdv", CudaQ, key)
    assert calls == ["cuda:0"]
    tsa._drain_streams_before_first_tune("sparse_dkdv", CudaQ, dict(key, HAS_DOC=True))  # a new key tunes again
    tsa._drain_streams_before_first_tune("paged_dkdv5", CudaQ, key)  # another kernel
    assert len(calls) == 3
    tsa._drain_streams_before_first_tune("sparse_dkdv", torch.zeros(1), key)  # CPU: nothing to wait for
    assert len(calls) == 3


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (an output buffer from torch.empty may hold NaNs)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only: on a GPU the autotuner calls the hooks itself "
                    "(test_cuda_autotune_leaves_the_pools_as_one_launch)")
def test_autotune_hooks_restore_every_row_the_dkdv_kernels_write(monkeypatch):
    """Autotuning runs the dK/dV kernels (which add into the page pools) once per config and must leave the pools as
    they were. The hooks save only the rows a launch can write: around every real launch here (the interpreter),
    the kernel changes no row outside them, and pre_hook + kernel + post_hook gives the pools back bitwise."""
    seen = []
    for kern, restore in ((sparse_kernels._sparse_attn_bwd_dkdv_kernel["full"], sparse_kernels._DKDV_RESTORE),
                          (paged_bwd._paged_attn_bwd_dkdv5_kernel["full"], paged_bwd._DKDV5_RESTORE)):
        def run(*args, _orig=kern.run, _r=restore, **kw):
            before = [kw[n].clone() for n in _r.names]
            _r.pre_hook(kw)
            idx = _r.saved[0]
            out = _orig(*args, **kw)
            outside = torch.ones(before[0].shape[0], dtype=torch.bool, device=before[0].device)
            outside[idx if idx is not None else slice(None)] = False
            changed = False
            for n, b in zip(_r.names, before):
                assert torch.equal(kw[n][outside], b[outside]), (_r.names, "a row outside the saved ones changed")
                changed |= not torch.equal(kw[n], b)
            _r.post_hook(kw, exception=None)
            assert all(_same_bits(kw[n], b) for n, b in zip(_r.names, before)) and _r.saved is None
            seen.append((_r.names[0], changed, idx is None or idx.numel() < outside.numel()))
            return out

        monkeypatch.setattr(kern, "run", run)
    C, Hq, Hkv, D, past_len, S = 8, 4, 2, 32, 48, 8
    c = make_case(C, Hq, Hkv, D, past_len, S, seed=5, extra_pages=3)
    _, sel = _selection(c, past_len, S, 1, 1, 0, 4, "mean")  # 2 of 6 past pages per block and head
    out, lse = tsa.sparse_attention_fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], past_len, sel)
    base = torch.randn(c["k_cache"].shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    tsa.sparse_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out, lse, c["k_cache"], c["v_cache"], c["block_table"],
                             past_len, base.clone(), base.clone(), sel)
    out, lse = tpa.paged_attention_fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], past_len)
    tpa.paged_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out, lse, c["k_cache"], c["v_cache"], c["block_table"],
                            past_len, base.clone(), base.clone(), past_start=2 * S)
    names = [n for n, _, _ in seen]
    assert "dk_cache_ptr" in names and "dk_ptr" in names
    assert all(changed for _, changed, _ in seen)  # every launch wrote something (the check is not vacuous)
    assert any(n == "dk_cache_ptr" and fewer for n, _, fewer in seen)  # the sparse launch saved fewer rows than all
    assert any(n == "dk_ptr" and fewer for n, _, fewer in seen)  # the past launch from page 2 did too


@pytest.mark.cuda(reason="needs CUDA (several autotune configs, benchmarked)")
@pytest.mark.skipif(os.environ.get("OOMB_TEST_AUTOTUNE") == "first",
                    reason="OOMB_TEST_AUTOTUNE=first runs every kernel's first config: nothing is tuned")
def test_cuda_autotune_leaves_the_pools_as_one_launch(monkeypatch):
    """A first call that autotunes the dK/dV kernels (every config benchmarked on the real pools, the hooks saving and
    restoring the rows each run writes) leaves the pools exactly as a call that only launches the chosen config."""
    kerns = (sparse_kernels._sparse_attn_bwd_dkdv_kernel["full"], paged_bwd._paged_attn_bwd_dkdv5_kernel["full"])
    for kern in kerns:
        monkeypatch.setattr(kern, "cache", {})  # tune again, in this process ...
        monkeypatch.setattr(kern, "cache_results", False)  # ... and not from the disk cache
        monkeypatch.setattr(kern, "configs_timings", None, raising=False)
    C, Hq, Hkv, D, past_len, S = 256, 28, 4, 128, 2048, 128
    # bf16 q/K/V as in training (fp32 q prunes every kernel to its single fp32 tile: nothing to tune), fp32 dK/dV.
    c = make_case(C, Hq, Hkv, D, past_len, S, seed=5, extra_pages=3, dtype=torch.bfloat16)
    _, sel = _selection(c, past_len, S, 4, 1, 1, 128, "mean")
    out, lse = tsa.sparse_attention_fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], past_len, sel)
    out2, lse2 = tpa.paged_attention_fwd(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["block_table"], past_len)
    base = torch.randn(c["k_cache"].shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)  # fp32
    pools = []
    for _ in range(2):  # the first call tunes, the second only launches
        dk, dv, dk2, dv2 = (base.clone() for _ in range(4))
        tsa.sparse_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out, lse, c["k_cache"], c["v_cache"],
                                 c["block_table"], past_len, dk, dv, sel)
        tpa.paged_attention_bwd(c["dout"], c["q"], c["k"], c["v"], out2, lse2, c["k_cache"], c["v_cache"],
                                c["block_table"], past_len, dk2, dv2, past_start=2 * S)
        pools.append((dk, dv, dk2, dv2))
        if len(pools) == 1:
            assert all(kern.configs_timings and len(kern.configs_timings) > 1 for kern in kerns)  # it did tune
    torch.cuda.synchronize()
    assert all(_same_bits(a, b) for a, b in zip(*pools))
    assert not torch.equal(pools[0][0], base) and not torch.equal(pools[0][2], base)  # the launches did write
