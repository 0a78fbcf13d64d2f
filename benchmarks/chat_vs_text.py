"""Chat fine-tuning vs plain text through ``oomb train``: tokens/s and the trained-token share.

Builds a chat dataset from the bundled novels (:func:`oomb.data.novels.write_chat_novels`: a ~60K-character
passage in the user turn, "which sentence follows ...?" and its answer as the assistant turn), then runs
``oomb train`` on it packed to --seq-len tokens (loss on the assistant turns only) and the same run on the
bundled plain text, and writes one JSON with, per run, the median tokens/s of the steps after the first, the
trained-token share (trained tokens / sequence positions, from the same packing ``oomb train`` does) and the
data statistics. GPU::

    python3 benchmarks/chat_vs_text.py --out benchmarks/results/chat_vs_text.json
    # or: OUT=benchmarks/results/chat benchmarks/run_gpu.sh chat-vs-text

Each run is a subprocess ``python3 -m oomb train --device cuda --model qwen2.5-0.5b --seq-len 131072 --steps
4 ...`` (add flags after ``--``, e.g. ``-- --checkpoint-layers``).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", default="qwen2.5-0.5b")
p.add_argument("--seq-len", type=int, default=131072)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--examples", type=int, default=96, help="chat examples to build (~15K tokens each)")
p.add_argument("--passage-chars", type=int, default=60_000)
p.add_argument("--device", default="cuda")
p.add_argument("--out", default="benchmarks/results/chat_vs_text.json")
p.add_argument("extra", nargs="*", help="more oomb train flags (after --)")
a = p.parse_args()

from oomb.config import DataConfig  # noqa: E402
from oomb.data import build_training_data, load_tokenizer  # noqa: E402
from oomb.data.novels import write_chat_novels  # noqa: E402

work = tempfile.mkdtemp(prefix="oomb-chat-vs-text-")
chat = write_chat_novels(os.path.join(work, "chat-novels.jsonl"), a.examples, a.passage_chars)
template = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_template.jinja")
runs = {"chat": ["--data", str(chat), "--chat-template", template], "text": []}
tok = load_tokenizer()
report = {"model": a.model, "seq_len": a.seq_len, "steps": a.steps, "device": a.device, "runs": {}}
for name, data_flags in runs.items():
    cfg = DataConfig(path=str(chat) if name == "chat" else None, chat_template=template if name == "chat" else None,
                     seq_len=a.seq_len)
    stats = build_training_data(cfg, tok).stats
    out = os.path.join(work, name)
    cmd = [sys.executable, "-m", "oomb", "train", "--device", a.device, "--model", a.model, "--seq-len", str(a.seq_len),
           "--steps", str(a.steps), "--lr", "3e-4", "--no-progress", "--output-dir", out, *data_flags, *a.extra]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-4000:])
    row = {"command": cmd[1:], "returncode": proc.returncode, "data": stats.as_dict()}
    if proc.returncode == 0:
        log = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
        timed = [r["tokens_per_s"] for r in log[1:]] or [log[-1]["tokens_per_s"]]
        row.update(tokens_per_s=statistics.median(timed), trained_tokens_per_s=statistics.median(timed) * stats.trained_share,
                   trained_share=stats.trained_share, losses=[r["loss"] for r in log],
                   peak_memory_gib=max((r["peak_memory_bytes"] or 0) for r in log) / 2**30)
    report["runs"][name] = row
    print(name, {k: v for k, v in row.items() if k not in ("command", "losses")}, flush=True)
os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
with open(a.out, "w") as f:
    json.dump(report, f, indent=2)
shutil.rmtree(work, ignore_errors=True)
print("wrote", a.out)
