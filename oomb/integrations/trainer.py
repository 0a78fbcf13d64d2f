"""``transformers.Trainer`` with oomb's engine as its training step.

Trainer keeps everything around the step: the optimizer and schedule it creates from ``TrainingArguments``,
gradient accumulation (``gradient_accumulation_steps`` sequences per optimizer step), clipping
(``max_grad_norm``), logging, checkpointing, callbacks. Each micro-batch is ONE sequence of any length: the
engine runs its chunk-recurrent forward and backward and accumulates the gradients into the model, so memory
follows ``OOMBConfig.chunk_size``, not the sequence.

Sources: the training loop of ``transformers.Trainer._inner_training_loop`` (``get_batch_samples`` counts the
step's targets, ``training_step`` returns the detached loss it adds to the log).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from ..config import OOMBConfig
from ..config.engine import check_config_type
from ..engine.engine import Engine

__all__ = ["OOMBTrainer", "collate_one_sequence"]


def _as_row(value) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    return t.reshape(1, -1).long()


def collate_one_sequence(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The data collator of :class:`OOMBTrainer`: one example -> ``input_ids [1, T]`` and, when the example has
    them, ``labels [1, T]`` (``-100`` = no loss; shifted by the engine) and ``cu_seqlens [D + 1]`` (document
    bounds: attention and positions restart at each).

    Raises:
        ValueError: more than one example (the batch is one long sequence: use ``per_device_train_batch_size=1``
            and ``gradient_accumulation_steps`` for more sequences per step), or no ``input_ids``.
    """
    if len(examples) != 1:
        raise ValueError(f"OOMBTrainer trains one sequence per micro-batch, got {len(examples)}; set "
                         "per_device_train_batch_size=1 and use gradient_accumulation_steps for more sequences per step")
    ex = examples[0]
    if "input_ids" not in ex:
        raise ValueError(f"a training example needs input_ids; it has {sorted(ex)}")
    batch = {"input_ids": _as_row(ex["input_ids"])}
    if ex.get("labels") is not None:
        batch["labels"] = _as_row(ex["labels"])
    if ex.get("cu_seqlens") is not None:
        batch["cu_seqlens"] = _as_row(ex["cu_seqlens"]).view(-1)
    return batch


class OOMBTrainer(Trainer):
    """A ``transformers.Trainer`` whose training step is :meth:`oomb.Engine.step` on one long sequence.

    Args:
        model: a supported Hugging Face causal LM (Qwen2/2.5, Llama, Mistral, Qwen3; a peft model for LoRA).
        args: ``TrainingArguments``; ``per_device_train_batch_size`` must be 1 (one sequence per micro-batch).
        oomb_config: the engine's settings (chunk size, pages, attention backend, sparse, offload); default
            :class:`oomb.OOMBConfig()`.
        **kwargs: the rest of ``Trainer``'s arguments (``train_dataset`` of examples with ``input_ids`` and
            optionally ``labels`` / ``cu_seqlens``; ``callbacks``; ...). The data collator defaults to
            :func:`collate_one_sequence`.

    The loss of an optimizer step is the mean cross-entropy over every valid target of its
    ``gradient_accumulation_steps`` sequences (the normaliser ``oomb train`` uses), and so are its gradients.

    Raises:
        TypeError: ``oomb_config`` is not an :class:`oomb.OOMBConfig`.
        ValueError: ``per_device_train_batch_size`` is not 1, several processes (under torchrun use
            ``oomb train``, whose step sums gradients over ranks itself), or a model the engine cannot run.
    """

    def __init__(self, model=None, args=None, *, oomb_config: OOMBConfig | None = None, **kwargs) -> None:
        check_config_type(oomb_config, "oomb_config")  # before Trainer places the model
        kwargs.setdefault("data_collator", collate_one_sequence)
        super().__init__(model=model, args=args, **kwargs)
        if self.args.per_device_train_batch_size != 1:
            raise ValueError(f"OOMBTrainer trains one sequence per micro-batch, per_device_train_batch_size is "
                             f"{self.args.per_device_train_batch_size}; set it to 1 and use gradient_accumulation_steps")
        if self.args.world_size > 1:
            raise ValueError("OOMBTrainer runs in one process; for several GPUs run 'torchrun ... oomb train'")
        self.engine = Engine(self.model, oomb_config if oomb_config is not None else OOMBConfig())

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> int:
        """The valid targets of the step's sequences (after the engine's shift and document bounds)."""
        return sum(self.engine.count_valid_tokens(b["input_ids"], b.get("labels"), b.get("cu_seqlens"))
                   for b in batch_samples)

    def training_step(self, model, inputs: dict[str, torch.Tensor], num_items_in_batch=None) -> torch.Tensor:
        """One sequence: the engine's forward and backward, gradients accumulated into ``model``.

        Returns:
            This sequence's share of the step's mean loss (a detached scalar on ``args.device``): the sum over
            the step's sequences is the step's loss.
        """
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        device = self.args.device
        ids = inputs["input_ids"].to(device)
        labels = inputs.get("labels")
        labels = labels.to(device) if labels is not None else None
        cu = inputs.get("cu_seqlens")
        total = int(num_items_in_batch) if num_items_in_batch is not None else None
        out = self.engine.step(ids, labels, cu_seqlens=cu, loss_normalizer=total)
        share = out.loss * out.num_valid_tokens / total if total else out.loss
        return torch.tensor(share, dtype=torch.float32, device=device)
