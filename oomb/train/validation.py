"""Held-out loss during training (``oomb train --val-every``): the first sequences of held-out data, evaluated with
the run's engine between optimizer steps, without changing what the training does next.

The held-out sequences are built as the training ones are (:func:`oomb.data.build_training_data` of the same data
settings: ``seq_len`` tokens, labels with -100 where no loss is taken, document bounds), and taken in file order
(:func:`held_out`), so every evaluation reads the same tokens and the points of the curve are comparable.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..distributed import DistributedContext, RankFailedError, agree_ok, global_sum
from ..memory import is_out_of_memory
from .sequences import Sample, sample_bounds

__all__ = ["HeldOutLoss", "ValError", "ValRecord", "held_out"]


@dataclass(frozen=True)
class ValRecord:
    """One evaluation of the held-out loss: a ``log.jsonl`` line of its own, told from a step record
    (:class:`~oomb.train.StepRecord`) by its ``val_loss`` key and its lack of ``loss``.

    ``step``: the optimizer steps done when it was evaluated; ``val_loss``: the mean cross-entropy (nats/token) over
    every valid target of the held-out sequences (each sequence's mean weighted by its valid targets);
    ``val_tokens``: those targets; ``val_sequences``: the sequences evaluated (over every rank); ``val_seconds``:
    wall-clock seconds of the evaluation.
    """

    step: int
    val_loss: float
    val_tokens: int
    val_sequences: int
    val_seconds: float

    def to_json(self) -> dict:
        """The record rounded as ``log.jsonl`` stores it."""
        r = asdict(self)
        r["val_loss"] = round(r["val_loss"], 6)
        r["val_seconds"] = round(r["val_seconds"], 4)
        return r


class ValError(RuntimeError):
    """An evaluation of the held-out loss failed on this rank or another; ``kind`` is ``"out_of_memory"``,
    ``"data"`` (the engine refused a sequence), ``"other_rank"`` or ``"non_finite"``; ``detail`` the error's
    message. The model, the optimizer and the random generators are as they were before it."""

    def __init__(self, step: int, kind: str, detail: str = "") -> None:
        super().__init__(f"held-out loss at step {step}: {kind}{': ' + detail if detail else ''}")
        self.step, self.kind, self.detail = step, kind, detail


def held_out(data, count: int) -> list[Sample]:
    """The first ``count`` sequences of ``data`` (a :class:`~oomb.data.TrainingData`) in file order: its indices
    ``0 .. count - 1``, not the seeded order training reads (fewer where ``data`` has fewer)."""
    out = []
    for i in range(min(count, len(data))):
        item = data[i]
        out.append(item if isinstance(item, Sample) else Sample(item))
    return out


def _random_state() -> tuple:
    """Every random generator a step may draw from: Python's, numpy's global one, torch's CPU and CUDA ones."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_random_state(state: tuple) -> None:
    py, npy, cpu, cuda = state
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class HeldOutLoss:
    """The token-weighted mean loss of held-out sequences with the run's engine, on one rank or under torchrun.

    Each sequence runs :meth:`oomb.Engine.evaluate` (a no-grad chunked forward) with the document bounds training
    gives it (:func:`~oomb.train.sequences.sample_bounds`, as :meth:`Trainer.document_bounds`); its mean is weighted
    by its valid targets. Under torchrun rank ``r`` of ``W`` evaluates the sequences ``r, r + W, ...`` and the sums
    are all-reduced, so every rank gets the same record. With a sharded model (FSDP2) every forward is a collective:
    each rank then runs ``ceil(n / W)`` forwards, a rank with fewer sequences repeating one whose result it does not
    count.

    An evaluation leaves the optimizer and the gradients alone, restores every random generator (Python, numpy,
    torch CPU and CUDA) and every module's train/eval mode afterwards (it runs in eval mode), so a run with
    evaluations trains exactly as one without them (and a resumed run as an uninterrupted one).

    Args:
        engine: the run's :class:`oomb.Engine`.
        samples: the held-out sequences (:func:`held_out`), the same on every rank.
        dist, device, eos_token_id, document_mask, sharding: as :class:`~oomb.train.Trainer` takes them.

    Raises:
        ValueError: no sequence of ``samples`` has a valid target (or ``samples`` is empty), or the engine refuses
            one (a token outside the vocabulary, malformed bounds).
    """

    def __init__(self, engine, samples: list[Sample], *, dist: DistributedContext | None = None,
                 device: torch.device | None = None, eos_token_id: int | None = None, document_mask: bool = False,
                 sharding=None) -> None:
        self.engine, self.sharding = engine, sharding
        self.dist = dist or DistributedContext()
        self.device = device if device is not None else torch.device("cpu")
        kept = []
        for s in samples:
            cu = sample_bounds(s, document_mask, eos_token_id)
            n = engine.count_valid_tokens(s.input_ids, s.labels, cu)
            if n > 0:
                kept.append((s.input_ids, s.labels, cu, n))
        if not kept:
            raise ValueError(f"none of the {len(samples):,} held-out sequences has a token that carries a loss")
        self.sequences = kept
        self.tokens = sum(k[3] for k in kept)

    def evaluate(self, step: int) -> ValRecord:
        """The held-out loss after optimizer step ``step``; every rank calls it at the same step.

        Raises:
            ValError: an evaluation failed on this rank or another (every rank raises it, except with a sharded
                model, where a rank that fails inside a forward raises at once, as a training step does).
        """
        W, rank = self.dist.world_size, self.dist.rank
        mine = self.sequences[rank::W]
        passes = -(-len(self.sequences) // W) if self.sharding is not None else len(mine)
        model = self.engine.model
        modes = [(m, m.training) for m in model.modules()]
        state = _random_state()
        t0 = time.perf_counter()
        loss_sum, error = 0.0, None
        try:
            model.eval()
            try:
                for i in range(passes):
                    ids, labels, cu, n = mine[i] if i < len(mine) else self.sequences[0]
                    loss = self.engine.evaluate(ids.to(self.device), labels.to(self.device) if labels is not None else None, cu)
                    if i < len(mine):
                        loss_sum += loss * n
            except ValueError as exc:
                error = ValError(step, "data", str(exc))
            except RuntimeError as exc:
                if not is_out_of_memory(exc):
                    raise
                error = ValError(step, "out_of_memory", str(exc).splitlines()[0] if str(exc) else "")
            if self.sharding is not None:
                if error is not None:
                    raise error
                self.sharding.end_step()  # the layers and root kept gathered by the forwards
            if self.dist.enabled:
                try:
                    agree_ok(error is None, self.device)
                except RankFailedError as exc:
                    raise ValError(step, "other_rank") from exc
            if error is not None:
                raise error
            if self.dist.enabled:
                loss_sum = global_sum(loss_sum, self.device)
        finally:
            for m, training in modes:
                m.training = training
            _set_random_state(state)
        loss = loss_sum / self.tokens
        if not math.isfinite(loss):
            raise ValError(step, "non_finite", str(loss))
        return ValRecord(step=step, val_loss=loss, val_tokens=self.tokens, val_sequences=len(self.sequences),
                         val_seconds=time.perf_counter() - t0)
