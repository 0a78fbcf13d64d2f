"""Pictures of a ``run_gpu.sh retrieval`` result folder: the loss curves of every mode, and each mode's passkey heatmap.

    python3 benchmarks/plot_retrieval.py DIR [--prefix NAME]

Reads the training stages' log.jsonl, DIR/retrieval_train_a.jsonl (stage A, shared by every mode; or one
DIR/retrieval_train_a_MODE.jsonl per mode), DIR/retrieval_train_a2.jsonl (stage A2, shared, where it ran) and
DIR/retrieval_train_b_MODE.jsonl, and DIR/retrieval_eval_MODE.json (``oomb eval --task passkey --json``); writes
DIR/NAME_loss.png (the stages' steps one after the other, log-scale loss, one line per mode) and
DIR/NAME_heatmap_MODE.png (one per trained mode: a column per evaluation mode, exact-match accuracy above and
answer log-probability below).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oomb.retrieval.report import RetrievalReport, RetrievalRow, RetrievalTrial  # noqa: E402
from oomb.train.plot import read_log  # noqa: E402


def report_of(path: Path) -> RetrievalReport:
    """The :class:`RetrievalReport` a ``--json`` file was written from."""
    d = json.loads(path.read_text())
    report = RetrievalReport(task=d["task"], lengths=d["lengths"], depths=d["depths"], trials=d["trials"],
                             needles=d["needles"], seed=d["seed"], page_size=d["page_size"],
                             sink_pages=d["sink_pages"], local_pages=d["local_pages"], sparse_score=d["sparse_score"])
    for r in d["rows"]:
        report.rows.append(RetrievalRow(r["mode"], r["budget"], [RetrievalTrial(**t) for t in r["results"]],
                                        r["seconds"]))
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--prefix", default="retrieval")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shared = a.dir / "retrieval_train_a.jsonl"
    modes = sorted({p.stem.rsplit("_", 1)[1] for p in a.dir.glob("retrieval_train_[ab]_*.jsonl")})
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    split = None
    for mode in modes:
        a_path = shared if shared.exists() else a.dir / f"retrieval_train_a_{mode}.jsonl"
        a_log = read_log(a_path) if a_path.exists() else []
        a2_path = a.dir / "retrieval_train_a2.jsonl"
        a_log += read_log(a2_path) if a2_path.exists() else []
        b_path = a.dir / f"retrieval_train_b_{mode}.jsonl"
        b_log = read_log(b_path) if b_path.exists() else []
        split = len(a_log)
        steps = list(range(1, len(a_log) + len(b_log) + 1))
        ax.plot(steps, [r["loss"] for r in a_log + b_log], label=mode, linewidth=0.8)
    if split:
        ax.axvline(split + 0.5, color="grey", linestyle=":", linewidth=1)
        ax.text(split + 2, 5, "stage B", fontsize=8, color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step (stage A, stage A2 where it ran, then stage B)")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("passkey training from random weights, 100M Qwen2 shape", fontsize=10)
    ax.legend()
    fig.savefig(a.dir / f"{a.prefix}_loss.png", bbox_inches="tight")
    plt.close(fig)
    for mode in modes:
        path = a.dir / f"retrieval_eval_{mode}.json"
        if path.exists():
            report_of(path).heatmap(a.dir / f"{a.prefix}_heatmap_{mode}.png")
    print(f"wrote {a.prefix}_loss.png and {len(modes)} heatmap(s) to {a.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
