"""Training around the engine: the learning-rate schedule, the order of sequences over ranks, one optimizer
step of gradient accumulation (:class:`Trainer`), and the step log.

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

__all__ = ["Sample", "SequenceStream", "StepError", "StepLog", "StepRecord", "StepStopped", "TensorBoardLog", "Trainer", "document_bounds",
           "lr_at", "plot_log", "warmup_steps"]
