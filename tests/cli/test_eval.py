"""`oomb eval`: dense loss against a plain Hugging Face forward, sparse = dense when the budget holds the whole
past, a small budget really runs the sparse path, deterministic windows, and one-line refusals of bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from oomb.data import load_documents, load_tokenizer, tokenize_documents
from oomb.evaluation import token_windows
from cli_helpers import run_cli

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered as the rightful property of some one or other "
    "of their daughters.\n"
)
# Windows of 128 tokens, chunks of 32, pages of 8: the last chunk has 12 past pages.
S = 128
SMALL = ["--seq-len", str(S), "--chunk-size", "32", "--page-size", "8"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("data") / "text.txt"
    # Varied text (not one sentence repeated), so that attention to distant pages matters.
    f.write_text("".join(f"{i}: {TEXT[(7 * i) % 200 :]}{TEXT[: (7 * i) % 200]}" for i in range(8)))
    return f


@pytest.fixture(scope="module")
def tokens(text_file):
    return tokenize_documents(load_documents(text_file), load_tokenizer(None))


def run_eval(tmp_path, argv, name="report.json"):
    js = tmp_path / name
    assert run_cli(["eval", *argv, "--json", js]) == 0
    return json.loads(js.read_text())


def _check_refused(status, capsys, fragment):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("oomb: error: ") and "; " in lines[0], lines[0]
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err


def _hf_losses(model, windows):
    model.eval()
    with torch.no_grad():
        return [float(model(input_ids=w, labels=w).loss) for w in windows]


def test_dense_loss_of_a_trained_output_equals_a_plain_hf_forward(tmp_path, text_file, tokens, capsys):
    """fp32: the dense row's per-window losses equal transformers' own full-sequence loss on the same windows,
    for an `oomb train` output folder (model and tokenizer read from it)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, "--seq-len", "128", "--chunk-size", "64",
                    "--page-size", "32", "--steps", "1", "--no-progress"]) == 0
    capsys.readouterr()
    report = run_eval(tmp_path, ["--model", out, "--data", text_file, *SMALL, "--num-windows", "2"])
    assert f"tokenizer {out}" in capsys.readouterr().err  # the output folder's tokenizer, not the bundled one
    dense = report["rows"][0]
    assert dense["mode"] == "dense" and dense["budget"] is None and len(report["rows"]) == 1
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ref = _hf_losses(model, token_windows(tokens, S, 2))
    assert dense["window_losses"] == pytest.approx(ref, rel=2e-6, abs=0)
    assert dense["loss"] == pytest.approx(sum(ref) / 2, rel=2e-6, abs=0)
    assert dense["tokens"] == 2 * (S - 1) and dense["window_tokens"] == [S - 1, S - 1]
    assert dense["perplexity"] == pytest.approx(np.exp(dense["loss"]), rel=1e-12)


def test_dense_loss_of_a_preset_equals_a_plain_hf_forward(tmp_path, text_file, tokens):
    from oomb.models.presets import build_model

    report = run_eval(tmp_path, ["--model", "tiny", "--seed", "3", "--data", text_file, *SMALL, "--num-windows", "1"])
    torch.manual_seed(3)
    ref = _hf_losses(build_model("tiny"), token_windows(tokens, S, 1))
    assert report["rows"][0]["window_losses"] == pytest.approx(ref, rel=2e-6, abs=0)


def test_a_budget_holding_the_whole_past_is_dense_and_a_small_one_is_not(tmp_path, text_file, capsys):
    # 12 past pages in the last chunk: budget 12 (no sink/local pages) holds them all; budget 1 does not.
    report = run_eval(tmp_path, ["--data", text_file, *SMALL, "--num-windows", "2", "--budgets", "1", "12",
                                 "--sink-pages", "0", "--local-pages", "0"])
    out, err = capsys.readouterr()
    dense, small, whole = report["rows"]
    assert (small["budget"], whole["budget"]) == (1, 12)
    assert whole["window_losses"] == dense["window_losses"] and whole["rel_change_pct"] == 0.0
    assert all(abs(s - d) > 1e-5 for s, d in zip(small["window_losses"], dense["window_losses"])), (small, dense)
    assert small["rel_change_pct"] == pytest.approx((small["loss"] - dense["loss"]) / dense["loss"] * 100)
    # the Markdown table: one row per mode, and the note that budget 12 equals dense
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows] == ["mode", "dense", "sparse 1", "sparse 12"]
    assert f"{dense['loss']:.6f}" in rows[1] and f"{small['rel_change_pct']:+.3f}%" in rows[2]
    assert "note: budget 12 " in err and "budget 1," not in err


def test_windows_are_consecutive_deterministic_and_capped(tmp_path, text_file, tokens, capsys, monkeypatch):
    available = len(tokens) // S
    assert available >= 4
    windows = token_windows(tokens, S)
    assert len(windows) == available
    for i, w in enumerate(windows):
        assert w.shape == (1, S) and w.dtype == torch.int64
        assert torch.equal(w[0], torch.from_numpy(tokens[i * S : (i + 1) * S]))
    # default: every whole window, at most the cap (a note says how many there are)
    import oomb.cli.measure as cli

    monkeypatch.setattr(cli, "_EVAL_MAX_WINDOWS", 2)
    a = run_eval(tmp_path, ["--data", text_file, *SMALL], "a.json")
    assert f"2 windows of {S} (of {available}; --num-windows {available} for all)" in capsys.readouterr().err
    assert a["num_windows"] == 2 and a["window_starts"] == [0, S]
    # the same windows again: identical losses; --num-windows 1 gives the first of them
    b = run_eval(tmp_path, ["--data", text_file, *SMALL], "b.json")
    assert b["rows"][0]["window_losses"] == a["rows"][0]["window_losses"]
    c = run_eval(tmp_path, ["--data", text_file, *SMALL, "--num-windows", "1"], "c.json")
    assert c["rows"][0]["window_losses"] == a["rows"][0]["window_losses"][:1]


def test_json_replaces_only_an_earlier_eval_report(tmp_path, text_file, capsys):
    """--json PATH overwrote any file; now only an earlier eval report (or an empty file) is replaced."""
    from oomb.cli.measure import _EVAL_REPORT_KEYS

    argv = ["--data", text_file, *SMALL, "--num-windows", "1"]
    notes = tmp_path / "notes.json"
    notes.write_text('{"my": "results"}\n')
    _check_refused(run_cli(["eval", *argv, "--json", notes]), capsys,
                   f"--json {str(notes)!r} exists and is not an earlier 'oomb eval' report")
    assert notes.read_text() == '{"my": "results"}\n'
    text = tmp_path / "text.json"
    text.write_text("not json at all")
    _check_refused(run_cli(["eval", *argv, "--json", text]), capsys, "is not an earlier 'oomb eval' report")
    assert text.read_text() == "not json at all"
    # an earlier report (and an empty file) may be replaced
    first = run_eval(tmp_path, argv)
    assert _EVAL_REPORT_KEYS <= first.keys()
    assert run_eval(tmp_path, argv)["rows"][0]["window_losses"] == first["rows"][0]["window_losses"]
    (tmp_path / "empty.json").write_text("")
    assert run_eval(tmp_path, argv, "empty.json")["num_windows"] == 1


def test_token_windows_refuses_too_little_data():
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(np.arange(10), 11)
    with pytest.raises(ValueError, match=r"the data \(10 tokens\) holds 2 windows of seq_len 5"):
        token_windows(np.arange(10), 5, 3)
    with pytest.raises(ValueError, match="holds 1 window of seq_len 6"):
        token_windows(np.arange(10), 6, 2)
    with pytest.raises(ValueError, match="the data has 1,500 tokens, fewer than one window of seq_len 2,000"):
        token_windows(np.arange(1500), 2000)


def test_the_dense_budget_note_counts_past_pages_in_their_number(capsys):
    from types import SimpleNamespace

    from oomb.cli.measure import _note_dense_budgets

    for seq_len, said in ((128, "covers the 1 past page of the last chunk"), (64 * 1002, "covers all 1,001 past pages")):
        args = SimpleNamespace(seq_len=seq_len, chunk_size=64, page_size=64, sink_pages=1, local_pages=8)
        _note_dense_budgets(args, [5000], "same loss")
        assert said in capsys.readouterr().err


def test_bad_eval_input_exits_2_with_one_line(tmp_path, text_file, tokens, capsys):
    n = len(tokens)
    base = ["eval", "--data", text_file, *SMALL]
    _check_refused(run_cli(["eval", "--data", text_file, "--seq-len", n + 1]), capsys,
                   f"the data has {n:,} tokens, fewer than one window of --seq-len {n + 1}; pass --seq-len {n} or less")
    # budget 0 means only the sink and local pages (as in train and grad-error); with neither, no past at all
    _check_refused(run_cli([*base, "--budgets", "4", "0", "--sink-pages", "0", "--local-pages", "0"]), capsys,
                   "--budgets 0 with --sink-pages 0 and --local-pages 0 attends to no past page")
    _check_refused(run_cli([*base, "--budgets", "-2"]), capsys, "--budgets has -2")
    # sparse options without --budgets would be ignored (the run is dense only)
    _check_refused(run_cli([*base, "--local-pages", "2"]), capsys,
                   "--local-pages sets sparse attention but --budgets is not given; add --budgets with the page budgets")
    _check_refused(run_cli([*base, "--sink-pages", "0", "--sparse-score", "quest"]), capsys,
                   "--sink-pages and --sparse-score set sparse attention but --budgets is not given")
    _check_refused(run_cli([*base, "--num-windows", "0"]), capsys, "--num-windows is 0")
    _check_refused(run_cli([*base, "--num-windows", "999"]), capsys, f"pass --num-windows {n // S} or less")
    _check_refused(run_cli(["eval", "--data", text_file, "--seq-len", "1"]), capsys, "--seq-len is 1")
    _check_refused(run_cli(["eval", "--data", text_file, "--chunk-size", "100", "--page-size", "64"]), capsys, "not a multiple of --page-size")
    _check_refused(run_cli([*base, "--sink-pages", "-1"]), capsys, "--sink-pages")
    _check_refused(run_cli([*base, "--json", tmp_path]), capsys, "is a folder")
    _check_refused(run_cli([*base, "--model", "gpt-17"]), capsys, "gpt-17")
    _check_refused(run_cli([*base, "--budgets"]), capsys, "--budgets")
    if not torch.cuda.is_available():
        _check_refused(run_cli([*base, "--device", "cuda"]), capsys, "--device cuda")
        _check_refused(run_cli([*base, "--attention-backend", "triton"]), capsys, "--attention-backend triton")


@pytest.mark.parametrize("lora", [False, True])
def test_a_checkpoint_reads_as_the_model_its_run_saved(tmp_path, text_file, capsys, lora):
    """--model naming a checkpoint folder rebuilds the run's model (a preset drawn from the run's seed, the LoRA
    adapter merged): its losses equal those of the model the run saved at the same step, exactly, and an earlier
    step's differ; a run folder that holds no saved model is read at its latest checkpoint, with a note."""
    import shutil

    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, "--seq-len", "128", "--chunk-size", "64",
                    "--page-size", "32", "--steps", "2", "--save-every", "1", "--seed", "5", "--lr", "1e-2",
                    "--no-progress", *(["--lora-rank", "4", "--train-embeddings-norms"] if lora else [])]) == 0
    windows = ["--data", text_file, *SMALL, "--num-windows", "2"]
    saved = run_eval(tmp_path, ["--model", out, *windows])["rows"][0]["window_losses"]
    last = run_eval(tmp_path, ["--model", out / "checkpoints" / "step-00000002", *windows])["rows"][0]["window_losses"]
    first = run_eval(tmp_path, ["--model", out / "checkpoints" / "step-00000001", *windows])["rows"][0]["window_losses"]
    assert last == saved and first != saved
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(out / "checkpoints", stopped / "checkpoints")
    capsys.readouterr()
    assert run_eval(tmp_path, ["--model", stopped, *windows])["rows"][0]["window_losses"] == saved
    assert f"oomb: note: {stopped} holds no saved model: reading its latest checkpoint, step-00000002" in \
        capsys.readouterr().err
    assert run_eval(tmp_path, ["--model", out / "checkpoints", *windows])["rows"][0]["window_losses"] == saved
    killed = tmp_path / "killed"  # a run stopped before its first checkpoint: only its log
    killed.mkdir()
    shutil.copy(out / "log.jsonl", killed / "log.jsonl")
    capsys.readouterr()
    _check_refused(run_cli(["eval", "--model", killed, *windows]), capsys,
                   "is the output folder of an oomb train run that stopped before it saved its model or a complete "
                   "checkpoint; train it again")
    weights = stopped / "checkpoints" / "step-00000002" / "trainable.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:100])
    _check_refused(run_cli(["eval", "--model", stopped, *windows]), capsys,
                   f"{weights} is truncated (100 of its {size:,} bytes); pass the earlier checkpoint beside it, "
                   f"{stopped / 'checkpoints' / 'step-00000001'}, or restore the file")


@pytest.mark.parametrize("edit, said", [
    (lambda meta: "{\"format\": 1,", "meta.json is corrupt"),
    (lambda meta: json.dumps([meta]), "is not an oomb checkpoint of format 1"),
    (lambda meta: json.dumps({**meta, "files": {}}), "its file list names no trainable.safetensors"),
    (lambda meta: json.dumps({**meta, "fingerprint": {**meta["fingerprint"], "seed": "x"}}), 'has seed "x", not an integer'),
    (lambda meta: json.dumps({**meta, "fingerprint": {**meta["fingerprint"], "dtype": "int64"}}), 'has dtype "int64"'),
    (lambda meta: json.dumps({**meta, "fingerprint": {**meta["fingerprint"], "lora_rank": -3}}), "has lora_rank -3"),
    (lambda meta: json.dumps({**meta, "fingerprint": {**meta["fingerprint"], "rope_theta": "big"}}), 'has rope_theta "big"'),
    (lambda meta: json.dumps({**meta, "fingerprint": {**meta["fingerprint"], "lora_rank": 2, "lora_targets": "foo_proj"}}),
     'has lora_targets "foo_proj", not linear layers of the model'),
    (lambda meta: json.dumps({**meta, "fingerprint": {**meta["fingerprint"], "tokenizer": "/nowhere/tok"}}),
     "the tokenizer folder of the checkpoint's run, '/nowhere/tok', does not exist; put it back there"),
])
def test_a_damaged_or_edited_checkpoint_meta_is_one_line_naming_the_earlier_checkpoint(tmp_path, text_file, capsys,
                                                                                         edit, said):
    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, "--seq-len", "128", "--chunk-size", "64",
                    "--page-size", "32", "--steps", "2", "--save-every", "1", "--no-progress"]) == 0
    meta_file = out / "checkpoints" / "step-00000002" / "meta.json"
    meta_file.write_text(edit(json.loads(meta_file.read_text())))
    capsys.readouterr()
    status = run_cli(["eval", "--model", meta_file.parent, "--data", text_file, *SMALL, "--num-windows", "1"])
    _check_refused(status, capsys, said)
    if "tokenizer" not in said:
        assert capsys.readouterr().err == ""
        assert run_cli(["eval", "--model", meta_file.parent, "--data", text_file, *SMALL, "--num-windows", "1"]) == 2
        assert f"pass the earlier checkpoint beside it, {out / 'checkpoints' / 'step-00000001'}, or restore" in \
            capsys.readouterr().err


def test_data_split_and_text_field_pick_the_held_out_rows(tmp_path, text_file, capsys):
    """A folder of train.jsonl and test.jsonl was read at its train split, with no flag to pick the held-out one:
    --data-split (and --text-field) read as in oomb train; --task passkey, which reads no --data, refuses them."""
    folder = tmp_path / "rows"
    folder.mkdir()
    text = text_file.read_text()
    (folder / "train.jsonl").write_text(json.dumps({"body": "short words " * 3}) + "\n")
    (folder / "test.jsonl").write_text(json.dumps({"body": text}) + "\n")
    argv = ["--data", folder, "--text-field", "body", *SMALL, "--num-windows", "1"]
    held_out = run_eval(tmp_path, [*argv, "--data-split", "test"])
    assert held_out["rows"][0]["window_losses"] == run_eval(tmp_path, ["--data", text_file, *SMALL, "--num-windows",
                                                                       "1"])["rows"][0]["window_losses"]
    capsys.readouterr()
    _check_refused(run_cli(["eval", *argv, "--data-split", "validation"]), capsys,
                   f"{str(folder)!r} has no split 'validation' (it has: train, test)")
    _check_refused(run_cli(["eval", "--task", "passkey", "--lengths", "128", "--data-split", "test"]), capsys,
                   "--data-split is not read by --task passkey")
