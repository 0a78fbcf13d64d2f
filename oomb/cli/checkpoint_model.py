"""An ``oomb train`` checkpoint read as a model by ``oomb eval`` and ``oomb grad-error``: ``--model`` naming a
checkpoint folder (``<output-dir>/checkpoints/step-N``), or the output folder of a run that stopped before it saved
its model (a signal, a time limit), which is read at its latest complete checkpoint.

The model is rebuilt as the run built it, from the checkpoint's meta.json: its base (a preset drawn again from the
run's seed, on the device the run recorded, or a model folder), --rope-theta / --rope-scaling, and for a LoRA run
the adapter (rank, alpha, targets, embeddings and norms), which is then merged into the base in memory. The
trainable weights are loaded after every file of the checkpoint is verified (size and SHA-256).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from .errors import UsageError, _one_line


def _checkpoint_to_read(model: str) -> Path | None:
    """The checkpoint folder ``--model`` names, or the latest complete checkpoint of a run folder that holds no saved
    model (no config.json, no adapter_config.json); None for anything else (a preset, a model or adapter folder)."""
    from ..checkpoint import find_latest, is_checkpoint_meta

    folder = Path(model).expanduser()
    if not folder.is_dir():
        return None
    if is_checkpoint_meta(folder / "meta.json"):
        return folder
    if (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file():
        return None
    return find_latest(folder / "checkpoints") if (folder / "checkpoints").is_dir() else None


def _run_tokenizer(checkpoint: Path) -> str | None:
    """The --tokenizer of the checkpoint's run (None: the bundled one, as oomb train reads without --tokenizer)."""
    from ..checkpoint import read_settings

    tokenizer = (read_settings(checkpoint, "fingerprint") or {}).get("tokenizer")
    return tokenizer if isinstance(tokenizer, str) else None


def _checkpoint_model(checkpoint: Path, given: str, device, dtype):
    """The model of ``checkpoint`` (``given``: how --model named it), on ``device`` in ``dtype``; a note on stderr
    where ``given`` is a run folder read at its latest checkpoint.

    Raises:
        UsageError: the checkpoint holds the parameter shards of several ranks, names a base model that cannot be
            built, or a file of it is missing, truncated or corrupt (naming the earlier checkpoints that are intact).
    """
    import torch

    from ..checkpoint import CheckpointError, intact_before, load_checkpoint, read_settings
    from ..models.hf import UnsupportedModelError
    from ..models.presets import PRESETS, UnknownModelError, build_model

    meta = read_settings(checkpoint, "fingerprint") or {}
    settings = read_settings(checkpoint) or {}
    sharded = read_settings(checkpoint, "sharded")
    if isinstance(sharded, dict) and sharded.get("world_size"):
        raise UsageError(f"--model {given!r}: {checkpoint} holds the parameter shards of {sharded['world_size']} ranks "
                         "(--shard)", "finish the run with --resume under torchrun so that it saves its model, and "
                         "pass that folder")
    base, lora_rank = meta.get("model"), int(meta.get("lora_rank") or 0)
    if not isinstance(base, str) or not base:
        raise UsageError(f"--model {given!r}: {checkpoint}/meta.json names no model", "pass a checkpoint oomb train wrote")
    if base not in PRESETS and not Path(base).is_dir():
        raise UsageError(f"--model {given!r}: the base model folder of its run, {base!r}, does not exist",
                         "put the base model back there, or pass the run's saved model instead")
    # A preset's random weights are drawn again as the run drew them: same seed, same device, same dtype. A full
    # fine-tune's checkpoint replaces every one of them; a LoRA adapter's keeps them.
    run_device = settings.get("device", device.type) if base in PRESETS and lora_rank else device.type
    if run_device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--model {given!r}: its base is the random preset of a run on cuda, whose weights only a CUDA "
                         "GPU draws again", "read it on a machine with a CUDA GPU (--device cuda)")
    run_dtype = getattr(torch, str(meta.get("dtype", "float32")), torch.float32)
    torch.manual_seed(int(meta.get("seed", 0)))
    try:
        model = build_model(base, dtype=run_dtype, device=run_device)
    except (UnknownModelError, UnsupportedModelError) as exc:
        raise UsageError(f"--model {given!r}: cannot build the base model of its run ({_one_line(exc)})",
                         "pass the run's saved model instead") from exc
    if meta.get("rope_theta") is not None or meta.get("rope_scaling"):
        from ..models.rope import set_rope

        set_rope(model, rope_theta=meta.get("rope_theta"), rope_scaling=meta.get("rope_scaling"))
    if lora_rank:
        from ..config import ModelConfig
        from ..models.lora import apply_lora

        model = apply_lora(model, lora_rank, meta.get("lora_alpha"), meta.get("lora_targets", ModelConfig.lora_targets),
                           bool(meta.get("train_embeddings_norms", ModelConfig.train_embeddings_norms)))
    try:
        load_checkpoint(checkpoint, model, None, None, meta)
    except CheckpointError as exc:
        problem = _one_line(exc).rpartition("; ")[0] or _one_line(exc)
        earlier = intact_before(checkpoint)
        fix = (f"pass --model {shlex.quote(str(earlier[0]))}, the earlier checkpoint of its run, or restore the file"
               if earlier else "restore the file from a copy, or pass the run's saved model")
        raise UsageError(problem, fix) from exc
    if Path(given).expanduser() != checkpoint:
        print(f"oomb: note: {given} holds no saved model (its run stopped before the end): reading its latest "
              f"checkpoint, {checkpoint.name}", file=sys.stderr)
    if lora_rank:
        model = model.merge_and_unload()
    return model.to(device=device, dtype=dtype)
