"""Long-context retrieval evaluation: passkey and needle-in-a-haystack prompts of exact token lengths
(:mod:`~oomb.retrieval.prompts`), scored teacher-forced through the engine's no-grad chunked pass
(:mod:`~oomb.retrieval.score`), reported as Markdown, JSON and a depth x length heatmap
(:mod:`~oomb.retrieval.report`); and a generator of retrieval training text (:mod:`~oomb.retrieval.synthetic`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

_EXPORTS = {
    "TASKS": "prompts", "RetrievalPrompt": "prompts", "build_prompts": "prompts", "check_digits": "prompts",
    "needle_prompt": "prompts", "passkey_prompt": "prompts",
    "RetrievalReport": "report", "RetrievalRow": "report", "RetrievalTrial": "report",
    "evaluate_retrieval": "score", "score_prompt": "score",
    "is_retrieval_jsonl": "synthetic", "retrieval_rows": "synthetic", "write_retrieval_jsonl": "synthetic",
}
"""Name -> the submodule that defines it. The submodules are imported when a name is first asked for (PEP 562), so
that writing rows (``oomb data --make``) does not import the engine that scoring needs."""

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .prompts import TASKS, RetrievalPrompt, build_prompts, check_digits, needle_prompt, passkey_prompt
    from .report import RetrievalReport, RetrievalRow, RetrievalTrial
    from .score import evaluate_retrieval, score_prompt
    from .synthetic import is_retrieval_jsonl, retrieval_rows, write_retrieval_jsonl


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
