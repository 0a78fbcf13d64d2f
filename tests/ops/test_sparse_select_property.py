"""select_pages (two stable sorts) against an independent implementation without sorts (``_select_pages_topk``):
bitwise, randomized.

Inputs are built to hit the tie rule hard: small-integer queries and summaries (exact arithmetic, so
equal summaries give bit-equal scores), signed zeros (+0.0 and -0.0 scores tie), +-inf and NaN
summaries (NaN scores become -inf and tie with the non-candidates' -inf; -inf scores become
the lowest finite value), packed documents,
budgets of 0 and beyond the past, sink/local pages of 0 and overlapping, partial last pages,
several query blocks, GQA, both scores, float32 and float64 summaries (bf16 or matching queries).
On CUDA too, where available (torch's CUDA sort and topk are other code than the CPU's).
"""

from __future__ import annotations

import pytest
import torch

from oomb.ops.sparse_select import PageSelection, _select_pages_topk, select_pages


def assert_same(a: PageSelection, b: PageSelection) -> None:
    assert a.page_idx.dtype == b.page_idx.dtype == torch.int32
    assert a.counts.dtype == b.counts.dtype == torch.int32
    assert a.page_idx.shape == b.page_idx.shape and torch.equal(a.page_idx, b.page_idx)
    assert a.counts.shape == b.counts.shape and torch.equal(a.counts, b.counts)
    assert (a.block_size, a.n_past_pages, a.dense) == (b.block_size, b.n_past_pages, b.dense)


def _values(shape, gen, dtype, mode):
    if mode == "normal":
        return torch.randn(shape, generator=gen, dtype=dtype)
    if mode == "few":  # a handful of small integers and both zeros: many exact ties
        pool = torch.tensor([-2.0, -1.0, -0.0, 0.0, 1.0, 2.0], dtype=dtype)
        return pool[torch.randint(0, len(pool), shape, generator=gen)]
    pool = torch.tensor([-0.0, 0.0, 1.0], dtype=dtype)  # "zeros": mostly signed zeros
    return pool[torch.randint(0, len(pool), shape, generator=gen)]


def random_case(seed: int, big: bool = False):
    gen = torch.Generator().manual_seed(seed)

    def pick(*xs):
        return xs[int(torch.randint(0, len(xs), (1,), generator=gen))]

    def rint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    dtype = pick(torch.float32, torch.float64)
    score = pick("mean", "quest")
    Hkv, G, D = pick(1, 2, 3), pick(1, 2, 4), pick(1, 1, 2, 4, 8)
    S = pick(1, 2, 3, 4, 8)
    B = pick(1, 2, 3, 4, 8, 16)
    C = rint(1, 40)
    n_target = rint(300, 2500) if big else pick(0, 1, 2, 3, rint(1, 12), rint(1, 60))
    past_len = max(0, n_target * S - rint(0, S - 1))  # often a partial last page
    n = -(-past_len // S)
    budget = pick(0, 1, 2, 3, rint(0, 12), n, n + rint(1, 5), max(0, n - rint(0, 3)))
    sink = pick(0, 0, 1, 2, rint(0, 8))
    local = pick(0, 0, 1, 3, rint(0, 8), n + 2)
    q_mode, r_mode = pick("normal", "few", "zeros"), pick("normal", "few", "few", "zeros")
    q = _values((C, Hkv * G, D), gen, dtype, q_mode).to(pick(dtype, dtype, torch.bfloat16))  # training: bf16 q
    n_rep = n + pick(0, 0, 2)  # summaries may cover more pages than the past
    reps = [_values((n_rep, Hkv, D), gen, dtype, r_mode) for _ in range(1 if score == "mean" else 2)]
    if score == "quest":
        reps = [torch.minimum(reps[0], reps[1]), torch.maximum(reps[0], reps[1])]
    if n_rep and pick(True, False):  # non-finite summaries: +-inf and NaN scores
        for r in reps:
            for val in (float("inf"), float("-inf"), float("nan")):
                m = torch.rand(n_rep, Hkv, D, generator=gen) < pick(0.05, 0.3)
                r[m] = val
    doc = None
    kind = pick("none", "none", "packed", "arbitrary")
    if kind == "packed":  # realistic: non-decreasing, each query's document starts at or before it
        starts = torch.randint(0, past_len + C, (C,), generator=gen)
        doc = torch.minimum(starts, torch.arange(C) + past_len).sort().values.to(torch.int32)
    elif kind == "arbitrary":
        doc = torch.randint(0, past_len + C + 2 * S + 1, (C,), generator=gen).to(pick(torch.int32, torch.int64))
    return (q, tuple(reps), past_len, S, budget, sink, local, B, score), doc


CUDA = pytest.param("cuda", marks=pytest.mark.cuda(reason="needs CUDA"))


def on(device, args, doc):
    args = tuple(a.to(device) if torch.is_tensor(a) else tuple(r.to(device) for r in a) if isinstance(a, tuple) else a
                 for a in args)
    return args, None if doc is None else doc.to(device)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("chunk", range(8))
def test_select_pages_matches_sort_reference_randomized(chunk, device):
    for seed in range(chunk * 150, chunk * 150 + 150):
        args, doc = on(device, *random_case(seed))
        try:
            ref = _select_pages_topk(*args, q_doc_start=doc)
        except ValueError:
            with pytest.raises(ValueError):
                select_pages(*args, q_doc_start=doc)
            continue
        assert_same(select_pages(*args, q_doc_start=doc), ref), f"seed {seed}"


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("seed", range(12))
def test_select_pages_matches_sort_reference_many_pages(seed, device):
    args, doc = on(device, *random_case(10_000 + seed, big=True))
    assert_same(select_pages(*args, q_doc_start=doc), _select_pages_topk(*args, q_doc_start=doc))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tie_rule_with_signed_zeros_and_infinities(dtype, device):
    """D = 1 so each score is q_sum * summary exactly: +0.0/-0.0, +-inf, NaN (-> -inf) and ties all appear."""
    vals = [0.0, -0.0, 1.0, float("-inf"), 1.0, -0.0, float("nan"), 0.0, float("inf"), float("-inf"), 1.0, -0.0, 0.0]
    n = len(vals)
    mean = torch.tensor(vals, dtype=dtype, device=device).view(n, 1, 1)
    for sign in (1.0, -1.0):
        q = torch.full((4, 1, 1), sign, dtype=dtype, device=device)
        for budget in range(n + 2):
            for sink in (0, 1, 2):
                for local in (0, 1, 3):
                    for doc in (None, torch.tensor([5, 5, 9, 9], device=device), torch.tensor([0, 13, 13, 13], device=device)):
                        args = (q, (mean,), n, 1, budget, sink, local, 2, "mean")
                        assert_same(select_pages(*args, q_doc_start=doc), _select_pages_topk(*args, q_doc_start=doc))


def test_nan_candidate_loses_to_lower_index_non_candidate():
    """The budget is taken from the stable order of ALL pages (non-candidates at -inf), then filtered:
    a candidate scored -inf (a NaN score; note nan_to_num maps a -inf score to the lowest finite
    value, which still beats the non-candidates) behind lower-index ineligible pages gets nothing."""
    n = 8
    mean = torch.full((n, 1, 1), float("nan"), dtype=torch.float32)
    mean[6, 0, 0] = 1.0
    mean[7, 0, 0] = float("-inf")  # score -inf -> -FLT_MAX: ahead of every -inf
    q = torch.ones(2, 1, 1)
    doc = torch.tensor([4, 4])  # pages 0..3 are ineligible (-inf like the NaN candidates 4 and 5)
    sel = select_pages(q, (mean,), n, 1, 3, 0, 0, 2, "mean", q_doc_start=doc)
    assert_same(sel, _select_pages_topk(q, (mean,), n, 1, 3, 0, 0, 2, "mean", q_doc_start=doc))
    assert sel.page_idx[0, 0].tolist() == [6, 7, -1] and sel.counts.tolist() == [[2]]
