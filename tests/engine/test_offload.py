"""Two-tier KV store: page placement, prefetch order, lifetimes, and bitwise-equal training with and without offload.

On CPU the host tier is simulated (plain CPU tensors, synchronous copies) with the same schedule as on CUDA.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from oomb import Engine, OOMBConfig
from oomb.config import KernelConfig, OffloadConfig, SparseConfig
from configs import engine_config
from oomb.engine.kv_store import PagedKVStore
from oomb import memory
from oomb.engine.offload import OffloadedKVStore, head_tiles, layout, segmented, store as store_mod, uses, whole_layer
from oomb.memory import ModelShape, min_gpu_pages, offload_traffic, resident_pages_for_budget
from test_engine import VOCAB, clone_model, run_parity, tiny


def _store_options(monkeypatch, **options):
    """Engines build their offloaded stores with these keyword options on top of what their config passes (options
    no config field sets, such as ``stage1_shadow_partial``, or ``staging_sets`` for dense whole-layer staging)."""
    init = OffloadedKVStore.__init__
    monkeypatch.setattr(OffloadedKVStore, "__init__", lambda self, *a, **k: init(self, *a, **{**k, **options}))


def _step(model, ids, trace=False, **cfg):
    cfg.setdefault("attention_backend", "torch")
    engine = Engine(model, engine_config(**cfg))
    if trace:
        orig = engine._ensure_store

        def ensure(T):
            store = orig(T)
            if isinstance(store, OffloadedKVStore) and store.trace is None:
                store.trace = []
            return store

        engine._ensure_store = ensure
    out = engine.step(ids)
    return out, engine


def _assert_same_training(m_ref, m_off, out_ref, out_off):
    assert out_ref.loss == out_off.loss, (out_ref.loss, out_off.loss)
    for (name, a), (_, b) in zip(m_ref.named_parameters(), m_off.named_parameters()):
        assert torch.equal(a.grad, b.grad), f"{name}: max diff {(a.grad - b.grad).abs().max().item():.3e}"


CASES = [
    # family, heads, kv_heads, layers, T, chunk, page, budget, checkpoint, dtype
    ("qwen2", 4, 2, 3, 45, 8, 4, None, True, torch.float32),  # every page in the host tier, odd L, recompute views
    ("llama", 7, 1, 4, 50, 12, 4, 40, False, torch.bfloat16),  # partly resident (R = 3 of 13), GQA 7:1, bf16
    ("qwen3", 4, 2, 5, 37, 8, 4, 30, True, torch.float32),  # R = 2 of 10, q/k norms, partial last page
    ("qwen2", 4, 2, 4, 33, 16, 8, None, False, torch.float64),  # chunk = 2 pages, last chunk of 1 token
]


@pytest.mark.parametrize("family,heads,kv_heads,layers,T,chunk,page,budget,ckpt,dtype", CASES)
def test_offload_trains_bitwise_like_all_on_device(family, heads, kv_heads, layers, T, chunk, page, budget, ckpt, dtype):
    torch.manual_seed(0)
    m_ref = tiny(family, heads, kv_heads, layers=layers).to(dtype)
    m_off = clone_model(m_ref)
    ids = torch.randint(0, VOCAB, (1, T))
    common = dict(chunk_size=chunk, page_size=page, checkpoint_layers=ckpt)
    out_ref, e_ref = _step(m_ref, ids, offload=False, **common)
    out_off, e_off = _step(m_off, ids, offload=True, gpu_page_budget=budget, **common)
    assert isinstance(e_ref.kv_store, PagedKVStore) and isinstance(e_off.kv_store, OffloadedKVStore)
    store = e_off.kv_store
    assert store.staging_pages > 0 and store.stats["h2d_bytes"] > 0 and store.stats["d2h_bytes"] > 0
    _assert_same_training(m_ref, m_off, out_ref, out_off)
    # The planner predicts exactly what was copied.
    pred = offload_traffic(ModelShape.from_config(m_off.config), T, chunk, page, store.resident_pages_per_layer, dtype,
                           segment_pages=store.segment_pages, checkpoint_layers=ckpt,
                           stage1_shadow_pages=store.stage1_shadow_pages)
    assert (store.stats["h2d_bytes"], store.stats["d2h_bytes"]) == (pred["h2d_bytes"], pred["d2h_bytes"])
    # Every stage-in was issued ahead of its use (the previous layer's compute), none at the point of use.
    assert store.stats["on_demand"] == 0, store.stats
    assert store.num_free_pages == store.num_pages


def test_offload_matches_full_sequence_training_fp64():
    out, ref_loss, (err, where), engine = run_parity(tiny("qwen2", 4, 2, layers=3), 41, 8, 4, offload=True, gpu_page_budget=24)
    assert isinstance(engine.kv_store, OffloadedKVStore) and engine.kv_store.resident_pages_per_layer == 2
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"


@pytest.mark.parametrize("budget,segment_pages,ckpt", [(24, None, False), (24, 1, True), (None, 2, False)])
def test_offloaded_dense_through_sdpa_matches_full_sequence_fp64(monkeypatch, budget, segment_pages, ckpt):
    """The 'sdpa' backend runs each staged segment as cuDNN-style calls over its contiguous runs (the resident pages
    and the staging buffer; the CPU flash kernel here): full-sequence gradients to fp64 rounding, every call with a
    past went through it, and segment 0 came in two runs where pages are resident."""
    import oomb.ops.sdpa_attention as sa

    runs = []
    bwd = sa.sdpa_attention_bwd
    monkeypatch.setattr(sa, "sdpa_attention_bwd", lambda *a, **k: (runs.append(len(a[6])), bwd(*a, **k))[1])
    out, ref_loss, (err, where), engine = run_parity(
        tiny("qwen2", 4, 2, layers=3), 41, 8, 4, offload=True, gpu_page_budget=budget, offload_segment_pages=segment_pages,
        checkpoint_layers=ckpt, attention_backend="sdpa", shuffle_pages=False)
    store = engine.kv_store
    assert isinstance(store, OffloadedKVStore) and store.segmented and store.stats["h2d_bytes"] > 0
    assert abs(out.loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert err <= 1e-10, f"worst gradient {where}: rel err {err:.3e}"
    n_chunks, layers = -(-41 // 8), 3
    assert sum(1 for r in runs if r) >= (n_chunks - 1) * layers  # at least one call per (chunk with a past, layer)
    assert (2 in runs) == (store.resident_pages_per_layer > 0)  # segment 0: resident pages, then the buffer


def test_packed_documents_and_two_steps_reuse_the_store():
    torch.manual_seed(5)
    m_ref = tiny("llama", 4, 2, layers=3).double()
    m_off = clone_model(m_ref)
    ids = torch.randint(0, VOCAB, (1, 34))
    cu = torch.tensor([0, 13, 14, 31, 34])
    cfg = dict(chunk_size=8, page_size=4, attention_backend="torch")
    e_ref = Engine(m_ref, engine_config(offload=False, **cfg))
    e_off = Engine(m_off, engine_config(offload=True, **cfg))
    for _ in range(2):
        out_ref = e_ref.step(ids, cu_seqlens=cu)
        out_off = e_off.step(ids, cu_seqlens=cu)
    store = e_off.kv_store
    _assert_same_training(m_ref, m_off, out_ref, out_off)
    assert e_off.evaluate(ids, cu_seqlens=cu) == e_ref.evaluate(ids, cu_seqlens=cu)
    assert e_off.kv_store is store  # reused, not reallocated


class _LazyStreams:
    """Two copy streams (host->device, device->host) that run their copies as LATE as the events allow (on CPU).

    Copies are queued per stream; they run only when something waits on an event recorded after
    them: the compute stream (``compute_wait``), the other copy stream (a queued wait, run when the
    copies behind it run), or ``synchronize``. Compute is immediate. So a missing compute-side wait
    makes the compute read a staging slot (or overwrite a write buffer) before the copy ran, and a
    missing wait between the two copy streams lets a host->device copy read host pages (or
    overwrite a buffer) before the device->host copy ordered before it ran: wrong numbers.
    """

    asynchronous = True

    class _Event:
        def __init__(self):
            self.stream, self.pos = None, 0  # stream None: a compute event (compute is immediate)

    def __init__(self):
        self.queues = {"h2d": [], "d2h": []}
        self.done = {"h2d": 0, "d2h": 0}
        self.max_queued, self.skip_compute_waits, self.skip_copy_waits = 0, False, False

    def event(self):
        return self._Event()

    def record_compute(self):
        return self._Event()

    def compute_wait(self, ev):
        if not self.skip_compute_waits:
            self._run_event(ev)

    def _wait(self, name, ev):
        if ev.stream is not None and ev.stream != name and not self.skip_copy_waits:
            target = (ev.stream, ev.pos)
            self._push(name, lambda: self._run_until(*target))

    def copy_wait(self, ev):
        self._wait("h2d", ev)

    def d2h_wait(self, ev):
        self._wait("d2h", ev)

    def _record(self, name, ev):
        ev.stream, ev.pos = name, self.done[name] + len(self.queues[name])

    def record_copy(self, ev):
        self._record("h2d", ev)

    def record_d2h(self, ev):
        self._record("d2h", ev)

    eager_d2h = False  # run device->host work as soon as it is enqueued (after its waits): another legal schedule

    def _push(self, name, fn):
        self.queues[name].append(fn)
        self.max_queued = max(self.max_queued, sum(len(q) for q in self.queues.values()))
        if name == "d2h" and self.eager_d2h:
            self._run_until("d2h", self.done["d2h"] + len(self.queues["d2h"]))

    def copy_(self, dst, src):
        self._push("h2d", functools.partial(dst.copy_, src))

    def zero_(self, dst):
        self._push("h2d", dst.zero_)

    def d2h_copy_(self, dst, src):
        self._push("d2h", functools.partial(dst.copy_, src))

    def h2d_run(self, fn):
        self._push("h2d", fn)

    def h2d_alloc(self, fn):
        fn()

    def h2d_keep(self, *tensors):
        pass

    def d2h_run(self, fn, *tensors):
        self._push("d2h", fn)

    def synchronize(self):
        for name in self.queues:
            self._run_until(name, self.done[name] + len(self.queues[name]))

    def _run_event(self, ev):
        if ev.stream is not None:
            self._run_until(ev.stream, ev.pos)

    def _run_until(self, name, pos):
        q = self.queues[name]
        while self.done[name] < pos:
            fn = q.pop(0)
            self.done[name] += 1
            fn()


def test_event_ordering_with_a_lazy_copy_stream(monkeypatch):
    """Every read of staged pages waits for the copy that staged them (copies deferred as long as allowed).

    With per-layer checkpointing both wait points are exercised: the views (forward, recompute) and
    the readying of the next layer's backward in after_backward."""
    streams = []
    monkeypatch.setattr(store_mod, "_make_streams", lambda device, copy_streams: streams.append(_LazyStreams()) or streams[-1])
    torch.manual_seed(1)
    m_ref = tiny("qwen2", 4, 2, layers=4)
    m_off = clone_model(m_ref)
    ids = torch.randint(0, VOCAB, (1, 44))
    common = dict(chunk_size=8, page_size=4, checkpoint_layers=True)
    out_ref, _ = _step(m_ref, ids, offload=False, **common)
    out_off, e_off = _step(m_off, ids, offload=True, gpu_page_budget=2 * 11 + 2 * 2, **common)
    assert e_off.kv_store._wbuf_k is not None and streams[0].max_queued >= 4  # copies really were deferred
    _assert_same_training(m_ref, m_off, out_ref, out_off)


def test_lazy_stream_control_detects_a_missing_wait(monkeypatch):
    """The simulator has teeth: the same schedule without the compute-side waits reads stale pages."""
    streams = []

    def make(device, copy_streams):
        streams.append(_LazyStreams())
        streams[-1].skip_compute_waits = True
        return streams[-1]

    monkeypatch.setattr(store_mod, "_make_streams", make)
    torch.manual_seed(1)
    m_ref = tiny("qwen2", 4, 2, layers=4)
    m_bad = clone_model(m_ref)
    ids = torch.randint(0, VOCAB, (1, 44))
    out_ref, _ = _step(m_ref, ids, offload=False, chunk_size=8, page_size=4)
    out_bad, _ = _step(m_bad, ids, offload=True, chunk_size=8, page_size=4)
    assert out_bad.loss != out_ref.loss


# ------------------------------------------------------------------ placement
def test_resident_pages_for_budget():
    L, n = 28, 1000
    assert min_gpu_pages(L, n) == 2 * n
    assert resident_pages_for_budget(L, n, 2 * n) == 0
    assert resident_pages_for_budget(L, n, 2 * n + 26 * 7 + 25) == 7
    assert resident_pages_for_budget(L, n, L * n) == n
    assert resident_pages_for_budget(L, n, 10**9) == n
    with pytest.raises(ValueError, match="below the 2,000 pages offload needs"):
        resident_pages_for_budget(L, n, 1999)
    assert resident_pages_for_budget(2, n, 2 * n) == n  # two layers: staging costs as much as residency


@pytest.mark.parametrize("segment_pages,R,W", [("layer", 3, 7), (2, 5, 2), (1, 6, 1)])
def test_page_placement_and_staged_views_read_the_written_pages(segment_pages, R, W):
    L, Hkv, D, S, C, T = 4, 2, 3, 4, 8, 40
    store = OffloadedKVStore(L, Hkv, D, S, T, torch.float32, "cpu", chunk_size=C, gpu_pages=2 * 10 + 2 * 3, trace=True,
                             segment_pages=segment_pages)
    n = 10
    assert (store.resident_pages_per_layer, store.staging_pages) == (R, W)
    assert store.gpu_pool_pages == L * R + 2 * W and store.k_cache.shape[0] == store.gpu_pool_pages
    assert store.k_host.shape == (L, n - R, S, Hkv, D)
    assert store.page_location(2, 1) == ("gpu", 2 * R + 1) and store.page_location(2, 7) == ("host", 7 - R)
    store.begin_step(T)
    g = torch.Generator().manual_seed(0)
    written = {}

    def written_v(layer, start):
        return torch.cat([written[(layer, s)][1] for s in range(0, start, C)]) if start else torch.empty(0, Hkv, D)
    for start in range(0, T - C, C):  # Stage 1 of a 40-token sequence: chunks 0..3
        for layer in range(L):
            kv = store.attention_view(layer, 1, start, C, False)
            past = torch.cat([written[(layer, s)][0] for s in range(0, start, C)]) if start else torch.empty(0, Hkv, D)
            if segment_pages == "layer":
                # The view's past pages, gathered through its block table, are exactly the tokens written before.
                got = kv.k_cache[kv.block_table.long()].flatten(0, 1)[:start]  # (Stage 1 may read the shadow)
                assert torch.equal(got, past), (layer, start)
            k, v = torch.randn(C, Hkv, D, generator=g), torch.randn(C, Hkv, D, generator=g)
            store.write(layer, start, k, v)
            written[(layer, start)] = (k, v)
            if segment_pages != "layer":
                # Each segment, gathered through the table its acquire returns, holds exactly its tokens.
                segs = kv.segments
                assert kv.block_table is None and (not segs.bounds or segs.bounds[-1][1] == start)
                for i, (a, b) in enumerate(segs.bounds):
                    kc, vc, bt, dkc, dvc = segs.acquire(i, False)
                    assert dkc is None and dvc is None
                    got = kc[bt[a // S : -(-b // S)].long()].flatten(0, 1)
                    assert torch.equal(got, past[a:b]), (layer, start, i)
                    # The same tokens as contiguous views of the pool (the 'sdpa' backend's runs).
                    runs, grads = segs.runs(i, False)
                    assert grads == () and len(runs) == 1 + (i == 0 and a < R * S < b)
                    assert all(rk.untyped_storage().data_ptr() == kc.untyped_storage().data_ptr() for rk, _ in runs)
                    assert torch.equal(torch.cat([rk for rk, _ in runs]), past[a:b]), (layer, start, i)
                    assert torch.equal(torch.cat([rv for _, rv in runs]), written_v(layer, start)[a:b])
                    segs.release(i, False)
                assert all(hi - lo == W * S for lo, hi in segs.bounds[1:-1])  # full segments but the last
                assert not segs.bounds or segs.bounds[0][1] == min(start, (R + W) * S)  # resident prefix + one segment
            store.after_attention_forward(layer, 1)
    for (layer, start), (k, v) in written.items():
        for j in range(C // S):
            p = start // S + j
            tier, idx = store.page_location(layer, p)
            pool = store.k_cache[idx] if tier == "gpu" else store.k_host[layer, idx]
            assert torch.equal(pool, k[j * S : (j + 1) * S]), (layer, p)
    assert [store.num_layer_pages(l) for l in range(L)] == [8] * L
    assert store.num_free_pages == L * n - L * 8
    assert store.stats["on_demand"] == 0


def _schedule(trace):
    """(kind, layer, start, grad) of each view and each staging, in issue order."""
    out = []
    for t in trace:
        if t[0] == "view":
            out.append(("view", t[2], t[3], t[1]))
        elif t[0] == "stage":
            out.append(("stage", t[2], t[3], t[5] is not None))
    return out


@pytest.fixture
def whole_layer_staging(monkeypatch):
    """Engines in this test stage whole layers (segment_pages='layer', what sparse attention uses)."""
    monkeypatch.setattr(Engine, "_segment_pages", lambda self: "layer")


@pytest.mark.parametrize("shadow", [True, False])
@pytest.mark.parametrize("ckpt", [False, True])
def test_prefetch_order(ckpt, shadow, whole_layer_staging, monkeypatch):
    """Whole-layer staging: each use's pages are staged one use ahead: while the previous layer computes, never
    at the point of use."""
    torch.manual_seed(0)
    L, C, S, T = 4, 8, 4, 32
    # with the shadow (partial by default): 4 of the 8 host pages per layer
    _, engine = _step(tiny("qwen2", layers=L), torch.randint(0, VOCAB, (1, T)), trace=True, chunk_size=C, page_size=S,
                      offload=True, checkpoint_layers=ckpt, offload_stage1_shadow=shadow)
    store = engine.kv_store
    assert store.stage1_shadow_pages == (4 if shadow else 0)  # 16 fp32 pool pages hold 4 K/V pages per layer
    sched = _schedule(store.trace)
    stages = [(l, s, g) for k, l, s, g in sched if k == "stage"]
    # Stage 1: chunks 1 and 2 read a past, layer by layer (K/V only; none with the shadow, which holds every
    # host page here); then layer 0 of the first Stage-2 chunk.
    expect = [] if shadow else [(l, s, False) for s in (8, 16) for l in range(L)]
    expect += [(0, 24, False)]
    # Stage 2, chunk at s: K/V of layers 1..L-2, K/V + dK/dV of the top layer (its backward follows its
    # forward), the backward of layers L-2..0, then layer 0 of the chunk before. Chunk 0 has no past:
    # only its own stored dK/dV pages are staged.
    for s in (24, 16, 8, 0):
        expect += [(l, s, False) for l in range(1, L - 1) if s]
        expect += [(L - 1, s, True)] + [(l, s, True) for l in range(L - 2, -1, -1)]
        expect += [(0, s - C, False)] if s - C > 0 else []
    assert stages == expect, stages
    # Where each staging is issued: a forward use of layer l right after the view of layer l-1 (so it
    # overlaps layer l-1's attention); the backward of layer l one backward ahead (after the top layer's
    # view, or with per-layer checkpointing after the recompute view of layer l+2).
    last_view = None
    for kind, layer, start, grad in sched:
        if kind == "view":
            last_view = (layer, start)
        elif not grad and layer >= 1:
            assert last_view == (layer - 1, start), (layer, start, last_view)
        elif grad and layer == L - 1:
            assert last_view == (L - 2, start), (layer, start, last_view)
        elif grad:
            # issued when the backward of layer l+2 ends, i.e. one use (layer l+1's backward) ahead
            assert last_view == ((layer + 2, start) if ckpt and layer < L - 2 else (L - 1, start)), (layer, start, last_view)
    assert engine.kv_store.stats["on_demand"] == 0


@pytest.mark.parametrize("segment_pages", ["layer", None, 1])
def test_pages_released_as_stage2_passes_their_chunk(segment_pages, monkeypatch):
    if segment_pages == "layer":
        monkeypatch.setattr(Engine, "_segment_pages", lambda self: "layer")
    torch.manual_seed(0)
    L, C, S, T = 3, 8, 4, 30
    model = tiny("qwen2", layers=L)
    engine = Engine(model, OOMBConfig(chunk_size=C, page_size=S, attention_backend="torch", offload=OffloadConfig(mode="on", segment_pages=None if segment_pages == "layer" else segment_pages)))
    seen = []
    orig = OffloadedKVStore.release_from

    def release(self, layer, start):
        seen.append((layer, start, self.num_layer_pages(layer), self.grad_written_pages(layer)))
        orig(self, layer, start)
        assert self.num_layer_pages(layer) == start // S

    OffloadedKVStore.release_from = release
    try:
        engine.step(torch.randint(0, VOCAB, (1, T)))
    finally:
        OffloadedKVStore.release_from = orig
    # Chunks 2, 1, 0 (chunk 3 is the last: never stored) are released in that order, every layer.
    assert [(l, s) for l, s, _, _ in seen] == [(l, s) for s in (16, 8, 0) for l in range(L)]
    # When chunk c is released, the layer holds chunks 0..c and every stored gradient page of its
    # past was written back to the host by the backward of chunk c+1.
    for layer, start, pages, valid in seen:
        assert pages == start // S + C // S and valid >= start // S
    store = engine.kv_store
    assert store.num_free_pages == store.num_pages
    # The first Stage-2 chunk found no written-back gradients: its dK/dV pages were zero-filled on the device.
    assert all(store.grad_written_pages(layer) == 0 for layer in range(L))


def test_bad_budget_and_config():
    model = tiny("qwen2", layers=3)
    engine = Engine(model, OOMBConfig(chunk_size=8, page_size=4, attention_backend="torch", offload=OffloadConfig(gpu_page_budget=5)))
    with pytest.raises(ValueError, match="gpu_page_budget 5 pages is below the 16 pages offload needs"):
        engine.step(torch.randint(0, VOCAB, (1, 30)))
    with pytest.raises(ValueError, match="mode is 'yes'; pass one of 'auto', 'on', 'off'"):
        OOMBConfig(offload=OffloadConfig(mode="yes"))
    with pytest.raises(ValueError, match="gpu_page_budget is 0; pass a positive number of pages"):
        OOMBConfig(offload=OffloadConfig(gpu_page_budget=0))
    with pytest.raises(ValueError, match="gpu_page_budget sizes the GPU tier of offload but mode is off"):
        OOMBConfig(offload=OffloadConfig(mode="off", gpu_page_budget=100))
    assert OffloadConfig(mode=True).mode == "on" and OffloadConfig(mode=False).mode == "off"  # the Python spellings


def test_auto_on_cpu_keeps_every_page_on_the_device():
    engine = Engine(tiny("qwen2", layers=3), engine_config(chunk_size=8, page_size=4, attention_backend="torch"))
    engine.step(torch.randint(0, VOCAB, (1, 20)))
    assert type(engine.kv_store) is PagedKVStore


@pytest.mark.cuda(reason="needs CUDA (side stream, pinned host memory)")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_cuda_offload_bitwise_like_all_on_device(ckpt, backend):
    from oomb.ops.paged_attention import _triton_available

    if backend == "triton" and not _triton_available():
        pytest.skip("triton kernels not importable")
    torch.manual_seed(0)
    m_ref = tiny("qwen2", 4, 2, layers=5, head_dim=16).to("cuda", torch.bfloat16)
    m_off = clone_model(m_ref).to("cuda")
    ids = torch.randint(0, VOCAB, (1, 300), device="cuda")
    common = dict(chunk_size=32, page_size=16, checkpoint_layers=ckpt, attention_backend=backend)
    out_ref, _ = _step(m_ref, ids, offload=False, **common)
    out_off, e_off = _step(m_off, ids, offload=True, gpu_page_budget=2 * 19 + 3 * 4, **common)
    store = e_off.kv_store
    assert store.k_host.is_pinned() and store.resident_pages_per_layer == 4 and store.stats["on_demand"] == 0
    _assert_same_training(m_ref, m_off, out_ref, out_off)


# ------------------------------------------------------------------ segmented staging (issue 4)
def _assert_close_training(m_ref, m_off, out_ref, out_off, tol=1e-12):
    """Loss and EVERY parameter gradient within ``tol`` (relative, per parameter: max |diff| / max |ref|)."""
    assert abs(out_ref.loss - out_off.loss) <= tol * abs(out_ref.loss), (out_ref.loss, out_off.loss)
    for (name, a), (_, b) in zip(m_ref.named_parameters(), m_off.named_parameters()):
        err = ((a.grad - b.grad).abs().max() / a.grad.abs().max().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: relative error {err:.3e}"


def _lazy(monkeypatch):
    """Lazy simulated side stream; host pages and GPU pool start as NaN, so a read of a page never written
    (or a staged gradient never zero-filled) shows."""
    streams = []
    monkeypatch.setattr(store_mod, "_make_streams", lambda device, copy_streams: streams.append(_LazyStreams()) or streams[-1])
    monkeypatch.setattr(OffloadedKVStore, "_host_empty", lambda self, shape, dtype: torch.full(shape, float("nan"), dtype=dtype))
    orig_empty = torch.empty

    def nan_empty(*shape, dtype=None, device=None, **kw):
        t = orig_empty(*shape, dtype=dtype, device=device, **kw)
        if dtype == torch.uint8:  # the pools (K and dK share one byte allocation): 0xFF reads as NaN in bf16/fp32/fp64
            return t.fill_(255)
        if t.is_floating_point():
            return t.fill_(float("nan"))
        # Tile lists and counts (int32) read before they are made would list no tile at all.
        return t.fill_(-7) if t.dtype == torch.int32 else t

    for mod in (store_mod, layout, head_tiles, whole_layer, segmented):  # every module of the store that allocates
        monkeypatch.setattr(mod, "torch", _TorchWith(empty=nan_empty))
    return streams


class _TorchWith:
    """``torch`` with some attributes replaced (poisons what offload.py allocates)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)

    def __getattr__(self, name):
        return getattr(torch, name)


SEGMENT_CASES = [
    # family, heads, kv_heads, layers, T, chunk, page, segment pages, GPU budget, checkpoint
    # (checkpoint: False, True = checkpoint_attention 'keep', or 'recompute')
    ("qwen2", 4, 2, 3, 45, 8, 4, 1, None, False),  # one-page segments, every page in the host tier
    ("qwen2", 4, 2, 3, 45, 8, 4, 1, None, True),
    ("qwen2", 4, 2, 3, 45, 8, 4, 1, None, "recompute"),
    ("qwen2", 4, 2, 4, 50, 12, 4, 3, None, True),  # segment boundaries not aligned to chunks (3 pages vs 3)
    ("qwen2", 4, 2, 4, 50, 12, 4, 3, None, "recompute"),
    ("llama", 7, 1, 4, 50, 12, 4, 2, 3 * 4 + 2 * 2, False),  # GQA 7:1, R = 3 resident pages + 2-page segments
    ("qwen3", 4, 2, 5, 37, 8, 4, 3, 2 * 5 + 2 * 3, True),  # R = 2, partial last page, q/k norms
    ("qwen2", 4, 2, 3, 41, 8, 4, 64, None, True),  # a segment larger than the whole past: one segment
    ("qwen2", 4, 2, 3, 41, 8, 4, 64, 2 * 3 + 2 * 9, False),  # R = 2 + one segment
]


@pytest.mark.parametrize("family,heads,kv_heads,layers,T,chunk,page,sp,budget,ckpt",
                         [SEGMENT_CASES[0], SEGMENT_CASES[5], SEGMENT_CASES[6]])
def test_segmented_offload_through_sdpa_waits_for_its_copies(family, heads, kv_heads, layers, T, chunk, page, sp,
                                                             budget, ckpt, monkeypatch):
    """The 'sdpa' backend's contiguous views of a staged segment are read only after the copies into them ran
    (lazy side stream, pools and host pages poisoned with NaN): the all-on-device step's loss and gradients
    (the torch reference attention there) to fp64 rounding."""
    _lazy(monkeypatch)
    torch.manual_seed(0)
    m_ref = tiny(family, heads, kv_heads, layers=layers).double()
    m_off = clone_model(m_ref)
    ids = torch.randint(0, VOCAB, (1, T))
    common = dict(chunk_size=chunk, page_size=page, checkpoint_layers=bool(ckpt))
    out_ref, _ = _step(m_ref, ids, offload=False, **common)
    out_off, e_off = _step(m_off, ids, offload=True, gpu_page_budget=budget, offload_segment_pages=sp,
                           attention_backend="sdpa", **common)
    assert e_off.kv_store.segmented and e_off.kv_store.stats["on_demand"] == 0
    _assert_close_training(m_ref, m_off, out_ref, out_off, tol=1e-11)


@pytest.mark.parametrize("family,heads,kv_heads,layers,T,chunk,page,sp,budget,ckpt", SEGMENT_CASES)
def test_segmented_offload_trains_like_all_on_device(family, heads, kv_heads, layers, T, chunk, page, sp, budget, ckpt,
                                                     monkeypatch):
    """Offload with the past staged in segments (lazy side stream: copies run as late as the events allow)
    gives the losses and every gradient of the all-on-device run: bitwise with one segment, else fp64 to 1e-12.
    The planner predicts the copied bytes exactly; every staging is issued ahead of its use. With save_attention
    the Stage-2 forwards read no past (fewer bytes staged, still none on demand) and the step is bitwise the
    offloaded step without it; with several segments per call it stages fewer bytes. The rerun of a checkpointed
    layer reads no past when it keeps the attention outputs (checkpoint_attention 'keep')."""
    streams = _lazy(monkeypatch)
    torch.manual_seed(0)
    m_ref = tiny(family, heads, kv_heads, layers=layers).double()
    ids = torch.randint(0, VOCAB, (1, T))
    common = dict(chunk_size=chunk, page_size=page, checkpoint_layers=bool(ckpt))
    if ckpt == "recompute":
        common["checkpoint_attention"] = "recompute"
    out_ref, _ = _step(m_ref, ids, offload=False, **common)
    max_past = (T - 1) // chunk * chunk // page
    runs = {}
    for save in ("off", "host"):  # the offloaded step without save_attention is the reference of the one with it
        m_off = clone_model(m_ref)
        out_off, e_off = _step(m_off, ids, offload=True, gpu_page_budget=budget, offload_segment_pages=sp,
                               save_attention=save, **common)
        runs[save] = (m_off, out_off, e_off)
        store = e_off.kv_store
        R, n = store.resident_pages_per_layer, store.max_pages_per_layer
        if save != "off":
            m_nosave, out_nosave, e_nosave = runs["off"]
            assert e_off._saved_keep is not None
            _assert_same_training(m_nosave, m_off, out_nosave, out_off)
            if max_past - R > sp:
                # Several segments per call: the Stage-2 forwards' staging is gone. (With one segment a recomputing
                # forward reuses the previous chunk's buffers, which the saved order, backwards only, cannot.)
                assert store.stats["h2d_bytes"] < e_nosave.kv_store.stats["h2d_bytes"]
        assert store.segmented and store.staging_pages == min(sp, n - R) and streams[-1].max_queued >= 2
        if max_past - R <= sp:  # one segment per call: the very same kernel calls
            _assert_same_training(m_ref, m_off, out_ref, out_off)
        else:
            _assert_close_training(m_ref, m_off, out_ref, out_off)
        pred = offload_traffic(ModelShape.from_config(m_off.config), T, chunk, page, R, torch.float64,
                               segment_pages=sp, checkpoint_layers=e_off.config.reruns_attention,
                               saved_attention=save != "off")
        assert (store.stats["h2d_bytes"], store.stats["d2h_bytes"]) == (pred["h2d_bytes"], pred["d2h_bytes"])
        if ckpt is True and save == "off":  # the same step with the attention rerun stages more
            m_rerun = clone_model(m_ref)
            out_rerun, e_rerun = _step(m_rerun, ids, offload=True, gpu_page_budget=budget, offload_segment_pages=sp,
                                       checkpoint_attention="recompute", **common)
            _assert_same_training(m_rerun, m_off, out_rerun, out_off)
            rerun_bytes = e_rerun.kv_store.stats["h2d_bytes"]
            # With up to two segments per call the rerun finds them still staged (two buffers); with more it stages
            # again.
            if max_past - R > 2 * sp:
                assert store.stats["h2d_bytes"] < rerun_bytes
            else:
                assert store.stats["h2d_bytes"] == rerun_bytes
        assert store.stats["on_demand"] == 0, store.stats
        assert store.num_free_pages == store.num_pages


@pytest.mark.parametrize("sp", [1, 3])
def test_segmented_packed_documents_evaluate_and_two_steps(sp, monkeypatch):
    """Packed documents with segments (one fully masked for some queries), two steps on one store, evaluate."""
    _lazy(monkeypatch)
    torch.manual_seed(5)
    m_ref = tiny("llama", 4, 2, layers=3).double()
    m_off = clone_model(m_ref)
    ids = torch.randint(0, VOCAB, (1, 42))
    cu = torch.tensor([0, 13, 14, 31, 42])  # documents start mid-page; a one-token document
    cfg = dict(chunk_size=8, page_size=4, attention_backend="torch")
    e_ref = Engine(m_ref, engine_config(offload=False, **cfg))
    e_off = Engine(m_off, engine_config(offload=True, offload_segment_pages=sp, **cfg))
    for _ in range(2):
        out_ref = e_ref.step(ids, cu_seqlens=cu)
        out_off = e_off.step(ids, cu_seqlens=cu)
    store = e_off.kv_store
    _assert_close_training(m_ref, m_off, out_ref, out_off)
    ev_ref, ev_off = e_ref.evaluate(ids, cu_seqlens=cu), e_off.evaluate(ids, cu_seqlens=cu)
    assert abs(ev_ref - ev_off) <= 1e-12 * ev_ref
    assert e_off.kv_store is store and store.staging_pages == sp


def test_lazy_stream_catches_a_missing_segment_wait(monkeypatch):
    """The simulator has teeth for segments: without the compute-side wait before a staged segment (or own
    gradient) is read, the same schedule reads stale pages; with it, the numbers are right."""
    torch.manual_seed(1)
    m_ref = tiny("qwen2", 4, 2, layers=4).double()
    ids = torch.randint(0, VOCAB, (1, 44))
    common = dict(chunk_size=8, page_size=4, offload_segment_pages=2)
    out_ref, _ = _step(clone_model(m_ref), ids, offload=False, chunk_size=8, page_size=4)
    _lazy(monkeypatch)
    out_ok, _ = _step(clone_model(m_ref), ids, offload=True, **common)
    assert abs(out_ok.loss - out_ref.loss) <= 1e-12 * out_ref.loss
    monkeypatch.setattr(OffloadedKVStore, "_wait_segment", lambda self, ev: None)
    out_bad, _ = _step(clone_model(m_ref), ids, offload=True, **common)
    assert not abs(out_bad.loss - out_ref.loss) <= 1e-6  # wrong, or NaN from a never-written (NaN-filled) page


def _store_gpu_bytes(T, segment_pages, budget=None):
    """A Qwen2.5-7B-shaped store whose tensors have shapes but no storage (meta), so 512K tokens fit on CPU."""
    orig = OffloadedKVStore._host_empty
    OffloadedKVStore._host_empty = lambda self, shape, dtype: torch.empty(shape, dtype=dtype, device="meta")
    try:
        store = OffloadedKVStore(28, 4, 128, 128, T, torch.bfloat16, "meta", chunk_size=4096, gpu_pages=budget,
                                 segment_pages=segment_pages)
    finally:
        OffloadedKVStore._host_empty = orig
    store._wbuf_k = torch.empty(2, 32, 128, 4, 128, dtype=torch.bfloat16, device="meta")  # as on CUDA
    store._wbuf_v = torch.empty_like(store._wbuf_k)
    return store


def test_gpu_bytes_flat_in_context_length():
    """Qwen2.5-7B-shaped store (28 layers, 4 KV heads, head dim 128, bf16, page 128, chunk 4096): with
    segmented staging the GPU bytes of every page buffer are identical at 64K, 128K, 256K and 512K tokens (only
    the int32 tables grow, 4 bytes per page); whole-layer staging grows by 2 layers' pages per token."""
    lengths = [65536, 131072, 262144, 524288]
    seg = [_store_gpu_bytes(T, "auto") for T in lengths]
    assert len({s.nbytes for s in seg}) == 1, [s.nbytes for s in seg]
    for s, T in zip(seg, lengths):
        assert s.staging_pages == 256 and s.resident_pages_per_layer == 0
        assert s.index_nbytes <= 4 * (T // 128 + s.gpu_pool_pages) + 4 * 2 * 28 * 256
    # The fixed part: 2 segments x 256 pages x (K, V bf16 + dK, dV fp32) + 2 own-gradient chunks + 2 write chunks.
    page = 128 * 4 * 128
    assert seg[0].nbytes == 2 * 256 * page * (2 + 2 + 4 + 4) + 2 * 32 * page * (4 + 4) + 2 * 32 * page * (2 + 2)
    per_10k = (seg[-1].index_nbytes - seg[0].index_nbytes) / ((lengths[-1] - lengths[0]) / 10_000)
    assert per_10k < 400  # bytes per 10K tokens (~312: one int32 per page of 128 tokens)
    whole = [_store_gpu_bytes(T, "layer") for T in lengths[:2]]
    slope = (whole[1].nbytes - whole[0].nbytes) / ((lengths[1] - lengths[0]) / 10_000)
    assert slope > 100e6  # ~126 MB per 10K tokens: the old staging fails the flatness above
    # With a budget the resident pages come on top, sized by the budget, not by the context.
    res = [_store_gpu_bytes(T, "auto", budget=2 * 256 + 28 * 100) for T in lengths]
    assert {s.resident_pages_per_layer for s in res} == {100} and len({s.nbytes for s in res}) == 1


def test_segment_pages_knob_is_validated():
    with pytest.raises(ValueError, match="segment_pages must be a positive number of pages"):
        OffloadedKVStore(2, 1, 4, 4, 32, torch.float32, "cpu", chunk_size=8, segment_pages=0)
    with pytest.raises(ValueError, match="segment_pages is -3; pass a positive number of pages"):
        OOMBConfig(offload=OffloadConfig(segment_pages=-3))
    with pytest.raises(ValueError, match="segment_pages sizes the staging of offload but mode is off"):
        OOMBConfig(offload=OffloadConfig(mode="off", segment_pages=8))
    assert memory.default_segment_pages(128) == 256 and memory.default_segment_pages(65536) == 1
    # Two buffers of min(segment, n) pages is the least a budget can be; resident pages beyond.
    assert min_gpu_pages(28, 1000, 256) == 512 and min_gpu_pages(28, 100, 256) == 200
    assert resident_pages_for_budget(28, 1000, 512, 256) == 0
    assert resident_pages_for_budget(28, 1000, 512 + 28 * 7 + 27, 256) == 7
    assert resident_pages_for_budget(28, 300, 28 * 50 + 2 * 250, 256) == 50  # n - R < segment: smaller buffers
    with pytest.raises(ValueError, match="below the 512 pages offload needs"):
        resident_pages_for_budget(28, 1000, 511, 256)


@pytest.mark.cuda(reason="needs CUDA (side stream, pinned host memory)")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_segmented_offload_like_all_on_device(backend):
    from oomb.ops.paged_attention import _triton_available

    if backend == "triton" and not _triton_available():
        pytest.skip("triton kernels not importable")
    torch.manual_seed(0)
    m_ref = tiny("qwen2", 4, 2, layers=5, head_dim=16).to("cuda", torch.float32)
    m_off = clone_model(m_ref).to("cuda")
    ids = torch.randint(0, VOCAB, (1, 300), device="cuda")
    common = dict(chunk_size=32, page_size=16, checkpoint_layers=True, attention_backend=backend)
    out_ref, _ = _step(m_ref, ids, offload=False, **common)
    out_off, e_off = _step(m_off, ids, offload=True, offload_segment_pages=3, **common)
    assert e_off.kv_store.stats["on_demand"] == 0
    _assert_close_training(m_ref, m_off, out_ref, out_off, tol=1e-5)


_TRITON_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from oomb import Engine, OOMBConfig
from configs import engine_config
from test_engine import VOCAB, clone_model, tiny
rows = []
# 25 tokens, chunks of 8, pages of 4: the last chunk (1 token) has a past of 6 pages, in 6 segments or in 2
for family, heads, kv_heads, sp, ckpt, cu in [("qwen2", 4, 2, 1, True, None), ("llama", 7, 1, 3, False, [0, 13, 14, 25])]:
    torch.manual_seed(0)
    m_ref = tiny(family, heads, kv_heads, layers=2, head_dim=16).float()
    m_off = clone_model(m_ref)
    ids = torch.randint(0, VOCAB, (1, 25))
    cfg = dict(chunk_size=8, page_size=4, attention_backend="triton", checkpoint_layers=ckpt)
    cu_t = None if cu is None else torch.tensor(cu)
    out_ref = Engine(m_ref, engine_config(offload=False, **cfg)).step(ids, cu_seqlens=cu_t)
    e_off = Engine(m_off, engine_config(offload=True, offload_segment_pages=sp, **cfg))
    out_off = e_off.step(ids, cu_seqlens=cu_t)
    err = max(((a.grad - b.grad).abs().max() / a.grad.abs().max()).item()
              for a, b in zip(m_ref.parameters(), m_off.parameters()))
    rows.append(dict(family=family, loss=out_off.loss, ref_loss=out_ref.loss, err=err,
                     segments=e_off.kv_store.staging_pages, on_demand=e_off.kv_store.stats["on_demand"],
                     past_pages=e_off.kv_store.max_pages_per_layer - e_off.kv_store.resident_pages_per_layer))
print("RESULT " + json.dumps(rows))
"""


@pytest.mark.slow
def test_segmented_offload_triton_backend():
    """The Triton kernels (interpreter on CPU) with the past in 1- and 3-page segments, GQA 4:2 and 7:1, per-layer
    checkpointing and packed documents, equal the all-on-device Triton run (fp32)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'oomb[triton]')")
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, here], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for r in rows:
        assert r["segments"] in (1, 3) and r["on_demand"] == 0, r
        assert r["past_pages"] > r["segments"], r  # the past really is staged in more than one segment
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * r["ref_loss"], r
        assert r["err"] <= 1e-5, r


def test_segment_traffic_closed_form_equals_the_schedule():
    """The planner's closed-form traffic equals running the store's schedule over the step's calls, over many
    small configurations (layers, resident pages, segment and chunk sizes, lengths, checkpointing)."""
    for L in (3, 4, 5):
        for R in (0, 1, 2, 5):
            for sp in (1, 2, 3, 5):
                for chunk_pages in (1, 2, 3):
                    for T in (5, 17, 33, 64, 97):
                        for ckpt in (False, True):
                            args = (L, T, 4 * chunk_pages, 4, R, sp, ckpt, 7, 3)
                            assert memory.segment_traffic(*args, simulate=True) == memory.segment_traffic(
                                *args, simulate=False), args


# ------------------------------------------------- sparse attention: Stage 2 stages only the selected pages
from oomb.engine.sparse_state import SparseAttentionState  # noqa: E402

SPARSE = dict(sparse=True, page_budget=1, sink_pages=1, local_pages=1, sparse_block_size=4)


def _sparse_pair(monkeypatch, ids, budget, cu=None, spy=None, exact_unions=True, grain="head", layers=3, **cfg):
    """(ref model, offloaded model, ref out, offloaded out, offloaded engine): sparse, all on device vs offloaded
    (lazy side stream, NaN-poisoned host tier and GPU pool). ``grain``: the store's Stage-2 staging grain
    ('head': the selections' (page, KV head) tiles; 'page': their page unions). ``exact_unions`` (page grain):
    Stage 2 stages exactly the selections' page unions (no merging of nearby runs, no whole-layer fallback)."""
    if exact_unions:
        monkeypatch.setattr(OffloadedKVStore, "stage_merge_gap_pages", 0)
        monkeypatch.setattr(OffloadedKVStore, "stage_whole_fraction", 2.0)
        monkeypatch.setattr(OffloadedKVStore, "stage_max_runs", 10**9)
    streams = _lazy(monkeypatch)
    torch.manual_seed(3)
    m_ref = tiny("qwen2", 4, 2, layers=layers).double()
    m_off = clone_model(m_ref)
    cfg = dict(SPARSE, attention_backend="torch", **cfg)
    off = {k: cfg.pop(k) for k in list(cfg) if k.startswith("offload_")}  # the offloaded engine's options
    e_ref = Engine(m_ref, engine_config(offload=False, **cfg))
    e_off = Engine(m_off, engine_config(offload=True, gpu_page_budget=budget, offload_stage_grain=grain, **off, **cfg))
    out_ref = e_ref.step(ids, cu_seqlens=cu)
    out_off = e_off.step(ids, cu_seqlens=cu)
    assert streams and streams[0].max_queued >= 2
    return m_ref, m_off, out_ref, out_off, e_off


def _staged_pages(monkeypatch):
    """Record the ``pages`` of every Stage-2 whole-layer staging (None: the whole layer)."""
    seen = []
    orig = OffloadedKVStore._stage

    def stage(self, use, why):
        if self._in_stage2:  # (Stage 1 stages the host pages beyond its shadow, the same for every grain)
            seen.append(use.pages)
        return orig(self, use, why)

    monkeypatch.setattr(OffloadedKVStore, "_stage", stage)
    return seen


@pytest.mark.parametrize("grain", ["head", "page"])
@pytest.mark.parametrize("budget,ckpt,packed,chunk", [
    (None, False, False, 8),  # every page in the host tier
    (None, True, True, 12),  # per-layer checkpointing, packed documents
    (2 * 13 + 4, False, True, 8),  # R = 4 resident pages (sink and early pages), packed documents
    (2 * 13 + 3, True, False, 12),  # R = 3, checkpointing
])
def test_sparse_offload_stages_selected_pages_bitwise(monkeypatch, budget, ckpt, packed, chunk, grain):
    """Sparse + offload: Stage 2 stages only the (page, KV head) tiles, or pages, the selections read (never-staged
    slots hold NaN), and the loss and every gradient equal the all-on-device sparse step bitwise; traffic is below
    whole-layer staging."""
    seen = _staged_pages(monkeypatch)
    ids = torch.randint(0, VOCAB, (1, 52), generator=torch.Generator().manual_seed(7))
    cu = torch.tensor([0, 9, 30, 52]) if packed else None
    m_ref, m_off, out_ref, out_off, e_off = _sparse_pair(monkeypatch, ids, budget, cu, chunk_size=chunk, page_size=4,
                                                         checkpoint_layers=ckpt, grain=grain)
    store = e_off.kv_store
    assert not store.segmented and store.resident_pages_per_layer == (0 if budget is None else budget - 26)
    if grain == "head":
        assert any(isinstance(p, uses._HeadsOf) for p in seen)
        # The last chunk's selection is made in Stage 2, before the view: its backward stages tiles too.
        assert any(isinstance(p, uses._HeadsOf) and p.start == 51 // chunk * chunk for p in seen)
    else:
        assert any(p is not None and p != ((store.resident_pages_per_layer, store.max_pages_per_layer),) for p in seen)
    _assert_same_training(m_ref, m_off, out_ref, out_off)
    assert store.stats["on_demand"] == 0
    pred = offload_traffic(ModelShape.from_config(m_off.config), 52, chunk, 4, store.resident_pages_per_layer,
                           torch.float64, segment_pages=None, checkpoint_layers=ckpt,
                           stage1_shadow_pages=store.stage1_shadow_pages)
    assert store.stats["h2d_bytes"] < pred["h2d_bytes"] and store.stats["d2h_bytes"] < pred["d2h_bytes"]


@pytest.mark.parametrize("gap,fraction,max_runs", [(2, 2.0, 10**9), (0, 0.3, 10**9), (0, 2.0, 1)])
def test_sparse_offload_coalesced_stagings_bitwise(monkeypatch, gap, fraction, max_runs):
    """Merged runs, and the whole-layer fallback for dense unions or too many runs, give the same training bitwise."""
    monkeypatch.setattr(OffloadedKVStore, "stage_merge_gap_pages", gap)
    monkeypatch.setattr(OffloadedKVStore, "stage_whole_fraction", fraction)
    monkeypatch.setattr(OffloadedKVStore, "stage_max_runs", max_runs)
    seen = _staged_pages(monkeypatch)
    ids = torch.randint(0, VOCAB, (1, 52), generator=torch.Generator().manual_seed(7))
    m_ref, m_off, out_ref, out_off, e_off = _sparse_pair(monkeypatch, ids, 2 * 13 + 3, None, exact_unions=False,
                                                         grain="page", chunk_size=8, page_size=4)
    _assert_same_training(m_ref, m_off, out_ref, out_off)
    assert e_off.kv_store.stats["on_demand"] == 0
    if fraction > 1 and max_runs > 1:  # merged runs only: some staging is a strict subset with gaps filled
        assert any(p is not None for p in seen)
    elif max_runs == 1:  # more than one run -> the whole layer
        assert any(p is None for p in seen) and all(p is None or len(p) == 1 for p in seen)
    else:  # every union covers >= 30% of its span here -> the whole layer
        assert all(p is None for p in seen)


def test_coalesce_runs():
    from oomb.engine.offload.uses import _coalesce_runs

    runs = ((10, 12), (13, 14), (20, 21))
    assert _coalesce_runs(runs, 10, 100, 0, 1.0, 99) == runs
    assert _coalesce_runs(runs, 10, 100, 1, 1.0, 99) == ((10, 14), (20, 21))
    assert _coalesce_runs(runs, 10, 100, 6, 1.0, 99) == ((10, 21),)
    assert _coalesce_runs(runs, 10, 100, 6, 0.1, 99) is None  # 11 of 90 pages >= 10%
    assert _coalesce_runs(runs, 10, 100, 0, 1.0, 2) is None  # 3 runs > 2
    assert _coalesce_runs((), 10, 100, 1, 0.5, 9) == ()


def _traffic(monkeypatch, page_budget, whole_layer, grain="page"):
    if whole_layer:
        monkeypatch.setattr(SparseAttentionState, "needed_pages", lambda self, layer, start: None)
        monkeypatch.setattr(SparseAttentionState, "needed_heads", lambda self, layer, start: None)
    ids = torch.randint(0, VOCAB, (1, 56), generator=torch.Generator().manual_seed(8))
    _, _, out_ref, out_off, e_off = _sparse_pair(monkeypatch, ids, None, chunk_size=8, page_size=4, grain=grain,
                                                 **{"page_budget": page_budget})
    assert out_ref.loss == out_off.loss
    return e_off.kv_store.stats


@pytest.mark.parametrize("page_budget", [1, 14])
def test_sparse_offload_traffic_below_whole_layer(monkeypatch, page_budget):
    """The store's counters, for (page, KV head) tiles and for page unions: Stage-2 traffic strictly below
    whole-layer staging for a small budget, equal when the budget covers the past (Stage 1 is the same either way).
    With the small budget the selections' tiles are a strict subset of their page unions: fewer bytes each way than
    page-grained staging, for bitwise the same training (checked in _traffic)."""
    sel = {}
    for grain in ("head", "page"):
        with monkeypatch.context() as mp:
            sel[grain] = _traffic(mp, page_budget, False, grain)
        with monkeypatch.context() as mp:
            whole = _traffic(mp, page_budget, True, grain)
        got = sel[grain]
        if page_budget == 1:
            assert got["h2d_bytes"] < whole["h2d_bytes"] and got["d2h_bytes"] < whole["d2h_bytes"], (grain, got, whole)
        else:
            assert (got["h2d_bytes"], got["d2h_bytes"]) == (whole["h2d_bytes"], whole["d2h_bytes"]), (grain, got, whole)
    if page_budget == 1:
        head, page = sel["head"], sel["page"]
        assert head["h2d_bytes"] < page["h2d_bytes"] and head["d2h_bytes"] < page["d2h_bytes"], (head, page)


def _selections(monkeypatch, ids, cu, **cfg):
    """{(start, layer): PageSelection} of every selection of a sparse on-device step (the last chunk's too)."""
    with monkeypatch.context() as mp:
        mp.setattr(SparseAttentionState, "release", lambda self, start: None)
        torch.manual_seed(3)
        engine = Engine(tiny("qwen2", 4, 2, layers=3).double(), engine_config(offload=False, attention_backend="torch", **cfg))
        engine.step(ids, cu_seqlens=cu)
    return engine.sparse_state.selections


def _unions(monkeypatch, ids, cu, **cfg):
    """Page unions {(start, layer): sorted pages} of every selection of a sparse on-device step (the last chunk's too)."""
    out = {}
    for key, sel in _selections(monkeypatch, ids, cu, **cfg).items():
        n = sel.n_past_pages
        out[key] = list(range(n)) if sel.dense else sorted(set(sel.page_idx.clamp(min=0).flatten().tolist()))
    return out


def test_sparse_offload_needed_pages_for_every_chunk_zero_fills_never_written(monkeypatch):
    """A hook naming the pages of the last chunk too: the last chunk's backward writes back only its pages, so later
    stagings mix written and never-written (zero-filled; the host tier is NaN) gradient pages per page."""
    ids = torch.randint(0, VOCAB, (1, 52), generator=torch.Generator().manual_seed(9))
    cu = torch.tensor([0, 21, 52])
    cfg = dict(SPARSE, chunk_size=8, page_size=4)
    unions = _unions(monkeypatch, ids, cu, **cfg)
    monkeypatch.setattr(SparseAttentionState, "needed_pages", lambda self, layer, start: unions[(start, layer)])
    runs = []
    orig = OffloadedKVStore._valid_runs

    def valid_runs(self, layer, a, e):
        out = orig(self, layer, a, e)
        runs.append([ok for _, _, ok in out])
        return out

    monkeypatch.setattr(OffloadedKVStore, "_valid_runs", valid_runs)
    m_ref, m_off, out_ref, out_off, _ = _sparse_pair(monkeypatch, ids, None, cu, grain="page",
                                                     **{k: v for k, v in cfg.items() if k not in SPARSE})
    assert any(False in r and True in r[r.index(False):] for r in runs)  # a written page above a never-written one
    _assert_same_training(m_ref, m_off, out_ref, out_off)


def test_sparse_offload_skipped_writeback_is_detected(monkeypatch):
    """Control: writing back the gradients of all needed pages but the first run changes the gradients."""
    import dataclasses

    orig = OffloadedKVStore._after_backward

    def after_backward(self, use):
        if use.pages:
            use = dataclasses.replace(use, pages=use.pages[1:])
        return orig(self, use)

    monkeypatch.setattr(OffloadedKVStore, "_after_backward", after_backward)
    ids = torch.randint(0, VOCAB, (1, 52), generator=torch.Generator().manual_seed(7))
    m_ref, m_off, out_ref, out_off, _ = _sparse_pair(monkeypatch, ids, None, grain="page", chunk_size=8, page_size=4)
    assert out_ref.loss == out_off.loss  # the forward does not depend on gradients
    assert any(not torch.equal(a.grad, b.grad) for a, b in zip(m_ref.parameters(), m_off.parameters()))


def test_sparse_offload_missing_wait_for_selected_pages_is_detected(monkeypatch):
    """Control: without the compute-side wait on stagings of selected pages the lazy stream serves stale pages."""
    orig = OffloadedKVStore._wait_staged
    monkeypatch.setattr(OffloadedKVStore, "_wait_staged",
                        lambda self, use, ev: None if use.pages is not None else orig(self, use, ev))
    ids = torch.randint(0, VOCAB, (1, 52), generator=torch.Generator().manual_seed(7))
    m_ref, m_off, out_ref, out_off, _ = _sparse_pair(monkeypatch, ids, None, chunk_size=8, page_size=4)
    assert not out_off.loss == out_ref.loss or any(
        not torch.equal(a.grad, b.grad) for a, b in zip(m_ref.parameters(), m_off.parameters()))


def _worst_rel_err(m_ref, m, out_ref, out) -> float:
    """Largest relative error of the loss and of any parameter gradient (inf for NaN)."""
    errs = [abs(out.loss - out_ref.loss) / abs(out_ref.loss)]
    for a, b in zip(m_ref.parameters(), m.parameters()):
        errs.append(((a.grad - b.grad).abs().max() / a.grad.abs().max().clamp_min(1e-30)).item())
    return max(float("inf") if e != e else e for e in errs)


@pytest.mark.parametrize("segment_pages", ["layer", 2])
def test_two_copy_streams_exact_and_each_cross_stream_wait_matters(monkeypatch, segment_pages):
    """Device->host copies run on their own stream (concurrent with host->device ones on a GPU). With both
    simulated lazily, training matches the all-on-device run (bitwise for whole layers; segments merge
    partial attentions, so to 1e-12); without the wait for earlier writes into host pages, or for the
    last write-back (piece) out of a staging buffer, a host->device copy reads/overwrites data too early: wrong."""
    torch.manual_seed(1)
    m_ref = tiny("qwen2", 4, 2, layers=4).double()
    ids = torch.randint(0, VOCAB, (1, 44))
    common = dict(chunk_size=8, page_size=4)
    out_ref, _ = _step(m_ref, ids, offload=False, **common)
    streams = _lazy(monkeypatch)
    monkeypatch.setattr(Engine, "_segment_pages", lambda self: segment_pages)  # "layer": what sparse attention uses
    m_ok = clone_model(m_ref)
    out_ok, _ = _step(m_ok, ids, offload=True, **common)
    assert streams[-1].max_queued >= 4  # copies really were deferred
    if segment_pages == "layer":
        _assert_same_training(m_ref, m_ok, out_ref, out_ok)
    assert _worst_rel_err(m_ref, m_ok, out_ref, out_ok) <= 1e-12
    # Whole layers: dK/dV stagings follow the previous write-back out of the set piece by piece.
    out_of = "_after_writeback_piece" if segment_pages == "layer" else "_after_writeback_out_of"
    for hook in ("_after_host_writes", out_of):
        with monkeypatch.context() as mp:
            mp.setattr(OffloadedKVStore, hook, lambda self, *a: None)
            m_bad = clone_model(m_ref)
            out_bad, _ = _step(m_bad, ids, offload=True, **common)
        assert _worst_rel_err(m_ref, m_bad, out_ref, out_bad) > 1e-6, f"removing {hook} went unnoticed"


def test_writeback_pieces_split_and_order(monkeypatch):
    """The whole-layer write-back is cut into pieces with an event each; a later staging of the same slots is
    cut at the piece bounds and each part waits for (only) the last piece over its slots."""
    store = OffloadedKVStore(3, 1, 4, 4, 64, torch.float32, "cpu", chunk_size=8, gpu_pages=32, segment_pages="layer")
    assert store.resident_pages_per_layer == 0 and store.staging_pages == 16
    store.writeback_pieces = 3
    store.dk_cache.copy_(torch.arange(store.dk_cache.numel(), dtype=torch.float32).view_as(store.dk_cache))
    store.dv_cache.copy_(-store.dk_cache)
    store.dk_host.zero_()
    store.dv_host.zero_()
    store._write_back_pieces(0, 1, 0, [(0, 2), (5, 9)])  # 6 slots -> pieces of 2: [0,2) [5,7) [7,9)
    for x, y in ((0, 2), (5, 9)):  # exactly those slots reached layer 1's host pages
        assert torch.equal(store.dk_host[1, x:y], store.dk_cache[x:y])
        assert torch.equal(store.dv_host[1, x:y], store.dv_cache[x:y])
    assert not store.dk_host[1, 2:5].any() and not store.dk_host[1, 9:].any() and not store.dk_host[0].any() and not store.dk_host[2].any()
    assert store.stats["d2h_bytes"] == 2 * 6 * store.dk_host[0, 0].numel() * 4
    assert [(a, b) for a, b, _ in store._wb_pieces[0]] == [(0, 2), (5, 7), (7, 9)]
    assert store._writeback_split(0, 0, 10) == [(0, 2, 0), (2, 5, -1), (5, 7, 1), (7, 9, 2), (9, 10, -1)]
    assert store._writeback_split(0, 3, 6) == [(3, 5, -1), (5, 6, 1)]
    assert store._writeback_split(1, 0, 4) == [(0, 4, -1)]  # nothing written out of set 1 yet
    store._write_back_pieces(0, 0, 0, [(0, 7)])  # 7 slots -> pieces of 3: [0,3) [3,6) [6,7)
    assert [(a, b) for a, b, _ in store._wb_pieces[0]] == [(0, 3), (3, 6), (6, 7)]


# ------------------------------------------------------------ head-grained stagings (issue 5)
def _head_selections(monkeypatch, ids, cu, **cfg):
    """page_idx of every selection of a sparse on-device step (the last chunk's too; None where dense)."""
    return {key: None if sel.dense else sel.page_idx for key, sel in _selections(monkeypatch, ids, cu, **cfg).items()}


@pytest.mark.parametrize("skip", [None, "scatter", "zero_unwritten", "valid", "piece_waits"])
def test_sparse_offload_head_grain_every_chunk_and_controls(monkeypatch, skip):
    """A ``needed_heads`` hook that knows the last chunk's selection too: its backward writes back only its tiles, so
    later stagings (head-grained ones, and whole-layer ones of dense selections) mix written and never-written
    tiles (the host tier is NaN). Training is bitwise the all-on-device one. Controls with teeth: without the tile
    write-back, without zeroing never-written tiles in a whole-layer staging, or reading every tile as written,
    the gradients change; so do they when a dK/dV gather does not wait for the write-back pieces out of its set."""
    import oomb.ops.page_gather as pg

    ids = torch.randint(0, VOCAB, (1, 52), generator=torch.Generator().manual_seed(9))
    cfg = dict(SPARSE, chunk_size=8, page_size=4, sparse_block_size=8)  # one block per chunk: fewer tiles selected
    sels = _head_selections(monkeypatch, ids, None, **cfg)
    monkeypatch.setattr(SparseAttentionState, "needed_heads", lambda self, layer, start: sels[(start, layer)])
    unwritten = []
    orig_zero = OffloadedKVStore._zero_unwritten

    def zero_unwritten(self, layer, base, x, y):
        self._streams.synchronize()
        unwritten.append(not bool(self._written[layer, x:y].all()))
        if skip != "zero_unwritten":
            orig_zero(self, layer, base, x, y)

    monkeypatch.setattr(OffloadedKVStore, "_zero_unwritten", zero_unwritten)
    if skip == "scatter":
        monkeypatch.setattr(head_tiles, "scatter_head_pages", lambda *a, **k: None)
    elif skip == "piece_waits":  # the dK/dV gather into a set no longer waits for the write-back out of it
        orig_stage = OffloadedKVStore._stage_heads

        def stage_heads(self, use, s, base, kv_ok, grad_ok):
            self._wb_pieces[s], self._wb_prev[s] = [], None
            return orig_stage(self, use, s, base, kv_ok, grad_ok)

        monkeypatch.setattr(OffloadedKVStore, "_stage_heads", stage_heads)
    elif skip == "valid":
        orig = pg.gather_head_pages
        monkeypatch.setattr(head_tiles, "gather_head_pages",
                            lambda dst, base, src, pairs, count, valid=None, *a, **k: orig(dst, base, src, pairs, count, None, *a, **k))
    m_ref, m_off, out_ref, out_off, _ = _sparse_pair(monkeypatch, ids, None, chunk_size=8, page_size=4, sparse_block_size=8)
    assert out_ref.loss == out_off.loss  # the forward does not read gradients
    if skip is None:
        assert any(unwritten)  # a whole-layer staging did meet never-written tiles
        _assert_same_training(m_ref, m_off, out_ref, out_off)
    else:
        assert any(not torch.equal(a.grad, b.grad) for a, b in zip(m_ref.parameters(), m_off.parameters()))


def test_offload_stage_grain_argument():
    make = lambda **k: OffloadedKVStore(2, 2, 8, 4, 32, torch.float32, "cpu", chunk_size=8, segment_pages="layer", **k)
    assert make().stage_grain == "head" and make(stage_grain="page").stage_grain == "page"
    with pytest.raises(ValueError, match="stage_grain must be 'head' or 'page'; got 'tile'"):
        make(stage_grain="tile")


@pytest.mark.cuda(reason="needs CUDA (side streams, pinned host memory, zero-copy kernels)")
@pytest.mark.parametrize("grain", ["head", "page"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_cuda_sparse_offload_bitwise_like_all_on_device(monkeypatch, ckpt, grain):
    """Real streams: head-grained stagings (zero-copy gather/scatter kernels on the copy streams) and page-grained
    ones give the all-on-device sparse training bitwise (bf16 model, PyTorch attention)."""
    seen = _staged_pages(monkeypatch)
    torch.manual_seed(0)
    m_ref = tiny("qwen2", 4, 2, layers=5, head_dim=16).to("cuda", torch.bfloat16)
    m_off = clone_model(m_ref).to("cuda")
    ids = torch.randint(0, VOCAB, (1, 300), device="cuda")
    common = dict(chunk_size=32, page_size=16, checkpoint_layers=ckpt, attention_backend="torch", sparse=True,
                  page_budget=2, sink_pages=1, local_pages=1, sparse_block_size=16)
    out_ref, _ = _step(m_ref, ids, offload=False, **common)
    out_off, e_off = _step(m_off, ids, offload=True, gpu_page_budget=2 * 19 + 3 * 2, offload_stage_grain=grain, **common)
    store = e_off.kv_store
    assert store.stage_grain == grain
    assert store.k_host.is_pinned() and store.resident_pages_per_layer == 2 and store.stats["on_demand"] == 0
    if grain == "head":
        assert any(isinstance(p, uses._HeadsOf) for p in seen)
    _assert_same_training(m_ref, m_off, out_ref, out_off)


@pytest.mark.cuda(reason="needs CUDA (side streams, pinned host memory, Triton)")
@pytest.mark.parametrize("layers,full", [(5, True), (9, False)])
def test_cuda_stage1_shadow_bitwise(monkeypatch, layers, full):
    """Real streams and the Triton kernels: Stage 1 reading host pages from the shadow (all of them, or a prefix with
    the rest staged) trains bitwise like staging them (sparse, head grain, bf16; both runs in one process, so
    both use the same autotuned kernel configurations)."""
    _store_options(monkeypatch, stage1_shadow_partial=not full)
    torch.manual_seed(0)
    m_ref = tiny("qwen2", 4, 2, layers=layers, head_dim=16).to("cuda", torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 300), device="cuda")
    common = dict(chunk_size=48, page_size=16, checkpoint_layers=True, attention_backend="triton", sparse=True,
                  page_budget=2, sink_pages=1, local_pages=1, sparse_block_size=16, offload=True,
                  gpu_page_budget=layers * 2 + 2 * 17)
    runs = {}
    for shadow in (False, True):
        m = clone_model(m_ref).to("cuda")
        out, e = _step(m, ids, offload_stage1_shadow=shadow, **common)
        runs[shadow] = (m, out, e.kv_store)
    st = runs[True][2]
    H = st.host_pages_per_layer
    assert st.resident_pages_per_layer == 2 and (st.stage1_shadow_pages == H if full else 0 < st.stage1_shadow_pages < H)
    _assert_same_training(runs[False][0], runs[True][0], runs[False][1], runs[True][1])


@pytest.mark.cuda(reason="needs CUDA (pinned host memory)")
def test_cuda_store_falls_back_to_page_grain_without_zero_copy(monkeypatch):
    store = OffloadedKVStore(3, 2, 16, 16, 256, torch.bfloat16, "cuda", chunk_size=32, segment_pages="layer")
    assert store.stage_grain == "head" and head_tiles._zero_copy_works(store.k_host, store.k_cache)
    monkeypatch.setattr(store_mod, "_zero_copy_works", lambda host, pool: False)
    with pytest.warns(UserWarning, match="zero-copy"):
        store = OffloadedKVStore(3, 2, 16, 16, 256, torch.bfloat16, "cuda", chunk_size=32, segment_pages="layer")
    assert store.stage_grain == "page"


@pytest.mark.parametrize("name,value,says", [
    ("stage_grain", "tile", "must be 'head' or 'page'"),
    ("stage1_shadow", 2, "must be True or False"),
    ("stage1_shadow_partial", "yes", "must be True or False"),
    ("copy_streams", 3, "must be 1 or 2"),
    ("staging_sets", 1, "must be an integer >= 2"),
    ("kv_stash_mib", -1, "must be an integer >= 0"),
    ("page_gather_programs", 0, "must be a positive integer"),
    ("page_gather_warps", 6, "must be a power of two from 1 to 32"),
    ("page_gather_elems", 64, "must be a power of two from 128 to 65536"),
])
def test_store_options_are_checked_before_anything_is_allocated(monkeypatch, name, value, says):
    """Every keyword option of the store is checked before the pools and the host tier are allocated: one
    ValueError naming the argument, also for a store that would not use it (segmented staging)."""
    monkeypatch.setattr(store_mod, "pool_pair", lambda *a: pytest.fail("allocated before the options were checked"))
    for segment_pages in ("layer", "auto"):
        with pytest.raises(ValueError, match=f"^{name}[ =].*{says}"):
            OffloadedKVStore(5, 2, 8, 4, 64, torch.float32, "cpu", chunk_size=8, segment_pages=segment_pages,
                             **{name: value})


def test_page_gather_launch_settings_reach_every_copy_kernel(monkeypatch):
    """``page_gather_programs``/``_warps``/``_elems`` are the launch keywords of every tile copy (gathers, scatters,
    stash and unstash), passed through one method of the store; the defaults pass only ``num_programs``."""
    from oomb.engine.offload.head_tiles import copy_kernel_args

    assert copy_kernel_args(8, None, None) == {"num_programs": 8}
    assert copy_kernel_args(4, 16, 2048) == {"num_programs": 4, "num_warps": 16, "elems_per_load": 2048}
    store = OffloadedKVStore(5, 2, 8, 4, 64, torch.float32, "cpu", chunk_size=8, segment_pages="layer",
                             page_gather_programs=4, page_gather_warps=16, page_gather_elems=2048)
    assert store.gather_programs == 4
    seen = []
    store._tile_copy(lambda *a, **k: seen.append((a, k)), "pool", 0, first=2)
    assert seen == [(("pool", 0), {"first": 2, "num_programs": 4, "num_warps": 16, "elems_per_load": 2048})]
    calls = []
    for name in ("gather_head_pages", "scatter_head_pages", "stash_head_tiles", "unstash_head_tiles"):
        real = getattr(head_tiles, name)

        def spy(*a, _real=real, _name=name, **k):
            calls.append((_name, {x: k.get(x) for x in ("num_programs", "num_warps", "elems_per_load")}))
            return _real(*a, **{x: v for x, v in k.items() if x not in ("num_warps", "elems_per_load")})

        monkeypatch.setattr(head_tiles, name, spy)
    ids = torch.randint(0, VOCAB, (1, 52), generator=torch.Generator().manual_seed(5))
    _sparse_pair(monkeypatch, ids, None, chunk_size=8, page_size=4, checkpoint_layers=True, layers=5,
                 offload_kv_stash_mib=1, page_gather_programs=3, page_gather_warps=8, page_gather_elems=256)
    assert {n for n, _ in calls} == {"gather_head_pages", "scatter_head_pages", "stash_head_tiles", "unstash_head_tiles"}
    assert all(k == {"num_programs": 3, "num_warps": 8, "elems_per_load": 256} for _, k in calls)


@pytest.mark.parametrize("dtype,layers,budget,full", [
    (torch.bfloat16, 3, None, True),  # every host page in the shadow: Stage 1 stages nothing
    (torch.float32, 3, None, False),  # partial shadows (stage1_shadow_partial): the rest is staged
    (torch.bfloat16, 6, None, False),
    (torch.float32, 6, 44, False),
])
def test_stage1_shadow_bitwise_and_fewer_bytes(dtype, layers, budget, full, whole_layer_staging, monkeypatch):
    """Stage 1 reading host pages from the pool's dK/dV bytes (the shadow) trains bitwise like staging them, with
    fewer host->device bytes, whether the shadow holds all of each layer's host pages or part of them."""
    _store_options(monkeypatch, stage1_shadow_partial=not full)
    torch.manual_seed(0)
    m_ref = tiny("llama", 4, 2, layers=layers).to(dtype)
    ids = torch.randint(0, VOCAB, (1, 61))
    common = dict(chunk_size=8, page_size=4, checkpoint_layers=True, offload=True, gpu_page_budget=budget)
    runs = {}
    for shadow in (False, True):
        m = clone_model(m_ref)
        out, e = _step(m, ids, offload_stage1_shadow=shadow, **common)
        runs[shadow] = (m, out, e.kv_store)
    (m_off, out_off, st_off), (m_on, out_on, st_on) = runs[False], runs[True]
    n, R, Sh = st_on.max_pages_per_layer, st_on.resident_pages_per_layer, st_on.stage1_shadow_pages
    assert st_off.stage1_shadow_pages == 0
    assert Sh == n - R if full else (0 < Sh < n - R and 48 // 4 > R + Sh)  # partial: Stage 1 still stages some
    _assert_same_training(m_off, m_on, out_off, out_on)
    assert st_on.stats["h2d_bytes"] < st_off.stats["h2d_bytes"]
    assert st_on.stats["d2h_bytes"] == st_off.stats["d2h_bytes"] and st_on.stats["on_demand"] == 0
    pred = offload_traffic(ModelShape.from_config(m_on.config), 61, 8, 4, R, dtype, segment_pages=None,
                           checkpoint_layers=True, stage1_shadow_pages=Sh)
    assert (st_on.stats["h2d_bytes"], st_on.stats["d2h_bytes"]) == (pred["h2d_bytes"], pred["d2h_bytes"])


def test_stage1_shadow_controls(whole_layer_staging, monkeypatch):
    """Teeth: Stage 1 must write its new K/V into the shadow, and Stage 2 must zero the dK/dV bytes it used."""
    torch.manual_seed(0)
    m_ref = tiny("qwen2", 4, 2, layers=3)
    ids = torch.randint(0, VOCAB, (1, 45))
    common = dict(chunk_size=8, page_size=4, offload=True, gpu_page_budget=28)  # R = 4 resident pages, 8 on the host
    out_ref, _ = _step(m_ref, ids, **common)
    ref = {k: p.grad.clone() for k, p in m_ref.named_parameters()}

    def differs(patch):
        with monkeypatch.context() as mp:
            patch(mp)
            m = clone_model(m_ref)
            m.zero_grad(set_to_none=True)
            out, e = _step(m, ids, **common)
            assert e.kv_store.stage1_shadow_pages == 8 and e.kv_store.resident_pages_per_layer == 4
            return out.loss != out_ref.loss or any(not torch.equal(p.grad, ref[k]) for k, p in m.named_parameters())

    orig_write = OffloadedKVStore.write

    def write_no_shadow(self, layer, start, k, v):  # the shadow keeps stale bytes
        Sh, self.stage1_shadow_pages = self.stage1_shadow_pages, 0
        try:
            orig_write(self, layer, start, k, v)
        finally:
            self.stage1_shadow_pages = Sh

    assert differs(lambda mp: mp.setattr(OffloadedKVStore, "write", write_no_shadow))
    orig_begin = OffloadedKVStore._begin_stage2

    def begin_no_zero(self):
        self._in_stage2 = True

    assert differs(lambda mp: mp.setattr(OffloadedKVStore, "_begin_stage2", begin_no_zero))
    assert orig_begin is OffloadedKVStore._begin_stage2


def test_stage1_shadow_sizes():
    make = lambda L, **k: OffloadedKVStore(L, 2, 8, 4, 64, torch.float32, "cpu", chunk_size=8, **k)
    assert make(2, segment_pages="layer", stage1_shadow=False).stage1_shadow_pages == 0
    # The minimum pool (two staging sets of 16 pages: 32 fp32 dK/dV pages over 3 layers): a
    # shadow of 10 of each layer's 16 host pages (partial shadows are on by default).
    assert make(3, segment_pages="layer").stage1_shadow_pages == 10
    assert make(3, gpu_pages=36, segment_pages="layer").stage1_shadow_pages == 12  # R = 4: all 12 host pages fit
    assert make(2).stage1_shadow_pages == 0  # segmented
    # only a shadow of every host page
    assert make(3, segment_pages="layer", stage1_shadow_partial=False).stage1_shadow_pages == 0
    assert make(3, gpu_pages=36, segment_pages="layer", stage1_shadow_partial=False).stage1_shadow_pages == 12


def _stash_step(monkeypatch, mib, ckpt, skip=None):
    ids = torch.randint(0, VOCAB, (1, 52), generator=torch.Generator().manual_seed(5))
    if skip == "restore":  # the backward reads its K/V tiles from a stale stash... and not from the host
        monkeypatch.setattr(head_tiles, "unstash_head_tiles", lambda *a, **k: None)
    elif skip == "keep":  # the forward never fills the stash
        monkeypatch.setattr(head_tiles, "stash_head_tiles", lambda *a, **k: None)
    return _sparse_pair(monkeypatch, ids, None, chunk_size=8, page_size=4, checkpoint_layers=ckpt, layers=5,
                        offload_kv_stash_mib=mib)


@pytest.mark.parametrize("ckpt", [False, True])
def test_kv_stash_bitwise_and_fewer_bytes(monkeypatch, ckpt):
    """The K/V stash: Stage-2 backwards of layers below L - 2 take their first C K/V tiles from the forward's stash
    instead of the host. Training is bitwise the all-on-device one (NaN-poisoned pools and host tier, lazy copy
    streams) and the host->device bytes drop by exactly the bytes restored from the stash, for part of each
    layer's tiles (1, 3) or all of them (capped)."""
    D, S = 8, 4  # tiny('qwen2', 4, 2): head dim 8 (float64); 13 pages per layer, all in the host tier
    tile = 2 * S * D * 8
    with monkeypatch.context() as mp:
        *_, e_plain = _stash_step(mp, 0, ckpt)
        plain = dict(e_plain.kv_store.stats)
    assert plain["kv_stash_bytes"] == 0
    for tiles in (1, 3, 10**6):  # one stash-less step is the reference of all three
        mib = -(-tiles * tile * 3 // (1 << 20))  # 3 = L - 2 stashed layers
        with monkeypatch.context() as mp:
            if tiles < 10**6:  # C tiles per layer exactly: the MiB knob rounds, so set the class default in bytes
                mp.setattr(store_mod, "kv_stash_tiles", lambda *a, t=tiles: t)
            m_ref, m_off, out_ref, out_off, e = _stash_step(mp, mib, ckpt)
            store = e.kv_store
            st = dict(store.stats)
        assert store.kv_stash_tiles == (tiles if tiles < 10**6 else 13 * 2), tiles
        assert store._stash_k.shape == (3, store.kv_stash_tiles, S, D)
        _assert_same_training(m_ref, m_off, out_ref, out_off)
        assert st["kv_stash_bytes"] > 0
        assert st["h2d_bytes"] == plain["h2d_bytes"] - st["kv_stash_bytes"]
        assert st["d2h_bytes"] == plain["d2h_bytes"]


@pytest.mark.parametrize("skip", ["restore", "keep"])
def test_kv_stash_controls(monkeypatch, skip):
    """Teeth: a backward that does not restore its stashed tiles, or a forward that does not fill the stash, changes
    the gradients (the stashed tiles are then never read from the host)."""
    m_ref, m_off, out_ref, out_off, e = _stash_step(monkeypatch, 1, True, skip)
    assert e.kv_store.kv_stash_tiles > 0
    assert out_ref.loss == out_off.loss  # the forward does not read the stash
    assert any(not torch.equal(a.grad, b.grad, ) for a, b in zip(m_ref.parameters(), m_off.parameters())
               if a.grad is not None)


def test_kv_stash_sizing():
    assert memory.kv_stash_tiles(28, 3876, 4, 128, 128, torch.bfloat16, 4 << 30) == (4 << 30) // (26 * 65536)
    assert memory.kv_stash_tiles(28, 10, 4, 128, 128, torch.bfloat16, 4 << 30) == 40  # at most every host tile
    assert memory.kv_stash_tiles(2, 3876, 4, 128, 128, torch.bfloat16, 4 << 30) == 0  # L <= 2: no layer loses its set
    assert memory.kv_stash_tiles(28, 0, 4, 128, 128, torch.bfloat16, 4 << 30) == 0
    make = lambda **k: OffloadedKVStore(4, 2, 8, 4, 64, torch.float32, "cpu", chunk_size=8, segment_pages="layer", **k)
    plain = make()
    assert plain.kv_stash_tiles == 0 and plain._stash_k is None  # off by default
    plain.needed_heads = lambda layer, start: None
    assert plain._stash_k is None
    st = make(kv_stash_mib=1)
    assert st.kv_stash_tiles == 16 * 2 and st._stash_k is None  # every host tile of a layer; not allocated yet
    assert st.nbytes == plain.nbytes
    st.needed_heads = lambda layer, start: None  # sparse attention's hook: now the stash is needed
    assert st._stash_k.shape == st._stash_v.shape == (2, 32, 4, 8)
    assert st.nbytes == plain.nbytes + 2 * 2 * 32 * 4 * 8 * 4  # K and V, 2 layers, 32 tiles of 4 x 8 fp32
    assert make(kv_stash_mib=1, stage_grain="page").kv_stash_tiles == 0  # page-grained stagings keep no stash
    assert OffloadedKVStore(4, 2, 8, 4, 64, torch.float32, "cpu", chunk_size=8,
                            kv_stash_mib=1).kv_stash_tiles == 0  # segmented
    with pytest.raises(ValueError, match=r"kv_stash_mib must be an integer >= 0; got -1"):
        make(kv_stash_mib=-1)


@pytest.mark.cuda(reason="needs CUDA (side streams, pinned host memory, Triton)")
@pytest.mark.parametrize("ckpt", [False, True])
def test_cuda_kv_stash_bitwise(monkeypatch, ckpt):
    """Real streams and the Triton tile kernels: with the K/V stash (part of each layer's tiles) the sparse offloaded
    training is bitwise the all-on-device one, with fewer host->device bytes than without it."""
    torch.manual_seed(0)
    m_ref = tiny("qwen2", 4, 2, layers=6, head_dim=16).to("cuda", torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 300), device="cuda")
    common = dict(chunk_size=32, page_size=16, checkpoint_layers=ckpt, attention_backend="torch", sparse=True,
                  page_budget=2, sink_pages=1, local_pages=1, sparse_block_size=16)
    out_ref, _ = _step(m_ref, ids, offload=False, **common)
    runs = {}
    for tiles in (0, 5):
        monkeypatch.setattr(store_mod, "kv_stash_tiles", lambda *a, t=tiles: t)
        m = clone_model(m_ref).to("cuda")
        for p in m.parameters():
            p.grad = None
        out, e = _step(m, ids, offload=True, gpu_page_budget=2 * 19 + 6 * 2, **common)
        assert e.kv_store.kv_stash_tiles == tiles and e.kv_store.stats["on_demand"] == 0
        _assert_same_training(m_ref, m, out_ref, out)
        runs[tiles] = dict(e.kv_store.stats)
    assert runs[5]["kv_stash_bytes"] > 0
    assert runs[5]["h2d_bytes"] == runs[0]["h2d_bytes"] - runs[5]["kv_stash_bytes"]


@pytest.mark.parametrize("skip_wait", [False, True])
def test_sparse_offload_last_chunk_tiles_and_list_wait(monkeypatch, skip_wait):
    """The last chunk's selection is made in its Stage-2 forward, before the view: its backward's stagings and
    write-backs are head-grained too. Its top layer was prefetched whole (the selection did not exist yet), so the
    write-back is the first to need that layer's tile list, made on the other copy stream: without waiting for it
    (control) the write-back reads a list not yet made, and the gradients change."""
    if skip_wait:
        orig = OffloadedKVStore._head_tiles
        monkeypatch.setattr(OffloadedKVStore, "_head_tiles", lambda self, use: orig(self, use)[:4] + (self._streams.event(),))
    monkeypatch.setattr(_LazyStreams, "eager_d2h", True)  # write-backs run as early as their waits allow
    ids = torch.randint(0, VOCAB, (1, 52), generator=torch.Generator().manual_seed(2))
    m_ref, m_off, out_ref, out_off, e = _sparse_pair(monkeypatch, ids, None, chunk_size=8, page_size=4,
                                                     checkpoint_layers=True)
    assert out_ref.loss == out_off.loss
    if skip_wait:
        assert any(not torch.equal(a.grad, b.grad) for a, b in zip(m_ref.parameters(), m_off.parameters()))
    else:
        _assert_same_training(m_ref, m_off, out_ref, out_off)


def test_last_chunk_tile_list_waits_for_the_compute_stream(monkeypatch):
    """The last chunk's selection is made on the compute stream right before its tile list is made on the copy
    stream: making the list must wait for the compute stream (the simulator runs compute at once, so only the
    order of the calls can show it). Lists of earlier chunks (selections made in Stage 1) need no such wait."""
    log = []
    orig = OffloadedKVStore._head_tiles

    def head_tiles(self, use):
        fresh = (use.layer, use.start, use.pages.own) not in self._pairs_cache
        st = self._streams
        waits = []
        with monkeypatch.context() as mp:
            mp.setattr(st, "copy_wait", lambda ev, w=st.copy_wait: waits.append(ev.stream) or w(ev))
            out = orig(self, use)
        if fresh:
            log.append((use.start + self.chunk_size >= self._seq_len, None in waits))
        return out

    monkeypatch.setattr(OffloadedKVStore, "_head_tiles", head_tiles)
    ids = torch.randint(0, VOCAB, (1, 52), generator=torch.Generator().manual_seed(2))
    m_ref, m_off, out_ref, out_off, _ = _sparse_pair(monkeypatch, ids, None, chunk_size=8, page_size=4)
    _assert_same_training(m_ref, m_off, out_ref, out_off)
    assert any(last for last, _ in log) and any(not last for last, _ in log)
    assert all(waited == last for last, waited in log), log



def _whole_layer_reference(monkeypatch, layers, ckpt, T=44):
    """A float64 tiny model, T tokens, chunk 8, page 4, its all-on-device step, and engines set to stage whole
    layers -> (m_ref, ids, step kwargs, out_ref)."""
    torch.manual_seed(1)
    m_ref = tiny("qwen2", 4, 2, layers=layers).double()
    ids = torch.randint(0, VOCAB, (1, T))
    common = dict(chunk_size=8, page_size=4, checkpoint_layers=ckpt)
    out_ref, _ = _step(m_ref, ids, offload=False, **common)
    monkeypatch.setattr(Engine, "_segment_pages", lambda self: "layer")
    return m_ref, ids, common, out_ref


@pytest.mark.parametrize("ckpt", [False, True])
def test_more_staging_sets_bitwise_and_traffic(monkeypatch, ckpt):
    """staging_sets=K (whole-layer staging): layer l stages into set l % K. Dense attention: training is
    bitwise the all-on-device one under the lazy two-stream simulator with poisoned pools, every staging is issued
    ahead, and the bytes equal the planner's (the top K layers keep their K/V from the Stage-2 forward to the
    backward, so fewer host->device bytes than with two sets)."""
    m_ref, ids, common, out_ref = _whole_layer_reference(monkeypatch, 6, ckpt)
    stats = {}
    for k in (2, 3, 4):
        with monkeypatch.context() as mp:
            _store_options(mp, staging_sets=k)  # dense attention: no config field sets it
            _lazy(mp)
            m = clone_model(m_ref)
            out, e = _step(m, ids, offload=True, gpu_page_budget=6 * 2 + k * 9, **common)  # R = 2 of 11 pages
            st = e.kv_store
            assert st.staging_sets == k and st.resident_pages_per_layer == 2 and st.gpu_pool_pages == 6 * 2 + k * 9
            _assert_same_training(m_ref, m, out_ref, out)
            pred = offload_traffic(ModelShape.from_config(m.config), 44, 8, 4, 2, torch.float64, segment_pages=None,
                                   checkpoint_layers=ckpt, stage1_shadow_pages=st.stage1_shadow_pages, staging_sets=k)
            stats[k] = dict(st.stats)
            assert (stats[k]["h2d_bytes"], stats[k]["d2h_bytes"]) == (pred["h2d_bytes"], pred["d2h_bytes"])
            assert stats[k]["on_demand"] == 0
    for sets in (3, 4):
        assert stats[sets]["h2d_bytes"] < stats[2]["h2d_bytes"] and stats[sets]["d2h_bytes"] == stats[2]["d2h_bytes"]


@pytest.mark.parametrize("stash", [0, 1])
def test_three_staging_sets_sparse_head_grain_bitwise(monkeypatch, stash):
    """Three staging sets with sparse attention's head-grained Stage 2 (and the K/V stash, now for layers below
    L - 3), under the lazy simulator with eager write-backs: bitwise the all-on-device training."""
    monkeypatch.setattr(_LazyStreams, "eager_d2h", True)
    ids = torch.randint(0, VOCAB, (1, 52), generator=torch.Generator().manual_seed(4))
    m_ref, m_off, out_ref, out_off, e = _sparse_pair(monkeypatch, ids, None, chunk_size=8, page_size=4,
                                                     checkpoint_layers=True, layers=6, offload_staging_sets=3,
                                                     offload_kv_stash_mib=stash)
    st = e.kv_store
    assert st.staging_sets == 3 and st.gpu_pool_pages == 3 * 13
    assert (st._stash_k.shape[0] == 3) if stash else st._stash_k is None
    _assert_same_training(m_ref, m_off, out_ref, out_off)
    assert (st.stats["kv_stash_bytes"] > 0) == bool(stash)


def test_auto_staging_sets_bitwise_and_traffic(monkeypatch):
    """Without staging_sets a whole-layer store picks its sets from its pool (choose_staging_sets):
    a pool of 4 whole layers at 13 layers of 5 pages keeps 0 of 5 pages resident with 4 sets and with 2 (the
    host tier does not grow: taken), and training stays bitwise the all-on-device one with the planner's bytes."""
    L, T, n = 13, 20, 5  # 3 chunks of 8 tokens (the last of 4); more than 2 * n + 2 layers: 2 sets keep none resident
    assert memory.resident_pages_for_budget(L, n, 4 * n, None, 2) == 0
    m_ref, ids, common, out_ref = _whole_layer_reference(monkeypatch, L, True, T)
    _lazy(monkeypatch)
    m = clone_model(m_ref)
    out, e = _step(m, ids, offload=True, gpu_page_budget=4 * n, **common)
    st = e.kv_store
    assert st.staging_sets == 4 and st.resident_pages_per_layer == 0 and st.max_pages_per_layer == n
    _assert_same_training(m_ref, m, out_ref, out)
    pred = offload_traffic(ModelShape.from_config(m.config), T, 8, 4, 0, torch.float64, segment_pages=None,
                           checkpoint_layers=True, stage1_shadow_pages=st.stage1_shadow_pages, staging_sets=4)
    assert (st.stats["h2d_bytes"], st.stats["d2h_bytes"]) == (pred["h2d_bytes"], pred["d2h_bytes"])
    two = offload_traffic(ModelShape.from_config(m.config), T, 8, 4, 0, torch.float64, segment_pages=None,
                          checkpoint_layers=True, stage1_shadow_pages=st.stage1_shadow_pages, staging_sets=2)
    assert pred["h2d_bytes"] < two["h2d_bytes"]  # the top four layers keep their K/V to their backward


def test_choose_staging_sets_rule(monkeypatch):
    """The largest K <= 4 whose host tier stays within 10% of the two-set one; 2 for segments, a minimum pool, an
    all-resident pool, and K >= L; a requested K wins. The planner's tiering and the store agree."""
    from oomb.memory import choose_staging_sets as choose, resident_pages_for_budget

    L, n = 28, 8192  # Qwen2.5-7B at 1M tokens
    assert choose(L, n, 128_600, None) == 4 and resident_pages_for_budget(L, n, 128_600, None) == 3993
    assert choose(L, n, 128_600, 512) == 2  # segments
    assert choose(L, n, 2 * n, None) == 2 and choose(L, n, 3 * n - 1, None) == 2  # no room for a third layer
    assert choose(L, n, L * n, None) == 2  # every page resident: nothing to stage
    for pool in range(2 * n, L * n, 977):
        K = choose(L, n, pool, None)
        R = resident_pages_for_budget(L, n, pool, None)
        assert L * R + K * (n - R) <= pool < L * R + K * (n - R) + (L - K) + (0 if R < n else 10**9)
        R2 = (pool - 2 * n) // (L - 2)
        assert n - R <= 1.1 * (n - min(R2, n))
        if K < 4 and pool >= (K + 1) * n:  # one more set was refused: it would cost > 10% more host pages
            RK = min(n, (pool - (K + 1) * n) // (L - K - 1))
            assert n - RK > 1.1 * (n - min(R2, n))
    # a 3-set choice exists between the two
    assert any(choose(L, n, p, None) == 3 for p in range(3 * n, 5 * n, 257))
    assert choose(3, 10, 29, None) == 2 and choose(4, 10, 39, None) == 3  # K < L only
    assert choose(L, n, 128_600, None, 2) == 2 and resident_pages_for_budget(L, n, 128_600, None, 2) == 4316
    st = OffloadedKVStore(28, 2, 4, 4, 11 * 4, torch.float64, "cpu", chunk_size=8, gpu_pages=4 * 11, segment_pages="layer")
    assert st.staging_sets == 4 and st.gpu_pool_pages == 4 * 11
    st = OffloadedKVStore(6, 2, 4, 4, 11 * 4, torch.float64, "cpu", chunk_size=8, gpu_pages=4 * 11, segment_pages="layer")
    assert st.staging_sets == 2 and st.resident_pages_per_layer == 5  # 4 sets would keep none resident


def test_staging_sets_argument():
    from oomb.memory import min_gpu_pages, resident_pages_for_budget

    assert min_gpu_pages(6, 10, None, 3) == 30 and min_gpu_pages(6, 10, 4, 3) == 8  # segments keep two buffers
    assert resident_pages_for_budget(6, 10, 30 + 3 * 2, None, 3) == 2
    assert resident_pages_for_budget(3, 10, 30, None, 3) == 10  # L <= K: all resident
    make = lambda **k: OffloadedKVStore(5, 2, 8, 4, 64, torch.float32, "cpu", chunk_size=8, **k)
    st = make(segment_pages="layer", staging_sets=3)
    assert st.staging_sets == 3 and st.gpu_pool_pages == 48 and st.block_table[4, 0] == 1 * 16  # layer 4: set 1 of 16 slots
    assert make(staging_sets=3).staging_sets == 2  # segmented
    for bad in (1, "x"):
        with pytest.raises(ValueError, match="staging_sets must be an integer >= 2"):
            make(segment_pages="layer", staging_sets=bad)


def test_engine_passes_offload_staging_sets_to_the_store(monkeypatch):
    """OffloadConfig.staging_sets reaches the store (CPU: the minimum pool of that many whole layers), and so do
    the other offload and copy-kernel settings of the config."""
    m = tiny("qwen2", 4, 2, layers=6).double()
    cfg = OOMBConfig(chunk_size=8, page_size=4, sparse=SparseConfig(page_budget=1, sink_pages=1, local_pages=0), offload=OffloadConfig(mode="on", staging_sets=3))
    e = Engine(m, cfg)
    e.reserve(44)
    assert e.kv_store.staging_sets == 3 and e.kv_store.gpu_pool_pages == 3 * 11
    seen = {}
    init = OffloadedKVStore.__init__
    monkeypatch.setattr(OffloadedKVStore, "__init__", lambda self, *a, **k: seen.update(k) or init(self, *a, **k))
    cfg = OOMBConfig(chunk_size=8, page_size=4, sparse=SparseConfig(page_budget=1, sink_pages=1, local_pages=0),
                     offload=OffloadConfig(mode="on", staging_sets=4, stage_grain="page", stage1_shadow=False,
                                           copy_streams=1, kv_stash_mib=3),
                     kernels=KernelConfig(page_gather_programs=5, page_gather_warps=4, page_gather_elems=512))
    e = Engine(m, cfg)
    e.reserve(44)
    assert e.kv_store.staging_sets == 4 and e.kv_store.gpu_pool_pages == 4 * 11
    assert e.kv_store.stage_grain == "page" and e.kv_store.stage1_shadow_pages == 0 and e.kv_store.gather_programs == 5
    assert {k: seen[k] for k in ("stage_grain", "stage1_shadow", "copy_streams", "kv_stash_mib", "page_gather_programs",
                                 "page_gather_warps", "page_gather_elems")} == dict(
        stage_grain="page", stage1_shadow=False, copy_streams=1, kv_stash_mib=3, page_gather_programs=5,
        page_gather_warps=4, page_gather_elems=512)
