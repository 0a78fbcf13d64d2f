"""Does training with page-level sparse attention learn retrieval as dense training does? A CPU-sized answer.

A 2-layer Qwen2-shaped model from random weights learns the passkey task (``oomb.retrieval.passkey_prompt``,
loss on the answer tokens only, the recipe of ``benchmarks/passkey_loss_recipe_cpu.py``) through the engine,
chunk-recurrently, in one attention mode per run: dense, or sparse with a page budget. The prompts are
LENGTH tokens in chunks of CHUNK with pages of PAGE tokens, so the answer's chunk has LENGTH/PAGE - CHUNK/PAGE
past pages of which sparse attention keeps sink + local + budget: the passkey's page must be *selected* (top-K
of the mean-key score) for the model to see it. Every EVAL_EVERY steps the model is scored on held-out prompts at
LENGTH and 2x LENGTH (``oomb.retrieval.evaluate_retrieval``), dense and at each budget, teacher-forced: exact
match (every answer token the argmax) and the answer's log-probability.

Vocabulary ids are remapped to the few the prompts use (< 256), so the model is small enough for a CPU.

Usage: ``python3 benchmarks/retrieval_sparse_cpu.py --mode dense|sparseB [--steps N] --out FILE.jsonl``
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from oomb import Engine
from oomb.config import OOMBConfig, SparseConfig
from oomb.data import load_tokenizer
from oomb.retrieval import evaluate_retrieval
from oomb.retrieval.prompts import passkey_prompt

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--mode", required=True, help="dense, or sparseB for a page budget of B")
p.add_argument("--steps", type=int, default=1600)
p.add_argument("--batch", type=int, default=8, help="prompts per optimizer step")
p.add_argument("--length", type=int, default=256)
p.add_argument("--chunk", type=int, default=64)
p.add_argument("--page", type=int, default=16)
p.add_argument("--sink", type=int, default=1)
p.add_argument("--local", type=int, default=1)
p.add_argument("--eval-budgets", type=int, nargs="+", default=[2, 6])
p.add_argument("--eval-every", type=int, default=200)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--seed", type=int, default=0, help="model initialisation and training prompts (the held-out prompts stay fixed)")
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)

tok = load_tokenizer(None)
VOC: dict[int, int] = {}


def remap(ids: torch.Tensor) -> torch.Tensor:
    out = torch.tensor([VOC.setdefault(int(i), len(VOC)) for i in ids.tolist()])
    assert len(VOC) <= 256, "the prompts use more than 256 token ids"
    return out


def prompt(length: int, depth: float, trial: int, seed: int):
    pr = passkey_prompt(tok, length, depth, trial, seed)
    return dataclasses.replace(pr, input_ids=remap(pr.input_ids))


cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1 << 16, rope_theta=1e6, tie_word_embeddings=True,
                  use_sliding_window=False)
model = AutoModelForCausalLM.from_config(cfg)
sparse = SparseConfig(page_budget=1, sink_pages=args.sink, local_pages=args.local, block_size=args.page)
base = OOMBConfig(chunk_size=args.chunk, page_size=args.page, attention_backend="torch", sparse=sparse)
if args.mode == "dense":
    train_cfg = dataclasses.replace(base, sparse=None)
elif args.mode.startswith("sparse") and args.mode[6:].isdigit():
    train_cfg = dataclasses.replace(base, sparse=dataclasses.replace(sparse, page_budget=int(args.mode[6:])))
else:
    raise SystemExit(f"--mode {args.mode}: give dense or sparseB (e.g. sparse2)")
engine = Engine(model, train_cfg)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
held_out = [prompt(L, d, t, seed=1) for L in (args.length, 2 * args.length) for d in (0, 25, 50, 75, 100)
            for t in range(8)]
rng = np.random.default_rng(args.seed)
out = open(args.out, "w")


def log(rec: dict) -> None:
    rec = {"mode": args.mode, **rec}
    print(json.dumps(rec), flush=True)
    out.write(json.dumps(rec) + "\n")
    out.flush()


log({"config": vars(args), "past_pages_at_answer": (args.length - args.chunk) // args.page,
     "kept_pages": None if train_cfg.sparse is None else args.sink + args.local + train_cfg.sparse.page_budget})
t0 = time.time()
losses: list[float] = []
for step in range(1, args.steps + 1):
    batch = [prompt(args.length, float(rng.uniform(0, 100)), int(rng.integers(1 << 30)), seed=2)
             for _ in range(args.batch)]
    n = sum(int((b.labels != -100).sum()) - 1 for b in batch)  # the first label is never a target
    total = 0.0
    for b in batch:
        o = engine.step(b.input_ids[None], b.labels[None], loss_normalizer=n)
        total += o.loss * o.num_valid_tokens
    losses.append(total / n)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step % args.eval_every == 0 or step == args.steps:
        report = evaluate_retrieval(model, held_out, base, budgets=args.eval_budgets)
        rows = {}
        for row in report.rows:
            for L in (args.length, 2 * args.length):
                trials = [t for t in row.trials if t.length == L]
                rows[f"{row.name}@{L}"] = {"exact": sum(t.exact for t in trials) / len(trials),
                                           "logprob": sum(t.logprob for t in trials) / len(trials)}
        log({"step": step, "seconds": round(time.time() - t0, 1),
             "train_loss": round(float(np.mean(losses[-args.eval_every:])), 4), "eval": rows})
        if step == args.steps:
            log({"table": report.table()})
