"""The one-kernel page selection (``select_pages_triton``) against ``select_pages``: bitwise, randomized (interpreter on
CPU, compiled on CUDA).

Both take the same PyTorch scores, so equality is exact, whatever the inputs. The grid is that of
tests/ops/test_sparse_select_property.py at smaller sizes (the interpreter runs one program per (block, KV head)):
ties from small-integer and signed-zero summaries, +-inf and NaN summaries, packed and arbitrary documents (int32
and int64), budgets of 0 and beyond the past, sink/local pages of 0 and overlapping, partial last pages, both
scores, float32 and bfloat16 summaries, tiles of 16 to 64 pages (rows of several tiles, n not a multiple of one).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'oomb[triton]')")

from oomb.ops.sparse_select import select_pages  # noqa: E402
from oomb.ops.triton.interpreter import INTERPRET  # noqa: E402
from oomb.ops.triton.page_select import select_pages_triton  # noqa: E402
from tests.ops.test_sparse_select_property import _values, assert_same  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"


def small_case(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def pick(*xs):
        return xs[int(torch.randint(0, len(xs), (1,), generator=gen))]

    def rint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    dtype = pick(torch.float32, torch.float32, torch.bfloat16)
    score = pick("mean", "quest")
    Hkv, G, D = pick(1, 2), pick(1, 2), pick(1, 2, 4)
    S = pick(1, 2, 4)
    C = rint(1, 12)
    B = pick(3, 4, 8, 16)
    n_target = pick(0, 1, 2, rint(1, 12), rint(10, 60))
    past_len = max(0, n_target * S - rint(0, S - 1))
    n = -(-past_len // S)
    budget = pick(0, 1, 2, rint(0, 12), n, n + rint(1, 5), max(0, n - rint(0, 3)))
    sink = pick(0, 1, 2, rint(0, 8))
    local = pick(0, 1, 3, rint(0, 8), n + 2)
    q_mode, r_mode = pick("normal", "few", "zeros"), pick("normal", "few", "few", "zeros")
    q = _values((C, Hkv * G, D), gen, torch.float32, q_mode).to(pick(torch.float32, torch.bfloat16))
    n_rep = n + pick(0, 0, 2)
    reps = [_values((n_rep, Hkv, D), gen, torch.float32, r_mode) for _ in range(1 if score == "mean" else 2)]
    if score == "quest":
        reps = [torch.minimum(reps[0], reps[1]), torch.maximum(reps[0], reps[1])]
    if n_rep and pick(True, False):
        for r in reps:
            for val in (float("inf"), float("-inf"), float("nan")):
                r[torch.rand(n_rep, Hkv, D, generator=gen) < pick(0.05, 0.3)] = val
    reps = [r.to(dtype) for r in reps]
    doc = None
    kind = pick("none", "packed", "arbitrary")
    if kind == "packed":
        starts = torch.randint(0, past_len + C, (C,), generator=gen)
        doc = torch.minimum(starts, torch.arange(C) + past_len).sort().values.to(torch.int32)
    elif kind == "arbitrary":
        doc = torch.randint(0, past_len + C + 2 * S + 1, (C,), generator=gen).to(pick(torch.int32, torch.int64))
    block_n = pick(16, 32, 64)
    return (q, tuple(reps), past_len, S, budget, sink, local, B, score), doc, block_n


def _on(args, doc):
    args = tuple(a.to(DEVICE) if torch.is_tensor(a) else tuple(r.to(DEVICE) for r in a) if isinstance(a, tuple) else a
                 for a in args)
    return args, None if doc is None else doc.to(DEVICE)


@pytest.mark.parametrize("chunk", range(6))
def test_matches_select_pages_randomized(chunk):
    for seed in range(chunk * 12, chunk * 12 + 12):
        args, doc, block_n = small_case(seed)
        args, doc = _on(args, doc)
        ref = select_pages(*args, q_doc_start=doc)
        assert_same(select_pages_triton(*args, q_doc_start=doc, block_n=block_n), ref), f"seed {seed}"


def test_tie_rule_with_signed_zeros_and_infinities():
    """D = 1: each score is q_sum * summary exactly, so +0.0/-0.0, +-inf, NaN (-> -inf) and ties all appear."""
    vals = [0.0, -0.0, 1.0, float("-inf"), 1.0, -0.0, float("nan"), 0.0, float("inf"), float("-inf"), 1.0, -0.0, 0.0]
    n = len(vals)
    mean = torch.tensor(vals, device=DEVICE).view(n, 1, 1)
    docs = (None, torch.tensor([5, 5, 9, 9], device=DEVICE), torch.tensor([0, 13, 13, 13], device=DEVICE))
    for sign in (1.0, -1.0):
        q = torch.full((4, 1, 1), sign, device=DEVICE)
        for budget in (0, 2, 6, n):
            for sink, local in ((0, 0), (2, 1)):
                for doc in docs:
                    args = (q, (mean,), n, 1, budget, sink, local, 2, "mean")
                    assert_same(select_pages_triton(*args, q_doc_start=doc, block_n=16),
                                select_pages(*args, q_doc_start=doc))


def test_nan_candidate_loses_to_lower_index_non_candidate():
    n = 8
    mean = torch.full((n, 1, 1), float("nan"), device=DEVICE)
    mean[6, 0, 0], mean[7, 0, 0] = 1.0, float("-inf")
    q = torch.ones(2, 1, 1, device=DEVICE)
    doc = torch.tensor([4, 4], device=DEVICE)
    sel = select_pages_triton(q, (mean,), n, 1, 3, 0, 0, 2, "mean", q_doc_start=doc)
    assert_same(sel, select_pages(q, (mean,), n, 1, 3, 0, 0, 2, "mean", q_doc_start=doc))
    assert sel.page_idx[0, 0].tolist() == [6, 7, -1] and sel.counts.tolist() == [[2]]


@pytest.mark.parametrize("past_len,budget,sink,local", [(0, 4, 1, 2), (40, 8, 1, 2), (40, 0, 1, 2), (40, 5, 0, 0),
                                                        (40, 0, 0, 0), (37, 3, 2, 20)],
                         ids=["no-past", "dense", "budget0", "no-sink-local", "nothing", "local-over-sink"])
def test_edge_cases(past_len, budget, sink, local):
    gen = torch.Generator().manual_seed(past_len + budget)
    q = torch.randn(9, 4, 8, generator=gen).to(DEVICE)
    mean = torch.randn(10, 2, 8, generator=gen).to(DEVICE)
    args = (q, (mean,), past_len, 4, budget, sink, local, 4, "mean")
    got, ref = select_pages_triton(*args, block_n=16), select_pages(*args)
    assert_same(got, ref)
    assert got.page_idx.shape == (3, 2, min(-(-past_len // 4), budget + sink + local))


def test_tiles_across_a_long_row():
    """Two programs over 200 pages in tiles of 16 (13 tiles, the last partial), with many exact ties."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randint(-2, 3, (4, 2, 4), generator=gen).float().to(DEVICE)
    mean = torch.randint(-2, 3, (200, 1, 4), generator=gen).float().to(DEVICE)
    for budget in (37, 150):
        args = (q, (mean,), 200 * 4 - 1, 4, budget, 1, 8, 2, "mean")
        assert_same(select_pages_triton(*args, block_n=16), select_pages(*args))


def test_launcher_checks():
    q = torch.randn(4, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="representatives"):
        select_pages_triton(q.double(), (torch.randn(3, 1, 4, dtype=torch.float64, device=DEVICE),), 12, 4, 1)
    with pytest.raises(ValueError, match="block_n"):
        select_pages_triton(q, (torch.randn(3, 1, 4, device=DEVICE),), 12, 4, 1, block_n=48)
    with pytest.raises(ValueError, match="q_doc_start"):
        select_pages_triton(q, (torch.randn(3, 1, 4, device=DEVICE),), 12, 4, 1,
                            q_doc_start=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="score"):
        select_pages_triton(q, (torch.randn(3, 1, 4, device=DEVICE),), 12, 4, 1, score="max")
