"""oomb: chunk-recurrent long-context training of Hugging Face causal LMs on one GPU.

Public API::

    from oomb import Engine, OOMBConfig
    engine = Engine(model, OOMBConfig(chunk_size=4096, page_size=128))
    out = engine.step(input_ids)   # two-stage step; gradients accumulate into the model
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The public names are imported on first use (PEP 562), so that `oomb --help`, `--version` and argument
# errors answer without importing torch and transformers (~6 s on a small machine).
_LAZY = {
    "OOMBConfig": ".config",
    "Engine": ".engine.engine",
    "StepOutput": ".engine.engine",
    "UnsupportedModelError": ".models.hf",
    "check_model_supported": ".models.hf",
    "build_model": ".models.presets",
}

if TYPE_CHECKING:  # for type checkers and IDEs
    from .config import OOMBConfig
    from .engine.engine import Engine, StepOutput
    from .models.hf import UnsupportedModelError, check_model_supported
    from .models.presets import build_model


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'oomb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "Engine",
    "OOMBConfig",
    "StepOutput",
    "UnsupportedModelError",
    "build_model",
    "check_model_supported",
    "__version__",
]
