"""(page, KV head) tile gather/scatter between a host span and the pool (oomb.ops.page_gather; issue 5).

The Triton kernel runs under the interpreter (TRITON_INTERPRET=1, set in conftest) on CPU tensors; both it and
the PyTorch path are compared with an explicit per-tile loop. The CUDA test reads pinned host memory directly."""

import pytest
import torch

from oomb.engine.offload import _unregister_host, host_empty
from oomb.ops.page_gather import _use_kernel, gather_head_pages, head_pairs, scatter_head_pages

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


def test_page_gather_errors():
    pool = torch.zeros(4, 4, 2, 8)
    src = torch.zeros(3, 4, 2, 8)
    pairs, count = head_pairs(torch.ones(3, 2, dtype=torch.bool))
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory read by a kernel)")
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
