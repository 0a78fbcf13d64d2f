"""Every setting of oomb, declared once: typed dataclasses, one per concern.

- :mod:`oomb.config.engine`: :class:`OOMBConfig` (chunking and attention) with its :class:`SparseConfig`,
  :class:`OffloadConfig` and :class:`KernelConfig` sections -- what :class:`oomb.Engine` takes;
- :mod:`oomb.config.job`: the model, data, training, output, validation and per-command sections of an ``oomb`` run,
  gathered in :class:`JobConfig`;
- :mod:`oomb.config.flags`: the ``oomb`` flags, generated from those fields;
- :mod:`oomb.config.io`: YAML files of the same fields (``oomb train --config``, ``--print-config``).

A bad value raises :class:`ConfigError` (a ``ValueError``) naming the field and the fix.
"""

from .engine import KernelConfig, OffloadConfig, OOMBConfig, SparseConfig
from .errors import ConfigError
from .job import (BenchConfig, DataConfig, DataMakeConfig, DataReportConfig, EvalConfig, GradErrorConfig, JobConfig, ModelConfig,
                  OutputConfig, PlanConfig, TrainConfig, ValidationConfig, resolve_dtype)

__all__ = [
    "BenchConfig", "ConfigError", "DataConfig", "DataMakeConfig", "DataReportConfig", "EvalConfig", "GradErrorConfig", "JobConfig",
    "KernelConfig", "ModelConfig", "OOMBConfig", "OffloadConfig", "OutputConfig", "PlanConfig", "SparseConfig", "TrainConfig",
    "ValidationConfig", "resolve_dtype",
]
