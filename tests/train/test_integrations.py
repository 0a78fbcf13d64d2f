"""OOMBTrainer (a transformers.Trainer running the engine) trains like ``oomb train`` on the same data and seed."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("accelerate")

from oomb.cli import main  # noqa: E402

SEQ, STEPS, K = 64, 3, 2
NOISE_ONLY = "k_proj.bias"
"""The key bias's gradient is zero in exact arithmetic (softmax is unchanged by adding q . b_k to every logit of a
query), so AdamW turns its rounding noise into steps of +-lr: not compared."""
FLAGS = ["--seq-len", str(SEQ), "--chunk-size", "32", "--page-size", "16", "--steps", str(STEPS), "--grad-accum", str(K),
         "--lr", "3e-3", "--lr-schedule", "constant", "--warmup-steps", "0", "--no-progress", "--seed", "0"]


def _oomb_train(tmp_path, text):
    out = tmp_path / "run"
    try:
        status = main(["train", "--data", str(text), "--output-dir", str(out), *FLAGS])
    except SystemExit as exc:
        status = exc.code
    assert status == 0
    losses = [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]
    from safetensors.torch import load_file

    return losses, load_file(str(out / "model.safetensors"))


def _trainer_run(tmp_path, text, **trainer_kwargs):
    from transformers import TrainerCallback, TrainingArguments

    from oomb import OOMBConfig
    from oomb.data import TokenSequences, load_documents, load_tokenizer, tokenize_documents
    from oomb.integrations import OOMBTrainer
    from oomb.models.presets import build_model
    from oomb.train import SequenceStream

    tokens = tokenize_documents(load_documents(str(text)), load_tokenizer(None))
    stream = SequenceStream(TokenSequences(tokens, SEQ, seed=0))
    # The sequences oomb train draws, in its order; the Trainer reads them in order.
    rows = [{"input_ids": stream[g].input_ids[0]} for g in range(STEPS * K)]
    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    losses = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=1, gradient_accumulation_steps=K, max_steps=STEPS,
        learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95,
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
        train_sampling_strategy="sequential", use_cpu=True, seed=0, disable_tqdm=True)
    trainer = OOMBTrainer(model=model, args=args, train_dataset=rows, callbacks=[Record()],
                          oomb_config=OOMBConfig(chunk_size=32, page_size=16), **trainer_kwargs)
    trainer.train()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def text(tmp_path):
    from oomb.data import BUNDLED_CORPUS

    f = tmp_path / "text.txt"
    f.write_text(sorted(BUNDLED_CORPUS.glob("*.txt"))[0].read_text()[:6000])
    return f


def test_oomb_trainer_trains_like_oomb_train(tmp_path, text):
    """Same sequences, seed, schedule and optimizer: the Trainer's losses and final weights equal oomb train's."""
    cli_losses, cli_weights = _oomb_train(tmp_path, text)
    hf_losses, hf_weights = _trainer_run(tmp_path, text)
    assert len(hf_losses) == STEPS
    assert hf_losses == pytest.approx(cli_losses, rel=1e-5, abs=1e-6)
    assert cli_losses[-1] < cli_losses[0]  # it trained
    for name, w in cli_weights.items():
        if name.endswith(NOISE_ONLY):
            continue
        torch.testing.assert_close(hf_weights[name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_one_sequence_per_micro_batch(tmp_path):
    from transformers import TrainingArguments

    from oomb.integrations import OOMBTrainer, collate_one_sequence
    from oomb.models.presets import build_model

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        OOMBTrainer(model=build_model("tiny", dtype=torch.float32, device="cpu"), args=args, train_dataset=[])
    with pytest.raises(ValueError, match="one sequence per micro-batch"):
        collate_one_sequence([{"input_ids": [1, 2]}, {"input_ids": [3, 4]}])
    with pytest.raises(ValueError, match="needs input_ids"):
        collate_one_sequence([{"text": "x"}])
    batch = collate_one_sequence([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "cu_seqlens": [0, 2, 3]}])
    assert batch["input_ids"].shape == (1, 3) and batch["labels"].tolist() == [[-100, 6, 7]]
    assert batch["cu_seqlens"].tolist() == [0, 2, 3]


def test_the_training_loops_refuse_arguments_of_another_type(tmp_path):
    """Trainer and OOMBTrainer raise a TypeError naming the argument and what to pass (the dict of a config
    included), before anything is built on the model, not an AttributeError from inside."""
    from transformers import TrainingArguments

    from oomb import Engine, OOMBConfig
    from oomb.config import TrainConfig
    from oomb.integrations import OOMBTrainer
    from oomb.models.presets import build_model
    from oomb.train import SequenceStream, Trainer

    model = build_model("tiny", dtype=torch.float32, device="cpu")
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, use_cpu=True, report_to=[])
    before = model.config._attn_implementation
    with pytest.raises(TypeError, match=r"^oomb_config must be an OOMBConfig, got dict; pass OOMBConfig\(chunk_size=32\)"):
        OOMBTrainer(model=model, args=args, train_dataset=[], oomb_config={"chunk_size": 32})
    assert model.config._attn_implementation == before
    engine = Engine(model, OOMBConfig(chunk_size=32, page_size=16))
    opt = torch.optim.AdamW(model.parameters())
    stream = SequenceStream([])
    good = dict(engine=engine, optimizer=opt, stream=stream, train=TrainConfig())
    for name, bad, said in [("train", {"steps": 3}, "got dict; pass TrainConfig(steps=..., lr=...) (from oomb.config), "
                                                    "e.g. TrainConfig(**that_dict)"),
                            ("engine", model, "got Qwen2ForCausalLM; pass oomb.Engine(model, OOMBConfig(...))"),
                            ("optimizer", None, "got NoneType; pass a torch.optim.Optimizer"),
                            ("stream", [], "got list; wrap the sequences: SequenceStream(sequences)")]:
        with pytest.raises(TypeError) as info:
            Trainer(**{**good, name: bad})
        assert str(info.value).startswith(f"{name} must be a ") and said in str(info.value), info.value


def test_oomb_trainer_normalises_by_the_step_targets_as_the_oomb_trainer_loop(tmp_path, text):
    """Sequences with different numbers of trained targets (labels -100 on a prefix of varying length): the loss and
    gradients are the mean over the step's targets, as oomb.train.Trainer computes them; a per-sequence mean would
    weight the sequences differently and change the weights."""
    from transformers import TrainingArguments

    from oomb import Engine, OOMBConfig
    from oomb.config import TrainConfig
    from oomb.data import TokenSequences, load_documents, load_tokenizer, tokenize_documents
    from oomb.integrations import OOMBTrainer
    from oomb.models.presets import build_model
    from oomb.train import Sample, Trainer

    tokens = tokenize_documents(load_documents(str(text)), load_tokenizer(None))
    seqs = TokenSequences(tokens, SEQ, seed=0)
    samples = []
    for g in range(STEPS * K):
        ids = seqs[g]
        labels = ids.clone()
        labels[0, : 5 + 9 * g] = -100
        samples.append(Sample(ids, labels))

    class InOrder:
        def __len__(self):
            return len(samples)

        def order(self, epoch):
            return range(len(samples))

        def __getitem__(self, i):
            return samples[i]

    from oomb.train import SequenceStream

    cfg = OOMBConfig(chunk_size=32, page_size=16)
    torch.manual_seed(0)
    ref_model = build_model("tiny", dtype=torch.float32, device="cpu")
    opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    train = TrainConfig(steps=STEPS, grad_accum=K, lr=3e-3, lr_schedule="constant", warmup_steps=0)
    loop = Trainer(Engine(ref_model, cfg), opt, SequenceStream(InOrder()), train)
    with pytest.raises(ValueError, match=r"step is 0: optimizer steps are counted from 1"):
        loop.step(0)  # refused before it changes anything: the losses below are those of a fresh loop
    ref_losses = [loop.step(s).loss for s in range(1, STEPS + 1)]

    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=1, gradient_accumulation_steps=K, max_steps=STEPS,
        learning_rate=3e-3, lr_scheduler_type="constant", adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to=[], train_sampling_strategy="sequential", use_cpu=True,
        disable_tqdm=True)
    rows = [{"input_ids": s.input_ids[0], "labels": s.labels[0]} for s in samples]
    trainer = OOMBTrainer(model=model, args=args, train_dataset=rows, oomb_config=cfg)
    trainer.train()
    hf_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert hf_losses == pytest.approx(ref_losses, rel=1e-5)
    ref = ref_model.state_dict()
    for name, w in model.state_dict().items():
        if name.endswith(NOISE_ONLY):
            continue
        torch.testing.assert_close(w, ref[name], rtol=1e-5, atol=1e-6, msg=name)
