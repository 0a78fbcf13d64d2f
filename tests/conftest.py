"""Test setup: on a machine without CUDA the Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, before any
test module is collected. ``OOMB_TEST_AUTOTUNE=first`` (for test runs on a GPU) autotunes every kernel over the
first config of its list only.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("OOMB_TEST_AUTOTUNE") == "first":
    # GPU test runs compile dozens of small shapes: autotune each kernel over the first config of its list only,
    # whatever kernels.autotune a test passes (the kernels' own setting is an argument; this is the test run's).
    from oomb.ops.triton.autotune import TunedKernel

    _getitem = TunedKernel.__getitem__
    TunedKernel.__getitem__ = lambda self, autotune: _getitem(self, "first" if autotune == "full" else autotune)
