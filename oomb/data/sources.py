"""Where the rows come from: local files read with ``datasets`` (or the plain-text reader).

* nothing: the bundled corpus; a ``.txt`` (or any other non-table) file, or a folder of ``.txt`` files (with
  ``.jsonl`` beside them): :func:`oomb.data.text.load_documents`, one document per file (per line of a
  ``.jsonl``), as one ``text`` column;
* a ``.json``/``.jsonl``, ``.parquet``, ``.csv`` or ``.arrow`` file: ``datasets.load_dataset`` with that
  builder (its one split is ``train``);
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``: ``datasets.load_from_disk``;
* any other folder: ``datasets.load_dataset(folder)`` (the builder and the splits from its file names).

With ``streaming`` the rows are read as they are used (``IterableDataset``) instead of into an Arrow table.
``datasets`` keeps its own cache under :func:`oomb.data.text.cache_dir` ``/datasets``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from .errors import DataError
from .text import BUNDLED_CORPUS, cache_dir, load_documents

__all__ = ["Rows", "open_rows", "data_fingerprint"]

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


@dataclass
class Rows:
    """The rows of one split: ``columns`` (field names), ``rows`` (re-iterable dicts) and ``name`` (for
    messages: ``'{name} row {i}'``); ``plain``: read by the plain-text reader (one ``text`` column)."""

    columns: list[str]
    rows: Any
    name: str
    streaming: bool = False
    plain: bool = False

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows)


def _documents(path) -> Rows:
    docs = load_documents(path)
    name = str(BUNDLED_CORPUS if path is None else path)
    return Rows(["text"], [{"text": d.text} for d in docs], name, plain=True)


def _datasets():
    try:
        import datasets
    except ImportError as exc:  # a dependency of oomb, but an environment may lack it
        raise DataError(f"reading JSON Lines, parquet, csv or arrow data needs the datasets library ({exc})",
                        "pip install datasets") from None

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its failures become one DataError line
    return datasets


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__


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
        small_text = size < 1 << 20 and file.suffix in (".json", ".jsonl", ".csv")
        return size == 0 or (small_text and not file.read_bytes().strip())
    except OSError:
        return False


def _refuse_empty(path: Path) -> None:
    """Raise the DataError of a data file, or a folder of data files, that holds no rows at all (datasets fails on
    them with a bare StopIteration)."""
    if path.is_file():
        if _blank(path):
            what = "is empty" if path.stat().st_size == 0 else "holds only blank lines"
            how = {".csv": " (a header line, e.g. text, then one row per line)",
                   ".jsonl": ' (one JSON object per line, e.g. {"text": "..."})',
                   ".json": ' (one JSON object per line, e.g. {"text": "..."})'}.get(path.suffix, "")
            raise DataError(f"{str(path)!r} holds no rows (the file {what})",
                            f"write the rows into it{how}, or pass --data a file with rows")
        return
    files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".") and p.suffix in _BUILDERS]
    if files and all(_blank(p) for p in files):
        names = ", ".join(sorted(p.name for p in files)[:3]) + (", ..." if len(files) > 3 else "")
        raise DataError(f"folder {str(path)!r} holds no rows (its data files are empty: {names})",
                        "write the rows into them, or pass --data a folder or file with rows")


def _load(path: Path, split: str, streaming: bool):
    ds = _datasets()
    cache = str(cache_dir() / "datasets")
    where = repr(str(path))
    if not (path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())):
        _refuse_empty(path)
    try:
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            loaded = ds.load_from_disk(str(path))
            data = _split_of(loaded, split, where)
            return data.to_iterable_dataset() if streaming else data
        if path.is_dir():
            loaded = ds.load_dataset(str(path), cache_dir=cache, streaming=streaming)
        else:
            loaded = ds.load_dataset(_BUILDERS[path.suffix], data_files={"train": [str(path)]}, cache_dir=cache,
                                     streaming=streaming)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many kinds (ValueError, DatasetGenerationError, ArrowInvalid, ...)
        if "corresponds to no data" in str(exc):  # how datasets says a split has no rows
            raise DataError(f"the split {split!r} of {where} has no rows",
                            "pass --data-split a split with rows, or other data") from exc
        if path.is_file() and path.suffix in (".json", ".jsonl"):
            _first_bad_json_line(path)
        raise DataError(f"cannot read {where} ({_one_line(exc)})",
                        "pass --data json/jsonl, parquet, csv or text files, a folder of them, or a save_to_disk folder") from exc
    return _split_of(loaded, split, where)


def _first_bad_json_line(path: Path) -> None:
    """Raise the DataError of the first line of a JSON Lines file that is not a JSON object (where datasets
    refused the file, to say where)."""
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
            if lineno == 1 and path.suffix == ".json":
                return  # maybe one JSON document over many lines
            raise DataError(f"{path}:{lineno} is not valid JSON ({exc.msg})",
                            'write one JSON object per line, e.g. {"text": "..."}') from exc
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno} is not a JSON object", 'write one JSON object per line, e.g. {"text": "..."}')


def _plain_text(path: Path) -> bool:
    if path.is_file():
        return path.suffix not in _BUILDERS
    files = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
    return any(p.suffix == ".txt" for p in files) and all(p.suffix in (".txt", ".jsonl") or p.suffix not in _BUILDERS
                                                        for p in files)


def open_rows(path: str | None, split: str = "train", streaming: bool = False) -> Rows:
    """The rows of ``split`` of the data at ``path`` (see the module).

    Raises:
        DataError: the path does not exist, cannot be read, is an empty file or a folder of empty files, has no
            such split (naming those it has), or the split has no rows.
    """
    if path is None:
        if split != "train":
            raise DataError(f"the bundled corpus has one split, not {split!r}", "leave --data-split out (train)")
        return _documents(None)
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"data path {str(root)!r} does not exist",
                        "pass --data a text, json/jsonl, parquet or csv file, a folder of them, or a save_to_disk folder")
    if root.is_dir() and not any(p.is_file() and not p.name.startswith(".") and (p.suffix in _BUILDERS or p.suffix == ".txt")
                                 for p in root.rglob("*")):
        raise DataError(f"folder {str(root)!r} holds no .txt or .jsonl file (nor json, parquet, csv or arrow)",
                        "put the training data there, e.g. .txt files or .jsonl with a \"text\" field")
    if _plain_text(root) and not (root.is_dir() and (root / "state.json").is_file()):
        if split != "train":
            raise DataError(f"{str(root)!r} is plain text, which has one split, not {split!r}",
                            "leave --data-split out (train)")
        return _documents(root)
    data = _load(root, split, streaming)
    name = str(root) if split == "train" else f"{root} [{split}]"
    columns = list(data.column_names or [])
    if not columns:  # a streamed json file names its columns with its first row
        first = next(iter(data), None)
        columns = list(first) if first is not None else []
    if not streaming and len(data) == 0 or streaming and next(iter(data), None) is None:
        raise DataError(f"the split {split!r} of {str(root)!r} has no rows",
                        "pass --data-split a split with rows, or other data")
    return Rows(columns, data, name, streaming)


def data_fingerprint(path: str | None) -> str:
    """What identifies the data files for a cache key: each file's path, size and modification time (ns)."""
    root = BUNDLED_CORPUS if path is None else Path(path).expanduser().resolve()
    files: Iterable[Path] = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return "\n".join(f"{p}\0{p.stat().st_size}\0{p.stat().st_mtime_ns}" for p in itertools.islice(files, 100_000))
