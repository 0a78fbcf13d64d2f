"""`oomb train --val-every`: the held-out loss is that of a plain transformers forward, evaluated at the steps it
should be, of the split it should read; it changes no training loss (resumed or not), leaves the random generators
and train/eval modes alone, and its bad settings are refused in one line with exit status 2."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from cli_helpers import run_cli

pytestmark = pytest.mark.usefixtures("_cache")  # no test reads what another cached

# 2 chunks of 16 tokens per sequence, pages of 8: a step takes a fraction of a second on one core.
FAST = ["--seq-len", "32", "--chunk-size", "16", "--page-size", "8", "--no-progress"]
SENTENCE = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife."


def _rows(n: int, tag: str) -> list[dict]:
    return [{"text": f"{tag} row {i}: " + SENTENCE * (1 + i % 2)} for i in range(n)]


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def folder(tmp_path):
    """train.jsonl beside validation.jsonl: the held-out split is found by name."""
    d = tmp_path / "data"
    d.mkdir()
    _write(d / "train.jsonl", _rows(10, "train"))
    _write(d / "validation.jsonl", _rows(6, "held-out"))
    return d


def _log(out) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r], [r for r in lines if "val_loss" in r]


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("oomb: error:")]
    assert len(err) == 1, err
    return err[0]


def _hf_mean_loss(model, samples) -> tuple[float, int]:
    """Token-weighted mean cross-entropy of a plain transformers forward in float32: each document of each sample
    (its cu_seqlens, or the whole sequence) on its own, with its labels (-100: no loss)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels, cu in samples:
            bounds = cu.tolist() if cu is not None else [0, ids.numel()]
            for a, b in zip(bounds, bounds[1:]):
                if b - a < 2:
                    continue
                lab = labels[a:b]
                n = int((lab[1:] != -100).sum())
                if n == 0:
                    continue
                out = model(input_ids=ids[a:b].view(1, -1), labels=lab.view(1, -1))
                total += float(out.loss) * n
                count += n
    return total / count, count


def test_val_loss_is_a_plain_forward_of_the_validation_split(tmp_path, folder, capsys):
    """The held-out split of a folder is its validation.jsonl, found by name; the last evaluation (after the last
    step: the saved model) equals a transformers forward of its first --val-sequences windows, tokenised here
    independently (one stream, EOS between rows, cut into --seq-len windows in file order)."""
    from transformers import AutoModelForCausalLM

    from oomb.data import load_tokenizer

    out = tmp_path / "run"
    assert run_cli(["train", "--data", folder, *FAST, "--steps", "1", "--val-every", "1", "--val-sequences", "3",
                    "--output-dir", out]) == 0
    captured = capsys.readouterr()
    assert f"3 sequences of --data {folder} [validation]" in captured.err
    steps, vals = _log(out)
    assert [r["step"] for r in steps] == [1] and [r["step"] for r in vals] == [1]
    assert "val      1/1  val_loss" in captured.out

    tok = load_tokenizer(None)
    rows = [json.loads(line)["text"] for line in (folder / "validation.jsonl").read_text().splitlines()]
    stream = []
    for i, text in enumerate(rows):
        stream += ([tok.eos_token_id] if i else []) + tok(text, add_special_tokens=False)["input_ids"]
    windows = [torch.tensor(stream[k * 32:(k + 1) * 32]) for k in range(3)]
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    want, count = _hf_mean_loss(model, [(w, w, None) for w in windows])
    assert vals[0]["val_tokens"] == count == 3 * 31 and vals[0]["val_sequences"] == 3
    assert vals[0]["val_loss"] == pytest.approx(want, abs=2e-5)
    # The validation rows' loss, not the training rows' (the same length of text, other words)
    train_rows = [json.loads(line)["text"] for line in (folder / "train.jsonl").read_text().splitlines()]
    other = tok("\n".join(train_rows), add_special_tokens=False)["input_ids"][:32]
    assert abs(_hf_mean_loss(model, [(torch.tensor(other),) * 2 + (None,)])[0] - want) > 1e-4


def test_val_loss_of_packed_rows_takes_their_labels_and_document_bounds(tmp_path, capsys):
    """--val-data of prompt/completion rows: the held-out sequences are packed as training packs them (labels -100
    on the prompts, one document per row); the loss is a transformers forward of each document with its labels."""
    from transformers import AutoModelForCausalLM

    from oomb.data import build_training_data, load_tokenizer
    from oomb.config import DataConfig

    rows = [{"prompt": f"Question {i}: who is in want of a wife?", "completion": " A single man" + ", truly" * (i % 4)
             + f", number {i}."} for i in range(12)]
    _write(tmp_path / "pc.jsonl", rows)
    _write(tmp_path / "heldout.jsonl", rows[::-1])
    out = tmp_path / "run"
    assert run_cli(["train", "--data", tmp_path / "pc.jsonl", *FAST, "--steps", "1", "--val-every", "1",
                    "--val-data", tmp_path / "heldout.jsonl", "--val-sequences", "2", "--output-dir", out]) == 0
    _, vals = _log(out)
    data = build_training_data(DataConfig(path=str(tmp_path / "heldout.jsonl"), seq_len=32), load_tokenizer(None))
    samples = [data[i] for i in range(2)]
    assert all(s.cu_seqlens is not None and s.labels is not None and (s.labels == -100).any() for s in samples)
    # sequences of different numbers of targets: the mean is over tokens, not over sequences
    assert len({int((s.labels[0, 1:] != -100).sum()) for s in samples}) == 2
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    want, count = _hf_mean_loss(model, [(s.input_ids[0], s.labels[0], s.cu_seqlens) for s in samples])
    assert vals[0]["val_tokens"] == count and vals[0]["val_sequences"] == 2
    assert vals[0]["val_loss"] == pytest.approx(want, abs=2e-5)


def test_evaluations_every_n_steps_and_after_the_last(tmp_path, folder, capsys):
    """--val-every 2 over 5 steps: after steps 2, 4 and 5, each a log line after its step's line, a printed line, a
    TensorBoard scalar; the readers of log.jsonl keep step records and held-out records apart."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from oomb.png import png_kind
    from oomb.train.plot import read_log, read_val_log

    out = tmp_path / "run"
    assert run_cli(["train", "--data", folder, *FAST, "--steps", "5", "--val-every", "2", "--val-sequences", "2",
                    "--report-to", "tensorboard", "--output-dir", out]) == 0
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], "val_loss" in r) for r in lines] == [
        (1, False), (2, False), (2, True), (3, False), (4, False), (4, True), (5, False), (5, True)]
    assert capsys.readouterr().out.count("val_loss") == 3
    assert [r["step"] for r in read_log(out / "log.jsonl")] == [1, 2, 3, 4, 5]
    assert all("loss" in r for r in read_log(out / "log.jsonl"))
    vals = read_val_log(out / "log.jsonl")
    assert [r["step"] for r in vals] == [2, 4, 5]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("val/loss")] == [(r["step"], pytest.approx(r["val_loss"], rel=1e-6))
                                                                   for r in vals]
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5]
    assert png_kind(out / "loss.png") == "loss"


def test_training_is_unchanged_by_evaluations(tmp_path, folder):
    """The training losses and gradient norms with --val-every are those without it, bit for bit."""
    base = ["train", "--data", folder, *FAST, "--steps", "3", "--lr", "1e-2"]
    assert run_cli([*base, "--output-dir", tmp_path / "plain"]) == 0
    assert run_cli([*base, "--val-every", "1", "--val-sequences", "2", "--output-dir", tmp_path / "val"]) == 0
    plain, _ = _log(tmp_path / "plain")
    steps, vals = _log(tmp_path / "val")
    assert [(r["loss"], r["grad_norm"]) for r in steps] == [(r["loss"], r["grad_norm"]) for r in plain]
    assert [r["step"] for r in vals] == [1, 2, 3]


def test_a_resumed_run_trains_and_evaluates_as_the_uninterrupted_one(tmp_path, folder):
    """A run resumed from a checkpoint of a --val-every run has the training and held-out losses of the
    uninterrupted run, bit for bit; in its own folder the log keeps the evaluation of the checkpoint's step once."""
    base = ["train", "--data", folder, *FAST, "--steps", "3", "--save-every", "2", "--lr", "1e-2", "--val-every", "1",
            "--val-sequences", "2"]
    assert run_cli([*base, "--output-dir", tmp_path / "val"]) == 0
    steps, vals = _log(tmp_path / "val")
    shutil.rmtree(tmp_path / "val" / "checkpoints" / "step-00000003")
    assert run_cli([*base, "--resume", "latest", "--output-dir", tmp_path / "val"]) == 0
    r_steps, r_vals = _log(tmp_path / "val")
    assert [(r["step"], r["loss"]) for r in r_steps] == [(r["step"], r["loss"]) for r in steps]
    assert [(r["step"], r["val_loss"]) for r in r_vals] == [(r["step"], r["val_loss"]) for r in vals]


def test_an_evaluation_restores_random_generators_and_modes():
    """Whatever an evaluation draws from a random generator or whichever mode it sets, the generators and every
    module's train/eval mode are as before it; it runs in eval mode."""
    from oomb import Engine, OOMBConfig
    from oomb.models.presets import build_model
    from oomb.train import HeldOutLoss
    from oomb.train.sequences import Sample

    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    model.train()
    model.model.layers[1].eval()  # a mixed state, kept as it is
    engine = Engine(model, OOMBConfig(chunk_size=16, page_size=8))
    ids = torch.randint(0, 1000, (1, 32))
    held = HeldOutLoss(engine, [Sample(ids), Sample(ids.flip(-1))])
    seen = []
    evaluate = engine.evaluate

    def drawing(*a, **k):
        seen.append(model.training)
        random.random(), np.random.rand(), torch.rand(3)
        return evaluate(*a, **k)

    engine.evaluate = drawing
    modes = [m.training for m in model.modules()]
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()
    record = held.evaluate(3)
    assert seen == [False, False]
    assert [m.training for m in model.modules()] == modes
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert torch.equal(torch.get_rng_state(), before[2])
    want = (evaluate(ids) + evaluate(ids.flip(-1))) / 2  # two sequences of 31 targets each
    assert record.step == 3 and record.val_tokens == 62 and record.val_loss == pytest.approx(want, rel=1e-6)


def test_oomb_data_reports_the_held_out_data_a_run_would_evaluate(tmp_path, folder, capsys):
    """``oomb data`` with the run's --val-* flags says what the held-out loss would read (the split, its sequences,
    how many are evaluated) and refuses what ``oomb train`` refuses, in the same words."""
    png = tmp_path / "lengths.png"
    assert run_cli(["data", "--data", folder, *FAST, "--val-every", "2", "--val-sequences", "4", "--output", png]) == 0
    held = [line for line in capsys.readouterr().out.splitlines() if line.startswith("oomb: held-out ")]
    assert len(held) == 1, held
    assert f"(--data {folder} [validation])" in held[0] and "6 documents (text)" in held[0], held[0]
    assert held[0].endswith("--val-every 2 evaluates the first 4 sequences"), held[0]
    assert run_cli(["data", "--data", folder, *FAST, "--val-every", "1", "--val-split", "dev", "--output", png]) == 2
    line = _one_error_line(capsys)
    assert "--val-split 'dev'" in line and "its splits: train, validation" in line
    assert run_cli(["data", "--data", folder, *FAST, "--output", png]) == 0
    assert "held-out" not in capsys.readouterr().out  # no --val-every: no held-out loss, nothing to report


def test_data_without_a_held_out_split_is_refused_before_training(tmp_path, capsys):
    """A single file (one split, train) or the bundled corpus with --val-every and neither --val-data nor
    --val-split: one line naming the problem and the fix, exit status 2, nothing written."""
    _write(tmp_path / "rows.jsonl", _rows(10, "train"))
    out = tmp_path / "run"
    assert run_cli(["train", "--data", tmp_path / "rows.jsonl", *FAST, "--val-every", "1", "--output-dir", out]) == 2
    line = _one_error_line(capsys)
    assert "has no validation or test split (its splits: train)" in line
    assert "validation.jsonl" in line and "--val-data PATH" in line and "--val-split NAME" in line
    assert not (out / "log.jsonl").exists() and not (out / "checkpoints").exists()
    assert run_cli(["train", *FAST, "--val-every", "1", "--output-dir", out]) == 2
    assert "the bundled corpus, which has no validation or test split" in _one_error_line(capsys)


def test_a_split_the_data_lacks_is_refused(tmp_path, folder, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "--data", folder, *FAST, "--val-every", "1", "--val-split", "dev", "--output-dir", out]) == 2
    line = _one_error_line(capsys)
    assert "--val-split 'dev'" in line and "its splits: train, validation" in line and "--val-split validation" in line
    assert not (out / "log.jsonl").exists()


def test_a_missing_val_data_path_is_refused(tmp_path, folder, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "--data", folder, *FAST, "--val-every", "1", "--val-data", tmp_path / "nope.jsonl",
                    "--output-dir", out]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("oomb: error: --val-data: data path") and "does not exist" in line and "pass --val-data" in line
    assert not (out / "log.jsonl").exists()


@pytest.mark.parametrize("flags, named", [
    (["--val-sequences", "4"], "--val-sequences"),
    (["--val-split", "test"], "--val-split"),
    (["--val-data", "held.jsonl"], "--val-data"),
    (["--val-every", "0", "--val-split", "test"], "--val-split"),
])
def test_val_flags_without_val_every_are_refused(tmp_path, capsys, flags, named):
    """A held-out setting with --val-every 0 (the default) would be read by nothing: refused, naming both flags."""
    assert run_cli(["train", *FAST, *flags, "--output-dir", tmp_path / "run"]) == 2
    line = _one_error_line(capsys)
    assert f"{named} sets up the held-out loss but --val-every is 0" in line and f"leave {named} out" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags", [["--val-every", "-1"], ["--val-every", "2", "--val-sequences", "0"]])
def test_bad_val_numbers_are_refused(tmp_path, capsys, flags):
    assert run_cli(["train", *FAST, *flags, "--output-dir", tmp_path / "run"]) == 2
    assert flags[-2] in _one_error_line(capsys)


def test_print_config_round_trips_the_validation_section(tmp_path, capsys):
    """--print-config writes the validation section; read back with --config it gives the same configuration, and a
    bad value in the file is named as the file's key."""
    import yaml

    argv = ["train", "--val-every", "3", "--val-split", "test", "--val-sequences", "5", "--print-config"]
    assert run_cli(argv) == 0
    text = capsys.readouterr().out
    assert yaml.safe_load(text)["validation"] == {"every": 3, "data": None, "split": "test", "sequences": 5}
    config = tmp_path / "run.yaml"
    config.write_text(text)
    assert run_cli(["train", "--config", config, "--print-config"]) == 0
    assert capsys.readouterr().out == text
    assert run_cli(["train", "--config", config, "--val-every", "0", "--print-config"]) == 2
    assert "validation.split (in " in _one_error_line(capsys)


@pytest.mark.slow  # torchrun with two gloo ranks
def test_torchrun_ranks_share_the_held_out_sequences(tmp_path, folder):
    """Under torchrun (2 gloo ranks, one launch) 3 held-out sequences are shared 2 + 1, with --shard none, params
    (rank 1 repeats a forward it does not count, as FSDP2's all-gathers need) and grads-optim: the held-out loss of
    rank 0's log is that of one process evaluating all 3 (a tiny --lr: the same weights whatever the ranks)."""
    from tests.cli.test_cli_shard import DRIVER, _torchrun

    common = ["train", "--data", folder, *FAST, "--steps", "2", "--val-every", "1", "--val-sequences", "3",
              "--lr", "1e-6"]
    modes = ("none", "params", "grads-optim")
    target = [DRIVER, tmp_path / "statuses.json"]
    for mode in modes:
        target += ["--", *map(str, [*common, "--shard", mode, "--output-dir", tmp_path / mode])]
    res = _torchrun(target)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((tmp_path / "statuses.json").read_text()) == [0, 0, 0], res.stderr[-3000:]
    assert run_cli([*common, "--grad-accum", "2", "--output-dir", tmp_path / "one"]) == 0
    _, want = _log(tmp_path / "one")
    assert [(r["step"], r["val_tokens"], r["val_sequences"]) for r in want] == [(1, 93, 3), (2, 93, 3)]
    for mode in modes:
        _, got = _log(tmp_path / mode)
        assert [(r["step"], r["val_tokens"], r["val_sequences"]) for r in got] == [(1, 93, 3), (2, 93, 3)], mode
        for g, w in zip(got, want):
            assert g["val_loss"] == pytest.approx(w["val_loss"], abs=1e-5), (mode, got, want)


def test_data_splits_names_the_splits_without_reading_rows(tmp_path, folder):
    """The splits the held-out default is chosen from: a folder's by its file names, a save_to_disk DatasetDict's by
    its index, a folder of .txt files by its file names, one train split for a single file, a folder of .txt files
    whose names say no split and the bundled corpus."""
    from datasets import Dataset, DatasetDict

    from oomb.data import data_splits

    assert data_splits(str(folder)) == ["train", "validation"]
    assert data_splits(str(folder / "train.jsonl")) == ["train"]
    assert data_splits(None) == ["train"]
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "emma.txt").write_text(SENTENCE)  # no name says a split: one train split of documents
    assert data_splits(str(tmp_path / "txt")) == ["train"]
    (tmp_path / "txt" / "emma.txt").rename(tmp_path / "txt" / "train.txt")
    (tmp_path / "txt" / "test.txt").write_text(SENTENCE)
    assert data_splits(str(tmp_path / "txt")) == ["train", "test"]
    rows = Dataset.from_list(_rows(3, "x"))
    DatasetDict({"train": rows, "test": rows}).save_to_disk(str(tmp_path / "saved"))
    assert data_splits(str(tmp_path / "saved")) == ["train", "test"]
    rows.save_to_disk(str(tmp_path / "single"))
    assert data_splits(str(tmp_path / "single")) == ["train"]


def _notes(capsys) -> list[str]:
    out = capsys.readouterr()
    return [line for line in (out.out + out.err).splitlines() if "is the split training reads" in line]


def test_val_data_that_is_the_training_data_and_split_is_noted(tmp_path, folder, capsys, monkeypatch):
    """--val-data naming the --data path (spelled otherwise: the same resolved path) with --val-split train
    evaluates training sequences: noted as when --val-data is not given; another path is not noted."""
    monkeypatch.chdir(tmp_path)
    png = tmp_path / "lengths.png"
    argv = ["data", "--data", "data", *FAST, "--val-every", "1", "--val-split", "train", "--output", png]
    assert run_cli([*argv, "--val-data", f"./data/../{folder.name}/"]) == 0
    notes = _notes(capsys)
    assert len(notes) == 1 and "the held-out loss is of training sequences" in notes[0], notes
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    assert run_cli([*argv, "--val-data", other]) == 0
    assert _notes(capsys) == []
    out = tmp_path / "run"
    assert run_cli(["train", "--data", folder, *FAST, "--steps", "1", "--val-every", "1", "--val-data", folder,
                    "--val-split", "train", "--output-dir", out]) == 0
    assert len(_notes(capsys)) == 1


def test_the_training_split_note_names_what_was_given(tmp_path, folder, capsys):
    """The note names the settings as the user gave them: no --val-split where the held-out split defaulted to the
    one --data-split chose, and the --config file's keys where the values came from the file."""
    png = tmp_path / "lengths.png"
    argv = ["data", *FAST, "--val-every", "1", "--output", png]
    assert run_cli([*argv, "--data", folder, "--data-split", "validation"]) == 0
    assert _notes(capsys) == ["oomb: note: the held-out split 'validation' is the split training reads "
                              "(--data-split validation): the held-out loss is of training sequences"]
    config = tmp_path / "run.yaml"
    config.write_text(f"data:\n  path: {folder}\n  split: validation\n")
    assert run_cli([*argv, "--config", config]) == 0
    assert _notes(capsys) == [f"oomb: note: the held-out split 'validation' is the split training reads "
                              f"(data.split (in {config}) validation): the held-out loss is of training sequences"]
    config.write_text(f"validation:\n  every: 1\n  split: train\n")
    assert run_cli(["data", *FAST, "--output", png, "--data", folder, "--config", config]) == 0
    assert _notes(capsys) == [f"oomb: note: validation.split (in {config}) train is the split training reads: the "
                              "held-out loss is of training sequences"]
    assert run_cli([*argv, "--data", folder, "--val-split", "train", "--val-data", folder]) == 0
    assert _notes(capsys) == [f"oomb: note: --val-split train of --val-data {folder} is the split training reads "
                              f"(--data {folder}): the held-out loss is of training sequences"]
