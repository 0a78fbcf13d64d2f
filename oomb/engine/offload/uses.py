"""What one use of a layer's pages needs (:class:`_Use`) and what a whole-layer staging set holds (:class:`_Tag`),
and the page runs a Stage-2 staging copies (docs/design.md §2.3)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class _Use:
    """One use of a layer's pages: K/V of ``past`` pages, plus dK/dV of ``past + own`` pages if ``grad``.

    ``pages``: a :class:`_HeadsOf` (Stage 2, head grain: the selection's (page, KV head) tiles), or runs
    ``(a, e)`` of the host pages [a, e) (R <= a < e <= past, ascending) that the attention reads (Stage 2
    with a ``needed_pages`` hook); None: all of [R, past)."""

    layer: int
    start: int  # token offset of the chunk
    past: int  # past pages whose K/V are read
    own: int  # the chunk's own pages whose stored dK/dV are read (backward only)
    grad: bool
    pages: tuple[tuple[int, int], ...] | None = None


@dataclass
class _Tag:
    """What a staging set holds (``pages``/``grad_pages``: a :class:`_HeadsOf` (tiles), host-page runs staged,
    or None: all of [R, past))."""

    layer: int
    past: int
    kv: bool
    grad_start: int | None = None  # chunk whose dK/dV are staged (None: none)
    grad_own: int = 0
    pages: tuple[tuple[int, int], ...] | None = None
    grad_pages: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class _HeadsOf:
    """A Stage-2 use's pages are the (page, KV head) tiles the selection of (its layer, chunk ``start``) reads,
    plus all heads of the chunk's ``own`` gradient pages (head-grained staging)."""

    start: int
    own: int


def _covers(have, need) -> bool:
    """Whether the host-page runs ``have`` (None: all) include every page of ``need`` (None: all); a
    :class:`_HeadsOf` covers only itself."""
    if have is None or have == need:
        return True
    if isinstance(have, _HeadsOf) and isinstance(need, _HeadsOf):
        return have.start == need.start  # the same selection's tiles (own pages are checked with the gradients)
    if need is None or isinstance(have, _HeadsOf) or isinstance(need, _HeadsOf):
        return False
    i = 0
    for a, e in need:
        while i < len(have) and have[i][1] <= a:
            i += 1
        if i == len(have) or have[i][0] > a or have[i][1] < e:
            return False
    return True


def _page_runs(pages) -> tuple[tuple[int, int], ...]:
    """Sorted distinct page indices -> runs ``(a, e)`` of consecutive pages [a, e)."""
    runs: list[list[int]] = []
    for p in pages:
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return tuple((a, e) for a, e in runs)


def _coalesce_runs(
    runs: tuple[tuple[int, int], ...], lo: int, hi: int, merge_gap: int, whole_fraction: float, max_runs: int
) -> tuple[tuple[int, int], ...] | None:
    """Page runs of a Stage-2 staging made cheap to copy; None: stage the whole span [lo, hi).

    Runs separated by at most ``merge_gap`` pages are merged (copying a short gap costs less than
    the extra copy calls: one page of K, V, dK, dV of a 7B layer is 768 KiB, ~15 us over PCIe 5,
    about one copy call's overhead). If the merged runs still cover at least ``whole_fraction``
    of [lo, hi), or there are more than ``max_runs`` of them, the whole span is staged: one
    contiguous copy per tensor moves it at full bandwidth, while thousands of short copies do not
    (a 1M-token sparse step whose unions covered most of the past ran Stage 2 at ~5.5 s per chunk
    with per-run copies against ~1.3 s with whole layers, on an H200).
    """
    if not runs or hi <= lo:
        return runs
    merged: list[list[int]] = []
    for a, e in runs:
        if merged and a - merged[-1][1] <= merge_gap:
            merged[-1][1] = e
        else:
            merged.append([a, e])
    covered = sum(e - a for a, e in merged)
    if covered >= whole_fraction * (hi - lo) or len(merged) > max_runs:
        return None
    return tuple((a, e) for a, e in merged)
