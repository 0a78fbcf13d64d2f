"""Stage-2 seconds per chunk from a tqdm console of ``bench_sparse.py --progress``.

Reads the "stage 2 (recompute + backward)" progress lines of the timed step (the one with the most chunks)
and prints the mean seconds per chunk over the first ``--chunks`` chunks (the elapsed time at chunk k over k),
so runs cut before the end of the step can be compared.

Usage: python benchmarks/stage2_rate.py CONSOLE [--chunks 40] [--label TEXT]
"""

from __future__ import annotations

import argparse
import re
import sys

_LINE = re.compile(r"stage 2 \(recompute \+ backward\):.*?\|\s*(\d+)/(\d+) \[(?:(\d+):)?(\d+):(\d+)")


def stage2_points(text: str) -> list[tuple[int, float]]:
    """(chunks done, elapsed seconds) of the longest Stage-2 progress bar in ``text``."""
    bars: dict[int, list[tuple[int, float]]] = {}
    for m in _LINE.finditer(text):
        done, total = int(m.group(1)), int(m.group(2))
        h, mi, s = int(m.group(3) or 0), int(m.group(4)), int(m.group(5))
        bars.setdefault(total, []).append((done, 3600 * h + 60 * mi + s))
    if not bars:
        return []
    return sorted(set(bars[max(bars)]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("console")
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    pts = [p for p in stage2_points(open(args.console, errors="replace").read()) if p[0] > 0]
    if not pts:
        print(f"{args.label}: no Stage-2 progress found in {args.console}")
        return 1
    k, t = max((p for p in pts if p[0] <= args.chunks), key=lambda p: p[0], default=pts[0])
    print(f"{args.label}: {t / k:.3f} s/chunk over the first {k} Stage-2 chunks ({t:.0f} s; {pts[-1][0]} chunks seen)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
