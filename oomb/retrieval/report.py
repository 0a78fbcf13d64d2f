"""Results of a retrieval evaluation: per trial, per (depth, length) cell, as Markdown, JSON and a heatmap PNG."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..data.stats import counted
from ..png import png_metadata

__all__ = ["RetrievalReport", "RetrievalRow", "RetrievalTrial"]


@dataclass
class RetrievalTrial:
    """One scored prompt.

    Attributes:
        length: tokens of the prompt; depth: requested depth (percent); trial: index within its cell.
        answer: the value asked for.
        logprob: sum of the answer tokens' log-probabilities (nats, teacher-forced).
        exact: every answer token was the model's most likely token.
        answer_tokens: tokens of the answer.
        needle_start: token index of the asked needle's first token.
        token_logprobs: the answer tokens' log-probabilities, in order.
    """

    length: int
    depth: float
    trial: int
    answer: str
    logprob: float
    exact: bool
    answer_tokens: int
    needle_start: int
    token_logprobs: list[float] = field(default_factory=list)


@dataclass
class RetrievalRow:
    """One attention mode: ``"dense"`` (budget None) or ``"sparse"`` with a page budget."""

    mode: str
    budget: int | None
    trials: list[RetrievalTrial] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def name(self) -> str:
        """``"dense"`` or ``"sparse B"``."""
        return "dense" if self.budget is None else f"sparse {self.budget}"

    def cell(self, length: int | None, depth: float | None) -> list[RetrievalTrial]:
        """The trials of one (length, depth) cell; None for either: every length or depth."""
        return [t for t in self.trials if (length is None or t.length == length) and (depth is None or t.depth == depth)]

    def accuracy(self, length: int | None = None, depth: float | None = None) -> float:
        """Fraction of exact matches over the trials of that length and/or depth (all trials for None); nan if none."""
        ts = self.cell(length, depth)
        return sum(t.exact for t in ts) / len(ts) if ts else math.nan

    def mean_logprob(self, length: int | None = None, depth: float | None = None) -> float:
        """Mean answer log-probability (nats) over the trials of that length and/or depth (all for None); nan if
        none."""
        ts = self.cell(length, depth)
        return sum(t.logprob for t in ts) / len(ts) if ts else math.nan


def _depth(d: float) -> str:
    return f"{d:g}%"


@dataclass
class RetrievalReport:
    """Result of :func:`oomb.retrieval.evaluate_retrieval`: the grid, the sparse settings and one row per mode."""

    task: str
    lengths: list[int]
    depths: list[float]
    trials: int
    needles: int
    seed: int
    page_size: int
    sink_pages: int
    local_pages: int
    sparse_score: str
    rows: list[RetrievalRow] = field(default_factory=list)

    def grid(self, row: RetrievalRow) -> list[list[float]]:
        """Accuracy ``[depth][length]`` of one mode (fractions 0..1)."""
        return [[row.accuracy(length, depth) for length in self.lengths] for depth in self.depths]

    def logprob_grid(self, row: RetrievalRow) -> list[list[float]]:
        """Mean answer log-probability ``[depth][length]`` of one mode (nats, <= 0; 0 is a certain answer)."""
        return [[row.mean_logprob(length, depth) for length in self.lengths] for depth in self.depths]

    def table(self) -> str:
        """Markdown: per mode a table of exact-match accuracy (%) with depths as rows and lengths as columns, then
        the accuracy and mean answer log-probability of each length."""
        out = []
        head = "| depth \\ length | " + " | ".join(f"{n:,}" for n in self.lengths) + " |"
        rule = "|---:|" + "---:|" * len(self.lengths)
        for row in self.rows:
            what = f"{self.task}, {row.name}: exact match over {counted(self.trials, 'trial')} per cell"
            lines = [f"**{what}** ({row.seconds:.1f} s)", "", head, rule]
            for depth, accs in zip(self.depths, self.grid(row)):
                lines.append(f"| {_depth(depth)} | " + " | ".join(f"{100 * a:.0f}%" for a in accs) + " |")
            lines.append("| **all** | " + " | ".join(f"{100 * row.accuracy(n):.0f}%" for n in self.lengths) + " |")
            lines.append("| log-prob | " + " | ".join(f"{row.mean_logprob(n):.3f}" for n in self.lengths) + " |")
            out.append("\n".join(lines))
        return "\n\n".join(out)

    def to_dict(self) -> dict:
        """JSON-friendly report: the settings, and per mode the accuracy grid, per-length summaries and every trial."""
        return {
            "task": self.task, "lengths": self.lengths, "depths": self.depths, "trials": self.trials,
            "needles": self.needles, "seed": self.seed, "page_size": self.page_size, "sink_pages": self.sink_pages,
            "local_pages": self.local_pages, "sparse_score": self.sparse_score,
            "rows": [
                {
                    "mode": row.mode, "budget": row.budget, "seconds": row.seconds,
                    "accuracy": row.accuracy(), "accuracy_grid": self.grid(row),
                    "mean_logprob_grid": self.logprob_grid(row),
                    "accuracy_by_length": [row.accuracy(n) for n in self.lengths],
                    "mean_logprob_by_length": [row.mean_logprob(n) for n in self.lengths],
                    "results": [vars(t) for t in row.trials],
                }
                for row in self.rows
            ],
        }

    def heatmap(self, path: str | os.PathLike) -> Path:
        """Write the heatmap PNG to ``path`` (atomically): one column of panels per mode, lengths on x, depths on y
        (0% at the top), each cell labelled. Top row: exact-match accuracy (red 0 to green 1). Bottom row: the mean
        answer log-probability (nats; green 0, red at the lowest cell of any mode), which still ranks models that
        answer nothing exactly. Returns the path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        path = Path(path)
        n = len(self.rows)
        width = max(4.0, 0.7 * len(self.lengths) + 2.5)
        height = max(3.0, 0.45 * len(self.depths) + 1.8)
        fig, axes = plt.subplots(2, n, figsize=(width * n, 2 * height), dpi=100, squeeze=False, layout="constrained")
        logprobs = [np.array(self.logprob_grid(row), dtype=float) for row in self.rows]
        lowest = min(float(np.nanmin(g)) if np.isfinite(g).any() else -1.0 for g in logprobs)
        lowest = min(math.floor(lowest), -1)
        images = [None, None]
        for j, row in enumerate(self.rows):
            panels = ((np.array(self.grid(row), dtype=float), 0.0, 1.0, "{:.0f}", 100.0,
                       f"{self.task}, {row.name}: {100 * row.accuracy():.0f}% exact"),
                      (logprobs[j], lowest, 0.0, "{:.1f}", 1.0,
                       f"{self.task}, {row.name}: answer log-prob {row.mean_logprob():.2f}"))
            for i, (grid, vmin, vmax, fmt, scale, title) in enumerate(panels):
                ax = axes[i][j]
                images[i] = ax.imshow(grid, cmap="RdYlGn", vmin=vmin, vmax=vmax, aspect="auto")
                ax.set_xticks(range(len(self.lengths)), [f"{x:,}" for x in self.lengths], rotation=45, ha="right")
                ax.set_yticks(range(len(self.depths)), [_depth(d) for d in self.depths])
                for r in range(grid.shape[0]):
                    for c in range(grid.shape[1]):
                        ax.text(c, r, fmt.format(scale * grid[r, c]), ha="center", va="center", fontsize=7)
                if i == 1:
                    ax.set_xlabel("context length (tokens)")
                if j == 0:
                    ax.set_ylabel("depth of the answer")
                ax.set_title(title, fontsize=9)
        fig.colorbar(images[0], ax=list(axes[0]), label="exact-match accuracy")
        fig.colorbar(images[1], ax=list(axes[1]), label="answer log-prob (nats)")
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
        try:
            fig.savefig(tmp, format="png", bbox_inches="tight", metadata=png_metadata("heatmap"))
            os.replace(tmp, path)
        finally:
            plt.close(fig)
            if tmp.exists():
                tmp.unlink()
        return path
