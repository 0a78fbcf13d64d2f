"""``oomb train --resume``: the fingerprint of a run (data, model, settings) saved with each checkpoint and checked
when it resumes."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Sequence

from .checks import _preset_names
from .errors import UsageError, _named


def _resume_command(argv: Sequence[str]) -> str:
    """The command line that continues this run: the same arguments with ``--resume latest``."""
    import shlex

    rest: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--overwrite" or a.startswith("--resume="):
            continue
        if a == "--resume":
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("-")
            continue
        rest.append(a)
    return "oomb " + shlex.join([*rest, "--resume", "latest"])


def _run_tokenizer_fact(args: argparse.Namespace) -> str | None:
    """The tokenizer of the run as its fingerprint records it: the absolute folder :func:`.inputs._tokenizer_path`
    picks (--tokenizer, else a --model folder's own), which 'oomb eval' and 'oomb merge' of a checkpoint read back;
    None for the bundled tokenizer, also where --tokenizer names its folder (so a run that trained with it from a
    model folder that holds its own tokenizer resumes with --tokenizer that folder)."""
    from ..data.tokenizer import BUNDLED_TOKENIZER
    from .inputs import _tokenizer_path

    path = _tokenizer_path(args)
    if path is None or Path(path).resolve() == BUNDLED_TOKENIZER:
        return None
    return str(Path(path).resolve())


def _fingerprint(args: argparse.Namespace, sequences, dtype, world_size: int) -> dict:
    """What a checkpoint's run and the resuming run must share (see --resume in --help); ``sequences``: the
    training data (:func:`oomb.data.build_training_data`), whose ``digest()`` covers its tokens, labels and
    bounds, or None: every fact but the data's ``data_sha256`` (what the flags alone say)."""
    fingerprint = {
        "model": args.model if args.model in _preset_names() or not os.path.isdir(args.model) else str(Path(args.model).resolve()),
        "seq_len": args.seq_len,
        "data_sha256": sequences.digest() if sequences is not None else None,
        "tokenizer": _run_tokenizer_fact(args),
        "seed": args.seed,
        "lora_rank": args.lora_rank,
        "lora_alpha": args.lora_alpha,
        "grad_accum": args.grad_accum,
        "dtype": str(dtype).replace("torch.", ""),
        "document_mask": args.document_mask,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling_dict,
        "world_size": world_size,
    }
    if sequences is None:
        del fingerprint["data_sha256"]
    # What the adapter trains, where it is not the default (a checkpoint of a run before these options matches).
    from ..config import ModelConfig

    for key in ("lora_targets", "train_embeddings_norms"):
        if getattr(args, key) != getattr(ModelConfig, key):
            fingerprint[key] = getattr(args, key)
    return fingerprint


_FINGERPRINT_FLAGS = {
    "model": "--model", "seq_len": "--seq-len", "tokenizer": "--tokenizer", "seed": "--seed", "lora_rank": "--lora-rank",
    "lora_alpha": "--lora-alpha", "grad_accum": "--grad-accum", "dtype": "--dtype", "document_mask": "--document-mask",
    "rope_theta": "--rope-theta", "rope_scaling": "--rope-scaling", "lora_targets": "--lora-targets",
    "train_embeddings_norms": "--train-embeddings-norms",
}


_DATA_FLAGS = {"path": "--data", "split": "--data-split", "format": "--data-format", "text_field": "--text-field",
               "chat_template": "--chat-template", "loss_on": "--loss-on", "long_examples": "--long-examples"}
"""The data settings (DataConfig fields) that decide the training tokens besides the fingerprint facts (--seq-len,
--tokenizer, --document-mask), with their flags."""


def _data_settings(args: argparse.Namespace, tokenizer) -> dict:
    """meta.json's settings "data": the data settings of ``_DATA_FLAGS`` (paths resolved) and ``tokenizer_sha256``,
    a digest of the tokenizer's encoding; where a resumed run's tokens differ from the checkpoint's, they say
    whether a setting differs or the same settings read other data (or another tokenizer) than the run did."""
    import hashlib

    from ..data.tokenizer import tokenizer_digest

    data = args.job.data
    settings = {k: getattr(data, k) for k in _DATA_FLAGS}
    for k in ("path", "chat_template"):
        settings[k] = settings[k] and str(Path(settings[k]).expanduser().resolve())
    settings["tokenizer_sha256"] = hashlib.sha256(tokenizer_digest(tokenizer)).hexdigest()
    return settings


def _check_resume_fingerprint(saved: dict | None, now: dict, path: Path, saved_data: dict | None = None,
                              now_data: dict | None = None, resume: str = "--resume") -> None:
    """Refuse a --resume whose checkpoint's run differs in a fingerprint fact, naming flags and both values
    (load_checkpoint checks the same facts with their internal names; this says it the CLI's way). Where only the
    data's tokens differ, ``saved_data`` and ``now_data`` (the checkpoint's and this run's
    :func:`_data_settings`; None: not known) tell a data setting that differs (named as the other facts are) from
    the same settings over changed data or a changed tokenizer, which is refused as such. ``resume``: how the user gave
    the resume setting (:func:`~oomb.cli.errors._named`), the subject of the refusals."""
    if saved is None:
        return  # unreadable meta.json: load_checkpoint names the file
    differ = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if not differ:
        return
    data_part = "the --data tokens differ"
    if "data_sha256" in differ and isinstance(saved_data, dict) and now_data is not None:
        keys = [k for k in _DATA_FLAGS if saved_data.get(k) != now_data.get(k)]
        if keys:
            data_part += " (" + "; ".join(f"{_DATA_FLAGS[k]} {_show(saved_data.get(k))} there, "
                                          f"{_show(now_data.get(k))} here" for k in keys) + ")"
        elif differ == ["data_sha256"]:
            _refuse_changed_inputs(saved_data, now_data, path, resume)

    fix = "resume with that run's settings, or start a new run without --resume in another --output-dir"
    parts = []
    for k in differ:
        if k == "tokenizer":  # None: the bundled one, whatever the flags said
            parts.append(f"tokenizer {saved.get(k) or 'bundled'} there, {now.get(k) or 'bundled'} here")
            if saved.get(k) is None:
                from ..data.tokenizer import BUNDLED_TOKENIZER

                fix = (f"resume with that run's settings (its bundled tokenizer: --tokenizer {BUNDLED_TOKENIZER}), or "
                       "start a new run without --resume in another --output-dir")
        elif k == "data_sha256":
            parts.append(data_part)
        elif k == "world_size":
            parts.append(f"{saved.get(k)} ranks there, {now.get(k)} here")
        else:
            parts.append(f"{_FINGERPRINT_FLAGS.get(k, k)} {_show(saved.get(k))} there, {_show(now.get(k))} here")
    raise UsageError(
        f"{resume}: {path} is a checkpoint of another run ({'; '.join(parts)})", fix)


def _show(v):
    """A setting's value as a flag takes it: (not given), on, off, or the value."""
    return "(not given)" if v is None else ("on" if v is True else "off" if v is False else v)


def _refuse_changed_inputs(saved_data: dict, now_data: dict, path: Path, resume: str = "--resume") -> None:
    """Refuse a --resume whose tokens differ from the checkpoint's run though every setting is the same: the
    tokenizer's encoding changed, else the contents of the data (or of the --chat-template file) did."""
    again = "or start a new run without --resume in another --output-dir"
    if "tokenizer_sha256" in saved_data and saved_data["tokenizer_sha256"] != now_data["tokenizer_sha256"]:
        raise UsageError(f"{resume}: the tokenizer changed since {path} was saved (the tokens differ though "
                         "--tokenizer and the data settings are the same)",
                         f"restore the tokenizer the run trained with, {again}")
    what = "the data's contents" + (" (or the --chat-template file's)" if now_data.get("chat_template") else "")
    data = now_data.get("path") or "the bundled corpus"
    raise UsageError(f"{resume}: {what} changed since {path} was saved (the --data tokens differ though the data "
                     f"settings are the same: {data})", f"restore the data the run trained on, {again}")


_RESUME_SETTINGS = ("sparse", "page_budget", "sink_pages", "local_pages", "sparse_score", "chunk_size", "page_size",
                    "optimizer", "shard")
"""Settings saved with every checkpoint (meta.json "settings") and compared on --resume: a different sparse
attention changes the gradients (refused); a different chunk or page size changes them only with --sparse (the
selection is per chunk and page), while dense attention is exact at any (a note); another optimizer cannot
load the checkpoint's optimizer state (refused; a checkpoint that records none was written with adamw); another
shard mode has another checkpoint format (refused; one that records none was unsharded)."""
_SAVED_DEFAULTS = {"optimizer": "adamw", "shard": "none"}


def _resume_settings(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in _RESUME_SETTINGS}


def _checkpoint_settings(args: argparse.Namespace, device, tokenizer) -> dict:
    """meta.json's "settings" of every checkpoint: those --resume compares (``_RESUME_SETTINGS``), the device
    the run drew its weights on, which a LoRA checkpoint of a random preset is rebuilt on when it is read as a model
    (:mod:`oomb.cli.checkpoint_model`) and which --resume compares for such a run only, and the data settings
    (:func:`_data_settings`), which say why a resumed run's tokens differ."""
    return {**_resume_settings(args), "device": device.type, "data": _data_settings(args, tokenizer)}


def _setting_text(name: str, value) -> str:
    if name == "sparse":
        return "--sparse" if value else "no --sparse"
    return f"--{name.replace('_', '-')} {value}"


def _check_resume_settings(args: argparse.Namespace, saved: dict | None, path: Path) -> list[str]:
    """Refuse a --resume whose checkpoint was trained with other engine settings that change the training
    (``_RESUME_SETTINGS``), or is a LoRA adapter on a random preset drawn on another device; return notes on the
    harmless differences (and on a checkpoint that recorded none)."""
    resume = _named(args, "output.resume", "--resume")
    if saved is None:
        return [f"{resume}: {path} records no engine settings (an older oomb wrote it): check that --sparse, "
                "its options, --chunk-size and --page-size are the run's, as they are not checked"]
    drawn_on = saved.get("device")
    if drawn_on not in (None, args.device) and args.lora_rank > 0 and args.model in _preset_names():
        raise UsageError(
            f"{resume}: {path} is a LoRA run on the random preset {args.model!r}, whose weights were drawn on "
            f"{drawn_on}; drawn again on {args.device} they are other weights under the same adapter",
            f"continue it with --device {drawn_on}")
    now = _resume_settings(args)
    sparse = bool(saved.get("sparse")) or args.sparse
    saved = {**_SAVED_DEFAULTS, **saved}
    differ = [k for k in _RESUME_SETTINGS if k in saved and saved[k] != now[k]]
    refused = [k for k in differ if sparse or k not in ("chunk_size", "page_size")]
    if refused:
        was = ", ".join(_setting_text(k, saved[k]) for k in refused)
        raise UsageError(
            f"{resume}: {path} was trained with {was} but this command has "
            f"{', '.join(_setting_text(k, now[k]) for k in refused)}, which would silently change the training",
            f"continue it with the checkpoint's settings ({was}), or start a new run without --resume in another "
            "--output-dir",
        )
    return [f"{resume}: {path} was trained with {', '.join(_setting_text(k, saved[k]) for k in differ)}; this run "
            f"has {', '.join(_setting_text(k, now[k]) for k in differ)}: dense attention gives the same gradients at "
            "any chunk and page size (up to rounding), so it continues"] if differ else []
