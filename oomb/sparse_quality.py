"""How far sparse-attention gradients are from dense ones on the same data (the `oomb grad-error` tool).

OOMB's accuracy analysis (arXiv 2602.02108) compares the gradients of a sparse step with those
of a dense step. :func:`sparse_grad_error` runs one dense engine step and one sparse step per
page budget on the same sequence and the same weights, and reports for every parameter the
relative error ``||g_sparse - g_dense|| / ||g_dense||`` (Frobenius norms), plus the same over all
parameters together ("all") and the losses. :meth:`GradErrorReport.table` prints it as a
Markdown table, one row per parameter or per parameter kind (``q_proj``, ``mlp.down_proj``, ...
pooled over layers).

Memory: the dense gradients are kept on ``keep_on`` (default the CPU) in float32 while the sparse
steps run; the model's own ``.grad`` is restored afterwards.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .config import OOMBConfig, SparseConfig
from .engine.engine import Engine
from .ops.paged_attention import paged_backend, resolve_backend


def dense_like_sparse(config: OOMBConfig, device: torch.device) -> OOMBConfig:
    """``config.dense()`` on the attention kernels the sparse runs use (the block-table backend behind
    'sdpa'/'auto'), so that a sparse-vs-dense comparison measures the selection, not two kernels' rounding."""
    backend = paged_backend(resolve_backend(config.attention_backend, device), device)
    return dataclasses.replace(config.dense(), attention_backend=backend)


def check_budgets(budgets: Sequence[int]) -> list[int]:
    """``budgets`` as a list of page counts, or ValueError naming them when one is not an int >= 0 (0: the sink and
    local pages only, as ``SparseConfig.page_budget`` allows)."""
    budgets = list(budgets)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in budgets):
        raise ValueError(f"budgets must be page counts >= 0, got {budgets}")
    return budgets


def engines_by_budget(model: torch.nn.Module, config: OOMBConfig, budgets: Sequence[int],
                      reserve_tokens: int | None = None) -> Iterator[tuple[int | None, Engine]]:
    """``(None, dense engine)``, then ``(budget, sparse engine)`` per page budget, one alive at a time, the model
    in eval mode throughout (its mode restored at the end). The dense engine runs on the kernels of the sparse
    ones (:func:`dense_like_sparse`); the sparse ones take ``config``'s sparse settings with that budget.
    ``reserve_tokens``: each engine's KV store is sized for that many tokens before it is yielded."""
    sparse = config.sparse or SparseConfig()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for budget in [None, *budgets]:
            cfg = (dense_like_sparse(config, device) if budget is None
                   else dataclasses.replace(config, sparse=dataclasses.replace(sparse, page_budget=budget)))
            engine = Engine(model, cfg)
            if reserve_tokens is not None:
                engine.reserve(reserve_tokens)
            yield budget, engine
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        model.train(was_training)

__all__ = ["GradErrorReport", "check_budgets", "dense_like_sparse", "engines_by_budget", "sparse_grad_error"]


@dataclass
class GradErrorReport:
    """Result of :func:`sparse_grad_error`.

    Attributes:
        seq_len: tokens in the sequence.
        budgets: page budgets measured (pages of ``page_size`` tokens).
        dense_loss: mean token loss of the dense step.
        sparse_loss: budget -> mean token loss of the sparse step.
        names: parameter names, in model order.
        numel: name -> number of elements.
        dense_norm: name -> ||g_dense||.
        sq_diff: (budget, name) -> ||g_sparse - g_dense||^2.
    """

    seq_len: int
    budgets: list[int]
    dense_loss: float
    sparse_loss: dict[int, float] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    numel: dict[str, int] = field(default_factory=dict)
    dense_norm: dict[str, float] = field(default_factory=dict)
    sq_diff: dict[tuple[int, str], float] = field(default_factory=dict)

    def rel_error(self, budget: int, names: list[str] | None = None) -> float:
        """Relative gradient error of the given parameters pooled (all parameters by default)."""
        names = self.names if names is None else names
        num = sum(self.sq_diff[(budget, n)] for n in names)
        den = sum(self.dense_norm[n] ** 2 for n in names)
        return (num / den) ** 0.5 if den > 0 else float("nan")

    def groups(self, by: str = "kind") -> dict[str, list[str]]:
        """Parameter names grouped: by='parameter' (one each) or 'kind' (layer index removed)."""
        if by == "parameter":
            return {n: [n] for n in self.names}
        if by != "kind":
            raise ValueError(f"by must be 'parameter' or 'kind', got {by!r}")
        out: dict[str, list[str]] = {}
        for n in self.names:
            out.setdefault(re.sub(r"\.\d+\.", ".*.", n), []).append(n)
        return out

    def table(self, by: str = "kind") -> str:
        """Markdown table: one row per group, a column of relative errors per budget, then 'all' and the losses."""
        head = "| parameter | elements | dense grad norm | " + " | ".join(f"rel err @ {b} pages" for b in self.budgets) + " |"
        lines = [head, "|" + "---|" * (3 + len(self.budgets))]
        for name, members in self.groups(by).items():
            norm = sum(self.dense_norm[n] ** 2 for n in members) ** 0.5
            errs = " | ".join(f"{self.rel_error(b, members):.3e}" for b in self.budgets)
            lines.append(f"| {name} | {sum(self.numel[n] for n in members)} | {norm:.3e} | {errs} |")
        total = sum(self.numel.values())
        lines.append(f"| **all** | {total} | {sum(v * v for v in self.dense_norm.values()) ** 0.5:.3e} | "
                     + " | ".join(f"{self.rel_error(b):.3e}" for b in self.budgets) + " |")
        lines.append(f"| loss (dense {self.dense_loss:.6f}) | | | "
                     + " | ".join(f"{self.sparse_loss[b]:.6f}" for b in self.budgets) + " |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-friendly summary: losses and per-budget overall and per-parameter errors."""
        return {
            "seq_len": self.seq_len,
            "budgets": self.budgets,
            "dense_loss": self.dense_loss,
            "sparse_loss": {str(b): v for b, v in self.sparse_loss.items()},
            "rel_error_all": {str(b): self.rel_error(b) for b in self.budgets},
            "rel_error": {str(b): {n: self.rel_error(b, [n]) for n in self.names} for b in self.budgets},
        }


def _params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def sparse_grad_error(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    config: OOMBConfig,
    budgets: list[int] | tuple[int, ...] = (4, 16, 64),
    labels: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    keep_on: torch.device | str = "cpu",
) -> GradErrorReport:
    """Per-parameter relative gradient error of sparse attention against dense, on the same data.

    Args:
        model: a Hugging Face causal LM oomb supports (its ``.grad`` are restored on return).
        input_ids: int64 [T] or [1, T] one sequence.
        config: engine settings; ``sparse`` and ``page_budget`` are overridden (dense once, then
            sparse with each budget; the dense run uses the sparse runs' block-table kernels, so an
            'sdpa'/'auto' backend becomes 'triton' on CUDA, 'torch' on the CPU); ``sink_pages``, ``local_pages``, ``sparse_block_size`` and
            ``sparse_score`` are used as given (an ``OOMBConfig(sparse=True, ...)`` when they differ from the
            defaults: OOMBConfig refuses them with sparse off).
        budgets: page budgets to measure (pages of ``config.page_size`` tokens, each >= 0).
        labels, cu_seqlens: as in :meth:`oomb.Engine.step`.
        keep_on: where the dense gradients wait (float32) while the sparse steps run.

    Returns:
        :class:`GradErrorReport` (``.table()`` for the Markdown table).

    Raises:
        ValueError: for an empty or negative budget list, and whatever :meth:`Engine.step` raises.
    """
    budgets = list(budgets)
    if not budgets or any((not isinstance(b, int)) or b < 0 for b in budgets):
        raise ValueError(f"budgets must be a non-empty list of page counts >= 0, got {budgets}")
    params = _params(model)
    saved = [p.grad for _, p in params]
    try:
        for _, p in params:
            p.grad = None
        device = next(model.parameters()).device
        out = Engine(model, dense_like_sparse(config, device)).step(input_ids, labels, cu_seqlens=cu_seqlens)
        report = GradErrorReport(seq_len=out.num_tokens, budgets=budgets, dense_loss=out.loss)
        dense = {}
        for n, p in params:
            g = torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.float()
            dense[n] = g.to(keep_on)
            report.names.append(n)
            report.numel[n] = p.numel()
            report.dense_norm[n] = float(g.norm())
            p.grad = None
        for b in budgets:
            cfg = dataclasses.replace(config, sparse=dataclasses.replace(config.sparse or SparseConfig(), page_budget=b))
            out = Engine(model, cfg).step(input_ids, labels, cu_seqlens=cu_seqlens)
            report.sparse_loss[b] = out.loss
            for n, p in params:
                g = torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.float()
                report.sq_diff[(b, n)] = float((g - dense[n].to(g.device)).norm()) ** 2
                p.grad = None
    finally:
        for (_, p), g in zip(params, saved):
            p.grad = g
    return report
