"""GPU memory the 'sdpa' attention backend's backward holds beyond its inputs and outputs, per past length and shape.

For each attention shape (``Hq:Hkv:D``) and past length: a chunk of ``--chunk-size`` queries over one contiguous
past run plus its own keys (:mod:`oomb.ops.sdpa_attention`), bf16, past dK/dV in float32 views. The forward runs
first; then with every input, the forward's out/lse and the float32 gradient views allocated, the peak of
``torch.cuda.max_memory_allocated`` during :func:`~oomb.ops.sdpa_attention.sdpa_attention_bwd` minus the memory
before it and minus the outputs it returns (dq, the own dk/dv) is the transient. One JSON line per case, with the
transient per past token in bytes and in units of ``Hq * D`` and ``Hkv * D`` (what the memory model needs:
:func:`oomb.memory.activation_bytes`, ``attention_temp``).

Usage (CUDA): ``python benchmarks/bench_sdpa_memory.py --out sdpa_memory.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from oomb.ops import sdpa_attention as sa  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["28:4:128", "14:2:64", "32:8:128", "16:16:128"], help="Hq:Hkv:D")
    p.add_argument("--pasts", type=int, nargs="+", default=[32768, 131072, 258048])
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--out", required=True, help="JSON lines, appended")
    a = p.parse_args(argv)
    dev, bf = torch.device("cuda"), torch.bfloat16
    meta = dict(kind="run", gpu=torch.cuda.get_device_name(dev), torch=torch.__version__,
                cudnn=torch.backends.cudnn.version(), chunk_size=a.chunk_size)
    rows = [meta]
    C = a.chunk_size
    for spec in a.shapes:
        Hq, Hkv, D = (int(x) for x in spec.split(":"))
        for past in a.pasts:
            q, dout = (torch.randn(C, Hq, D, device=dev, dtype=bf) for _ in range(2))
            k, v = (torch.randn(C, Hkv, D, device=dev, dtype=bf) for _ in range(2))
            pk, pv = (torch.randn(past, Hkv, D, device=dev, dtype=bf) for _ in range(2))
            pdk, pdv = (torch.zeros(past, Hkv, D, device=dev, dtype=torch.float32) for _ in range(2))
            scale = D ** -0.5
            out, lse = sa.sdpa_attention_fwd(q, k, v, [(pk, pv)], scale)
            for _ in range(2):  # the second call is the measured one (the first builds cuDNN's graph and plan)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
                before = torch.cuda.memory_allocated(dev)
                dq, dk, dv = sa.sdpa_attention_bwd(dout, q, k, v, out, lse, [(pk, pv)], [(pdk, pdv)], scale)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated(dev)
                kept = sum(t.untyped_storage().nbytes() for t in (dq, dk, dv))
                transient = peak - before - kept
                del dq, dk, dv
            row = dict(kind="case", Hq=Hq, Hkv=Hkv, D=D, chunk=C, past=past, transient_bytes=transient,
                       per_past_token=transient / past, per_past_token_over_q_dim=transient / past / (Hq * D),
                       per_past_token_over_kv_dim=transient / past / (Hkv * D))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, dout, k, v, pk, pv, pdk, pdv, out, lse
            torch.cuda.empty_cache()
    with open(a.out, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
