"""``loss.png``: the loss and the throughput of a run against its step, drawn from its ``log.jsonl``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..png import png_metadata

__all__ = ["plot_log", "read_log"]


def read_log(path: str | os.PathLike) -> list[dict]:
    """The step records of a ``log.jsonl`` in step order, one per step (a step logged twice: its last line); lines
    that are not complete records (a crash mid-write) are skipped."""
    by_step: dict[int, dict] = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            by_step[int(record["step"])] = record
        except (ValueError, KeyError, TypeError):
            continue
    return [by_step[s] for s in sorted(by_step)]


def plot_log(log_path: str | os.PathLike, png_path: str | os.PathLike) -> bool:
    """Draw ``png_path`` (PNG, matplotlib's Agg backend) from the records of ``log_path``: the loss (nats/token)
    on top and tokens/s below, against the step. The file is written to a temporary name beside it and renamed, so
    it is whole or absent. Returns False (nothing written) when the log holds no record."""
    records = read_log(log_path)
    if not records:
        return False
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in records]
    fig = Figure(figsize=(7, 5), dpi=100)
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    loss_ax.plot(steps, [r.get("loss") for r in records], marker="." if len(steps) < 50 else None)
    loss_ax.set_ylabel("loss (nats/token)")
    loss_ax.grid(alpha=0.3)
    speed_ax.plot(steps, [r.get("tokens_per_s") for r in records], color="tab:green", marker="." if len(steps) < 50 else None)
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("step")
    speed_ax.grid(alpha=0.3)
    speed_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"{Path(log_path).parent.name}: steps {steps[0]}-{steps[-1]}")
    fig.tight_layout()
    png_path = Path(png_path)
    tmp = png_path.with_name(f".{png_path.name}.tmp")
    fig.savefig(tmp, format="png", metadata=png_metadata("loss"))
    os.replace(tmp, png_path)
    return True
