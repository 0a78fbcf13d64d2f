"""Built-in model presets (random weights) and loading of local Hugging Face models.

A preset is a transformers config with random initial weights: ``tiny`` runs a
real training job on two CPU cores in minutes; ``qwen2.5-0.5b``, ``qwen2.5-7b``,
``qwen2.5-32b`` and ``qwen2.5-72b`` have the shapes of the released Qwen2.5 models
for GPU runs and benchmarks (docs/design.md §3 uses the 7B shape; the two larger
ones need more than one GPU: --shard, docs/design.md §8). Every preset's vocabulary covers
the bundled 32,000-token tokenizer, and every preset allows positions past one
million tokens (RoPE is computed per position, so this costs no memory).

Nothing is ever fetched from a hub: a name that is not a preset must be a local
directory holding a Hugging Face checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

__all__ = ["PRESETS", "Preset", "UnknownModelError", "build_model", "check_config_supported", "load_config", "preset_config", "preset_names"]

_MAX_POSITIONS = 1 << 22
"""4,194,304 tokens: the position limit of every preset (the published system trains 4M tokens)."""


class UnknownModelError(ValueError):
    """The model name is neither a preset nor a local Hugging Face directory."""


@dataclass(frozen=True)
class Preset:
    """One named model config; ``make()`` returns a fresh transformers config."""

    description: str
    make: Callable[[], PretrainedConfig]


_TINY_SHAPE = dict(
    vocab_size=32000,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=_MAX_POSITIONS,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
"""The shape every tiny preset shares: ~5.3M parameters, 4.1M of them the tied 32,000 x 128 embedding."""


def _tiny() -> PretrainedConfig:
    return Qwen2Config(**_TINY_SHAPE, rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False)


def _tiny_llama() -> PretrainedConfig:
    return LlamaConfig(**_TINY_SHAPE, rope_theta=5e5, rms_norm_eps=1e-5)


def _tiny_mistral() -> PretrainedConfig:
    return MistralConfig(**_TINY_SHAPE, rope_theta=1e6, sliding_window=None)


def _tiny_qwen3() -> PretrainedConfig:
    return Qwen3Config(**_TINY_SHAPE, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False)


def _qwen25_05b() -> PretrainedConfig:
    # Shape of Qwen/Qwen2.5-0.5B (494M parameters, tied embeddings).
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=_MAX_POSITIONS,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151643,
    )


def _qwen25_7b() -> PretrainedConfig:
    # Shape of Qwen/Qwen2.5-7B (7.6B parameters): the model of docs/design.md §3.
    return Qwen2Config(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=_MAX_POSITIONS,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151643,
    )


def _qwen25_large(hidden: int, intermediate: int, layers: int, heads: int) -> PretrainedConfig:
    # The larger Qwen2.5 shapes (8 KV heads, untied embeddings), for models sharded over GPUs (--shard).
    return Qwen2Config(
        vocab_size=152064,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        max_position_embeddings=_MAX_POSITIONS,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151643,
    )


PRESETS: dict[str, Preset] = {
    "tiny": Preset("Qwen2-style, 4 layers, hidden 128, 4 query / 2 KV heads, vocab 32000 (CPU)", _tiny),
    "tiny-llama": Preset("Llama-style, 4 layers, hidden 128, 4 query / 2 KV heads, vocab 32000 (CPU)", _tiny_llama),
    "tiny-mistral": Preset("Mistral-style (no sliding window), 4 layers, hidden 128, vocab 32000 (CPU)", _tiny_mistral),
    "tiny-qwen3": Preset("Qwen3-style (QK norm), 4 layers, hidden 128, 4 query / 2 KV heads, vocab 32000 (CPU)", _tiny_qwen3),
    "qwen2.5-0.5b": Preset("Qwen2.5-0.5B shape, 24 layers, hidden 896, 14 query / 2 KV heads (GPU)", _qwen25_05b),
    "qwen2.5-7b": Preset("Qwen2.5-7B shape, 28 layers, hidden 3584, 28 query / 4 KV heads (GPU, bf16 ~15 GiB)", _qwen25_7b),
    "qwen2.5-32b": Preset("Qwen2.5-32B shape, 64 layers, hidden 5120, 40 query / 8 KV heads (GPUs, bf16 ~61 GiB)",
                          lambda: _qwen25_large(5120, 27648, 64, 40)),
    "qwen2.5-72b": Preset("Qwen2.5-72B shape, 80 layers, hidden 8192, 64 query / 8 KV heads (GPUs, bf16 ~135 GiB)",
                          lambda: _qwen25_large(8192, 29568, 80, 64)),
}


def preset_names() -> list[str]:
    """Names of the built-in presets, in table order."""
    return list(PRESETS)


def preset_config(name: str) -> PretrainedConfig:
    """A fresh transformers config for preset ``name``.

    Raises:
        UnknownModelError: ``name`` is not a preset; the message lists the presets.
    """
    if name not in PRESETS:
        raise UnknownModelError(
            f"unknown model {name!r}: not a preset and not a local directory; "
            f"use one of the presets ({', '.join(PRESETS)}) or a local Hugging Face model directory"
        )
    return PRESETS[name].make()


def _is_local_model_dir(path: str) -> bool:
    # A bare preset name always means the preset, even with a folder of that name in the working
    # directory; such a folder is written as a path ("./tiny").
    return path not in PRESETS and os.path.isdir(path)


def _training_output(path: str) -> tuple[str, str] | None:
    """What the folder ``path`` (without config.json) is of an ``oomb train`` run, and the ``oomb train`` arguments
    that continue that run, for a message: one checkpoint (``checkpoints/step-N``, whole or damaged), a run's
    ``checkpoints`` folder, or a run folder that stopped before it saved its model (checkpoints only); None for
    anything else."""
    from pathlib import Path

    from ..checkpoint import find_latest, is_checkpoint_folder

    folder = Path(path)
    if is_checkpoint_folder(folder):
        return "an oomb training checkpoint", f"--resume {path}"
    if find_latest(folder) is not None:
        return "the checkpoints folder of an oomb training run", f"--output-dir {folder.parent} --resume"
    if find_latest(folder / "checkpoints") is not None:
        return ("an oomb training run that stopped before it saved its model (it holds checkpoints only)",
                f"--output-dir {path} --resume")
    return None


def load_config(name_or_path: str) -> PretrainedConfig:
    """The transformers config of a preset or of a local model directory; no weights are read.

    Raises:
        UnknownModelError: neither a preset nor a directory with a readable ``config.json``.
    """
    if not _is_local_model_dir(name_or_path):
        return preset_config(name_or_path)
    path = name_or_path
    if not os.path.isfile(os.path.join(path, "config.json")):
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise UnknownModelError(
                f"{path!r} holds a LoRA adapter (adapter_config.json), not a full model; merge it into its base "
                f"model first ('oomb merge {path} --output-dir MERGED', or peft's merge_and_unload) and pass that "
                "folder"
            )
        run = _training_output(path)
        if run is not None:
            what, resume = run
            raise UnknownModelError(
                f"{path!r} is {what}, not a model folder (no config.json); write its model first "
                f"('oomb merge {path} --output-dir MODEL') and pass that folder, or continue the run with "
                f"'oomb train {resume}' and its other flags"
            )
        raise UnknownModelError(
            f"{path!r} is a directory without config.json; pass a Hugging Face model directory "
            f"(as written by save_pretrained) or one of the presets ({', '.join(PRESETS)})"
        )
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UnknownModelError(f"cannot read the model config in {path!r} ({first_line}); check that config.json is a valid Hugging Face config") from exc


def check_config_supported(config: PretrainedConfig) -> None:
    """Raise ``oomb.UnsupportedModelError`` if the engine cannot train a model of ``config``.

    Runs the engine's own checks, :func:`oomb.models.hf.check_model_config` and then
    :func:`oomb.models.hf.check_model_supported` on a model built on the meta device (no memory,
    no weights), so a large unsupported checkpoint is refused before it is read, in the words
    :class:`oomb.Engine` uses.
    """
    from .hf import check_model_config, check_model_supported

    check_model_config(config)  # before building: a model type transformers cannot build as a causal LM is named
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    check_model_supported(meta_model)


_MISSING_NAMES_SHOWN = 3
"""How many missing tensor names the refusal of a model folder with missing weights shows."""


_LOAD_REPORT_LOGGER = logging.getLogger("transformers.modeling_utils")
"""The logger that from_pretrained writes its per-tensor LOAD REPORT table (and its other warnings) to."""


@contextlib.contextmanager
def _held_load_report():
    """Hold back what from_pretrained logs (its LOAD REPORT table among it) inside the block; yields the records.

    A refused model folder then shows oomb's one line only; the caller re-emits the records otherwise.
    """
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    _LOAD_REPORT_LOGGER.addFilter(hold)
    try:
        yield held
    finally:
        _LOAD_REPORT_LOGGER.removeFilter(hold)


def _refuse_missing_weights(path: str, loading_info: dict) -> None:
    """Raise UnknownModelError if the weights of the folder ``path`` lack tensors the model needs.

    ``loading_info`` is what ``from_pretrained(..., output_loading_info=True)`` returns; its
    ``missing_keys`` leaves out what the model ties (an output layer shared with the input
    embedding), so only tensors that would start from random values are counted. Tensors the
    model does not use (``unexpected_keys``) are left to transformers' own warning.
    """
    missing = sorted(loading_info.get("missing_keys") or ())
    if not missing:
        return
    shown = ", ".join(missing[:_MISSING_NAMES_SHOWN]) + (", ..." if len(missing) > _MISSING_NAMES_SHOWN else "")
    raise UnknownModelError(
        f"the weights of the model folder {path!r} lack {len(missing)} of the model's tensors ({shown}), which "
        "would start from random values; re-save the complete model with save_pretrained, or copy the weight "
        "files again if some are missing or cut short"
    )


def build_model(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """Build a preset with random weights, or load a local Hugging Face causal LM.

    Args:
        name_or_path: a key of :data:`PRESETS` or a local directory holding
            ``config.json`` and weights. Never fetched from a hub.
        dtype: parameter dtype (``torch.bfloat16`` on GPU, ``torch.float32`` on CPU).
        device: where the parameters live. Presets are initialised directly on it.

    Returns:
        A transformers ``*ForCausalLM`` module in train mode. Random weights
        depend on the global torch seed (``torch.manual_seed`` before calling).

    Raises:
        UnknownModelError: neither a preset nor a readable local model directory, or a directory
            whose weights lack tensors the model needs (tied ones aside).
        oomb.UnsupportedModelError: a model the engine cannot train (checked
            before any weight is read).
        TypeError: ``name_or_path`` is neither a string nor a path.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a preset name or a local model folder, got "
                        f"{type(name_or_path).__name__}; pass e.g. build_model('tiny') or build_model('path/to/model')")
    device = torch.device(device)
    config = load_config(name_or_path)
    check_config_supported(config)
    if _is_local_model_dir(name_or_path):
        try:
            with _held_load_report() as held:
                model, loading_info = AutoModelForCausalLM.from_pretrained(
                    name_or_path, dtype=dtype, local_files_only=True, output_loading_info=True
                )
        except Exception as exc:  # OSError (no weights file), SafetensorError (truncated), ...
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            hint = ""
            if os.path.exists(os.path.join(name_or_path, "adapter_config.json")):
                hint = " (it holds a LoRA adapter: merge it into its base model first, e.g. peft's merge_and_unload)"
            raise UnknownModelError(
                f"could not read the weights of the model folder {name_or_path!r}{hint}: {type(exc).__name__}: {reason}. "
                "A model folder needs config.json and the weights save_pretrained writes (model.safetensors, or "
                "sharded files with their index); re-save the model, or copy the file again if it was cut short"
            ) from exc
        _refuse_missing_weights(name_or_path, loading_info)
        for record in held:  # complete weights: transformers' warnings (unused tensors, say) are shown as they would be
            _LOAD_REPORT_LOGGER.handle(record)
        model.to(device)
    else:
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.train()
    return model
