"""The tokenizer ``oomb train`` and ``oomb data`` encode with: --tokenizer where given, else the --model folder's own
(a Hugging Face model, an ``oomb train`` output), else the bundled one (a preset). A model folder's run used to be
encoded with the bundled 32K tokenizer, silently (its ids < 32000 pass the vocabulary check), and its output shipped
that tokenizer; each summary line now names the tokenizer, as ``oomb eval``'s does."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from oomb.data import BUNDLED_TOKENIZER, load_documents, load_tokenizer, tokenize_documents
from cli_helpers import run_cli

pytestmark = pytest.mark.usefixtures("_cache")  # every test: a cache folder of its own

FAST = ["--seq-len", "64", "--chunk-size", "32", "--page-size", "16", "--no-progress"]
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families.\n")
CHAT_TEMPLATE = (Path(__file__).parent.parent / "data" / "chat_templates" / "plain.jinja").read_text()


def _bpe(folder: Path, vocab_size: int, chat_template: str | None = None) -> Path:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens (far from the bundled 32K SentencePiece one), saved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([TEXT * 4], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """The tiny preset's weights (vocabulary 32,000, as a large model's covers the bundled ids) saved with a
    tokenizer of its own: 400 byte-level BPE tokens, with a chat template."""
    import torch

    from oomb.models.presets import build_model

    folder = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    build_model("tiny").save_pretrained(folder)
    _bpe(folder, 400, CHAT_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("data") / "text.txt"
    f.write_text("".join(f"{i}: {TEXT}" for i in range(12)))
    return f


def _tokens(text_file, tokenizer_folder) -> int:
    return len(tokenize_documents(load_documents(text_file), load_tokenizer(tokenizer_folder)))


def _data_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("oomb: data: ")]
    assert len(lines) == 1, text
    return lines[0]


def test_train_from_a_model_folder_encodes_with_its_tokenizer_and_saves_it(tmp_path, model_folder, text_file, capsys):
    from transformers import AutoTokenizer

    from oomb.checkpoint import find_latest, read_settings

    own = load_tokenizer(model_folder)
    assert len(own) == 400
    out = tmp_path / "run"
    argv = ["train", "--model", model_folder, "--data", text_file, *FAST, "--save-every", "1", "--output-dir", out]
    assert run_cli([*argv, "--steps", "1"]) == 0
    line = _data_line(capsys.readouterr().err)
    n = _tokens(text_file, model_folder)
    assert n != _tokens(text_file, None)  # the tokenizers tell apart
    assert f"{n:,} tokens -> " in line and line.endswith(f"; tokenizer {model_folder}"), line
    saved = AutoTokenizer.from_pretrained(str(out))
    assert len(saved) == 400 and saved(TEXT)["input_ids"] == own(TEXT)["input_ids"]
    # the checkpoint records the folder: eval and merge of it read the run's tokenizer, and the run resumes
    ckpt = find_latest(out / "checkpoints")
    assert read_settings(ckpt, "fingerprint")["tokenizer"] == str(model_folder.resolve())
    assert run_cli([*argv, "--steps", "2", "--resume", "latest"]) == 0
    err = capsys.readouterr().err
    assert "resuming from" in err and "tokenizer" in _data_line(err)
    assert [json.loads(r)["step"] for r in (out / "log.jsonl").read_text().splitlines()] == [1, 2]


def test_a_run_that_trained_a_model_folder_with_the_bundled_tokenizer_is_told_how_to_resume(
        tmp_path, model_folder, text_file, capsys):
    """The checkpoint an older oomb wrote for a model folder: encoded with the bundled tokenizer, recorded as none
    (as --tokenizer naming the bundled folder records it). Resumed with the folder's own it is refused, naming the
    bundled tokenizer both ways ('bundled' there, and --tokenizer its folder as the fix), which then resumes it."""
    from oomb.checkpoint import find_latest, read_settings

    out = tmp_path / "run"
    argv = ["train", "--model", model_folder, "--data", text_file, *FAST, "--save-every", "1", "--output-dir", out]
    assert run_cli([*argv, "--tokenizer", BUNDLED_TOKENIZER, "--steps", "1"]) == 0
    assert read_settings(find_latest(out / "checkpoints"), "fingerprint")["tokenizer"] is None
    capsys.readouterr()
    assert run_cli([*argv, "--steps", "2", "--resume", "latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"(tokenizer bundled there, {model_folder.resolve()} here)" in err, err
    assert err.endswith(f"--tokenizer {BUNDLED_TOKENIZER}), or start a new run without --resume in another "
                        "--output-dir"), err
    assert run_cli([*argv, "--tokenizer", BUNDLED_TOKENIZER, "--steps", "2", "--resume", "latest"]) == 0
    assert _data_line(capsys.readouterr().err).endswith(f"; tokenizer {BUNDLED_TOKENIZER}")


def test_oomb_data_of_a_model_folder_reports_its_tokenizer_and_template(tmp_path, model_folder, text_file, capsys):
    """The same token count as train, named; chat rows render with the folder's own template (the bundled
    tokenizer has none, so they used to be refused for want of --chat-template)."""
    assert run_cli(["data", "--model", model_folder, "--data", text_file, *FAST, "--output", tmp_path / "h.png"]) == 0
    line = _data_line(capsys.readouterr().out)
    assert f"{_tokens(text_file, model_folder):,} tokens -> " in line and line.endswith(f"; tokenizer {model_folder}")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                                     {"role": "assistant", "content": f"It is {2 * i}."}]}) + "\n"
                            for i in range(6)))
    assert run_cli(["data", "--model", model_folder, "--data", chat, *FAST, "--output", tmp_path / "c.png"]) == 0
    out = capsys.readouterr().out
    assert "6 examples (messages)" in _data_line(out) and re.search(r"\[\[It is \d+\.<\|endoftext\|>\]\]", out), out


def test_tokenizer_overrides_the_model_folders(tmp_path, model_folder, text_file, capsys):
    other = _bpe(tmp_path / "other", 300)
    out = tmp_path / "run"
    assert run_cli(["train", "--model", model_folder, "--tokenizer", other, "--data", text_file, *FAST, "--steps", "1",
                    "--output-dir", out]) == 0
    line = _data_line(capsys.readouterr().err)
    assert f"{_tokens(text_file, other):,} tokens -> " in line and line.endswith(f"; tokenizer {other}"), line
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(out))) == 300
    assert run_cli(["data", "--model", model_folder, "--tokenizer", other, "--data", text_file, *FAST,
                    "--output", tmp_path / "h.png"]) == 0
    assert _data_line(capsys.readouterr().out).endswith(f"; tokenizer {other}")


def test_a_preset_and_a_folder_without_a_tokenizer_use_the_bundled_one(tmp_path, model_folder, text_file, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "run"
    assert run_cli(["train", "--model", "tiny", "--data", text_file, *FAST, "--steps", "1", "--output-dir", out]) == 0
    line = _data_line(capsys.readouterr().err)
    assert f"{_tokens(text_file, None):,} tokens -> " in line and line.endswith("; tokenizer bundled"), line
    assert len(AutoTokenizer.from_pretrained(str(out))) == len(load_tokenizer(None)) == 32000
    bare = tmp_path / "bare"  # weights and config only
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((model_folder / name).read_bytes())
    for model in ("tiny", bare):
        assert run_cli(["data", "--model", model, "--data", text_file, *FAST, "--output", tmp_path / "h.png"]) == 0
        assert _data_line(capsys.readouterr().out).endswith("; tokenizer bundled")


@pytest.fixture(scope="module")
def sentencepiece_folder(tmp_path_factory):
    """A Llama-style model folder whose tokenizer is a SentencePiece tokenizer.model alone, without tokenizer.json or
    tokenizer_config.json (as older Llama and Mistral folders ship it): the tiny Llama preset's weights beside the
    bundled tokenizer's .model file. Its ids are the bundled tokenizer's, but they are read from the folder."""
    import torch

    from oomb.models.presets import build_model

    folder = tmp_path_factory.mktemp("sp_model")
    torch.manual_seed(0)
    build_model("tiny-llama").save_pretrained(folder)
    shutil.copy(BUNDLED_TOKENIZER / "tokenizer.model", folder / "tokenizer.model")
    assert not (folder / "tokenizer.json").exists() and not (folder / "tokenizer_config.json").exists()
    return folder


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("oomb:")]
    assert len(lines) == 1 and lines[0].startswith("oomb: error:") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("command", ["train", "data"])
def test_a_model_folder_whose_tokenizer_model_cannot_load_is_refused_not_given_the_bundled_one(
        tmp_path, sentencepiece_folder, text_file, capsys, monkeypatch, command):
    """A tokenizer.model alone used to count as no tokenizer: the run was encoded with the bundled 32K one, ids of
    another vocabulary for a real Llama or Mistral model. Without sentencepiece (what transformers converts it with)
    the run is refused in one line naming the file, the package and --tokenizer."""
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import sentencepiece fails, as where not installed
    out = tmp_path / "run"
    extra = ["--steps", "1", "--output-dir", out] if command == "train" else ["--output", tmp_path / "h.png"]
    assert run_cli([command, "--model", sentencepiece_folder, "--data", text_file, *FAST, *extra]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"the tokenizer '{sentencepiece_folder / 'tokenizer.model'}' is a SentencePiece model" in line, line
    assert line.endswith("pip install sentencepiece, or set --tokenizer to a folder with the model's tokenizer.json")
    assert not out.exists() and not (tmp_path / "h.png").exists()


def test_a_tokenizer_model_sentencepiece_cannot_read_is_refused_naming_it(tmp_path, sentencepiece_folder, text_file,
                                                                          capsys):
    pytest.importorskip("sentencepiece")
    broken = tmp_path / "broken"
    shutil.copytree(sentencepiece_folder, broken)
    (broken / "tokenizer.model").write_bytes((broken / "tokenizer.model").read_bytes()[:5000])  # truncated
    assert run_cli(["data", "--model", broken, "--data", text_file, *FAST, "--output", tmp_path / "h.png"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"cannot load the tokenizer '{broken / 'tokenizer.model'}': sentencepiece cannot read it" in line, line
    assert "tiktoken" not in line and line.endswith("or set --tokenizer to a folder with the model's tokenizer.json")


def test_a_model_folder_with_a_tokenizer_model_alone_encodes_with_it(tmp_path, sentencepiece_folder, text_file,
                                                                      capsys):
    """Loaded as transformers loads the folder (AutoTokenizer, the ids SentencePiece itself gives) and named on the
    data line."""
    sentencepiece = pytest.importorskip("sentencepiece")
    from transformers import AutoTokenizer

    text = "It is a truth  universally acknowledged,\n  that a single man 123."
    ids = load_tokenizer(sentencepiece_folder)(text, add_special_tokens=False)["input_ids"]
    spm = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_folder / "tokenizer.model"))
    assert ids == spm.encode(text)
    assert ids == AutoTokenizer.from_pretrained(str(sentencepiece_folder))(text, add_special_tokens=False)["input_ids"]
    assert run_cli(["data", "--model", sentencepiece_folder, "--data", text_file, *FAST,
                    "--output", tmp_path / "h.png"]) == 0
    line = _data_line(capsys.readouterr().out)
    assert f"{_tokens(text_file, sentencepiece_folder):,} tokens -> " in line, line
    assert line.endswith(f"; tokenizer {sentencepiece_folder}"), line


def test_a_run_of_a_model_folder_with_a_tokenizer_model_alone_records_and_saves_it(tmp_path, sentencepiece_folder,
                                                                                     text_file, capsys):
    pytest.importorskip("sentencepiece")
    from transformers import AutoTokenizer

    from oomb.checkpoint import find_latest, read_settings

    out = tmp_path / "run"
    assert run_cli(["train", "--model", sentencepiece_folder, "--data", text_file, *FAST, "--steps", "1",
                    "--save-every", "1", "--output-dir", out]) == 0
    assert _data_line(capsys.readouterr().err).endswith(f"; tokenizer {sentencepiece_folder}")
    assert read_settings(find_latest(out / "checkpoints"), "fingerprint")["tokenizer"] == \
        str(sentencepiece_folder.resolve())
    text = "It is a truth  universally acknowledged,\n  that a single man 123."
    own = load_tokenizer(sentencepiece_folder)(text, add_special_tokens=False)["input_ids"]
    assert AutoTokenizer.from_pretrained(str(out))(text, add_special_tokens=False)["input_ids"] == own


@pytest.mark.parametrize("command", [["train"], ["eval"], ["eval", "--task", "needle"], ["grad-error"]])
@pytest.mark.parametrize("model, said", [
    ("qwen2.5-7bb", "unknown model 'qwen2.5-7bb': not a preset"),
    ("bert", "model type 'bert' is not supported"),
])
def test_a_model_oomb_cannot_train_is_refused_before_the_data_is_tokenised(tmp_path, capsys, monkeypatch, model, said,
                                                                          command):
    """A misspelt preset, or a folder of another architecture, is named at once, by every command that reads
    --data: tokenising a large corpus first took minutes before the refusal."""
    import oomb.data

    if model == "bert":
        (tmp_path / "bert").mkdir()
        (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 100}))
        model = str(tmp_path / "bert")

    def read(*a, **k):
        raise AssertionError("the data was read before the model was checked")

    monkeypatch.setattr(oomb.data, "build_training_data", read)
    monkeypatch.setattr(oomb.data, "load_documents", read)
    (tmp_path / "doc.txt").write_text("some words " * 50)
    more = ["--output-dir", tmp_path / "run"] if command == ["train"] else ["--seq-len", "64", "--chunk-size", "32",
                                                                           "--page-size", "16"]
    assert run_cli([*command, "--model", model, "--data", tmp_path / "doc.txt", *(FAST if command == ["train"] else []),
                    *more]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oomb: error: ") and said in err and "Traceback" not in err, err
