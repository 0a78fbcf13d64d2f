"""Where the rows come from: local files read with ``datasets`` (or the plain-text reader).

* nothing: the bundled corpus; a ``.txt`` (or any other non-table) file: one document; a folder of ``.txt``
  files (in subfolders too): one document per file, sorted by path (:func:`oomb.data.text.read_documents`),
  as one ``text`` column, split by the file and folder names as any other folder is (``test.txt`` beside
  ``train.txt`` is the test split; one ``train`` split where no name says one);
* a ``.json``/``.jsonl``, ``.parquet``, ``.csv`` or ``.arrow`` file: ``datasets.load_dataset`` with that
  builder (its one split is ``train``);
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``: ``datasets.load_from_disk``;
* any other folder: ``datasets.load_dataset`` with the builder of its format, of its data files in it and its
  subfolders, split by their file and folder names as ``datasets.load_dataset(folder)`` splits them; a data
  file those names put in no split is refused, not left out.

A suffix, and a split name, is matched in any case: ``PC.JSONL`` is JSON Lines, ``a.TXT`` a text file of a
folder, ``TRAIN.JSONL`` the train split.

A folder is read as one format: its data files (``.txt``, ``.json``/``.jsonl``, ``.parquet``, ``.csv``,
``.arrow``; hidden ones and files of other suffixes are not data) are all of one, or it is refused naming what
it holds. With ``streaming`` the rows are read as they are used (``IterableDataset``) instead of into an Arrow
table. ``datasets`` keeps its own cache under :func:`oomb.data.text.cache_dir` ``/datasets``. A file that
cannot be read is refused naming its first bad line where one can be found (not UTF-8, not JSON, a CSV line
with more fields than its header), also where the rows are read one by one; JSON rows that are not objects (an
array of strings or numbers, which datasets would read as a ``text`` field) are refused naming the first. A
compressed file (gzip, zstd, xz or bzip2, known by its first bytes whatever its name), a folder of compressed
files only, or a folder's compressed data file (``b.jsonl.gz``, its data file ``b.jsonl`` not beside it) is
refused saying so and naming the command that decompresses it: rows are named by the lines of the file as it is
on disk, which a compressed file does not have.
"""

from __future__ import annotations

import itertools
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from .errors import DataError
from .stats import counted
from .text import (BUNDLED_CORPUS, COMPRESSED_SUFFIXES, cache_folder, compressed, compression_of, not_utf8,
                   read_documents)

__all__ = ["Rows", "check_data_path", "data_fingerprint", "data_splits", "open_rows"]

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_KINDS = {".txt": ".txt", ".json": ".json/.jsonl", ".jsonl": ".json/.jsonl", ".parquet": ".parquet", ".csv": ".csv",
          ".arrow": ".arrow"}
"""The data files of a folder, by suffix, and the format each is read as (one format per folder)."""


def _suffix(path: Path) -> str:
    """The suffix of ``path`` in lower case, by which its format is known (``PC.JSONL`` is JSON Lines as
    ``pc.jsonl`` is)."""
    return path.suffix.lower()


@dataclass
class Rows:
    """The rows of one split: ``columns`` (field names), ``rows`` (re-iterable dicts) and ``name`` (for
    messages: :meth:`where`); ``plain``: read by the plain-text reader (one ``text`` column, ``sources`` the file
    of each row); ``path``: the data path (None: the bundled corpus); ``lines``: the JSON Lines file whose
    non-blank lines the rows are (rows are then named by line); ``table``: the format of rows that are a table,
    each row with every column (``csv``, ``parquet``, ``arrow``, or ``saved`` for a ``save_to_disk`` folder), in
    which a None field is a null (an empty CSV cell) -- None for JSON rows, where a None field may be one the row
    lacks."""

    columns: list[str]
    rows: Any
    name: str
    streaming: bool = False
    plain: bool = False
    path: Path | None = None
    lines: Path | None = None
    sources: list[str] | None = None
    table: str | None = None
    _line_numbers: list[int] | None = field(default=None, repr=False)

    def __iter__(self) -> Iterator[dict]:
        """The rows; a file that turns out unreadable while they are read is refused (naming its bad line where
        one is found) instead of failing with the reader's exception."""
        it = iter(self.rows)
        while True:
            try:
                row = next(it)
            except StopIteration:
                return
            except DataError:
                raise
            except Exception as exc:  # pyarrow, pandas, UnicodeDecodeError, datasets' own errors
                raise _unreadable(self.path, self.name, exc) from exc
            yield row

    def _line(self, i: int) -> int | None:
        """The 1-based line of row ``i`` (0-based) in a JSON Lines file; None for other data."""
        if self.lines is None:
            return None
        if self._line_numbers is None:
            self._line_numbers = _non_blank_lines(self.lines)
        return self._line_numbers[i] if i < len(self._line_numbers) else i + 1

    def written_null(self, i: int, row: dict, field: str) -> bool:
        """Whether ``row``, row ``i`` (0-based), writes ``field`` as null rather than lacking it: a column of a
        ``table`` (parquet, CSV, arrow, a saved dataset) whose value is None there, or a JSON Lines line that writes
        it as null (datasets reads a field a row lacks as None too); False for other data or a line that cannot be
        read."""
        import json

        if row.get(field) is not None:
            return False
        if self.table is not None:
            return field in self.columns
        line = self._line(i)
        if line is None:
            return False
        try:
            with open(self.lines, encoding="utf-8") as f:
                text = next(itertools.islice(f, line - 1, None), "")
            record = json.loads(text)
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        return isinstance(record, dict) and field in record and record[field] is None

    def number(self, i: int) -> str:
        """Row ``i`` (0-based) as a user counts it: ``line N`` of a JSON Lines file, else ``row N`` (1-based)."""
        line = self._line(i)
        return f"row {i + 1}" if line is None else f"line {line}"

    def where(self, i: int) -> str:
        """Row ``i`` (0-based) for a message: ``FILE:LINE`` of a JSON Lines file (1-based), the file of a plain-text
        document, else ``NAME row N`` (1-based)."""
        if self.sources is not None and i < len(self.sources):
            return self.sources[i]
        line = self._line(i)
        return f"{self.name} row {i + 1}" if line is None else f"{self.name}:{line}"


def _non_blank_lines(path: Path) -> list[int]:
    """The 1-based numbers of the non-blank lines of ``path`` (the rows of a JSON Lines file)."""
    try:
        with open(path, "rb") as f:
            return [k for k, line in enumerate(f, start=1) if line.strip()]
    except OSError:
        return []


def _documents(root: Path, files: list[Path]) -> Rows:
    """The plain-text rows of ``root``: the file itself, or the ``.txt`` ``files`` of the folder."""
    files = [root] if root.is_file() else files
    docs = read_documents(files, root)
    name = str(root)
    return Rows(["text"], [{"text": d.text} for d in docs], name, plain=True, path=root,
                sources=[d.source for d in docs])


def _datasets():
    try:
        import datasets
    except ImportError as exc:  # a dependency of oomb, but an environment may lack it
        raise DataError(f"reading JSON Lines, parquet, csv or arrow data needs the datasets library ({exc})",
                        "pip install datasets") from None

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its failures become one DataError line
    return datasets


def _one_line(exc: BaseException) -> str:
    """The message of ``exc``'s first cause that says more than a wrapper (datasets' "An error occurred while
    generating the dataset" hides the parser's error in its chain), on one line."""
    seen, chain = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for e in reversed(chain):  # the innermost cause first: the parser's own words
        text = " ".join(str(e).split())
        if text and "An error occurred while generating the dataset" not in text:
            return text[:300]
    return type(chain[0]).__name__ if chain else "unknown error"


_READABLE = "pass --data json/jsonl, parquet, csv or text files, a folder of them, or a save_to_disk folder"


def _unreadable(path: Path | None, name: str, exc: BaseException) -> DataError:
    """The DataError of data at ``path`` that its reader failed on with ``exc``: its first bad line where one is
    found (raised), else ``cannot read NAME (the reader's cause)``."""
    if path is not None:
        _first_bad_line(path)
        if path.is_dir():
            _refuse_differing_fields(path)
    return DataError(f"cannot read {name!r} ({_one_line(exc)})", _READABLE)


def _kind(value: Any) -> str:
    """The kind of a JSON value, as a message names it (an integer and a fraction are both a number, which the
    reader casts to one type)."""
    return ("a boolean" if isinstance(value, bool) else "a number" if isinstance(value, (int, float))
            else "a string" if isinstance(value, str) else "a list" if isinstance(value, list) else "an object")


def _fields_of(file: Path) -> dict[str, set[str]] | None:
    """The fields of the rows of the data ``file``, each with the kinds of value it holds in them (named for JSON
    rows only; empty for a table's columns), or None where the file cannot be read so."""
    import json

    suffix = _suffix(file)
    try:
        if suffix in (".json", ".jsonl"):
            text = file.read_text(encoding="utf-8-sig")
            try:
                value = json.loads(text)
                records = value if isinstance(value, list) else [value]
            except ValueError:
                records = [json.loads(line) for line in text.splitlines() if line.strip()]
            fields: dict[str, set[str]] = {}
            for record in records:
                for key, item in (record.items() if isinstance(record, dict) else ()):
                    fields.setdefault(key, set()).update([] if item is None else [_kind(item)])
            return fields
        if suffix == ".csv":
            import csv

            with open(file, newline="", encoding="utf-8-sig") as f:
                return {name: set() for name in next((row for row in csv.reader(f) if row), [])}
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return {name: set() for name in pq.read_schema(file).names}
    except Exception:  # noqa: BLE001 -- any file this cannot read leaves the reader's own words to say it
        return None
    return None


def _refuse_differing_fields(root: Path) -> None:
    """Raise the DataError of a folder whose data files the reader failed on because they differ: two files of
    different fields (``datasets`` reads a folder's files as one table, of the first file's columns), or of one
    field that holds values of different kinds (a number in one, a string in the other)."""
    def names(fields: dict[str, set[str]]) -> str:
        shown = sorted(fields)
        return ", ".join(shown[:8]) + (f", ... ({len(shown)} fields)" if len(shown) > 8 else "")

    first: tuple[Path, dict[str, set[str]]] | None = None
    fix = ("give every file the same fields (drop the ones training does not read, or add them to every file), or "
           "move the files that differ to a folder of their own and pass --data one folder or file")
    for file in _data_files(root):
        fields = _fields_of(file)
        if fields is None:
            continue
        if first is None:
            first = (file, fields)
            continue
        a, b = first[0].relative_to(root), file.relative_to(root)
        if set(fields) != set(first[1]):
            raise DataError(f"folder {str(root)!r} holds files with different fields ({a}: {names(first[1])}; {b}: "
                            f"{names(fields)}), which are read as one table", fix)
        for key in sorted(fields):
            if first[1][key] and fields[key] and not first[1][key] & fields[key]:
                raise DataError(f"folder {str(root)!r} holds the field {key!r} as {' or '.join(sorted(first[1][key]))}"
                                f" in {a} but as {' or '.join(sorted(fields[key]))} in {b}, and its files are read "
                                "as one table", f"write {key!r} as one kind of value in every file (or drop it), or "
                                "pass --data one file")


def _split_of(obj, split: str, where: str):
    """``obj[split]`` of a DatasetDict (or ``obj`` itself), refusing a missing split by naming those there are."""
    ds = _datasets()
    keys = list(obj.keys()) if isinstance(obj, (ds.DatasetDict, ds.IterableDatasetDict)) else None
    if keys is None:
        if split != "train":
            raise DataError(f"{where} has one split, not {split!r}", "leave --data-split out (train)")
        return obj
    if split not in keys:
        raise DataError(f"{where} has no split {split!r} (it has: {', '.join(keys) or 'none'})",
                        f"pass --data-split {keys[0]}" if keys else "pass data with rows")
    return obj[split]


def _blank(file: Path) -> bool:
    """Whether ``file`` holds nothing but whitespace (read only where it is under 1 MiB; a larger one is not)."""
    try:
        size = file.stat().st_size
        small_text = size < 1 << 20 and _suffix(file) in (".json", ".jsonl", ".csv")
        return size == 0 or (small_text and not file.read_bytes().strip())
    except OSError:
        return False


def _refuse_empty(path: Path, files: list[Path]) -> None:
    """Raise the DataError of a data file, or a folder of data files (``files``), that holds no rows at all
    (datasets fails on them with a bare StopIteration)."""
    if path.is_file():
        if _blank(path):
            what = "is empty" if path.stat().st_size == 0 else "holds only blank lines"
            how = {".csv": " (a header line, e.g. text, then one row per line)",
                   ".jsonl": ' (one JSON object per line, e.g. {"text": "..."})',
                   ".json": ' (one JSON object per line, e.g. {"text": "..."})'}.get(_suffix(path), "")
            raise DataError(f"{str(path)!r} holds no rows (the file {what})",
                            f"write the rows into it{how}, or pass --data a file with rows")
        return
    if files and all(_blank(p) for p in files):
        names = ", ".join(sorted(p.name for p in files)[:3]) + (", ..." if len(files) > 3 else "")
        raise DataError(f"folder {str(path)!r} holds no rows (its data files are empty: {names})",
                        "write the rows into them, or pass --data a folder or file with rows")


def _data_files(root: Path) -> list[Path]:
    """The data files of the folder ``root`` and its subfolders, sorted by path: a suffix of ``_KINDS`` in any
    case, no part of the path under ``root`` hidden."""
    return sorted(p for p in root.rglob("*") if _suffix(p) in _KINDS and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def _folder_kind(root: Path, files: list[Path]) -> str:
    """The one format of the data ``files`` of folder ``root`` (a ``_KINDS`` value).

    Raises:
        DataError: the folder holds no data file, a compressed data file (:func:`_refuse_compressed_beside`), or
            files of several formats (naming how many of each and one).
    """
    by_kind: dict[str, list[Path]] = {}
    for f in files:
        by_kind.setdefault(_KINDS[_suffix(f)], []).append(f)
    if not by_kind:
        packed = sorted(p for p in root.rglob("*") if p.is_file() and compression_of(p) is not None
                        and not any(part.startswith(".") for part in p.relative_to(root).parts))
        if packed:
            name, _, keep = compression_of(packed[0])
            raise DataError(f"folder {str(root)!r} holds no data file (.txt, .json/.jsonl, .parquet, .csv or .arrow), "
                            f"but {counted(len(packed), 'compressed file')} (e.g. {packed[0].relative_to(root)}, "
                            f"{name}), which oomb reads uncompressed only",
                            f"decompress them beside themselves, e.g. {keep} {shlex.quote(str(packed[0]))}, and pass "
                            "--data the folder again")
        raise DataError(f"folder {str(root)!r} holds no data file (.txt, .json/.jsonl, .parquet, .csv or .arrow)",
                        "put the training data there, e.g. .txt files or .jsonl with a \"text\" field")
    _refuse_compressed_beside(root)
    if len(by_kind) > 1:
        found = ", ".join(f"{counted(len(v), k + ' file')} (e.g. {v[0].relative_to(root)})" for k, v in by_kind.items())
        raise DataError(f"folder {str(root)!r} mixes data formats: {found}",
                        "a folder is read in one format: move the files of the other formats to a folder of their "
                        "own (or convert them), and pass --data that folder or one file")
    return next(iter(by_kind))


def _refuse_compressed_beside(root: Path) -> None:
    """Refuse the compressed data files of the folder ``root`` and its subfolders: a file named as a data file with
    a compression suffix (``b.jsonl.gz``, in any case), compressed (known by its first bytes), where that data file
    (``b.jsonl``) is not beside it. Not being data files, they would be left out of the rows, so the folder is
    refused as a compressed file is, with the command that decompresses them and keeps them (the folder then reads
    the decompressed copies).

    Raises:
        DataError: naming the compressed files (up to three) and the command that decompresses them.
    """
    left_out = []
    for p in sorted(root.rglob("*")):
        plain = p.with_suffix("")
        if _suffix(p) not in COMPRESSED_SUFFIXES or _suffix(plain) not in _KINDS or plain.is_file() or not p.is_file() \
                or any(part.startswith(".") for part in p.relative_to(root).parts):
            continue
        found = compression_of(p)
        if found is not None:
            left_out.append((p, found[2]))
    if not left_out:
        return
    shown = left_out[:3]
    names = ", ".join(str(p.relative_to(root)) for p, _ in shown) + (", ..." if len(left_out) > 3 else "")
    tools: dict[str, list[str]] = {}
    for p, keep in shown:
        tools.setdefault(keep, []).append(shlex.quote(str(p)))
    command = " && ".join(f"{keep} {' '.join(paths)}" for keep, paths in tools.items())
    one = len(left_out) == 1
    raise DataError(f"folder {str(root)!r} holds {counted(len(left_out), 'compressed data file')} beside its data "
                    f"files ({names}), which oomb reads uncompressed only, so {'it' if one else 'they'} would be "
                    "left out",
                    f"decompress {'it beside itself' if one else 'them beside themselves'}"
                    f"{': ' if len(left_out) <= 3 else ', e.g. '}{command}, and pass --data the folder again")


def _saved(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``save_to_disk``."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def _load(path: Path, split: str, streaming: bool, files: list[Path]):
    ds = _datasets()
    where = repr(str(path))
    if not _saved(path):
        _refuse_empty(path, files)
    csv_files = [path] if _suffix(path) == ".csv" and path.is_file() else [f for f in files if _suffix(f) == ".csv"]
    for file in csv_files:  # pandas would read a longer first row's leading fields as an index
        _first_bad_csv_line(file, first_row_only=True)
    # No implicit index (no field leaves its column), and only an empty cell is missing: pandas would read the
    # words NA, null, None, NaN... of a text column as missing values too.
    options = {"index_col": False, "keep_default_na": False, "na_values": [""]} if csv_files else {}
    try:
        if _saved(path):
            loaded = ds.load_from_disk(str(path))
            data = _split_of(loaded, split, where)
            return data.to_iterable_dataset() if streaming else data
        cache = str(cache_folder("datasets"))
        if path.is_dir():  # datasets would pick its files by lower-case suffix: a folder's B.CSV is named here
            builder, data_files = _BUILDERS[_suffix(files[0])], _split_files(path, files)
        else:
            builder, data_files = _BUILDERS[_suffix(path)], {"train": [str(path)]}
        loaded = ds.load_dataset(builder, data_files=data_files, cache_dir=cache, streaming=streaming, **options)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many kinds (ValueError, DatasetGenerationError, ArrowInvalid, ...)
        if "corresponds to no data" in str(exc):  # how datasets says a split has no rows
            raise _no_rows(path, split) from exc
        raise _unreadable(path, str(path), exc) from exc
    return _split_of(loaded, split, where)


def _split_files(root: Path, files: list[Path]) -> dict[str, list[str]]:
    """The data ``files`` of the folder ``root`` by split, the splits named from the file and folder names under
    ``root`` as ``datasets.load_dataset(folder)`` names them (``train``, ``test``, ``validation``...; one ``train``
    split where no name says one), but in any case (``TRAIN.JSONL`` is train, as ``train.jsonl`` is), from the data
    files alone (another file's name says no split), and each file once in a split.

    Raises:
        DataError: the names say splits, but some data files are in none (datasets would leave them out).
    """
    import re

    from datasets.data_files import (
        ALL_DEFAULT_PATTERNS,
        ALL_SPLIT_PATTERNS,
        DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME,
        DEFAULT_SPLITS,
    )
    from datasets.utils.py_utils import string_to_dict
    from fsspec.utils import glob_translate

    names = [(f.relative_to(root).as_posix().lower(), f) for f in files]

    def matching(patterns: list[str]) -> list[Path]:
        """The files whose lower-case path under ``root`` one of ``patterns`` matches (datasets' globs), in the
        order of the patterns, then of the paths."""
        found: dict[Path, None] = {}
        for pattern in patterns:
            regex = re.compile(glob_translate(pattern))
            found.update((f, None) for name, f in names if regex.match(name))
        return list(found)

    by_split: dict[str, list[Path]] = {}
    named_by = "file"  # what names the splits: a "shard" name, a "folder" or a "file" name
    for sharded in ALL_SPLIT_PATTERNS:  # data/train-00000-of-00002.parquet
        shards = matching([sharded.replace("{split}", "*")])
        splits = {(string_to_dict(f.name.lower(), sharded.rsplit("/", 1)[-1]) or {}).get("split", "") for f in shards}
        if shards and all(re.fullmatch(r"\w+(\.\w+)*", split) for split in splits):
            order = [str(s) for s in DEFAULT_SPLITS if s in splits] + sorted(splits - {str(s) for s in DEFAULT_SPLITS})
            by_split = {split: matching([sharded.format(split=split)]) for split in order}
            named_by = "shard"
            break
    else:
        for patterns in ALL_DEFAULT_PATTERNS:
            by_split = {str(split): found for split, p in patterns.items() if (found := matching(p))}
            if by_split:
                named_by = "folder" if patterns is DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME else "file"
                break
    by_split = {split: found for split, found in by_split.items() if found}
    if not by_split:
        return {"train": [str(f) for f in files]}
    placed = {f for found in by_split.values() for f in found}
    left_out = [f for f in files if f not in placed]
    if left_out:
        said = ", ".join(f"{split} ({found[0].relative_to(root)})" for split, found in by_split.items())
        rel, shard = left_out[0].relative_to(root), next(iter(by_split.values()))[0].relative_to(root)
        fix = {"shard": f"name each data file as a shard of its split, as {shard} is",
               "folder": f"move each data file into a folder named for its split, e.g. {Path('train') / rel}",
               "file": f"name each data file for its split, e.g. {rel.parent / ('train-' + rel.name)}"}[named_by]
        raise DataError(f"folder {str(root)!r} names its splits by {named_by} name: {said}, but "
                        f"{counted(len(left_out), 'data file')} {'is' if len(left_out) == 1 else 'are'} in none "
                        f"(e.g. {rel}), which would be left out", f"{fix}, or move the others out of the folder")
    return {split: [str(f) for f in found] for split, found in by_split.items()}


def _first_bad_line(path: Path) -> None:
    """Raise the DataError of the first bad line of the JSON or CSV data at ``path`` (a file, or a folder's files,
    where a reader refused it, to say where): a line that is not UTF-8, not a JSON object, or a CSV row of more
    fields than its header."""
    files = [path] if path.is_file() else _data_files(path) if path.is_dir() else []
    for file in files:
        if _suffix(file) in (".json", ".jsonl", ".csv"):
            _first_non_utf8_line(file)
            if _suffix(file) == ".csv":
                _first_bad_csv_line(file)
            else:
                _first_bad_json_line(file)


def _first_non_utf8_line(path: Path) -> None:
    """Raise the DataError of the first line of ``path`` that is not UTF-8."""
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise not_utf8(f"{path}:{lineno}", exc) from exc
    except OSError:
        return


def _first_bad_csv_line(path: Path, first_row_only: bool = False) -> None:
    """Raise the DataError of the first row of a CSV file with more fields than its header line (a later row:
    what pandas refuses; the first row: what pandas would read with its leading fields as an index, or, with
    ``index_col=False``, cut to the header's fields). ``first_row_only``: look at the first row after the header
    only (blank lines are skipped, as pandas skips them)."""
    import csv

    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next((row for row in reader if row), None)
            for row in (row for row in reader if row) if header else ():
                if len(row) > len(header):
                    raise DataError(f"{path}:{reader.line_num} has {len(row)} fields but the header line has "
                                    f"{len(header)} ({', '.join(header)})",
                                    'quote a field that holds a comma ("a, b"), or fix the line')
                if first_row_only:
                    return
    except (OSError, UnicodeDecodeError, csv.Error):
        return


def _first_bad_json_line(path: Path) -> None:
    """Raise the DataError of the first line of a JSON Lines file that is not a JSON object (where datasets
    refused the file, to say where), or of a ``.json`` file that is not an array of objects (naming the first
    row that is not one)."""
    import json

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == 1 and _suffix(path) == ".json":
                _first_non_object_row(path, peek=False)  # maybe one JSON document over many lines
                return
            raise DataError(f"{path}:{lineno} is not valid JSON ({exc.msg})",
                            'write one JSON object per line, e.g. {"text": "..."}') from exc
        if not isinstance(record, dict):
            if lineno == 1 and _suffix(path) == ".json":
                _first_non_object_row(path, peek=False)  # maybe one JSON array of rows
                return
            raise DataError(f"{path}:{lineno} is {_json_value(record)}, but the rows must be JSON objects",
                            f"write one JSON object per line, e.g. {_ROW_EXAMPLES}")


_ROW_EXAMPLES = '{"text": "..."}, {"messages": [...]} or {"prompt": "...", "completion": "..."}'
"""The row formats, as JSON objects, that the fix of a row that is not an object names."""

_OBJECT_ROWS = f"write each row as a JSON object, e.g. {_ROW_EXAMPLES}"


def _json_value(value: Any) -> str:
    """A JSON value for a message: ``the number 1``, ``the string "a"``, ``the array [1, 2]``, ``null``..."""
    import json

    shown = json.dumps(value, ensure_ascii=False)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    kind = ("" if value is None or isinstance(value, bool) else "the number " if isinstance(value, (int, float))
            else "the string " if isinstance(value, str) else "the array " if isinstance(value, list) else "")
    return kind + shown


def _first_non_object_row(path: Path, peek: bool = True) -> None:
    """Raise the DataError of a ``.json`` file that is an array with an element that is not an object (datasets
    reads an array of strings or numbers as the rows of a ``text`` field it names itself), naming the first such
    element as ``row N``, or of one that is a single JSON value other than an object or array; a ``.jsonl`` file
    is named by its first line that is not an object. ``peek``: read the file only where it starts with an array
    whose first element is not an object."""
    import json

    try:
        if peek:
            with open(path, "rb") as f:
                start = f.read(1 << 16).decode("utf-8", errors="ignore").lstrip("\ufeff \t\r\n")
            if not start.startswith("[") or start[1:].lstrip()[:1] in ("{", "]", ""):
                return
        if _suffix(path) == ".jsonl":
            _first_bad_json_line(path)
            return
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError):
        return
    try:
        value = json.loads(text)
    except ValueError:
        return
    if isinstance(value, list):
        k, item = next(((k, v) for k, v in enumerate(value, start=1) if not isinstance(v, dict)), (0, None))
        if k:
            raise DataError(f"{path} row {k} is {_json_value(item)}, but the rows must be JSON objects", _OBJECT_ROWS)
    elif not isinstance(value, dict):
        raise DataError(f"{path} is {_json_value(value)}, but it must hold rows that are JSON objects", _OBJECT_ROWS)


def _refuse_run_folder(root: Path) -> None:
    """Refuse an ``oomb train`` output folder (its ``train_args.json`` written by oomb), its ``checkpoints/`` folder
    or one checkpoint of it as data: read as JSON files they would make a table of the run's own records.

    Raises:
        DataError: naming what the folder is, the data the run trained on, and --model.
    """
    import json

    args = root / "train_args.json"
    if args.is_file():
        try:
            recorded = json.loads(args.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if isinstance(recorded, dict) and "oomb_version" in recorded:
            trained = recorded.get("data")
            raise DataError(f"data path {str(root)!r} is the output folder of an oomb train run (its train_args.json), "
                            "not data",
                            f"pass --data the data it trained on "
                            f"({'the bundled corpus: leave --data out' if trained is None else trained}), "
                            "or pass the folder as --model to train from its model")
        return
    if (root / "latest").is_file() and any(root.glob("step-*/meta.json")):
        what = "holds checkpoints"
    elif (root / "meta.json").is_file() and (root / "trainer_state.pt").is_file():
        what = "is a checkpoint"
    else:
        return
    raise DataError(f"data path {str(root)!r} {what} of an oomb train run, not data",
                    "pass --data the data the run trained on; to go on training from a checkpoint, pass --resume")


def check_data_path(path: str) -> Path:
    """``path`` as a path (``~`` expanded), once it exists; reads nothing, and needs no torch.

    Raises:
        DataError: the path is empty (which would read the current folder), does not exist, is neither a file
            nor a folder (a pipe, a device), or is an oomb train output or checkpoints folder.
    """
    if not str(path).strip():
        raise DataError(f"data path {str(path)!r} is empty",
                        "pass --data (or data.path in --config) a file or folder, or leave it out for the bundled corpus")
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"data path {str(root)!r} does not exist",
                        "pass --data a text, json/jsonl, parquet or csv file, a folder of them, or a save_to_disk folder")
    if root.is_dir():
        _refuse_run_folder(root)
    if not root.is_file() and not root.is_dir():  # a pipe (<(zcat rows.jsonl.gz)), a device or a socket
        raise DataError(f"data path {str(root)!r} is not a file or folder but a pipe, device or socket, which the data "
                        "is read from more than once and named by its lines in",
                        "write the data to a file (e.g. zcat rows.jsonl.gz > rows.jsonl) and pass --data that file")
    return root


def data_splits(path: str | None) -> list[str]:
    """The names of the splits :func:`open_rows` reads from the data at ``path`` (None: the bundled corpus), without
    reading any row: ``['train']`` for the bundled corpus and a single file; a folder's splits (also a folder of
    ``.txt`` files) as its file and folder names give them (``train``, ``validation``, ``test``, ...); a ``save_to_disk`` folder's as its
    ``dataset_dict.json`` lists them (a saved single ``Dataset``: ``['train']``).

    Raises:
        DataError: what :func:`open_rows` refuses of the path itself (missing, a folder of no data file or of
            several formats, an unreadable ``dataset_dict.json``).
    """
    if path is None:
        return ["train"]
    root = check_data_path(path)
    if _saved(root):
        index = root / "dataset_dict.json"
        if not index.is_file():
            return ["train"]
        import json

        try:
            return [str(s) for s in json.loads(index.read_text(encoding="utf-8"))["splits"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"cannot read the splits of {str(root)!r} ({index.name}: {_one_line(exc)})",
                            "write the folder again with DatasetDict.save_to_disk") from exc
    if not root.is_dir():
        return ["train"]
    files = _data_files(root)
    _folder_kind(root, files)  # refuses a folder of no data file, or of several formats
    return list(_split_files(root, files))


def open_rows(path: str | None, split: str = "train", streaming: bool = False) -> Rows:
    """The rows of ``split`` of the data at ``path`` (see the module).

    Raises:
        DataError: the path does not exist, is a folder of no data file or of several formats, is or holds a
            compressed file, cannot be read (naming the first bad line where one is found), is an empty file or a folder of empty files, has no
            such split (naming those it has), or a data file in no split, or the split has no rows.
    """
    if path is None:
        if split != "train":
            raise DataError(f"the bundled corpus has one split, not {split!r}", "leave --data-split out (train)")
        return _documents(BUNDLED_CORPUS, _data_files(BUNDLED_CORPUS))
    root = check_data_path(path)
    folder = root.is_dir() and not _saved(root)
    files = _data_files(root) if folder else []
    kind = _folder_kind(root, files) if folder else None  # refuses a folder of no data file, or of several formats
    for file in [root] if root.is_file() else files:  # datasets would read some as they are, some not at all
        packed = compressed(file)
        if packed is not None:
            raise packed
    if kind == ".txt":  # split by the file and folder names as any other folder: test.txt is not trained on
        by_split = _split_files(root, files)
        if split not in by_split:
            raise DataError(f"folder {str(root)!r} has no split {split!r} (it has: {', '.join(by_split)})",
                            f"pass --data-split {next(iter(by_split))}")
        return _documents(root, [Path(f) for f in by_split[split]])
    if root.is_file() and _suffix(root) not in _BUILDERS:
        if split != "train":
            raise DataError(f"{str(root)!r} is plain text, which has one split, not {split!r}",
                            "leave --data-split out (train)")
        return _documents(root, files)
    data = _load(root, split, streaming, files)
    name = str(root) if split == "train" else f"{root} [{split}]"
    lines = root if root.is_file() and _suffix(root) == ".jsonl" else None
    suffix = _suffix(root) if root.is_file() else kind
    table = "saved" if _saved(root) else {".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}.get(suffix)
    rows = Rows(list(data.column_names or []), data, name, streaming, path=root, lines=lines, table=table)
    first = next(iter(rows), None)
    if not rows.columns and first is not None:  # a streamed json file names its columns with its first row
        rows.columns = list(first)
    if rows.columns == ["text"]:  # the column datasets names for a JSON array of strings or numbers
        for file in [root] if root.is_file() else files:
            if _suffix(file) in (".json", ".jsonl"):
                _first_non_object_row(file)
    if first is None:
        raise _no_rows(root, split)
    return rows


def _no_rows(root: Path, split: str) -> DataError:
    """The DataError of data at ``root`` that reads as no rows: a split of a saved dataset (another split may
    have rows), else a file or folder of files whose one split is empty (a CSV header alone, empty JSON objects),
    which no --data-split changes."""
    if _saved(root):
        return DataError(f"the split {split!r} of {str(root)!r} has no rows",
                         "pass --data-split a split with rows, or other data")
    what = "file holds" if root.is_file() else "folder's data files hold"
    return DataError(f"{str(root)!r} holds no rows with any field (the {what} at most a CSV header line or "
                     "empty JSON objects)", "write the rows into it, or pass other data")


def data_fingerprint(path: str | None) -> str:
    """What identifies the data files for a cache key: each file's path, size and modification time (ns), not
    its contents (as datasets keys its own cache): a file rewritten with its size and modification time kept
    keeps its fingerprint."""
    root = BUNDLED_CORPUS if path is None else Path(path).expanduser().resolve()
    files: Iterable[Path] = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return "\n".join(f"{p}\0{p.stat().st_size}\0{p.stat().st_mtime_ns}" for p in itertools.islice(files, 100_000))
