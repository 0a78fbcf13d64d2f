"""``oomb merge ADAPTER_DIR --output-dir DIR``: a LoRA adapter merged into its base model (peft's
``merge_and_unload``), written with its tokenizer as a folder ``AutoModelForCausalLM`` and ``AutoTokenizer`` load
as-is."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from .errors import UsageError, _named
from .lock import LOCK_NAME, OutputLock, live_holder
from .output import _check_writable_dir_path


def _adapter_dir(given: str | None, args: argparse.Namespace | None = None) -> Path:
    if given is None or not str(given).strip():
        raise UsageError("oomb merge needs ADAPTER_DIR (or merge.adapter in --config FILE)",
                         "pass the --output-dir of an 'oomb train --lora-rank' run")
    shown = _named(args, "merge.adapter", "ADAPTER_DIR")
    path = Path(given).expanduser().resolve()
    if not path.is_dir():
        raise UsageError(f"{shown} {given!r} {'is a file' if path.exists() else 'does not exist'}",
                         "pass the --output-dir of an 'oomb train --lora-rank' run")
    if not (path / "adapter_config.json").is_file():
        full = " (it holds a full model: it loads as it is, there is nothing to merge)" if (path / "config.json").is_file() else ""
        raise UsageError(f"{shown} {given!r} is not a LoRA adapter folder: no adapter_config.json{full}",
                         "pass the --output-dir of an 'oomb train --lora-rank' run")
    _read_json(path / "adapter_config.json", "restore the adapter_config.json its run wrote (peft's LoRA settings)")
    return path


def _output_dir(given: str | None, adapter: Path, args: argparse.Namespace | None = None) -> Path:
    if given is None or not str(given).strip():
        raise UsageError("oomb merge needs --output-dir (or output.dir in --config FILE)",
                         "pass --output-dir DIR, a folder that is new or empty")
    shown = _named(args, "output.dir", "--output-dir")
    out = Path(given).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"{shown} {given!r} is a file", "pass a directory path that is new or empty")
    if out == adapter or (out.is_dir() and any(p.name != LOCK_NAME or p.is_dir() for p in out.iterdir())):
        raise UsageError(f"{shown} {given!r} exists and is not empty", "pass a new or empty directory")
    _refuse_if_written(out, shown, given)
    _check_writable_dir_path(shown, given, out)
    return out


def _refuse_if_written(out: Path, shown: str, given: str) -> None:
    """Refuse the output folder ``out`` (named ``shown`` ``given``) where a live ``oomb train`` holds its lock
    (:class:`~oomb.cli.lock.OutputLock`). The lock file of a run that ended is no content of the folder: a finished
    run deletes it, and one left by a killed run is held by no process.

    Raises:
        UsageError: naming the run that holds it.
    """
    holder = live_holder(out)
    if holder is not None:
        raise OutputLock(out, shown, given, "")._refusal(holder)


def _read_json(path: Path, restore: str) -> dict:
    """The JSON object of the file ``path``; {} where there is none. A file that cannot be read or holds no JSON
    object is one UsageError naming it, with ``restore`` as the fix."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise UsageError(f"{path} cannot be read ({exc.strerror or exc})", restore) from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is corrupt (not UTF-8 text)", restore) from exc
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{path} is corrupt (not valid JSON: {exc})", restore) from exc
    if not isinstance(value, dict):
        raise UsageError(f"{path} is corrupt (a JSON {type(value).__name__}, not an object)", restore)
    return value


_RESTORE_ARGS = "restore the train_args.json its run wrote (oomb train writes the run's options there)"


def _recipe_value(train_args: dict, file: Path, key: str, default):
    """``train_args[key]`` (``default`` where absent), refused as one UsageError naming the file, the key and the
    value where it is not what oomb train writes there."""
    value = train_args.get(key, default)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok, want = {
        "seed": (isinstance(value, int) and not isinstance(value, bool), "an integer (the run's --seed)"),
        "dtype": (value in ("auto", "float32", "bfloat16"), "auto, float32 or bfloat16 (the run's --dtype)"),
        "device": (value in ("cpu", "cuda"), "cpu or cuda (the run's --device)"),
        "rope_theta": (value is None or number and value > 0, "null or a number > 0 (the run's --rope-theta)"),
        "rope_scaling_dict": (value is None or isinstance(value, dict),
                              "null or an object of RoPE scaling settings (the run's --rope-scaling)"),
    }[key]
    if not ok:
        raise UsageError(f"{file} has {key} {json.dumps(value)}, not {want}: it was edited or is damaged",
                         f"set {key} back to the run's value, or {_RESTORE_ARGS}")
    return value


def _base_recipe(adapter: Path) -> dict:
    """How to rebuild the adapter's base model: {model, seed, dtype, device, rope_theta, rope_scaling}. From the
    train_args.json of an oomb run; else from adapter_config.json's base_model_name_or_path (a local folder)."""
    from ..models.presets import PRESETS

    file = adapter / "train_args.json"
    train_args = _read_json(file, _RESTORE_ARGS)
    base = _read_json(adapter / "adapter_config.json",
                      "restore the adapter_config.json its run wrote (peft's LoRA settings)").get("base_model_name_or_path")
    if "oomb_version" in train_args:
        model = train_args.get("model")
        if not isinstance(model, str) or not model.strip():
            raise UsageError(f"{file} has model {json.dumps(model)}, not a model name or folder: it was edited or is "
                             "damaged", f"set model back to the run's --model, or {_RESTORE_ARGS}")
        if model not in PRESETS:  # a folder: the absolute path adapter_config.json records (the run's own
            # --model may be relative to where it ran, and read from here it could name another model)
            if isinstance(base, str) and base.strip():
                model = base
            elif not os.path.isabs(model):
                raise UsageError(f"{file} names the base model folder {model!r} relative to where its run started, "
                                 "and adapter_config.json records no base_model_name_or_path",
                                 "set base_model_name_or_path in adapter_config.json to the base model's absolute folder")
        return dict(model=model, seed=_recipe_value(train_args, file, "seed", 0),
                    dtype=_recipe_value(train_args, file, "dtype", "auto"),
                    device=_recipe_value(train_args, file, "device", "cpu"),
                    rope_theta=_recipe_value(train_args, file, "rope_theta", None),
                    rope_scaling=_recipe_value(train_args, file, "rope_scaling_dict", None))
    if isinstance(base, str) and os.path.isdir(base) and base not in PRESETS:
        return dict(model=base, seed=0, dtype="float32", device="cpu", rope_theta=None, rope_scaling=None)
    raise UsageError(f"ADAPTER_DIR {str(adapter)!r} does not say where its base model is: no train_args.json of an "
                     f"oomb run and adapter_config.json's base_model_name_or_path ({base!r}) is not a local folder",
                     "set base_model_name_or_path in its adapter_config.json to the base model's folder")


def _build_base(recipe: dict):
    import torch

    from ..config import resolve_dtype
    from ..models.presets import PRESETS, UnknownModelError, build_model

    device = recipe["device"]
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("the adapter's base is the random preset of a run on cuda, whose weights only a CUDA GPU "
                         "draws again", "run oomb merge on a machine with a CUDA GPU")
    given = recipe["dtype"] if recipe["dtype"] in ("float32", "bfloat16") else "auto"  # anything else: as 'auto'
    dtype = getattr(torch, resolve_dtype(given, device))
    if recipe["model"] not in PRESETS and not os.path.isdir(recipe["model"]):
        raise UsageError(f"the adapter's base model folder {recipe['model']!r} does not exist",
                         "put the base model back there, or set base_model_name_or_path in adapter_config.json")
    torch.manual_seed(int(recipe["seed"]))  # a preset's random weights, drawn as oomb train drew them
    try:
        model = build_model(recipe["model"], dtype=dtype, device=device)
    except (UnknownModelError, ValueError) as exc:
        raise UsageError(f"cannot build the adapter's base model ({exc})", "check base_model_name_or_path") from exc
    if recipe["rope_theta"] is not None or recipe["rope_scaling"]:
        from ..models.rope import set_rope

        set_rope(model, rope_theta=recipe["rope_theta"], rope_scaling=recipe["rope_scaling"])
    return model


def _tokenizer(adapter: Path, recipe: dict):
    """The adapter folder's tokenizer, else the base folder's; None where neither has one."""
    from ..data import DataError, load_tokenizer
    from ..data.tokenizer import TOKENIZER_FILES
    from ..models.presets import PRESETS

    for folder in (adapter,) + (() if recipe["model"] in PRESETS else (Path(recipe["model"]),)):
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            try:
                return load_tokenizer(folder)
            except DataError as exc:  # no setting of the user's: the tokenizer files of the folder
                raise UsageError(exc.problem, f"replace the tokenizer files in {str(folder)!r} with the model's own "
                                 "(what a Hugging Face tokenizer's save_pretrained writes)") from exc
    return None


def _check_adapter_weights(adapter: Path, shown: str) -> None:
    """Refuse an adapter folder whose adapter_model.safetensors is missing or unreadable (truncated, corrupt) before
    its base is built; ``shown``: how the command's user gave the adapter. Only the file's header is read."""
    from safetensors import safe_open

    weights = adapter / "adapter_model.safetensors"
    if not weights.is_file():
        raise UsageError(f"{shown} has no adapter_model.safetensors (the adapter's trained weights)",
                         "restore it from a copy, or pass another adapter folder")
    try:
        with safe_open(str(weights), "pt") as f:
            f.keys()
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"{weights} cannot be read ({first}): it is truncated or corrupt",
                         "restore it from a copy, or pass another adapter folder") from exc


def _merged(base, adapter: Path, recipe: dict, shown: str):
    """``base`` with the LoRA adapter folder ``adapter`` merged into it; an adapter of another model is one
    UsageError naming ``shown`` (how the command's user gave the adapter) and the base."""
    from ..models.lora import merge_adapter

    try:
        return merge_adapter(base, adapter)
    except (ValueError, KeyError, RuntimeError, OSError) as exc:  # an adapter of another model
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"cannot load {shown} onto its base {recipe['model']!r} ({first})",
                         "pass an adapter trained on that base model") from exc


def _write_model(model, tokenizer, out: Path) -> None:
    """``model`` (and ``tokenizer`` where not None) written to a temporary folder beside ``out`` and moved into
    place, so that ``out`` is whole or absent."""
    from ..models.saving import save_tokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.oomb-merge-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        model.save_pretrained(str(tmp))
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        if out.is_dir():
            _refuse_if_written(out, "--output-dir", str(out))  # a run may have started into it since the check
            lock = out / LOCK_NAME
            if lock.is_file() or lock.is_symlink():  # left by a killed run: held by no process
                lock.unlink()
            out.rmdir()  # checked empty
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _merge_checkpoint(args: argparse.Namespace, checkpoint: Path) -> int:
    """``oomb merge CHECKPOINT``: the model of an ``oomb train`` checkpoint (a LoRA run's adapter merged into its
    base; a full fine-tune's weights as they are), rebuilt as ``oomb eval --model CHECKPOINT`` rebuilds it, written
    in its run's dtype with its run's tokenizer."""
    import torch

    from .checkpoint_model import _checkpoint_model, _meta, _run_tokenizer

    out = _output_dir(args.output_dir, checkpoint.resolve(), args)
    meta, _ = _meta(checkpoint)
    tokenizer_folder = _run_tokenizer(checkpoint)
    from transformers.utils import logging as hf_logging

    from ..data import load_tokenizer

    hf_logging.disable_progress_bar()
    dtype = getattr(torch, meta.get("dtype", "float32"), torch.float32)  # checked by _checkpoint_model
    model = _checkpoint_model(checkpoint, args.adapter_dir, torch.device("cpu"), dtype, "ADAPTER_DIR")
    _write_model(model, load_tokenizer(tokenizer_folder), out)
    what = f"its LoRA adapter merged into {meta['model']}" if meta.get("lora_rank") else "a full fine-tune"
    print(f"oomb: wrote the model of checkpoint {checkpoint} ({what}) to {out}", file=sys.stderr)
    return 0


def _merge(args: argparse.Namespace) -> int:
    """``oomb merge``: every check first; then the merged model and tokenizer are written to a temporary folder
    beside --output-dir and moved into place. ADAPTER_DIR may also be an ``oomb train`` checkpoint folder, or a run
    folder that stopped before saving its model (read at its latest complete checkpoint)."""
    if args.adapter_dir is not None and str(args.adapter_dir).strip():
        from .checkpoint_model import _checkpoint_to_read

        checkpoint = _checkpoint_to_read(str(args.adapter_dir), "ADAPTER_DIR")
        if checkpoint is not None:
            return _merge_checkpoint(args, checkpoint)
    adapter = _adapter_dir(args.adapter_dir, args)
    out = _output_dir(args.output_dir, adapter, args)
    recipe = _base_recipe(adapter)
    _check_adapter_weights(adapter, f"ADAPTER_DIR {str(adapter)!r}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    base = _build_base(recipe)
    tokenizer = _tokenizer(adapter, recipe)
    merged = _merged(base, adapter, recipe, f"ADAPTER_DIR {str(adapter)!r}")
    _write_model(merged, tokenizer, out)
    note = "" if tokenizer is not None else " (no tokenizer: neither the adapter nor its base folder has one)"
    print(f"oomb: merged {adapter} into {recipe['model']}; wrote {out}{note}", file=sys.stderr)
    return 0
