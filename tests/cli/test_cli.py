"""`oomb train` end to end on tiny presets, and every bad-input rule: exit 2, one line, nothing touched."""

from __future__ import annotations

import json
import shutil
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from oomb.cli import main
from cli_helpers import run_cli

# Small and fast: 2 chunks of 64 tokens per sequence, pages of 32.
FAST = ["--seq-len", "128", "--chunk-size", "64", "--page-size", "32", "--steps", "2", "--no-progress"]

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered as the rightful property of some one or other "
    "of their daughters.\n"
) * 4


# One log.jsonl line as `oomb train` writes it (an earlier run's output, which --overwrite may replace).
OOMB_LOG_LINE = json.dumps({
    "step": 1, "loss": 10.4, "tokens_per_s": 812.5, "peak_memory_bytes": None, "seconds": 0.1575, "lr": 0.0015,
    "grad_norm": 2.71, "num_tokens": 128, "stage1_seconds": 0.0412, "stage2_seconds": 0.1021, "kept_graphs": 0,
}) + "\n"

# A checkpoint's meta.json as oomb's checkpoint code writes it (the keys are what --overwrite recognises).
OOMB_META_JSON = json.dumps({
    "files": {"trainable.safetensors": {"bytes": 8, "sha256": "0" * 64}, "trainer_state.pt": {"bytes": 8, "sha256": "0" * 64}},
    "fingerprint": {"model": "tiny", "seq_len": 128}, "format": 1, "step": 1,
    "settings": {"sparse": False, "page_budget": 64, "sink_pages": 1, "local_pages": 8, "sparse_score": "mean",
                 "chunk_size": 64, "page_size": 32},
})


@pytest.fixture
def text_file(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(TEXT)
    return f


def snapshot(path):
    """Every file under ``path`` with its bytes, to prove a directory was left as it was."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_train_end_to_end_writes_log_and_safetensors(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, *FAST]) == 0
    lines = (out / "log.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {"step", "loss", "tokens_per_s", "peak_memory_bytes", "seconds", "lr"} <= set(r)
        assert r["num_tokens"] == 128 and r["peak_memory_bytes"] is None and r["tokens_per_s"] > 0
        assert 5 < r["loss"] < 12
        assert set(r) == set(json.loads(OOMB_LOG_LINE))  # the tests' stand-in for an earlier run is realistic
    meta = json.loads((out / "checkpoints" / "step-00000002" / "meta.json").read_text())
    assert set(meta) == set(json.loads(OOMB_META_JSON))  # so is the stand-in for an earlier run's checkpoint
    names = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "train_args.json", "log.jsonl"} <= names
    assert not [n for n in names if n.startswith(".oomb-save")]
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 4
    assert json.loads((out / "train_args.json").read_text())["seq_len"] == 128
    printed = capsys.readouterr().out
    assert "step     2/2" in printed


def test_training_changes_the_weights_and_is_seeded(tmp_path, text_file):
    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, "--model", "tiny-llama", *FAST]) == 0
    trained = load_file(out / "model.safetensors")
    torch.manual_seed(0)
    from oomb.models.presets import build_model

    init = build_model("tiny-llama").state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(trained[key], init[key])
    assert trained[key].shape == init[key].shape


# peft's get_peft_model reads transformers' deprecated is_gradient_checkpointing (a FutureWarning); oomb filters it there.
@pytest.mark.filterwarnings("error:`is_gradient_checkpointing`:FutureWarning")
def test_lora_run_saves_only_an_adapter(tmp_path, text_file):
    out = tmp_path / "lora"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, "--lora-rank", "4", *FAST]) == 0
    names = set(os.listdir(out))
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "log.jsonl"} <= names
    assert "model.safetensors" not in names
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any("q_proj" in k for k in adapter) and any("o_proj" in k for k in adapter)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    # lora_B starts at zero; a trained adapter is not.
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)


def test_offloaded_kv_store_gives_the_same_losses(tmp_path, text_file, capsys):
    losses, said = {}, {}
    for offload in ("off", "on"):
        out = tmp_path / offload
        assert run_cli(["train", "--data", text_file, "--output-dir", out, "--offload", offload, *FAST]) == 0
        losses[offload] = [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]
        said[offload] = capsys.readouterr().err
    assert losses["on"] == losses["off"]
    # The startup lines say where the KV pages live (a 1M-token run pins ~75 GiB of host memory once).
    assert "oomb: KV store: every page on the CPU (" in said["off"]
    assert re.search(r"oomb: KV store: offload, 0 of \d+ pages per layer resident, [\d.]+ MiB CPU pool \+ "
                     r"[\d.]+ MiB host memory \(allocated once, in [\d.]+ s\)", said["on"]), said["on"]


def test_plan_subcommand(capsys):
    status = run_cli(["plan", "--model", "qwen2.5-7b", "--seq-len", "65536", "--gpu-gib", "139", "--host-gib", "120", "--checkpoint-layers"])
    assert status == 0
    assert "predicted peak" in capsys.readouterr().out
    assert run_cli(["plan", "--model", "qwen2.5-7b", "--seq-len", str(1 << 23), "--gpu-gib", "80", "--host-gib", "64"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    _check_refused(run_cli(["plan", "--model", "gpt-17"]), capsys, "unknown model")
    _check_refused(run_cli(["plan", "--seq-len", "0"]), capsys, "--seq-len is 0")


def test_plan_offers_the_dtypes_train_runs(tmp_path, text_file, capsys):
    """`oomb plan --dtype` offered float16, which `oomb train` refuses (it has no loss scaling): a plan for a run
    that cannot be started. Both refuse it with argparse's list of their choices."""
    _check_refused(run_cli(["plan", "--model", "tiny", "--gpu-gib", "8", "--dtype", "float16"]), capsys,
                   "invalid choice: 'float16'")
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", tmp_path / "run", *FAST, "--dtype", "float16"]),
                   capsys, "invalid choice: 'float16'")
    assert run_cli(["plan", "--model", "tiny", "--gpu-gib", "8", "--host-gib", "8", "--dtype", "float32"]) == 0


@pytest.mark.parametrize("sizes", [["--chunk-size", "100", "--page-size", "32"], ["--chunk-size", "0"], ["--page-size", "-32"]])
def test_chunk_and_page_size_errors_read_the_same_in_every_subcommand(tmp_path, text_file, capsys, sizes):
    """`oomb plan` said 'pass a --page-size that divides --chunk-size' where `oomb train` gave a chunk size to pass
    : one check words them for train, plan, eval, grad-error and bench, naming the fix."""
    seq = ["--seq-len", "256"]
    argvs = [["train", "--data", text_file, "--output-dir", tmp_path / "run", *seq, *sizes],
             ["plan", "--model", "tiny", "--gpu-gib", "8", *seq, *sizes],
             ["eval", "--data", text_file, *seq, *sizes],
             ["grad-error", "--data", text_file, *seq, *sizes],
             ["bench", "--lengths", "256", *sizes]]
    errors = set()
    for argv in argvs:
        assert run_cli(argv) == 2, argv
        errors.add(capsys.readouterr().err.strip())
    assert len(errors) == 1, errors
    error = errors.pop()
    if sizes[1] == "100":
        assert error.startswith("oomb: error: --chunk-size 100 is not a multiple of --page-size 32")
        assert "pass e.g. --chunk-size 96, or a divisor of 100 as --page-size" in error
    else:
        assert f"{sizes[0]} is {sizes[1]}; pass a positive number of tokens for {sizes[0]}" in error


def test_overwrite_replaces_a_previous_run(tmp_path, text_file, capsys):
    """--overwrite replaces what an earlier oomb run wrote and keeps what it did not (a user lost an
    eval report kept in a run folder); train_args.json lists the run's outputs for that."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "log.jsonl").write_text(OOMB_LOG_LINE)  # an earlier run: --overwrite replaces only oomb outputs
    assert run_cli(["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()
    assert "kept what it did not write: notes.txt" in capsys.readouterr().err
    assert len((out / "log.jsonl").read_text().splitlines()) == 2
    outputs = json.loads((out / "train_args.json").read_text())["outputs"]
    assert {"model.safetensors", "config.json", "train_args.json"} <= set(outputs) and "notes.txt" not in outputs
    # a finished run: its listed outputs are replaced, a report saved next to them stays
    (out / "eval.json").write_text('{"mine": 1}')
    (out / "model.safetensors").write_bytes(b"stale")
    assert run_cli(["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST, "--lora-rank", "4"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"eval.json", "notes.txt", "adapter_model.safetensors"} <= names and "model.safetensors" not in names
    # a run saved before outputs were listed: everything in it is replaced, as documented then
    args = json.loads((out / "train_args.json").read_text())
    del args["outputs"]
    (out / "train_args.json").write_text(json.dumps(args))
    assert run_cli(["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST]) == 0
    assert not (out / "eval.json").exists() and not (out / "adapter_model.safetensors").exists()


@pytest.fixture
def small_vocab_model(tmp_path):
    d = tmp_path / "small-vocab"
    cfg = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture
def sliding_window_model(tmp_path):
    d = tmp_path / "sliding"
    cfg = MistralConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, sliding_window=64)
    MistralForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture
def encoder_model(tmp_path):
    from transformers import BertConfig

    d = tmp_path / "bert"
    BertConfig(vocab_size=32000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(d)
    return d


@pytest.fixture
def gpt2_model(tmp_path):
    from transformers import GPT2Config

    d = tmp_path / "gpt2"
    GPT2Config(n_layer=2, n_embd=64, n_head=2).save_pretrained(d)
    return d


def test_a_model_folder_whose_weights_lack_tensors_is_refused_by_train_and_eval(tmp_path, text_file, capsys):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path / "two-layers"
    cfg = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(d)
    weights = d / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if not k.startswith("model.layers.1.")}, weights, metadata={"format": "pt"})
    capsys.readouterr()
    out = tmp_path / "out"
    line = _check_refused(run_cli(["train", "--data", text_file, "--model", d, "--output-dir", out, *FAST]), capsys,
                          "lack 9 of the model's tensors (model.layers.1.")
    assert str(d) in line and "re-save the complete model" in line
    assert not out.exists() or not any(out.iterdir())
    _check_refused(run_cli(["eval", "--model", d, "--data", text_file, "--seq-len", "128", "--chunk-size", "64",
                            "--page-size", "32"]), capsys, "lack 9 of the model's tensors")


@pytest.mark.parametrize("targets, said", [("q_proj,,k_proj", "'q_proj,,k_proj', which has an empty name"),
                                           ("q_proj,", "'q_proj,', which has an empty name"), ("", "is ''")])
def test_lora_targets_with_an_empty_name_are_refused(tmp_path, text_file, capsys, targets, said):
    out = tmp_path / "out"
    line = _check_refused(run_cli(["train", "--data", text_file, "--lora-rank", "2", "--lora-targets", targets,
                                   "--output-dir", out, *FAST]), capsys, said)
    assert "--lora-targets" in line and "pass module names separated by commas" in line
    assert not out.exists()


def _bad_inputs(tmp_path, text_file):
    """(name, extra argv, fragment the message must contain). Each run also gets --overwrite."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    empty_dir = tmp_path / "no-text"
    empty_dir.mkdir()
    one_token = tmp_path / "one.txt"
    one_token.write_text("a")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text("not json\n")
    return [
        ("missing data", ["--data", tmp_path / "nope.txt"], "does not exist"),
        ("empty file", ["--data", empty], "is empty"),
        ("folder without text", ["--data", empty_dir], "holds no data file"),
        ("bad jsonl", ["--data", bad_jsonl], "not valid JSON"),
        ("one token", ["--data", one_token, "--seq-len", "2"], "only 1 token"),
        ("shorter than seq-len", ["--data", text_file, "--seq-len", "100000", "--chunk-size", "64", "--page-size", "32"], "fewer than --seq-len 100,000"),
        ("seq-len 1", ["--data", text_file, "--seq-len", "1"], "at least 2 tokens"),
        ("zero seq-len", ["--data", text_file, "--seq-len", "0"], "--seq-len is 0"),
        ("negative chunk", ["--data", text_file, "--chunk-size", "-64"], "--chunk-size is -64"),
        ("zero page", ["--data", text_file, "--page-size", "0"], "--page-size is 0"),
        ("zero steps", ["--data", text_file, "--steps", "0"], "--steps is 0"),
        ("negative lr", ["--data", text_file, "--lr", "-1"], "--lr is -1"),
        ("negative lora rank", ["--data", text_file, "--lora-rank", "-2"], "--lora-rank is -2"),
        ("chunk not multiple of page", ["--data", text_file, "--chunk-size", "100", "--page-size", "32"], "not a multiple of --page-size"),
        ("not an integer", ["--data", text_file, "--seq-len", "ten"], "invalid int value"),
        ("unknown preset", ["--data", text_file, "--model", "gpt-17"], "unknown model 'gpt-17'"),
        ("missing tokenizer", ["--data", text_file, "--tokenizer", tmp_path / "no-tok"], "tokenizer folder"),
        ("page budget too small", ["--data", text_file, "--offload", "on", "--gpu-page-budget", "3"], "--gpu-page-budget 3 pages is below the 8 pages"),
        ("page budget without offload", ["--data", text_file, "--offload", "off", "--gpu-page-budget", "64"], "--offload is off"),
        ("zero page budget", ["--data", text_file, "--gpu-page-budget", "0"], "--gpu-page-budget is 0"),
        ("page budget on the cpu with auto offload", ["--data", text_file, "--gpu-page-budget", "64"],
         "--offload auto never uses on the CPU"),
        ("segment without offload", ["--data", text_file, "--offload", "off", "--offload-segment-pages", "5"],
         "--offload-segment-pages sizes the staging of offload but --offload is off"),
        ("llama3 rope spec incomplete", ["--data", text_file, "--model", "tiny-llama", "--rope-scaling", "type=llama3,factor=8"],
         "e.g. 'type=llama3,factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192'"),
        ("negative page budget", ["--data", text_file, "--sparse", "--page-budget", "-1"], "--page-budget is -1"),
        ("triton on cpu", ["--data", text_file, "--attention-backend", "triton"], "GPU only"),
        ("graph cap without keep-graphs auto", ["--data", text_file, "--keep-graphs-max", "2"],
         "--keep-graphs-max caps the chunk graphs --keep-graphs auto keeps, and --keep-graphs is 'off', which keeps "
         "none; pass --keep-graphs auto, or leave --keep-graphs-max out"),
        ("no cuda", ["--data", text_file, "--device", "cuda"], "no CUDA GPU"),
    ]


def _check_refused(status, capsys, fragment):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("oomb: error: ") and "; " in lines[0], lines[0]
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err
    return lines[0]


def test_every_bad_input_exits_2_with_one_line_and_touches_nothing(tmp_path, text_file, capsys):
    if torch.cuda.is_available():
        pytest.skip("the no-CUDA rule needs a machine without a GPU")
    out = tmp_path / "previous-run"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    (out / "log.jsonl").write_text(OOMB_LOG_LINE)
    before = snapshot(out)
    for name, extra, fragment in _bad_inputs(tmp_path, text_file):
        status = run_cli(["train", "--output-dir", out, "--overwrite", *FAST, *extra])
        _check_refused(status, capsys, fragment)
        assert snapshot(out) == before, name


def test_cuda_run_that_does_not_fit_is_refused_before_the_model_is_built(tmp_path, text_file, capsys, monkeypatch):
    """On CUDA the memory plan is checked first: a 7B full fine-tune on a (faked) GPU with 8 GiB free is refused."""
    import oomb.models.presets as presets
    from oomb.planner import Machine

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the plan check")

    small_gpu = Machine(8 << 30, 8 << 30, 64 << 30, 64 << 30, "fake 8 GiB GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls, device=None: small_gpu))
    monkeypatch.setattr(presets, "build_model", no_build)
    out = tmp_path / "previous-run"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    (out / "log.jsonl").write_text(OOMB_LOG_LINE)  # an earlier run's output, so --overwrite may replace it
    status = run_cli(["train", "--data", text_file, "--model", "qwen2.5-7b", "--device", "cuda", "--output-dir", out, "--overwrite", *FAST])
    _check_refused(status, capsys, "GiB")
    assert snapshot(out) == {"keep.txt": b"keep", "log.jsonl": OOMB_LOG_LINE.encode()}


@pytest.mark.parametrize(
    "model_fixture, fragment",
    [("small_vocab_model", "vocabulary of 300"), ("sliding_window_model", "sliding"), ("encoder_model", "bert")],
)
def test_bad_models_exit_2_and_touch_nothing(request, tmp_path, text_file, capsys, model_fixture, fragment):
    model_dir = request.getfixturevalue(model_fixture)
    capsys.readouterr()  # drop what saving the fixture printed
    out = tmp_path / "previous-run"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    (out / "log.jsonl").write_text(OOMB_LOG_LINE)  # an earlier run's output, so --overwrite may replace it
    status = run_cli(["train", "--data", text_file, "--model", model_dir, "--output-dir", out, "--overwrite", *FAST])
    _check_refused(status, capsys, fragment)
    assert snapshot(out) == {"keep.txt": b"keep", "log.jsonl": OOMB_LOG_LINE.encode()}


@pytest.mark.parametrize(
    "model_fixture, fragment",
    [("gpt2_model", "model type 'gpt2'"), ("encoder_model", "model type 'bert'"), ("sliding_window_model", "sliding")],
)
def test_plan_refuses_the_models_train_refuses_in_its_words(request, tmp_path, text_file, capsys, model_fixture,
                                                            fragment):
    """A plan and a training run given the same flags describe the same run: a model ``oomb train`` refuses (a
    decoder of another family, an encoder, sliding-window attention) gets no memory plan (GPT-2 had a traceback,
    the others 'fits'), but train's exit-2 line."""
    model_dir = request.getfixturevalue(model_fixture)
    capsys.readouterr()
    planned = _check_refused(run_cli(["plan", "--model", model_dir, "--gpu-gib", "10", "--host-gib", "10"]), capsys,
                             fragment)
    trained = _check_refused(run_cli(["train", "--data", text_file, "--model", model_dir, "--output-dir",
                                      tmp_path / "run", *FAST]), capsys, fragment)
    assert planned == trained.replace("oomb train --help", "oomb plan --help")


def test_non_empty_output_dir_needs_overwrite(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    # not an oomb run: --overwrite would refuse it too, so it is not offered
    line = _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, *FAST]), capsys,
                          "exists, is not empty and holds no oomb run; pass a new or empty --output-dir")
    assert "--overwrite" not in line
    assert snapshot(out) == {"keep.txt": b"keep"}
    # an earlier oomb run: --overwrite is offered
    (out / "log.jsonl").write_text(OOMB_LOG_LINE)
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, *FAST]), capsys,
                   "pass a new directory, or --overwrite to replace the oomb run in it")
    assert snapshot(out) == {"keep.txt": b"keep", "log.jsonl": OOMB_LOG_LINE.encode()}
    f = tmp_path / "a-file"
    f.write_text("x")
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", f, *FAST]), capsys, "is a file")
    assert f.read_text() == "x"


def test_overwrite_refuses_to_delete_its_own_inputs(tmp_path, capsys):
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "a.txt").write_text(TEXT)
    # a folder of inputs is no oomb output: refused before anything else
    _check_refused(run_cli(["train", "--data", data / "a.txt", "--output-dir", data, "--overwrite", *FAST]), capsys,
                   "does not look like an oomb output")
    assert (data / "a.txt").read_text() == TEXT


def test_version(capsys):
    from oomb import __version__

    assert run_cli(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"oomb {__version__}"


def test_missing_output_dir_and_unknown_command(capsys):
    _check_refused(run_cli(["train"]), capsys, "--output-dir")
    _check_refused(run_cli(["fly"]), capsys, "invalid choice")


def test_command_line_entry_point(tmp_path, text_file):
    """The real process: a bad input gives status 2, exactly one stderr line and no traceback."""
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    (out / "train_args.json").write_text('{"oomb_version": "0.1.0"}')  # an earlier run, so --overwrite is allowed to get that far
    bad = subprocess.run(
        [sys.executable, "-m", "oomb", "train", "--data", text_file, "--output-dir", out, "--overwrite", "--seq-len", "100000"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("oomb: error: the data has "), bad.stderr
    assert "pass --seq-len" in bad.stderr
    assert snapshot(out) == {"keep.txt": b"keep", "train_args.json": b'{"oomb_version": "0.1.0"}'}


README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def _readme_blocks(lang):
    text = open(README, encoding="utf-8").read()
    return [block.split("```", 1)[0] for block in text.split(f"```{lang}\n")[1:]]


def test_readme_python_example_runs():
    (example,) = _readme_blocks("python")
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert 10.0 < out.loss < 10.8 and out.num_tokens == 2048


CLI_DOC = os.path.join(os.path.dirname(README), "docs", "cli.md")
_FLAG = r"--[a-z][a-z0-9-]*[a-z0-9]"


def _help_flags(capsys, command):
    import re

    assert run_cli([command, "--help"]) == 0
    return set(re.findall(rf"({_FLAG})", capsys.readouterr().out)) - {"--help"}


def test_cli_doc_lists_every_train_option_and_help_lists_them_too(capsys):
    """docs/cli.md's `oomb train` table names exactly the flags of `oomb train --help`, no more, no fewer."""
    import re

    text = open(CLI_DOC, encoding="utf-8").read()
    text = text.split("## `oomb train`", 1)[1].split("\n## ", 1)[0]  # the train section only
    options = _help_flags(capsys, "train")
    documented = set(re.findall(rf"`({_FLAG})[` ]", text))
    assert "--offload-stage1-shadow" in options and "--no-fwd-tma" in options  # digits and --no- forms count
    assert options == documented, (options - documented, documented - options)


def test_streaming_help_says_its_cache_knows_a_file_by_its_modification_time_and_how_to_refresh_it():
    """The packed cache is keyed by each file's path, size and modification time, not its contents (as datasets
    keys its own): --help and docs/cli.md say so, name what keeps a modification time, and the fix."""
    from oomb.config import DataConfig
    from oomb.config.flags import plain_help
    from oomb.config.meta import field_docs

    help_text = plain_help(field_docs(DataConfig)["streaming"])
    for said in ("paths, sizes and modification times (not their contents", "cp -p, rsync -a, touch -r",
                 "touch the file, or delete the cache's packed folder", "$OOMB_CACHE_DIR", "~/.cache/oomb"):
        assert said in help_text, said
    row = next(line for line in open(CLI_DOC, encoding="utf-8") if line.startswith("| `--streaming` |"))
    assert row.rstrip().split(" | ")[-1].rstrip(" |") == help_text


def test_plan_help_and_doc_say_which_train_flags_plan_takes(capsys):
    """`oomb plan` takes the flags of `oomb train` that change memory, not all of them: its help says so and names
    the refused ones, which are refused; docs/cli.md names every train flag plan takes (the --offload-* family as
    one) and none that it refuses."""
    import re

    from oomb.config.flags import command_fields

    plan, train = ({ff.flag for ff in command_fields(c)} for c in ("plan", "train"))
    assert run_cli(["plan", "--help"]) == 0
    description = " ".join(capsys.readouterr().out.split("\n\n")[1].split())
    assert "takes the flags of 'oomb train' that change memory" in description, description
    refused = set(re.findall(rf"({_FLAG})", description.split("are refused")[0].rsplit("other flags", 1)[1]))
    assert refused and refused <= train - plan, refused
    for flag in refused:
        assert run_cli(["plan", flag, "1"]) == 2 and f"{flag} is a flag of 'oomb train'" in capsys.readouterr().err
    from pathlib import Path

    text = Path(CLI_DOC).read_text(encoding="utf-8").split("## `oomb plan`", 1)[1].split("\n## ", 1)[0]
    paragraph = text.split("\n\n", 2)[1]
    named = set(re.findall(rf"`({_FLAG})[`* ]", paragraph))
    shared = {f for f in plan & train if not f.startswith("--offload-")}
    assert shared <= named, shared - named
    said_refused = set(re.findall(rf"`({_FLAG})`", paragraph.split("The others", 1)[1].split(")")[0]))
    assert said_refused and said_refused <= train - plan and named - said_refused <= plan | {"--config"}, named - plan


def test_readme_names_only_flags_that_exist(capsys):
    """Every flag the README shows in backticks is a flag of some `oomb` command."""
    import re

    text = open(README, encoding="utf-8").read()
    known = set()
    for command in ("train", "data", "plan", "eval", "grad-error", "bench"):
        known |= _help_flags(capsys, command)
    shown = set(re.findall(rf"(?<![a-z0-9-])({_FLAG})(?![a-z0-9_-])", text))  # not torchrun's --nproc_per_node
    assert shown and shown <= known, shown - known


def test_readme_commands_are_the_ones_ci_runs():
    first, second = _readme_blocks("bash")[:2]
    assert "oomb train" in first and "pip install torch==2.13.0" in first
    ci = open(os.path.join(os.path.dirname(README), ".ci", "run"), encoding="utf-8").read()
    assert second.strip() in ci


@pytest.mark.parametrize("steps, warmup", [(30, 3), (3, 0), (1, 0), (5, 5)])
def test_learning_rate_schedule(steps, warmup):

    from oomb.train import lr_at

    lrs = [lr_at(s, lr=1.0, steps=steps, warmup=warmup) for s in range(1, steps + 1)]
    assert max(lrs) == pytest.approx(1.0)
    assert all(0.1 - 1e-12 <= lr <= 1.0 for lr in lrs)
    if warmup == 0:
        assert lrs[0] == pytest.approx(1.0)
    if steps - warmup >= 2:
        assert lrs[-1] == pytest.approx(0.1)
    assert lrs[warmup:] == sorted(lrs[warmup:], reverse=True)


def test_a_users_readme_in_the_output_folder_is_not_replaced_by_the_model_card(tmp_path, text_file, capsys):
    """peft writes a model card (README.md) with a LoRA adapter: over a README.md the user keeps in the output folder
    (kept by --overwrite, as everything oomb did not write) it is not written; where oomb wrote the card, it is."""
    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, *FAST]) == 0  # a full fine-tune: no card
    (out / "README.md").write_text("my notes")
    capsys.readouterr()
    assert run_cli(["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST, "--lora-rank", "4"]) == 0
    assert (out / "README.md").read_text() == "my notes" and (out / "adapter_model.safetensors").is_file()
    assert f"kept README.md in {out}, which oomb did not write: the model card was not saved" in capsys.readouterr().err
    assert "README.md" not in json.loads((out / "train_args.json").read_text())["outputs"]
    card = tmp_path / "card"
    assert run_cli(["train", "--data", text_file, "--output-dir", card, *FAST, "--lora-rank", "4"]) == 0
    assert "README.md" in json.loads((card / "train_args.json").read_text())["outputs"]
    (card / "README.md").write_text("stale card")  # oomb's own card is replaced by the next run's
    assert run_cli(["train", "--data", text_file, "--output-dir", card, "--overwrite", *FAST, "--lora-rank", "4"]) == 0
    assert (card / "README.md").read_text() != "stale card"


@pytest.mark.parametrize("floor", [0.0, 0.05, 1.0])
def test_the_cosine_schedule_ends_at_min_lr_factor(floor):
    from oomb.train import lr_at

    lrs = [lr_at(s, lr=2.0, steps=20, warmup=2, floor=floor) for s in range(1, 21)]
    assert lrs[2] == pytest.approx(2.0) and lrs[-1] == pytest.approx(2.0 * floor)
    assert all(2.0 * floor - 1e-12 <= lr <= 2.0 for lr in lrs[2:]) and lrs[2:] == sorted(lrs[2:], reverse=True)


def test_min_lr_factor_reaches_the_run_and_is_checked(tmp_path, text_file, capsys):
    """--min-lr-factor sets the last step's lr of a cosine run (log.jsonl); a factor outside [0, 1], or one given
    with the constant schedule (which it would not change), is refused in one line."""
    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, *FAST, "--lr", "1e-3", "--warmup-steps", "0",
                    "--min-lr-factor", "0"]) == 0
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(0.0, abs=1e-12), lrs
    for flags, told in ((["--min-lr-factor", "1.5"], "--min-lr-factor is 1.5; pass a fraction of --lr from 0 to 1"),
                        (["--min-lr-factor", "0", "--lr-schedule", "constant"],
                         "--min-lr-factor sets where the cosine schedule ends, but --lr-schedule is constant")):
        capsys.readouterr()
        assert run_cli(["train", "--data", text_file, "--output-dir", tmp_path / "x", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and told in err[0], err


def test_a_diverging_run_stops_with_status_1_and_one_line(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    status = run_cli(["train", "--data", text_file, "--output-dir", out, *FAST, "--lr", "1e30", "--warmup-steps", "0"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("oomb: error")]
    assert status == 1 and len(err) == 1 and "the loss became nan at step 2" in err[0] and "lower --lr" in err[0]
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize("flags, detail", [
    (["--lr", "1e38"], "(value cannot be converted to type float without overflow)"),  # lr / (1 - beta1) > fp32 max
    (["--lr", "1e308", "--lr-schedule", "constant"], ""),  # an update that makes weights infinite, then NaN
])
def test_an_update_that_breaks_the_weights_stops_before_anything_is_saved(tmp_path, text_file, capsys, flags, detail):
    """The loss guard saw a broken update only at the next step's loss: the last step's update was saved as a model
    of NaN weights (exit 0), or torch's overflow error came as a traceback."""
    out = tmp_path / "run"
    status = run_cli(["train", "--data", text_file, "--output-dir", out, *FAST, "--steps", "1", "--save-every", "1",
                      "--warmup-steps", "0", *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("oomb: error")]
    assert status == 1 and len(err) == 1, err
    assert f"the update of step 1 left weights that are not finite numbers{' ' + detail if detail else ''}; the " \
           "model was not saved" in err[0] and "lower --lr" in err[0], err[0]
    assert not (out / "model.safetensors").exists() and not list((out / "checkpoints").glob("step-*"))


def test_weights_finite_sees_one_nan_or_infinity_in_any_tensor():
    from oomb.train.step import _weights_finite

    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.zeros(3, 5, dtype=dtype), torch.ones(0, dtype=dtype), torch.full((7,), 3e38, dtype=dtype)]
        assert _weights_finite(params)
        for bad in (float("nan"), float("inf"), -float("inf")):
            broken = [p.clone() for p in params]
            broken[0][2, 4] = bad
            assert not _weights_finite(broken), (dtype, bad)
    assert _weights_finite([])


def test_document_bounds_split_after_each_eos():
    from oomb.train import document_bounds as _document_bounds

    ids = torch.tensor([[5, 6, 2, 7, 8, 9, 2, 4]])
    assert _document_bounds(ids, 2).tolist() == [0, 3, 7, 8]
    assert _document_bounds(torch.tensor([[5, 6, 7, 2]]), 2).tolist() == [0, 4]  # EOS last: one document
    assert _document_bounds(torch.tensor([[5, 6, 7]]), 2).tolist() == [0, 3]


def test_document_mask_run(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": TEXT[i * 40 : i * 40 + 200]}) + "\n" for i in range(12)))
    losses = {}
    for flag in ([], ["--document-mask"]):
        out = tmp_path / ("masked" if flag else "stream")
        assert run_cli(["train", "--data", data, "--output-dir", out, *FAST, "--steps", "1", *flag]) == 0
        losses[bool(flag)] = json.loads((out / "log.jsonl").read_text())["loss"]
    assert losses[True] != losses[False]  # positions restart and attention stops at each EOS


def test_sparse_run_equals_dense_while_the_past_fits_and_differs_when_it_does_not(tmp_path, text_file):
    def loss(*flags):
        out = tmp_path / "-".join(flags or ("dense",))
        assert run_cli(["train", "--data", text_file, "--output-dir", out, *FAST, "--steps", "1", *flags]) == 0
        return json.loads((out / "log.jsonl").read_text())["loss"]

    dense = loss()
    # 128 tokens = 4 pages of 32: a budget of 64 pages holds every past page.
    assert loss("--sparse") == pytest.approx(dense, rel=1e-6)
    assert loss("--sparse", "--page-budget", "0", "--local-pages", "0", "--sink-pages", "1") != pytest.approx(dense, rel=1e-6)


# ---------------------------------------------------------------- input checks


def _previous_run(tmp_path):
    out = tmp_path / "previous-run"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    (out / "log.jsonl").write_text(OOMB_LOG_LINE)
    return out


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_bad_seed_is_refused_before_the_output_dir_is_touched(tmp_path, text_file, capsys, seed):
    out = _previous_run(tmp_path)
    before = snapshot(out)
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST, "--seed", seed]), capsys, f"--seed is {seed}")
    assert snapshot(out) == before
    new = tmp_path / "new"
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", new, *FAST, "--seed", seed]), capsys, "--seed")
    assert not new.exists()
    _check_refused(run_cli(["grad-error", "--data", text_file, "--seed", seed]), capsys, f"--seed is {seed}")


def test_overwrite_refuses_a_folder_that_is_not_an_oomb_output(tmp_path, text_file, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "main.py").write_text("print('my work')\n")
    (src / "pkg").mkdir()
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    before = snapshot(src)
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", src, "--overwrite", *FAST]), capsys, "does not look like an oomb output")
    assert snapshot(src) == before
    # files that merely carry oomb's names do not make it an oomb output (a user had a
    # thesis deleted next to a log.jsonl of its own)
    (src / "log.jsonl").write_text("{}\n")
    (src / "checkpoints").mkdir()
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", src, "--overwrite", *FAST]), capsys, "does not look like an oomb output")
    assert (src / "main.py").is_file()
    # nor does another tool's checkpoint folder with a meta.json of its own
    (src / "checkpoints" / "step-00000001").mkdir()
    (src / "checkpoints" / "step-00000001" / "meta.json").write_text('{"step": 1}')
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", src, "--overwrite", *FAST]), capsys, "does not look like an oomb output")
    assert (src / "main.py").is_file()
    # an earlier run (only a checkpoint of it left) may still be replaced
    (src / "checkpoints" / "step-00000001" / "meta.json").write_text(OOMB_META_JSON)
    assert run_cli(["train", "--data", text_file, "--output-dir", src, "--overwrite", *FAST, "--steps", "1"]) == 0
    assert (src / "main.py").is_file() and (src / "log.jsonl").is_file()  # what oomb did not write stays


def test_overwrite_keeps_inputs_it_does_not_replace_and_refuses_those_it_would(tmp_path, text_file, capsys,
                                                                               monkeypatch):
    out = _previous_run(tmp_path)
    # A data file beside the earlier run's outputs is not one of them: --overwrite keeps it and trains on it.
    data = out / "mydata.txt"
    shutil.copy(text_file, data)
    assert run_cli(["train", "--data", data, "--output-dir", out, "--overwrite", *FAST, "--steps", "1"]) == 0
    assert data.read_bytes() == text_file.read_bytes()
    capsys.readouterr()
    # Inside an output it replaces (checkpoints/): refused, nothing touched.
    (out / "checkpoints" / "data.txt").write_bytes(text_file.read_bytes())
    before = snapshot(out)
    _check_refused(run_cli(["train", "--data", out / "checkpoints" / "data.txt", "--output-dir", out, "--overwrite",
                            *FAST]), capsys, "(the --data input), which --overwrite would delete")
    # The working directory inside the output dir: refused at any depth.
    monkeypatch.chdir(out)
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST]), capsys,
                   "(the working directory), which --overwrite would delete")
    assert snapshot(out) == before


def test_overwrite_refuses_to_delete_what_oomb_did_not_write_inside_its_folders(tmp_path, text_file, capsys):
    """--overwrite moves checkpoints/ and tensorboard/ aside and deletes them once the new run saves: a user's file
    inside them went with them, unnamed. It is refused, naming the entries, and nothing is moved."""
    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, *FAST]) == 0
    capsys.readouterr()
    (out / "checkpoints" / "NOTES.txt").write_text("my notes")
    before = snapshot(out)
    argv = ["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST]
    line = _check_refused(run_cli(argv), capsys, f"--overwrite: --output-dir {str(out)!r} holds checkpoints/NOTES.txt, "
                                                 "which oomb did not write")
    assert f"move it out of {str(out)!r} and run again, or pass a new --output-dir" in line
    assert snapshot(out) == before and not (out / ".oomb-replaced").exists()
    # without --overwrite, the refusal says they must be moved out before --overwrite
    _check_refused(run_cli(argv[:-len(FAST) - 1] + FAST), capsys,
                   "move checkpoints/NOTES.txt (not written by oomb) out of it and pass --overwrite")
    # a folder of the user's, a file beside a checkpoint's own and in tensorboard/: up to three named, then a count
    (out / "checkpoints" / "my-best").mkdir()
    (out / "checkpoints" / "my-best" / "model.bin").write_bytes(b"best")
    (out / "checkpoints" / "step-00000002" / "eval.json").write_text("{}")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1.host.2.0").write_bytes(b"")
    (out / "tensorboard" / "plot.png").write_bytes(b"png")
    before = snapshot(out)
    _check_refused(run_cli(argv), capsys, "holds checkpoints/NOTES.txt, checkpoints/my-best/, "
                                          "checkpoints/step-00000002/eval.json and 1 more, which oomb did not write")
    assert snapshot(out) == before
    # moved out: the earlier run (its checkpoints, the pointer, its event files) is replaced as before
    for p in ("checkpoints/NOTES.txt", "checkpoints/my-best/model.bin", "checkpoints/step-00000002/eval.json",
              "tensorboard/plot.png"):
        (out / p).unlink()
    (out / "checkpoints" / "my-best").rmdir()
    assert run_cli(argv) == 0
    assert "moved the earlier run's outputs" in capsys.readouterr().err
    assert (out / "model.safetensors").is_file() and not (out / ".oomb-replaced").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-00000002"]
    assert not (out / "tensorboard").exists()


def test_overwrite_refuses_a_folder_whose_log_is_not_oomb_s(tmp_path, text_file, capsys):
    """A log.jsonl with step and loss lines is what many tools write; only oomb's own records (with its stage
    timings) let --overwrite delete the folder."""
    other = tmp_path / "other-tool-run"
    other.mkdir()
    (other / "log.jsonl").write_text('{"step": 1, "loss": 2.31}\n{"step": 2, "loss": 2.28}\n')
    (other / "weights.bin").write_bytes(b"someone else's model")
    before = snapshot(other)
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", other, "--overwrite", *FAST]), capsys,
                   f"--overwrite: --output-dir {str(other.resolve())!r} is not empty and does not look like an oomb output")
    assert snapshot(other) == before
    # the same folder with a log that oomb train wrote is an earlier run: replaced
    (other / "log.jsonl").write_text(OOMB_LOG_LINE)
    assert run_cli(["train", "--data", text_file, "--output-dir", other, "--overwrite", *FAST, "--steps", "1"]) == 0
    assert (other / "weights.bin").read_bytes() == b"someone else's model"  # not oomb's: kept


def test_a_bare_preset_name_means_the_preset_even_with_a_folder_of_that_name(tmp_path, text_file, capsys, monkeypatch):
    work = tmp_path / "work"
    (work / "tiny").mkdir(parents=True)
    (work / "tiny" / "notes.txt").write_text("not a model")
    monkeypatch.chdir(work)
    out = tmp_path / "out"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, *FAST, "--steps", "1"]) == 0
    assert json.loads((out / "train_args.json").read_text())["model"] == "tiny"
    capsys.readouterr()
    # written as a path, the folder is meant (and refused: it holds no model)
    _check_refused(run_cli(["train", "--data", text_file, "--model", "./tiny", "--output-dir", tmp_path / "out2", *FAST]), capsys, "without config.json")


def test_a_training_checkpoint_as_model_points_to_merge(tmp_path, text_file, capsys):
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(OOMB_META_JSON)
    (ckpt / "trainable.safetensors").write_bytes(b"")
    line = _check_refused(run_cli(["train", "--data", text_file, "--model", ckpt, "--output-dir", tmp_path / "out", *FAST]),
                          capsys, "is an oomb training checkpoint")
    assert f"oomb merge {ckpt} --output-dir MODEL" in line and "without config.json" not in line
    assert f"'oomb train --resume {ckpt}'" in line


def test_a_run_or_its_checkpoints_folder_as_model_points_to_merge_and_resume(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(OOMB_META_JSON)
    (ckpt / "trainable.safetensors").write_bytes(b"")
    (run / "checkpoints" / "latest").write_text(ckpt.name)
    folder = run / "checkpoints"
    line = _check_refused(run_cli(["train", "--data", text_file, "--model", folder, "--output-dir", tmp_path / "out",
                                   *FAST]), capsys, f"{str(folder)!r} is the checkpoints folder of an oomb training run")
    assert f"oomb merge {folder} --output-dir MODEL" in line and f"'oomb train --output-dir {run} --resume'" in line
    assert "without config.json" not in line
    line = _check_refused(run_cli(["plan", "--model", run, "--seq-len", "128"]), capsys,
                          f"{str(run)!r} is an oomb training run that stopped before it saved its model")
    assert f"oomb merge {run} --output-dir MODEL" in line and f"'oomb train --output-dir {run} --resume'" in line


def test_model_help_says_a_preset_name_beats_a_folder(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "./tiny" in capsys.readouterr().out


def test_an_output_dir_that_cannot_be_created_is_refused_up_front(tmp_path, text_file, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", afile / "run", *FAST]), capsys, "is a file, not a folder")
    assert afile.read_text() == "x"
    if os.path.isdir("/proc/self"):
        _check_refused(run_cli(["train", "--data", text_file, "--output-dir", "/proc/oomb-x/run", *FAST]), capsys, "cannot create folders")


@pytest.mark.parametrize("spec, fragment", [("factor=4", "has no type"), ("type=linear,factor=0.5", "must be >= 1"),
                                            ("type=yarn,factor=-2", "must be > 0")])
def test_bad_rope_scaling_is_refused(tmp_path, text_file, capsys, spec, fragment):
    out = tmp_path / "run"
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, *FAST, "--rope-scaling", spec]), capsys, fragment)
    assert not out.exists()


def test_grad_error_json_folder_is_refused_before_measuring(tmp_path, text_file, capsys, monkeypatch):
    import oomb.sparse_quality as sq

    def no_run(*a, **k):
        raise AssertionError("measured before checking --json")

    monkeypatch.setattr(sq, "sparse_grad_error", no_run)
    _check_refused(run_cli(["grad-error", "--data", text_file, "--json", tmp_path]), capsys, "is a folder")
    assert os.listdir(tmp_path) == ["text.txt"]
    # an existing file that is not an earlier grad-error report is not overwritten (here: the data itself)
    _check_refused(run_cli(["grad-error", "--data", text_file, "--json", text_file]), capsys,
                   f"--json {str(text_file)!r} exists and is not an earlier 'oomb grad-error' report")
    assert text_file.read_text() == TEXT


def test_grad_error_json_replaces_only_an_earlier_report(tmp_path, text_file, capsys):
    from oomb.cli.measure import _GRAD_ERROR_REPORT_KEYS

    js = tmp_path / "report.json"
    argv = ["grad-error", "--data", text_file, "--seq-len", "128", "--chunk-size", "64", "--page-size", "16",
            "--budgets", "1", "--attention-backend", "torch", "--json", js]
    assert run_cli(argv) == 0
    assert _GRAD_ERROR_REPORT_KEYS <= json.loads(js.read_text()).keys()
    assert run_cli(argv) == 0  # an earlier report: replaced
    eval_report = tmp_path / "eval.json"
    eval_report.write_text('{"seq_len": 128, "num_windows": 1, "rows": []}')  # another command's report: kept
    capsys.readouterr()
    _check_refused(run_cli([*argv[:-1], eval_report]), capsys, "is not an earlier 'oomb grad-error' report")
    assert eval_report.read_text() == '{"seq_len": 128, "num_windows": 1, "rows": []}'


def test_grad_error_notes_budgets_that_hold_the_whole_past(tmp_path, text_file, capsys):
    # 256 tokens, chunks of 64, pages of 16: the last chunk has 12 past pages.
    argv = ["grad-error", "--data", text_file, "--seq-len", "256", "--chunk-size", "64", "--page-size", "16",
            "--sink-pages", "0", "--local-pages", "0", "--budgets", "1", "16"]
    assert run_cli(argv) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert len(err) == 1 and "budget 16 " in err[0] and "12 past pages" in err[0] and "--seq-len" in err[0], err


def test_grad_error_attention_backend(tmp_path, text_file, capsys, monkeypatch):
    """--attention-backend reaches the engine config; triton without a GPU is refused up front."""
    _check_refused(run_cli(["grad-error", "--data", text_file, "--attention-backend", "triton"]), capsys, "--attention-backend triton")
    import oomb.sparse_quality as sq

    seen = []
    orig = sq.sparse_grad_error

    def spy(model, input_ids, cfg, **kw):
        seen.append(cfg.attention_backend)
        return orig(model, input_ids, cfg, **kw)

    monkeypatch.setattr(sq, "sparse_grad_error", spy)
    argv = ["grad-error", "--data", text_file, "--seq-len", "128", "--chunk-size", "64", "--page-size", "16",
            "--budgets", "1", "--attention-backend", "torch"]
    assert run_cli(argv) == 0 and seen == ["torch"]


@pytest.mark.parametrize("extra, fragment", [
    (["--gpu-gib", "-1"], "--gpu-gib is -1"),
    (["--gpu-gib", "nan"], "--gpu-gib is nan"),
    (["--host-gib", "-0.75"], "--host-gib is -0.75"),
    (["--gpu-gib", "80", "--host-gib", "inf"], "--host-gib is inf"),
    (["--offload", "off", "--gpu-page-budget", "5"], "--offload is off"),
    (["--gpu-page-budget", "0"], "--gpu-page-budget is 0"),
    (["--offload-segment-pages", "0"], "--offload-segment-pages is 0"),
    # a plan is of a GPU run: a --device cpu run has no GPU memory or pinned tier to plan
    (["--gpu-gib", "8", "--host-gib", "8", "--device", "cpu"], "oomb plan plans a run on a GPU"),
])
def test_plan_refuses_bad_machines_and_offload_flags(capsys, extra, fragment):
    _check_refused(run_cli(["plan", "--model", "tiny", "--seq-len", "4096", "--chunk-size", "512", *extra]), capsys, fragment)


@pytest.mark.parametrize("extra, fragment", [
    (["--page-budget", "4"], "--page-budget sets sparse attention but --sparse is not given; add --sparse"),
    (["--sink-pages", "0", "--sparse-score", "quest"], "--sink-pages and --sparse-score set sparse attention but --sparse is not given"),
    (["--sparse", "--page-budget", "-1"], "--page-budget is -1"),
    (["--sparse", "--local-pages", "-8"], "--local-pages is -8"),
    (["--sparse", "--page-budget", "0", "--sink-pages", "0", "--local-pages", "0"], "attends to no past page"),
])
def test_plan_validates_sparse_options_as_train_does(tmp_path, text_file, capsys, extra, fragment):
    """`oomb plan` printed a plan for sparse options it ignored (no --sparse), a negative budget and a setting
    with no past page; it now refuses them with train's own messages."""
    _check_refused(run_cli(["plan", "--model", "tiny", "--seq-len", "4096", "--chunk-size", "512", "--gpu-gib", "8", *extra]),
                   capsys, fragment)
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", tmp_path / "run", *FAST, *extra]), capsys, fragment)


def test_cli_errors_name_flags_not_python_names(tmp_path, text_file, capsys):
    from oomb.cli.checks import _flag_names

    assert _flag_names("need 9 pages on the GPU; raise gpu_page_budget or shorten the sequence") == \
        "need 9 pages on the GPU; raise --gpu-page-budget or shorten the sequence"
    assert "use --lora-rank, --checkpoint-layers or a smaller --chunk-size" in _flag_names("x; use LoRA, checkpoint_layers or a smaller chunk_size")
    assert _flag_names("need seq_len >= 2 and offload_segment_pages must be") == "need --seq-len >= 2 and --offload-segment-pages must be"
    assert _flag_names("/a/seq_len/b and seq_len.txt") == "/a/seq_len/b and seq_len.txt"
    assert _flag_names("use a smaller chunk_size.") == "use a smaller --chunk-size."
    out = tmp_path / "run"
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, *FAST, "--offload-segment-pages", "-1"]), capsys, "--offload-segment-pages is -1")
    # a library error raised through the CLI (the engine's page-budget check) names the flag
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, *FAST, "--offload", "on", "--gpu-page-budget", "3"]), capsys, "--gpu-page-budget")


def test_plan_advice_names_flags(capsys):
    assert run_cli(["plan", "--model", "qwen2.5-7b", "--gpu-gib", "8", "--host-gib", "64"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "--lora-rank, --checkpoint-layers or a smaller --chunk-size" in out
    assert "checkpoint_layers" not in out and "chunk_size" not in out


def test_unknown_flags_point_to_the_subcommand_s_help(capsys):
    """argparse tells a subcommand's unknown flags from the top-level parser; the line names that subcommand's
    help (whose flags they are not), and the command that takes the flag where one does."""
    line = _check_refused(run_cli(["train", "--bogus-flag", "1"]), capsys, "unrecognized arguments: --bogus-flag 1")
    assert line.endswith("; run 'oomb train --help' for the options"), line
    line = _check_refused(run_cli(["plan", "--model", "qwen2.5-7b", "--seq-len", "1048576", "--steps", "5"]), capsys,
                          "unrecognized arguments: --steps 5 (--steps is a flag of 'oomb train', not of 'oomb plan')")
    assert line.endswith("; run 'oomb plan --help' for the options"), line
    line = _check_refused(run_cli(["eval", "--lr=3"]), capsys, "--lr is a flag of 'oomb train', not of 'oomb eval'")
    assert "'oomb eval --help'" in line
    _check_refused(run_cli(["train", "--seq-len", "x"]), capsys, "run 'oomb train --help'")
    _check_refused(run_cli(["bogus"]), capsys, "run 'oomb --help'")


def test_the_flags_given_are_parsed_by_one_parser_that_keeps_nothing_of_a_command_line():
    """The parser that tells the flags given from the defaults is built once per process: a command line parsed
    with it leaves nothing in it for the next (its namespace holds the flags given, only those)."""
    from oomb.cli.parser import _given_parser

    first = vars(_given_parser().parse_args(["grad-error", "--budgets", "1", "2", "--seq-len", "64"]))
    assert first == {"command": "grad-error", "budgets": [1, 2], "seq_len": 64}
    first["budgets"].append(3)
    assert vars(_given_parser().parse_args(["grad-error"])) == {"command": "grad-error"}
    assert vars(_given_parser().parse_args(["grad-error", "--budgets", "4"]))["budgets"] == [4]


def test_no_help_text_shows_docstring_markup_or_python_values():
    """The flags' help is generated from the fields' docstrings, written for Python readers: no reST role
    (:class:`SparseConfig`), no ``literal`` markup and no None (a flag user never writes it) reaches any
    subcommand's help."""
    import argparse

    from oomb.cli.parser import _build_parser

    parser = _build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert {"train", "plan", "eval", "grad-error", "bench", "data", "merge"} <= set(sub.choices)
    markup = re.compile(r":[a-z]+:`|``|`|\bNone\b|\bTrue\b|\bFalse\b")
    for command, p in sub.choices.items():
        texts = {"description": p.description or ""}
        texts.update({"/".join(a.option_strings) or a.dest: a.help or "" for a in p._actions})
        for where, text in texts.items():
            assert not markup.search(text), (command, where, text)


@pytest.mark.parametrize("command", ["train", "plan", "grad-error", "eval"])
def test_every_subcommand_help_shows_defaults_the_same_way(capsys, command):
    """`oomb plan --help` used argparse's plain defaults formatter: '(default: None)' and '(default: False)' on
    flags and options without a meaningful default, unlike the other subcommands."""
    assert run_cli([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: auto)" in text  # --attention-backend: a real default is still shown


def test_plan_messages_speak_to_cli_users(capsys, monkeypatch):
    """What `oomb plan` prints when a run does not fit names flags, not Python (`offload='auto' or True`), blames
    the right thing, and says how to plan without a GPU (--gpu-gib and --host-gib)."""

    base = ["plan", "--model", "qwen2.5-7b", "--seq-len", "1048576", "--host-gib", "100"]
    assert run_cli([*base, "--gpu-gib", "139", "--offload", "off"]) == 1
    out = capsys.readouterr().out
    assert "GiB of GPU memory is left for it; turn offload on (--offload auto, or on)" in out and "True" not in out
    line = _check_refused(run_cli([*base, "--gpu-gib", "139", "--checkpoint-layers", "--offload", "on", "--gpu-page-budget",
                                   "100"]), capsys, "--gpu-page-budget 100 pages is below the 512 pages offload needs")
    assert "raise --gpu-page-budget to 512" in line
    assert run_cli([*base, "--gpu-gib", "8"]) == 1
    out = capsys.readouterr().out
    assert "of GPU memory is left for KV pages" in out and "use --lora-rank, --checkpoint-layers or a smaller --chunk-size" in out


@pytest.mark.parametrize("extra, says", [
    (["--gpu-page-budget", "3"], "--gpu-page-budget 3 pages is below the 8 pages offload needs for 4 pages per layer "
     "(two staging buffers of 4 pages); raise --gpu-page-budget to 8 or more, lower --offload-segment-pages"),
    (["--sparse", "--offload-staging-sets", "3", "--gpu-page-budget", "11"], "--gpu-page-budget 11 pages is below the "
     "12 pages offload needs for 4 pages per layer (3 layers of staging); raise --gpu-page-budget to 12 or more, lower "
     "--offload-staging-sets (2 needs 8)"),
])
def test_a_gpu_page_budget_below_the_smallest_pool_is_bad_input_in_plan_and_train(tmp_path, text_file, capsys,
                                                                                   monkeypatch, extra, says):
    """A --gpu-page-budget below the smallest pool the run stages through fits no machine: `oomb plan` and
    `oomb train` (on the CPU, and on a GPU before the model is built) refuse it alike, exit status 2 and the same
    one line naming the minimum, nothing written."""
    import oomb.models.presets as presets
    from oomb.planner import Machine

    run = ["--seq-len", "128", "--chunk-size", "64", "--page-size", "32", "--offload", "on", *extra]
    train = ["train", "--data", text_file, "--output-dir", tmp_path / "run", "--steps", "2", "--no-progress"]
    lines = [_check_refused(run_cli(["plan", "--gpu-gib", "8", "--host-gib", "8", *run]), capsys, says),
             _check_refused(run_cli([*train, *run]), capsys, says)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls, device=None: Machine(8 << 30, 8 << 30, 8 << 30,
                                                                                        8 << 30, "fake GPU")))
    monkeypatch.setattr(presets, "build_model", lambda *a, **k: pytest.fail("the model was built before the check"))
    lines.append(_check_refused(run_cli([*train, "--device", "cuda", *run]), capsys, says))
    assert len(set(lines)) == 1, lines
    assert not (tmp_path / "run").exists()


def test_plan_without_a_gpu_needs_the_machine_sizes(capsys, monkeypatch):
    """`oomb plan` on a machine without a CUDA GPU and without --gpu-gib printed a table of zeros and exited 1; it
    exits 2 with one line, before any table, naming --gpu-gib and --host-gib. Given the sizes it plans as before."""
    from oomb.planner import Machine

    no_gpu = Machine(0, 0, 64 << 30, 64 << 30, "no GPU")
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls, device=None: no_gpu))
    base = ["plan", "--model", "tiny", "--seq-len", "4096", "--chunk-size", "512"]
    for extra in ([], ["--host-gib", "64"]):
        status = run_cli([*base, *extra])
        out, err = capsys.readouterr()
        assert status == 2 and out == "" and len(err.splitlines()) == 1, (status, out, err)  # no table, one line
        assert err.startswith("oomb: error: no CUDA GPU is visible, so there is no GPU memory to plan for; pass --gpu-gib G "
                              "and --host-gib H (the free GPU memory and the available host RAM, in GiB, of the machine to "
                              "plan for)"), err
    # an unknown model is still the first thing said
    _check_refused(run_cli(["plan", "--model", "gpt-17"]), capsys, "unknown model")
    assert run_cli([*base, "--gpu-gib", "8", "--host-gib", "64"]) == 0
    assert "predicted peak" in capsys.readouterr().out
    assert run_cli([*base, "--gpu-gib", "8"]) == 0  # the host side defaults to this machine's


def test_help_version_and_argument_errors_do_not_import_torch():
    """Building the parser needs no torch/transformers (a user timed `oomb --version` at 6-20 s)."""
    code = (
        "import sys, oomb.cli as c\n"
        "for a in (['--help'], ['train', '--help'], ['plan', '--help'], ['eval', '--help'], ['grad-error', '--help'],"
        " ['--version'], ['train', '--no-such-flag']):\n"
        "    try:\n"
        "        c.main(a)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.dirname(README))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "heavy: []", res.stdout[-500:]


@pytest.mark.parametrize("extra,fragment", [
    (["--page-budget", "4"], "--page-budget sets sparse attention but --sparse is not given"),
    (["--sink-pages", "0", "--sparse-score", "quest"], "--sink-pages and --sparse-score set sparse attention"),
    (["--sparse", "--page-budget", "0", "--sink-pages", "0", "--local-pages", "0"], "attends to no past page"),
    (["--lora-alpha", "16"], "--lora-alpha scales a LoRA adapter but --lora-rank is 0"),
])
def test_options_that_would_be_ignored_are_refused(tmp_path, text_file, capsys, extra, fragment):
    """A user found these accepted and silently ignored (or, for the all-zero sparse setting,
    training without any past)."""
    out = tmp_path / "run"
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, *FAST, *extra]), capsys, fragment)
    assert not out.exists()


def test_lora_rank_larger_than_the_adapted_layers_is_refused(tmp_path, text_file, capsys):
    """A user found --lora-rank 99999 on tiny (hidden size 128) accepted: 358M trainable parameters
    for a 4.9M model and 68 s steps. tiny's q/o projections are 128 x 128 and its k/v 128 x 64."""
    out = tmp_path / "run"
    fragment = "--lora-rank 99999 is larger than the layers it adapts (q/o projections 128 x 128, k/v 128 x 64"
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, *FAST, "--lora-rank", "99999"]), capsys, fragment)
    assert not out.exists()
    _check_refused(run_cli(["plan", "--model", "tiny", "--gpu-gib", "8", "--host-gib", "8", "--lora-rank", "129"]), capsys,
                   "pass a rank of at most 128 (8-64 is usual)")
    assert run_cli(["plan", "--model", "tiny", "--gpu-gib", "8", "--host-gib", "8", "--lora-rank", "128"]) == 0


def test_a_default_warmup_longer_than_anyone_runs_is_noted(tmp_path, text_file, capsys, monkeypatch):
    """--steps 99999999999999999999 was accepted without a word and its default warm-up (10% of --steps) kept the
    learning rate ~0 for as long as anyone could run."""
    import oomb.train.step

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(oomb.train.step, "lr_at", stop)  # the first step: everything before it has run
    with pytest.raises(Stop):
        run_cli(["train", "--data", text_file, "--output-dir", tmp_path / "run", *FAST, "--steps", "99999999999999999999"])
    assert ("oomb: note: the default warm-up is 10% of --steps 99,999,999,999,999,999,999: 9,999,999,999,999,999,999 "
            "steps before the learning rate reaches --lr") in capsys.readouterr().err
    for extra in (["--steps", "100000"], ["--steps", "99999999999999999999", "--warmup-steps", "100"]):
        with pytest.raises(Stop):
            run_cli(["train", "--data", text_file, "--output-dir", tmp_path / "run", "--overwrite", *FAST, *extra])
        assert "default warm-up" not in capsys.readouterr().err


def test_sparse_with_only_sink_and_local_pages_is_allowed(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, *FAST, "--steps", "1", "--sparse", "--page-budget", "0"]) == 0


def test_warmup_longer_than_the_run_is_a_warning_that_names_the_peak_lr(tmp_path, text_file, capsys):
    """A warm-up longer than the run leaves the learning rate rising at the last step: a warning (as oomb's other
    warnings) names the lr it peaks at. A warm-up as long as the run reaches --lr at its last step: nothing to
    say (it was noted as 'never reaches --lr')."""
    config = tmp_path / "run.yaml"
    config.write_text("train: {steps: 2, warmup_steps: 50, lr: 0.003}\n")
    fast = [a for a in FAST if a != "--steps" and a != "2"]
    assert run_cli(["train", "--config", config, "--data", text_file, "--output-dir", tmp_path / "run", *fast]) == 0
    err = capsys.readouterr().err
    assert ("oomb: warning: --warmup-steps 50 is longer than the run (--steps 2): the learning rate is still warming "
            "up at the last step, so it peaks at 0.00012 (2/50 of --lr 0.003) and never reaches --lr (nor does the "
            "cosine decay start); pass --warmup-steps 2 or fewer, or leave it out (10% of --steps)") in err, err
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([0.00006, 0.00012])
    assert run_cli(["train", "--data", text_file, "--output-dir", tmp_path / "run", "--overwrite", *FAST,
                    "--warmup-steps", "2"]) == 0
    err = capsys.readouterr().err
    assert "--warmup-steps" not in err and "never reaches" not in err, err


def test_repeated_data_is_noted(tmp_path, text_file, capsys):
    """More sequences drawn than the data holds: said once, with the number of passes."""
    assert run_cli(["train", "--data", text_file, "--output-dir", tmp_path / "run", *FAST, "--steps", "4"]) == 0
    err = capsys.readouterr().err
    assert err.count("the data is repeated") == 1 and "4 steps x 1 sequence = 4 sequences from 2:" in err, err
    assert "the data is repeated (~2.0 passes)" in err, err


def test_the_parameter_count_holds_each_parameter_once():
    """The start line's count: a tied weight once, and of the embeddings and norms --train-embeddings-norms trains
    (peft keeps a frozen original beside each trained copy) only the copy, as the model runs."""
    from oomb.cli.train import _parameter_count
    from oomb.models.lora import apply_lora
    from oomb.models.presets import build_model

    base = build_model("tiny", device="cpu")
    n = sum(p.numel() for p in base.parameters())
    assert _parameter_count(base) == n
    model = apply_lora(base, 4, train_embeddings_norms=True)
    adapter = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    assert adapter > 0 and sum(p.numel() for p in model.parameters()) > n + adapter  # the originals and their copies
    assert _parameter_count(model) == n + adapter


def _help_entries(text):
    """{'--flag': its help text on one line} of an argparse --help output."""
    entries, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (--[a-z][a-z-]*)", line)
        if m:
            current = m.group(1)
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


def test_help_shows_zero_defaults_of_numeric_options(capsys):
    """_HelpFormatter hid '(default: 0)' because 0 == False: --seed, --lora-rank and --save-every looked as if
    they had no default. Flags (store_true) and None defaults stay without one."""
    assert run_cli(["train", "--help"]) == 0
    entries = _help_entries(capsys.readouterr().out)
    for flag in ("--seed", "--lora-rank", "--save-every"):
        assert entries[flag].endswith("(default: 0)"), entries[flag]
    assert entries["--weight-decay"].endswith("(default: 0.0)"), entries["--weight-decay"]
    for flag in ("--sparse", "--overwrite", "--progress", "--warmup-steps", "--data"):
        assert "(default:" not in entries[flag], entries[flag]
    assert run_cli(["plan", "--help"]) == 0
    entries = _help_entries(capsys.readouterr().out)
    assert entries["--lora-rank"].endswith("(default: 0)") and "(default:" not in entries["--no-optimizer"]


def test_train_warns_when_seq_len_exceeds_the_model_s_positions(tmp_path, text_file, capsys):
    """Positions beyond max_position_embeddings were never trained: a warning (the same text as `oomb plan`'s),
    not a refusal; a --rope-scaling that covers --seq-len silences it."""
    d = tmp_path / "short-model"
    cfg = Qwen2Config(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    assert run_cli(["train", "--data", text_file, "--model", d, "--output-dir", tmp_path / "a", *FAST, "--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert f"oomb: warning: --seq-len 128 exceeds the 64 positions model {str(d)!r} declares" in err
    assert run_cli(["train", "--data", text_file, "--model", d, "--output-dir", tmp_path / "b", *FAST, "--steps", "1",
                    "--rope-scaling", "type=yarn,factor=2,original_max_position_embeddings=64"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_overwrite_with_an_empty_log_deletes_only_an_empty_run(tmp_path, text_file, capsys):
    """An empty log.jsonl is what a run stopped in its first step leaves; --overwrite may replace that, but
    not anything kept next to it, not even under checkpoints/ (a user lost a file that way)."""
    out = tmp_path / "run"
    (out / "checkpoints" / "mydata").mkdir(parents=True)
    (out / "log.jsonl").write_text("")
    (out / "checkpoints" / "mydata" / "important.txt").write_text("precious")
    before = snapshot(out)
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST]), capsys,
                   "does not look like an oomb output")
    assert snapshot(out) == before
    # the empty log (and an empty checkpoints/) alone: an earlier run that wrote nothing yet, replaced
    (out / "checkpoints" / "mydata" / "important.txt").unlink()
    (out / "checkpoints" / "mydata").rmdir()
    assert run_cli(["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST, "--steps", "1"]) == 0
    assert len((out / "log.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("available_mib, fragment", [
    (40, "use --lora-rank 8 ("),  # the adapters would fit
    (10, "; use a smaller --model (e.g. tiny), or --device cuda"),
])
def test_a_cpu_run_larger_than_the_ram_is_refused_before_anything_is_built(tmp_path, text_file, capsys, monkeypatch,
                                                                          available_mib, fragment):
    """The weights, gradients and AdamW states alone exceed the available RAM: one line naming the sizes and a fix,
    before the model is built or the output folder made (a 7B model on a 23 GB machine swapped or died with a
    traceback)."""
    import oomb.memory

    monkeypatch.setattr(oomb.memory, "host_memory", lambda: (available_mib * 2**20, 64 * 2**30))
    out = tmp_path / "run"
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, *FAST]), capsys, fragment)
    assert not out.exists()


def test_a_cpu_kv_store_larger_than_the_ram_is_refused_before_anything_is_written(tmp_path, text_file, capsys,
                                                                                 monkeypatch):
    """On the CPU the KV store is host memory that the OS hands out without refusing: a store (here one whole
    65,536-token page per layer, 256 MiB) that does not fit in the available RAM next to the weights is refused in
    one line naming both sizes and the fix, before the output folder is made (a 1M-token store started training
    and grew until the process was killed)."""
    import oomb.memory

    monkeypatch.setattr(oomb.memory, "host_memory", lambda: (200 * 2**20, 64 * 2**30))
    out = tmp_path / "run"
    line = _check_refused(run_cli(["train", "--data", text_file, "--output-dir", out, "--seq-len", "128",
                                   "--chunk-size", "65536", "--page-size", "65536", "--steps", "1", "--no-progress"]),
                          capsys, "the KV store for --seq-len 128 needs 0.25 GiB of memory on the CPU")
    assert "0.20 GiB is available" in line and "pass a --page-size (and --chunk-size) of at most --seq-len 128" in line
    assert not out.exists()


_CPU_ALLOC_ERROR = ("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you tried "
                    "to allocate 107374182400 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("command", ["train", "eval", "grad-error"])
def test_a_host_allocation_failure_is_one_line_and_exit_2(tmp_path, text_file, capsys, monkeypatch, command):
    """The CPU allocator's RuntimeError where the KV store is allocated is a refusal in one line naming the bytes
    asked for and the sizes to lower (it was a traceback with exit status 1); train writes nothing."""
    from oomb.engine.kv_store import PagedKVStore

    def fail(self, *args, **kwargs):
        raise RuntimeError(_CPU_ALLOC_ERROR)

    monkeypatch.setattr(PagedKVStore, "__init__", fail)
    out = tmp_path / "run"
    extra = {"train": ["--output-dir", out, "--steps", "1", "--no-progress"], "eval": [], "grad-error": ["--budgets", "1"]}
    sizes = ["--seq-len", "128", "--chunk-size", "64", "--page-size", "32"]
    status = run_cli([command, "--data", text_file, *sizes, *extra[command]])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("oomb: error: ")]
    assert status == 2 and len(errors) == 1 and "Traceback" not in err, err
    line = errors[0]  # eval's line on what it evaluates comes before it
    assert "could not allocate 100.0 GiB of host memory" in line and line == err.strip().splitlines()[-1]
    assert "use a shorter --seq-len or a smaller --chunk-size or --page-size" in line
    assert not out.exists()


def test_a_host_allocation_failure_in_a_step_is_one_line_and_exit_1(tmp_path, text_file, capsys, monkeypatch):
    """The CPU allocator's RuntimeError inside a training step ends the run as a GPU out-of-memory does: one line,
    exit status 1 (it was a traceback)."""
    from oomb import Engine

    def fail(self, *args, **kwargs):
        raise RuntimeError(_CPU_ALLOC_ERROR)

    monkeypatch.setattr(Engine, "step", fail)
    status = run_cli(["train", "--data", text_file, "--output-dir", tmp_path / "run", *FAST])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 1, err
    assert lines[-1].startswith("oomb: error: out of host memory at step 1; "), err
    assert "Traceback" not in err


def test_oomb_warnings_are_one_line_and_sparse_ignores_segment_pages(tmp_path, text_file, capsys):
    """oomb's own warnings print as one 'oomb: warning:' line (not Python's two lines naming the CLI's source);
    --offload-segment-pages with --sparse says it is not used (sparse offload stages whole layers), and so does
    --save-attention, by its flag first (it led with save_attention='gpu', a Python name)."""
    out = tmp_path / "run"
    argv = ["train", "--data", text_file, "--output-dir", out, *FAST, "--steps", "1", "--sparse", "--offload", "on",
            "--offload-segment-pages", "2", "--save-attention", "gpu"]
    assert run_cli(argv) == 0
    err = capsys.readouterr().err
    assert "oomb: warning: --offload-segment-pages is not used with --sparse" in err
    assert ("oomb: warning: --save-attention gpu (OOMBConfig.save_attention='gpu') is not used with an offloaded KV "
            "store that stages whole layers (--sparse under offload") in err
    assert "or pass --save-attention off (save_attention='off') to silence this" in err
    assert "warnings.warn(" not in err and "UserWarning" not in err
    # oomb plan's note on the same case leads with the flag too
    assert run_cli(["plan", "--model", "qwen2.5-7b", "--seq-len", "1048576", "--gpu-gib", "139", "--host-gib", "1000",
                    "--checkpoint-layers", "--sparse", "--save-attention", "host"]) == 0
    assert "\n--save-attention host (save_attention='host'): not kept (offload stages whole layers" in capsys.readouterr().out


def test_a_refused_run_prints_its_error_line_and_no_warning_or_note(tmp_path, text_file, capsys, monkeypatch):
    """Warnings and notes come once every refusal is behind: a train or plan refused as bad input prints its one
    error line only, though its flags would be warned about (--offload-segment-pages with --sparse) or noted
    (--host-gib not given on a machine without a GPU)."""
    from oomb.planner import Machine

    sizes = ["--seq-len", "128", "--chunk-size", "64", "--page-size", "32"]
    warned = ["--sparse", "--offload", "on", "--offload-segment-pages", "2", "--gpu-page-budget", "3"]
    _check_refused(run_cli(["train", "--data", text_file, "--output-dir", tmp_path / "run", "--steps", "1",
                            "--no-progress", *sizes, *warned]), capsys, "--gpu-page-budget 3 pages is below")
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls, device=None: Machine(0, 0, 8 << 30, 8 << 30, "no GPU")))
    for extra in (warned, ["--offload", "on", "--gpu-page-budget", "3"]):
        _check_refused(run_cli(["plan", "--gpu-gib", "8", *sizes, *extra]), capsys,
                       "--gpu-page-budget 3 pages is below")
    assert not (tmp_path / "run").exists()


def test_save_attention_gpu_on_the_cpu_says_where_the_outputs_are_kept(tmp_path, text_file, capsys):
    """`--save-attention gpu --device cpu` was accepted without a word: the run works, with the
    outputs in CPU memory (SavedAttention keeps them on the compute device), and one warning says so; 'host' on the
    CPU and 'gpu' on cuda are what they say and get none. `oomb bench` warns the same."""
    base = ["train", "--data", text_file, *FAST, "--steps", "1", "--device", "cpu"]
    assert run_cli([*base, "--output-dir", tmp_path / "gpu", "--save-attention", "gpu"]) == 0
    err = capsys.readouterr().err
    assert err.count("oomb: warning: --save-attention gpu with --device cpu keeps Stage 1's attention outputs in "
                     "ordinary CPU memory") == 1
    assert run_cli([*base, "--output-dir", tmp_path / "host", "--save-attention", "host"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert run_cli(["bench", "--lengths", "128", "--systems", "oomb", "--chunk-size", "64", "--page-size", "32",
                    "--warmup-len", "0", "--steps", "1", "--save-attention", "gpu"]) == 0
    assert "oomb: warning: --save-attention gpu with --device cpu" in capsys.readouterr().err


def test_tiny_offload_segments_are_warned_about(tmp_path, text_file, capsys):
    """`--offload-segment-pages 1` (one host-to-device copy and attention call per page) was accepted without a word
    : train and plan warn once below 4,096 tokens' worth and name the default; a segment that
    holds a whole layer's pages (tiny at FAST: 4 pages of 32 tokens), the default and --sparse are not warned."""
    base = ["train", "--data", text_file, *FAST, "--steps", "1", "--offload", "on"]
    assert run_cli([*base, "--output-dir", tmp_path / "one", "--offload-segment-pages", "1"]) == 0
    err = capsys.readouterr().err
    assert err.count("oomb: warning: --offload-segment-pages 1 stages 32 tokens of a layer's past at a time") == 1
    assert "pass 128 pages (4,096 tokens) or more, or leave the flag out for the default, 32,768 tokens' worth" in err
    assert run_cli([*base, "--output-dir", tmp_path / "four", "--offload-segment-pages", "4"]) == 0
    assert "warning" not in capsys.readouterr().err
    plan = ["plan", "--model", "qwen2.5-7b", "--seq-len", "1048576", "--gpu-gib", "139", "--host-gib", "1000",
            "--checkpoint-layers"]
    assert run_cli([*plan, "--offload-segment-pages", "16"]) == 0
    err = capsys.readouterr().err
    assert err.count("oomb: warning: --offload-segment-pages 16 stages 2,048 tokens") == 1
    assert "(256 pages of --page-size 128)" in err
    for extra in ([], ["--offload-segment-pages", "32"]):
        assert run_cli([*plan, *extra]) == 0
        assert "--offload-segment-pages" not in capsys.readouterr().err


def test_an_offload_budget_that_holds_every_page_is_warned_about_once(tmp_path, text_file, capsys):
    """`--offload on --gpu-page-budget N` with N at least every page of every layer kept them all on the GPU
    silently (offload moved nothing): one warning per run (not per step) names the pages and the budget; the run
    itself is unchanged. tiny at FAST: 4 layers x 4 pages of 32 tokens = 16 pages; `oomb eval` warns the same."""
    base = ["train", "--data", text_file, *FAST, "--offload", "on"]  # 2 steps
    assert run_cli([*base, "--output-dir", tmp_path / "all", "--gpu-page-budget", "16"]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "warning" in line] == [
        "oomb: warning: --gpu-page-budget 16 holds all 16 KV pages of this run (4 layers x 4 pages of --seq-len 128 / "
        "--page-size 32), so every page stays on the GPU and offload moves nothing to the host at this length; drop "
        "--offload on and --gpu-page-budget to run without offload, or pass a --gpu-page-budget below 16 to offload"]
    assert "oomb: KV store: every page on the CPU (" in err  # as before: the offloaded store, all pages resident
    assert run_cli([*base, "--output-dir", tmp_path / "some", "--gpu-page-budget", "15"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "oomb: KV store: offload, 3 of 4 pages per layer resident" in err
    argv = ["eval", "--data", text_file, "--seq-len", "128", "--chunk-size", "64", "--page-size", "32", "--num-windows", "1",
            "--offload", "on", "--gpu-page-budget"]
    assert run_cli([*argv, "20"]) == 0
    assert capsys.readouterr().err.count("oomb: warning: --gpu-page-budget 20 holds all 16 KV pages") == 1
    assert run_cli([*argv, "15"]) == 0
    assert "warning" not in capsys.readouterr().err
    plan = ["plan", "--model", "tiny", "--seq-len", "128", "--chunk-size", "64", "--page-size", "32", "--gpu-gib", "8",
            "--host-gib", "8", "--offload", "on", "--gpu-page-budget"]
    assert run_cli([*plan, "16"]) == 0  # oomb plan says it too, after its table
    captured = capsys.readouterr()
    assert "tiering: every page on the GPU" in captured.out and "KV staging: none (no offload)" in captured.out
    assert captured.err.count("oomb: warning: --gpu-page-budget 16 holds all 16 KV pages") == 1
    assert run_cli([*plan, "15"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("extra, dense, smaller", [
    # the defaults, 64 + 1 + 8 pages, hold the 2 past pages of FAST's last chunk
    ([], True, "--page-budget, --sink-pages or --local-pages"),
    (["--page-budget", "1", "--sink-pages", "1", "--local-pages", "0"], True, "--page-budget or --sink-pages"),  # exactly
    # a budget of 0 cannot shrink: the fix names only the others
    (["--page-budget", "0", "--sink-pages", "1", "--local-pages", "1"], True, "--sink-pages or --local-pages"),
    (["--page-budget", "1", "--sink-pages", "0", "--local-pages", "0"], False, None),  # 1 of 2 past pages: sparse
])
def test_a_sparse_setting_that_keeps_every_page_is_warned_about_once(tmp_path, text_file, capsys, extra, dense, smaller):
    """--page-budget + --sink-pages + --local-pages covering every past page of the last chunk made sparse attention
    exactly dense at that length without a word: `oomb train` (once per run, not per step) and `oomb plan` warn."""
    assert run_cli(["train", "--data", text_file, "--output-dir", tmp_path / "run", *FAST, "--sparse", *extra]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    kept = sum(int(v) for v in extra[1::2]) if extra else 73
    assert warned == ([f"oomb: warning: --sparse at --seq-len 128: --page-budget {extra[1] if extra else 64} + --sink-pages "
                       f"{extra[3] if extra else 1} + --local-pages {extra[5] if extra else 8} = {kept} pages cover all 2 past "
                       "pages of the last chunk, so the sparse selection keeps every page and attention is dense (correct, "
                       f"just not sparse); use a longer --seq-len or a smaller {smaller}, or drop --sparse"]
                      if dense else [])
    assert run_cli(["plan", "--model", "tiny", "--seq-len", "128", "--chunk-size", "64", "--page-size", "32", "--gpu-gib", "8",
                    "--host-gib", "8", "--sparse", *extra]) == 0
    captured = capsys.readouterr()
    assert "predicted peak" in captured.out
    assert captured.err.count("oomb: warning: --sparse at --seq-len 128:") == int(dense)


def test_a_one_chunk_sparse_run_is_warned_about(tmp_path, text_file, capsys):
    assert run_cli(["train", "--data", text_file, "--output-dir", tmp_path / "run", *FAST, "--steps", "1", "--sparse",
                    "--chunk-size", "128"]) == 0
    assert ("oomb: warning: --sparse at --seq-len 128: the sequence is one chunk (--chunk-size 128), which has no past page "
            "to choose from, so the sparse selection keeps every page and attention is dense (correct, just not sparse); "
            "use a --chunk-size below --seq-len") in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,says", [
    ("--offload-stage-grain", "tile", "invalid choice: 'tile'"),
    ("--offload-copy-streams", "3", "invalid choice: 3"),
    ("--offload-kv-stash-mib", "-1", "--offload-kv-stash-mib is -1"),
    ("--offload-staging-sets", "1", "--offload-staging-sets is 1"),
    ("--page-gather-programs", "0", "--page-gather-programs is 0"),
    ("--page-gather-warps", "6", "--page-gather-warps is 6"),
    ("--page-gather-elems", "x", "--page-gather-elems: invalid int value: 'x'"),
])
def test_bad_offload_and_kernel_settings_fail_before_anything_loads(tmp_path, text_file, capsys, flag, value, says):
    """The offload and kernel settings are checked when the command starts, also for a run that would not use
    them (dense, no offload): one line naming the flag, exit 2, no output directory."""
    out = tmp_path / "run"
    runs = [["train", "--data", text_file, "--output-dir", out, *FAST, "--sparse", flag, value]]
    if not flag.startswith("--page-gather"):  # oomb plan has no kernel settings
        runs.append(["plan", "--model", "tiny", "--seq-len", "128", "--gpu-gib", "8", "--host-gib", "16", "--sparse",
                     flag, value])
    for argv in runs:
        assert run_cli(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("oomb: error: ") and says in err[0], err
    assert not out.exists()


def test_empty_output_dir_is_named_as_empty(text_file, capsys):
    assert run_cli(["train", "--data", text_file, "--output-dir", "", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["oomb: error: --output-dir is empty; pass a directory path that is new or empty"], err


def test_progress_bars_only_on_a_terminal_unless_asked(tmp_path, text_file, capsys):
    """Progress bars filled log files with carriage-return updates: they are shown only when stderr is a terminal,
    or with --progress; of --progress and --no-progress the last one given counts."""
    base = ["train", "--data", text_file, "--seq-len", "128", "--chunk-size", "64", "--page-size", "32", "--steps", "2"]
    assert run_cli([*base, "--output-dir", tmp_path / "a"]) == 0  # capsys: stderr is not a terminal
    err = capsys.readouterr().err
    assert "train:" not in err and "step/s" not in err and "s/step" not in err and "\r" not in err
    assert run_cli([*base, "--output-dir", tmp_path / "b", "--progress"]) == 0
    err = capsys.readouterr().err
    assert "train:" in err and "\r" in err
    assert run_cli([*base, "--output-dir", tmp_path / "c", "--progress", "--no-progress"]) == 0
    assert "\r" not in capsys.readouterr().err


def test_overwrite_keeps_the_earlier_run_until_the_new_one_is_saved(tmp_path, text_file, capsys, monkeypatch):
    """--overwrite deleted the earlier run at the start, so a run killed or failing before its save lost it (a user
    killed one after two steps: the finished run's model and checkpoint were gone). It now moves
    the earlier outputs to DIR/.oomb-replaced and deletes them only after the new model is saved."""
    import oomb.cli.train as cli

    out = tmp_path / "run"
    assert run_cli(["train", "--data", text_file, "--output-dir", out, *FAST]) == 0
    first_model = (out / "model.safetensors").read_bytes()
    first_log = (out / "log.jsonl").read_text()
    capsys.readouterr()

    real_save = cli._save

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash before the save")

    monkeypatch.setattr(cli, "_save", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_cli(["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST, "--lr", "1e-3"])
    backup = out / ".oomb-replaced"
    assert "moved the earlier run's outputs to" in capsys.readouterr().err
    assert (backup / "model.safetensors").read_bytes() == first_model and (backup / "log.jsonl").read_text() == first_log
    assert not (out / "model.safetensors").exists()
    # a second attempt that fails too: the unfinished run goes, the finished one it replaced stays
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_cli(["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST])
    assert "stays in" in capsys.readouterr().err
    assert (backup / "model.safetensors").read_bytes() == first_model
    # without --overwrite the folder is refused, as any non-empty one
    assert run_cli(["train", "--data", text_file, "--output-dir", out, *FAST]) == 2
    capsys.readouterr()
    # a run that saves: the backup goes
    monkeypatch.setattr(cli, "_save", real_save)
    assert run_cli(["train", "--data", text_file, "--output-dir", out, "--overwrite", *FAST]) == 0
    assert (out / "model.safetensors").is_file() and not backup.exists()
    assert len((out / "log.jsonl").read_text().splitlines()) == 2


def test_plan_warns_when_offload_on_keeps_every_page_on_the_gpu(capsys):
    """`--offload on` where every page fits was planned (and, on a GPU, trained) with no host tier and no word about
    it: the plan now warns, and names the flag that makes a host tier."""
    base = ["plan", "--model", "qwen2.5-7b", "--gpu-gib", "139.8", "--host-gib", "125"]
    assert run_cli([*base, "--seq-len", "131072", "--offload", "on"]) == 0
    captured = capsys.readouterr()
    assert "every page on the GPU" in captured.out
    assert captured.err.count("oomb: warning: --offload on: all 28672 KV pages of this run fit on the GPU") == 1
    assert "--gpu-page-budget below 28672" in captured.err
    # where pages are offloaded, or with --offload auto, or a given pool: no such warning
    for extra in (["--seq-len", "1048576", "--offload", "on", "--checkpoint-layers"], ["--seq-len", "131072"],
                  ["--seq-len", "131072", "--offload", "on", "--gpu-page-budget", "8192"]):
        run_cli([*base, *extra])
        assert "--offload on: all" not in capsys.readouterr().err


def test_plan_notes_whose_host_ram_it_uses_without_host_gib(capsys):
    """`oomb plan --gpu-gib G` without --host-gib on a machine with no GPU took this machine's RAM as the host
    budget without a word (: 'DOES NOT FIT ... free host RAM' on a 23 GB laptop)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the note is for planning on a machine without a GPU")
    run_cli(["plan", "--model", "qwen2.5-7b", "--seq-len", "65536", "--gpu-gib", "139.8"])
    assert "oomb: note: --host-gib not given, so the host budget comes from this machine's available RAM" in capsys.readouterr().err
    run_cli(["plan", "--model", "qwen2.5-7b", "--seq-len", "65536", "--gpu-gib", "139.8", "--host-gib", "120"])
    assert "--host-gib not given" not in capsys.readouterr().err


def test_plan_host_budget_line_says_where_the_budget_comes_from(capsys, monkeypatch):
    """The host budget row names its source: 75% of --host-gib H where it was given, else of this machine's
    available RAM (the GPU row likewise says 'given' for --gpu-gib)."""
    from oomb.planner import Machine

    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls, device=None: Machine(0, 0, 64 << 30, 64 << 30, "no GPU")))
    base = ["plan", "--model", "tiny", "--seq-len", "4096", "--chunk-size", "512", "--gpu-gib", "8"]

    def host_row(extra):
        assert run_cli([*base, *extra]) == 0
        return next(line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("budget (75%"))

    assert host_row(["--host-gib", "120"]) == ["budget", "(75%", "of", "--host-gib", "120)", "90.00"]
    assert host_row(["--host-gib", "0.5"]) == ["budget", "(75%", "of", "--host-gib", "0.5)", "0.38"]
    assert host_row([]) == ["budget", "(75%", "of", "available", "RAM)", "48.00"]


def test_plan_refusals_name_fixes_that_apply(capsys):
    """A refused plan named --checkpoint-layers with it given, never named the user's own too-small
    --gpu-page-budget when that was what overflowed the host tier, and offered only memory flags for a context far
    too long."""
    base = ["plan", "--model", "qwen2.5-7b", "--gpu-gib", "139.8", "--host-gib", "125", "--sparse"]
    assert run_cli([*base, "--seq-len", "1048576", "--checkpoint-layers"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "use --lora-rank or a smaller --chunk-size" in out and "--checkpoint-layers or" not in out
    assert run_cli([*base, "--seq-len", "1048576", "--checkpoint-layers", "--no-optimizer", "--gpu-page-budget", "16384"]) == 1
    out = capsys.readouterr().out
    assert "raise --gpu-page-budget (16,384 pages keep 0 of 8,192 pages per layer on the GPU)" in out
    assert run_cli(["plan", "--model", "qwen2.5-7b", "--gpu-gib", "139.8", "--host-gib", "125", "--seq-len", "100000000000"]) == 1
    out = capsys.readouterr().out
    # the host tier is what does not fit (one chunk's attention temporaries are bounded: MAX_RUN_TOKENS)
    assert "the host tier needs" in out and "; shorten the context to 905,216 tokens or fewer (the longest that fits " \
        "with offload), free host RAM" in out


def test_plan_refusal_names_what_grows_with_the_context(capsys):
    """A context far too long for the host: the verdict names the host tier and the longest context that fits (one
    chunk's attention temporaries do not grow past MAX_RUN_TOKENS keys per call, so they are not what fails), not
    LoRA for the weights."""
    base = ["plan", "--model", "tiny", "--gpu-gib", "80", "--host-gib", "100"]
    assert run_cli([*base, "--seq-len", "99999999999"]) == 1
    out = capsys.readouterr().out
    verdict = out.splitlines()[-1]
    assert verdict.startswith("DOES NOT FIT: the host tier needs 286025.25 GiB of pinned memory but the budget is "
                              "75.00 GiB; shorten the context to 53,141,504 tokens or fewer (the longest that fits "
                              "with offload), free host RAM")
    # bounded attention temporaries: the fused path plans a 100M-token context on 20 GiB like the Triton kernels
    for backend in ("sdpa", "triton"):
        assert run_cli(["plan", "--model", "tiny", "--gpu-gib", "20", "--host-gib", "1000", "--seq-len", "100000000",
                        "--attention-backend", backend]) == 0
        capsys.readouterr()
    # a plan whose weights and states do not fit keeps its advice
    assert run_cli(["plan", "--model", "qwen2.5-7b", "--gpu-gib", "8", "--host-gib", "64"]) == 1
    assert "DOES NOT FIT: weights, gradients, optimizer states and one chunk's activations need" in capsys.readouterr().out


def test_saved_files_follow_the_umask(tmp_path, text_file):
    """model.safetensors came out 0600 (transformers writes a temp file and renames it) and each checkpoint folder
    0700 (mkdtemp), unreadable to the other users of a shared server; they follow the umask."""
    import stat

    old = os.umask(0o022)
    try:
        out = tmp_path / "perm"
        assert run_cli(["train", "--data", text_file, "--output-dir", out, *FAST]) == 0
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(out / "model.safetensors") == 0o644 and mode(out / "config.json") == 0o644
    ckpts = [p for p in (out / "checkpoints").iterdir() if p.is_dir()]
    assert ckpts and all(mode(p) == 0o755 for p in ckpts)


def test_train_warns_that_adamw_rounds_away_bf16_updates(tmp_path, text_file, capsys):
    """A full fine-tune with plain AdamW on bfloat16 weights: a warning naming adamw-bf16; not with LoRA, not in
    float32."""
    argv = ["train", "--data", text_file, *FAST, "--steps", "1"]
    assert run_cli([*argv, "--output-dir", tmp_path / "a", "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert "oomb: warning: --optimizer adamw on bfloat16 weights rounds away" in err and "--optimizer adamw-bf16" in err
    for extra, where in ((["--dtype", "float32"], "b"), (["--dtype", "bfloat16", "--lora-rank", "4"], "c")):
        assert run_cli([*argv, "--output-dir", tmp_path / where, *extra]) == 0
        assert "rounds away" not in capsys.readouterr().err


def test_adamw_bf16_on_float_weights_is_told_it_is_adamw():
    """--optimizer adamw-bf16 rounds bfloat16 weights; on float32 weights (the CPU's default) it is plain AdamW, and
    a warning says so (not for bfloat16 weights, not for another optimizer)."""
    import argparse
    import warnings

    from oomb.cli.checks import _warn_if_bf16_optimizer_has_float_weights

    with pytest.warns(UserWarning, match=r"adamw-bf16 rounds bfloat16 weights stochastically, but the weights are "
                                         r"float32: it trains as --optimizer adamw"):
        _warn_if_bf16_optimizer_has_float_weights(argparse.Namespace(optimizer="adamw-bf16"), torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_if_bf16_optimizer_has_float_weights(argparse.Namespace(optimizer="adamw-bf16"), torch.bfloat16)
        _warn_if_bf16_optimizer_has_float_weights(argparse.Namespace(optimizer="adamw"), torch.float32)


def test_train_with_kept_graphs_logs_and_prints_them(tmp_path, text_file, capsys):
    """--keep-graphs auto with a cap on the CPU: each step keeps the chunks before the last (capped), log.jsonl and
    the step line say how many, and the losses are those of a run without it."""
    runs = {}
    for name, extra in (("plain", []), ("kept", ["--keep-graphs", "auto", "--keep-graphs-max", "5"])):
        out = tmp_path / name
        assert run_cli(["train", "--data", text_file, "--output-dir", out, "--log-every", "1", *FAST, *extra]) == 0
        runs[name] = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        printed = capsys.readouterr().out
        assert ("kept graphs 1" in printed) == (name == "kept"), printed
    assert [r["kept_graphs"] for r in runs["kept"]] == [1, 1] and [r["kept_graphs"] for r in runs["plain"]] == [0, 0]
    assert [r["loss"] for r in runs["kept"]] == [r["loss"] for r in runs["plain"]]


def test_a_file_the_user_may_not_read_is_one_line_not_a_traceback(capsys, monkeypatch):
    """A PermissionError anywhere in a command (a checkpoint, a data file or an output folder another user owns)
    is one line naming the path, exit status 2."""
    cli_main = sys.modules["oomb.cli.main"]  # the module (the package's attribute main is the function)

    def denied(args):
        raise PermissionError(13, "Permission denied", "/runs/x/checkpoints/step-00000004/trainable.safetensors")

    monkeypatch.setattr(cli_main, "_eval", denied)
    with pytest.raises(SystemExit) as exc:
        main(["eval"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err == ("oomb: error: permission denied: /runs/x/checkpoints/step-00000004/trainable.safetensors "
                   "(Permission denied); give this user access to it (chmod, chown) or pass another path\n")
