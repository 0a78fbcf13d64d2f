"""oomb inside other training frameworks: :class:`OOMBTrainer`, a ``transformers.Trainer`` whose training step
runs the chunk-recurrent engine on one long sequence."""

from .trainer import OOMBTrainer, collate_one_sequence

__all__ = ["OOMBTrainer", "collate_one_sequence"]
