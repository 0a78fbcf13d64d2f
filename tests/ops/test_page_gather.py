"""(page, KV head) tile gather/scatter between a host span and the pool (oomb.ops.page_gather; issue 5).

The Triton kernel runs under the interpreter (TRITON_INTERPRET=1, set in conftest) on CPU tensors; both it and
the PyTorch path are compared with an explicit per-tile loop. The CUDA test reads pinned host memory directly."""

import pytest
import torch

from oomb.engine.offload.layout import host_empty, unregister_host as _unregister_host
from oomb.ops.page_gather import (
    _use_kernel,
    gather_head_pages,
    head_pairs,
    scatter_head_pages,
    stash_head_tiles,
    unstash_head_tiles,
)

# The interpreter converts the loaded tile count (a one-element array) to the loop bound with a NumPy warning.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def _expected_gather(pool, base, src, mask, valid):
    exp = pool.clone()
    for j in range(src.shape[0]):
        for h in range(src.shape[2]):
            if mask[j, h]:
                exp[base + j, :, h] = src[j, :, h] if valid is None or valid[j, h] else 0
    return exp


@pytest.mark.parametrize("m,Hkv", [(0, 2), (1, 1), (5, 3), (9, 4)])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_head_pairs(m, Hkv, density):
    mask = torch.rand(m, Hkv, generator=torch.Generator().manual_seed(m)) < density
    pairs, count = head_pairs(mask)
    n = int(count.item())
    assert pairs.shape == (m * Hkv + 1,) and pairs.dtype == torch.int32
    assert pairs[:n].tolist() == torch.nonzero(mask.flatten()).flatten().tolist()
    out = (torch.full((m * Hkv + 1,), -5, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    p2, c2 = head_pairs(mask, out=out)
    assert p2 is out[0] and c2 is out[1] and torch.equal(p2[:n], pairs[:n]) and int(c2) == n
    with pytest.raises(ValueError, match="out must be int32"):
        head_pairs(mask, out=(torch.empty(m * Hkv, dtype=torch.int32), torch.empty(1, dtype=torch.int32)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("S,Hkv,D", [(4, 2, 8), (16, 3, 32), (8, 1, 24)])
def test_gather_and_scatter_match_a_tile_loop(backend, dtype, S, Hkv, D):
    g = torch.Generator().manual_seed(S * 100 + D)
    m, base, P = 6, 3, 12
    src = torch.randn(m, S, Hkv, D, generator=g).to(dtype)
    mask = torch.rand(m, Hkv, generator=g) < 0.5
    mask[0, 0] = True
    valid = torch.rand(m, Hkv, generator=g) < 0.6
    pairs, count = head_pairs(mask)
    for v in (None, valid):
        pool = torch.full((P, S, Hkv, D), float("nan"), dtype=dtype)
        exp = _expected_gather(pool, base, src, mask, v)
        gather_head_pages(pool, base, src, pairs, count, v, num_programs=3, backend=backend)
        assert torch.equal(pool.nan_to_num(7.0), exp.nan_to_num(7.0))  # untouched tiles stay NaN
    back = torch.full_like(src, -3.0)
    scatter_head_pages(back, pool, base, pairs, count, num_programs=2, backend=backend)
    exp_back = torch.full_like(src, -3.0)
    for j in range(m):
        for h in range(Hkv):
            if mask[j, h]:
                exp_back[j, :, h] = pool[base + j, :, h]
    assert torch.equal(back, exp_back)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_page_ranges_split_a_copy(backend):
    """Copies restricted to page ranges ([lo, hi)) that tile the span give the unrestricted copy."""
    g = torch.Generator().manual_seed(4)
    m, S, Hkv, D = 9, 4, 3, 8
    src = torch.randn(m, S, Hkv, D, generator=g)
    mask = torch.rand(m, Hkv, generator=g) < 0.5
    valid = torch.rand(m, Hkv, generator=g) < 0.7
    pairs, count = head_pairs(mask)
    whole = torch.full((m + 2, S, Hkv, D), 5.0)
    gather_head_pages(whole, 2, src, pairs, count, valid, backend=backend)
    parts = torch.full_like(whole, 5.0)
    one = torch.full_like(whole, 5.0)
    for lo, hi in ((0, 4), (4, 5), (5, 9)):
        gather_head_pages(parts, 2, src, pairs, count, valid, num_programs=2, backend=backend, pages=(lo, hi))
    gather_head_pages(one, 2, src, pairs, count, valid, backend=backend, pages=(4, 5))
    assert torch.equal(parts, whole)
    assert torch.equal(one[2 + 4], whole[2 + 4]) and torch.all(one[:6] == 5.0) and torch.all(one[7:] == 5.0)
    back, back_parts = torch.zeros_like(src), torch.zeros_like(src)
    scatter_head_pages(back, whole, 2, pairs, count, backend=backend)
    for lo, hi in ((0, 7), (7, 9)):
        scatter_head_pages(back_parts, whole, 2, pairs, count, backend=backend, pages=(lo, hi))
    assert torch.equal(back_parts, back)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_listed_tiles_beyond_the_span_are_skipped(backend):
    """pairs from a mask with more rows than the span (the engine's K/V gathers) never address pages past it."""
    mask = torch.ones(5, 2, dtype=torch.bool)
    pairs, count = head_pairs(mask)
    src = torch.randn(3, 4, 2, 8)
    pool = torch.full((8, 4, 2, 8), 9.0)
    gather_head_pages(pool, 1, src, pairs, count, backend=backend)
    assert torch.equal(pool[1:4], src) and torch.all(pool[:1] == 9.0) and torch.all(pool[4:] == 9.0)
    dst = torch.zeros(2, 4, 2, 8)
    scatter_head_pages(dst, pool, 1, pairs, count, backend=backend)
    assert torch.equal(dst, src[:2])
    big = torch.tensor([6], dtype=torch.int32)  # a count past the list reads no further than the list
    gather_head_pages(pool, 1, src, pairs[:3], big, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C", [0, 1, 5, 40])  # none, a few, some, more than listed
def test_stash_round_trip_and_first(backend, dtype, C):
    """stash_head_tiles keeps list entries i < min(count, C) at stash[i]; unstash_head_tiles puts them back, and
    gather_head_pages(first=C) supplies the other entries: together a full gather, and nothing else is written."""
    g = torch.Generator().manual_seed(11 + C)
    m, S, Hkv, D, base, P = 7, 4, 3, 8, 2, 12
    src = torch.randn(m, S, Hkv, D, generator=g).to(dtype)
    mask = torch.rand(m + 2, Hkv, generator=g) < 0.5  # two rows past the span (as the own pages): skipped
    mask[m:] = True
    pairs, count = head_pairs(mask)
    n = int(count) - 2 * Hkv  # the span's listed tiles come first
    pool = torch.full((P, S, Hkv, D), float("nan"), dtype=dtype)
    gather_head_pages(pool, base, src, pairs, count, backend=backend)
    stash = torch.full((C, S, D), -4.0, dtype=dtype)
    stash_head_tiles(stash, pool, base, m, pairs, count, num_programs=2, backend=backend)
    for i in range(min(C, n)):
        j, h = divmod(int(pairs[i]), Hkv)
        assert torch.equal(stash[i], src[j, :, h])
    assert torch.all(stash[n:] == -4.0)  # entries of pages past the span, and past the list, are not written
    again = torch.full_like(pool, 3.0)
    unstash_head_tiles(again, base, m, stash, pairs, count, num_programs=3, backend=backend)
    gather_head_pages(again, base, src, pairs, count, num_programs=2, backend=backend, first=C)
    assert torch.equal(again.nan_to_num(3.0), pool.nan_to_num(3.0))
    only = torch.full_like(pool, 3.0)
    gather_head_pages(only, base, src, pairs, count, backend=backend, first=C)
    for i in range(n):
        j, h = divmod(int(pairs[i]), Hkv)
        assert torch.all(only[base + j, :, h] == 3.0) == (i < C)


@pytest.mark.parametrize("fn", ["gather", "scatter", "stash", "unstash"])
def test_kernel_warps_and_elems_arguments(monkeypatch, fn):
    """``num_warps`` / ``elems_per_load`` change how the kernel is launched, not what it copies; bad values are
    ValueErrors naming the argument, never a silent PyTorch fallback (with every copy of the module)."""
    from oomb.ops import page_gather as pg
    from oomb.ops.triton.page_gather import NUM_WARPS

    g = torch.Generator().manual_seed(5)
    m, S, Hkv, D = 6, 32, 2, 16
    src = torch.randn(m, S, Hkv, D, generator=g)
    mask = torch.rand(m, Hkv, generator=g) < 0.6
    pairs, count = head_pairs(mask)
    n = int(count)

    def call(backend, **kw):
        if fn == "gather":
            got = torch.zeros(m + 1, S, Hkv, D)
            gather_head_pages(got, 1, src, pairs, count, backend=backend, **kw)
        elif fn == "scatter":
            got = torch.zeros(m, S, Hkv, D)
            scatter_head_pages(got, torch.cat([torch.zeros(1, S, Hkv, D), src]), 1, pairs, count, backend=backend, **kw)
        elif fn == "stash":
            got = torch.zeros(n, S, D)
            stash_head_tiles(got, torch.cat([torch.zeros(1, S, Hkv, D), src]), 1, m, pairs, count, backend=backend, **kw)
        else:
            got = torch.zeros(m + 1, S, Hkv, D)
            unstash_head_tiles(got, 1, m, torch.randn(n, S, D, generator=torch.Generator().manual_seed(1)), pairs,
                               count, backend=backend, **kw)
        return got

    want = call("torch")
    seen = []
    monkeypatch.setattr("oomb.ops.triton.page_gather._copy_tiles_kernel", _SpyKernel(seen))
    for warps, elems in ((2, 128), (8, 65536), (None, 256), (4, None)):
        got = call("triton", num_programs=2, num_warps=warps, elems_per_load=elems)
        assert torch.equal(got, want)
        block_s = min(elems or 16384, S * D) // D
        assert seen[-1] == (warps or NUM_WARPS, block_s)  # (num_warps, BLOCK_S)
    for name, bad in (("num_warps", 3), ("num_warps", 64), ("elems_per_load", 64), ("elems_per_load", "x"),
                      ("num_warps", True)):
        with pytest.raises(ValueError, match=f"{name} must be a power of two"):
            call("triton", **{name: bad})
        with pytest.raises(ValueError, match=f"{name} must be a power of two"):
            call("torch", **{name: bad})  # checked on every path
    with pytest.raises(ValueError, match="num_programs must be a positive int"):
        call("triton", num_programs=0)
    pg.check_launch_args(8, 16, 16384)
    with pytest.raises(ValueError, match="elems_per_load must be a power of two from 128 to 65536"):
        pg.check_launch_args(8, None, 100)
    assert pg._triton_kernel() is not None


class _SpyKernel:
    """Wraps the Triton kernel: records (num_warps, BLOCK_S) of each launch, then runs it."""

    def __init__(self, seen):
        from oomb.ops.triton import page_gather

        self.kernel, self.seen = page_gather._copy_tiles_kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append((kw.get("num_warps"), kw["BLOCK_S"]))
            return self.kernel[grid](*args, **kw)

        return launch


def test_page_gather_errors():
    pool = torch.zeros(4, 4, 2, 8)
    src = torch.zeros(3, 4, 2, 8)
    pairs, count = head_pairs(torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        head_pairs(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        head_pairs(torch.ones(3, 2))
    with pytest.raises(ValueError, match="pairs must be int32"):
        gather_head_pages(pool, 0, src, pairs.long(), count)
    with pytest.raises(ValueError, match="count must be int32"):
        gather_head_pages(pool, 0, src, pairs, count.reshape(1, 1))
    with pytest.raises(ValueError, match="valid must be a contiguous bool"):
        gather_head_pages(pool, 0, src, pairs, count, torch.ones(2, 3, dtype=torch.bool).t())
    with pytest.raises(ValueError, match="valid must be a contiguous bool"):
        gather_head_pages(pool, 0, src, pairs, count, torch.ones(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_programs"):
        gather_head_pages(pool, 0, src, pairs, count, num_programs=0)
    with pytest.raises(ValueError, match="base must be an int"):
        gather_head_pages(pool, 1.0, src, pairs, count)
    with pytest.raises(ValueError, match="pages must be"):
        scatter_head_pages(src, pool, 0, pairs, count, pages=(-1, 2))
    with pytest.raises(ValueError, match="outside the pool"):
        gather_head_pages(pool, 2, src, pairs, count)
    with pytest.raises(ValueError, match="dtype"):
        gather_head_pages(pool, 0, src.double(), pairs, count)
    with pytest.raises(ValueError, match="alike"):
        gather_head_pages(pool, 0, torch.zeros(3, 4, 2, 4), pairs, count)
    with pytest.raises(ValueError, match="laid out"):
        scatter_head_pages(torch.zeros(3, 2, 4, 8).transpose(1, 2), pool, 0, pairs, count)
    with pytest.raises(ValueError, match="backend"):
        gather_head_pages(pool, 0, src, pairs, count, backend="cuda")
    with pytest.raises(ValueError, match="first must be an int >= 0"):
        gather_head_pages(pool, 0, src, pairs, count, first=-1)
    stash = torch.zeros(5, 4, 8)
    with pytest.raises(ValueError, match=r"stash \(5, 4, 2, 8\) must be \[C, S, D\]"):
        stash_head_tiles(torch.zeros(5, 4, 2, 8), pool, 0, 3, pairs, count)
    with pytest.raises(ValueError, match="one dtype and device"):
        unstash_head_tiles(pool, 0, 3, stash.double(), pairs, count)
    with pytest.raises(ValueError, match=r"pages \[2, 5\) are outside the pool's 4"):
        stash_head_tiles(stash, pool, 2, 3, pairs, count)
    with pytest.raises(ValueError, match="num_pages must be an int >= 0"):
        unstash_head_tiles(pool, 0, -1, stash, pairs, count)


@pytest.mark.cuda(reason="needs CUDA (pinned host memory read by a kernel)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_copy_kernels_on_cuda(dtype):
    pins: list[int] = []
    m, S, Hkv, D, base = 64, 128, 4, 128, 5
    host = host_empty((m, S, Hkv, D), dtype, True, pins)
    try:
        _zero_copy_round_trip(host, pins, dtype, m, S, Hkv, D, base)
    finally:  # a registration left behind would be stale once the memory is reused
        _unregister_host(pins, [])


def _zero_copy_round_trip(host, pins, dtype, m, S, Hkv, D, base):
    host.copy_(torch.randn(m, S, Hkv, D).to(dtype))
    mask = torch.rand(m, Hkv) < 0.4
    valid = torch.rand(m, Hkv) < 0.8
    pairs, count = head_pairs(mask.cuda())
    pool = torch.full((m + 8, S, Hkv, D), 2.0, dtype=dtype, device="cuda")
    assert _use_kernel(pool, host, "auto") and _use_kernel(pool, pool, "auto")  # a registered host span takes the kernel
    gather_head_pages(pool, base, host, pairs, count, valid.cuda())
    exp = _expected_gather(torch.full((m + 8, S, Hkv, D), 2.0, dtype=dtype), base, host, mask, valid)
    assert torch.equal(pool.cpu(), exp)
    out = host_empty((m, S, Hkv, D), dtype, True, pins)
    out.fill_(-1.0)
    scatter_head_pages(out, pool, base, pairs, count)
    torch.cuda.synchronize()
    exp_out = torch.full_like(out, -1.0)
    idx = torch.nonzero(mask)
    exp_out[idx[:, 0], :, idx[:, 1]] = exp[base + idx[:, 0], :, idx[:, 1]]
    assert torch.equal(out, exp_out)
    # The K/V stash's device-to-device kernels, and a gather of the rest of the list (first=C).
    C = max(1, int(count) // 2)
    stash = torch.full((C, S, D), 5.0, dtype=dtype, device="cuda")
    stash_head_tiles(stash, pool, base, m, pairs, count)
    again = torch.full_like(pool, 2.0)
    unstash_head_tiles(again, base, m, stash, pairs, count)
    gather_head_pages(again, base, host, pairs, count, valid.cuda(), first=C)
    torch.cuda.synchronize()
    assert torch.equal(again, pool)


@pytest.mark.slow
def test_without_triton_the_pytorch_path_serves(tmp_path):
    """Triton is optional: with it unimportable, the package imports, 'auto' copies through PyTorch, 'triton' says
    how to install it, and a sparse + offload CPU step runs (head grain)."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["triton"] = None
import torch
from oomb.ops.page_gather import gather_head_pages, head_pairs
from oomb.engine.offload import OffloadedKVStore
pairs, count = head_pairs(torch.ones(2, 2, dtype=torch.bool))
pool = torch.zeros(3, 4, 2, 8)
gather_head_pages(pool, 1, torch.ones(2, 4, 2, 8), pairs, count)
assert pool[1:].eq(1).all()
try:
    gather_head_pages(pool, 1, torch.ones(2, 4, 2, 8), pairs, count, backend="triton")
except ValueError as e:
    assert "pip install" in str(e)
else:
    raise SystemExit("no error")
from transformers import AutoModelForCausalLM
from oomb import Engine, OOMBConfig
from configs import engine_config
from oomb.models.presets import preset_config
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(preset_config("tiny")).double()
engine = Engine(model, engine_config(chunk_size=8, page_size=4, offload=True, sparse=True, page_budget=1, sink_pages=1,
                                  local_pages=1, sparse_block_size=4, attention_backend="torch"))
out = engine.step(torch.randint(0, 100, (1, 48)))
assert engine.kv_store.stage_grain == "head" and any(engine.kv_store._heads_used), "head grain not used"
assert out.loss == out.loss
print("ok")
"""
    import os

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/configs.py
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
