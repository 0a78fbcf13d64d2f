"""Training around the engine: the learning-rate schedule, the order of sequences over ranks, one optimizer
step of gradient accumulation (:class:`Trainer`), the held-out loss between steps (:class:`HeldOutLoss`), and the
step log.

The CLI (``oomb train``) adds what is about files and flags: the output folder, checkpoints, signals and
messages. A Python program can drive :class:`Trainer` itself::

    from oomb.train import Trainer, SequenceStream
    trainer = Trainer(engine, optimizer, SequenceStream(sequences), config.train)
    for step in range(1, config.train.steps + 1):
        record = trainer.step(step)
"""

from .log import StepLog, TensorBoardLog
from .plot import plot_log
from .schedule import lr_at, warmup_steps
from .sequences import Sample, SequenceStream, document_bounds
from .step import StepError, StepRecord, StepStopped, Trainer
from .validation import HeldOutLoss, ValError, ValRecord, held_out

__all__ = ["HeldOutLoss", "Sample", "SequenceStream", "StepError", "StepLog", "StepRecord", "StepStopped", "TensorBoardLog",
           "Trainer", "ValError", "ValRecord", "document_bounds", "held_out", "lr_at", "plot_log", "warmup_steps"]
