"""End-to-end parity on the GPU: oomb's dense chunked step vs full-sequence HF training (bf16 rule).

A small model with Qwen2.5-7B attention shapes (28 query heads, 4 KV heads, head
dim 128) but few layers. Three runs on the same weights and tokens:

* ``ref32``: full-sequence HF training in float32 (SDPA math) -- the reference;
* ``hf16``: the same in bf16 -- what plain training gives;
* ``oomb16``: oomb's two-stage step in bf16 with the chosen attention backend (and, with ``--offload on``,
  its pages offloaded: half of them on the GPU, the rest staged in ``--offload-segment-pages`` segments).

Pass: for the loss and every parameter gradient, ``err(oomb16, ref32) <= 2 *
err(hf16, ref32) + 1e-6`` (relative Frobenius errors; flash-attention's rule).
Writes a JSON report to --out and exits non-zero on failure.

With ``--sparse-budget B`` the step is sparse (page budget B, ``--sink-pages``, ``--local-pages``), which no
full-sequence model computes. Its references are the same sparse step through the engine's PyTorch attention
(``attention_backend='torch'``): ``ref32`` in float32 and, as the plain-bf16 level, ``ref16`` in bf16. Page
selection depends on the keys' precision, so both references replay the pages the ``oomb16`` run selected
(every (chunk, layer) selection recorded, then returned instead of selecting again): the check compares the
attention over the same pages, and a kernel that reads a wrong page or masks a wrong token fails it. Pass:
``err(oomb16, ref32) <= 2 * err(ref16, ref32) + 1e-6``, as above. Writes ``gpu_parity_sparse.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from oomb import Engine, OOMBConfig  # noqa: E402
from oomb.config import OffloadConfig, SparseConfig  # noqa: E402
from oomb.engine.sparse_state import SparseAttentionState  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402


def full_step(model, ids):
    model.set_attn_implementation("sdpa")
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits[0].float()
    t = torch.cat([ids[0, 1:], ids.new_full((1,), -100)])
    loss = F.cross_entropy(logits, t, ignore_index=-100)
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def selections(record: dict, replay: bool):
    """Within: every new sparse selection of the engine goes into ``record`` by (chunk start, layer), or, with
    ``replay``, is taken from ``record`` instead of being made (a missing one raises KeyError)."""
    made = SparseAttentionState.selection

    def selection(self, layer, start, q, q_doc_start, record_pages=False):
        key = (start, layer)
        if not replay or key in self.selections:
            sel = made(self, layer, start, q, q_doc_start, record_pages)
            record.setdefault(key, sel)
            return sel
        sel = self.selections[key] = record[key]
        if record_pages and self.track_pages:
            self._record_pages(layer, start, sel)
        return sel

    SparseAttentionState.selection = selection
    try:
        yield
    finally:
        SparseAttentionState.selection = made


def sparse_parity(args, m32, ids, dev, rel) -> dict:
    """The ``--sparse-budget`` check (module docstring): per backend, oomb16 recorded, ref32 and ref16 replayed."""
    sparse = SparseConfig(page_budget=args.sparse_budget, sink_pages=args.sink_pages, local_pages=args.local_pages)
    m16 = Qwen2ForCausalLM(m32.config).to(dev, torch.bfloat16)
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in m32.state_dict().items()})

    def run(model, backend, record, replay):
        model.zero_grad(set_to_none=True)
        engine = Engine(model, OOMBConfig(chunk_size=args.chunk_size, page_size=args.page_size,
                                          attention_backend=backend, sparse=sparse))
        with selections(record, replay):
            out = engine.step(ids)
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        return out, grads

    report = dict(seq_len=args.seq_len, chunk_size=args.chunk_size, page_size=args.page_size,
                  sparse=dict(page_budget=sparse.page_budget, sink_pages=sparse.sink_pages,
                              local_pages=sparse.local_pages), backends={})
    ok = True
    for backend in args.backends:
        record: dict = {}
        out, g = run(m16, backend, record, replay=False)
        ref32, g32 = run(m32, "torch", record, replay=True)
        ref16, g16 = run(m16, "torch", record, replay=True)
        kept = [s.counts.float().mean().item() for s in record.values() if not s.dense and s.counts.numel()]
        worst = (-1.0, None, 0.0, 0.0)
        for n in g:
            e_o, e_h = rel(g[n], g32[n]), rel(g16[n], g32[n])
            if e_o / max(e_h, 1e-12) > worst[0]:
                worst = (e_o / max(e_h, 1e-12), n, e_o, e_h)
            if e_o > 2 * e_h + 1e-6 or not torch.isfinite(g[n]).all():
                ok = False
        le_o, le_h = abs(out.loss - ref32.loss) / ref32.loss, abs(ref16.loss - ref32.loss) / ref32.loss
        ok &= le_o <= 2 * le_h + 1e-3
        report["backends"][backend] = dict(
            loss=out.loss, loss_ref32=ref32.loss, loss_err=le_o, ref16_loss_err=le_h, worst_param=worst[1],
            worst_grad_err=worst[2], ref16_grad_err_same_param=worst[3], selections=len(record),
            sparse_selections=len(kept), mean_pages_kept=sum(kept) / len(kept) if kept else None)
        print(json.dumps({backend: report["backends"][backend]}), flush=True)
    report["pass"] = ok
    return report


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=12288 + 77)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=["torch", "triton"])
    ap.add_argument("--grad-accum-dtypes", nargs="+", default=["param"], choices=["param", "float32"],
                    help="OOMBConfig.grad_accum_dtype values to check (each with every backend); many chunks "
                         "(e.g. --seq-len 262144 --chunk-size 4096) show the per-chunk bf16 rounding of 'param'")
    ap.add_argument("--fused-glue", nargs="+", default=["none"], choices=["none", "liger"],
                    help="OOMBConfig.fused_glue values to check (each with every backend; liger patches the model "
                         "for good, so its runs come last)")
    ap.add_argument("--offload", nargs="+", default=["off"], choices=["off", "on"],
                    help="offload modes to check (each with every backend); on: half the pages on the GPU")
    ap.add_argument("--offload-segment-pages", type=int, default=64,
                    help="pages per staged segment with --offload on (a few segments per call)")
    ap.add_argument("--sparse-budget", type=int, default=None,
                    help="check the sparse step with this page budget instead (see above; --backends, --seq-len, "
                         "--chunk-size, --page-size, --layers apply)")
    ap.add_argument("--sink-pages", type=int, default=1)
    ap.add_argument("--local-pages", type=int, default=8)
    ap.add_argument("--device", default="cuda", help="cuda; cpu checks the script itself (float64 is not used)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=3584, intermediate_size=4096, num_hidden_layers=args.layers,
                      num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=1 << 20, rope_theta=1e6)
    torch.manual_seed(0)
    with torch.device(dev):
        m32 = Qwen2ForCausalLM(cfg).float()
    ids = torch.randint(0, 32000, (1, args.seq_len), device=dev)
    torch.backends.cuda.matmul.allow_tf32 = False

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    if args.sparse_budget is not None:
        report = dict(command=" ".join(["python3", *sys.argv]), gpu=torch.cuda.get_device_name() if dev.type == "cuda"
                      else "cpu", torch=torch.__version__, **sparse_parity(args, m32, ids, dev, rel))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_parity_sparse.json"), "w") as f:
            json.dump(report, f, indent=2)
        print("PASS" if report["pass"] else "FAIL")
        sys.exit(0 if report["pass"] else 1)
    loss32, g32 = full_step(m32, ids)
    m16 = Qwen2ForCausalLM(cfg).to(dev, torch.bfloat16)
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in m32.state_dict().items()})
    del m32
    loss16, g16 = full_step(m16, ids)

    report = dict(seq_len=args.seq_len, chunk_size=args.chunk_size, loss_ref32=loss32, loss_hf_bf16=loss16, backends={})
    ok = True
    glues = sorted(set(args.fused_glue), key=["none", "liger"].index)
    runs = [(b, g, fg, o) for fg in glues for o in args.offload for b in args.backends for g in args.grad_accum_dtypes]
    half = args.layers * -(-args.seq_len // args.page_size) // 2
    for backend, accum, glue, off in runs:
        key = backend if args.grad_accum_dtypes == ["param"] else f"{backend}/{accum}"
        key = key if glue == "none" else f"{key}+{glue}"
        key = key if off == "off" else f"{key}+offload"
        offload = OffloadConfig(mode="off") if off == "off" else OffloadConfig(
            mode="on", gpu_page_budget=half, segment_pages=args.offload_segment_pages)
        m16.zero_grad(set_to_none=True)
        engine = Engine(m16, OOMBConfig(chunk_size=args.chunk_size, page_size=args.page_size, attention_backend=backend,
                                        grad_accum_dtype=accum, fused_glue=glue, offload=offload))
        out = engine.step(ids)
        worst = (-1.0, None, 0.0, 0.0)  # (ratio, name, err oomb, err hf)
        for n, p in m16.named_parameters():
            e_o, e_h = rel(p.grad.float(), g32[n]), rel(g16[n], g32[n])
            if e_o / max(e_h, 1e-12) > worst[0]:
                worst = (e_o / max(e_h, 1e-12), n, e_o, e_h)
            if e_o > 2 * e_h + 1e-6 or not torch.isfinite(p.grad).all():
                ok = False
        # The loss is one scalar: its bf16 error can be near zero by chance, so allow 1e-3 absolute slack.
        le_o, le_h = abs(out.loss - loss32) / loss32, abs(loss16 - loss32) / loss32
        ok &= le_o <= 2 * le_h + 1e-3
        report["backends"][key] = dict(loss=out.loss, loss_err=le_o, hf_loss_err=le_h, worst_param=worst[1],
                                           worst_grad_err=worst[2], hf_grad_err_same_param=worst[3], seconds=out.seconds,
                                           store=type(engine.kv_store).__name__,
                                           h2d_bytes=getattr(engine.kv_store, "stats", {}).get("h2d_bytes"))
        print(json.dumps({key: report["backends"][key]}), flush=True)
        del engine
    report["pass"] = ok
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_parity.json"), "w") as f:
        json.dump(report, f, indent=2)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
