"""Loading text files, folders and JSON Lines into one token stream cut into sequences."""

from __future__ import annotations

import json

import numpy as np
import pytest

from oomb.data import (
    BUNDLED_CORPUS,
    BUNDLED_TOKENIZER,
    DataError,
    TokenSequences,
    load_documents,
    load_tokenizer,
    tokenize_documents,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_bundled_corpus_and_tokenizer_ship_with_their_licences():
    names = sorted(p.name for p in BUNDLED_CORPUS.iterdir())
    assert "COPYRIGHT.packaging" in names and len([n for n in names if n.endswith(".txt")]) == 6
    assert (BUNDLED_TOKENIZER / "LICENSE").is_file() and (BUNDLED_TOKENIZER / "tokenizer.json").is_file()
    docs = load_documents()
    assert [d.source.rsplit("/", 1)[-1] for d in docs] == sorted(n for n in names if n.endswith(".txt"))


def test_bundled_tokenizer_is_local_and_has_eos(tokenizer):
    assert len(tokenizer) == 32000 and tokenizer.eos_token_id == 2


def test_text_file(tmp_path):
    f = tmp_path / "a.md"
    f.write_text("Hello there.\n")
    docs = load_documents(f)
    assert [d.text for d in docs] == ["Hello there.\n"]


def test_folder_reads_every_txt_file_recursively_one_document_each_and_skips_other_files(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "README.md").write_text("not data")
    (tmp_path / ".hidden.txt").write_text("hidden")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.txt").write_text("in a subfolder\nits second line")
    docs = load_documents(tmp_path)
    assert [d.text for d in docs] == ["first", "second", "in a subfolder\nits second line"]
    assert docs[2].source == str(tmp_path / "sub" / "x.txt")
    only_sub = tmp_path / "only"
    (only_sub / "deep").mkdir(parents=True)
    (only_sub / "deep" / "y.txt").write_text("line one\nline two\n")
    assert [d.text for d in load_documents(only_sub)] == ["line one\nline two\n"]  # one document, not one per line


@pytest.mark.parametrize("files, said", [
    ({"a.jsonl": json.dumps({"text": "x"}) + "\n", "b.csv": "text\nx\n"},
     "mixes data formats: 1 .json/.jsonl file (e.g. a.jsonl), 1 .csv file (e.g. b.csv)"),
    ({"a.txt": "x", "b.json": json.dumps([{"text": "x"}])},
     "mixes data formats: 1 .txt file (e.g. a.txt), 1 .json/.jsonl file (e.g. b.json)"),
    ({"a.txt": "x", "sub/c.jsonl": json.dumps({"text": "x"}) + "\n"}, "1 .json/.jsonl file (e.g. sub/c.jsonl)"),
])
def test_a_folder_of_several_formats_is_refused_listing_them(tmp_path, files, said):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match="mixes data formats") as info:
        load_documents(tmp_path)
    assert said in info.value.problem and "one format" in info.value.fix


def test_a_folder_of_jsonl_files_reads_its_subfolders_too(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "top"}) + "\n")
    (tmp_path / "sub" / "b.jsonl").write_text(json.dumps({"text": "deep"}) + "\n")
    assert sorted(d.text for d in load_documents(tmp_path)) == ["deep", "top"]


@pytest.mark.parametrize("name", ["rows.csv", "rows.json", "rows.parquet"])
def test_documents_of_csv_json_and_parquet_rows_are_their_text_fields(tmp_path, name):
    import pandas as pd

    frame = pd.DataFrame({"text": ["first row, with a comma", "second"], "n": [1, 2]})
    path = tmp_path / name
    {"csv": lambda: frame.to_csv(path, index=False), "parquet": lambda: frame.to_parquet(path),
     "json": lambda: path.write_text(frame.to_json(orient="records"))}[name.split(".")[1]]()
    docs = load_documents(path)
    assert [d.text for d in docs] == ["first row, with a comma", "second"]
    assert docs[1].source == f"{path} row 2"


@pytest.mark.parametrize("folder", [False, True])
def test_a_csv_whose_first_row_has_more_fields_than_its_header_is_refused_naming_it(tmp_path, folder):
    (tmp_path / "a.csv").write_text('text,source\n"one, two",web\n')
    bad = tmp_path / "b.csv"
    bad.write_text("text,source\n\n" + "Dear Sir, the weather is fine,web\n" * 3)
    with pytest.raises(DataError) as info:
        load_documents(tmp_path if folder else bad)
    assert info.value.problem == f"{bad}:3 has 3 fields but the header line has 2 (text, source)"
    assert "quote a field that holds a comma" in info.value.fix


def test_csv_rows_shorter_than_the_header_keep_every_field_in_its_column(tmp_path):
    path = tmp_path / "short.csv"
    path.write_text("text,source\nonly text\nmore text,web\n")
    assert [d.text for d in load_documents(path)] == ["only text", "more text"]


def test_documents_of_chat_rows_are_refused_saying_what_is_read(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError) as info:
        load_documents(path, reader="'oomb eval'")
    assert "holds messages rows, but 'oomb eval' reads plain text" in info.value.problem
    assert ".txt files" in info.value.fix


def test_jsonl_one_document_per_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "one", "id": 1}) + "\n\n" + json.dumps({"text": "two"}) + "\n" + json.dumps({"text": "  "}) + "\n")
    docs = load_documents(f)
    assert [d.text for d in docs] == ["one", "two"]
    assert docs[1].source.endswith("d.jsonl:3")


@pytest.mark.parametrize(
    "content, match",
    [("{not json}\n", "bad.jsonl:1 is not valid JSON"), (json.dumps({"body": "x"}) + "\n", "has no 'text' field"),
     ("[1, 2]\n", "bad.jsonl:1"),
     (json.dumps({"text": "x"}) + "\n\n" + json.dumps({"body": "y"}) + "\n", "bad.jsonl:3 has no 'text' field")],
)
def test_bad_jsonl(tmp_path, content, match):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(DataError, match=match) as info:
        load_documents(f)
    assert "bad.jsonl" in info.value.problem and info.value.fix


@pytest.mark.parametrize("content, said", [
    ("[1,2,3]\n", "rows.json row 1 is the number 1, but the rows must be JSON objects"),
    ('[\n  "one",\n  "two"\n]\n', 'rows.json row 1 is the string "one", but the rows must be JSON objects'),
    ('[{"text": "one"}, [2]]', "rows.json row 2 is the array [2], but the rows must be JSON objects"),
    ('"one"', 'rows.json is the string "one", but it must hold rows that are JSON objects'),
])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_json_file_whose_rows_are_not_objects_is_refused_saying_what_a_row_is(tmp_path, content, said, streaming):
    from oomb.data.sources import open_rows

    path = tmp_path / "rows.json"
    path.write_text(content)
    with pytest.raises(DataError) as info:
        open_rows(str(path), streaming=streaming)
    assert info.value.problem == f"{tmp_path}/{said}"
    assert '{"text": "..."}, {"messages": [...]} or {"prompt": "...", "completion": "..."}' in info.value.fix


def test_missing_and_empty_data(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_documents(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="holds no data file"):
        load_documents(tmp_path)
    (tmp_path / "blank.txt").write_text(" \n\n\t")
    with pytest.raises(DataError, match="empty"):
        load_documents(tmp_path)


def test_non_utf8_file(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        load_documents(f)


def test_missing_tokenizer(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(DataError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)


def test_eos_between_documents_only(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("Emma Woodhouse")
    (tmp_path / "b.txt").write_text("Mr. Knightley")
    docs = load_documents(tmp_path)
    tokens = tokenize_documents(docs, tokenizer)
    a = tokenizer("Emma Woodhouse", add_special_tokens=False)["input_ids"]
    b = tokenizer("Mr. Knightley", add_special_tokens=False)["input_ids"]
    assert tokens.dtype == np.int64
    assert tokens.tolist() == a + [tokenizer.eos_token_id] + b


def test_token_cache_round_trip(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("OOMB_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("It is a truth universally acknowledged")
    docs = load_documents(tmp_path / "a.txt")
    first = tokenize_documents(docs, tokenizer, cache=True)
    assert len(list((tmp_path / "cache").glob("tokens-*.npy"))) == 1
    again = tokenize_documents(docs, tokenizer, cache=True)
    np.testing.assert_array_equal(first, again)
    (tmp_path / "a.txt").write_text("It is a truth universally acknowledged, that")
    changed = tokenize_documents(load_documents(tmp_path / "a.txt"), tokenizer, cache=True)
    assert len(changed) > len(first)  # a changed text is a new cache entry, not a stale hit


def test_sequences_cut_and_order():
    tokens = np.arange(103, dtype=np.int64)
    seqs = TokenSequences(tokens, seq_len=10, seed=7)
    assert len(seqs) == 10  # tail of 3 tokens dropped
    assert seqs[3].tolist() == [list(range(30, 40))]
    served = [int(s[0, 0]) // 10 for s in seqs.batches(25)]
    assert sorted(served[:10]) == list(range(10)) and sorted(served[10:20]) == list(range(10))
    assert served[:10] != served[10:20]  # a new order each epoch
    again = [int(s[0, 0]) // 10 for s in TokenSequences(tokens, 10, seed=7).batches(25)]
    assert served == again
    other = [int(s[0, 0]) // 10 for s in TokenSequences(tokens, 10, seed=8).batches(10)]
    assert other != served[:10]


def test_sequences_too_short_say_how_many_tokens():
    with pytest.raises(DataError, match="only 1 token"):
        TokenSequences(np.array([5]), seq_len=2)
    with pytest.raises(DataError, match="has 50 tokens, fewer than --seq-len 64") as info:
        TokenSequences(np.arange(50), seq_len=64)
    assert "--seq-len 50" in info.value.fix
    with pytest.raises(DataError, match="at least 2"):
        TokenSequences(np.arange(50), seq_len=1)


def test_tokenizer_saved_beside_a_qwen2_config_loads_as_it_was_saved(tmp_path, tokenizer):
    """An oomb output folder (config.json of a qwen2 model + the tokenizer) gives back the same tokenization."""
    from oomb.models.presets import preset_config

    tokenizer.save_pretrained(str(tmp_path))
    preset_config("tiny").save_pretrained(str(tmp_path))  # model_type qwen2, as `oomb train` writes
    again = load_tokenizer(tmp_path)
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    assert type(again).__name__ == type(tokenizer).__name__
    assert again.tokenize(text) == tokenizer.tokenize(text)
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_each_load_of_a_folder_is_a_tokenizer_of_its_own(tmp_path):
    """A folder is read once per process, but every load returns a new tokenizer: what one caller changes (a chat
    template, added tokens) is not in another's; a folder whose files change is read again."""
    first = load_tokenizer()
    first.chat_template = "{{ messages }}"
    first.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    second = load_tokenizer()
    assert second is not first and second.backend_tokenizer is not first.backend_tokenizer
    assert second.chat_template is None and len(second) == 32000 and len(first) == 32001
    assert second("<|im_start|>hi")["input_ids"] != first("<|im_start|>hi")["input_ids"]

    load_tokenizer().save_pretrained(str(tmp_path))
    assert len(load_tokenizer(tmp_path)) == 32000
    first.save_pretrained(str(tmp_path))  # the folder now holds the changed tokenizer
    again = load_tokenizer(tmp_path)
    assert len(again) == 32001 and again.chat_template == "{{ messages }}"


def test_a_tokenizer_path_that_is_a_file_is_named_as_such(tmp_path):
    f = tmp_path / "tokenizer.txt"
    f.write_text("not a folder")
    with pytest.raises(DataError, match="is a file, not a folder"):
        load_tokenizer(str(f))


@pytest.mark.parametrize("second, said", [
    ({"text": "two", "id": 7}, "b.jsonl: id, text"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "b.jsonl: messages"),
])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_folder_whose_files_have_different_fields_is_refused_naming_two_of_them(tmp_path, second, said, streaming):
    from oomb.data.sources import open_rows

    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(second) + "\n")
    with pytest.raises(DataError) as info:
        list(open_rows(str(tmp_path), streaming=streaming))
    assert info.value.problem == (f"folder {str(tmp_path)!r} holds files with different fields (a.jsonl: text; "
                                  f"{said}), which are read as one table")
    assert "same fields" in info.value.fix


def test_a_folder_whose_files_hold_a_field_as_different_kinds_is_refused_naming_it(tmp_path):
    from oomb.data.sources import open_rows

    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one", "id": 1}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "two", "id": "x"}) + "\n")
    with pytest.raises(DataError) as info:
        list(open_rows(str(tmp_path)))
    assert info.value.problem == (f"folder {str(tmp_path)!r} holds the field 'id' as a number in a.jsonl but as a "
                                  "string in b.jsonl, and its files are read as one table")


def test_a_pipe_as_data_is_refused_saying_what_to_pass(tmp_path):
    """A named pipe or process substitution (``--data <(zcat rows.jsonl.gz)``), which is read once and has no file
    name to read rows by, is refused naming it; it was "cannot read '/dev/fd/63' ('')"."""
    import os

    from oomb.data.sources import open_rows

    pipe = tmp_path / "rows.jsonl"
    os.mkfifo(pipe)
    with pytest.raises(DataError) as info:
        open_rows(str(pipe))
    assert info.value.problem.startswith(f"data path {str(pipe)!r} is not a file or folder but a pipe, device or socket")
    assert "write the data to a file" in info.value.fix
