"""Passkey rows against keyvalue rows as training data for retrieval from random weights (CPU, a 2-layer model).

``passkey``: one passkey prompt per row, the answer trained (``oomb data --make passkey``); ``keyvalue``: one
keyvalue row (``oomb data --make keyvalue``: the pass key and NEEDLES secret sentences, every one asked and its
answer trained). Rows of 384-512 tokens (every 16th length), batch 16, AdamW lr 1e-3, same steps. Usage:
``python3 benchmarks/keyvalue_recipe_cpu.py passkey|keyvalue STEPS [NEEDLES] [--fixed]``. Every 100 steps prints
the teacher-forced exact match and answer log-prob of 40 held-out passkey prompts of 500 tokens (``oomb eval
--task passkey``'s prompts, at a length no row has) and of 40 held-out passkey rows of the training lengths.
``--fixed``: every row 512 tokens instead (then the 500-token prompts are off the one length trained).
Vocabulary ids are remapped to the few the rows use, so the model is small enough for a CPU.
"""
import sys, time, torch
from transformers import Qwen2Config, AutoModelForCausalLM
from oomb.data import load_tokenizer
from oomb.data.chat import encode_segments, encode_prompt_completion
from oomb.retrieval import passkey_prompt, retrieval_rows

torch.manual_seed(0)
tok = load_tokenizer(None)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
mode, steps = args[0], int(args[1])
needles = int(args[2]) if len(args) > 2 else 8
lengths = [512] if "--fixed" in sys.argv else list(range(384, 513, 16))
VOC = {}
remap = lambda ids: [VOC.setdefault(int(i), len(VOC)) for i in ids]
B, lr = 16, 1e-3


def encode(r):
    if "segments" in r:
        return encode_segments(tok, r["segments"], "assistant", "row")
    return encode_prompt_completion(tok, r["prompt"], r["completion"], None, "assistant", "row")


cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1 << 16, rope_theta=1e6, tie_word_embeddings=True,
                  use_sliding_window=False)
model = AutoModelForCausalLM.from_config(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
prompts = [passkey_prompt(tok, 500, d, t, 0) for d in (0, 25, 50, 75, 100) for t in range(8)]
held = [encode(r) for r in retrieval_rows("passkey", tok, lengths, 40, seed=99)]
evals = {"prompts500": [(remap(p.input_ids.tolist()), p.answer_start) for p in prompts],
         "rows": [(remap(ids[:-1]), int((lab == -100).sum())) for ids, lab in held]}


def evaluate(evalp):
    model.eval(); ok = 0; lp = 0
    with torch.no_grad():
        for ids, a in evalp:
            x = torch.tensor(ids)
            pred = model(x[None]).logits[0].float().log_softmax(-1)[a - 1:-1]
            tgt = x[a:]
            lp += pred.gather(1, tgt[:, None]).sum().item(); ok += int((pred.argmax(-1) == tgt).all())
    model.train(); return ok / len(evalp), lp / len(evalp)


t0 = time.time(); trained = 0
for step in range(1, steps + 1):
    rows = [encode(r) for r in retrieval_rows(mode, tok, lengths, B, seed=1000 + step, needles=needles)]
    n = max(len(ids) for ids, _ in rows)
    x = torch.zeros(B, n, dtype=torch.long); y = torch.full((B, n), -100)
    for i, (ids, lab) in enumerate(rows):
        m = remap(ids)
        x[i, :len(m)] = torch.tensor(m); y[i, :len(m)] = torch.tensor([t if l != -100 else -100 for t, l in zip(m, lab)])
    assert len(VOC) <= cfg.vocab_size
    trained += int((y[:, 1:] != -100).sum())
    loss = model(x, labels=y).loss  # right padding: causal attention keeps it out of every real token
    loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad()
    if step % 100 == 0:
        scores = " ".join(f"{k}: exact {a:.2f} logp {p:.2f}" for k, (a, p) in ((k, evaluate(e)) for k, e in evals.items()))
        print(f"{mode} step {step} loss {loss.item():.3f} trained tokens {trained} passkey {scores} "
              f"{time.time() - t0:.0f}s", flush=True)
