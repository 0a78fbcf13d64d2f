"""Held-out loss at long context, dense and with sparse attention (the ``oomb eval`` tool).

:func:`token_windows` cuts a token stream into consecutive, non-overlapping windows in file order (no
shuffling, so two runs read the same tokens), and :func:`evaluate_windows` runs the engine's no-grad
chunked forward (:meth:`oomb.Engine.evaluate`) on every window, once dense and once per sparse page
budget, with the same weights. :meth:`EvalReport.table` prints one row per mode: the token-weighted mean
loss, its perplexity and the relative change against dense, so the quality cost of a page budget can be read
off directly.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import OOMBConfig, SparseConfig
from .data.stats import counted
from .sparse_quality import check_budgets, engines_by_budget

__all__ = ["EvalReport", "EvalRow", "evaluate_windows", "token_windows"]


def token_windows(tokens: np.ndarray, seq_len: int, num_windows: int | None = None) -> list[torch.Tensor]:
    """Consecutive, non-overlapping ``seq_len``-token windows of ``tokens``, in order.

    Window ``i`` is ``tokens[i * seq_len : (i + 1) * seq_len]``; a tail shorter than ``seq_len`` is dropped.

    Args:
        tokens: int array ``[N]`` of token ids (one stream, as from :func:`oomb.data.tokenize_documents`).
        seq_len: tokens per window (>= 2).
        num_windows: how many windows, from the start; ``None``: every whole window.

    Returns:
        ``num_windows`` int64 tensors ``[1, seq_len]`` (CPU).

    Raises:
        ValueError: ``seq_len`` < 2, ``num_windows`` < 1, or fewer than ``num_windows`` (or than one) whole
            windows in ``tokens``; the message says how many tokens and windows there are.
    """
    n = int(tokens.shape[0])
    if seq_len < 2:
        raise ValueError(f"seq_len is {seq_len}; a window needs at least 2 tokens (one input, one target)")
    available = n // seq_len
    if available == 0:
        raise ValueError(f"the data has {counted(n, 'token')}, fewer than one window of seq_len {seq_len:,}; give more "
                         f"text or pass seq_len {n} or less")
    if num_windows is None:
        num_windows = available
    if num_windows < 1:
        raise ValueError(f"num_windows is {num_windows}; pass 1 or more")
    if num_windows > available:
        raise ValueError(
            f"num_windows is {num_windows:,} but the data ({counted(n, 'token')}) holds {counted(available, 'window')} of "
            f"seq_len {seq_len:,}; "
            f"pass num_windows {available} or less, or a smaller seq_len"
        )
    return [torch.from_numpy(np.ascontiguousarray(tokens[i * seq_len : (i + 1) * seq_len], dtype=np.int64)).view(1, -1)
            for i in range(num_windows)]


@dataclass
class EvalRow:
    """One mode of :func:`evaluate_windows`.

    Attributes:
        mode: ``"dense"`` or ``"sparse"``.
        budget: the sparse page budget (pages of ``page_size`` tokens per query block and KV head); None for dense.
        window_losses: mean token cross-entropy (nats) of each window, in window order.
        window_tokens: predicted (target) tokens of each window (``seq_len - 1`` without ignored labels).
        seconds: wall time of the mode over all windows (s).
    """

    mode: str
    budget: int | None
    window_losses: list[float] = field(default_factory=list)
    window_tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def name(self) -> str:
        """``"dense"`` or ``"sparse B"``."""
        return "dense" if self.budget is None else f"sparse {self.budget}"

    @property
    def tokens(self) -> int:
        """Predicted tokens over all windows."""
        return sum(self.window_tokens)

    @property
    def loss(self) -> float:
        """Mean token cross-entropy (nats) over all windows, token-weighted."""
        return sum(l * n for l, n in zip(self.window_losses, self.window_tokens)) / self.tokens

    @property
    def perplexity(self) -> float:
        """``exp(loss)`` (inf where it overflows)."""
        try:
            return math.exp(self.loss)
        except OverflowError:
            return math.inf


@dataclass
class EvalReport:
    """Result of :func:`evaluate_windows`: the dense row first, then one row per sparse budget.

    Attributes:
        seq_len: tokens per window.
        page_size, sink_pages, local_pages, sparse_score: the sparse settings (pages of ``page_size`` tokens).
        window_starts: token offset of each window in the stream.
        rows: :class:`EvalRow` per mode, dense first.
    """

    seq_len: int
    page_size: int
    sink_pages: int
    local_pages: int
    sparse_score: str
    window_starts: list[int] = field(default_factory=list)
    rows: list[EvalRow] = field(default_factory=list)

    @property
    def dense(self) -> EvalRow:
        """The dense row."""
        return self.rows[0]

    def rel_change(self, row: EvalRow) -> float:
        """``(row.loss - dense.loss) / dense.loss`` in percent (0 for the dense row)."""
        return (row.loss - self.dense.loss) / self.dense.loss * 100.0

    def table(self) -> str:
        """Markdown table: one row per mode with loss, perplexity, change vs dense (%), tokens and seconds."""
        lines = ["| mode | mean loss | perplexity | vs dense | tokens | seconds |", "|---|---:|---:|---:|---:|---:|"]
        for row in self.rows:
            change = "—" if row.budget is None else f"{self.rel_change(row):+.3f}%"
            lines.append(f"| {row.name} | {row.loss:.6f} | {row.perplexity:.3f} | {change} | {row.tokens:,} | {row.seconds:.1f} |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-friendly report: the settings, and per mode the summary and the per-window losses."""
        return {
            "seq_len": self.seq_len,
            "num_windows": len(self.window_starts),
            "window_starts": self.window_starts,
            "page_size": self.page_size,
            "sink_pages": self.sink_pages,
            "local_pages": self.local_pages,
            "sparse_score": self.sparse_score,
            "rows": [
                {
                    "mode": row.mode,
                    "budget": row.budget,
                    "loss": row.loss,
                    "perplexity": row.perplexity if math.isfinite(row.perplexity) else None,
                    "rel_change_pct": self.rel_change(row),
                    "tokens": row.tokens,
                    "seconds": row.seconds,
                    "window_losses": row.window_losses,
                    "window_tokens": row.window_tokens,
                }
                for row in self.rows
            ],
        }


def evaluate_windows(
    model: torch.nn.Module,
    windows: list[torch.Tensor],
    config: OOMBConfig,
    budgets: list[int] | tuple[int, ...] = (),
    window_starts: list[int] | None = None,
    progress=None,
) -> EvalReport:
    """Loss of ``model`` on every window, dense and with sparse attention at each page budget.

    One :class:`oomb.Engine` per mode (the previous one is dropped first, so only one KV store is held);
    every window is evaluated with :meth:`oomb.Engine.evaluate` (no gradients, labels = the window itself).

    Args:
        model: a Hugging Face causal LM oomb supports, on its device and dtype.
        windows: int64 ``[1, T]`` token windows (from :func:`token_windows`); moved to the model's device.
        config: engine settings; ``sparse`` and ``page_budget`` are overridden (dense first, then sparse with
            each budget; dense on the sparse runs' block-table kernels, see
            :func:`oomb.sparse_quality.dense_like_sparse`); ``sink_pages``, ``local_pages``, ``sparse_block_size``, ``sparse_score`` and the
            offload settings are used as given (an ``OOMBConfig(sparse=True, ...)`` when the sparse ones differ
            from the defaults: OOMBConfig refuses them with sparse off).
        budgets: sparse page budgets (pages of ``config.page_size`` tokens, each >= 1); empty: dense only.
        window_starts: token offset of each window in the stream, for the report (default ``i * T``).
        progress: optional callable ``progress(row_name, window_index)`` called after each window.

    Returns:
        :class:`EvalReport` (``.table()`` for the Markdown table).

    Raises:
        ValueError: an empty window list or a budget < 1, and whatever :meth:`Engine.evaluate` raises.
    """
    budgets = check_budgets(budgets)
    if not windows:
        raise ValueError("windows is empty; pass at least one token window")
    T = int(windows[0].shape[-1])
    if window_starts is None:
        window_starts = [i * T for i in range(len(windows))]
    sparse = config.sparse or SparseConfig()
    report = EvalReport(seq_len=T, page_size=config.page_size, sink_pages=sparse.sink_pages, local_pages=sparse.local_pages,
                        sparse_score=sparse.score, window_starts=list(window_starts))
    device = next(model.parameters()).device
    for budget, engine in engines_by_budget(model, config, budgets):
        row = EvalRow(mode="dense" if budget is None else "sparse", budget=budget)
        t0 = time.perf_counter()
        for i, ids in enumerate(windows):
            ids = ids.to(device)
            row.window_losses.append(float(engine.evaluate(ids)))
            row.window_tokens.append(int(ids.shape[-1]) - 1)
            if progress is not None:
                progress(row.name, i)
        row.seconds = time.perf_counter() - t0
        report.rows.append(row)
        del engine
    return report
