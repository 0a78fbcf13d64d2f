"""One optimizer step of ``oomb train``: gradient accumulation over a rank's sequences, the all-reduce over
ranks, clipping and the optimizer update (:class:`Trainer`)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from ..distributed import DistributedContext, RankFailedError, agree_ok, all_reduce_gradients, clip_grad_norm, global_sum
from ..engine.engine import NO_TARGETS
from ..memory import is_out_of_memory
from .schedule import lr_at, warmup_steps
from .sequences import Sample, SequenceStream, sample_bounds

__all__ = ["StepError", "StepRecord", "StepStopped", "Trainer"]


class StepError(RuntimeError):
    """A step failed; nothing of it was applied to the model or the optimizer.

    Attributes:
        step: the step (from 1).
        kind: ``"data"`` (the engine refused a sequence, e.g. a document too short to hold a target),
            ``"out_of_memory"`` (an allocation failed: the GPU or host ran out of memory), ``"other_rank"`` (another rank failed: its error
            is reported there), ``"non_finite"`` (the loss is NaN or infinite; ``loss`` holds it) or
            ``"non_finite_update"`` (the optimizer's update overflowed or left a weight NaN or infinite, e.g. at a
            learning rate far too large). Only for ``"non_finite_update"`` was the step applied: the weights are
            then unusable, and neither the model nor a checkpoint should be saved from them.
        detail: the underlying error's message ('' where there is none).
    """

    def __init__(self, step: int, kind: str, detail: str = "", loss: float | None = None) -> None:
        super().__init__(f"step {step}: {kind}{': ' + detail if detail else ''}")
        self.step, self.kind, self.detail, self.loss = step, kind, detail, loss


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step did: the record of a ``log.jsonl`` line.

    ``loss`` is the mean cross-entropy over the step's valid targets on every rank (nats/token);
    ``num_tokens`` counts the tokens of every rank; ``peak_memory_bytes`` is this rank's peak GPU memory
    (``None`` on the CPU); times are seconds of wall clock; ``kept_graphs`` counts the chunks of this rank's
    sequences whose Stage-2 recompute was skipped (``OOMBConfig.keep_graphs``).
    """

    step: int
    loss: float
    tokens_per_s: float
    peak_memory_bytes: Optional[int]
    seconds: float
    lr: float
    grad_norm: float
    num_tokens: int
    stage1_seconds: float
    stage2_seconds: float
    kept_graphs: int = 0

    def to_json(self) -> dict:
        """The record rounded as ``log.jsonl`` stores it."""
        r = asdict(self)
        for key, digits in (("loss", 6), ("tokens_per_s", 2), ("seconds", 4), ("grad_norm", 6),
                            ("stage1_seconds", 4), ("stage2_seconds", 4)):
            r[key] = round(r[key], digits)
        return r


@dataclass(frozen=True)
class StepStopped:
    """A step stopped between two sequences of its accumulation: ``sequences_done`` of ``sequences`` had run;
    their gradients were dropped, so the model and the optimizer are those after ``step - 1``."""

    step: int
    sequences_done: int
    sequences: int


def _weights_finite(params) -> bool:
    """Whether every element of ``params`` (this rank's shards where they are ``DTensor``) is finite: their
    max-abs norm (``torch.nn.utils.get_total_norm``, fused per device and dtype, no temporary of a weight's size),
    which carries a NaN or an infinity through, and one host sync."""
    from torch.distributed.tensor import DTensor

    local = [p.detach().to_local() if isinstance(p, DTensor) else p.detach() for p in params]
    local = [t for t in local if t.numel()]  # the infinity norm of an empty tensor is undefined
    return not local or bool(torch.isfinite(torch.nn.utils.get_total_norm(local, float("inf"))))


def _check_types(engine, optimizer, stream, train) -> None:
    """Raise the TypeError of a :class:`Trainer` argument that is not of its type, naming what was passed and
    what to pass."""
    from ..config import TrainConfig
    from ..engine.engine import Engine

    expected = (
        ("engine", engine, Engine, "pass oomb.Engine(model, OOMBConfig(...))"),
        ("optimizer", optimizer, torch.optim.Optimizer, "pass a torch.optim.Optimizer, e.g. "
                                                        "torch.optim.AdamW(model.parameters(), lr=3e-4)"),
        ("stream", stream, SequenceStream, "wrap the sequences: SequenceStream(sequences) (from oomb.train)"),
        ("train", train, TrainConfig, "pass TrainConfig(steps=..., lr=...) (from oomb.config)"
         + (", e.g. TrainConfig(**that_dict)" if isinstance(train, dict) else "")),
    )
    for name, value, cls, fix in expected:
        if not isinstance(value, cls):
            got = f"the class {cls.__name__} itself" if value is cls else type(value).__name__
            raise TypeError(f"{name} must be a {cls.__name__}, got {got}; {fix}")


class Trainer:
    """Optimizer steps of the engine over a :class:`SequenceStream`, on one rank or under torchrun.

    Each step trains ``train.grad_accum`` sequences on every rank; gradients accumulate in the model, the loss
    is normalised by the valid targets of the whole step (all ranks), gradients are summed over ranks once
    (all-reduced; with a sharded model FSDP2 reduce-scatters them, :mod:`oomb.engine.sharding`), clipped to
    ``train.max_grad_norm`` (0: no clipping; the norm of the whole gradient over all shards) and applied at the
    learning rate of :func:`~oomb.train.schedule.lr_at`.

    Every sequence is checked (its targets counted) on every rank before any rank runs a step, and the ranks agree
    on the outcome: a sequence without a target stops every rank with its error. With a sharded model the step
    itself is full of collectives, so a rank that fails inside it (out of memory) raises at once without telling
    the others, which wait in their next collective until torchrun ends them (it does when a rank exits) or the
    process group's timeout.

    Args:
        engine: an :class:`oomb.Engine` over the model being trained.
        optimizer: a ``torch.optim.Optimizer`` over ``params``.
        stream: the sequences, in run order.
        train: the :class:`oomb.config.TrainConfig` (steps, grad_accum, lr, lr_schedule, min_lr_factor, warmup_steps,
            max_grad_norm).
        params: the trainable parameters (default: every parameter the optimizer holds).
        dist: the process group's :class:`~oomb.distributed.DistributedContext` (default: one process).
        device: where collectives run (the model's device).
        eos_token_id: with ``document_mask``, documents end after each such token (a :class:`Sample` that
            carries its own ``cu_seqlens`` keeps them).
        document_mask: attention and positions restart per document.
        progress: show the engine's per-chunk progress bar.
        sharding: the model's :class:`~oomb.engine.sharding.Sharding` (None: not sharded).

    Raises:
        TypeError: ``engine``, ``optimizer``, ``stream`` or ``train`` is not of its type (a model for the engine,
            a plain sequence source for the stream, a dict for the TrainConfig), naming what to pass.
    """

    def __init__(self, engine, optimizer: torch.optim.Optimizer, stream: SequenceStream, train, *, params=None,
                 dist: DistributedContext | None = None, device: torch.device | None = None,
                 eos_token_id: int | None = None, document_mask: bool = False, progress: bool = False,
                 sharding=None) -> None:
        _check_types(engine, optimizer, stream, train)
        self.engine, self.optimizer, self.stream, self.train = engine, optimizer, stream, train
        self.params = list(params) if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
        self.dist = dist or DistributedContext()
        self.device = device if device is not None else torch.device("cpu")
        self.eos_token_id, self.document_mask, self.progress = eos_token_id, document_mask, progress
        self.warmup = warmup_steps(train.steps, train.warmup_steps)
        self.sharding = sharding

    def lr(self, step: int) -> float:
        """The learning rate of ``step`` (from 1)."""
        t = self.train
        return lr_at(step, lr=t.lr, steps=t.steps, warmup=self.warmup, schedule=t.lr_schedule, floor=t.min_lr_factor)

    def document_bounds(self, sample: Sample) -> torch.Tensor | None:
        """The ``cu_seqlens`` a sample trains with: its own, else (``document_mask``) a document ends after each
        EOS token, else ``None``."""
        return sample_bounds(sample, self.document_mask, self.eos_token_id)

    def _agree(self, ok: bool, step: int) -> None:
        """Every rank learns whether every rank got here without an error (no rank waits on a failed one)."""
        if self.dist.enabled:
            try:
                agree_ok(ok, self.device)
            except RankFailedError as exc:
                raise StepError(step, "other_rank") from exc

    def step(self, step: int, should_stop: Callable[[], bool] = lambda: False) -> StepRecord | StepStopped:
        """Train optimizer step ``step`` (from 1).

        Args:
            should_stop: asked between two sequences of one rank's accumulation (single process only): True
                drops the step's gradients and returns :class:`StepStopped` (the model and optimizer stay as
                after ``step - 1``).

        Returns:
            The step's :class:`StepRecord`, or :class:`StepStopped`.

        Raises:
            ValueError: ``step`` is below 1.
            StepError: the step failed on this rank or another; every rank raises it.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"step is {step!r}: optimizer steps are counted from 1 (the first is trainer.step(1))")
        K, W = self.train.grad_accum, self.dist.world_size
        lr = self.lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        error = None
        micro = []
        try:
            for s in self.stream.of_step(step, K, self.dist.rank, W):
                ids = s.input_ids.to(self.device)
                labels = s.labels.to(self.device) if s.labels is not None else None
                cu = self.document_bounds(s)
                n = self.engine.count_valid_tokens(ids, labels, cu)
                if n == 0:  # what engine.step would refuse, found before any rank starts the step's collectives
                    raise ValueError(NO_TARGETS)
                micro.append((ids, labels, cu, n))
        except ValueError as exc:
            error = StepError(step, "data", str(exc))
        self._agree(error is None, step)
        if error is not None:
            raise error
        local_valid = sum(m[3] for m in micro)
        total_valid = int(round(global_sum(local_valid, self.device))) if self.dist.enabled else local_valid
        stoppable = K > 1 and not self.dist.enabled
        loss_sum, results = 0.0, []
        try:
            for i, (ids, labels, cu, _) in enumerate(micro):
                if i > 0 and stoppable and should_stop():
                    self.optimizer.zero_grad(set_to_none=True)
                    return StepStopped(step, i, K)
                r = self.engine.step(ids, labels, progress=self.progress, cu_seqlens=cu,
                                     loss_normalizer=total_valid if (K > 1 or W > 1) else None,
                                     sync_gradients=i == len(micro) - 1)
                results.append(r)
                loss_sum += r.loss * r.num_valid_tokens
        except ValueError as exc:
            error = StepError(step, "data", str(exc))
        except RuntimeError as exc:  # torch.OutOfMemoryError, or the CPU allocator's RuntimeError
            if not is_out_of_memory(exc):
                raise
            error = StepError(step, "out_of_memory", str(exc).splitlines()[0] if str(exc) else "")
        if self.sharding is not None:
            if error is not None:  # the other ranks are inside the step's collectives: no agreement can be reached
                raise error
            self.sharding.end_step()
        self._agree(error is None, step)
        if error is not None:
            self.optimizer.zero_grad(set_to_none=True)
            raise error
        loss = (global_sum(loss_sum, self.device) if self.dist.enabled else loss_sum) / total_valid
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            raise StepError(step, "non_finite", loss=loss)
        if self.sharding is None:
            all_reduce_gradients(self.params)
        max_norm = self.train.max_grad_norm if self.train.max_grad_norm > 0 else float("inf")
        grad_norm = clip_grad_norm(self.params, max_norm)
        try:
            self.optimizer.step()
        except RuntimeError as exc:  # an update too large for the weights' dtype (torch: "... without overflow")
            if "overflow" not in str(exc):
                raise
            error = StepError(step, "non_finite_update", str(exc).splitlines()[0])
        else:
            error = None if _weights_finite(self.params) else StepError(step, "non_finite_update")
        self.optimizer.zero_grad(set_to_none=True)
        self._agree(error is None, step)
        if error is not None:
            raise error
        seconds = time.perf_counter() - t0
        num_tokens = sum(r.num_tokens for r in results) * W
        peaks = [r.peak_memory_bytes for r in results if r.peak_memory_bytes is not None]
        return StepRecord(
            step=step, loss=loss, tokens_per_s=num_tokens / seconds if seconds > 0 else 0.0,
            peak_memory_bytes=max(peaks) if peaks else None, seconds=seconds, lr=lr, grad_norm=grad_norm,
            num_tokens=num_tokens, stage1_seconds=sum(r.stage1_seconds for r in results),
            stage2_seconds=sum(r.stage2_seconds for r in results), kept_graphs=sum(r.kept_graphs for r in results))
