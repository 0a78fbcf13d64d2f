"""End to end with the Triton kernels: the dense chunked step equals full-sequence training
(one sequence, and packed documents against separate training of each document).

The kernels run under the Triton interpreter on CPU tensors, also on a machine with a GPU (the
tiny models of tests/test_engine.py live on the CPU; the bf16 parity on a GPU is
benchmarks/check_gpu_parity.py). The interpreter must be switched on before triton is first
imported, so the check runs in a fresh interpreter process.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a subprocess runs the Triton interpreter over three model families

pytest.importorskip("triton", reason="triton is not installed (pip install 'oomb[triton]')")

SCRIPT = r"""
import json, os, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_engine import tiny, run_parity, packed_parity
case = sys.argv[2]
cases = {"qwen2": (4, 2, 45, 16, 8), "llama": (7, 1, 40, 16, 16), "qwen3": (4, 4, 37, 8, 8)}
if case in cases:
    h, kv, T, C, P = cases[case]
    out, ref_loss, (err, where), _ = run_parity(tiny(case, h, kv, head_dim=16), T, C, P, dtype=torch.float32,
                                                attention_backend="triton")
else:  # packed documents against separate training of each
    out, ref_loss, n_valid, (err, where), _ = packed_parity("qwen2", [13, 1, 22, 9, 1, 17], 16, 8, backend="triton",
                                                           dtype=torch.float32)
print("RESULT " + json.dumps(dict(family=case, loss=out.loss, ref_loss=ref_loss, err=err, where=where)))
"""


def _numpy_too_new_for_interpreter() -> bool:
    """triton 3.6's interpreter fails with numpy >= 2.4 ("only 0-dimensional arrays can be converted");
    pyproject pins numpy < 2.4, but a GPU machine's preinstalled stack may not follow that pin."""
    import numpy

    major, minor = (int(x) for x in numpy.__version__.split(".")[:2])
    return (major, minor) >= (2, 4)


@pytest.mark.skipif(_numpy_too_new_for_interpreter(), reason="the Triton interpreter needs numpy < 2.4 (pip install 'numpy<2.4')")
@pytest.mark.parametrize("case", ["qwen2", "llama", "qwen3", "qwen2-packed"])
def test_dense_parity_triton_backend_fp32(case):
    """One process per case, so that the cases (each a Triton interpreter run of tens of seconds) spread over the
    test workers."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tensors only, so the engine resolves every device to the CPU
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, here, case], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * r["ref_loss"], r
    assert r["err"] <= 1e-5, f"{r['family']}: worst gradient {r['where']}: rel err {r['err']:.3e}"
