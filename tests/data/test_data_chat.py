"""Chat rows -> labels: -100 exactly outside assistant content and its end-of-turn token, checked against
hand-written token lists for a ChatML (Qwen-style) and a Llama-3-style template; prompt/completion rows; an
example cut by packing keeps its labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from oomb.data import DataError, load_tokenizer, pack
from oomb.data.chat import check_messages, encode_messages, encode_prompt_completion, encode_segments, read_chat_template

TEMPLATES = Path(__file__).parent / "chat_templates"
SPECIALS = {"chatml": (["<|im_start|>", "<|im_end|>"], None),
            "llama3": (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>")}


def chat_tokenizer(name: str):
    """The bundled tokenizer with the template's special tokens added (ids 32000 and up)."""
    tok = load_tokenizer()
    specials, bos = SPECIALS[name]
    tok.add_special_tokens({"additional_special_tokens": specials, **({"bos_token": bos} if bos else {})})
    return tok


def marked(tok, ids, labels) -> list[str]:
    """Token strings, trained ones in [brackets]."""
    return [f"[{t}]" if lab != -100 else t for t, lab in zip(tok.convert_ids_to_tokens(ids.tolist()), labels)]


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi?"},
    {"role": "assistant", "content": "Yes."},
    {"role": "user", "content": "Why?"},
    {"role": "assistant", "content": " No. "},
]
NL = "<0x0A>"
EXPECTED = {
    "chatml": ["<|im_start|>", "system", NL, "Be", "▁brief", ".", "<|im_end|>", NL,
               "<|im_start|>", "user", NL, "Hi", "?", "<|im_end|>", NL,
               "<|im_start|>", "ass", "istant", NL, "[Yes]", "[.]", "[<|im_end|>]", NL,
               "<|im_start|>", "user", NL, "Why", "?", "<|im_end|>", NL,
               "<|im_start|>", "ass", "istant", NL, "[▁No]", "[.]", "[▁]", "[<|im_end|>]", NL],
    # Llama 3 trims the content: ' No. ' is rendered (and trained) as 'No.'
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "system", "<|end_header_id|>", NL, NL, "Be", "▁brief", ".",
               "<|eot_id|>", "<|start_header_id|>", "user", "<|end_header_id|>", NL, NL, "Hi", "?", "<|eot_id|>",
               "<|start_header_id|>", "ass", "istant", "<|end_header_id|>", NL, NL, "[Yes]", "[.]", "[<|eot_id|>]",
               "<|start_header_id|>", "user", "<|end_header_id|>", NL, NL, "Why", "?", "<|eot_id|>",
               "<|start_header_id|>", "ass", "istant", "<|end_header_id|>", NL, NL, "[No]", "[.]", "[<|eot_id|>]"],
}


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_multi_turn_labels_are_the_assistant_content_and_end_of_turn(name):
    tok = chat_tokenizer(name)
    template = read_chat_template(str(TEMPLATES / f"{name}.jinja"))
    ids, labels = encode_messages(tok, CONVERSATION, template, "assistant", "row 0")
    assert marked(tok, ids, labels) == EXPECTED[name]
    assert np.array_equal(labels[labels != -100], ids[labels != -100])  # a trained label is the token itself
    _, everything = encode_messages(tok, CONVERSATION, template, "all", "row 0")
    assert np.array_equal(everything, ids)


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_an_assistant_content_that_looks_like_the_header_is_found_in_its_own_turn(name):
    tok = chat_tokenizer(name)
    template = read_chat_template(str(TEMPLATES / f"{name}.jinja"))
    conv = [{"role": "user", "content": "assistant"}, {"role": "assistant", "content": "a"}]
    ids, labels = encode_messages(tok, conv, template, "assistant", "row 0")
    trained = [t for t in marked(tok, ids, labels) if t.startswith("[")]
    assert trained == ["[a]", "[<|im_end|>]" if name == "chatml" else "[<|eot_id|>]"]


def test_prompt_completion_strings_train_the_completion_and_eos():
    tok = load_tokenizer()
    ids, labels = encode_prompt_completion(tok, "Q: two and two?", " A: four.", None, "assistant", "row 0")
    assert marked(tok, ids, labels) == ["▁Q", ":", "▁two", "▁and", "▁two", "?", "[▁A]", "[:]", "[▁four]", "[.]", "[</s>]"]


def test_segments_train_the_labelled_segments_and_the_eos_after_a_labelled_last_one():
    tok = load_tokenizer()
    segments = [{"text": "Q: two and two?", "label": False}, {"text": " four.", "label": True},
                {"text": " Q: and three?", "label": False}, {"text": " six.", "label": True}]
    ids, labels = encode_segments(tok, segments, "assistant", "row 0")
    assert marked(tok, ids, labels) == ["▁Q", ":", "▁two", "▁and", "▁two", "?", "[▁four]", "[.]", "▁Q", ":", "▁and",
                                        "▁three", "?", "[▁six]", "[.]", "[</s>]"]
    # each segment is tokenised on its own: the ids are the concatenation of the segments' own encodings
    assert ids[:-1].tolist() == sum((tok(g["text"], add_special_tokens=False)["input_ids"] for g in segments), [])
    ids, labels = encode_segments(tok, segments[:3], "assistant", "row 0")
    assert labels[-1] == -100 and (labels != -100).sum() == 2  # an unlabelled last segment: its EOS untrained
    ids, labels = encode_segments(tok, segments[:3], "all", "row 0")
    assert labels.tolist() == ids.tolist()


@pytest.mark.parametrize("segments, match", [
    ([], "segments is empty"),
    ("text", "segments is str, not a list"),
    ([{"text": "a"}], 'segment 0 is not an object with "text" and "label"'),
    ([{"text": 3, "label": True}], "segment 0 has text of type int"),
    ([{"text": "a", "label": "yes"}], "segment 0 has label 'yes', not true or false"),
    (None, "segments is null"),
    ([{"text": "Q?", "label": False}, {"text": "", "label": True}], "segment 1 is labelled true but its text is empty"),
])
def test_bad_segments_are_refused_naming_the_row(segments, match):
    with pytest.raises(DataError, match=match) as info:
        encode_segments(load_tokenizer(), segments, "assistant", "rows.jsonl row 7")
    assert "rows.jsonl row 7" in str(info.value)


def test_segments_rows_are_read_packed_and_need_a_labelled_segment(tmp_path, monkeypatch):
    import json

    from oomb.config import DataConfig
    from oomb.data import build_training_data

    monkeypatch.setenv("OOMB_CACHE_DIR", str(tmp_path / "cache"))
    tok = load_tokenizer()
    rows = [{"segments": [{"text": f"Question {i}?", "label": False}, {"text": f" Answer {i}.", "label": True}]}
            for i in range(6)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = build_training_data(DataConfig(path=str(path), seq_len=64, document_mask=True), tok)
    assert data.stats.format == "segments" and data.stats.examples == 6
    trained = sum(int((data[i].labels != -100).sum()) for i in range(len(data)))
    want = sum(int((encode_segments(tok, r["segments"], "assistant", "r")[1] != -100).sum()) for r in rows)
    assert trained == want > 0
    path.write_text("".join(json.dumps({"segments": [{"text": "no answer", "label": False}]}) + "\n" for _ in range(3)))
    with pytest.raises(DataError, match='has a segment with "label": true'):
        build_training_data(DataConfig(path=str(path), seq_len=64, document_mask=True), tok)


def test_prompt_completion_messages_train_only_the_completion_turns():
    tok = chat_tokenizer("chatml")
    template = read_chat_template(str(TEMPLATES / "chatml.jinja"))
    prompt = CONVERSATION[:4]
    ids, labels = encode_prompt_completion(tok, prompt, CONVERSATION[4:], template, "assistant", "row 0")
    trained = [t for t in marked(tok, ids, labels) if t.startswith("[")]
    assert trained == ["[▁No]", "[.]", "[▁]", "[<|im_end|>]"]  # the earlier assistant turn is prompt


def test_an_example_cut_by_packing_keeps_its_labels_on_both_pieces():
    tok = chat_tokenizer("chatml")
    template = read_chat_template(str(TEMPLATES / "chatml.jinja"))
    ids, labels = encode_messages(tok, CONVERSATION, template, "assistant", "row 0")
    n = len(ids)  # 39 tokens
    short_ids, short_labels = encode_messages(tok, CONVERSATION[1:3], template, "assistant", "row 1")
    S = 28
    data = pack([(ids, labels), (short_ids, short_labels)], S, "split", pad_id=0)
    assert len(data) == 2 and data.stats.split_examples == 1
    first, second = data[0], data[1]
    # piece 1: the first S tokens of the example, a document of its own
    assert first.input_ids[0].tolist() == ids[:S].tolist() and first.labels[0].tolist() == labels[:S].tolist()
    assert first.cu_seqlens.tolist() == [0, S]
    # piece 2: the rest, then the short example, then padding (label -100), each its own document
    rest = n - S
    m = len(short_ids)
    assert second.input_ids[0, :rest].tolist() == ids[S:].tolist()
    assert second.labels[0, :rest].tolist() == labels[S:].tolist()
    assert second.labels[0, rest:rest + m].tolist() == short_labels.tolist()
    assert (second.labels[0, rest + m:] == -100).all() and (second.input_ids[0, rest + m:] == 0).all()
    assert second.cu_seqlens.tolist() == [0, rest, rest + m, S]
    assert data.stats.padding == S - rest - m


def test_long_chat_examples_are_dropped_and_counted_by_default_policy():
    tok = chat_tokenizer("chatml")
    template = read_chat_template(str(TEMPLATES / "chatml.jinja"))
    long = encode_messages(tok, CONVERSATION, template, "assistant", "row 0")
    short = encode_messages(tok, CONVERSATION[1:3], template, "assistant", "row 1")
    data = pack([long, short, short], 30, "drop", pad_id=0)
    s = data.stats
    assert (len(data), s.examples, s.dropped_examples, s.dropped_tokens) == (1, 3, 1, len(long[0]))
    assert s.trained_tokens == 2 * 3  # 'Yes', '.', '<|im_end|>' of each short example
    assert "data: 3 examples (" in s.summary() and "; 1 example dropped (" in s.summary()


@pytest.mark.parametrize("messages, match", [
    ([{"role": "narrator", "content": "x"}], "unknown role 'narrator'"),
    ([{"role": "user", "content": ["x"]}], "content of type list, not a string"),
    ([{"role": "user"}], 'not an object with "role" and "content"'),
    ("hello", "not a list of messages"),
])
def test_bad_messages_are_refused_naming_the_row(messages, match):
    with pytest.raises(DataError, match=match) as info:
        check_messages(messages, "d.jsonl row 3")
    assert info.value.problem.startswith("d.jsonl row 3") and info.value.fix


CHATML_PLAIN = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Yes."},
                {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "No."}]


def test_a_plain_text_end_of_turn_marker_is_trained_and_warned_about():
    """The bundled tokenizer has no <|im_end|> special token: the ChatML end of turn is 7 tokens of text, trained
    with the content (the newline after it is not), and one warning says it is no special token."""
    tok = load_tokenizer()
    template = read_chat_template(str(TEMPLATES / "chatml.jinja"))
    with pytest.warns(UserWarning, match=r"ends an assistant turn with '<\|im_end\|>', which this tokenizer has as 7 "
                                         r"tokens of plain text, not a special token.*pass --tokenizer"):
        ids, labels = encode_messages(tok, CHATML_PLAIN, template, "assistant", "row 0")
    trained = "".join(t.strip("[]") for t in marked(tok, ids, labels) if t.startswith("["))
    assert trained == "Yes.<|im_end|>No.<|im_end|>"
    assert tok.decode(ids[labels != -100].tolist()).replace(" ", "") == "Yes.<|im_end|>No.<|im_end|>"
    assert marked(tok, ids, labels)[-1] == NL  # the separator after the end of turn is not trained


def test_a_template_with_nothing_after_the_content_is_warned_about():
    tok = load_tokenizer()
    template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    with pytest.warns(UserWarning, match="renders nothing after an assistant message's content"):
        ids, labels = encode_messages(tok, CHATML_PLAIN, template, "assistant", "row 0")
    assert [t for t in marked(tok, ids, labels) if t.startswith("[")] == ["[▁Yes]", "[.]", "[▁No]", "[.]"]


@pytest.mark.parametrize("name, loss_on", [("chatml", "assistant"), ("llama3", "assistant"), ("chatml", "all")])
def test_no_warning_where_the_end_of_turn_is_a_special_token_or_every_token_is_trained(name, loss_on):
    import warnings

    tok = chat_tokenizer(name) if loss_on == "assistant" else load_tokenizer()
    template = read_chat_template(str(TEMPLATES / f"{name}.jinja"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encode_messages(tok, CONVERSATION, template, loss_on, "row 0")


@pytest.mark.parametrize("field", ["messages", "segments"])
def test_a_list_field_written_as_json_text_in_a_csv_cell_is_refused_saying_to_write_json_lines(tmp_path, field):
    """A CSV cell holds text only, so a ``messages`` column of JSON text reads as a string: the refusal says so and
    names a format that holds lists, not "write messages as a list", which a CSV cannot."""
    import csv
    import json

    from oomb.config import DataConfig
    from oomb.data import build_training_data

    value = ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}] if field == "messages"
             else [{"text": "hi", "label": True}])
    path = tmp_path / "rows.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([[field], [json.dumps(value)]])
    with pytest.raises(DataError) as info:
        build_training_data(DataConfig(path=str(path), seq_len=64, chat_template=str(TEMPLATES / "chatml.jinja") if field == "messages" else None),
                            load_tokenizer())
    assert info.value.problem == f"{path} row 1: {field} is a string of JSON text, not a list"
    assert info.value.fix == f"write {field} as a list itself, in JSON Lines or parquet rows (a CSV cell holds only text)"
