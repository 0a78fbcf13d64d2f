"""Teacher-forced scoring of retrieval prompts through the engine's no-grad chunked pass, dense and sparse.

For each prompt, :meth:`oomb.Engine.score_targets` runs the whole sequence once (chunk by chunk, as
:meth:`oomb.Engine.evaluate` does, so it reaches the lengths training reaches) and returns the log-probability
of each answer token given everything before it, and whether it was the most likely token. A trial is an
exact match when every answer token is the argmax: what greedy decoding would have produced, without a
generation loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..config import OOMBConfig, SparseConfig
from ..engine.engine import Engine
from ..sparse_quality import check_budgets, engines_by_budget
from .prompts import RetrievalPrompt
from .report import RetrievalReport, RetrievalRow, RetrievalTrial

__all__ = ["evaluate_retrieval", "score_prompt"]


def score_prompt(engine: Engine, prompt: RetrievalPrompt) -> RetrievalTrial:
    """Score one prompt with ``engine``: the summed answer log-probability (nats) and the exact match."""
    device = engine.device
    logprobs, greedy = engine.score_targets(prompt.input_ids.to(device), prompt.labels.to(device))
    return RetrievalTrial(length=prompt.length, depth=prompt.depth, trial=prompt.trial, answer=prompt.answer,
                          logprob=float(logprobs.double().sum()), exact=bool(greedy.all()),
                          answer_tokens=int(logprobs.numel()), needle_start=prompt.needle_start,
                          token_logprobs=[float(x) for x in logprobs.tolist()])


def evaluate_retrieval(
    model: torch.nn.Module,
    prompts: Sequence[RetrievalPrompt],
    config: OOMBConfig,
    budgets: Sequence[int] = (),
    seed: int = 0,
    needles: int = 1,
    progress=None,
) -> RetrievalReport:
    """Score every prompt dense and with sparse attention at each page budget.

    One :class:`oomb.Engine` per mode (dense on the sparse runs' kernels, see
    :func:`oomb.sparse_quality.dense_like_sparse`; the previous engine is dropped first); its page store is
    sized once for the longest prompt.

    Args:
        model: a Hugging Face causal LM oomb supports, on its device and dtype.
        prompts: from :func:`oomb.retrieval.build_prompts` (one task).
        config: engine settings; ``sparse.page_budget`` is overridden per budget, the other sparse settings used
            as given (see :func:`oomb.evaluation.evaluate_windows`).
        budgets: sparse page budgets (each >= 1); empty: dense only.
        seed, needles: recorded in the report (how the prompts were made).
        progress: optional callable ``progress(row_name, prompt_index, trial)`` after each prompt, with its
            :class:`RetrievalTrial`.

    Returns:
        :class:`RetrievalReport` (``.table()``, ``.to_dict()``, ``.heatmap(path)``).

    Raises:
        ValueError: no prompts, prompts of several tasks, a budget < 1, and what :meth:`Engine.score_targets`
            raises.
    """
    prompts = list(prompts)
    budgets = check_budgets(budgets)
    if not prompts:
        raise ValueError("prompts is empty; pass at least one retrieval prompt")
    tasks = {p.task for p in prompts}
    if len(tasks) != 1:
        raise ValueError(f"the prompts are of several tasks ({', '.join(sorted(tasks))}); score one task at a time")
    sparse = config.sparse or SparseConfig()
    report = RetrievalReport(
        task=prompts[0].task, lengths=list(dict.fromkeys(p.length for p in prompts)),
        depths=list(dict.fromkeys(p.depth for p in prompts)), trials=max(p.trial for p in prompts) + 1,
        needles=needles, seed=seed, page_size=config.page_size, sink_pages=sparse.sink_pages,
        local_pages=sparse.local_pages, sparse_score=sparse.score)
    for budget, engine in engines_by_budget(model, config, budgets, reserve_tokens=max(report.lengths)):
        row = RetrievalRow(mode="dense" if budget is None else "sparse", budget=budget)
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            row.trials.append(score_prompt(engine, prompt))
            if progress is not None:
                progress(row.name, i, row.trials[-1])
        row.seconds = time.perf_counter() - t0
        report.rows.append(row)
        del engine
    return report
