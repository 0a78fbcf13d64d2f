"""Sharded training (``oomb train --shard``) on several GPUs against one: s/step, tokens/s per GPU, peak memory per
GPU beside ``oomb plan``'s prediction, and the time of one profiled step in all-gathers and reduce-scatters.

Parts (``--part``, run in the order given; default both):

* ``step``: the Qwen2.5-7B shape (``--model``), full fine-tune with AdamW at ``--seq-len`` (262,144) tokens per
  GPU, dense: one GPU unsharded (``none:1``), then ``--nproc`` GPUs with each of ``--modes`` (default
  ``none params grads-optim``). A configuration the planner refuses is not run: its row says why.
* ``largest``: at ``--largest-seq-len`` (131,072) tokens on ``--nproc`` GPUs with ``--shard params``, the largest
  preset (72B, 32B, then 7B; full fine-tune, else LoRA rank 16) whose plan fits, with ``--checkpoint-layers``.

Each configuration is one ``torchrun --standalone`` launch of this script in worker mode, which runs ``oomb train``
itself (``oomb.cli.main``: the command users run, with its plan check, sharded build and checkpoints) with
``Trainer.step`` wrapped: every step's seconds, loss and this rank's peak memory (``max_memory_allocated`` since
the engine's reset at the step's last sequence, so the optimizer's update is in it) and, for step
``--profile-step``, the time in collectives from ``torch.profiler``: on CUDA the device time of the NCCL
all-gather and reduce-scatter kernels, on the CPU the time of the c10d all-gather and reduce-scatter ops
(gloo; a smoke test, not a measurement). Rows are JSON lines appended to ``--out``: one per (configuration,
rank, step), then one summary per configuration (median s/step after the first, tokens/s per GPU, the largest
peak over the ranks, the plan's peak, and the ratio of tokens/s per GPU against ``none:1``).

On an H200 node (estimates from the 256K dense step, 122 s on one GPU): setup ~2 min per launch (the model is
built in host memory, then sharded), ~125 s per 7B step; ``--steps 3`` x 4 configurations ~35 min: give one part
or ``--configs`` per device call, or start it detached as ``benchmarks/full_finetune.py`` describes.

Smoke test on the CPU (2 gloo ranks, tiny model; ~1.5 min on 2 cores)::

    python benchmarks/bench_shard.py --device cpu --model tiny --seq-len 256 --largest-seq-len 512 \\
        --chunk-size 64 --page-size 32 --steps 2 --out /tmp/shard.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GiB = 1 << 30
LARGEST = ("qwen2.5-72b", "qwen2.5-32b", "qwen2.5-7b")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", nargs="+", choices=("step", "largest"), default=["step", "largest"])
    p.add_argument("--configs", nargs="+", metavar="MODE:NPROC", help="part step: these configurations instead of "
                   "none:1 and each of --modes on --nproc GPUs")
    p.add_argument("--modes", nargs="+", default=["none", "params", "grads-optim"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--seq-len", type=int, default=262144)
    p.add_argument("--largest-seq-len", type=int, default=131072, help="part largest (on the CPU: --model only)")
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile-step", type=int, default=2, help="the step profiled (0: none)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_shard.jsonl"))
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more oomb train flags, for every run")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # JSON: one configuration, run under torchrun
    return p.parse_args(argv)


def write_rows(path: str, rows: list[dict]) -> None:
    with open(path, "a") as f:
        for row in rows:
            line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}, default=str)
            f.write(line + "\n")
            print(line, flush=True)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------------------- worker
def _collective_seconds(prof, cuda: bool) -> dict[str, float]:
    """Seconds of one profiled step in all-gathers, reduce-scatters and all-reduces (``--shard none``, and the
    loss and token counts every mode sums): NCCL kernels' device time on CUDA, the c10d ops' CPU time otherwise."""
    out = {"all_gather_s": 0.0, "reduce_scatter_s": 0.0, "all_reduce_s": 0.0}
    for e in prof.events():
        name = e.name.lower().replace("_", "")
        kind = next((f"{k}_s" for k, key in (("all_gather", "allgather"), ("reduce_scatter", "reducescatter"),
                                              ("all_reduce", "allreduce")) if key in name), None)
        if kind is None:
            continue
        if cuda and e.device_type.name == "CUDA":
            out[kind] += e.device_time / 1e6  # microseconds
        elif not cuda and e.name.startswith("c10d::"):
            out[kind] += e.cpu_time / 1e6
    return out


def worker(cfg: dict) -> int:
    """One configuration under torchrun: ``oomb train`` with Trainer.step timed and one step profiled; this rank's
    rows go to ``cfg['rows']`` + ``.rank<R>``."""
    import torch

    import oomb.train.step as train_step
    from oomb.cli import main

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = cfg["device"] == "cuda"
    rows = []
    step_fn = train_step.Trainer.step

    def timed(self, step, *args, **kwargs):
        profile = step == cfg["profile_step"]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if profile:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=activities) as prof:
                record = step_fn(self, step, *args, **kwargs)
                if cuda:
                    torch.cuda.synchronize()
        else:
            record = step_fn(self, step, *args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        row = dict(config=cfg["name"], rank=rank, nproc=world, step=step, seconds=round(seconds, 4),
                   loss=getattr(record, "loss", None), tokens_per_s_per_gpu=round(cfg["tokens"] / seconds, 2),
                   peak_gib=round(torch.cuda.max_memory_allocated() / GiB, 3) if cuda else None, profiled=profile)
        if profile:
            row.update({k: round(v, 4) for k, v in _collective_seconds(prof, cuda).items()})
        rows.append(row)
        return record

    train_step.Trainer.step = timed
    try:
        status = main(cfg["argv"])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    finally:
        train_step.Trainer.step = step_fn
    with open(f"{cfg['rows']}.rank{rank}", "w") as f:
        json.dump({"status": status, "rows": rows}, f)
    return 0


# ---------------------------------------------------------------------------------------------------- orchestrator
def plan_row(a, model: str, seq_len: int, mode: str, nproc: int, lora: int, checkpoint_layers: bool) -> dict:
    """``oomb plan``'s verdict and predicted peak for one configuration (None on a machine without a GPU)."""
    import torch

    if a.device != "cuda":
        return {"plan_fits": None, "plan_peak_gib": None, "plan_problem": None}
    from oomb.planner import plan

    p = plan(model, seq_len, chunk_size=a.chunk_size, page_size=a.page_size, dtype=torch.bfloat16, lora_rank=lora,
             optimizer="adamw", checkpoint_layers=checkpoint_layers, attention_backend="auto", shard=mode, nproc=nproc)
    return {"plan_fits": p.fits, "plan_peak_gib": round(p.gpu_peak / GiB, 2),
            "plan_problem": None if p.fits else "; ".join(p.problems)}


def run_config(a, name: str, model: str, seq_len: int, mode: str, nproc: int, lora: int = 0,
               checkpoint_layers: bool = False) -> dict:
    """Launch one configuration; its per-rank rows and a summary row go to ``a.out``; returns the summary."""
    planned = plan_row(a, model, seq_len, mode, nproc, lora, checkpoint_layers)
    base = dict(config=name, model=model, seq_len=seq_len, shard=mode, nproc=nproc, lora_rank=lora,
                checkpoint_layers=checkpoint_layers, **planned)
    if planned["plan_fits"] is False:
        summary = dict(base, kind="summary", ran=False, why="the plan does not fit")
        write_rows(a.out, [summary])
        return summary
    work = tempfile.mkdtemp(prefix="bench-shard-")
    argv = ["train", "--model", model, "--device", a.device, "--seq-len", str(seq_len), "--chunk-size",
            str(a.chunk_size), "--page-size", str(a.page_size), "--steps", str(a.steps), "--lr", str(a.lr),
            "--shard", mode, "--no-progress", "--warmup-steps", "0", "--output-dir", os.path.join(work, "run"),
            *(["--lora-rank", str(lora)] if lora else []), *(["--checkpoint-layers"] if checkpoint_layers else []),
            *a.extra]
    cfg = dict(name=name, argv=argv, device=a.device, profile_step=a.profile_step, tokens=seq_len,
               rows=os.path.join(work, "rows"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.abspath(__file__), "--worker", json.dumps(cfg)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if a.device == "cpu":  # as torchrun sets it for several ranks: one launch of one rank would take every core
        env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    per_rank = []
    for r in range(nproc):
        try:
            with open(f"{cfg['rows']}.rank{r}") as f:
                per_rank.append(json.load(f))
        except OSError:
            per_rank.append({"status": None, "rows": []})
    rows = [dict(base, kind="step", **row) for got in per_rank for row in got["rows"]]
    write_rows(a.out, rows)
    errors = [line for line in res.stderr.splitlines() if line.startswith("oomb: error:")]
    steps = sorted({row["step"] for row in rows})
    later = [s for s in steps if s > steps[0]] or steps
    per_step = [max(row["seconds"] for row in rows if row["step"] == s) for s in later]
    prof = [row for row in rows if row.get("profiled")]
    summary = dict(base, kind="summary", ran=True, status=res.returncode, wall_s=round(wall, 1), errors=errors[:2],
                   steps=len(steps), s_per_step=round(statistics.median(per_step), 3) if per_step else None,
                   tokens_per_s_per_gpu=round(seq_len / statistics.median(per_step), 1) if per_step else None,
                   peak_gib=max((row["peak_gib"] for row in rows if row["peak_gib"] is not None), default=None),
                   all_gather_s=max((row["all_gather_s"] for row in prof), default=None),
                   reduce_scatter_s=max((row["reduce_scatter_s"] for row in prof), default=None),
                   all_reduce_s=max((row["all_reduce_s"] for row in prof), default=None))
    if res.returncode != 0 and not errors:
        summary["stderr_tail"] = res.stderr[-1500:]
    write_rows(a.out, [summary])
    shutil.rmtree(work, ignore_errors=True)
    return summary


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker(json.loads(a.worker))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    import torch

    write_rows(a.out, [{"kind": "run", "argv": sys.argv, "device": a.device, "torch": torch.__version__,
                        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}])
    if "step" in a.part:
        configs = a.configs or ["none:1"] + [f"{m}:{a.nproc}" for m in a.modes]
        summaries = []
        for c in configs:
            mode, n = c.split(":")
            summaries.append(run_config(a, f"step-{mode}-{n}", a.model, a.seq_len, mode, int(n)))
        one = next((s for s in summaries if s["nproc"] == 1 and s.get("tokens_per_s_per_gpu")), None)
        if one is not None:
            write_rows(a.out, [{"kind": "vs_one_gpu", "config": s["config"],
                                "tokens_per_s_per_gpu_ratio": round(s["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"], 3)}
                               for s in summaries if s.get("tokens_per_s_per_gpu") and s is not one])
    if "largest" in a.part:
        candidates = LARGEST if a.device == "cuda" else (a.model,)
        for model in candidates:
            for lora in (0, 16):
                p = plan_row(a, model, a.largest_seq_len, "params", a.nproc, lora, True)
                if p["plan_fits"] is not False:
                    run_config(a, f"largest-{model}-{'lora' if lora else 'full'}", model, a.largest_seq_len, "params",
                               a.nproc, lora, checkpoint_layers=True)
                    return 0
        write_rows(a.out, [{"kind": "largest", "ran": False, "why": "no candidate's plan fits"}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
