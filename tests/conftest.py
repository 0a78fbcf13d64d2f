"""Test setup: on a machine without CUDA the Triton kernels run in the interpreter, and tests marked ``cuda`` are
skipped. Markers (pyproject.toml): ``cuda(reason=...)`` needs a GPU; ``slow`` takes tens of seconds or more on 2 CPU
cores (``-m "not slow"`` for a quick run; CI runs everything).

TRITON_INTERPRET must be set before triton is first imported, so it is set here, before any
test module is collected. ``OOMB_TEST_AUTOTUNE=first`` (for test runs on a GPU) autotunes every kernel over the
first config of its list only.
"""

import os
import sys

import pytest
import torch

# The shared helpers (configs.py) sit beside this file; test modules in the folders below import them by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # pytest -n N: the cores are shared among the N workers (torch would give each worker every core).
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    # The processes a test starts (the CLI, torchrun ranks, the Triton interpreter scripts, mp.spawn workers) get
    # the same share: with torch's default of every core, N workers' children oversubscribed the cores and spent
    # up to half their CPU time in OpenMP threads waiting on each other over tiny tensors.
    os.environ["OMP_NUM_THREADS"] = str(_threads)

if os.environ.get("OOMB_TEST_AUTOTUNE") == "first":
    # GPU test runs compile dozens of small shapes: autotune each kernel over the first config of its list only,
    # whatever kernels.autotune a test passes (the kernels' own setting is an argument; this is the test run's).
    from oomb.ops.triton.autotune import TunedKernel

    _getitem = TunedKernel.__getitem__
    TunedKernel.__getitem__ = lambda self, autotune: _getitem(self, "first" if autotune == "full" else autotune)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=marker.kwargs.get("reason", "needs CUDA")))
