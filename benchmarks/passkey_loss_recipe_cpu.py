"""Which training loss teaches a 2-layer model from random weights the passkey task (CPU, 256-token prompts).

``answer``: loss on the answer tokens only; ``rep``: every token trained, half the rows repeated random numbers
(a copying signal). Usage: ``python3 benchmarks/passkey_loss_recipe_cpu.py answer|rep STEPS LR``. Prints teacher-
forced exact match and answer log-prob on 24 held-out prompts every 100 steps. Vocabulary ids are remapped to the
few the prompts use, so the model is small enough for a CPU.
"""
import sys, time, numpy as np, torch
from transformers import Qwen2Config, AutoModelForCausalLM
from oomb.data import load_tokenizer
from oomb.retrieval.prompts import passkey_prompt
torch.manual_seed(0)
tok = load_tokenizer(None)
mode = sys.argv[1]; steps = int(sys.argv[2]); L = 256; lr = float(sys.argv[3])
enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
VOC = {}
remap = lambda ids: [VOC.setdefault(i, len(VOC)) for i in ids]
def pk(rng):
    p = passkey_prompt(tok, L, float(rng.uniform(0, 100)), int(rng.integers(1 << 20, 1 << 30)), 0)
    ids = remap(p.input_ids.tolist()); lab = list(ids)
    if mode == "answer":
        lab = [-100] * p.answer_start + ids[p.answer_start:]
    return ids, lab
def rep(rng):
    n = int(rng.integers(8, 24))
    nums = " ".join(str(int(rng.integers(10000, 100000))) for _ in range(n))
    ids = [1] + enc(" " + nums + ".")
    while len(ids) < L: ids = ids + enc(" " + nums + ".")
    ids = remap(ids[:L]); return ids, list(ids)
cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1<<16, rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False)
model = AutoModelForCausalLM.from_config(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
rng = np.random.default_rng(0)
evalp = [passkey_prompt(tok, L, d, t, 0) for d in (0, 50, 100) for t in range(8)]
evalp = [(torch.tensor(remap(p.input_ids.tolist())), p.answer_start) for p in evalp]
def evaluate():
    model.eval(); ok = 0; lp = 0
    with torch.no_grad():
        x = torch.stack([e[0] for e in evalp]); logits = model(x).logits.float().log_softmax(-1)
        for i, (ids, a) in enumerate(evalp):
            tgt = ids[a:]; pred = logits[i, a-1:-1]
            lp += pred.gather(1, tgt[:, None]).sum().item(); ok += int((pred.argmax(-1) == tgt).all())
    model.train(); return ok / len(evalp), lp / len(evalp)
B = 16; t0 = time.time()
for step in range(1, steps + 1):
    rows = [(rep if (mode == "rep" and i % 2) else pk)(rng) for i in range(B)]
    x = torch.tensor([r[0] for r in rows]); y = torch.tensor([r[1] for r in rows])
    loss = model(x, labels=y).loss
    loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad()
    if step % 100 == 0:
        acc, lp = evaluate(); print(f"{mode} step {step} loss {loss.item():.3f} passkey acc {acc:.2f} logp {lp:.2f} {time.time()-t0:.0f}s", flush=True)
