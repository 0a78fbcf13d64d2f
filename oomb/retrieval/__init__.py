"""Long-context retrieval evaluation: passkey and needle-in-a-haystack prompts of exact token lengths
(:mod:`~oomb.retrieval.prompts`), scored teacher-forced through the engine's no-grad chunked pass
(:mod:`~oomb.retrieval.score`), reported as Markdown, JSON and a depth x length heatmap
(:mod:`~oomb.retrieval.report`); and a generator of retrieval training text (:mod:`~oomb.retrieval.synthetic`).
"""

from .prompts import (
    TASKS,
    RetrievalPrompt,
    build_prompts,
    check_digits,
    needle_prompt,
    passkey_prompt,
)
from .report import RetrievalReport, RetrievalRow, RetrievalTrial
from .score import evaluate_retrieval, score_prompt
from .synthetic import is_retrieval_jsonl, retrieval_rows, write_retrieval_jsonl

__all__ = [
    "TASKS",
    "RetrievalPrompt",
    "RetrievalReport",
    "RetrievalRow",
    "RetrievalTrial",
    "build_prompts",
    "check_digits",
    "evaluate_retrieval",
    "is_retrieval_jsonl",
    "needle_prompt",
    "passkey_prompt",
    "retrieval_rows",
    "score_prompt",
    "write_retrieval_jsonl",
]
