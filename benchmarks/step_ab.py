"""Engine step time of the oomb source tree at --src: one warm-up step, then --steps timed steps per length.

Run it once per tree in one device call (the baseline tree first) to A/B two checkouts of the same machine,
e.g. with the other tree unpacked by ``git archive REV oomb | tar -x -C /tmp/base``::

    python3 benchmarks/step_ab.py --src /tmp/base --label base --lengths 32768 131072 --out ab.jsonl
    python3 benchmarks/step_ab.py --src . --label head --lengths 32768 131072 --out ab.jsonl

A tree whose OOMBConfig has no sections (``kernels``) takes the sparse settings as flat fields. Appends one
JSON row per length (min/median/max seconds, Stage-2 median, loss, peak GiB) to --out. ``--checkpoint-layers``
with ``--checkpoint-attention keep|recompute`` A/Bs what the rerun of a checkpointed layer does for its
attention in one tree (a tree without that field always recomputes).
"""
import argparse, json, sys, time, os, statistics
p = argparse.ArgumentParser()
p.add_argument("--src", required=True)
p.add_argument("--label", required=True)
p.add_argument("--model", default="qwen2.5-7b")
p.add_argument("--lengths", type=int, nargs="+")
p.add_argument("--sparse", action="store_true")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--out", required=True)
p.add_argument("--device", default="cuda")
p.add_argument("--autotune", choices=["full", "first"], default="full",
               help="first: every Triton kernel runs its first config (both trees alike; no tuning time)")
p.add_argument("--offload", choices=["auto", "on", "off"], default="auto",
               help="the engine's offload mode (a tree without sections always runs its default)")
p.add_argument("--checkpoint-layers", action="store_true")
p.add_argument("--checkpoint-attention", choices=["keep", "recompute"], default="keep")
p.add_argument("--fused-glue", nargs="+", choices=["none", "liger"], default=["none"],
               help="engine fused_glue values to time one after the other on the same model and tokens (liger "
                    "patches the model for good, so it goes last)")
a = p.parse_args()
a.fused_glue = sorted(set(a.fused_glue), key=["none", "liger"].index)
if a.autotune == "first":
    os.environ["OOMB_TRITON_CONFIGS"] = "first"  # the switch of a tree with flat settings; a sectioned tree ignores it
sys.path.insert(0, os.path.abspath(a.src))
import torch
from transformers import AutoModelForCausalLM
import oomb
from oomb import Engine
from oomb.models.presets import preset_config
assert oomb.__file__.startswith(os.path.abspath(a.src)), oomb.__file__
from oomb import OOMBConfig
ckpt = {}
if "kernels" in OOMBConfig.__dataclass_fields__:
    from oomb.config import KernelConfig, OffloadConfig, SparseConfig
    ckpt = {"checkpoint_layers": a.checkpoint_layers, "offload": OffloadConfig(mode=a.offload)}
    if a.checkpoint_layers and "checkpoint_attention" in OOMBConfig.__dataclass_fields__:
        ckpt["checkpoint_attention"] = a.checkpoint_attention
    cfg = OOMBConfig(chunk_size=4096, sparse=SparseConfig(page_budget=64) if a.sparse else None,
                     kernels=KernelConfig(autotune=a.autotune), **ckpt)
    api = "sections"
else:
    cfg = OOMBConfig(chunk_size=4096, sparse=a.sparse, page_budget=64, checkpoint_layers=a.checkpoint_layers)
    api = "flat"
dev = torch.device(a.device)
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
mc = preset_config(a.model)
torch.manual_seed(0)
with dev:
    model = AutoModelForCausalLM.from_config(mc, torch_dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
for p_ in model.parameters():
    p_.requires_grad_(True)
import dataclasses
g = torch.Generator().manual_seed(1)
inputs = {T: torch.randint(0, mc.vocab_size, (1, T), generator=g).to(dev) for T in a.lengths}
rows = []
eng, eng_glue = None, None
for glue, T in [(glue, T) for glue in a.fused_glue for T in a.lengths]:
    if glue != eng_glue:  # a new engine (and its KV store) per glue; the first one's is freed first
        eng = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        eng = Engine(model, dataclasses.replace(cfg, fused_glue=glue) if glue != "none" else cfg)
        eng_glue = glue
    ids = inputs[T]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses, stage2 = [], [], []
    for i in range(a.steps + 1):
        model.zero_grad(set_to_none=True)
        sync(); t0 = time.perf_counter()
        out = eng.step(ids)
        sync(); dt = time.perf_counter() - t0
        print(f"{a.label} glue={glue} T={T} step {i}: {dt:.2f} s", flush=True)
        if i:
            times.append(dt)
            stage2.append(out.stage2_seconds)
        losses.append(out.loss)
    row = dict(label=a.label, api=api, model=a.model, tokens=T, sparse=a.sparse, autotune=a.autotune, fused_glue=glue,
               offload=a.offload if api == "sections" else None,
               checkpoint_layers=a.checkpoint_layers, checkpoint_attention=ckpt.get("checkpoint_attention")
               if api == "sections" else None,
               min_s=min(times), median_s=statistics.median(times), max_s=max(times), times=times,
               stage2_median_s=statistics.median(stage2),
               loss=losses[-1], peak_gib=torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None)
    rows.append(row)
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
