"""``loss.png``: the loss (and the held-out loss) and the throughput of a run against its step, drawn from its
``log.jsonl``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..png import missing_glyphs_drawn_as_boxes, png_metadata

__all__ = ["plot_log", "read_log", "read_val_log"]


def _records(path: str | os.PathLike) -> tuple[dict[int, dict], dict[int, dict]]:
    """({step: step record}, {step: held-out record}) of a ``log.jsonl``: a record with ``val_loss`` and no
    ``loss`` is a held-out one; a step logged twice keeps its last line; lines that are not complete records (a
    crash mid-write) are skipped."""
    steps: dict[int, dict] = {}
    vals: dict[int, dict] = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            (vals if "val_loss" in record and "loss" not in record else steps)[int(record["step"])] = record
        except (ValueError, KeyError, TypeError):
            continue
    return steps, vals


def read_log(path: str | os.PathLike) -> list[dict]:
    """The step records of a ``log.jsonl`` in step order, one per step (a step logged twice: its last line); lines
    that are not complete records (a crash mid-write) and held-out records (:func:`read_val_log`) are skipped."""
    steps, _ = _records(path)
    return [steps[s] for s in sorted(steps)]


def read_val_log(path: str | os.PathLike) -> list[dict]:
    """The held-out records of a ``log.jsonl`` (``oomb train --val-every``: ``step``, ``val_loss``, ``val_tokens``,
    ``val_sequences``, ``val_seconds``) in step order, one per step (logged twice: its last line)."""
    _, vals = _records(path)
    return [vals[s] for s in sorted(vals)]


def plot_log(log_path: str | os.PathLike, png_path: str | os.PathLike) -> bool:
    """Draw ``png_path`` (PNG, matplotlib's Agg backend) from the records of ``log_path``: the loss (nats/token)
    on top (with the held-out loss of its held-out records as points, where it has any) and tokens/s below, against
    the step. The file is written to a temporary name beside it and renamed, so it is whole or absent. Returns False
    (nothing written) when the log holds no step record."""
    by_step, by_val = _records(log_path)
    records = [by_step[s] for s in sorted(by_step)]
    vals = [by_val[s] for s in sorted(by_val)]
    if not records:
        return False
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in records]
    fig = Figure(figsize=(7, 5), dpi=100)
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    loss_ax.plot(steps, [r.get("loss") for r in records], marker="." if len(steps) < 50 else None, label="train")
    if vals:
        loss_ax.plot([r["step"] for r in vals], [r.get("val_loss") for r in vals], color="tab:orange", marker="o",
                     linestyle="--", label="held-out")
        loss_ax.legend(loc="upper right")
    loss_ax.set_ylabel("loss (nats/token)")
    loss_ax.grid(alpha=0.3)
    speed_ax.plot(steps, [r.get("tokens_per_s") for r in records], color="tab:green", marker="." if len(steps) < 50 else None)
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("step")
    speed_ax.grid(alpha=0.3)
    speed_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"{Path(log_path).parent.name}: steps {steps[0]}-{steps[-1]}")
    png_path = Path(png_path)
    tmp = png_path.with_name(f".{png_path.name}.tmp")
    with missing_glyphs_drawn_as_boxes():  # the title names the run folder, in whatever script
        fig.tight_layout()
        fig.savefig(tmp, format="png", metadata=png_metadata("loss"))
    os.replace(tmp, png_path)
    return True
