"""oomb: chunk-recurrent long-context training of Hugging Face causal LMs on one GPU.

Public API::

    from oomb import Engine, OOMBConfig
    engine = Engine(model, OOMBConfig(chunk_size=4096, page_size=128))
    out = engine.step(input_ids)   # two-stage step; gradients accumulate into the model
"""

from .config import OOMBConfig
from .engine.engine import Engine, StepOutput
from .models.hf import UnsupportedModelError, check_model_supported
from .models.presets import build_model

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "OOMBConfig",
    "StepOutput",
    "UnsupportedModelError",
    "build_model",
    "check_model_supported",
    "__version__",
]
