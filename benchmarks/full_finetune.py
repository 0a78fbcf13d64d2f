"""Full fine-tune of the Qwen2.5-7B shape with each ``--optimizer``: s/step, the loss of each step, peak GPU and
pinned host memory, beside ``oomb plan``'s prediction (issue: a 7B full fine-tune on a million tokens, one H200).

The same code path as ``oomb train`` in one process: the preset built in bf16 on the GPU, the engine sized by
the planner's tiering for the chosen optimizer (``plan_for_config(...).engine_settings()``, as
``oomb.cli.train_setup``), :func:`oomb.train.optim.build_optimizer`, and :class:`oomb.train.Trainer` over the
bundled text tokenized with the bundled tokenizer (repeated where it holds fewer than ``--steps`` sequences:
it is 1,047,872 tokens, 704 short of 1M). Per length the model and the KV store are built once; each optimizer
starts from the same initial weights (a host copy) and the same sequences, so step 1's loss is the same for all.

Parts (``--only``, run in the order given; default: all of (a) then (b)):

* ``262144:dense:adamw,adamw8bit,adamw-bf16,adamw-cpu`` -- (a) each optimizer at 256K, dense.
* ``1048576:sparse:adamw8bit`` -- (b) the goal length with the optimizer ``oomb plan`` says fits (sparse).

A part is written ``TOKENS:MODE:OPT[,OPT...]``, MODE ``dense`` or ``sparse``. An optimizer the planner refuses
at that length is not run (its row says why and what would fit).

Time: ``--budget-s`` seconds in all (default 560, inside one 600-second device call). Before each step and
each part the script estimates its time (the last step of the same part, else ``--est-dense-s`` /
``--est-sparse-s`` per 256K tokens, scaled: dense quadratically, sparse linearly) and skips what would not end
in time, with a row saying so. Rows are JSON lines appended to ``--out`` and flushed one by one, so a call that
is stopped keeps every finished step. The first row records the command, GPU, versions and host RAM.

Times measured on an H200 (docs/performance.md, "Full fine-tune per optimizer"): a dense 256K step 142-143 s
(the first of a process ~10 s more for autotuning, adamw8bit's first +28 s for torchao's compile); a sparse 1M step
262 s (the first ~350 s); the store of 1M pins ~77 GiB in ~50 s; setup of a length 15-90 s. So (a) ~450 s per
optimizer, ~1,800 s for all four; (b) ~950 s. A 600-second call holds the setup and three steps of 256K (one
optimizer), or setup + 1 step of 1M.
For longer runs start it detached and collect the rows in later calls (benchmarks/detach.sh), e.g.::

    benchmarks/detach.sh start ff benchmarks/run_gpu.sh finetune --budget-s 1700 \\
        --only 1048576:sparse:adamw8bit 262144:dense:adamw,adamw8bit
    benchmarks/detach.sh collect ff 560        # in this call and the next ones, until it says the run ended
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import logging  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

for _name in ("torchao", "torch.utils._pytree"):  # import-time notes of torchao (as the oomb command hides them)
    logging.getLogger(_name).setLevel(logging.ERROR)

GiB = 1 << 30
ALL_PARTS = ["262144:dense:adamw,adamw8bit,adamw-bf16,adamw-cpu", "1048576:sparse:adamw8bit"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=ALL_PARTS, metavar="TOKENS:MODE:OPT[,OPT]")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "full_finetune.jsonl"))
    p.add_argument("--budget-s", type=float, default=560.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--checkpoint-layers", choices=("auto", "on", "off"), default="auto",
                   help="auto: on above 262,144 tokens (what the 1M plan needs), off at and below")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (e.g. --model tiny, planned "
                   "for an 80 GiB GPU it does not use)")
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--est-dense-s", type=float, default=145.0, help="est. seconds of a dense 256K step")
    p.add_argument("--est-sparse-s", type=float, default=70.0, help="est. seconds per 256K tokens, sparse")
    p.add_argument("--est-setup-s", type=float, default=90.0, help="est. seconds to build a length's model+store")
    return p.parse_args(argv)


class Rows:
    """JSON lines appended to a file, each flushed and fsynced as it is written (and echoed to stdout)."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.f = open(path, "a")

    def write(self, **row) -> None:
        row = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}
        line = json.dumps(row, default=str)
        self.f.write(line + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        print(line, flush=True)


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton", "torchao"):
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - a missing one is recorded, not fatal
            out[name] = f"unavailable ({type(exc).__name__})"
    try:
        out["oomb_commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                            text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        out["oomb_commit"] = None
    return out


def host_status() -> dict:
    """VmRSS and VmHWM (peak RSS) of this process, GiB, from /proc/self/status."""
    got = {}
    try:
        for line in open("/proc/self/status"):
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                got[key] = round(int(line.split()[1]) * 1024 / GiB, 2)
    except OSError:
        pass
    return got


def bundled_sequences(seq_len: int, steps: int):
    """TokenSequences of the bundled text (tokenized by the bundled tokenizer), tiled until it holds ``steps``
    sequences; and how many copies that took."""
    from oomb.data import TokenSequences, load_documents, load_tokenizer, tokenize_documents

    tok = load_tokenizer(None)
    tokens = tokenize_documents(load_documents(None), tok, cache=True)
    copies = max(1, -(-(steps * seq_len) // len(tokens)))
    if copies > 1:
        tokens = np.tile(tokens, copies)
    return TokenSequences(tokens, seq_len, seed=0), copies, int(len(tokens) // copies)


def parse_part(text: str):
    tokens, mode, opts = text.split(":")
    if mode not in ("dense", "sparse"):
        raise SystemExit(f"--only {text}: MODE is dense or sparse")
    return int(tokens), mode, opts.split(",")


def estimate_step_s(a, T: int, mode: str) -> float:
    r = T / 262144
    return a.est_dense_s * r * r if mode == "dense" else a.est_sparse_s * r


def run_part(a, rows: Rows, T: int, mode: str, names: list[str], deadline: float) -> None:
    from dataclasses import replace

    from oomb import Engine
    from oomb.config import OOMBConfig, SparseConfig, TrainConfig
    from oomb.memory import Machine
    from oomb.models.presets import build_model
    from oomb.planner import plan_for_config
    from oomb.train import SequenceStream, Trainer
    from oomb.train.optim import HostAdamW, build_optimizer

    ckpt = a.checkpoint_layers == "on" or (a.checkpoint_layers == "auto" and T > 262144)
    cfg = OOMBConfig(chunk_size=a.chunk_size, page_size=a.page_size, checkpoint_layers=ckpt,
                     sparse=SparseConfig() if mode == "sparse" else None)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    part = dict(part=f"{T}:{mode}", seq_len=T, mode=mode, checkpoint_layers=ckpt, chunk_size=a.chunk_size,
                sparse=None if mode == "dense" else {k: getattr(cfg.sparse, k) for k in ("page_budget", "sink_pages", "local_pages", "score", "block_size")})
    machine = Machine.detect() if cuda else Machine(80 * GiB, 80 * GiB, 100 * GiB, 100 * GiB, "smoke test")
    plans = {}
    for name in names:
        p = plan_for_config(a.model, T, cfg, dtype="bfloat16", optimizer=name, machine=machine)
        plans[name] = p
        rows.write(kind="plan", optimizer=name, **part, fits=p.fits, problems=p.problems,
                   predicted_gpu_peak_gib=round(p.gpu_peak / GiB, 2), gpu_budget_gib=round(p.gpu_budget / GiB, 2),
                   predicted_host_gib=round(p.host_peak / GiB, 2), host_budget_gib=round(p.host_budget / GiB, 2),
                   predicted_optimizer_gpu_gib=round(p.optimizer / GiB, 2),
                   predicted_optimizer_host_gib=round(p.optimizer_host / GiB, 2),
                   offload=bool(p.tiering.offload), settings=p.engine_settings())
    runnable = [n for n in names if plans[n].fits]
    if not runnable:
        return
    est_step = estimate_step_s(a, T, mode)
    if time.time() + a.est_setup_s + est_step > deadline:
        rows.write(kind="skipped", **part, optimizers=runnable, reason="time budget: setup + one step "
                   f"(~{a.est_setup_s + est_step:.0f} s est.) would end after the deadline")
        return
    t_setup = time.perf_counter()
    sequences, copies, corpus_tokens = bundled_sequences(T, a.steps)
    torch.manual_seed(a.seed)
    model = build_model(a.model, dtype=torch.bfloat16, device=dev)
    params = [p for p in model.parameters() if p.requires_grad]
    initial = [p.detach().to("cpu", copy=True) for p in params] if len(runnable) > 1 else None
    engine = store = None
    settings_now = None
    train = TrainConfig(steps=a.steps, lr=a.lr, weight_decay=a.weight_decay, lr_schedule="constant", warmup_steps=0)
    for i, name in enumerate(runnable):
        settings = plans[name].engine_settings()
        if engine is None or settings != settings_now:
            engine = store = None
            gc.collect()
            torch.cuda.empty_cache()
            # as oomb train (default --offload auto): the plan's tiering for this optimizer's GPU states
            ecfg = replace(cfg, offload=replace(cfg.offload, **settings)) if cuda else cfg
            engine = Engine(model, ecfg)
            t0 = time.perf_counter()
            store = (getattr(engine, "reserve", None) or engine._ensure_store)(T)
            store_s = time.perf_counter() - t0
            settings_now = settings
        if i > 0:
            with torch.no_grad():
                for p, p0 in zip(params, initial):
                    p.copy_(p0)
        sync()
        optimizer = build_optimizer(name, params, lr=a.lr, weight_decay=a.weight_decay, device=dev)
        trainer = Trainer(engine, optimizer, SequenceStream(sequences), train, params=params, device=dev)
        pinned_kv = getattr(store, "host_nbytes", 0)
        pinned_opt = sum(h.nbytes + h.grad.nbytes for _, h, _ in optimizer._host) if isinstance(optimizer, HostAdamW) else 0
        rows.write(kind="setup", optimizer=name, **part, setup_s=round(time.perf_counter() - t_setup, 1),  # since the last
                   store_alloc_s=round(store_s, 1), kv_gpu_gib=round(store.nbytes / GiB, 2),
                   kv_pinned_host_gib=round(pinned_kv / GiB, 2), data=f"bundled text x{copies} "
                   f"({corpus_tokens:,} tokens each), {len(sequences)} sequences of {T:,}", **host_status())
        last = None
        for step in range(1, a.steps + 1):
            est = last if last is not None else est_step
            if time.time() + est > deadline:
                rows.write(kind="skipped", optimizer=name, **part, step=step,
                           reason=f"time budget: the step (~{est:.0f} s est.) would end after the deadline")
                break
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            rec = trainer.step(step)
            sync()
            last = time.perf_counter() - t0
            if not hasattr(rec, "loss"):
                rows.write(kind="stopped", optimizer=name, **part, step=step, record=repr(rec))
                break
            p = plans[name]
            rows.write(kind="step", optimizer=name, **part, step=step, seconds=round(last, 2),
                       stage1_s=round(rec.stage1_seconds, 2), stage2_s=round(rec.stage2_seconds, 2),
                       loss=round(rec.loss, 6), grad_norm=round(rec.grad_norm, 4), lr=rec.lr,
                       tokens_per_s=round(T / last, 1),
                       peak_gpu_allocated_gib=round(torch.cuda.max_memory_allocated() / GiB, 2) if cuda else None,
                       peak_gpu_reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2) if cuda else None,
                       predicted_gpu_peak_gib=round(p.gpu_peak / GiB, 2),
                       pinned_host_gib=round((pinned_kv + pinned_opt) / GiB, 2),
                       predicted_host_gib=round(p.host_peak / GiB, 2), **host_status())
            sys.stdout.flush()
        del trainer, optimizer
        gc.collect()
        torch.cuda.empty_cache()
        t_setup = time.perf_counter()
    del engine, store, model, params, initial
    gc.collect()
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    a = parse_args(argv)
    start = time.time()
    deadline = start + a.budget_s
    rows = Rows(a.out)
    from oomb.memory import host_memory

    avail, total = host_memory()
    rows.write(kind="run", command=[sys.executable, *sys.argv], budget_s=a.budget_s, steps=a.steps, lr=a.lr,
               model=a.model, gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               gpu_total_gib=round(torch.cuda.get_device_properties(0).total_memory / GiB, 2) if torch.cuda.is_available() else None,
               host_available_gib=round(avail / GiB, 1), host_total_gib=round(total / GiB, 1), **versions())
    if a.device == "cuda" and not torch.cuda.is_available():
        rows.write(kind="error", reason="no CUDA GPU: this benchmark runs on one")
        return 1
    for text in a.only:
        T, mode, names = parse_part(text)
        try:
            run_part(a, rows, T, mode, names, deadline)
        except Exception as exc:  # noqa: BLE001 - record and go on to the next part
            import traceback

            rows.write(kind="error", part=text, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
            gc.collect()
            torch.cuda.empty_cache()
    rows.write(kind="done", elapsed_s=round(time.time() - start, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
