"""Test-session setup: on a machine without CUDA the Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, before any
test module is collected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
