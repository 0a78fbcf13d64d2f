"""Retrieval prompts: exactly the requested length, the answer at the requested depth (token positions), the same
prompts from the same seed, synthetic training rows, and refusals of bad input."""

from __future__ import annotations

import numpy as np
import pytest

from oomb.data import load_documents, load_tokenizer, tokenize_documents
from oomb.retrieval import (
    build_prompts,
    check_digits,
    needle_prompt,
    passkey_prompt,
    retrieval_rows,
)
from oomb.retrieval.prompts import WORDS


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def novels(tok):
    return tokenize_documents(load_documents(None), tok, cache=True)


def _text(tok, ids) -> str:
    return tok.decode(list(ids))


def _make(kind, tok, novels, length, depth, trial=0, seed=0, needles=1):
    if kind == "passkey":
        return passkey_prompt(tok, length, depth, trial, seed)
    return needle_prompt(tok, novels, length, depth, trial, seed, needles)


@pytest.mark.parametrize("kind", ["passkey", "needle"])
@pytest.mark.parametrize("length", [97, 256, 1000])
def test_a_prompt_is_exactly_as_long_as_asked_and_ends_with_its_answer(tok, novels, kind, length):
    p = _make(kind, tok, novels, length, 50.0)
    assert p.input_ids.shape == (length,) and p.length == length
    answer = _text(tok, p.input_ids[p.answer_start:])
    assert answer.strip() == p.answer and p.answer.isdigit() and len(p.answer) == 5
    question = _text(tok, p.input_ids[p.haystack[1]:p.answer_start])
    asked = "What is the pass key? The pass key is" if kind == "passkey" else "What is the secret "
    assert question.strip().startswith(asked), question
    labels = p.labels
    assert (labels[:p.answer_start] == -100).all() and (labels[p.answer_start:] == p.input_ids[p.answer_start:]).all()


@pytest.mark.parametrize("kind", ["passkey", "needle"])
def test_depth_0_and_100_put_the_needle_at_the_haystacks_start_and_right_before_the_question(tok, novels, kind):
    for depth in (0.0, 100.0):
        p = _make(kind, tok, novels, 300, depth, needles=3 if kind == "needle" else 1)
        start, end = p.haystack
        expected = start if depth == 0 else end - p.needle_length
        assert p.needle_start == expected, (depth, p.needle_start, p.haystack)
        needle = _text(tok, p.input_ids[p.needle_start:p.needle_start + p.needle_length]).strip()
        if kind == "passkey":
            assert needle == f"The pass key is {p.answer}. Remember it. {p.answer} is the pass key."
        else:
            word = _text(tok, p.input_ids[end:p.answer_start]).split("secret ")[1].split("?")[0]
            assert word in WORDS and needle == f"The secret {word} is {p.answer}."
        assert p.depth_reached == depth
    if kind == "passkey":
        intro = _text(tok, p.input_ids[:p.haystack[0]])
        assert intro.startswith("There is an important info hidden")


@pytest.mark.parametrize("kind", ["passkey", "needle"])
@pytest.mark.parametrize("depth", [10.0, 37.5, 90.0])
def test_a_depth_between_lands_at_a_sentence_start_near_it(tok, novels, kind, depth):
    p = _make(kind, tok, novels, 2000, depth)
    assert abs(p.depth_reached - depth) < 5.0, p.depth_reached  # at most about one sentence away
    before = _text(tok, p.input_ids[p.haystack[0]:p.needle_start]).rstrip().rstrip("\"'")
    assert before.endswith((".", "!", "?")), before[-40:]


def test_several_needles_are_distinct_and_all_in_the_haystack(tok, novels):
    p = needle_prompt(tok, novels, 800, 50.0, needles=5)
    hay = _text(tok, p.input_ids[p.haystack[0]:p.haystack[1]])
    found = [w for w in WORDS if f"The secret {w} is " in hay]
    assert len(found) == 5
    values = [hay.split(f"The secret {w} is ")[1][:5] for w in found]
    assert len(set(values)) == 5 and p.answer in values


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others(tok, novels):
    for kind in ("passkey", "needle"):
        grid = build_prompts(kind, tok, [200, 300], [0, 50, 100], trials=2, seed=5, tokens=novels)
        again = build_prompts(kind, tok, [200, 300], [0, 50, 100], trials=2, seed=5, tokens=novels)
        assert len(grid) == 12
        assert all(a.input_ids.equal(b.input_ids) and a.needle_start == b.needle_start for a, b in zip(grid, again))
        # a cell's prompt does not depend on the rest of the grid
        alone = build_prompts(kind, tok, [300], [50], trials=2, seed=5, tokens=novels)
        assert alone[1].input_ids.equal(grid[6 + 2 + 1].input_ids)
        other = build_prompts(kind, tok, [200, 300], [0, 50, 100], trials=2, seed=6, tokens=novels)
        assert [p.answer for p in other] != [p.answer for p in grid]
        # trials of one cell differ
        assert grid[0].answer != grid[1].answer or not grid[0].input_ids.equal(grid[1].input_ids)


def test_a_stream_shorter_than_the_haystack_is_repeated(tok):
    short = np.asarray(tok("It was a fine day. The sun shone. We walked far.", add_special_tokens=False)["input_ids"])
    p = needle_prompt(tok, short, 200, 50.0)
    assert p.input_ids.shape == (200,)


def _digitless_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[EOS]", "The", "the", "is", "pass", "key", "secret", "What", "?", ".", "Remember", "it"]
    words += [f"w{i}" for i in range(300)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]")
    fast.save_pretrained(tmp_path / "nodigits")
    return tmp_path / "nodigits"


def test_bad_input_is_refused(tok, novels, tmp_path):
    with pytest.raises(ValueError, match=r"depth 101 is outside \[0, 100\]"):
        passkey_prompt(tok, 500, 101)
    with pytest.raises(ValueError, match=r"depth -1 is outside"):
        needle_prompt(tok, novels, 500, -1)
    with pytest.raises(ValueError, match=r"length 50 is too short .* pass lengths of \d+ or more"):
        passkey_prompt(tok, 50, 0)
    with pytest.raises(ValueError, match=r"length 20 is too short"):
        needle_prompt(tok, novels, 20, 0, needles=2)
    nodigits = load_tokenizer(_digitless_tokenizer(tmp_path))
    with pytest.raises(ValueError, match="cannot encode the digits"):
        check_digits(nodigits)
    with pytest.raises(ValueError, match="cannot encode the digits"):
        passkey_prompt(nodigits, 500, 0)
    check_digits(tok)
    with pytest.raises(ValueError, match="needs a text token stream"):
        build_prompts("needle", tok, [100], [0])


def test_training_rows_repeat_with_the_seed(tok, novels):
    rows = retrieval_rows("passkey", tok, [300, 500], 6, seed=3)
    assert rows == retrieval_rows("passkey", tok, [300, 500], 6, seed=3)
    assert rows != retrieval_rows("passkey", tok, [300, 500], 6, seed=4)
    assert {r["length"] for r in rows} <= {300, 500} and len({r["depth"] for r in rows}) == 6
    for r in rows:
        assert r["prompt"].endswith("The pass key is") and r["prompt"].count(r["answer"]) == 2
        assert r["completion"] == r["answer"]
    needle = retrieval_rows("needle", tok, [400], 2, seed=0, tokens=novels, needles=3)
    assert all(n["prompt"].count("The secret ") == 4 and n["completion"] == n["answer"] for n in needle)


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_a_row_of_length_L_is_L_tokens_as_training_encodes_it_and_fits_seq_len_L(tok, novels, task, tmp_path,
                                                                                   monkeypatch):
    """The EOS training appends is one of the row's L tokens, so --seq-len L --long-examples drop keeps every row
    (as docs/cli.md's --make-lengths 8192 32768 with --seq-len 32768 needs)."""
    from oomb.config import DataConfig
    from oomb.data import build_training_data
    from oomb.data.chat import encode_prompt_completion
    from oomb.retrieval import write_retrieval_jsonl

    monkeypatch.setenv("OOMB_CACHE_DIR", str(tmp_path / "cache"))
    rows = retrieval_rows(task, tok, [128, 256, 4000], 24, seed=5, tokens=novels, needles=3)
    for r in rows:
        ids, _ = encode_prompt_completion(tok, r["prompt"], r["completion"], None, "assistant", "row")
        assert len(ids) == r["length"] and ids[-1] == tok.eos_token_id
    path = write_retrieval_jsonl(tmp_path / "rows.jsonl", rows)
    for seq_len in (256, 4000):
        data = build_training_data(DataConfig(path=str(path), seq_len=seq_len, document_mask=True,
                                              long_examples="drop"), tok)
        fit = sum(r["length"] <= seq_len for r in rows)
        assert data.stats.examples - data.stats.dropped_examples == fit
    assert {r["length"] for r in rows} == {128, 256, 4000}


def test_a_needle_row_keeps_the_eos_between_the_texts_documents(tok):
    """A haystack that crosses a document boundary of the text holds its EOS as text, which encodes back to it."""
    from oomb.data.chat import encode_prompt_completion

    stream = np.asarray(tok("One day. Then it rained. Then it did not.", add_special_tokens=False)["input_ids"]
                        + [tok.eos_token_id], dtype=np.int64)
    rows = retrieval_rows("needle", tok, [300], 3, seed=0, tokens=stream)  # the stream repeated: EOS in every row
    for r in rows:
        ids, _ = encode_prompt_completion(tok, r["prompt"], r["completion"], None, "assistant", "row")
        assert len(ids) == 300 and (ids[:-1] == tok.eos_token_id).sum() == r["prompt"].count(tok.eos_token) > 0


def test_a_length_too_short_for_the_prompt_and_its_eos_is_refused_naming_the_shortest(tok):
    with pytest.raises(ValueError, match=r"question, answer and EOS take (\d+) tokens") as info:
        retrieval_rows("passkey", tok, [20], 1)
    need = int(info.value.args[0].split("EOS take ")[1].split()[0])
    assert f"pass lengths of {need + 1} or more" in str(info.value)
    assert len(retrieval_rows("passkey", tok, [need + 1], 1)) == 1


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_training_rows_encode_to_the_scored_prompt_with_only_the_answer_trained(tok, novels, task):
    """What oomb train trains on a row is the prompt oomb eval scores (BOS aside), with the answer and EOS trained
    and nothing else."""
    from oomb.data.chat import IGNORE_INDEX, encode_prompt_completion
    from oomb.retrieval.prompts import _bos
    from oomb.retrieval.synthetic import _RETRY_STRIDE, _TRIAL_BASE, _TRIES

    rows = retrieval_rows(task, tok, [160, 300, 700], 5, seed=2, tokens=novels, needles=2)
    for i, row in enumerate(rows):
        ids, labels = encode_prompt_completion(tok, row["prompt"], row["completion"], None, "assistant", "row")
        # the scored prompt of the row's length less its EOS (plus a BOS the row leaves out), of the first draw
        # whose haystack re-encodes to it
        for k in range(_TRIES):
            size = row["length"] - 1 + len(_bos(tok))
            trial = _TRIAL_BASE + i + k * _RETRY_STRIDE
            scored = (passkey_prompt(tok, size, row["depth"], trial, 2) if task == "passkey" else
                      needle_prompt(tok, novels, size, row["depth"], trial, 2, 2))
            bos = len(_bos(tok))
            want = scored.input_ids[bos:].tolist() + [tok.eos_token_id]
            # the novel's text may re-encode differently where the haystack cuts into a word; the rest is exact
            tail = len(want) if task == "passkey" else len(want) - (scored.needle_start - bos)
            if ids[-tail:].tolist() == want[-tail:]:
                break
        else:
            raise AssertionError(f"row {i} is no scored prompt")
        assert len(ids) == len(want) == row["length"]
        assert task == "needle" or k == 0  # the passkey filler always re-encodes as it is
        start = len(ids) - (len(want) - (scored.answer_start - bos))
        assert (labels[:start] == IGNORE_INDEX).all() and labels[start:].tolist() == ids[start:].tolist()
        assert tok.decode(ids[start:-1].tolist()).strip() == row["answer"]

def test_a_keyvalue_row_asks_every_key_and_trains_exactly_its_answers(tok, tmp_path, monkeypatch):
    """A keyvalue row is L tokens as training encodes it; its trained tokens are the answers of every question
    (and the EOS), each the value its key was given in the context; the pass key is asked in the passkey
    evaluation's words, at the depth asked; the same seed gives the same rows; it packs with --seq-len L."""
    import re

    from oomb.config import DataConfig
    from oomb.data import build_training_data
    from oomb.data.chat import IGNORE_INDEX, encode_segments
    from oomb.retrieval import write_retrieval_jsonl

    rows = retrieval_rows("keyvalue", tok, [400, 900], 6, seed=4, needles=5)
    assert rows == retrieval_rows("keyvalue", tok, [400, 900], 6, seed=4, needles=5)
    assert rows != retrieval_rows("keyvalue", tok, [400, 900], 6, seed=5, needles=5)
    for r in rows:
        ids, labels = encode_segments(tok, r["segments"], "assistant", "row")
        assert len(ids) == r["length"] and ids[-1] == tok.eos_token_id and labels[-1] == tok.eos_token_id
        context = r["segments"][0]["text"]
        given = dict(re.findall(r"The secret (\w+) is (\d+)\.", context))
        assert len(given) == 5 and context.count(f"The pass key is {r['answer']}. Remember it.") == 1
        assert sorted(r["answers"]) == sorted([r["answer"], *given.values()])
        questions = [g["text"] for g in r["segments"][0::2]]
        answers = [g["text"].strip() for g in r["segments"][1::2]]
        assert all(not g["label"] for g in r["segments"][0::2]) and all(g["label"] for g in r["segments"][1::2])
        for q, a in zip(questions, answers):
            key = re.search(r"What is the (pass key|secret (\w+))\? The \1 is$", q)
            assert key, q
            assert a == (r["answer"] if key.group(2) is None else given[key.group(2)])
        assert len(answers) == 6
        # exactly the answers' tokens (and the EOS) are trained
        trained = np.flatnonzero(labels != IGNORE_INDEX)
        assert tok.decode(ids[trained[:-1]].tolist()).replace(" ", "") == "".join(answers)
    # depth: the pass key at 0% opens the haystack, at 100% it is the haystack's last sentence but the secrets
    from oomb.retrieval.synthetic import _keyvalue_row  # rows draw their depth; the builder takes one

    for depth, where in ((0.0, "start"), (100.0, "end")):
        row = _keyvalue_row(tok, 600, depth, 0, 1, 1)
        context = row["segments"][0]["text"]
        hay = context.split("I will quiz you about the important information there.")[1]
        hay = re.sub(r" The secret \w+ is \d+\.", "", hay)
        if where == "start":
            assert hay.lstrip().startswith(f"The pass key is {row['answer']}.")
        else:
            assert hay.split(" What is the")[0].rstrip().endswith(f"{row['answer']} is the pass key.")
    monkeypatch.setenv("OOMB_CACHE_DIR", str(tmp_path / "cache"))
    path = write_retrieval_jsonl(tmp_path / "kv.jsonl", rows)
    data = build_training_data(DataConfig(path=str(path), seq_len=900, document_mask=True, long_examples="drop"), tok)
    assert data.stats.format == "segments" and data.stats.examples == 6 and data.stats.dropped_examples == 0


def test_a_keyvalue_row_too_short_or_with_too_many_needles_is_refused(tok):
    with pytest.raises(ValueError, match=r"pass lengths of (\d+) or more, or fewer needles") as info:
        retrieval_rows("keyvalue", tok, [100], 1, needles=5)
    assert "its intro, pass key and 5 secret sentences," in info.value.args[0]
    with pytest.raises(ValueError, match="its intro, pass key and 1 secret sentence,"):
        retrieval_rows("keyvalue", tok, [40], 1, needles=1)
    need = int(info.value.args[0].split("pass lengths of ")[1].split()[0])
    assert len(retrieval_rows("keyvalue", tok, [need], 1, needles=5)) == 1
    with pytest.raises(ValueError, match="pass 0 to 30 secret sentences"):
        retrieval_rows("keyvalue", tok, [1000], 1, needles=31)


def test_a_keyvalue_row_without_secrets_is_the_passkey_rows_tokens_as_segments(tok):
    """needles=0: the passkey prompt and its answer, the same tokens and trained tokens as a passkey row would
    have for that draw (a passkey prompt of L - 1 tokens then EOS)."""
    from oomb.data.chat import encode_segments
    from oomb.retrieval.synthetic import _TRIAL_BASE

    for r in retrieval_rows("keyvalue", tok, [300, 700], 4, seed=3, needles=0):
        ids, labels = encode_segments(tok, r["segments"], "assistant", "row")
        assert len(r["segments"]) == 2 and r["answers"] == [r["answer"]]
        prompt = passkey_prompt(tok, r["length"] - 1, r["depth"], _TRIAL_BASE, 0)  # its layout, any value
        assert len(ids) == r["length"] and int((labels != -100).sum()) == len(ids) - prompt.answer_start
        assert tok.decode(ids[:prompt.answer_start].tolist()).replace(r["answer"], "V") == \
            tok.decode(prompt.input_ids[:prompt.answer_start].tolist()).replace(prompt.answer, "V")
