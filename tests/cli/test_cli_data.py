"""``oomb data`` and the data ``oomb train`` reads: local files through datasets (jsonl, parquet, csv, a
save_to_disk folder, streaming), chat rows with their loss mask, and bad input refused in one line (exit 2,
nothing written)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from oomb.config import DataConfig
from oomb.data import BUNDLED_TOKENIZER, DataError, TokenSequences, build_training_data, load_documents, load_tokenizer, tokenize_documents
from cli_helpers import run_cli

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"
PLAIN = str(TEMPLATES / "plain.jinja")
FAST = ["--seq-len", "64", "--chunk-size", "32", "--page-size", "16", "--no-progress"]

pytestmark = pytest.mark.usefixtures("_cache")  # every test: a cache folder of its own


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_rows(n=12):
    return [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(n)]


def refused(argv, capsys, tmp_path, match):
    """``oomb`` refuses argv: exit 2, one line naming ``match``, no output folder and no histogram written."""
    out = tmp_path / "run"
    png = tmp_path / "lengths.png"
    extra = ["--output-dir", out] if argv[0] == "train" else ["--output", png]
    capsys.readouterr()
    assert run_cli([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if line.startswith("oomb:")]
    assert len(err) == 1 and err[0].startswith("oomb: error:"), err
    assert match in err[0], err[0]
    assert not out.exists() and not png.exists()
    return err[0]


# ------------------------------------------------------------------ what is read


def test_the_bundled_default_is_the_token_stream_it_was(tmp_path):
    tok = load_tokenizer()
    data = build_training_data(DataConfig(seq_len=512), tok, seed=7)
    ref = TokenSequences(tokenize_documents(load_documents(None), tok), 512, seed=7)
    assert len(data) == len(ref) and np.array_equal(data.order(3), ref.order(3))
    for i in (0, 5, len(ref) - 1):
        s = data[i]
        assert s.labels is None and s.cu_seqlens is None and s.input_ids.equal(ref[i])
    assert data.stats.trained_tokens == len(ref) * 511 and data.stats.padding == 0


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "save_to_disk", "folder"])
def test_local_files_read_through_datasets_give_the_same_sequences(tmp_path, kind):
    import datasets

    texts = [" ".join(["word"] * (20 + i)) + f" number {i}." for i in range(30)]
    ds = datasets.Dataset.from_dict({"body": texts, "id": list(range(30))})
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "d.jsonl", [{"body": t, "id": i} for i, t in enumerate(texts)])
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    elif kind == "csv":
        path = tmp_path / "d.csv"
        ds.to_csv(str(path), index=False)
    elif kind == "save_to_disk":
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(path))
    else:
        path = tmp_path / "folder"
        path.mkdir()
        ds.select(range(15)).to_json(str(path / "train-0.jsonl"))
        ds.select(range(15, 30)).to_json(str(path / "train-1.jsonl"))
    tok = load_tokenizer()
    data = build_training_data(DataConfig(path=str(path), text_field="body", seq_len=32), tok)
    tokens = tokenize_documents([type("D", (), {"text": t})() for t in texts], tok)
    ref = TokenSequences(tokens, 32)
    assert len(data) == len(ref) and all(data[i].input_ids.equal(ref[i]) for i in range(len(ref)))
    if kind == "save_to_disk":
        test = build_training_data(DataConfig(path=str(path), text_field="body", split="test", seq_len=8), tok)
        assert test.stats.examples == 3


def test_streaming_gives_the_same_sequences_and_caches_them(tmp_path):
    tok = load_tokenizer()
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40))
    cfg = dict(path=str(path), chat_template=PLAIN, seq_len=64)
    mem = build_training_data(DataConfig(**cfg), tok, seed=1)
    streamed = build_training_data(DataConfig(**cfg, streaming=True), tok, seed=1)
    assert len(list((tmp_path / "cache" / "packed").glob("*/manifest.json"))) == 1
    again = build_training_data(DataConfig(**cfg, streaming=True), tok, seed=1)  # from the cache
    assert mem.stats == streamed.stats == again.stats and mem.digest() == streamed.digest() == again.digest()
    for i in range(len(mem)):
        a, b = mem[i], again[i]
        assert a.input_ids.equal(b.input_ids) and a.labels.equal(b.labels) and a.cu_seqlens.equal(b.cu_seqlens)
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": f"line {i} " * 9} for i in range(50)])
    t_mem = build_training_data(DataConfig(path=str(text), seq_len=16), tok)
    t_str = build_training_data(DataConfig(path=str(text), seq_len=16, streaming=True), tok)
    assert t_mem.digest() == t_str.digest() and len(t_mem) == len(t_str)


def test_the_streaming_cache_knows_a_file_by_its_modification_time_as_its_help_says(tmp_path):
    """A file rewritten with its size and modification time kept reads the cached sequences (the contents are not
    hashed, as datasets does not hash them); once touched, it is read again."""
    import os

    tok = load_tokenizer()
    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": f"alpha {i} " * 9} for i in range(30)])
    cfg = DataConfig(path=str(path), seq_len=16, streaming=True)
    first = build_training_data(cfg, tok)
    kept = os.stat(path)
    path.write_text(path.read_text().replace("alpha", "omega"))  # the same size
    os.utime(path, ns=(kept.st_atime_ns, kept.st_mtime_ns))  # as cp -p, rsync -a or touch -r keep it
    assert build_training_data(cfg, tok).digest() == first.digest()
    os.utime(path)  # touch
    assert build_training_data(cfg, tok).digest() != first.digest()


def test_prompt_completion_rows_and_text_with_drop(tmp_path):
    tok = load_tokenizer()
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: one?", "completion": " A: one."}] * 4)
    data = build_training_data(DataConfig(path=str(path), seq_len=40), tok)
    assert data.stats.format == "prompt-completion" and data.stats.examples == 4
    s = data[0]
    completion = tok(" A: one.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(tok("Q: one?", add_special_tokens=False)["input_ids"]) + len(completion)
    per_seq = 40 // n
    assert s.labels[0][s.labels[0] != -100].tolist() == completion * per_seq
    long = write_jsonl(tmp_path / "t.jsonl", [{"text": "short one"}, {"text": "word " * 200}])
    dropped = build_training_data(DataConfig(path=str(long), seq_len=32, long_examples="drop"), tok)
    assert dropped.stats.dropped_examples == 1 and len(dropped) == 1


# ------------------------------------------------------------------ oomb data


def test_oomb_data_shows_the_mask_and_writes_the_histogram(tmp_path, capsys):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    png = tmp_path / "h.png"
    assert run_cli(["data", "--data", path, "--chat-template", PLAIN, "--seq-len", "64", "--output", png]) == 0
    out = capsys.readouterr().out
    assert "12 examples (messages)" in out and "trained tokens" in out and "padding" in out
    assert "[[ It is" in out and "</s>]]" in out and "--- document 0" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run_cli(["data", "--data", path, "--chat-template", PLAIN, "--seq-len", "64", "--output", png]) == 0  # a PNG: replaced
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    capsys.readouterr()
    assert run_cli(["data", "--data", path, "--chat-template", PLAIN, "--seq-len", "64", "--output", notes]) == 2
    assert "is not a PNG" in capsys.readouterr().err and notes.read_text() == "mine"
    # the histogram is a PNG: hist.jpg would hold PNG bytes under a JPEG name, so it is refused; no suffix is taken
    jpg = tmp_path / "hist.jpg"
    assert run_cli(["data", "--data", path, "--chat-template", PLAIN, "--seq-len", "64", "--output", jpg]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"oomb: error: --output {str(jpg)!r} ends in .jpg, but the histogram is written as a PNG image only; "
                   "pass a path ending in .png, e.g. --output hist.png") and not jpg.exists()
    bare = tmp_path / "hist"
    assert run_cli(["data", "--data", path, "--chat-template", PLAIN, "--seq-len", "64", "--output", bare]) == 0
    assert bare.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_png_that_is_not_an_earlier_histogram_is_kept(tmp_path, capsys):
    """--output replaces an earlier histogram, never another PNG: a photo, a run's loss curve, a heatmap."""
    from PIL import Image

    from oomb.png import png_kind
    from oomb.train.plot import plot_log

    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    argv = ["data", "--data", path, "--chat-template", PLAIN, "--seq-len", "64", "--output"]
    photo = tmp_path / "photo.png"
    Image.new("RGB", (10, 10)).save(photo)
    (tmp_path / "log.jsonl").write_text('{"step": 1, "loss": 3.0, "tokens_per_s": 10.0}\n')
    loss = tmp_path / "loss.png"
    assert plot_log(tmp_path / "log.jsonl", loss) and png_kind(loss) == "loss"
    for other in (photo, loss):
        before = other.read_bytes()
        capsys.readouterr()
        assert run_cli([*argv, other]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"oomb: error: --output {str(other)!r} exists and is not an earlier oomb histogram (a PNG that "
                       "another command or program wrote), so writing would destroy it; pass --output a new file path, "
                       "or delete that file first if it is not needed")
        assert other.read_bytes() == before
    hist = tmp_path / "hist.png"
    assert run_cli([*argv, hist]) == 0 and png_kind(hist) == "histogram"


def test_a_chatml_end_of_turn_that_is_plain_text_is_shown_trained_with_one_warning(tmp_path, capsys):
    """The bundled tokenizer has no <|im_end|> special token; the marker is inside the trained [[...]] span and
    one warning line says it is plain text."""
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows(3))
    chatml = str(TEMPLATES / "chatml.jinja")
    assert run_cli(["data", "--data", path, "--chat-template", chatml, "--seq-len", "512", "--show-tokens", "200",
                    "--output", tmp_path / "h.png"]) == 0
    captured = capsys.readouterr()
    assert "[[It is 0.<|im_end|>]]" in captured.out and "]]<|im_end|>" not in captured.out
    warned = [line for line in captured.err.splitlines() if line.startswith("oomb: warning:")]
    assert len(warned) == 1 and "'<|im_end|>'" in warned[0] and "plain text" in warned[0], captured.err


def test_oomb_train_on_chat_rows_prints_the_data_line(tmp_path, capsys):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    assert run_cli(["train", "--data", path, "--chat-template", PLAIN, *FAST, "--steps", "2",
                    "--output-dir", tmp_path / "run"]) == 0
    err = capsys.readouterr().err
    assert "oomb: data: 12 examples (messages)" in err and "trained tokens" in err
    assert len((tmp_path / "run" / "log.jsonl").read_text().splitlines()) == 2
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(tmp_path / "run"))  # the template it was trained with goes with it
    assert saved.chat_template == Path(PLAIN).read_text()
    # The tokenizer is read once per process: the template was set on this run's tokenizer only, not on the
    # next run's (nor on what load_tokenizer gives).
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged. " * 40)
    assert run_cli(["train", "--data", text, *FAST, "--steps", "1", "--output-dir", tmp_path / "plain"]) == 0
    assert AutoTokenizer.from_pretrained(str(tmp_path / "plain")).chat_template is None
    assert load_tokenizer().chat_template is None


# ------------------------------------------------------------------ bad input


def _tokenizer_folder(tmp_path, name, keep=("tokenizer_config.json",)):
    folder = tmp_path / name
    folder.mkdir()
    for n in keep:
        shutil.copy(BUNDLED_TOKENIZER / n, folder / n)
    return folder


@pytest.mark.parametrize("command", ["train", "data"])
def test_a_tokenizer_folder_without_a_vocabulary_is_refused(tmp_path, capsys, command):
    folder = _tokenizer_folder(tmp_path, "tok")
    refused([command, "--tokenizer", folder, *FAST], capsys, tmp_path, "has no vocabulary")


@pytest.mark.parametrize("command", ["train", "data"])
def test_a_text_field_the_rows_lack_is_refused_rather_than_reading_another_format(tmp_path, capsys, command):
    rows = [{"prompt": f"question {i} " * 5, "completion": f"answer {i} " * 5} for i in range(20)]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    line = refused([command, "--data", path, "--text-field", "body", "--chat-template", PLAIN, *FAST], capsys,
                   tmp_path, f"'{path}' has no 'body' field, which --text-field names (its fields: prompt, completion)")
    assert "leave --text-field out to read these prompt-completion rows" in line
    write_jsonl(path, [{**r, "body": r["prompt"] + r["completion"]} for r in rows])
    capsys.readouterr()
    assert run_cli([command, "--data", path, "--text-field", "body", "--data-format", "text", *FAST,
                    *(["--output-dir", tmp_path / "ok"] if command == "train" else ["--output", tmp_path / "ok.png"])]) == 0


@pytest.mark.parametrize("command", ["train", "data"])
def test_a_text_field_of_rows_of_another_format_is_refused_not_ignored(tmp_path, capsys, command):
    """prompt/completion (or messages, segments) rows that have the field --text-field names are read in their
    format, the field unread: refused in one line naming the format and the fixes (named as the --config file's
    key where it came from the file); --data-format text reads the field."""
    path = tmp_path / "pc.csv"
    path.write_text("prompt,completion\n" + "".join(f"question {i},answer {i}\n" for i in range(20)))
    line = refused([command, "--data", path, "--text-field", "prompt", *FAST], capsys, tmp_path,
                   f"--text-field 'prompt' names the field of text rows, but '{path}' holds prompt-completion rows")
    assert line.endswith("pass --data-format text to read the 'prompt' field as plain text, or leave --text-field out "
                         "to read the prompt-completion rows"), line
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  text_field: prompt\n")
    line = refused([command, "--config", config, "--data", path, *FAST], capsys, tmp_path,
                   f"data.text_field (in {config}) 'prompt' names the field of text rows")
    assert "leave data.text_field out" in line
    segments = write_jsonl(tmp_path / "seg.jsonl", [{"segments": [{"text": "Q: hi ", "label": False},
                                                                  {"text": "A: yo", "label": True}], "note": "x"}])
    refused([command, "--data", segments, "--text-field", "note", *FAST], capsys, tmp_path,
            f"'{segments}' holds segments rows")
    capsys.readouterr()
    assert run_cli(["data", "--data", path, "--text-field", "prompt", "--data-format", "text", *FAST,
                    "--output", tmp_path / "ok.png"]) == 0


def test_a_named_text_field_that_no_format_matches_says_which_fields_the_rows_have(tmp_path):
    path = write_jsonl(tmp_path / "notes.jsonl", [{"title": "a", "note": "some words " * 20}] * 5)
    with pytest.raises(DataError) as info:
        build_training_data(DataConfig(path=str(path), text_field="body", seq_len=32), load_tokenizer())
    assert info.value.problem == f"'{path}' has no 'body' field, which --text-field names (its fields: title, note)"
    assert info.value.fix == "pass --text-field the field that holds the text"
    build_training_data(DataConfig(path=str(path), text_field="note", seq_len=32), load_tokenizer())


@pytest.mark.parametrize("command", ["train", "data"])
def test_a_text_field_named_for_plain_text_is_refused_not_ignored(tmp_path, capsys, command):
    """.txt files (one, or a folder of them) have no fields: --text-field NAME other than text is refused in one line
    naming the flag (or the --config file's key), where it used to be ignored and the text read anyway."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(f"document {i} " * 40)
    for data in (folder / "0.txt", folder):
        line = refused([command, "--data", data, "--text-field", "body", *FAST], capsys, tmp_path,
                       f"--text-field 'body' names a field, but '{data}' is plain text, which has no fields; leave "
                       "--text-field out, or pass json/jsonl, parquet, csv or arrow rows with a 'body' field")
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  text_field: body\n")
    line = refused([command, "--config", config, "--data", folder, *FAST], capsys, tmp_path,
                   f"data.text_field (in {config}) 'body' names a field")
    assert "leave data.text_field out" in line
    # text, the default, is the one field plain text reads as: naming it changes nothing
    assert run_cli([command, "--data", folder, "--text-field", "text", *FAST,
                    *(["--output-dir", tmp_path / "ok"] if command == "train" else ["--output", tmp_path / "ok.png"])]) == 0


def test_the_library_refuses_a_text_field_for_plain_text_too(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("some words " * 40)
    tok = load_tokenizer()
    for read in (lambda field: build_training_data(DataConfig(path=str(path), text_field=field, seq_len=32), tok),
                 lambda field: load_documents(path, field),
                 lambda field: build_training_data(DataConfig(text_field=field, seq_len=32), tok)):
        with pytest.raises(DataError) as info:
            read("body")
        assert info.value.setting == "text_field"
        assert info.value.problem.startswith("text_field 'body' names a field, but ")
        assert info.value.problem.endswith(" is plain text, which has no fields")
        assert info.value.fix == "leave text_field out, or pass json/jsonl, parquet, csv or arrow rows with a 'body' field"
        read("text")
    with pytest.raises(DataError, match="the bundled corpus is plain text"):
        load_documents(None, "body")


def test_a_tokenizer_with_too_few_tokens_is_refused(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "the": 2, "a": 3}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path / "small")
    refused(["train", "--tokenizer", tmp_path / "small", *FAST], capsys, tmp_path, "has only 4 tokens")


def test_token_ids_above_the_models_vocabulary_are_refused(tmp_path, capsys):
    tok = load_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.save_pretrained(tmp_path / "big")
    text = tmp_path / "t.txt"
    text.write_text("<|im_start|>hello<|im_end|> " * 100)
    refused(["train", "--tokenizer", tmp_path / "big", "--data", text, *FAST], capsys, tmp_path,
            "the data has token id 32001 but model 'tiny' has a vocabulary of 32000 ids")
    refused(["data", "--tokenizer", tmp_path / "big", "--data", text, *FAST], capsys, tmp_path, "token id 32001")


@pytest.mark.parametrize("rows, flags, match", [
    ([{"body": "x", "id": 1}], [], "(its fields: body, id)"),
    ([{"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}], ["--chat-template", PLAIN],
     "d.jsonl:1: message 0 has the unknown role 'narrator'"),
    ([{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}], ["--chat-template", PLAIN],
     "message 0 (user) has content of type int, not a string"),
    ([{"messages": [{"role": "user", "content": "x"}]}] * 3, ["--chat-template", PLAIN], "no example of"),
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}], [], "--chat-template FILE"),
])
@pytest.mark.parametrize("command", ["train", "data"])
def test_bad_rows_are_refused_in_one_line(tmp_path, capsys, rows, flags, match, command):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    line = refused([command, "--data", path, *flags, *FAST], capsys, tmp_path, match)
    if "no example of" in match:
        assert "assistant turn" in line and "--loss-on all" in line


def test_an_empty_or_missing_split_is_refused(tmp_path, capsys):
    import datasets

    empty = tmp_path / "empty.csv"
    empty.write_text("text\n")  # the header only: no rows, which no --data-split changes
    line = refused(["data", "--data", empty, *FAST], capsys, tmp_path, f"{str(empty)!r} holds no rows with any field")
    assert "--data-split" not in line
    objects = write_jsonl(tmp_path / "objects.jsonl", [{}, {}])
    line = refused(["data", "--data", objects, *FAST], capsys, tmp_path, f"{str(objects)!r} holds no rows with any field")
    assert "--data-split" not in line and "empty JSON objects" in line
    ds = datasets.Dataset.from_dict({"text": ["some words here"] * 5})
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "saved"))
    refused(["train", "--data", tmp_path / "saved", "--data-split", "validation", *FAST], capsys, tmp_path,
            "has no split 'validation' (it has: train, test)")


@pytest.mark.parametrize("content, name, said", [("", "empty.jsonl", "the file is empty"),
                                                 ("\n \n", "blank.jsonl", "the file holds only blank lines"),
                                                 ("", "empty.csv", "the file is empty")])
@pytest.mark.parametrize("command", ["data", "train"])
def test_an_empty_data_file_is_refused_as_holding_no_rows(tmp_path, capsys, content, name, said, command):
    path = tmp_path / name
    path.write_text(content)
    line = refused([command, "--data", path, *FAST], capsys, tmp_path, f"{str(path)!r} holds no rows ({said})")
    assert "StopIteration" not in line and "write the rows into it" in line
    folder = tmp_path / "rows"
    folder.mkdir()
    (folder / name).write_text(content)
    refused([command, "--data", folder, *FAST], capsys, tmp_path, f"holds no rows (its data files are empty: {name})")


MESSAGES_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.mark.parametrize("rows, flags, said", [
    ([{"text": "hello there"}, MESSAGES_ROW], [], "line 1 is a text row, line 2 a messages row"),
    ([MESSAGES_ROW, MESSAGES_ROW, {"text": "hello there"}], ["--chat-template", PLAIN],
     "line 1 is a messages row, line 3 a text row"),
    ([{"prompt": "a", "completion": "b"}, {"text": "hello there"}], [], "line 1 is a prompt-completion row, line 2 a text row"),
    ([{"text": "hello there"}, MESSAGES_ROW], ["--data-format", "text"], "line 1 is a text row, line 2 a messages row"),
    ([{"text": "hello there"}, MESSAGES_ROW], ["--streaming"], "line 1 is a text row, line 2 a messages row"),
])
@pytest.mark.parametrize("command", ["data", "train"])
def test_rows_of_several_formats_are_refused_naming_the_first_of_each(tmp_path, capsys, rows, flags, said, command):
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    line = refused([command, "--data", path, *flags, *FAST], capsys, tmp_path, f"mixes row formats: {said}")
    assert "is empty" not in line and "files of their own" in line


@pytest.mark.parametrize("command", ["data", "train", "eval"])
def test_a_missing_data_path_from_a_config_file_names_the_key_and_the_file(tmp_path, capsys, monkeypatch, command):
    """data.path is read from the current folder; run from elsewhere, the error says where the path came from."""
    write_jsonl(tmp_path / "rows.jsonl", [{"text": "some words here"}] * 4)
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  path: rows.jsonl\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    said = f"data path 'rows.jsonl' (data.path in {config}) does not exist in the current folder {str(elsewhere)!r}"
    if command == "eval":  # its flags differ; it reads the same data.path
        capsys.readouterr()
        assert run_cli(["eval", "--config", config]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("oomb:")]
        assert len(err) == 1 and said in err[0], err
        return
    line = refused([command, "--config", config, *FAST], capsys, tmp_path, said)
    assert line.endswith("or pass --data")
    # a --data flag overrides the file: its error names the flag alone
    line = refused([command, "--config", config, "--data", "nothere.jsonl", *FAST], capsys, tmp_path,
                   "data path 'nothere.jsonl' does not exist")
    assert "data.path" not in line


@pytest.mark.parametrize("argv", [
    ["train", "--output-dir", "{tmp}/out"], ["eval"], ["eval", "--task", "needle"], ["grad-error"], ["data"],
    ["data", "--make", "needle", "--make-output", "{tmp}/rows.jsonl"],
])
def test_a_missing_data_path_is_refused_before_torch_is_imported(tmp_path, argv):
    """The refusal takes a fraction of a second: the path is checked before the imports of torch and
    transformers (seconds), with the line reading the data would give."""
    import subprocess
    import sys

    argv = [a.format(tmp=tmp_path) for a in argv] + ["--data", str(tmp_path / "nothere.jsonl")]
    code = ("import sys\nfrom oomb.cli import main\ntry:\n    main(%r)\nexcept SystemExit as exc:\n"
            "    print(exc.code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))" % argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    err = [line for line in done.stderr.splitlines() if line.startswith("oomb:")]
    assert len(err) == 1 and f"data path {str(tmp_path / 'nothere.jsonl')!r} does not exist; pass --data" in err[0], done.stderr
    assert done.stdout.split("\n")[0] == "2 []", (done.stdout, done.stderr)


@pytest.mark.parametrize("command", ["data", "train", "eval"])
def test_an_empty_data_path_is_refused_not_read_as_the_current_folder(tmp_path, capsys, monkeypatch, command):
    (tmp_path / "notes.txt").write_text("private notes that are not training data\n" * 50)
    monkeypatch.chdir(tmp_path)
    extra = ["--output-dir", tmp_path / "out"] if command == "train" else []
    for given in (["--data", ""], ["--config", _yaml(tmp_path, 'data:\n  path: ""\n')]):
        capsys.readouterr()
        assert run_cli([command, *given, *extra]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and "data path '' is empty; pass --data (or data.path in --config) a file or folder" in err[0], err
    assert not (tmp_path / "out").exists()


def _yaml(folder, text):
    path = folder / "c.yaml"
    path.write_text(text)
    return path


def test_the_novels_chat_set_asks_for_a_sentence_of_its_passage(tmp_path):
    from oomb.data.novels import write_chat_novels

    path = write_chat_novels(tmp_path / "novels.jsonl", 3, passage_chars=3000, seed=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        asked = user["content"].rsplit("\n", 1)[1].strip('"')
        passage = " ".join(user["content"].split())
        answer = assistant["content"].strip('"')
        assert 2500 < len(user["content"]) < 3400 and passage.index(asked) < passage.index(answer, passage.index(asked))


def test_oomb_data_prints_a_config_that_reads_back(tmp_path, capsys):
    assert run_cli(["data", "--print-config", "--loss-on", "all", "--long-examples", "split", "--show-tokens", "9"]) == 0
    text = capsys.readouterr().out
    assert "loss_on: all" in text and "long_examples: split" in text and "show_tokens: 9" in text
    (tmp_path / "run.yaml").write_text(text)
    assert run_cli(["data", "--config", tmp_path / "run.yaml", "--print-config"]) == 0
    assert capsys.readouterr().out == text


# ------------------------------------------------------------------ unreadable files, named by their bad line


def _bad_files(tmp_path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the one error line says)."""
    nonutf8 = tmp_path / "nonutf8.jsonl"
    nonutf8.write_bytes(b'{"text": "caf\xe9 au lait"}\n' * 20)
    lines = [json.dumps(r) for r in chat_rows(50)]
    lines[36] = lines[36][:30]
    bad37 = tmp_path / "bad37.jsonl"
    bad37.write_text("\n".join(lines) + "\n")
    rows = ["text,label"] + [f"row {i},1" for i in range(60)]
    rows[41] = "a,b,c,d,e"
    badcsv = tmp_path / "badcsv.csv"
    badcsv.write_text("\n".join(rows) + "\n")
    latin_csv = tmp_path / "latin.csv"
    latin_csv.write_bytes(b"text\n" + b"plain words here\n" * 5 + b"caf\xe9\n")
    commas = tmp_path / "commas.csv"  # every row one field too many: pandas would take the first as an index
    commas.write_text("text,source\n" + "".join(f"Dear Sir{i}, the weather today is fine,web\n" for i in range(40)))
    return {"nonutf8": (nonutf8, f"{nonutf8}:1 is not UTF-8 text"),
            "bad37": (bad37, f"{bad37}:37 is not valid JSON"),
            "badcsv": (badcsv, f"{badcsv}:42 has 5 fields but the header line has 2 (text, label)"),
            "commas": (commas, f"{commas}:2 has 3 fields but the header line has 2 (text, source)"),
            "latin_csv": (latin_csv, f"{latin_csv}:7 is not UTF-8 text")}


@pytest.mark.parametrize("name", ["nonutf8", "bad37", "badcsv", "latin_csv", "commas"])
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("command", ["data", "train"])
def test_an_unreadable_file_is_refused_naming_its_bad_line(tmp_path, capsys, name, streaming, command):
    path, said = _bad_files(tmp_path)[name]
    flags = ["--chat-template", PLAIN] + (["--streaming"] if streaming else [])
    line = refused([command, "--data", path, *flags, *FAST], capsys, tmp_path, said)
    assert "Traceback" not in line and ("convert it to UTF-8" in line or "fix the line" in line
                                        or "one JSON object per line" in line)


def _compress(kind: str, data: bytes) -> bytes:
    import bz2
    import gzip
    import lzma

    if kind == "zstd":  # the frame magic is what is looked at
        return b"\x28\xb5\x2f\xfd" + bytes(range(200, 256)) * 4
    return {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress}[kind](data)


@pytest.mark.parametrize("kind, suffix, tool", [("gzip", ".gz", "gunzip -k"), ("bzip2", ".bz2", "bunzip2 -k"),
                                                ("xz", ".xz", "unxz -k"), ("zstd", ".zst", "zstd -d")])
@pytest.mark.parametrize("command", ["data", "train", "eval"])
def test_a_compressed_file_is_refused_as_compressed_naming_how_to_decompress_it(tmp_path, capsys, kind, suffix, tool,
                                                                                 command):
    """chat.jsonl.gz was refused as 'not UTF-8 text; convert it to UTF-8': it is compressed, and the fix is to
    decompress it (oomb names rows by the lines of the file on disk, which a compressed file does not have)."""
    rows = "".join(json.dumps({"text": f"line {i} " * 9}) + "\n" for i in range(40)).encode()
    packed = tmp_path / f"rows.jsonl{suffix}"
    packed.write_bytes(_compress(kind, rows))
    said = (f"{packed} is {kind}-compressed, and oomb reads data files uncompressed only; decompress it: "
            f"{tool} {packed}, and pass --data {tmp_path / 'rows.jsonl'}, the file it writes")
    if command == "eval":  # writes no output of its own
        capsys.readouterr()
        assert run_cli(["eval", "--data", packed, "--seq-len", "16"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("oomb:")]
        assert len(err) == 1 and said in err[0], err
        return
    line = refused([command, "--data", packed, *FAST], capsys, tmp_path, said)
    assert "UTF-8" not in line


@pytest.mark.parametrize("streaming", [False, True])
def test_a_compressed_file_under_a_plain_name_is_refused_however_it_is_read(tmp_path, capsys, streaming):
    """A gzip file named rows.jsonl (datasets would read it whole, but not streamed), a gzip .txt file of a folder,
    and a folder of .jsonl.gz files only: each refused as compressed, with a command that keeps the original."""
    rows = "".join(json.dumps({"text": f"line {i} " * 9}) + "\n" for i in range(40)).encode()
    plain = tmp_path / "rows.jsonl"
    plain.write_bytes(_compress("gzip", rows))
    more = ["--streaming"] if streaming else []
    refused(["data", "--data", plain, *more, *FAST], capsys, tmp_path,
            f"{plain} is gzip-compressed, and oomb reads data files uncompressed only; decompress it under its own "
            f"name: mv -n {plain} {plain}.gz && gunzip -k {plain}.gz (which keeps {plain}.gz), and run the command "
            "again")
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("plain words " * 40)
    (texts / "b.txt").write_bytes(_compress("gzip", b"packed words " * 40))
    refused(["data", "--data", texts, *more, *FAST], capsys, tmp_path, f"{texts / 'b.txt'} is gzip-compressed")
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        (shards / f"part-{i}.jsonl.gz").write_bytes(_compress("gzip", rows))
    refused(["data", "--data", shards, *more, *FAST], capsys, tmp_path,
            f"folder {str(shards)!r} holds no data file (.txt, .json/.jsonl, .parquet, .csv or .arrow), but 3 "
            "compressed files (e.g. part-0.jsonl.gz, gzip), which oomb reads uncompressed only; decompress them "
            f"beside themselves, e.g. gunzip -k {shards / 'part-0.jsonl.gz'}, and pass --data the folder again")


@pytest.mark.parametrize("command", ["data", "train", "eval"])
def test_a_folder_of_data_files_and_compressed_ones_is_refused_naming_them(tmp_path, capsys, command):
    """a.jsonl beside b.jsonl.gz (and c.csv.xz in a subfolder): the compressed ones are no data files, so they were
    left out of the rows, silently; now refused as a compressed file is, naming them and the commands that
    decompress them keeping them. Decompressed beside themselves, the folder reads all three (the compressed copies
    are then not refused)."""
    import gzip
    import lzma

    rows = [{"text": f"line {i} " * 9} for i in range(20)]
    folder = tmp_path / "mixed"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", rows)
    packed = {folder / "b.jsonl.gz": gzip, folder / "sub" / "c.jsonl.xz": lzma}
    for path, codec in packed.items():
        path.write_bytes(codec.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    said = (f"folder {str(folder)!r} holds 2 compressed data files beside its data files (b.jsonl.gz, "
            f"{Path('sub') / 'c.jsonl.xz'}), which oomb reads uncompressed only, so they would be left out; decompress "
            f"them beside themselves: gunzip -k {folder / 'b.jsonl.gz'} && unxz -k {folder / 'sub' / 'c.jsonl.xz'}, "
            "and pass --data the folder again")
    if command == "eval":  # writes no output of its own
        capsys.readouterr()
        assert run_cli(["eval", "--data", folder, "--seq-len", "16"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("oomb:")]
        assert len(err) == 1 and err[0].endswith(said), err
        return
    assert refused([command, "--data", folder, *FAST], capsys, tmp_path, said).endswith(said)
    if command == "data":
        for path, codec in packed.items():  # what gunzip -k and unxz -k write
            path.with_suffix("").write_bytes(codec.decompress(path.read_bytes()))
        from oomb.data.sources import open_rows

        assert len(list(open_rows(str(folder)))) == 60


@pytest.mark.parametrize("command", ["eval", "grad-error"])
def test_eval_refuses_an_unreadable_file_naming_its_bad_line(tmp_path, capsys, command):
    for path, said in _bad_files(tmp_path).values():
        capsys.readouterr()
        assert run_cli([command, "--data", path, "--seq-len", "16"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("oomb:")]
        assert len(err) == 1 and said in err[0], err


@pytest.mark.parametrize("command", ["data", "train"])
def test_a_json_array_of_numbers_is_refused_saying_the_rows_must_be_objects(tmp_path, capsys, command):
    path = tmp_path / "arr.json"
    path.write_text("[1,2,3]\n")
    line = refused([command, "--data", path, *FAST], capsys, tmp_path,
                   f"{path} row 1 is the number 1, but the rows must be JSON objects")
    assert '{"messages": [...]}' in line and "'text' is int" not in line


def test_a_cause_hidden_in_the_exception_chain_is_named():
    from oomb.data.sources import _one_line

    try:
        try:
            raise ValueError("Expected 2 fields in line 42, saw 5")
        except ValueError as inner:
            raise RuntimeError("An error occurred while generating the dataset") from inner
    except RuntimeError as outer:
        assert _one_line(outer) == "Expected 2 fields in line 42, saw 5"


# ------------------------------------------------------------------ eval, grad-error and --make needle read what train reads


def test_eval_reads_csv_and_json_rows_as_their_text_field(tmp_path, capsys):
    import pandas as pd

    frame = pd.DataFrame({"text": ["alpha, beta gamma " * 30, "delta " * 40], "n": [1, 2]})
    frame.to_csv(tmp_path / "t.csv", index=False)
    (tmp_path / "t.json").write_text(frame.to_json(orient="records"))
    tok = load_tokenizer()
    want = tokenize_documents(load_documents(tmp_path / "t.csv"), tok)
    assert want.tolist() == tokenize_documents(load_documents(tmp_path / "t.json"), tok).tolist()
    for name in ("t.csv", "t.json"):
        capsys.readouterr()
        assert run_cli(["eval", "--data", tmp_path / name, "--seq-len", "16", "--chunk-size", "16",
                        "--page-size", "16"]) == 0
        assert f"{len(want):,} tokens ->" in capsys.readouterr().err


@pytest.mark.parametrize("argv, reader", [(["eval"], "'oomb eval'"), (["grad-error"], "'oomb grad-error'"),
                                          (["data", "--make", "needle"], "'oomb data --make needle'")])
def test_chat_rows_are_refused_by_the_plain_text_commands_saying_what_they_read(tmp_path, capsys, argv, reader):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows(3))
    capsys.readouterr()
    assert run_cli([*argv, "--data", path, "--seq-len", "256", *(["--make-output", tmp_path / "n.jsonl"]
                                                                  if "--make" in argv else [])]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("oomb:")]
    assert len(err) == 1 and f"holds messages rows, but {reader} reads plain text" in err[0], err


# ------------------------------------------------------------------ folders: one format, every file


def test_a_folder_mixing_formats_is_refused_and_subfolders_are_read(tmp_path, capsys):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", [{"text": "some words here " * 20}] * 5)
    (mixed / "b.csv").write_text("text\nhello there\n")
    for command in ("data", "train"):
        refused([command, "--data", mixed, *FAST], capsys, tmp_path,
                "mixes data formats: 1 .json/.jsonl file (e.g. a.jsonl), 1 .csv file (e.g. b.csv)")
    capsys.readouterr()
    assert run_cli(["eval", "--data", mixed, "--seq-len", "16"]) == 2
    assert "mixes data formats" in capsys.readouterr().err
    nested = tmp_path / "nested"
    (nested / "sub").mkdir(parents=True)
    (nested / "top.txt").write_text("top words " * 40)
    (nested / "sub" / "deep.txt").write_text("deep words\n" * 40)
    tok = load_tokenizer()
    data = build_training_data(DataConfig(path=str(nested), seq_len=16), tok)
    assert data.stats.examples == 2  # a document per file, the subfolder's too


@pytest.mark.parametrize("streaming", [False, True])
def test_a_suffix_in_upper_case_is_read_as_its_format(tmp_path, capsys, streaming):
    """PC.JSONL is prompt/completion rows and B.CSV a table, not one plain-text document of raw JSON or CSV;
    a folder's a.TXT, b.CSV and train.JSONL are among its data files, and a bad line of one is named."""
    from oomb.data.sources import open_rows

    pc = write_jsonl(tmp_path / "PC.JSONL", [{"prompt": f"q {i}?", "completion": f"a {i}."} for i in range(20)])
    rows = open_rows(str(pc), streaming=streaming)
    assert not rows.plain and rows.columns == ["prompt", "completion"] and len(list(rows)) == 20
    assert rows.where(1) == f"{pc}:2"  # named by line, as a .jsonl file's rows are
    table = tmp_path / "B.CSV"
    table.write_text("text\n" + "".join(f"row {i}\n" for i in range(10)))
    rows = open_rows(str(table), streaming=streaming)
    assert not rows.plain and rows.table == "csv" and [r["text"] for r in rows][:2] == ["row 0", "row 1"]
    both = tmp_path / "both"
    both.mkdir()
    shutil.copy(table, both / "b.CSV")
    shutil.copy(table, both / "a.csv")
    assert len(list(open_rows(str(both), streaming=streaming))) == 20  # both files, not a.csv alone
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.TXT").write_text("upper")
    (texts / "b.txt").write_text("lower")
    assert [r["text"] for r in open_rows(str(texts))] == ["upper", "lower"]
    splits = tmp_path / "splits"
    splits.mkdir()
    write_jsonl(splits / "train.JSONL", [{"text": "train row"}] * 3)
    write_jsonl(splits / "test.Jsonl", [{"text": "test row"}] * 2)
    assert [r["text"] for r in open_rows(str(splits), "test", streaming)] == ["test row"] * 2
    assert len(list(open_rows(str(splits), "train", streaming))) == 3
    bad = tmp_path / "BAD.JSONL"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    refused(["data", "--data", bad, *(["--streaming"] if streaming else []), *FAST], capsys, tmp_path,
            f"{bad}:2 is not valid JSON")


@pytest.mark.parametrize("streaming", [False, True])
def test_a_split_name_in_upper_case_names_its_split(tmp_path, capsys, streaming):
    """TRAIN.JSONL beside test.jsonl was in no split (datasets matches split names in lower case only): the train
    split was refused as missing; Train/ beside VALID/ read both folders as train, the validation rows trained on.
    Split names are matched in any case, as suffixes are."""
    from oomb.data.sources import open_rows

    files = tmp_path / "files"
    files.mkdir()
    write_jsonl(files / "TRAIN.JSONL", [{"text": "train row " * 20}] * 3)
    write_jsonl(files / "test.jsonl", [{"text": "test row"}] * 2)
    assert [r["text"] for r in open_rows(str(files), "train", streaming)] == ["train row " * 20] * 3
    assert [r["text"] for r in open_rows(str(files), "test", streaming)] == ["test row"] * 2
    folders = tmp_path / "folders"
    for name, rows in (("Train", 4), ("VALID", 5)):
        (folders / name).mkdir(parents=True)
        write_jsonl(folders / name / "part.jsonl", [{"text": f"{name} row"}] * rows)
    assert [r["text"] for r in open_rows(str(folders), "train", streaming)] == ["Train row"] * 4
    assert [r["text"] for r in open_rows(str(folders), "validation", streaming)] == ["VALID row"] * 5
    capsys.readouterr()
    assert run_cli(["data", "--data", files, *FAST, *(["--streaming"] if streaming else []),
                    "--output", tmp_path / "h.png"]) == 0
    assert "3 documents (text)" in next(s for s in capsys.readouterr().out.splitlines() if s.startswith("oomb: data:"))


def test_a_data_file_the_split_names_leave_out_is_refused_naming_it(tmp_path, capsys):
    """Where file names say the splits, a data file named for none (notes.jsonl beside train.jsonl and test.jsonl)
    was left out of every split, silently, as datasets leaves it out."""
    folder = tmp_path / "splits"
    folder.mkdir()
    for name in ("train.jsonl", "test.jsonl", "notes.jsonl"):
        write_jsonl(folder / name, [{"text": f"{name} row " * 5}] * 3)
    refused(["data", "--data", folder, *FAST], capsys, tmp_path,
            f"folder {str(folder)!r} names its splits by file name: train (train.jsonl), test (test.jsonl), but 1 "
            "data file is in none (e.g. notes.jsonl), which would be left out; name each data file for its split, "
            "e.g. train-notes.jsonl, or move the others out of the folder")


def test_a_folder_of_text_files_is_split_by_their_names(tmp_path, capsys):
    """test.txt beside train.txt was read with it as one train split: the test document trained on. A folder of
    .txt files is split by its file and folder names as a folder of JSON Lines is."""
    from oomb.data.sources import open_rows

    folder = tmp_path / "texts"
    (folder / "validation").mkdir(parents=True)
    (folder / "train").mkdir()
    (folder / "train" / "a.txt").write_text("the train document " * 20)
    (folder / "train" / "b.txt").write_text("another train document " * 20)
    (folder / "validation" / "c.txt").write_text("the held-out document " * 20)
    assert [r["text"] for r in open_rows(str(folder), "train")] == ["the train document " * 20,
                                                                    "another train document " * 20]
    assert [r["text"] for r in open_rows(str(folder), "validation")] == ["the held-out document " * 20]
    refused(["data", "--data", folder, "--data-split", "test", *FAST], capsys, tmp_path,
            f"folder {str(folder)!r} has no split 'test' (it has: train, validation); pass --data-split train")
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("emma.txt", "persuasion.txt"):  # no name says a split: one train split of both
        (plain / name).write_text(f"{name} " * 20)
    assert len(list(open_rows(str(plain), "train"))) == 2
    assert run_cli(["data", "--data", folder, *FAST, "--output", tmp_path / "h.png"]) == 0
    assert "2 documents (text)" in next(s for s in capsys.readouterr().out.splitlines() if s.startswith("oomb: data:"))


def test_a_run_folder_or_its_checkpoints_as_data_is_refused_naming_what_it_is(tmp_path, capsys):
    """An oomb train output folder as --data was read as a folder of JSON files (train_args.json, meta.json...), and
    refused with a fix that renamed a checkpoint's files for a split."""
    run = tmp_path / "trained"
    assert run_cli(["train", *FAST, "--steps", "1", "--save-every", "1", "--output-dir", run, "--no-progress"]) == 0
    step = next((run / "checkpoints").glob("step-*"))
    for data, said in ((run, f"data path {str(run)!r} is the output folder of an oomb train run (its train_args.json), "
                             "not data; pass --data the data it trained on (the bundled corpus: leave --data out), or "
                             "pass the folder as --model to train from its model"),
                       (run / "checkpoints", f"data path {str(run / 'checkpoints')!r} holds checkpoints of an oomb "
                                             "train run, not data; pass --data the data the run trained on"),
                       (step, f"data path {str(step)!r} is a checkpoint of an oomb train run, not data")):
        capsys.readouterr()
        refused(["data", "--data", data, *FAST], capsys, tmp_path, said)


def test_a_chat_template_json_file_in_upper_case_is_read_as_json(tmp_path):
    from oomb.data.chat import read_chat_template

    f = tmp_path / "TOKENIZER_CONFIG.JSON"
    f.write_text(json.dumps({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    assert read_chat_template(str(f)).startswith("{% for m in messages %}")


# ------------------------------------------------------------------ settings blamed rightly


def test_a_cache_folder_that_is_a_file_is_named_not_the_data(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("OOMB_CACHE_DIR", str(afile))
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": "some words here " * 20}] * 5)
    for flags in ([], ["--streaming"]):
        line = refused(["data", "--data", path, *flags, *FAST], capsys, tmp_path, f"OOMB_CACHE_DIR {str(afile)!r}")
        assert "cannot read" not in line and "set OOMB_CACHE_DIR to a folder" in line


def test_a_chat_template_that_does_not_compile_is_refused_before_any_row(tmp_path, capsys):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}<|im_start|>{{ m.role } }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows(3))
    line = refused(["data", "--data", path, "--chat-template", bad, *FAST], capsys, tmp_path,
                   f"--chat-template {str(bad)!r} is not a valid Jinja template (line 1: unexpected '}}')")
    assert "row" not in line and "chat.jsonl" not in line


@pytest.mark.parametrize("command", ["data", "train"])
def test_a_chat_template_with_text_rows_is_refused_and_a_missing_one_always(tmp_path, capsys, command):
    """Text rows are not rendered, so a --chat-template with them is refused as --loss-on assistant is; a template
    file that cannot be read is named as such, whatever the rows."""
    import datasets

    csv = tmp_path / "rows.csv"
    datasets.Dataset.from_dict({"text": ["some words here " * 20] * 10}).to_csv(str(csv), index=False)
    line = refused([command, "--data", csv, "--chat-template", PLAIN, *FAST], capsys, tmp_path,
                   f"--chat-template renders messages and prompt/completion rows, but {str(csv)!r} is text")
    assert "leave --chat-template out for text" in line
    missing = tmp_path / "nope.jinja"
    refused([command, "--data", csv, "--chat-template", missing, *FAST], capsys, tmp_path,
            f"cannot read --chat-template {str(missing)!r}")
    chats = write_jsonl(tmp_path / "chat.jsonl", chat_rows(3))
    refused([command, "--data", chats, "--chat-template", missing, *FAST], capsys, tmp_path,
            f"cannot read --chat-template {str(missing)!r}")


@pytest.mark.parametrize("command", ["data", "train"])
def test_a_chat_template_with_segments_rows_is_refused(tmp_path, capsys, command):
    """Segments rows are read as they are, not rendered by a template: a --chat-template with them is refused as
    with text rows (named as the --config file's key where it came from the file), not ignored."""
    seg = write_jsonl(tmp_path / "seg.jsonl", [{"segments": [{"text": "Q: hi ", "label": False},
                                                             {"text": "A: yo", "label": True}]}] * 4)
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}\n")
    line = refused([command, "--data", seg, "--chat-template", template, "--seq-len", "128", "--chunk-size", "32",
                    "--page-size", "16", "--no-progress"], capsys, tmp_path,
                   f"--chat-template renders messages and prompt/completion rows, but {str(seg)!r} holds segments "
                   "rows")
    assert line.endswith("leave --chat-template out for segments rows (their text is read as it is)"), line
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  chat_template: {template}\n")
    refused([command, "--config", config, "--data", seg, *FAST], capsys, tmp_path,
            f"data.chat_template (in {config}) renders messages")


# ------------------------------------------------------------------ rows named as the user counts them


def test_rows_are_named_by_line_in_json_lines_and_from_1_elsewhere(tmp_path, capsys):
    rows = chat_rows(10) + [{"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}]
    path = write_jsonl(tmp_path / "wrongrole.jsonl", rows)
    refused(["data", "--data", path, "--chat-template", PLAIN, *FAST], capsys, tmp_path,
            f"{path}:11: message 0 has the unknown role 'narrator'")
    import pandas as pd

    pd.DataFrame({"text": ["fine words"] * 3 + [None]}).to_parquet(tmp_path / "p.parquet")
    refused(["data", "--data", tmp_path / "p.parquet", *FAST], capsys, tmp_path,
            f"{tmp_path / 'p.parquet'} row 4: 'text' is null")
    null = write_jsonl(tmp_path / "null.jsonl", [{"text": "fine words " * 20}, {"text": None}])
    refused(["data", "--data", null, *FAST], capsys, tmp_path, f"{null}:2: 'text' is null")
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "fine words " * 20}, {"body": "no text"}])
    refused(["data", "--data", mixed, *FAST], capsys, tmp_path, f"{mixed}:2 has no 'text' field (its fields: body)")


def test_a_null_or_empty_field_of_a_table_is_named_as_such_not_as_missing(tmp_path, capsys):
    import datasets
    import pandas as pd

    csv = tmp_path / "rows.csv"
    csv.write_text("id,body\n1,fine words fine words\n2,\n")
    line = refused(["data", "--data", csv, "--text-field", "body", *FAST], capsys, tmp_path,
                   f"{csv} row 2: 'body' is empty")
    assert "has no" not in line and "write a string 'body' in every row" in line
    pd.DataFrame({"id": [1, 2, 3], "body": ["fine words", None, "more"]}).to_parquet(tmp_path / "p.parquet")
    refused(["data", "--data", tmp_path / "p.parquet", "--text-field", "body", *FAST], capsys, tmp_path,
            f"{tmp_path / 'p.parquet'} row 2: 'body' is null")
    folder = tmp_path / "tables"
    folder.mkdir()
    (folder / "a.csv").write_text("text\nfine words\n\"\"\n")
    refused(["data", "--data", folder, *FAST], capsys, tmp_path, f"{folder} row 2: 'text' is empty")
    words = tmp_path / "words.csv"  # words pandas would take for a missing value are text
    words.write_text("text\n" + "NA\nnull\nNone\nNaN\n" * 20)
    assert run_cli(["data", "--data", words, *FAST, "--output", tmp_path / "words.png"]) == 0
    datasets.Dataset.from_dict({"text": ["fine words", None]}).save_to_disk(str(tmp_path / "saved"))
    refused(["data", "--data", tmp_path / "saved", *FAST], capsys, tmp_path, f"{tmp_path / 'saved'} row 2: 'text' is null")


# ------------------------------------------------------------------ what the data lines say


def test_split_chats_say_their_untrained_pieces_were_left_out_not_a_tail(tmp_path, capsys):
    rows = [{"messages": [{"role": "user", "content": "tell me " * (120 if i % 2 else 5)},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(10)]
    path = write_jsonl(tmp_path / "somelong.jsonl", rows)
    assert run_cli(["data", "--data", path, "--chat-template", PLAIN, "--seq-len", "128", "--long-examples", "split",
                    "--output", tmp_path / "h.png"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("oomb: data:"))
    assert "5 examples split over sequences (" in line and "tokens of their pieces without a trained token left out" in line
    assert "tail" not in line


def test_a_streamed_text_sequence_is_a_writable_copy(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"line {i} " * 9} for i in range(50)])
    data = build_training_data(DataConfig(path=str(path), seq_len=16, streaming=True), load_tokenizer())
    assert not data.tokens.flags.writeable  # memory-mapped from the cache
    ids = data[0].input_ids
    assert ids.numpy().flags.writeable and not np.shares_memory(ids.numpy(), data.tokens)


def test_the_sequence_line_has_thousands_separators(tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_text("word " * 2600)
    assert run_cli(["data", "--data", path, "--seq-len", "2", "--seed", "0", "--show-tokens", "4",
                    "--output", tmp_path / "h.png"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("oomb: sequence "))
    first = int(line.split()[2].replace(",", ""))
    assert first >= 1000, line  # a number that needs a separator
    assert line.startswith(f"oomb: sequence {first:,} of 1,"), line


@pytest.mark.parametrize("rows, said, fix", [
    ([{"prompt": "", "completion": ""}], "(1 of 1 dropped: 1 without a trained token)", "a non-empty completion"),
    ([{"prompt": "word " * 200, "completion": "x"}], "(1 of 1 dropped: 1 longer than --seq-len", "--long-examples split"),
    ([{"prompt": "", "completion": ""}, {"prompt": "word " * 200, "completion": "x"}],
     "(2 of 2 dropped: 1 longer than --seq-len 64, 1 without a trained token)", "--long-examples split"),
])
def test_data_with_nothing_to_train_names_why_each_example_was_dropped(tmp_path, capsys, rows, said, fix):
    """A row of an empty prompt and completion (only the EOS, which no earlier token predicts) was reported as
    'longer than --seq-len or without a trained token', with the fix of a too-long row."""
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    line = refused(["data", "--data", path, *FAST], capsys, tmp_path, "is left to train on")
    assert said in line and fix in line, line
    if "longer" not in said:
        assert "--seq-len" not in line, line
