"""``oomb merge``: the merged model computes what the adapter on its base computes (fp32, 1e-5), loads as-is with
its tokenizer, and bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oomb.data import load_tokenizer
from oomb.models.presets import build_model

from cli_helpers import run_cli
from tests.cli.test_cli import FAST, TEXT, snapshot


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _adapter_logits(base, adapter, ids):
    from peft import PeftModel

    return _logits(PeftModel.from_pretrained(base, adapter), ids)


IDS = torch.tensor([load_tokenizer(None)(TEXT[:400], add_special_tokens=False)["input_ids"][:64]])


@pytest.mark.parametrize("extra", [[], ["--lora-targets", "all-linear", "--train-embeddings-norms", "--seed", "3"]])
def test_merged_preset_adapter_equals_the_adapter_model(tmp_path, capsys, extra):
    adapter, merged = tmp_path / "lora", tmp_path / "merged"
    assert run_cli(["train", "--output-dir", adapter, *FAST, "--lora-rank", "4", *extra]) == 0
    assert run_cli(["merge", adapter, "--output-dir", merged]) == 0
    assert "wrote" in capsys.readouterr().err
    torch.manual_seed(3 if extra else 0)  # the run's --seed draws the preset's weights
    want = _adapter_logits(build_model("tiny"), adapter, IDS)
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in k for k in model.state_dict())
    torch.testing.assert_close(_logits(model, IDS), want, rtol=1e-5, atol=1e-5)
    text = TEXT[:300]
    assert AutoTokenizer.from_pretrained(merged)(text)["input_ids"] == load_tokenizer(None)(text)["input_ids"]


def test_merge_rebuilds_a_folder_base_from_anywhere(tmp_path, monkeypatch):
    """A --model folder given as a relative path: adapter_config.json records it absolute, so merge works from
    another working directory."""
    torch.manual_seed(1)
    (tmp_path / "work").mkdir()
    build_model("tiny-llama").save_pretrained(tmp_path / "work" / "base")
    monkeypatch.chdir(tmp_path / "work")
    assert run_cli(["train", "--model", "./base", "--output-dir", "lora", *FAST, "--lora-rank", "2"]) == 0
    monkeypatch.chdir(tmp_path)
    assert run_cli(["merge", "work/lora", "--output-dir", "merged"]) == 0
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "work" / "base")
    want = _adapter_logits(base, tmp_path / "work" / "lora", IDS)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), IDS), want,
                               rtol=1e-5, atol=1e-5)


def test_a_moved_folder_base_is_refused_not_taken_from_the_current_folder(tmp_path, monkeypatch, capsys):
    """The run's --model ./base, read from another folder that holds another ./base, is not that other model: the
    base is the absolute folder adapter_config.json records, and where it has gone merge and eval refuse."""
    torch.manual_seed(1)
    for folder in ("work", "elsewhere"):
        (tmp_path / folder).mkdir()
        build_model("tiny-llama").save_pretrained(tmp_path / folder / "base")  # two different random models
    monkeypatch.chdir(tmp_path / "work")
    assert run_cli(["train", "--model", "./base", "--output-dir", "lora", *FAST, "--lora-rank", "2"]) == 0
    (tmp_path / "work" / "base").rename(tmp_path / "work" / "base.moved")
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    said = f"the adapter's base model folder {str(tmp_path / 'work' / 'base')!r} does not exist"
    _refused(["merge", tmp_path / "work" / "lora", "--output-dir", "merged"], capsys, tmp_path, said)
    _refused(["eval", "--model", tmp_path / "work" / "lora", "--seq-len", "64", "--chunk-size", "32",
              "--page-size", "16", "--num-windows", "1"], capsys, tmp_path, said)


def test_a_damaged_or_missing_adapter_file_is_one_line(tmp_path, capsys):
    adapter = tmp_path / "lora"
    assert run_cli(["train", "--output-dir", adapter, *FAST, "--steps", "1", "--lora-rank", "2"]) == 0
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    capsys.readouterr()
    eval_argv = ["eval", "--model", adapter, "--seq-len", "64", "--chunk-size", "32", "--page-size", "16",
                 "--num-windows", "1"]
    for argv in (["merge", adapter, "--output-dir", tmp_path / "m"], eval_argv):
        _refused(argv, capsys, tmp_path, f"{weights} cannot be read (")
    weights.unlink()
    for argv in (["merge", adapter, "--output-dir", tmp_path / "m"], eval_argv):
        _refused(argv, capsys, tmp_path, "has no adapter_model.safetensors (the adapter's trained weights)")


def _refused(argv, capsys, root, fragment):
    before = snapshot(root)
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err
    assert snapshot(root) == before


def test_bad_merge_input_is_one_line_exit_2_nothing_written(tmp_path, capsys):
    full = tmp_path / "full"
    assert run_cli(["train", "--output-dir", full, *FAST, "--steps", "1"]) == 0
    (tmp_path / "empty").mkdir()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "adapter_config.json").write_text('{"base_model_name_or_path": "someone/model"}')
    capsys.readouterr()
    out = ["--output-dir", tmp_path / "merged"]
    _refused(["merge", tmp_path / "empty", *out], capsys, tmp_path, "is not a LoRA adapter folder: no adapter_config.json")
    _refused(["merge", full, *out], capsys, tmp_path, "it holds a full model")
    _refused(["merge", tmp_path / "nope", *out], capsys, tmp_path, "does not exist")
    _refused(["merge", *out], capsys, tmp_path, "oomb merge needs ADAPTER_DIR")
    _refused(["merge", tmp_path / "foreign", *out], capsys, tmp_path,
             "does not say where its base model is: no train_args.json of an oomb run and adapter_config.json's "
             "base_model_name_or_path ('someone/model') is not a local folder")
    adapter = tmp_path / "lora"
    assert run_cli(["train", "--output-dir", adapter, *FAST, "--steps", "1", "--lora-rank", "2"]) == 0
    capsys.readouterr()
    _refused(["merge", adapter, "--output-dir", tmp_path / "busy"], capsys, tmp_path, "exists and is not empty")
    _refused(["merge", adapter, "--output-dir", adapter], capsys, tmp_path, "exists and is not empty")
    _refused(["merge", adapter], capsys, tmp_path, "oomb merge needs --output-dir")
    (tmp_path / "file").write_text("mine")
    (tmp_path / "out.yaml").write_text(f"output:\n  dir: {tmp_path / 'file'}\n")
    _refused(["merge", adapter, "--config", tmp_path / "out.yaml"], capsys, tmp_path, "output.dir (in ")
    # A hand-edited or corrupt train_args.json or adapter_config.json is named as such (a ValueError traceback,
    # 'no train_args.json of an oomb run' or 'pass an adapter trained on that base model' before).
    args_file, config_file = adapter / "train_args.json", adapter / "adapter_config.json"
    args_text, config_text = args_file.read_text(), config_file.read_text()
    for key, value, said in (("seed", "abc", 'has seed "abc", not an integer'), ("device", "gpu", 'has device "gpu"'),
                             ("rope_scaling_dict", [1], "has rope_scaling_dict [1]"), ("model", 7, "has model 7")):
        args_file.write_text(args_text.replace('"oomb_version"', f'"{key}": {json.dumps(value)}, "oomb_version"', 1))
        assert json.loads(args_file.read_text())[key] == value
        _refused(["merge", adapter, *out], capsys, tmp_path, f"train_args.json {said}")
    for text in ('{"seed": 0,', "[1, 2]"):
        args_file.write_text(text)
        _refused(["merge", adapter, *out], capsys, tmp_path, "train_args.json is corrupt")
    args_file.write_text(args_text)
    config_file.write_text('{"peft_type": "LORA",')
    _refused(["merge", adapter, *out], capsys, tmp_path, "adapter_config.json is corrupt (not valid JSON")
    config_file.write_text(config_text)
    assert not (tmp_path / "merged").exists()
    # An empty --output-dir is used.
    assert run_cli(["merge", adapter, "--output-dir", tmp_path / "empty"]) == 0
    assert (tmp_path / "empty" / "model.safetensors").is_file()


def test_a_lock_file_no_run_holds_is_no_content_of_the_output_dir_but_a_live_run_is_refused(tmp_path, capsys):
    """An --output-dir holding only the lock file of an oomb train that was killed is empty: the model is written
    there and the file removed; while a live oomb train holds that lock, merge is refused naming it."""
    from tests.cli.test_cli_resume import _hold_lock

    adapter = tmp_path / "lora"
    assert run_cli(["train", "--output-dir", adapter, *FAST, "--steps", "1", "--lora-rank", "2"]) == 0
    out = tmp_path / "merged"
    out.mkdir()
    holder = _hold_lock(out)
    try:
        capsys.readouterr()
        _refused(["merge", adapter, "--output-dir", out], capsys, tmp_path,
                 f"--output-dir {str(out)!r} is being written by another oomb train (pid {holder.pid}: ")
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    _hold_lock(out, "die")
    assert [p.name for p in out.iterdir()] == [".oomb-lock"]
    capsys.readouterr()
    assert run_cli(["merge", adapter, "--output-dir", out]) == 0
    assert (out / "model.safetensors").is_file() and not (out / ".oomb-lock").exists()


@pytest.mark.parametrize("lora", [True, False])
def test_a_checkpoint_is_written_as_the_model_its_run_saved(tmp_path, capsys, lora):
    """ADAPTER_DIR may be a checkpoint folder, or a run folder that stopped before saving its model: the
    checkpoint's model (a LoRA adapter merged into its base, or a full fine-tune's weights) is written with the
    run's tokenizer; at the final step it computes what the run's saved model computes."""
    run = tmp_path / "run"
    argv = ["train", "--output-dir", run, *FAST, "--steps", "3", "--save-every", "1"]
    assert run_cli([*argv, *(["--lora-rank", "2", "--seed", "2"] if lora else [])]) == 0
    if lora:
        torch.manual_seed(2)
        want = _adapter_logits(build_model("tiny"), run, IDS)
    else:
        want = _logits(AutoModelForCausalLM.from_pretrained(run), IDS)
    capsys.readouterr()
    final = run / "checkpoints" / "step-00000003"
    assert run_cli(["merge", final, "--output-dir", tmp_path / "m3"]) == 0
    err = capsys.readouterr().err
    assert f"wrote the model of checkpoint {final} ({'its LoRA adapter merged into tiny' if lora else 'a full fine-tune'})" in err
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m3")
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(_logits(merged, IDS), want, rtol=1e-5, atol=1e-5)
    text = TEXT[:300]
    assert AutoTokenizer.from_pretrained(tmp_path / "m3")(text)["input_ids"] == load_tokenizer(None)(text)["input_ids"]
    # a run stopped before saving its model: its latest checkpoint, with a note; an earlier step differs
    for name in ("adapter_config.json", "adapter_model.safetensors", "config.json", "model.safetensors"):
        (run / name).unlink(missing_ok=True)
    shutil.rmtree(final)
    assert run_cli(["merge", run, "--output-dir", tmp_path / "m2"]) == 0
    assert "holds no saved model: reading its latest checkpoint, step-00000002" in capsys.readouterr().err
    assert not torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "m2"), IDS), want)
    # the output folder is checked first: a non-empty one is refused, nothing written
    _refused(["merge", run, "--output-dir", tmp_path / "m2"], capsys, tmp_path, "exists and is not empty")
