"""Tokens, windows, models and JSON reports shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..data.tokenizer import TOKENIZER_FILES
from .checks import _check_vocab, _usage_from
from .errors import UsageError


def _vocab_size(model) -> int:
    emb = model.get_input_embeddings()
    n = getattr(emb, "num_embeddings", None)
    return int(n if n is not None else model.config.vocab_size)


def _is_report(path: Path, keys: frozenset) -> bool:
    """Whether the file ``path`` is empty or a JSON object with every one of ``keys`` (an earlier report)."""
    try:
        text = path.read_text()
        if not text.strip():
            return True
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and keys <= data.keys()


# Top-level keys of a retrieval --json report (RetrievalReport.to_dict): an existing file is replaced only if it
# is an earlier retrieval report.
RETRIEVAL_REPORT_KEYS = frozenset({"task", "lengths", "depths", "trials", "needles", "seed", "rows"})

# Top-level keys of the --json reports (EvalReport.to_dict, GradErrorReport.to_dict): an existing file is
# replaced only if it is an earlier report of the same command.
_EVAL_REPORT_KEYS = frozenset({"seq_len", "num_windows", "window_starts", "page_size", "sink_pages", "local_pages",
                               "sparse_score", "rows"})
_GRAD_ERROR_REPORT_KEYS = frozenset({"seq_len", "budgets", "dense_loss", "sparse_loss", "rel_error_all", "rel_error"})


def _report_task(path: Path) -> str | None:
    """The ``--task`` of the earlier ``oomb eval`` report in the file ``path``: ``loss``, ``passkey`` or
    ``needle``; None where the file is no such report (or cannot be read)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if RETRIEVAL_REPORT_KEYS <= data.keys():
        return data["task"] if data["task"] in ("passkey", "needle") else None
    return "loss" if _EVAL_REPORT_KEYS <= data.keys() else None


def _check_report_task(args: argparse.Namespace) -> None:
    """Refuse an ``oomb eval --json`` file that is an earlier report of another ``--task``: replacing it would
    destroy the results of that task.

    Raises:
        UsageError: naming the task the file reports and this one.
    """
    if args.json is None or not args.json.strip():
        return
    path = Path(args.json).expanduser()
    task = _report_task(path) if path.is_file() else None
    if task is not None and task != args.task:
        raise UsageError(f"--json {args.json!r} is a report of 'oomb eval --task {task}', not of --task {args.task}, "
                         "so writing would destroy it",
                         f"pass a new file path for the --task {args.task} report, or delete that file first if it "
                         "is not needed")


def _check_json_arg(args: argparse.Namespace, report_keys: frozenset, command: str) -> None:
    """--json PATH (grad-error, eval, bench) can be written: not a folder, in an existing folder we may write to, and
    new, empty or an earlier ``oomb <command>`` report (recognised by ``report_keys``), never another file."""
    if args.json is None:
        return
    if not args.json.strip():
        raise UsageError("--json is empty", "pass a file path, e.g. --json report.json")
    json_path = Path(args.json).expanduser().resolve()
    if json_path.is_dir():
        raise UsageError(f"--json {args.json!r} is a folder", "pass a file path, e.g. --json report.json")
    if not json_path.parent.is_dir():
        raise UsageError(f"--json {args.json!r}: its folder does not exist", "pass a path in an existing folder")
    if not os.access(json_path.parent, os.W_OK | os.X_OK) or (json_path.exists() and not os.access(json_path, os.W_OK)):
        raise UsageError(f"--json {args.json!r} cannot be written", "pass a path you can write to")
    if json_path.exists() and not _is_report(json_path, report_keys):
        raise UsageError(
            f"--json {args.json!r} exists and is not an earlier 'oomb {command}' report, so writing would destroy it",
            "pass a new file path, or delete that file first if it is not needed",
        )


_PNG = b"\x89PNG\r\n\x1a\n"


def _check_png_path(path: Path, shown: str, flag: str, what: str, kind: str) -> Path:
    """A PNG output ``path`` (named ``shown`` in messages, set by ``flag``; ``what`` is the picture, of
    :data:`oomb.png.KINDS` ``kind``) can be written: not a folder, in an existing folder we may write to, new, empty
    or an earlier oomb picture of the same kind (never another file, nor another picture: a run's loss curve, a
    photo), and ending in .png or in no suffix (hist.jpg would hold PNG bytes under a JPEG name)."""
    if path.is_dir():
        raise UsageError(f"{shown} is a folder", f"pass a file path, e.g. {flag} plot.png")
    if not path.resolve().parent.is_dir():
        raise UsageError(f"{shown}: its folder does not exist", "pass a path in an existing folder")
    if not os.access(path.resolve().parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{shown} cannot be written", f"pass a path you can write to with {flag}")
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as f:
            if f.read(8) != _PNG:
                raise UsageError(f"{shown} exists and is not a PNG image, so writing would destroy it",
                                 f"pass {flag} a new file path, or delete that file first if it is not needed")
        from ..png import png_kind

        if png_kind(path) != kind:
            raise UsageError(f"{shown} exists and is not an earlier oomb {kind} "
                             "(a PNG that another command or program wrote), so writing would destroy it",
                             f"pass {flag} a new file path, or delete that file first if it is not needed")
    if path.suffix and path.suffix.lower() != ".png":
        raise UsageError(f"{shown} ends in {path.suffix}, but {what} is written as a PNG image only",
                         f"pass a path ending in .png, e.g. {flag} {path.with_suffix('.png').name}")
    return path


def _check_png_arg(given: str | None, flag: str, what: str, kind: str) -> Path | None:
    """``flag PATH`` (a PNG to write) checked by :func:`_check_png_path`; None when not given."""
    if given is None:
        return None
    return _check_png_path(Path(given).expanduser(), f"{flag} {given!r}", flag, what, kind)


def _write_json(given: str, data: dict) -> None:
    """Write ``data`` to the --json path atomically (a temporary file beside it, then renamed)."""
    path = Path(given).expanduser()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _tokenizer_path(args: argparse.Namespace, checkpoints: bool = False) -> str | None:
    """The tokenizer folder a command encodes text with, the one rule of train, data, eval and grad-error: --tokenizer
    if given; else, with ``checkpoints`` (eval, grad-error: they read a checkpoint of 'oomb train' as --model), the
    run's tokenizer where --model is a checkpoint (:mod:`oomb.cli.checkpoint_model`); else the --model folder where it
    holds a tokenizer (:data:`TOKENIZER_FILES`), so that the token ids are the model's (one it cannot load is
    refused, never replaced); else None: the bundled tokenizer (a preset, whose random weights match any 32K
    vocabulary, or a folder without a tokenizer)."""
    if args.tokenizer is not None:
        return args.tokenizer
    if checkpoints:
        from .checkpoint_model import _checkpoint_to_read, _run_tokenizer

        checkpoint = _checkpoint_to_read(args.model)
        if checkpoint is not None:
            return _run_tokenizer(checkpoint)
    from ..models.presets import _is_local_model_dir

    if _is_local_model_dir(args.model) and any(os.path.isfile(os.path.join(args.model, n)) for n in TOKENIZER_FILES):
        return args.model
    return None


def _check_data_exists(args: argparse.Namespace) -> None:
    """Refuse a --data path that does not exist before a command's heavy imports (torch and transformers take
    seconds): the line reading the data would give."""
    if getattr(args, "data", None) is None:
        return
    from ..data.errors import DataError
    from ..data.sources import check_data_path

    try:
        check_data_path(args.data)
    except DataError as exc:
        raise _data_usage_error(args, exc) from exc


def _load_tokens(args: argparse.Namespace, tokenizer_path: str | None):
    """The --data token stream of grad-error, eval and ``data --make needle``: int64 ``[N]``, EOS between
    documents; the data read as ``oomb train`` reads text (:func:`oomb.data.load_documents`)."""
    from ..data import (
        BUNDLED_CORPUS,
        DataError,
        load_documents,
        load_tokenizer,
        tokenize_documents,
    )

    command = getattr(args, "command", None)
    reader = f"'oomb {command}{' --make needle' if command == 'data' else ''}'" if command else "this command"
    try:
        tokenizer = load_tokenizer(tokenizer_path)
        docs = load_documents(args.data, getattr(args, "text_field", "text"), getattr(args, "data_split", "train"),
                              reader)
        return tokenize_documents(docs, tokenizer, cache=args.data is None or Path(args.data).resolve() == BUNDLED_CORPUS)
    except DataError as exc:
        raise _data_usage_error(args, exc) from exc


def _data_usage_error(args: argparse.Namespace, exc) -> UsageError:
    """The UsageError of a :class:`oomb.data.DataError`. Where the data path does not exist and came from the
    --config file's data.path, it names that key and file (a relative path is read from the current folder); the
    data setting an error is about (its ``setting``: tokenizer, chat_template) is named as the file's key where
    its value came from the file, else as its flag."""
    config, path = getattr(args, "_config_file", None), getattr(args, "data", None)
    if config is None or path is None or "data.path" not in getattr(args, "_config_keys", ()) or \
            Path(path).expanduser().exists():
        told: set[str] = set()

        def name(setting: str) -> str:  # the file named once, where the setting is first named
            shown = _data_setting(args, setting, file=setting not in told)
            told.add(setting)
            return shown

        return UsageError(*exc.parts(name))
    if Path(path).expanduser().is_absolute():
        return UsageError(f"data path {path!r} (data.path in {config}) does not exist",
                          f"correct data.path in {config}, or pass --data")
    return UsageError(f"data path {path!r} (data.path in {config}) does not exist in the current folder "
                      f"{os.getcwd()!r}, which a relative data.path is read from",
                      f"run oomb from the folder the path is relative to, write an absolute path in {config}, or "
                      "pass --data")


def _data_setting(args: argparse.Namespace, name: str, file: bool = True) -> str:
    """The data setting ``name`` (a DataConfig field) as the user gave it: ``data.NAME (in FILE)`` where its value
    came from the --config file (without the file where ``file`` is false), else its flag."""
    from ..config.flags import flag_name

    config = getattr(args, "_config_file", None)
    if config is not None and f"data.{name}" in getattr(args, "_config_keys", ()):
        return f"data.{name} (in {config})" if file else f"data.{name}"
    command = getattr(args, "command", None)
    return (flag_name(command, "data", name) if command else None) or f"--{name.replace('_', '-')}"


def _merged_adapter(adapter: Path, device, dtype):
    """A LoRA adapter folder (an 'oomb train --lora-rank' output) merged into its base in memory, as 'oomb merge'
    rebuilds and merges it, then moved to ``device`` and ``dtype``."""
    from .merge import _base_recipe, _build_base, _check_adapter_weights, _merged

    shown = f"the adapter {str(adapter)!r}"
    recipe = _base_recipe(adapter)
    _check_adapter_weights(adapter, shown)
    merged = _merged(_build_base(recipe), adapter, recipe, shown)
    return merged.to(device=device, dtype=dtype)


def _check_model_named(args: argparse.Namespace, command: str) -> None:
    """Refuse a --model preset or model folder whose config is unknown or unsupported before the data is tokenised
    (minutes for a large corpus), as ``oomb train`` does; a checkpoint or a LoRA adapter folder is checked as it
    is read (:func:`_load_model`).

    Raises:
        UsageError: --model is neither a preset, a local model folder, an adapter folder nor a checkpoint, or its
            architecture is not one oomb trains.
    """
    from .checkpoint_model import _checkpoint_to_read

    if _checkpoint_to_read(args.model) is None and not _is_adapter_folder(Path(args.model)):
        _model_config(args, command)


def _is_adapter_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a LoRA adapter alone (adapter_config.json, no config.json of a whole model)."""
    return folder.is_dir() and (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file()


def _supported_models_fix(command: str) -> str:
    """The fix of an unknown or unsupported --model refusal of ``oomb <command>``."""
    return f"use a Qwen2/2.5, Llama 2/3, Mistral or Qwen3 causal LM (see 'oomb {command} --help')"


def _model_config(args: argparse.Namespace, command: str):
    """The transformers config of the --model preset or model folder, checked to be one oomb runs.

    Raises:
        UsageError: unknown model, or an unsupported architecture (the fix names the supported families); a
            model named in the --config file is refused as its key, ``model.name (in FILE)``.
    """
    from .. import UnsupportedModelError
    from ..models.presets import UnknownModelError, check_config_supported, load_config
    from .errors import _named

    try:
        config = load_config(args.model)
        check_config_supported(config)
    except (UnknownModelError, UnsupportedModelError) as exc:
        err = _usage_from(exc, _supported_models_fix(command))
        where = _named(args, "model.name", "--model")
        raise (UsageError(f"{where}: {err.problem}", err.fix) if where != "--model" else err) from exc
    return config


def _load_model(args: argparse.Namespace, tokens, device, dtype, command: str, source: str = "the data has"):
    """The --model of grad-error and eval (a preset seeded by --seed, a local folder, a LoRA adapter folder of
    'oomb train', merged into its base in memory, or a checkpoint of 'oomb train', see :mod:`.checkpoint_model`), its
    config and vocabulary checked against ``tokens`` before any weight is read (an adapter's or a checkpoint's after
    its model is built; ``source`` names what holds ``tokens``, with its verb, for that refusal)."""
    import torch

    from .. import UnsupportedModelError
    from ..models.presets import UnknownModelError, build_model

    if not sys.stderr.isatty():  # transformers' weight-loading bar is for a terminal, not a log file
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    from .checkpoint_model import _checkpoint_model, _checkpoint_to_read

    checkpoint = _checkpoint_to_read(args.model)
    if checkpoint is not None:
        model = _checkpoint_model(checkpoint, args.model, device, dtype)
        _check_vocab(int(tokens.max()), _vocab_size(model), args.model, source)
        return model
    folder = Path(args.model)
    if _is_adapter_folder(folder):
        model = _merged_adapter(folder, device, dtype)
        _check_vocab(int(tokens.max()), _vocab_size(model), args.model, source)
        return model
    model_config = _model_config(args, command)
    _check_vocab(int(tokens.max()), int(model_config.vocab_size), args.model, source)
    try:
        torch.manual_seed(args.seed)
        model = build_model(args.model, dtype=dtype, device=device)
    except (UnknownModelError, UnsupportedModelError) as exc:
        raise _usage_from(exc, _supported_models_fix(command)) from exc
    _check_vocab(int(tokens.max()), _vocab_size(model), args.model, source)
    return model


def _training_data(args: argparse.Namespace):
    """The tokenizer and training data of ``oomb train`` and ``oomb data`` (:func:`oomb.data.build_training_data`
    of the job's data section, in the order of --seed): ``(tokenizer_path, tokenizer, data)``, the tokenizer's folder
    as :func:`_tokenizer_path` picks it (None: the bundled one)."""
    from .. import data as data_lib  # looked up now: a test may stand in for load_tokenizer

    path = _tokenizer_path(args)
    try:
        tokenizer = data_lib.load_tokenizer(path)
        if args.document_mask and tokenizer.eos_token_id is None:
            raise UsageError("--document-mask splits documents at the EOS token but the tokenizer has none",
                             "use a tokenizer with an eos_token, or leave --document-mask out")
        return path, tokenizer, data_lib.build_training_data(args.job.data, tokenizer, seed=args.seed)
    except data_lib.DataError as exc:
        raise _data_usage_error(args, exc) from exc


def _same_data(a: str | os.PathLike | None, b: str | os.PathLike | None) -> bool:
    """Whether the data paths ``a`` and ``b`` (None: the bundled corpus) are one file or folder once resolved:
    ``split`` and ``./split/`` are the same data."""
    from ..data import BUNDLED_CORPUS

    def resolved(path) -> Path:
        return BUNDLED_CORPUS if path is None else Path(path).expanduser().resolve()

    return resolved(a) == resolved(b)


def _training_split_note(args: argparse.Namespace, split: str) -> str:
    """The note of held-out data that is the split ``split`` training reads, naming each setting as the user gave it
    (a flag, or the --config file's key): the held-out split (``--val-split``, or the default it fell to), the
    --val-data that is the training data, and what chose the training split where it is not the default."""
    from ..config import DataConfig
    from .errors import _named

    val, data = args.job.validation, args.job.data
    held = (f"{_named(args, 'validation.split', '--val-split')} {split}" if val.split is not None
            else f"the held-out split {split!r}")
    training = []
    if val.data is not None:
        held += f" of {_named(args, 'validation.data', '--val-data')} {val.data}"
        training.append(f"{_data_setting(args, 'path')} {data.path}" if data.path is not None else "the bundled corpus")
    if data.split != DataConfig().split:  # set by the user: name how
        training.append(f"{_data_setting(args, 'split')} {data.split}")
    of = f" ({', '.join(training)})" if training else ""
    return f"oomb: note: {held} is the split training reads{of}: the held-out loss is of training sequences"


def _held_out_data(args: argparse.Namespace, tokenizer):
    """The held-out data of ``oomb train --val-every N``: the split :attr:`ValidationConfig.split` names (default:
    validation, else test) of --val-data (read with every other data setting of the run) or of --data, built by
    :func:`oomb.data.build_training_data` as the training data is; ``(data, where, note)``, ``where`` naming it for
    messages (``"--data DIR [validation]"``), ``note`` a line to print once every check has passed (the held-out
    split is the one training reads, of --data or of a --val-data that is the same path) or None; None without
    --val-every.

    Raises:
        UsageError: the data has no such split, or (the default) neither validation nor test where --val-data is
            not given (naming the splits it has and how to add one), or its held-out split cannot be built.
    """
    from dataclasses import replace

    from .. import data as data_lib
    from .errors import _named

    val = args.job.validation
    if not val.every:
        return None
    path = val.data if val.data is not None else args.job.data.path
    shown = f"--val-data {val.data}" if val.data is not None else \
        f"--data {args.job.data.path}" if args.job.data.path is not None else "the bundled corpus"
    every = _named(args, "validation.every", "--val-every")
    try:
        splits = data_lib.data_splits(path)
    except data_lib.DataError as exc:
        if val.data is None:
            raise _data_usage_error(args, exc) from exc
        raise UsageError(f"{_named(args, 'validation.data', '--val-data')}: {exc.problem}",
                         exc.fix.replace("pass --data", "pass --val-data")) from exc
    has = ", ".join(splits)
    if val.split is not None:
        if val.split not in splits:
            others = [s for s in ("validation", "test", "train") if s in splits] or splits
            raise UsageError(f"{_named(args, 'validation.split', '--val-split')} {val.split!r}: {shown} has no split "
                             f"{val.split!r} (its splits: {has})",
                             f"pass --val-split {others[0]}, or --val-data PATH with such a split")
        split = val.split
    else:
        split = next((s for s in ("validation", "test") if s in splits), None)
        if split is None and val.data is not None:
            split = "train" if "train" in splits else splits[0]
        if split is None:
            folder = path is not None and Path(path).expanduser().is_dir()
            add = ("add validation.jsonl (held-out rows, named like the training files) beside its train file"
                   if folder else "put the rows in a folder as train.jsonl with held-out rows in validation.jsonl")
            raise UsageError(f"{every} {val.every} evaluates the held-out split of {shown}, which has no validation "
                             f"or test split (its splits: {has})",
                             f"{add}, or pass --val-data PATH (held-out data) or --val-split NAME")
    note = None
    if split == args.job.data.split and (val.data is None or _same_data(val.data, args.job.data.path)):
        note = _training_split_note(args, split)
    where = f"{shown} [{split}]"
    cfg = replace(args.job.data, path=path, split=split)
    try:
        return data_lib.build_training_data(cfg, tokenizer, seed=args.seed), where, note
    except data_lib.DataError as exc:
        problem, fix = exc.parts(lambda setting: _data_setting(args, setting))
        raise UsageError(f"the held-out data {where}: {problem}", fix.replace("--data-split", "--val-split")) from exc
