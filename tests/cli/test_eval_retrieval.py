"""`oomb eval --task passkey|needle` and `oomb data --make`: the table, --json and --heatmap of a tiny preset, a
trained output folder, the same numbers as the library, and one-line refusals of bad input (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from cli_helpers import run_cli
from tests.cli.test_eval import _check_refused

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = ["--chunk-size", "64", "--page-size", "16"]


def test_passkey_on_a_preset_writes_the_table_json_and_heatmap(tmp_path, capsys):
    js, png = tmp_path / "passkey.json", tmp_path / "passkey.png"
    argv = ["eval", "--task", "passkey", "--lengths", "96", "160", "--depths", "0", "50", "100", "--trials", "2",
            "--budgets", "2", *SMALL, "--json", js, "--heatmap", png]
    assert run_cli(argv) == 0
    out, err = capsys.readouterr()
    data = json.loads(js.read_text())
    assert png.read_bytes()[:8] == PNG and "wrote the heatmap" in err
    from oomb.png import png_kind

    assert png_kind(png) == "heatmap"  # a later --heatmap may replace it; another PNG is refused (test_bad_input...)
    assert "12 prompts: 2 lengths x 3 depths x 2 trials; chunk 64, page 16" in err
    assert "**passkey, dense: exact match over 2 trials per cell**" in out
    assert (data["task"], data["lengths"], data["depths"], data["trials"]) == ("passkey", [96, 160], [0.0, 50.0, 100.0], 2)
    assert [r["mode"] for r in data["rows"]] == ["dense", "sparse"] and data["rows"][1]["budget"] == 2
    for row in data["rows"]:
        assert len(row["results"]) == 12
        grid = [[sum(t["exact"] for t in row["results"] if t["length"] == n and t["depth"] == d) / 2
                 for n in data["lengths"]] for d in data["depths"]]
        assert row["accuracy_grid"] == grid
    tables = [line for line in out.splitlines() if line.startswith("| ")]
    assert tables.count("| depth \\ length | 96 | 160 |") == 2 and sum(t.startswith("| 50% |") for t in tables) == 2
    # the library on the same prompts gives the same numbers
    from oomb import OOMBConfig
    from oomb.data import load_tokenizer
    from oomb.models.presets import build_model
    from oomb.retrieval import build_prompts, evaluate_retrieval

    torch.manual_seed(0)
    prompts = build_prompts("passkey", load_tokenizer(None), [96, 160], [0, 50, 100], trials=2)
    ref = evaluate_retrieval(build_model("tiny"), prompts, OOMBConfig(chunk_size=64, page_size=16)).rows[0]
    assert [t["logprob"] for t in data["rows"][0]["results"]] == pytest.approx([t.logprob for t in ref.trials], abs=1e-6)
    # the same run again may replace its own report and picture
    assert run_cli(argv) == 0
    capsys.readouterr()
    assert json.loads(js.read_text())["rows"][0]["results"] == data["rows"][0]["results"]


def test_needle_on_a_trained_output_folder(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "--output-dir", out, "--seq-len", "128", "--chunk-size", "64", "--page-size", "32",
                    "--steps", "1", "--no-progress"]) == 0
    capsys.readouterr()
    js = tmp_path / "needle.json"
    assert run_cli(["eval", "--task", "needle", "--model", out, "--needles", "3", "--lengths", "200", "--depths", "0",
                    "100", *SMALL, "--json", js]) == 0
    err = capsys.readouterr().err
    assert f"tokenizer {out}" in err and "3 needles each" in err
    data = json.loads(js.read_text())
    assert data["needles"] == 3 and len(data["rows"][0]["results"]) == 2


@pytest.mark.parametrize("written, task", [("loss", "passkey"), ("passkey", "needle"), ("needle", "passkey"),
                                           ("needle", "loss")])
def test_a_json_report_of_another_task_is_refused_naming_both_tasks(tmp_path, capsys, written, task):
    from oomb.cli.measure import _EVAL_REPORT_KEYS
    from oomb.cli.retrieval import RETRIEVAL_REPORT_KEYS

    keys = _EVAL_REPORT_KEYS if written == "loss" else RETRIEVAL_REPORT_KEYS
    report = tmp_path / "report.json"
    report.write_text(json.dumps({**{k: [] for k in keys}, **({} if written == "loss" else {"task": written})}))
    before = report.read_text()
    argv = ["eval", "--task", task, "--json", report, *(["--num-windows", "1"] if task == "loss" else [])]
    _check_refused(run_cli(argv), capsys, f"--json {str(report)!r} is a report of 'oomb eval --task {written}', "
                                          f"not of --task {task}, so writing would destroy it")
    assert report.read_text() == before


def _digitless_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[EOS]", "The", "is", "pass", "key"] + [f"w{i}" for i in range(300)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(tmp_path / "tk")
    return tmp_path / "tk"


def test_bad_retrieval_input_gets_one_line(tmp_path, capsys):
    _check_refused(run_cli(["eval", "--task", "passkey", "--depths", "0", "120"]), capsys,
                   "--depths has 120, outside [0, 100]")
    _check_refused(run_cli(["eval", "--task", "needle", "--depths", "-5"]), capsys, "--depths has -5")
    _check_refused(run_cli(["eval", "--task", "passkey", "--lengths", "40", *SMALL]), capsys,
                   "length 40 is too short")
    _check_refused(run_cli(["eval", "--task", "needle", "--lengths", "12", *SMALL]), capsys, "pass --lengths of")
    _check_refused(run_cli(["eval", "--task", "passkey", "--tokenizer", _digitless_tokenizer(tmp_path), *SMALL]),
                   capsys, "cannot encode the digits")
    _check_refused(run_cli(["eval", "--depths", "10"]), capsys, "--depths sets up a retrieval evaluation but --task is loss")
    _check_refused(run_cli(["eval", "--task", "passkey", "--num-windows", "2"]), capsys, "--num-windows counts loss windows")
    _check_refused(run_cli(["eval", "--task", "passkey", "--needles", "3"]), capsys, "--needles is for --task needle")
    _check_refused(run_cli(["eval", "--task", "passkey", "--data", tmp_path]), capsys, "--data is not read by --task passkey")
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    _check_refused(run_cli(["eval", "--task", "passkey", "--json", other]), capsys, "is not an earlier")
    _check_refused(run_cli(["eval", "--task", "passkey", "--heatmap", other]), capsys, "is not a PNG image")
    assert other.read_text() == '{"mine": 1}'
    # a PNG that is not an earlier heatmap (here: a photo) is kept
    from PIL import Image

    photo = tmp_path / "loss.png"
    Image.new("RGB", (8, 8)).save(photo)
    before = photo.read_bytes()
    _check_refused(run_cli(["eval", "--task", "passkey", "--heatmap", photo]), capsys,
                   "exists and is not an earlier oomb heatmap (a PNG that another command or program wrote)")
    assert photo.read_bytes() == before
    # the heatmap is a PNG: a path with another image suffix is refused before anything runs
    for name in ("heat.jpg", "heat.svg"):
        _check_refused(run_cli(["eval", "--task", "passkey", "--heatmap", tmp_path / name]), capsys,
                       f"ends in .{name[5:]}, but the heatmap is written as a PNG image only; pass a path ending in .png")
        assert not (tmp_path / name).exists()
    # a loss report and a retrieval report do not replace each other
    loss = tmp_path / "loss.json"
    assert run_cli(["eval", "--seq-len", "64", "--num-windows", "1", *SMALL, "--json", loss]) == 0
    capsys.readouterr()
    _check_refused(run_cli(["eval", "--task", "passkey", "--json", loss]), capsys,
                   "is a report of 'oomb eval --task loss', not of --task passkey")
    # a model whose vocabulary the prompts' token ids exceed: the prompts are named, not a --data passkey reads not
    from transformers import AutoModelForCausalLM, Qwen2Config

    small = tmp_path / "small-vocab"
    AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(small)
    _check_refused(run_cli(["eval", "--task", "passkey", "--model", small, "--lengths", "256", *SMALL]), capsys,
                   "the passkey prompts (tokenizer bundled) have token id")


def test_oomb_data_make_writes_rows_oomb_train_reads(tmp_path, capsys):
    rows_file = tmp_path / "passkey.jsonl"
    assert run_cli(["data", "--make", "passkey", "--examples", "4", "--make-lengths", "120", "--make-output", rows_file]) == 0
    assert "wrote 4 passkey rows" in capsys.readouterr().out
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert len(rows) == 4 and all(r["prompt"].endswith("The pass key is") and r["completion"] == r["answer"]
                                  for r in rows)
    first = rows_file.read_text()
    assert run_cli(["data", "--make", "passkey", "--examples", "4", "--make-lengths", "120", "--make-output", rows_file]) == 0
    assert rows_file.read_text() == first  # same seed, same rows; its own file may be replaced
    capsys.readouterr()
    assert run_cli(["train", "--data", rows_file, "--output-dir", tmp_path / "run", "--seq-len", "128",
                    "--chunk-size", "64", "--page-size", "32", "--steps", "1", "--no-progress"]) == 0
    capsys.readouterr()
    other = tmp_path / "notes.jsonl"
    other.write_text('{"text": "mine"}\n')
    _check_refused(run_cli(["data", "--make", "needle", "--make-output", other]), capsys, "is not an earlier 'oomb data --make' file")
    _check_refused(run_cli(["data", "--examples", "5"]), capsys, "--examples sets up synthetic rows but --make is not given")
    _check_refused(run_cli(["data", "--make", "passkey", "--output", tmp_path / "h.png", "--make-output", tmp_path / "y.jsonl"]),
                   capsys, "--output names the length histogram of 'oomb data' without --make")
    assert not (tmp_path / "y.jsonl").exists()
    _check_refused(run_cli(["data", "--make", "passkey", "--make-lengths", "30", "--make-output", tmp_path / "x.jsonl"]),
                   capsys, "pass --make-lengths of")


@pytest.mark.parametrize("kind, flags, named", [
    ("passkey", ["--lora-rank", "8", "--lr", "1e-3"], "--lora-rank and --lr are not read by --make passkey"),
    ("keyvalue", ["--model", "tiny"], "--model is not read by --make keyvalue"),
    ("needle", ["--no-progress"], "--no-progress is not read by --make needle"),
    ("passkey", ["--text-field", "body"], "--text-field is not read by --make passkey"),
])
def test_oomb_data_make_refuses_the_flags_it_does_not_read(tmp_path, capsys, kind, flags, named):
    rows_file = tmp_path / "rows.jsonl"
    status = run_cli(["data", "--make", kind, "--examples", "2", "--make-lengths", "120", *flags,
                      "--make-output", rows_file])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("oomb: error: ") and named in lines[0], err
    assert f"--make {kind} reads only --make, " in lines[0] and not rows_file.exists()


def test_oomb_data_make_keyvalue_writes_segments_rows_oomb_train_trains(tmp_path, capsys):
    rows_file = tmp_path / "kv.jsonl"
    assert run_cli(["data", "--make", "keyvalue", "--needles", "3", "--examples", "4", "--make-lengths", "200",
                    "--make-output", rows_file]) == 0
    assert "wrote 4 keyvalue rows" in capsys.readouterr().out
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert len(rows) == 4 and all(len(r["segments"]) == 8 and len(r["answers"]) == 4 for r in rows)
    assert run_cli(["data", "--data", rows_file, "--seq-len", "256", "--document-mask",
                    "--output", tmp_path / "lengths.png"]) == 0
    assert "4 examples (segments)" in capsys.readouterr().out
    assert run_cli(["train", "--data", rows_file, "--output-dir", tmp_path / "run", "--seq-len", "256",
                    "--chunk-size", "64", "--page-size", "32", "--steps", "1", "--no-progress", "--document-mask"]) == 0
    capsys.readouterr()
    _check_refused(run_cli(["data", "--make", "keyvalue", "--data", rows_file, "--make-output", tmp_path / "y.jsonl"]),
                   capsys, "--data is not read by --make keyvalue")
    _check_refused(run_cli(["data", "--make", "keyvalue", "--needles", "31", "--make-output", tmp_path / "y.jsonl"]),
                   capsys, "pass 0 to 30 needles per row")
    _check_refused(run_cli(["data", "--make", "needle", "--needles", "0", "--make-output", tmp_path / "y.jsonl"]),
                   capsys, "pass 1 to 30 needles per row")
    _check_refused(run_cli(["data", "--make", "keyvalue", "--needles", "30", "--make-lengths", "300",
                            "--make-output", tmp_path / "y.jsonl"]), capsys, "pass --make-lengths of")
    # a file that begins with made rows but also holds the user's own is not replaced
    mine = tmp_path / "combined.jsonl"
    mine.write_text(rows_file.read_text() + json.dumps({"text": "my own row"}) + "\n")
    before = mine.read_text()
    _check_refused(run_cli(["data", "--make", "keyvalue", "--make-output", mine]), capsys,
                   "is not an earlier 'oomb data --make' file")
    assert mine.read_text() == before


def test_a_lora_output_folder_is_merged_in_memory_and_scored(tmp_path, capsys):
    """A LoRA `oomb train` output: eval merges it into its base as `oomb merge` does; the scores equal those of
    the merged folder."""
    out = tmp_path / "lora"
    assert run_cli(["train", "--output-dir", out, "--lora-rank", "4", "--seq-len", "128", "--chunk-size", "64",
                    "--page-size", "32", "--steps", "2", "--lr", "0.05", "--no-progress"]) == 0
    assert run_cli(["merge", out, "--output-dir", tmp_path / "merged"]) == 0
    capsys.readouterr()
    grid = ["--task", "passkey", "--lengths", "100", "--depths", "0", "100", *SMALL]
    assert run_cli(["eval", "--model", out, *grid, "--json", tmp_path / "a.json"]) == 0
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # as in a fresh process (an earlier command of this one may have turned it off)
    assert run_cli(["eval", "--model", tmp_path / "merged", *grid, "--json", tmp_path / "b.json"]) == 0
    assert "Loading weights" not in capsys.readouterr().err  # the bar is for a terminal; stderr is captured here
    a, b = (json.loads((tmp_path / n).read_text())["rows"][0]["results"] for n in ("a.json", "b.json"))
    assert [t["logprob"] for t in a] == pytest.approx([t["logprob"] for t in b], abs=1e-5)
    # and the base preset alone scores differently: the adapter is applied
    assert run_cli(["eval", *grid, "--json", tmp_path / "c.json"]) == 0
    c = json.loads((tmp_path / "c.json").read_text())["rows"][0]["results"]
    assert any(abs(x["logprob"] - y["logprob"]) > 1e-4 for x, y in zip(a, c))


def test_grad_error_of_a_lora_output_folder_is_that_of_its_merged_model(tmp_path, capsys):
    """grad-error merges a LoRA `oomb train` output in memory as eval does, and compares every weight's gradient:
    the merged model came back frozen and was refused as having nothing to compute gradients for."""
    out = tmp_path / "lora"
    assert run_cli(["train", "--output-dir", out, "--lora-rank", "4", "--seq-len", "128", "--chunk-size", "64",
                    "--page-size", "32", "--steps", "1", "--lr", "0.05", "--no-progress"]) == 0
    assert run_cli(["merge", out, "--output-dir", tmp_path / "merged"]) == 0
    capsys.readouterr()
    grid = ["--seq-len", "128", "--chunk-size", "32", "--page-size", "16", "--budgets", "1", "--local-pages", "1"]
    assert run_cli(["grad-error", "--model", out, *grid, "--json", tmp_path / "a.json"]) == 0
    assert run_cli(["grad-error", "--model", tmp_path / "merged", *grid, "--json", tmp_path / "b.json"]) == 0
    a, b = (json.loads((tmp_path / n).read_text())["rel_error_all"]["1"] for n in ("a.json", "b.json"))
    assert a > 0 and a == pytest.approx(b, rel=1e-6)


def test_eval_help_names_every_file_eval_writes(capsys):
    """`oomb eval --help` said 'nothing is trained or written, except --json', and --heatmap writes a PNG too."""
    assert run_cli(["eval", "--help"]) == 0
    description = " ".join(capsys.readouterr().out.split("\n\n")[1].split())
    written = next(s for s in description.split(". ") if "written" in s)
    assert "--json" in written and "--heatmap" in written, description


def test_a_full_disk_under_oomb_data_make_is_one_line_and_keeps_the_earlier_rows(tmp_path, capsys, monkeypatch):
    """A --make-output the disk has no room for: one line naming the full disk and the fix, exit 2 (it was a
    traceback, exit 1), and the earlier rows at that path are left as they were."""
    import errno
    import pathlib

    rows_file = tmp_path / "passkey.jsonl"
    argv = ["data", "--make", "passkey", "--examples", "2", "--make-lengths", "120", "--make-output", rows_file]
    assert run_cli(argv) == 0
    before = rows_file.read_bytes()
    real = pathlib.Path.write_text

    def write_text(self, *a, **k):
        if ".tmp-" in self.name:
            real(self, "{", encoding="utf-8")  # a part written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    capsys.readouterr()
    _check_refused(run_cli([*argv[:4], "3", *argv[5:]]), capsys,
                   "a file cannot be written: the disk is full (No space left on device); free space on that disk")
    assert rows_file.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["passkey.jsonl"]


def test_a_full_disk_is_named_in_the_words_of_each_writer():
    from safetensors import SafetensorError

    from oomb.cli.errors import _out_of_space

    said = "a file cannot be written: the disk is full (No space left on device)"
    assert _out_of_space(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")) == said
    assert _out_of_space(OSError(28, "No space left on device", "/x/m.png")) == said.replace("written:", "written (/x/m.png):")
    assert _out_of_space(ValueError("other")) is None
