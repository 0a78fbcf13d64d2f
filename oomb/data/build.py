"""The training data of a :class:`oomb.config.DataConfig`: rows -> examples -> sequences, one code path for
``oomb train`` and ``oomb data``.

* text rows (the bundled corpus, text files, a ``text_field``): one token stream, EOS between documents, cut
  into consecutive ``seq_len`` sequences (:class:`~oomb.data.sequences.TextSequences`, documents split at EOS
  with ``document_mask``); with ``long_examples="drop"`` each document (and its EOS) is an example packed as
  chat examples are;
* ``messages``, ``prompt``/``completion`` and ``segments`` rows: each row an example with its own labels
  (:mod:`oomb.data.chat`), packed with per-example bounds (:mod:`oomb.data.packing`).

With ``streaming`` the rows are read one by one and the result is written in shards to the cache folder
(``cache_dir()/packed/KEY``, KEY a hash of the data files, the tokenizer and the options), so a corpus larger
than RAM is tokenised once and memory-mapped after.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np

from .chat import encode_messages, encode_prompt_completion, encode_segments, encode_text, read_chat_template
from .errors import DataError
from .packing import PackedSequences, Packer
from .sequences import TextSequences
from .sources import Rows, data_fingerprint, open_rows
from .text import BUNDLED_CORPUS, Document, cache_dir, cache_folder, tokenize_documents
from .tokenizer import tokenizer_digest

__all__ = ["build_training_data", "detect_format", "load_documents"]

_FORMATS = ("messages", "prompt-completion", "segments", "text")

_UNRENDERED = {"text": ("is text", "text (it is read as it is)"),
               "segments": ("holds segments rows, whose text is not rendered by a template",
                            "segments rows (their text is read as it is)")}
"""The formats a chat template does not render: what the rows are, and what they are read as (its refusal's
words)."""


def detect_format(fmt: str, columns: list[str], text_field: str, name: str) -> str:
    """The row format: ``fmt`` unless "auto", else the first of messages, prompt-completion, segments, text
    whose fields the rows have. A ``text_field`` other than ``text`` is one the user named: with "auto" the rows
    must have it and be text rows (else they would be read in another format, the field named for nothing).

    Raises:
        DataError: the rows lack the fields of the format, or the named ``text_field`` (naming the fields they
            have), or they have it and are rows of another format (its setting: ``text_field``).
    """
    need = {"messages": ["messages"], "prompt-completion": ["prompt", "completion"], "segments": ["segments"],
            "text": [text_field]}
    found = ", ".join(columns) or "none"
    if fmt == "auto" and text_field != "text":
        other = next((f for f in _FORMATS[:-1] if all(c in columns for c in need[f])), None)
        if text_field not in columns:
            read = f", or leave --text-field out to read these {other} rows" if other else ""
            raise DataError(f"{name} has no {text_field!r} field, which --text-field names (its fields: {found})",
                            f"pass --text-field the field that holds the text{read}")
        if other is not None:  # read in the format preferred to text, the named field would be ignored
            raise DataError(f"{{text_field}} {text_field!r} names the field of text rows, but {name} holds {other} "
                            f"rows, which are not read from it (its fields: {found})",
                            f"pass --data-format text to read the {text_field!r} field as plain text, or leave "
                            f"{{text_field}} out to read the {other} rows", setting="text_field")
    if fmt != "auto":
        missing = [c for c in need[fmt] if c not in columns]
        if missing:
            raise DataError(f"{name} has no {' and '.join(repr(m) for m in missing)} field for --data-format {fmt} "
                            f"(its fields: {found})", "pass the --data-format of these rows, or --text-field NAME")
        return fmt
    for f in _FORMATS:
        if all(c in columns for c in need[f]):
            return f
    raise DataError(f"{name} has none of the fields messages, prompt and completion, segments, or {text_field!r} "
                    f"(its fields: {found})", "pass --text-field NAME for the field that holds the text, or rows "
                    "with messages, prompt/completion or segments")


def _fields(fmt: str, text_field: str) -> tuple[str, ...]:
    return {"messages": ("messages",), "prompt-completion": ("prompt", "completion"), "segments": ("segments",),
            "text": (text_field,)}[fmt]


def _refuse_mixed(rows: Rows, fmt: str, text_field: str, i: int, row: dict) -> None:
    """Raise the DataError of rows that mix formats where row ``i`` (``row``) lacks the fields of ``fmt`` and has
    those of another format (JSON Lines of several formats read as one table: each row holds its own fields, the
    others None)."""
    if all(row.get(f) is not None for f in _fields(fmt, text_field)):
        return
    other = next((k for k in _FORMATS if k != fmt and all(row.get(f) is not None for f in _fields(k, text_field))),
                 None)
    if other is None:
        return
    first = next((j for j, r in enumerate(rows) if all(r.get(f) is not None for f in _fields(fmt, text_field))), None)
    if first is None:
        return
    (a, fa), (b, fb) = sorted([(first, fmt), (i, other)])
    raise DataError(f"{rows.name!r} mixes row formats: {rows.number(a)} is a {fa} row, {rows.number(b)} a {fb} row",
                    f"the rows of one --data are read in one format: put the {fa} rows and the {fb} rows in files of "
                    "their own and train on one, or write all rows in one format")


def _not_a_string(rows: Rows, i: int, row: dict, field: str, flag: bool = True) -> DataError:
    """The DataError of row ``i`` whose ``field`` is no string: missing (a JSON row without it reads as None) or
    of another type; ``flag``: the command has --text-field."""
    other = ", or pass --text-field NAME" if flag else ""
    if rows.written_null(i, row, field):
        if rows.table == "csv":  # an empty cell
            return DataError(f"{rows.where(i)}: {field!r} is empty", f"write a string {field!r} in every row{other}")
        return DataError(f"{rows.where(i)}: {field!r} is null", f"write a string {field!r} in every row{other}")
    if row.get(field) is None:
        has = ", ".join(k for k, v in row.items() if v is not None) or "none"
        return DataError(f"{rows.where(i)} has no {field!r} field (its fields: {has})",
                         f"write a string {field!r} in every row{other}")
    return DataError(f"{rows.where(i)}: {field!r} is {type(row[field]).__name__}, not a string",
                     f"write each row's {field!r} as a string{other}")


def _refuse_field_of_plain_text(rows: Rows, text_field: str, path) -> None:
    """Refuse a ``text_field`` other than ``text`` for plain-text rows (``rows.plain``: a text file, a folder of
    .txt files, the bundled corpus at ``path`` None), which have no fields to name: their one column is ``text``,
    and any other name would be ignored. (``text`` is also the default: naming it changes nothing.)

    Raises:
        DataError: ``text_field`` is not ``text`` (its setting: ``text_field``).
    """
    if not rows.plain or text_field == "text":
        return
    shown = "the bundled corpus" if path is None else repr(rows.name)
    raise DataError(f"{{text_field}} {text_field!r} names a field, but {shown} is plain text, which has no fields",
                    "leave {text_field} out, or pass json/jsonl, parquet, csv or arrow rows with a "
                    f"{text_field!r} field", setting="text_field")


def _texts(rows: Rows, field: str):
    for i, row in enumerate(rows):
        _refuse_mixed(rows, "text", field, i, row)
        text = row.get(field)
        if not isinstance(text, str):
            raise _not_a_string(rows, i, row, field)
        if text.strip():
            yield text


def load_documents(path: str | os.PathLike | None = None, text_field: str = "text", split: str = "train",
                   reader: str = "this command") -> list[Document]:
    """The plain-text documents of the data at ``path`` (None: the bundled corpus), read as ``oomb train`` reads
    text (:func:`~oomb.data.sources.open_rows`): a text file or each ``.txt`` file of a folder is one document,
    a row's ``text_field`` of json/jsonl, parquet, csv or arrow rows is one (``source``: ``file:line`` of a JSON
    Lines file, else ``NAME row N``). Blank documents are dropped. ``reader`` names the command for messages.

    Raises:
        DataError: what :func:`open_rows` refuses; a ``text_field`` other than ``text`` for plain text, which has
            no fields; rows without ``text_field`` (chat rows: naming what they are), a row whose field is not a
            string, or no non-blank text.
    """
    rows = open_rows(None if path is None else str(path), split)
    _refuse_field_of_plain_text(rows, text_field, path)
    if rows.plain:
        return [Document(rows.where(i), r["text"]) for i, r in enumerate(rows)]
    if text_field not in rows.columns:
        fix = f"pass --data .txt files, or json/jsonl, parquet, csv or arrow rows with a {text_field!r} field"
        try:
            fmt = detect_format("auto", rows.columns, text_field, repr(rows.name))
        except DataError:
            raise DataError(f"{rows.name!r} has no {text_field!r} field, which {reader} reads (its fields: "
                            f"{', '.join(rows.columns) or 'none'})", fix) from None
        raise DataError(f"{rows.name!r} holds {fmt} rows, but {reader} reads plain text (the {text_field!r} field "
                        "of each row, or .txt files)", fix)
    docs = []
    for i, row in enumerate(rows):
        _refuse_mixed(rows, "text", text_field, i, row)
        text = row.get(text_field)
        if not isinstance(text, str):
            raise _not_a_string(rows, i, row, text_field, flag=False)
        if text.strip():
            docs.append(Document(rows.where(i), text))
    if not docs:
        raise DataError(f"data {rows.name!r} is empty (no non-blank text)", "give it some text to read")
    return docs


def _key(cfg, tokenizer, template: str | None) -> str:
    h = hashlib.sha256(b"oomb-packed-v2\0")
    h.update(data_fingerprint(cfg.path).encode())
    h.update(tokenizer_digest(tokenizer))
    opts = dict(split=cfg.split, format=cfg.format, text_field=cfg.text_field, template=template,
                loss_on=cfg.loss_on, long_examples=cfg.long_examples, seq_len=cfg.seq_len)
    h.update(json.dumps(opts, sort_keys=True).encode())
    return h.hexdigest()[:32]


class _CacheFolder:
    """A cache entry written into a temporary folder beside it and renamed into place when complete."""

    def __init__(self, key: str) -> None:
        self.final = cache_dir() / "packed" / key
        self.tmp = self.final.with_name(f"{key}.tmp{os.getpid()}")

    def __enter__(self) -> Path:
        cache_folder("packed")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        shutil.rmtree(self.final, ignore_errors=True)
        os.replace(self.tmp, self.final)


def _text_stream(cfg, rows: Rows, tokenizer, seed: int) -> TextSequences:
    eos = tokenizer.eos_token_id if cfg.document_mask else None
    if not rows.streaming:
        texts = list(_texts(rows, cfg.text_field))
        if not texts:
            raise DataError(f"data {rows.name!r} is empty (no non-blank text)", "pass --data a file or folder that holds text")
        cache = cfg.path is None or Path(cfg.path).resolve() == BUNDLED_CORPUS
        tokens = tokenize_documents([Document("", t) for t in texts], tokenizer, cache=cache)
        return TextSequences(tokens, cfg.seq_len, seed, eos, documents=len(texts), separator=tokenizer.eos_token_id)
    folder = cache_dir() / "packed" / _key(cfg, tokenizer, None)
    try:
        meta = json.loads((folder / "stream.json").read_text())
        tokens = np.load(folder / "tokens.npy", mmap_mode="r")
        return TextSequences(tokens, cfg.seq_len, seed, eos, documents=int(meta["documents"]),
                             separator=tokenizer.eos_token_id)
    except (OSError, ValueError, KeyError):
        pass
    with _CacheFolder(folder.name) as tmp:
        docs, n = 0, 0
        with open(tmp / "tokens.bin", "wb") as f:
            batch: list[str] = []
            for text in [*_texts(rows, cfg.text_field), None]:
                if text is not None:
                    batch.append(text)
                if batch and (text is None or len(batch) == 1000):
                    for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                        if docs and tokenizer.eos_token_id is not None:
                            ids = [tokenizer.eos_token_id] + ids
                        np.asarray(ids, dtype=np.int64).tofile(f)
                        n += len(ids)
                        docs += 1
                    batch = []
        if not docs:
            raise DataError(f"data {rows.name!r} is empty (no non-blank text)", "pass --data a file or folder that holds text")
        tokens = np.memmap(tmp / "tokens.bin", dtype=np.int64, mode="r", shape=(n,))
        np.save(tmp / "tokens.npy", tokens)
        del tokens
        (tmp / "tokens.bin").unlink()
        (tmp / "stream.json").write_text(json.dumps({"documents": docs}))
    tokens = np.load(folder / "tokens.npy", mmap_mode="r")
    return TextSequences(tokens, cfg.seq_len, seed, eos, documents=docs, separator=tokenizer.eos_token_id)


def _examples(cfg, fmt: str, rows: Rows, tokenizer, template: str | None, loss_on: str, seen: dict):
    """(ids, labels) per row; ``seen['assistant']`` counts the rows with a trained turn."""
    for i, row in enumerate(rows):
        where = rows.where(i)
        _refuse_mixed(rows, fmt, cfg.text_field, i, row)
        if fmt == "text":
            text = row.get(cfg.text_field)
            if not isinstance(text, str):
                raise _not_a_string(rows, i, row, cfg.text_field)
            if not text.strip():
                continue
            ids, labels = encode_text(tokenizer, text)
        elif fmt == "messages":
            ids, labels = encode_messages(tokenizer, row.get("messages"), template, loss_on, where)
            if any(isinstance(m, dict) and m.get("role") == "assistant" for m in row["messages"]):
                seen["assistant"] += 1
        elif fmt == "segments":
            ids, labels = encode_segments(tokenizer, row.get("segments"), loss_on, where)
            if any(g["label"] for g in row["segments"]):  # checked by encode_segments
                seen["assistant"] += 1
        else:
            prompt, completion = row.get("prompt"), row.get("completion")
            ids, labels = encode_prompt_completion(tokenizer, prompt, completion, template, loss_on, where)
            seen["assistant"] += 1
        yield ids, labels


def _needs_template(fmt: str, rows: Rows) -> bool:
    if fmt == "messages":
        return True
    if fmt == "prompt-completion":
        first = next(iter(rows), None)
        return first is not None and isinstance(first.get("prompt"), (list, tuple))
    return False


def build_training_data(cfg, tokenizer, seed: int = 0):
    """The training sequences of ``cfg`` (a :class:`~oomb.config.DataConfig`), tokenised with ``tokenizer``,
    served in the order of ``seed``: a :class:`TextSequences` or a :class:`PackedSequences`.

    Raises:
        DataError: unreadable or empty data or split, a ``text_field`` other than ``text`` for plain text (which
            has no fields), rows without the expected fields, rows of several formats
            (naming the first row of each), a bad message, no chat template for messages, no example with an
            assistant turn, ``loss_on`` assistant for text, a ``chat_template`` for text or segments rows, or less data than one sequence.
    """
    rows = open_rows(cfg.path, cfg.split, cfg.streaming)
    _refuse_field_of_plain_text(rows, cfg.text_field, cfg.path)
    fmt = detect_format(cfg.format, rows.columns, cfg.text_field, repr(rows.name))
    if fmt == "text" and cfg.loss_on == "assistant":
        raise DataError(f"--loss-on assistant needs messages, prompt/completion or segments rows, but {rows.name!r} is text",
                        "leave --loss-on out for text (every token is trained)")
    if fmt in _UNRENDERED and cfg.chat_template is not None:
        read_chat_template(cfg.chat_template)  # a file that cannot be read is named as such
        holds, leave = _UNRENDERED[fmt]
        raise DataError(f"{{chat_template}} renders messages and prompt/completion rows, but {rows.name!r} {holds}",
                        f"leave {{chat_template}} out for {leave}", setting="chat_template")
    long = cfg.long_examples or ("split" if fmt == "text" else "drop")
    if fmt == "text" and long == "split":
        return _text_stream(cfg, rows, tokenizer, seed)
    for i, row in enumerate(itertools.islice(rows, 1000)):  # before the template is asked for: mixing comes first
        _refuse_mixed(rows, fmt, cfg.text_field, i, row)
    template = read_chat_template(cfg.chat_template)
    if template is None and getattr(tokenizer, "chat_template", None) is None and _needs_template(fmt, rows):
        raise DataError(f"the tokenizer has no chat template, which the {fmt} rows of {rows.name!r} need",
                        "pass --chat-template FILE (a Jinja chat template, e.g. the model's), or a tokenizer with one")
    loss_on = cfg.loss_on or ("all" if fmt == "text" else "assistant")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad = 0 if pad is None else int(pad)
    seen = {"assistant": 0}

    def run(shard_dir: Path | None) -> PackedSequences:
        packer = Packer(cfg.seq_len, long, pad, fmt, shard_dir)
        for ids, labels in _examples(cfg, fmt, rows, tokenizer, template, loss_on, seen):
            packer.add(ids, labels)
        if fmt == "messages" and loss_on == "assistant" and not seen["assistant"]:
            raise DataError(f"no example of {rows.name!r} has an assistant turn, so no token would be trained",
                            "add assistant messages to the rows, or pass --loss-on all")
        if fmt == "segments" and loss_on == "assistant" and not seen["assistant"]:
            raise DataError(f"no example of {rows.name!r} has a segment with \"label\": true, so no token would be "
                            "trained", "label the segments to train true, or pass --loss-on all")
        data = packer.finish(seed)
        if not len(data):
            s = packer.stats()
            too_long, untrained = packer.dropped_reasons()
            why = ", ".join(([f"{too_long:,} longer than --seq-len {cfg.seq_len:,}"] if too_long else [])
                            + ([f"{untrained:,} without a trained token"] if untrained else []))
            fix = ("pass a longer --seq-len, or --long-examples split" if too_long else
                   "give the examples text to train on (a non-empty completion or assistant turn; an example's first "
                   "token is never a target), or pass other data")
            raise DataError(f"no example of {rows.name!r} is left to train on ({s.dropped_examples:,} of "
                            f"{s.examples:,} dropped: {why})", fix)
        return data

    if not rows.streaming:
        return run(None)
    key = _key(cfg, tokenizer, template)
    cached = PackedSequences.load(cache_dir() / "packed" / key, seed)
    if cached is not None:
        return cached
    with _CacheFolder(key) as tmp:
        run(tmp)
    return PackedSequences.load(cache_dir() / "packed" / key, seed)
