"""An ``oomb train`` checkpoint read as a model by ``oomb eval`` and ``oomb grad-error``: ``--model`` naming a
checkpoint folder (``<output-dir>/checkpoints/step-N``), or the output folder of a run that stopped before it saved
its model (a signal, a time limit), which is read at its latest complete checkpoint.

The model is rebuilt as the run built it, from the checkpoint's meta.json: its base (a preset drawn again from the
run's seed, on the device the run recorded, or a model folder), --rope-theta / --rope-scaling, and for a LoRA run
the adapter (rank, alpha, targets, embeddings and norms), which is then merged into the base in memory. The
trainable weights are loaded after every file of the checkpoint is verified (size and SHA-256).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from .errors import UsageError, _one_line


def _checkpoint_to_read(model: str, flag: str = "--model") -> Path | None:
    """The checkpoint folder ``--model`` names (a folder with a meta.json beside a checkpoint's files, readable or
    not: reading it names what is wrong), or the latest complete checkpoint of a run folder that holds no saved model
    (no config.json, no adapter_config.json) or of its checkpoints folder; None for anything else (a preset, a
    model or adapter folder).

    Raises:
        UsageError: ``--model`` is a run folder that holds neither a saved model nor a complete checkpoint (named
            as ``flag``, the command's name for the argument).
    """
    from ..checkpoint import find_latest, is_checkpoint_folder

    folder = Path(model).expanduser()
    if not folder.is_dir():
        return None
    if is_checkpoint_folder(folder):
        return folder
    if (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file():
        return None
    for root in (folder / "checkpoints", folder):  # a run folder, or its checkpoints folder
        latest = find_latest(root) if root.is_dir() else None
        if latest is not None:
            return latest
    from .output import _looks_like_oomb_output

    if _looks_like_oomb_output(folder):
        raise UsageError(f"{flag} {model!r} is the output folder of an oomb train run that stopped before it saved its "
                         "model or a complete checkpoint", "train it again (--save-every N keeps checkpoints on the way), "
                         "or pass a model folder or a preset")
    return None


def _instead(checkpoint: Path) -> str:
    """The fix of a checkpoint that cannot be read: its run's newest earlier checkpoint that has all its files."""
    from ..checkpoint import intact_before

    earlier = intact_before(checkpoint)
    if earlier:
        return f"pass the earlier checkpoint beside it, {shlex.quote(str(earlier[0]))}, or restore the file"
    return "restore the file from a copy, or pass the run's saved model"


def _meta(checkpoint: Path) -> tuple[dict, dict]:
    """(fingerprint, settings) of the checkpoint's meta.json, its structure checked.

    Raises:
        UsageError: meta.json is missing, corrupt or damaged, or holds the parameter shards of several ranks.
    """
    from ..checkpoint import CheckpointError, read_meta

    try:
        meta = read_meta(checkpoint)
    except CheckpointError as exc:
        problem = _one_line(exc).rpartition("; ")[0] or _one_line(exc)
        raise UsageError(problem, _instead(checkpoint)) from exc
    sharded = meta.get("sharded")
    if isinstance(sharded, dict) and sharded.get("world_size"):
        raise UsageError(f"{checkpoint} holds the parameter shards of {sharded['world_size']} ranks (--shard)",
                         "finish the run with --resume under torchrun so that it saves its model, and pass that folder")
    settings = meta.get("settings")
    return meta.get("fingerprint") or {}, settings if isinstance(settings, dict) else {}


def _checked(checkpoint: Path, key: str, value, ok: bool, want: str):
    """``value`` where ``ok``, else the UsageError of a meta.json value a hand or a disk changed."""
    if not ok:
        raise UsageError(f"{checkpoint / 'meta.json'} has {key} {json.dumps(value)}, not {want}: it was edited or is "
                         "damaged", _instead(checkpoint))
    return value


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _run_tokenizer(checkpoint: Path) -> str | None:
    """The tokenizer folder of the checkpoint's run, as its fingerprint records it (None: the bundled one).

    Raises:
        UsageError: meta.json cannot be read, or names a tokenizer folder that is not there.
    """
    meta, _ = _meta(checkpoint)
    tokenizer = meta.get("tokenizer")
    _checked(checkpoint, "tokenizer", tokenizer, tokenizer is None or isinstance(tokenizer, str), "a folder or null")
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise UsageError(f"the tokenizer folder of the checkpoint's run, {tokenizer!r}, does not exist",
                         "put it back there, or pass --tokenizer the folder it is in now")
    return tokenizer


def _checkpoint_model(checkpoint: Path, given: str, device, dtype, flag: str = "--model"):
    """The model of ``checkpoint`` (``given``: how the argument ``flag`` named it), on ``device`` in ``dtype``; a
    note on stderr where ``given`` is a run folder read at its latest checkpoint.

    Raises:
        UsageError: meta.json is damaged or holds a value no run writes, the checkpoint holds the parameter shards
            of several ranks, names a base model that cannot be built, or a file of it is missing, truncated or
            corrupt (naming the earlier checkpoint that is intact).
    """
    import torch

    from ..checkpoint import CheckpointError, load_checkpoint
    from ..config import ModelConfig
    from ..models.hf import UnsupportedModelError
    from ..models.presets import PRESETS, UnknownModelError, build_model

    meta, settings = _meta(checkpoint)
    base = meta.get("model")
    _checked(checkpoint, "model", base, isinstance(base, str) and bool(base.strip()), "a model name or folder")
    lora_rank = meta.get("lora_rank", 0)
    _checked(checkpoint, "lora_rank", lora_rank, isinstance(lora_rank, int) and not isinstance(lora_rank, bool)
             and lora_rank >= 0, "a rank of 0 or more")
    seed = meta.get("seed", 0)
    _checked(checkpoint, "seed", seed, isinstance(seed, int) and not isinstance(seed, bool), "an integer")
    run_dtype = meta.get("dtype", "float32")
    _checked(checkpoint, "dtype", run_dtype, run_dtype in ("float32", "bfloat16", "float16"), "float32 or bfloat16")
    theta, scaling = meta.get("rope_theta"), meta.get("rope_scaling")
    _checked(checkpoint, "rope_theta", theta, theta is None or (_number(theta) and theta > 0), "a positive number")
    _checked(checkpoint, "rope_scaling", scaling, scaling is None or isinstance(scaling, dict), "a mapping")
    alpha = meta.get("lora_alpha")
    _checked(checkpoint, "lora_alpha", alpha, alpha is None or _number(alpha), "a number")
    targets = meta.get("lora_targets", ModelConfig.lora_targets)
    _checked(checkpoint, "lora_targets", targets, isinstance(targets, str) and bool(targets.strip()), "module names")
    trained = meta.get("train_embeddings_norms", ModelConfig.train_embeddings_norms)
    _checked(checkpoint, "train_embeddings_norms", trained, isinstance(trained, bool), "true or false")
    if base not in PRESETS and not Path(base).is_dir():
        raise UsageError(f"{flag} {given!r}: the base model folder of its run, {base!r}, does not exist",
                         "put the base model back there")
    # A preset's random weights are drawn again as the run drew them: same seed, device and dtype. A full
    # fine-tune's checkpoint replaces every one of them; a LoRA adapter's keeps them.
    run_device = device.type
    if base in PRESETS and lora_rank:
        if "device" in settings:
            run_device = _checked(checkpoint, "device", settings["device"], settings["device"] in ("cpu", "cuda"),
                                  "cpu or cuda")
        else:
            print(f"oomb: note: {checkpoint} does not record the device of its run, which drew the random preset "
                  f"{base!r} under its LoRA adapter: drawn here on {device.type}, the same weights only if the run "
                  "was on it too", file=sys.stderr)
    if run_device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{flag} {given!r}: its base is the random preset of a run on cuda, whose weights only a CUDA "
                         "GPU draws again", "read it on a machine with a CUDA GPU (--device cuda)")
    torch.manual_seed(seed)
    try:
        model = build_model(base, dtype=getattr(torch, run_dtype), device=run_device)
    except (UnknownModelError, UnsupportedModelError) as exc:
        raise UsageError(f"{flag} {given!r}: cannot build the base model of its run ({_one_line(exc)})",
                         "put the run's base model back where it was") from exc
    if theta is not None or scaling:
        from ..models.rope import set_rope

        try:
            set_rope(model, rope_theta=theta, rope_scaling=scaling)
        except ValueError as exc:
            _checked(checkpoint, "rope_scaling", scaling, False, f"RoPE scaling this model takes ({_one_line(exc)})")
    if lora_rank:
        from ..models.lora import LoraTargetError, apply_lora

        try:
            model = apply_lora(model, lora_rank, alpha, targets, trained)
        except LoraTargetError as exc:
            _checked(checkpoint, "lora_targets", targets, False, f"linear layers of the model ({_one_line(exc)})")
    try:
        load_checkpoint(checkpoint, model, None, None, meta, trainer_state=False)
    except CheckpointError as exc:
        problem = _one_line(exc).rpartition("; ")[0] or _one_line(exc)
        raise UsageError(problem, _instead(checkpoint)) from exc
    if Path(given).expanduser() != checkpoint:
        print(f"oomb: note: {given} holds no saved model: reading its latest checkpoint, {checkpoint.name}",
              file=sys.stderr)
    if lora_rank:
        model = model.merge_and_unload()
    return model.to(device=device, dtype=dtype)
