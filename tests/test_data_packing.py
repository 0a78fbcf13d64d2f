"""Packed chat examples train as each example alone: loss and gradients (fp64) of one engine step over a packed
sequence (labels and cu_seqlens from the packer) equal plain full-sequence training of every example by itself."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from configs import engine_config
from oomb import Engine
from oomb.data import load_tokenizer, pack
from oomb.data.chat import encode_messages, read_chat_template

TEMPLATE = Path(__file__).parent / "chat_templates" / "plain.jinja"

CONVERSATIONS = [
    [{"role": "user", "content": "Who is Emma?"}, {"role": "assistant", "content": "A young lady of Highbury."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Her friend?"},
     {"role": "assistant", "content": "Harriet."}, {"role": "user", "content": "And her father?"},
     {"role": "assistant", "content": "Mr. Woodhouse, who fears draughts."}],
    [{"role": "user", "content": "Where?"}, {"role": "assistant", "content": "Hartfield."}],
]


def _model():
    torch.manual_seed(3)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).double()


def test_packed_chat_training_equals_training_each_example_alone():
    tok = load_tokenizer()
    template = read_chat_template(str(TEMPLATE))
    examples = [encode_messages(tok, c, template, "assistant", f"row {i}") for i, c in enumerate(CONVERSATIONS)]
    S = sum(len(ids) for ids, _ in examples) + 5  # all three in one sequence, then 5 padding tokens
    data = pack(examples, S, "drop", pad_id=tok.eos_token_id)
    assert len(data) == 1
    sample = data[0]
    assert sample.cu_seqlens.tolist()[-2:] == [S - 5, S] and len(sample.cu_seqlens) == len(examples) + 2

    model = _model()
    ref = _model()
    ref.load_state_dict(model.state_dict())
    ref.set_attn_implementation("sdpa")
    total, n_valid = 0.0, 0
    for ids, labels in examples:
        x = torch.from_numpy(ids).view(1, -1)
        targets = torch.cat([torch.from_numpy(labels)[1:], torch.tensor([-100])])
        logits = ref(input_ids=x).logits[0]
        total = total + F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        n_valid += int((targets != -100).sum())
    (total / n_valid).backward()

    engine = Engine(model, engine_config(chunk_size=16, page_size=4, attention_backend="torch"))
    out = engine.step(sample.input_ids, labels=sample.labels, cu_seqlens=sample.cu_seqlens)
    assert out.num_valid_tokens == n_valid == data.stats.trained_tokens
    assert abs(out.loss - total.item() / n_valid) <= 1e-10 * out.loss
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        err = (p.grad - r.grad).norm().item() / max(r.grad.norm().item(), 1e-30)
        assert err <= 1e-10, f"{name}: rel err {err:.3e}"


def test_the_trained_token_counts_are_what_the_engine_counts(tmp_path):
    """DataStats.trained_tokens = the sum of Engine.count_valid_tokens over every sequence (text with
    document_mask, and packed chat examples with padding)."""
    import json

    from oomb.config import DataConfig
    from oomb.data import build_training_data

    tok = load_tokenizer()
    engine = Engine(_model(), engine_config(chunk_size=16, page_size=4, attention_backend="torch"))
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": "word " * (3 + i)}) + "\n" for i in range(20)))
    chat = tmp_path / "c.jsonl"
    chat.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 3))
    for cfg in (DataConfig(path=str(text), seq_len=16, document_mask=True),
                DataConfig(path=str(chat), seq_len=64, chat_template=str(TEMPLATE))):
        data = build_training_data(cfg, tok)
        counted = 0
        for i in range(len(data)):
            s = data[i]
            counted += engine.count_valid_tokens(s.input_ids, s.labels, s.cu_seqlens)
        assert counted == data.stats.trained_tokens > 0
