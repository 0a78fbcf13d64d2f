"""The ``oomb`` command line: ``oomb train`` fine-tunes a causal LM on long sequences; ``oomb plan``,
``oomb grad-error`` and ``oomb eval`` size and measure runs.

Every input is checked before anything is written: a bad input ends the
program with exit status 2 and one line on stderr, ``oomb: error: <problem>;
<fix>``, and leaves an existing output directory as it was. The trained model
(or LoRA adapter) is written to a temporary directory inside the output
directory and moved into place only when complete.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import NoReturn, Sequence

from .config import ConfigError, SparseConfig
from .config.engine import SMALL_SEGMENT_TOKENS

_SPARSE_DEFAULTS = {"page_budget": SparseConfig.page_budget, "sink_pages": SparseConfig.sink_pages,
                    "local_pages": SparseConfig.local_pages, "sparse_score": SparseConfig.score}
"""The flags of the sparse options and their defaults (those of :class:`oomb.config.SparseConfig`)."""

__all__ = ["main"]

_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
_EVAL_MAX_WINDOWS = 16
"""``oomb eval`` without --num-windows: every whole window of the data, at most this many."""
_LONG_WARMUP = 10_000
"""A default warm-up (10% of --steps) longer than this many steps is noted: longer than the warm-ups of published
LLM training runs (~2,000 steps), so most likely a --steps meant as 'until I stop it'."""


class UsageError(Exception):
    """A bad input: ``problem`` and ``fix`` are printed on one line; exit status 2."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix


class _RunError(UsageError):
    """Training failed after it started (out of memory, diverged): one line, exit status 1."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(message: str, status: int = 2) -> NoReturn:
    print(f"oomb: error: {_one_line(message)}", file=sys.stderr)
    raise SystemExit(status)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``oomb: error: ...; see --help``) instead of usage + message."""

    def error(self, message: str) -> NoReturn:  # noqa: D102 - argparse API
        _fail(f"{message}; run '{self.prog} --help' for the options")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show '(default: X)' only where there is a meaningful default: not for None, nor for flags (store_true,
    whose default False only means 'off'). A numeric 0 is shown (``0 in (None, False)`` is true in Python, which
    hid --seed's, --lora-rank's and --save-every's defaults)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        # argparse wraps at hyphens too, which cut flag names in two ('--chunk-' / 'size').
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool) \
                or action.nargs == 0:  # flags: store_true/store_false/store_const
            return action.help
        return super()._get_help_string(action)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("oomb")
    except Exception:  # pragma: no cover - not installed
        from . import __version__

        return __version__


_DESCRIPTIONS = {
    "train": (
        "train a model on long token sequences",
        "Train a causal LM with oomb's chunk-recurrent step. Defaults: the 'tiny' preset on the bundled Austen corpus "
        "and tokenizer, on CPU. Writes <output-dir>/log.jsonl (one JSON line per step) and the final model (or LoRA "
        "adapter) and tokenizer as safetensors.",
    ),
    "plan": (
        "predict GPU and host memory of a run and the largest context that fits",
        "Predict GPU and host memory of one training step before anything is allocated, choose the KV tiering (all "
        "pages on the GPU, or offload to pinned host memory) and report the largest context that fits this machine "
        "(or the one described by --gpu-gib/--host-gib; with --gpu-page-budget, through that GPU pool). It takes "
        "the flags and --config file of 'oomb train' and plans the run they describe.",
    ),
    "grad-error": (
        "measure the gradient error of sparse attention against dense on one sequence",
        "Run one dense step and one sparse step per page budget on the same sequence (the first of the seeded data "
        "order) and print the relative gradient error ||g_sparse - g_dense|| / ||g_dense|| per parameter kind (or "
        "per parameter). Nothing is trained or written, except --json.",
    ),
    "eval": (
        "held-out loss at long context, dense and with sparse attention",
        "Evaluate the mean token loss of a model on consecutive, non-overlapping --seq-len token windows of the data, "
        "in file order (not shuffled: two runs read the same tokens), once with dense attention and once per sparse "
        "page budget. Prints a Markdown table (loss, perplexity, change vs dense, tokens, seconds); nothing is "
        "trained or written, except --json. Pass held-out text as --data: the default is the training corpus.",
    ),
    "bench": (
        "time one training step of oomb next to plain Hugging Face training",
        "Time one training step (forward + backward, no optimizer) of oomb's chunk-recurrent engine next to plain "
        "Hugging Face training of the same model -- SDPA attention over the whole sequence, per-layer gradient "
        "checkpointing, chunked cross-entropy -- on the same random tokens, per --lengths. Prints seconds, tokens/s, "
        "oomb's speed relative to hf, the peak GPU memory and the first step's seconds; a step out of memory is a "
        "row, and the run goes on. Both systems are timed at their --steps'th step on the same sequence (oomb on one "
        "engine): the first allocates memory and builds kernels (oomb also its page store), which a training run "
        "pays once. Nothing is trained or written, except --json.",
    ),
}
_HELP = {
    "grad-error": {"--sink-pages": "sparse runs: first pages of the sequence always attended (attention sink); 0 allowed",
                   "--local-pages": "sparse runs: latest past pages always attended; 0 allowed",
                   "--sparse-score": "sparse runs: page score (mean key, or Quest's min/max bound)"},
    "eval": {"--sink-pages": "with --budgets: first pages of the sequence always attended (attention sink); 0 allowed",
             "--local-pages": "with --budgets: latest past pages always attended; 0 allowed",
             "--sparse-score": "with --budgets: page score (mean key, or Quest's min/max bound)"},
}
"""Where a field's docstring reads wrong for one command (eval and grad-error make their own sparse runs)."""

META_FLAGS = ("--help", "--version", "--config", "--print-config")
"""The only flags that are not configuration fields: they say what to do with the configuration."""


def _build_parser(suppress: bool = False) -> argparse.ArgumentParser:
    """The ``oomb`` parser, every subcommand's flags generated from the configuration fields
    (:func:`oomb.config.flags.add_flags`). With ``suppress`` no defaults are set, so that the namespace holds
    only the flags given on the command line."""
    from .config.flags import add_flags

    parser = _Parser(
        prog="oomb",
        description="Chunk-recurrent long-context training of Hugging Face causal LMs (paged KV cache).",
    )
    parser.add_argument("--version", action="version", version=f"oomb {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for command, (short, description) in _DESCRIPTIONS.items():
        p = sub.add_parser(command, help=short, description=description, formatter_class=_HelpFormatter)
        p.add_argument("--config", default=None if not suppress else argparse.SUPPRESS, metavar="FILE",
                       help="read the settings from this YAML file (sections model, data, engine, train, output, ...; "
                            "see --print-config); flags given override it")
        p.add_argument("--print-config", action="store_true", default=False if not suppress else argparse.SUPPRESS,
                       help="print the effective configuration (defaults, --config file, flags) as YAML that "
                            "--config reads back, and exit")
        add_flags(p, command, suppress=suppress, help_overrides=_HELP.get(command))
    return parser


# ---------------------------------------------------------------- checks


def _check_sparse_flags(args: argparse.Namespace, enabled: bool, enabler: str, names: Sequence[str], how: str) -> None:
    """eval's sparse options (``names``), which only its ``enabler`` (--budgets) uses: none set while it is not
    given (it would be silently ignored)."""
    if not enabled:
        given = [f"--{k.replace('_', '-')}" for k in names if getattr(args, k) != _SPARSE_DEFAULTS[k]]
        if given:
            raise UsageError(
                f"{' and '.join(given)} {'sets' if len(given) == 1 else 'set'} sparse attention but {enabler} is not given",
                f"{how}, or leave them out for dense attention",
            )


def _check_cpu_memory(args: argparse.Namespace, model_config: object, dtype: "torch.dtype") -> None:
    """Refuse a CPU run whose weights, gradients and AdamW states alone exceed the available RAM (a lower
    bound: activations and the KV store come on top), before any weight is allocated."""
    from .memory import ModelShape, base_gpu_bytes as _base_gpu, host_memory as _host_memory

    shape = ModelShape.from_config(model_config)
    n = shape.num_params()

    def need(rank: int) -> int:  # as oomb plan counts them
        _, _, weights, grads, optim, _ = _base_gpu(
            shape, min(args.chunk_size, args.seq_len), args.chunk_size, dtype, rank, "adamw", args.checkpoint_layers,
            "torch", 4096, 1024, args.grad_accum_dtype)
        return weights + grads + optim

    available = _host_memory()[0]
    if need(args.lora_rank) <= available:
        return
    lora = not args.lora_rank and need(8) <= available
    raise UsageError(
        f"--model {args.model} ({n / 1e9:.2f}B parameters) needs at least {need(args.lora_rank) / 2**30:.1f} GiB of memory "
        f"on the CPU for its weights, {'adapter ' if args.lora_rank else ''}gradients and AdamW states, but "
        f"{available / 2**30:.1f} GiB is available",
        (f"use --lora-rank 8 (~{need(8) / 2**30:.1f} GiB), " if lora else "use ") + "a smaller --model (e.g. tiny), or --device cuda",
    )


def _check_offload_flags(args: argparse.Namespace) -> None:
    """--offload-segment-pages with --sparse is not used (train and plan): a warning."""
    if args.offload_segment_pages is not None and getattr(args, "sparse", False):
        warnings.warn("--offload-segment-pages is not used with --sparse: sparse attention reads the past through one "
                      "block table, so offload stages whole layers (leave the flag out)", stacklevel=2)


def _warn_if_offload_moves_nothing(args: argparse.Namespace, num_layers: int) -> None:
    """Warn (once, where the run is set up) when an explicit --gpu-page-budget holds every KV page of the run:
    the offloaded store then keeps all of them in its GPU tier and moves nothing to the host (train, eval and
    plan)."""
    budget = args.gpu_page_budget
    per_layer = -(-args.seq_len // args.page_size)
    pages = num_layers * per_layer  # as OffloadedKVStore.pages_needed
    if budget is None or args.offload == "off" or budget < pages:
        return
    drop = "--gpu-page-budget" if args.offload != "on" else "--offload on and --gpu-page-budget"
    warnings.warn(
        f"--gpu-page-budget {budget} holds all {pages} KV pages of this run ({num_layers} layers x {per_layer} pages of "
        f"--seq-len {args.seq_len} / --page-size {args.page_size}), so every page stays on the GPU and offload moves "
        f"nothing to the host at this length; drop {drop} to run without offload, or pass a --gpu-page-budget below "
        f"{pages} to offload", stacklevel=2)


def _warn_if_offload_on_keeps_every_page(args: argparse.Namespace, offloads: bool, num_layers: int) -> None:
    """Warn when --offload on (no --gpu-page-budget) is planned with every KV page on the GPU: they all fit, so
    the run keeps them there and moves nothing to the host (plan, and train on a GPU; a fresh-user review found
    the flag ignored without a word)."""
    if args.offload != "on" or args.gpu_page_budget is not None or offloads:
        return
    pages = num_layers * -(-args.seq_len // args.page_size)
    warnings.warn(
        f"--offload on: all {pages} KV pages of this run fit on the GPU, so every page stays there and nothing is "
        f"offloaded to the host (as with --offload auto); pass a --gpu-page-budget below {pages} to keep only part "
        "of them on the GPU", stacklevel=2)


def _warn_if_gpu_saved_attention_on_cpu(args: argparse.Namespace, device) -> None:
    """Warn that --save-attention gpu on the CPU keeps the outputs in the CPU's memory (the compute device's, as
    SavedAttention does): the run works, but the flag asked for GPU memory (train and bench; fresh-user review)."""
    if args.save_attention != "gpu" or device.type == "cuda":
        return
    warnings.warn(
        f"--save-attention gpu with --device {device.type} keeps Stage 1's attention outputs in ordinary CPU memory, as "
        "--save-attention host does on the CPU (the same run); 'gpu' means GPU memory only with --device cuda",
        stacklevel=2)


def _warn_if_offload_segments_are_small(args: argparse.Namespace, offloads: bool) -> None:
    """Warn when an explicit --offload-segment-pages splits a layer's past into segments smaller than
    :data:`oomb.config.engine.SMALL_SEGMENT_TOKENS` (train and plan, where the run offloads; sparse attention does not use them).
    A fresh-user review found --offload-segment-pages 1 accepted without a word."""
    pages = args.offload_segment_pages
    if pages is None or not offloads or args.sparse:
        return
    floor = max(1, SMALL_SEGMENT_TOKENS // args.page_size)
    if pages >= min(floor, -(-args.seq_len // args.page_size)):  # or one segment holds a whole layer
        return
    from .memory import DEFAULT_SEGMENT_TOKENS, default_segment_pages

    warnings.warn(
        f"--offload-segment-pages {pages} stages {pages * args.page_size:,} tokens of a layer's past at a time: each "
        "segment costs its own host-to-device copies and attention call, so segments this small make offload slow; "
        f"pass {floor} pages ({floor * args.page_size:,} tokens) or more, or leave the flag out for the default, "
        f"{DEFAULT_SEGMENT_TOKENS:,} tokens' worth ({default_segment_pages(args.page_size)} pages of --page-size "
        f"{args.page_size})", stacklevel=2)


def _last_chunk_past_pages(seq_len: int, chunk_size: int, page_size: int) -> int:
    """Past pages of the last chunk (whole pages: --chunk-size is a multiple of --page-size), the most that any
    chunk's sparse selection chooses from."""
    return (seq_len - 1) // chunk_size * chunk_size // page_size


def _warn_if_sparse_is_dense(args: argparse.Namespace) -> None:
    """Warn (once) when --sparse's --page-budget + --sink-pages + --local-pages cover every past page of the last
    chunk: every chunk's selection is then all of its past, so attention is exactly dense (train and plan; eval and
    grad-error note it per budget)."""
    if not args.sparse:
        return
    kept = args.page_budget + args.sink_pages + args.local_pages
    past = _last_chunk_past_pages(args.seq_len, args.chunk_size, args.page_size)
    if kept < past:
        return
    why = (f"--page-budget {args.page_budget} + --sink-pages {args.sink_pages} + --local-pages {args.local_pages} = "
           f"{kept} pages cover all {past} past pages of the last chunk" if past else
           f"the sequence is one chunk (--chunk-size {args.chunk_size}), which has no past page to choose from")
    warnings.warn(
        f"--sparse at --seq-len {args.seq_len}: {why}, so the sparse selection keeps every page and attention is "
        "dense (correct, just not sparse); use a longer --seq-len, a smaller --page-budget or --local-pages, or "
        "drop --sparse", stacklevel=2)


def _check_sizes(args: argparse.Namespace) -> None:
    """The checks of ``oomb train`` that need more than one section (the configuration checked each value)."""
    _check_backend_device(args)
    _check_offload_flags(args)
    args.rope_scaling_dict = None
    if args.rope_scaling is not None:
        from .models.rope import parse_rope_scaling

        try:
            args.rope_scaling_dict = parse_rope_scaling(args.rope_scaling)
        except ValueError as exc:
            raise _usage_from(exc, "pass e.g. --rope-scaling type=yarn,factor=4,original_max_position_embeddings=32768") from exc
        if not args.rope_scaling_dict:
            raise UsageError("--rope-scaling is empty", "pass e.g. --rope-scaling type=linear,factor=4")


def _check_backend_device(args: argparse.Namespace) -> None:
    if args.attention_backend == "triton" and args.device != "cuda":
        raise UsageError("--attention-backend triton runs on the GPU only", "pass --device cuda, or --attention-backend torch, sdpa or auto on the CPU")


def _is_within(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


_OOMB_LOG_KEYS = frozenset({"step", "loss", "stage1_seconds", "stage2_seconds"})
"""Keys of every log.jsonl record ``oomb train`` writes. A log line with only "step" and "loss" may be any
tool's; the stage timings are oomb's own."""


def _looks_like_oomb_output(out: Path) -> bool:
    """Whether ``out`` holds an earlier oomb run (what --overwrite may delete): a train_args.json that oomb
    wrote, a checkpoints/ folder with a checkpoint in it whose meta.json has the keys oomb's checkpoints write
    (format, step, fingerprint, files: any tool may write a meta.json), or a log.jsonl whose first line is an
    oomb step record (it has oomb's stage timings, not only a step and a loss, which any training tool may
    log). A bare file of one of those names is not enough (a fresh-user review had --overwrite delete a folder
    whose only oomb-looking file was someone's log.jsonl). A run whose --overwrite stopped before it saved keeps the
    run it replaced in .oomb-replaced: that counts too."""
    if out.name != _REPLACED and (out / _REPLACED).is_dir() and _looks_like_oomb_output(out / _REPLACED):
        return True
    try:
        if "oomb_version" in json.loads((out / "train_args.json").read_text()):
            return True
    except (OSError, ValueError, TypeError):
        pass
    ckpts = out / "checkpoints"
    if ckpts.is_dir():
        from .checkpoint import is_checkpoint_meta

        if any(p.is_dir() and is_checkpoint_meta(p / "meta.json") for p in ckpts.iterdir()):
            return True
    try:
        with open(out / "log.jsonl") as f:
            line = f.readline()
    except OSError:
        return False
    if not line:
        # A run stopped in its first step leaves an empty log.jsonl and nothing else. Deleting that (and an
        # empty checkpoints/ folder) loses nothing; anything else next to an empty log could be anyone's (a
        # fresh-user review had --overwrite delete files kept under checkpoints/ next to an empty log.jsonl).
        return all((p.name == "log.jsonl" and p.is_file()) or (p.name == "checkpoints" and p.is_dir() and not any(p.iterdir()))
                   for p in out.iterdir())
    try:
        first = json.loads(line)
    except ValueError:
        return False
    return isinstance(first, dict) and _OOMB_LOG_KEYS <= first.keys()


def _check_writable_dir_path(flag: str, given: str, path: Path) -> None:
    """``path`` (a directory to create or use) can be made: its nearest existing ancestor is a writable directory.

    Probes by creating and removing an empty temporary directory there (os.access is not enough for root,
    or on /proc-like file systems); nothing else is written.
    """
    import tempfile

    ancestor = path
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{flag} {given!r}: {str(ancestor)!r} is a file, not a folder", f"pass a {flag} whose parent folders are folders")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".oomb-probe-", dir=ancestor))
    except OSError as exc:
        raise UsageError(
            f"{flag} {given!r}: cannot create folders in {str(ancestor)!r} ({exc.strerror or exc})",
            f"pass a {flag} in a folder you can write to",
        ) from exc


def _check_output_dir(args: argparse.Namespace) -> Path:
    if args.output_dir is None:
        raise UsageError("oomb train needs --output-dir (or output.dir in --config FILE)",
                         "pass --output-dir DIR, a folder that is new or empty")
    if not str(args.output_dir).strip():
        raise UsageError("--output-dir is empty", "pass a directory path that is new or empty")
    out = Path(args.output_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output-dir {args.output_dir!r} is a file", "pass a directory path that is new or empty")
    _check_writable_dir_path("--output-dir", args.output_dir, out)
    if args.resume is not None:
        if args.resume == "latest" and not (out / "checkpoints").is_dir():
            raise UsageError(
                f"--resume: --output-dir {args.output_dir!r} has no checkpoints folder",
                "pass the --output-dir of the run to continue, or start without --resume",
            )
        ckpt = Path(args.resume).expanduser().resolve() if args.resume != "latest" else None
        if ckpt is not None and ckpt.is_dir() and ckpt.parent != (out / "checkpoints").resolve() \
                and out.is_dir() and any(out.iterdir()):
            # Continuing there would mix two runs: its log.jsonl rewritten, its checkpoints pruned, its model replaced.
            raise UsageError(
                f"--resume {args.resume!r} is not a checkpoint of --output-dir {args.output_dir!r} (it is in "
                f"{str(ckpt.parent)!r}) and that --output-dir is not empty: continuing there would mix two runs' "
                "logs, checkpoints and models",
                "pass the --output-dir the checkpoint belongs to, or a new or empty --output-dir to continue it there "
                "(the checkpoint's own folder is left as it is)",
            )
        return out
    if out.is_dir() and any(out.iterdir()):
        if not args.overwrite:
            from .checkpoint import find_latest

            latest = find_latest(out / "checkpoints") if (out / "checkpoints").is_dir() else None
            if latest is not None and not (out / "train_args.json").exists():
                raise UsageError(
                    f"--output-dir {args.output_dir!r} holds an oomb run that stopped before its end "
                    f"(last checkpoint {latest.name})",
                    "pass --resume to continue it, --overwrite to discard it, or a new directory",
                )
            raise UsageError(
                f"--output-dir {args.output_dir!r} exists and is not empty",
                "pass a new directory, or --overwrite to replace its contents",
            )
        # --overwrite deletes the directory's contents: refuse where that would delete inputs or the work tree.
        protected = [(Path.cwd().resolve(), "the working directory"), (Path.home().resolve(), "your home directory")]
        for flag, p in (("--data", args.data), ("--tokenizer", args.tokenizer), ("--model", args.model)):
            if p is not None and os.path.exists(p):
                protected.append((Path(p).resolve(), f"the {flag} input"))
        for p, what in protected:
            if _is_within(p, out):
                raise UsageError(
                    f"--output-dir {args.output_dir!r} contains {str(p)!r} ({what}), which --overwrite would delete",
                    "pass an output directory of its own",
                )
        # Only an earlier oomb run is replaced: never the contents of some other folder (a source tree, ...).
        if not _looks_like_oomb_output(out):
            raise UsageError(
                f"--overwrite: --output-dir {str(out)!r} is not empty and does not look like an oomb output "
                "(no train_args.json written by oomb, no oomb checkpoint, no log.jsonl of oomb train step records in it)",
                "remove its contents by hand if they are not needed, or pick another --output-dir",
            )
    return out


def _resolve_device_dtype(args: argparse.Namespace):
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was given but no CUDA GPU is available to PyTorch", "pass --device cpu, or install a CUDA build of torch")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype)
    if dtype is None:
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return torch.device(args.device), dtype


_FLAG_NAMES = [
    ("use LoRA, checkpoint_layers or a smaller chunk_size", "use --lora-rank, --checkpoint-layers or a smaller --chunk-size"),
    ("use a smaller chunk, LoRA or checkpoint_layers", "use a smaller --chunk-size, --lora-rank or --checkpoint-layers"),
    ("use LoRA", "use --lora-rank"),  # the planner's fixes without the flags a plan already has
    ("plan for one with plan(..., machine=Machine(...))",
     "plan for a GPU machine with --gpu-gib and --host-gib (its free GPU memory and available host RAM, in GiB)"),
    ("plan(..., machine=Machine(...))", "oomb plan --gpu-gib and --host-gib"),
    ("turn offload on (offload='auto' or True)", "turn offload on (--offload auto, or on)"),
    ("attention_backend='triton'", "--attention-backend triton"),
]
_PARAM_FLAGS = ("offload_segment_pages", "gpu_page_budget", "checkpoint_layers", "seq_len", "chunk_size", "page_size",
                "page_budget", "sink_pages", "local_pages", "lora_rank", "rope_theta")


def _flag_names(text: str) -> str:
    """A library message as the CLI user reads it: Python parameter names become the flags that set them."""
    import re

    for old, new in _FLAG_NAMES:
        text = text.replace(old, new)
    return re.sub(r"(?<![\w/.-])(" + "|".join(_PARAM_FLAGS) + r")(?![\w/-]|\.\w)", lambda m: "--" + m.group(1).replace("_", "-"), text)


def _usage_from(exc: Exception, default_fix: str) -> UsageError:
    """Split a library error 'problem; fix' into a UsageError (or add ``default_fix``), with flag names."""
    problem, sep, fix = _flag_names(_one_line(str(exc))).partition("; ")
    return UsageError(problem, fix if sep else default_fix)


def _check_vocab(max_id: int, vocab: int, model_name: str) -> None:
    if max_id >= vocab:
        raise UsageError(
            f"the data has token id {max_id} but model {model_name!r} has a vocabulary of {vocab} ids",
            "use the tokenizer that belongs to the model (--tokenizer) or a model whose vocabulary covers it",
        )


def _document_bounds(input_ids, eos_id: int):
    """cu_seqlens of the documents in ``input_ids [1, T]``: a document ends after each ``eos_id`` token.

    Returns an int64 tensor ``[num_docs + 1]`` (0 first, T last, strictly increasing).
    """
    import torch

    ids = input_ids.view(-1)
    T = ids.numel()
    ends = (torch.nonzero(ids[:-1] == eos_id).view(-1) + 1).tolist()
    return torch.tensor([0, *ends, T], dtype=torch.int64)


def _vocab_size(model) -> int:
    emb = model.get_input_embeddings()
    n = getattr(emb, "num_embeddings", None)
    return int(n if n is not None else model.config.vocab_size)


# ---------------------------------------------------------------- training


def _lr_at(step: int, args: argparse.Namespace, warmup: int) -> float:
    """Linear warm-up to --lr over ``warmup`` steps, then (cosine) decay from --lr to 10% of it at the last
    step, or (constant) --lr.

    ``step`` counts from 1. Without warm-up the first step runs at the full --lr.
    """
    if warmup > 0 and step <= warmup:
        return args.lr * step / warmup
    if getattr(args, "lr_schedule", "cosine") == "constant":
        return args.lr
    span = max(1, args.steps - warmup - 1)
    progress = min(1.0, (step - warmup - 1) / span)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


class _SequenceStream:
    """Sequence number ``g`` (0-based, over the whole run) of a :class:`TokenSequences`: epoch after epoch,
    each in its seeded order -- the order of ``TokenSequences.batches``. Rank ``r`` of ``W`` takes the numbers
    ``m * W + r``, so a run is sharded deterministically and a resumed run sees the same sequences."""

    def __init__(self, sequences) -> None:
        self.sequences = sequences
        self._orders: dict[int, object] = {}

    def __getitem__(self, g: int):
        epoch, i = divmod(g, len(self.sequences))
        if epoch not in self._orders:
            self._orders = {epoch: self.sequences.order(epoch)}
        return self.sequences[int(self._orders[epoch][i])]


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


def _log_step(line: str) -> float:
    """The step of a log.jsonl line; infinity for a line that is not a complete record (a crash mid-write)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def _preset_names() -> list[str]:
    from .models.presets import preset_names

    return preset_names()


def _store_summary(store, seq_len: int, page_size: int, seconds: float) -> str:
    """One line on the KV store ``oomb train`` allocated: where the pages live and what it cost."""
    def size(b: int) -> str:
        return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"

    host = getattr(store, "host_nbytes", 0)
    dev = store.device.type
    if not host:
        return f"KV store: every page on the {dev.upper()} ({size(store.nbytes)})"
    n = -(-seq_len // page_size)
    sets = f"{store.staging_sets} whole-layer staging sets, " if getattr(store, "segment_pages", 0) is None else ""
    return (f"KV store: offload, {store.resident_pages_per_layer:,} of {n:,} pages per layer resident, {sets}"
            f"{size(store.nbytes)} {dev.upper()} pool + {size(host)} "
            f"{'pinned ' if dev == 'cuda' else ''}host memory (allocated once, in {seconds:.1f} s)")


def _fingerprint(args: argparse.Namespace, tokens, dtype, world_size: int) -> dict:
    """What a checkpoint's run and the resuming run must share (see --resume in --help)."""
    import hashlib

    return {
        "model": args.model if args.model in _preset_names() or not os.path.isdir(args.model) else str(Path(args.model).resolve()),
        "seq_len": args.seq_len,
        "data_sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
        "tokenizer": args.tokenizer and str(Path(args.tokenizer).resolve()),
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


_FINGERPRINT_FLAGS = {
    "model": "--model", "seq_len": "--seq-len", "tokenizer": "--tokenizer", "seed": "--seed", "lora_rank": "--lora-rank",
    "lora_alpha": "--lora-alpha", "grad_accum": "--grad-accum", "dtype": "--dtype", "document_mask": "--document-mask",
    "rope_theta": "--rope-theta", "rope_scaling": "--rope-scaling",
}


def _check_resume_fingerprint(saved: dict | None, now: dict, path: Path) -> None:
    """Refuse a --resume whose checkpoint's run differs in a fingerprint fact, naming flags and both values
    (load_checkpoint checks the same facts with their internal names; this says it the CLI's way)."""
    if saved is None:
        return  # unreadable meta.json: load_checkpoint names the file
    differ = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if not differ:
        return

    def show(v):
        return "(not given)" if v is None else ("on" if v is True else "off" if v is False else v)

    parts = []
    for k in differ:
        if k == "data_sha256":
            parts.append("the --data tokens differ")
        elif k == "world_size":
            parts.append(f"{saved.get(k)} ranks there, {now.get(k)} here")
        else:
            parts.append(f"{_FINGERPRINT_FLAGS.get(k, k)} {show(saved.get(k))} there, {show(now.get(k))} here")
    raise UsageError(
        f"--resume: {path} is a checkpoint of another run ({'; '.join(parts)})",
        "resume with that run's settings, or start a new run without --resume in another --output-dir",
    )


_RESUME_SETTINGS = ("sparse", "page_budget", "sink_pages", "local_pages", "sparse_score", "chunk_size", "page_size")
"""Engine settings saved with every checkpoint (meta.json "settings") and compared on --resume: a different
sparse attention changes the gradients (refused); a different chunk or page size changes them only with
--sparse (the selection is per chunk and page), while dense attention is exact at any (a note)."""


def _resume_settings(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in _RESUME_SETTINGS}


def _setting_text(name: str, value) -> str:
    if name == "sparse":
        return "--sparse" if value else "no --sparse"
    return f"--{name.replace('_', '-')} {value}"


def _check_resume_settings(args: argparse.Namespace, saved: dict | None, path: Path) -> list[str]:
    """Refuse a --resume whose checkpoint was trained with other engine settings that change the training
    (``_RESUME_SETTINGS``); return notes on the harmless differences (and on a checkpoint that recorded none)."""
    if saved is None:
        return [f"--resume: {path} records no engine settings (an older oomb wrote it): check that --sparse, "
                "its options, --chunk-size and --page-size are the run's, as they are not checked"]
    now = _resume_settings(args)
    sparse = bool(saved.get("sparse")) or args.sparse
    differ = [k for k in _RESUME_SETTINGS if k in saved and saved[k] != now[k]]
    refused = [k for k in differ if sparse or k not in ("chunk_size", "page_size")]
    if refused:
        was = ", ".join(_setting_text(k, saved[k]) for k in refused)
        raise UsageError(
            f"--resume: {path} was trained with {was} but this command has "
            f"{', '.join(_setting_text(k, now[k]) for k in refused)}, which would silently change the training",
            f"continue it with the checkpoint's settings ({was}), or start a new run without --resume in another "
            "--output-dir",
        )
    return [f"--resume: {path} was trained with {', '.join(_setting_text(k, saved[k]) for k in differ)}; this run "
            f"has {', '.join(_setting_text(k, now[k]) for k in differ)}: dense attention gives the same gradients at "
            "any chunk and page size (up to rounding), so it continues"] if differ else []


def _oomb_outputs(out: Path) -> set[str] | None:
    """Names of the entries of ``out`` that an earlier ``oomb train`` wrote (what --overwrite deletes): its
    log.jsonl, checkpoints/ and save debris, and the files its train_args.json lists under "outputs". None
    means every entry: a train_args.json of an oomb that did not list its outputs yet."""
    names = {"log.jsonl", ".log.jsonl.tmp", "checkpoints"} | {p.name for p in out.glob(".oomb-save-*")}
    try:
        train_args = json.loads((out / "train_args.json").read_text())
    except (OSError, ValueError, TypeError):
        return names
    if not (isinstance(train_args, dict) and "oomb_version" in train_args):
        return names
    listed = train_args.get("outputs")
    if not isinstance(listed, list):
        return None
    return names | {"train_args.json"} | {n for n in map(str, listed) if n == Path(n).name and n not in ("", ".", "..")}


# Where --overwrite moves the earlier run's outputs until this run has saved its model (then they are deleted): a
# run that fails or is killed before that leaves the earlier one recoverable (a fresh-user review lost a finished run
# to a killed --overwrite run, which deleted it at its start).
_REPLACED = ".oomb-replaced"


def _prepare_output(out: Path, overwrite: bool) -> None:
    if out.is_dir() and overwrite:
        ours = _oomb_outputs(out)
        backup = out / _REPLACED
        keep_old = backup.is_dir()  # an earlier --overwrite did not finish: what it replaced stays, its own outputs go
        if not keep_old:
            backup.mkdir()
        kept = []
        for child in sorted(out.iterdir()):
            if child.name == _REPLACED:
                continue
            if ours is not None and child.name not in ours:
                kept.append(child.name)
            elif not keep_old:
                os.replace(child, backup / child.name)
            elif child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        if keep_old:
            print(f"oomb: note: --overwrite deleted the unfinished run in {out}; the run an earlier --overwrite replaced "
                  f"stays in {backup} until this run saves its model", file=sys.stderr)
        else:
            print(f"oomb: note: --overwrite moved the earlier run's outputs to {backup}; they are deleted once this run "
                  "saves its model", file=sys.stderr)
        if kept:
            print(f"oomb: note: --overwrite replaced the earlier run's outputs in {out} and kept what it did not write: "
                  f"{', '.join(kept)}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)


def _save(model, tokenizer, out: Path, lora: bool, train_args: dict) -> list[str]:
    """Write model (or adapter) + tokenizer + train_args.json to a temp dir in ``out``, then move them in."""
    tmp = out / f".oomb-save-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        if lora:
            model.save_pretrained(str(tmp), safe_serialization=True)
        else:
            model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        # The list of what this run wrote lets a later --overwrite delete exactly that (_oomb_outputs).
        train_args = dict(train_args, outputs=sorted(os.listdir(tmp) + ["train_args.json"]))
        (tmp / "train_args.json").write_text(json.dumps(train_args, indent=2) + "\n")
        names = sorted(os.listdir(tmp))
        from .checkpoint import _umask

        for name in names:
            if (tmp / name).is_file():  # transformers writes model.safetensors 0600 (a temp file renamed)
                os.chmod(tmp / name, 0o666 & ~_umask())
            dst = out / name
            if dst.is_dir() and not dst.is_symlink():
                shutil.rmtree(dst)
            os.replace(tmp / name, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return names


def _train(args: argparse.Namespace) -> int:
    _check_sizes(args)
    out = _check_output_dir(args)

    # Heavy imports only after the cheap checks.
    import torch

    from .distributed import RankFailedError, agree_ok, init_from_env

    device, dtype = _resolve_device_dtype(args)
    # Under torchrun (WORLD_SIZE > 1) every rank trains its own sequences; gradients are summed once per step.
    ctx = init_from_env(device.type)
    if ctx.enabled and device.type == "cuda":
        device = torch.device("cuda", ctx.local_rank)
    try:
        try:
            run = _setup(args, out, device, dtype, ctx)
        except UsageError:
            if ctx.enabled:  # tell the other ranks, so that none waits for this one
                try:
                    agree_ok(False, device)
                except Exception:  # noqa: BLE001
                    pass
            raise
        if ctx.enabled:
            try:
                agree_ok(True, device)
            except RankFailedError as exc:
                raise UsageError("another rank refused the run (its error is printed above)", "fix the input and start again") from exc
        return _run(args, out, device, dtype, ctx, run)
    finally:
        ctx.close()


def _setup(args: argparse.Namespace, out: Path, device, dtype, ctx) -> dict:
    """Every check, the model, engine and optimizer, and the checkpoint to resume from: nothing written yet."""
    import torch

    from .checkpoint import CheckpointError, find_latest, load_checkpoint, read_settings, set_rng_state
    from .data import BUNDLED_CORPUS, DataError, TokenSequences, load_documents, load_tokenizer, tokenize_documents
    from .models.presets import UnknownModelError, build_model, check_config_supported, load_config
    from . import Engine, UnsupportedModelError

    try:
        tokenizer = load_tokenizer(args.tokenizer)
        docs = load_documents(args.data)
        tokens = tokenize_documents(docs, tokenizer, cache=args.data is None or Path(args.data).resolve() == BUNDLED_CORPUS)
        sequences = TokenSequences(tokens, args.seq_len, seed=args.seed)
    except DataError as exc:
        raise UsageError(exc.problem, exc.fix) from exc
    if args.document_mask and tokenizer.eos_token_id is None:
        raise UsageError("--document-mask splits documents at the EOS token but the tokenizer has none", "use a tokenizer with an eos_token, or leave --document-mask out")

    # The model's config is checked before any weight is read or initialised.
    try:
        model_config = load_config(args.model)
        check_config_supported(model_config)
    except (UnknownModelError, UnsupportedModelError) as exc:
        raise _usage_from(exc, "use a Qwen2/2.5, Llama 2/3, Mistral or Qwen3 causal LM (see 'oomb train --help')") from exc
    _check_vocab(int(tokens.max()), int(model_config.vocab_size), args.model)
    from .models.limits import lora_rank_problem

    lora_problem = lora_rank_problem(model_config, args.lora_rank, args.model)
    if lora_problem:
        raise UsageError(*lora_problem)
    if device.type != "cuda":
        _check_cpu_memory(args, model_config, dtype)
    if device.type != "cuda" and args.offload == "auto":
        for flag, value in (("--gpu-page-budget", args.gpu_page_budget), ("--offload-segment-pages", args.offload_segment_pages)):
            if value is not None:
                raise UsageError(f"{flag} sizes offload, which --offload auto never uses on the CPU",
                                 f"pass --offload on to run the offloaded store on the CPU, or leave {flag} out")
    from dataclasses import replace

    cfg = args.job.engine
    if device.type == "cuda":
        # Predict the GPU and host memory of the run before allocating anything (DESIGN.md §4 sizes).
        from .planner import plan_for_train_args

        try:
            plan = plan_for_train_args(args, dtype)
            plan.check()
        except ValueError as exc:
            raise _usage_from(exc, "see 'oomb plan' for what fits") from exc
        _warn_if_offload_on_keeps_every_page(args, plan.tiering.offload, plan.shape.num_layers)
        settings = plan.engine_settings()
        if args.offload != "off" and args.gpu_page_budget is None:
            # The plan sizes the GPU page pool with the optimizer states counted; the engine alone would size
            # it before AdamW allocates them.
            cfg = replace(cfg, offload=replace(cfg.offload, **settings))
        elif args.offload != "off":  # the user's pool: the staging sets the plan checked against the host budget
            cfg = replace(cfg, offload=replace(cfg.offload, staging_sets=settings["staging_sets"]))

    if args.progress is False or not ctx.is_main or not (args.progress or sys.stderr.isatty()):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    try:
        model = build_model(args.model, dtype=dtype, device=device)
    except (UnknownModelError, UnsupportedModelError) as exc:
        raise _usage_from(exc, "use a Qwen2/2.5, Llama 2/3, Mistral or Qwen3 causal LM (see 'oomb train --help')") from exc
    _check_vocab(int(tokens.max()), _vocab_size(model), args.model)
    if args.rope_theta is not None or args.rope_scaling_dict:
        from .models.rope import set_rope

        try:
            set_rope(model, rope_theta=args.rope_theta, rope_scaling=args.rope_scaling_dict)
        except ValueError as exc:
            raise _usage_from(exc, "see --rope-theta and --rope-scaling in 'oomb train --help'") from exc
    from .models.limits import context_length_warning

    warning = context_length_warning(model.config, args.seq_len, args.model)  # after --rope-scaling, as oomb plan
    if warning and ctx.is_main:
        print(warning, file=sys.stderr)

    if args.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        missing = [t for t in _LORA_TARGETS if t not in names]
        if missing:
            raise UsageError(f"model {args.model!r} has no {', '.join(missing)} modules for LoRA", "pass --lora-rank 0 for a full fine-tune")
        lora_cfg = LoraConfig(
            r=args.lora_rank,
            lora_alpha=args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_rank,
            lora_dropout=0.0,
            target_modules=_LORA_TARGETS,
            task_type="CAUSAL_LM",
        )
        with warnings.catch_warnings():
            # peft (0.21) reads the model's is_gradient_checkpointing, which transformers 5.x deprecates with a
            # FutureWarning (renamed is_activation_checkpointing); oomb itself does not read it.
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            model = get_peft_model(model, lora_cfg)

    try:
        engine = Engine(model, cfg)
    except ValueError as exc:  # UnsupportedModelError is a ValueError
        raise _usage_from(exc, "use a Qwen2/2.5, Llama 2/3, Mistral or Qwen3 causal LM with full attention") from exc

    # Allocate the KV store for --seq-len now, so that a run that does not fit (GPU page budget, host
    # memory, GPU memory) is refused before the output directory is touched.
    reserve = getattr(engine, "reserve", None) or engine._ensure_store
    t_reserve = time.perf_counter()
    try:
        store = reserve(args.seq_len)
    except ValueError as exc:  # MemoryPlanError and page-budget errors
        raise _usage_from(exc, "see 'oomb plan --help' to size the run") from exc
    except torch.OutOfMemoryError as exc:
        raise UsageError(
            f"the KV store for --seq-len {args.seq_len} does not fit in GPU memory",
            "use a shorter --seq-len, --offload on, --checkpoint-layers or --lora-rank (see 'oomb plan')",
        ) from exc

    t_reserve_s = time.perf_counter() - t_reserve

    params = [p for p in model.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=fused)
    fingerprint = _fingerprint(args, tokens, dtype, ctx.world_size)

    start_step, finished = 0, False
    if args.resume is not None:
        ckpt_root = out / "checkpoints"
        path = find_latest(ckpt_root) if args.resume == "latest" else Path(args.resume).expanduser()
        if path is None:
            raise UsageError(f"--resume latest: {ckpt_root} holds no complete checkpoint", "start without --resume (with --overwrite)")
        if not path.is_dir():
            latest = find_latest(ckpt_root) if ckpt_root.is_dir() else None
            raise UsageError(f"--resume {args.resume}: {path} is not a checkpoint folder",
                             "pass 'latest' or a checkpoint folder" + (f" such as {latest}" if latest is not None else
                                                                       f" (step-NNNNNNNN under {ckpt_root})"))
        _check_resume_fingerprint(read_settings(path, "fingerprint"), fingerprint, path)
        notes = _check_resume_settings(args, read_settings(path), path)
        if args.resume == "latest":
            notes += _broken_latest_pointer(ckpt_root, path)
        try:
            start_step, extra = load_checkpoint(path, model, optimizer, None, fingerprint)
        except CheckpointError as exc:
            problem, sep, fix = _one_line(exc).rpartition("; ")
            raise UsageError(problem, fix) if sep else UsageError(fix, "resume from another checkpoint") from exc
        # AdamW's state carries the run's weight decay and would silently replace --weight-decay.
        saved_wd = optimizer.param_groups[0].get("weight_decay")
        if saved_wd is not None and saved_wd != args.weight_decay:
            raise UsageError(
                f"--resume: {path} was trained with --weight-decay {saved_wd:g} but this command has --weight-decay "
                f"{args.weight_decay:g}, which would silently change the training",
                f"continue it with --weight-decay {saved_wd:g}, or start a new run without --resume in another --output-dir",
            )
        if path.resolve().parent != (out / "checkpoints").resolve():
            notes.append(f"--resume: {path} is a checkpoint of another folder ({path.resolve().parent}); the run "
                         f"continues in {out}, whose log.jsonl starts at step {start_step + 1}, and that folder is "
                         "left as it is")
        else:
            later = sorted(p.name for p in path.parent.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name > path.name)
            if later:
                notes.append(f"--resume: {path.name} is not the newest checkpoint here: the steps after {start_step} are "
                             f"trained again, log.jsonl's lines after step {start_step} are dropped, and {', '.join(later)} "
                             "stay until this run saves the same step (then replaced)")
        if "rng" in extra:
            set_rng_state(extra["rng"])
        if start_step > args.steps:
            raise UsageError(f"--resume: {path} is at step {start_step}, past --steps {args.steps}", f"pass --steps {start_step} or more")
        if ctx.is_main:
            for note in notes:
                print(f"oomb: note: {note}", file=sys.stderr)
            print(f"oomb: resuming from {path} (step {start_step})", file=sys.stderr)
        finished = start_step == args.steps and _saved_model_of(out, path, start_step)
    if ctx.is_main:  # after every refusal: a warning never comes with an error line
        _warn_if_offload_moves_nothing(args, engine.num_layers)
        _warn_if_sparse_is_dense(args)
        _warn_if_gpu_saved_attention_on_cpu(args, device)
        _warn_if_offload_segments_are_small(args, getattr(store, "segment_pages", None) is not None)
    return dict(tokenizer=tokenizer, tokens=tokens, sequences=sequences, model=model, engine=engine, params=params,
                optimizer=optimizer, fingerprint=fingerprint, settings=_resume_settings(args), start_step=start_step,
                finished=finished,
                store_summary=_store_summary(store, args.seq_len, args.page_size, t_reserve_s))


def _broken_latest_pointer(ckpt_root: Path, used: Path) -> list[str]:
    """A note when checkpoints/latest names no complete checkpoint (find_latest then takes the newest one there):
    the run does not resume silently from another step than the pointer says."""
    pointer = ckpt_root / "latest"
    try:
        named = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return []
    if used.name == named:
        return []
    return [f"--resume latest: {pointer} names {named!r}, which is not a complete checkpoint; resuming from the "
            f"newest one there, {used.name}"]


def _saved_model_of(out: Path, path: Path, step: int) -> bool:
    """Whether ``out`` holds the saved model of its checkpoint ``path`` at ``step``, the newest of out/checkpoints:
    its train_args.json (written last by :func:`_save`) is of a run of ``step`` steps and every file it lists is
    there. Then a --resume with --steps ``step`` has nothing to do."""
    ckpt_root = (out / "checkpoints").resolve()
    if path.resolve().parent != ckpt_root or any(
            p.is_dir() and p.name.startswith("step-") and p.name > path.name for p in ckpt_root.iterdir()):
        return False
    try:
        train_args = json.loads((out / "train_args.json").read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(train_args, dict) and "oomb_version" in train_args and train_args.get("steps") == step):
        return False
    listed = train_args.get("outputs")
    return isinstance(listed, list) and all((out / str(n)).exists() for n in listed)


def _run(args: argparse.Namespace, out: Path, device, dtype, ctx, run: dict) -> int:
    """The training loop (all checks passed): log, checkpoint, stop on a signal, save."""
    import torch
    from tqdm.auto import tqdm

    from .checkpoint import GracefulStop, find_latest, rng_state, save_checkpoint
    from .distributed import RankFailedError, agree_ok, all_reduce_gradients, global_sum

    tokenizer, tokens, sequences, model, engine = run["tokenizer"], run["tokens"], run["sequences"], run["model"], run["engine"]
    params, optimizer, start_step = run["params"], run["optimizer"], run["start_step"]
    main_rank = ctx.is_main
    log_path = out / "log.jsonl"
    ckpt_root = out / "checkpoints"
    signals = getattr(args, "_signals", None) or _StartupSignals()  # (_run called without main(): none)
    signals.defer()  # a signal during setup: stop here, before anything is written
    if run["finished"]:
        # The checkpoint, log and model are those of --steps already: rewriting them (same content) would only
        # change their times.
        if main_rank:
            print(f"oomb: done: no steps left to train (the checkpoint is at --steps {args.steps} and {out} holds its "
                  "saved model); nothing was written", file=sys.stderr)
        return 0
    if main_rank:
        # ---- every check passed: from here on we write.
        _prepare_output(out, args.overwrite)
        if start_step and log_path.is_file():  # drop the steps after the checkpoint: they are trained again
            kept = [line for line in log_path.read_text(errors="replace").splitlines() if _log_step(line) <= start_step]
            tmp = log_path.with_name(".log.jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, log_path)
        elif not start_step and log_path.is_file():
            log_path.unlink()
    # A signal while the output was prepared: stop before training. The same command runs again (an empty
    # --output-dir is new; with --overwrite, the earlier run stays in .oomb-replaced).
    signals.check()
    n_trainable = sum(p.numel() for p in params)
    n_total = sum(p.numel() for p in model.parameters())
    warmup = args.warmup_steps if args.warmup_steps is not None else args.steps // 10
    if main_rank and args.warmup_steps is not None and args.warmup_steps >= args.steps:
        print(f"oomb: note: --warmup-steps {args.warmup_steps} >= --steps {args.steps}: the learning rate never "
              f"reaches --lr {args.lr:g}", file=sys.stderr)
    if main_rank and args.warmup_steps is None and warmup > _LONG_WARMUP:
        # --steps 99999999999999999999 (a run to stop with Ctrl-C) warmed up at a learning rate of ~0 for as long as
        # anyone could run it (fresh-user review)
        print(f"oomb: note: the default warm-up is 10% of --steps {args.steps:,}: {warmup:,} steps before the learning "
              f"rate reaches --lr {args.lr:g}; pass --warmup-steps (e.g. 1000) for a long or open-ended run", file=sys.stderr)
    show = main_rank and args.progress is not False and (args.progress or sys.stderr.isatty())
    K, W = args.grad_accum, ctx.world_size
    stream = _SequenceStream(sequences)
    if main_rank:
        ranks = f"; {W} ranks" if W > 1 else ""
        print(
            f"oomb: {args.model} ({n_total / 1e6:.1f}M parameters, {n_trainable / 1e6:.2f}M trainable, {str(dtype).replace('torch.', '')}, {device}); "
            f"{len(tokens):,} tokens -> {len(sequences)} sequence{'s' if len(sequences) != 1 else ''} of {args.seq_len}; {K * W} per step{ranks}; chunk {args.chunk_size}{' (> --seq-len: one chunk per sequence)' if args.chunk_size > args.seq_len else ''}, page {args.page_size}; "
            f"log: {log_path}",
            file=sys.stderr,
        )
        print(f"oomb: {run['store_summary']}", file=sys.stderr)
        drawn = (args.steps - start_step) * K * W
        if drawn > len(sequences):
            print(f"oomb: note: {args.steps - start_step} steps x {K * W} sequences = {drawn} sequences from {len(sequences)}: "
                  f"the data is repeated (~{drawn / len(sequences):.1f} passes); more data or fewer --steps avoids it",
                  file=sys.stderr)

    def checkpoint(step: int, rng: dict | None = None) -> Path | None:
        if not main_rank:
            return None
        extra = {"rng": rng if rng is not None else rng_state(), "step": step, "sequences_per_step": K * W}
        return save_checkpoint(ckpt_root, step, model, optimizer, None, run["fingerprint"], extra, keep_last=2,
                               settings=run["settings"])

    def check_all(ok: bool, step: int, error: "UsageError | None") -> None:
        if ctx.enabled:
            try:
                agree_ok(ok, device)
            except RankFailedError as exc:
                raise _RunError(f"step {step}: another rank failed (its error is printed above)", "all ranks stopped") from exc
        if error is not None:
            raise error

    model.train()
    first_loss = last_loss = None
    saved_at = start_step
    t_start = time.perf_counter()
    log = open(log_path, "a", encoding="utf-8") if main_rank else None
    try:
        what = "this step (with --grad-accum: this sequence)" if K > 1 and not ctx.enabled else "this step"
        notice = (
            f"oomb: {{name}} received: finishing {what}, then saving a "
            "checkpoint and stopping (send it again to stop at once WITHOUT saving)"
        ) if main_rank else None
        with GracefulStop(notice=notice) as stop, tqdm(total=args.steps, initial=start_step, desc="train", unit="step", disable=not show, file=sys.stderr) as bar:
            # GracefulStop takes the signals over from _StartupSignals: on exit it restores the handlers from before
            # oomb's (a Ctrl-C while the model is saved interrupts it), and a signal since the check above stops the
            # run after its first step, as any signal during training does.
            stop.take_over(signals.previous, signals.signum)
            for step in range(start_step + 1, args.steps + 1):
                lr = _lr_at(step, args, warmup)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                t0 = time.perf_counter()
                # This rank's K sequences of the step, their document bounds and valid-token counts.
                error = None
                micro = []
                try:
                    for j in range(K):
                        input_ids = stream[((step - 1) * K + j) * W + ctx.rank].to(device)
                        cu = _document_bounds(input_ids.cpu(), tokenizer.eos_token_id) if args.document_mask else None
                        micro.append((input_ids, cu, engine.count_valid_tokens(input_ids, None, cu)))
                except ValueError as exc:
                    error = _RunError(f"step {step} failed: {_one_line(exc)}", "check the data")
                check_all(error is None, step, error)
                local_valid = sum(n for _, _, n in micro)
                total_valid = int(round(global_sum(local_valid, device))) if ctx.enabled else local_valid
                loss_sum = 0.0
                results = []
                step_rng = rng_state() if K > 1 and not ctx.enabled else None  # the state a mid-step stop saves
                interrupted = False
                try:
                    for i, (input_ids, cu, _) in enumerate(micro):
                        if i > 0 and step_rng is not None and stop.requested is not None:
                            interrupted = True  # a signal during a long accumulation: stop at this sequence boundary
                            break
                        r = engine.step(input_ids, progress=show, cu_seqlens=cu, loss_normalizer=total_valid if (K > 1 or W > 1) else None)
                        results.append(r)
                        loss_sum += r.loss * r.num_valid_tokens
                except ValueError as exc:  # e.g. a sequence of documents too short to hold one target
                    error = _RunError(f"step {step} failed: {_one_line(exc)}", "check the data")
                except torch.OutOfMemoryError:
                    error = _RunError(
                        f"out of GPU memory at step {step}",
                        "use a smaller --chunk-size, --checkpoint-layers, --lora-rank or --offload on (see 'oomb plan')",
                    )
                check_all(error is None, step, error)
                if interrupted:
                    # The step's gradients so far are dropped; the model and optimizer are those after step - 1,
                    # which a resume re-runs from its first sequence.
                    optimizer.zero_grad(set_to_none=True)
                    done = step - 1
                    path = checkpoint(done, step_rng) if done > saved_at else (find_latest(ckpt_root) if done > 0 else None)
                    import signal as _signal

                    name = _signal.Signals(stop.requested).name
                    dropped = f"its {len(results)} of {K} sequences done were dropped"
                    if path is None:
                        print(f"oomb: stopped by {name} during step {step} ({dropped}); no step had completed, so nothing "
                              "was saved; to start again, run the same command with --overwrite", file=sys.stderr)
                    else:
                        print(f"oomb: stopped by {name} during step {step} ({dropped}); checkpoint {path} (after step "
                              f"{done}); to continue, run {_resume_command(args._argv)}", file=sys.stderr)
                    return 0
                loss = (global_sum(loss_sum, device) if ctx.enabled else loss_sum) / total_valid
                if not math.isfinite(loss):
                    raise _RunError(
                        f"the loss became {loss} at step {step}; the model was not saved (log.jsonl keeps the steps "
                        "before it, and checkpoints/ any checkpoint written before it)",
                        "lower --lr and run again with --overwrite, or --resume from a checkpoint with a lower --lr")
                all_reduce_gradients(params)
                max_norm = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                seconds = time.perf_counter() - t0
                first_loss = loss if first_loss is None else first_loss
                last_loss = loss
                num_tokens = sum(r.num_tokens for r in results) * W
                peaks = [r.peak_memory_bytes for r in results if r.peak_memory_bytes is not None]
                peak = max(peaks) if peaks else None
                tok_s = num_tokens / seconds if seconds > 0 else 0.0
                if main_rank:
                    record = {
                        "step": step,
                        "loss": round(loss, 6),
                        "tokens_per_s": round(tok_s, 2),
                        "peak_memory_bytes": peak,
                        "seconds": round(seconds, 4),
                        "lr": lr,
                        "grad_norm": round(grad_norm, 6),
                        "num_tokens": num_tokens,
                        "stage1_seconds": round(sum(r.stage1_seconds for r in results), 4),
                        "stage2_seconds": round(sum(r.stage2_seconds for r in results), 4),
                    }
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}")
                    bar.update(1)
                    if step % args.log_every == 0 or step == args.steps:
                        mem = "" if peak is None else f"  peak {peak / 2**30:.2f} GiB"
                        tqdm.write(f"step {step:>5}/{args.steps}  loss {loss:.4f}  {tok_s:,.0f} tok/s  {seconds:.2f} s  lr {lr:.2e}{mem}", file=sys.stdout)
                if args.save_every and step % args.save_every == 0 and step < args.steps:
                    checkpoint(step)
                    saved_at = step
                requested = stop.requested is not None
                if ctx.enabled:
                    requested = global_sum(1.0 if requested else 0.0, device) > 0
                if requested and step < args.steps:
                    path = checkpoint(step) if saved_at != step else find_latest(ckpt_root)
                    if main_rank:
                        import signal as _signal

                        name = _signal.Signals(stop.requested).name if stop.requested else "a signal on another rank"
                        how = (
                            f"run {_resume_command(args._argv)}" if not ctx.enabled
                            else f"run the same torchrun command with the oomb arguments {_resume_command(args._argv)[5:]}"
                        )
                        print(f"oomb: stopped by {name} after step {step}; checkpoint {path}; to continue, {how}", file=sys.stderr)
                    return 0
    finally:
        if log is not None:
            log.close()

    if main_rank:
        checkpoint(args.steps)
        train_args = {k: v for k, v in vars(args).items() if k not in ("command", "job") and not k.startswith("_")}
        train_args.update(oomb_version=_version(), num_tokens=int(len(tokens)), num_sequences=len(sequences), world_size=W)
        saved = _save(model, tokenizer, out, lora=args.lora_rank > 0, train_args=train_args)
        shutil.rmtree(out / _REPLACED, ignore_errors=True)  # the run --overwrite replaced: this one is saved now
        elapsed = time.perf_counter() - t_start
        losses = f"loss {first_loss:.4f} -> {last_loss:.4f}" if first_loss is not None else "no steps left to train"
        print(
            f"oomb: done in {elapsed:.1f} s; {losses}; saved {', '.join(n for n in saved if n.endswith('.safetensors'))} to {out}",
            file=sys.stderr,
        )
    return 0


# Top-level keys of the --json reports (EvalReport.to_dict, GradErrorReport.to_dict): an existing file is
# replaced only if it is an earlier report of the same command.
_EVAL_REPORT_KEYS = frozenset({"seq_len", "num_windows", "window_starts", "page_size", "sink_pages", "local_pages",
                               "sparse_score", "rows"})
_GRAD_ERROR_REPORT_KEYS = frozenset({"seq_len", "budgets", "dense_loss", "sparse_loss", "rel_error_all", "rel_error"})


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


def _check_json_arg(args: argparse.Namespace, report_keys: frozenset, command: str) -> None:
    """--json PATH (grad-error, eval, bench) can be written: not a folder, in an existing folder we may write to, and
    new, empty or an earlier ``oomb <command>`` report (recognised by ``report_keys``), never another file."""
    if args.json is None:
        return
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


def _write_json(given: str, data: dict) -> None:
    """Write ``data`` to the --json path atomically (a temporary file beside it, then renamed)."""
    path = Path(given).expanduser()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _measure_tokenizer_path(args: argparse.Namespace) -> str | None:
    """--tokenizer, else the --model folder when it holds a tokenizer (an 'oomb train' output), else None (bundled)."""
    if args.tokenizer is not None:
        return args.tokenizer
    from .models.presets import _is_local_model_dir

    if _is_local_model_dir(args.model) and any(os.path.isfile(os.path.join(args.model, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
        return args.model
    return None


def _load_tokens(args: argparse.Namespace, tokenizer_path: str | None):
    """The --data token stream of grad-error and eval: int64 ``[N]``, EOS between documents."""
    from .data import BUNDLED_CORPUS, DataError, load_documents, load_tokenizer, tokenize_documents

    try:
        tokenizer = load_tokenizer(tokenizer_path)
        return tokenize_documents(load_documents(args.data), tokenizer, cache=args.data is None or Path(args.data).resolve() == BUNDLED_CORPUS)
    except DataError as exc:
        raise UsageError(exc.problem, exc.fix) from exc


def _load_model(args: argparse.Namespace, tokens, device, dtype, command: str):
    """The --model of grad-error and eval (a preset seeded by --seed, or a local folder), its config and
    vocabulary checked against ``tokens`` before any weight is read."""
    import torch

    from .models.presets import UnknownModelError, build_model, check_config_supported, load_config
    from . import UnsupportedModelError

    try:
        model_config = load_config(args.model)
        check_config_supported(model_config)
        _check_vocab(int(tokens.max()), int(model_config.vocab_size), args.model)
        torch.manual_seed(args.seed)
        model = build_model(args.model, dtype=dtype, device=device)
    except (UnknownModelError, UnsupportedModelError) as exc:
        raise _usage_from(exc, f"use a Qwen2/2.5, Llama 2/3, Mistral or Qwen3 causal LM (see 'oomb {command} --help')") from exc
    _check_vocab(int(tokens.max()), _vocab_size(model), args.model)
    return model


def _check_budgets_see_a_past(args: argparse.Namespace) -> None:
    """A budget of 0 with --sink-pages 0 and --local-pages 0 attends to no past page at all (grad-error, eval)."""
    if 0 in args.budgets and args.sink_pages + args.local_pages == 0:
        raise UsageError("--budgets 0 with --sink-pages 0 and --local-pages 0 attends to no past page",
                         "drop budget 0, or keep sink or local pages")


def _note_dense_budgets(args: argparse.Namespace, budgets: Sequence[int], result: str) -> None:
    """Note on stderr the budgets that hold every past page of the last chunk (there sparse is dense)."""
    past_pages = _last_chunk_past_pages(args.seq_len, args.chunk_size, args.page_size)
    dense_budgets = [b for b in budgets if b + args.sink_pages + args.local_pages >= past_pages]
    if dense_budgets:
        print(
            f"oomb: note: budget {', '.join(map(str, dense_budgets))} + --sink-pages {args.sink_pages} + --local-pages "
            f"{args.local_pages} covers all {past_pages} past pages of the last chunk, so sparse equals dense there ({result}); "
            "measure with a longer --seq-len or a smaller --page-size",
            file=sys.stderr,
        )


def _grad_error(args: argparse.Namespace) -> int:
    """``oomb grad-error``: the sparse-vs-dense gradient error table of one sequence."""
    _check_backend_device(args)
    _check_budgets_see_a_past(args)
    _check_json_arg(args, _GRAD_ERROR_REPORT_KEYS, "grad-error")
    from .data import DataError, TokenSequences
    from .sparse_quality import sparse_grad_error

    device, dtype = _resolve_device_dtype(args)
    cfg = args.job.engine  # its sparse section: the sink, local and score settings of the budgets' runs
    tokens = _load_tokens(args, _measure_tokenizer_path(args))
    try:
        sequences = TokenSequences(tokens, args.seq_len, seed=args.seed)
    except DataError as exc:
        raise UsageError(exc.problem, exc.fix) from exc
    model = _load_model(args, tokens, device, dtype, "grad-error")
    input_ids = sequences[int(sequences.order(0)[0])].to(device)
    try:
        report = sparse_grad_error(model, input_ids, cfg, budgets=args.budgets)
    except ValueError as exc:
        raise _usage_from(exc, "see 'oomb grad-error --help'") from exc
    print(report.table(by=args.by))
    # The last chunk has the most past pages; a budget that holds them all selects every page (sparse = dense).
    _note_dense_budgets(args, args.budgets, "error 0")
    if args.json is not None:
        _write_json(args.json, report.to_dict())
    return 0


def _eval(args: argparse.Namespace) -> int:
    """``oomb eval``: mean loss on consecutive --seq-len windows, dense and per sparse page budget."""
    args.budgets = args.budgets or []
    _check_sparse_flags(args, bool(args.budgets), "--budgets", ("sink_pages", "local_pages", "sparse_score"),
                        how="add --budgets with the page budgets to evaluate (e.g. --budgets 16 64)")
    _check_budgets_see_a_past(args)
    _check_backend_device(args)
    _check_json_arg(args, _EVAL_REPORT_KEYS, "eval")
    budgets = list(dict.fromkeys(args.budgets))  # in the given order, each once
    import torch

    from .evaluation import evaluate_windows

    device, dtype = _resolve_device_dtype(args)
    cfg = args.job.engine if budgets else args.job.engine.dense()
    # Windows are checked before any weight is read.
    tokenizer_path = _measure_tokenizer_path(args)
    tokens = _load_tokens(args, tokenizer_path)
    n, S = int(tokens.shape[0]), args.seq_len
    available = n // S
    if available == 0:
        raise UsageError(f"the data has {n:,} tokens, fewer than one window of --seq-len {S}", f"pass --seq-len {n} or less, or more text as --data")
    if args.num_windows is not None and args.num_windows > available:
        raise UsageError(
            f"--num-windows is {args.num_windows} but the data ({n:,} tokens) holds {available} window(s) of --seq-len {S}",
            f"pass --num-windows {available} or less, or a smaller --seq-len",
        )
    count = args.num_windows if args.num_windows is not None else min(available, _EVAL_MAX_WINDOWS)
    from .evaluation import token_windows

    windows = token_windows(tokens, S, count)
    model = _load_model(args, tokens, device, dtype, "eval")
    _warn_if_offload_moves_nothing(args, model.config.num_hidden_layers)
    capped = "" if args.num_windows is not None or count == available else f" (of {available}; --num-windows {available} for all)"
    print(
        f"oomb: eval {args.model} ({str(dtype).replace('torch.', '')}, {device}); tokenizer {tokenizer_path or 'bundled'}; "
        f"{n:,} tokens -> {count} window(s) of {S}{capped}; chunk {args.chunk_size}, page {args.page_size}; "
        f"modes: dense{''.join(f', sparse {b}' for b in budgets)}",
        file=sys.stderr,
    )
    try:
        report = evaluate_windows(model, windows, cfg, budgets=budgets)
    except torch.OutOfMemoryError as exc:
        raise _RunError(f"out of GPU memory evaluating --seq-len {S}", "use a smaller --chunk-size or --offload on (see 'oomb plan')") from exc
    except ValueError as exc:
        raise _usage_from(exc, "see 'oomb eval --help'") from exc
    print(report.table())
    _note_dense_budgets(args, budgets, "same loss")
    if args.json is not None:
        data = report.to_dict()
        data.update(model=args.model, data=args.data, tokenizer=tokenizer_path, chunk_size=args.chunk_size,
                    dtype=str(dtype).replace("torch.", ""), device=str(device), data_tokens=n)
        _write_json(args.json, data)
    return 0


_BENCH_REPORT_KEYS = frozenset({"model", "lengths", "systems", "rows"})
_MAX_BENCH_TOKENS = 2**31


def _bench(args: argparse.Namespace) -> int:
    """``oomb bench``: one training step of oomb and of plain HF training per length, as a table."""
    if any(T < 2 for T in args.lengths):
        raise UsageError(f"--lengths has {min(args.lengths)}", "pass token counts of 2 or more")
    if max(args.lengths) > _MAX_BENCH_TOKENS:
        raise UsageError(f"--lengths has {max(args.lengths):,}", f"pass at most {_MAX_BENCH_TOKENS:,} tokens (2**31)")
    if len(set(args.lengths)) != len(args.lengths):
        raise UsageError(f"--lengths lists a length twice: {' '.join(map(str, args.lengths))}", "name each length once")
    if args.warmup_len == 1:
        raise UsageError(f"--warmup-len is {args.warmup_len}", "pass 0 (no warm-up) or 2 or more tokens")
    _check_backend_device(args)
    if len(set(args.systems)) != len(args.systems):
        raise UsageError(f"--systems lists a system twice: {' '.join(args.systems)}", "name each of hf and oomb at most once")
    _check_json_arg(args, _BENCH_REPORT_KEYS, "bench")
    import torch

    from .bench import bench_rows, bench_table
    from .models.presets import UnknownModelError, build_model, check_config_supported, load_config
    from . import UnsupportedModelError

    device, dtype = _resolve_device_dtype(args)
    cfg = args.job.engine
    try:
        model_config = load_config(args.model)
        check_config_supported(model_config)
        if device.type == "cpu":
            from .memory import ModelShape, host_memory as _host_memory

            n = ModelShape.from_config(model_config).num_params()
            need, available = 2 * n * dtype.itemsize, _host_memory()[0]  # weights and gradients, before activations
            if need > available:
                raise UsageError(f"--model {args.model} ({n / 1e9:.2f}B parameters) needs at least {need / 2**30:.1f} GiB "
                                 f"on the CPU for its weights and gradients, but {available / 2**30:.1f} GiB is available",
                                 "use a smaller --model (e.g. tiny), or --device cuda")
        torch.manual_seed(args.seed)
        model = build_model(args.model, dtype=dtype, device=device)
    except (UnknownModelError, UnsupportedModelError) as exc:
        raise _usage_from(exc, "use a Qwen2/2.5, Llama 2/3, Mistral or Qwen3 causal LM (see 'oomb bench --help')") from exc
    from .ops.paged_attention import resolve_backend

    backend = resolve_backend(args.attention_backend, device)
    _warn_if_gpu_saved_attention_on_cpu(args, device)
    print(f"oomb bench: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters, "
          f"{str(dtype).replace('torch.', '')}) on {device}; oomb: chunk {args.chunk_size}, page {args.page_size}, "
          f"attention {backend}, save-attention {args.save_attention}"
          f"{', checkpoint-layers' if args.checkpoint_layers else ''}, timed at step {args.steps}", file=sys.stderr)
    rows = bench_rows(model, args.lengths, cfg, systems=args.systems, steps=args.steps, warmup_len=args.warmup_len,
                      seed=args.seed,
                      progress=lambda r: print(f"oomb bench: {r['system']} {r['tokens']:,} tokens: "
                                               + (r["error"] if "error" in r else f"{r['seconds']:.2f} s"),
                                               file=sys.stderr))
    print(bench_table(rows))
    if args.json is not None:
        _write_json(args.json, dict(model=args.model, dtype=str(dtype).replace("torch.", ""), device=str(device),
                                    lengths=args.lengths, systems=args.systems, steps=args.steps,
                                    warmup_len=args.warmup_len, seed=args.seed,
                                    config=dict(chunk_size=args.chunk_size, page_size=args.page_size,
                                                attention_backend=backend, save_attention=args.save_attention,
                                                checkpoint_layers=args.checkpoint_layers),
                                    gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                                    cpu_threads=torch.get_num_threads(), torch=torch.__version__,
                                    transformers=__import__("transformers").__version__, rows=rows))
    return 0


def _plan(args: argparse.Namespace) -> int:
    """``oomb plan``: print the predicted memory of a run; 0 if it fits, 1 if not, 2 on bad input."""
    _check_offload_flags(args)
    import contextlib
    import io

    report = io.StringIO()
    try:
        with contextlib.redirect_stdout(report):  # the planner's advice names Python parameters; print flags
            from .planner import run_plan

            status = run_plan(args)
    except ValueError as exc:  # MemoryPlanError, UnknownModelError, UnsupportedModelError, config errors
        raise _usage_from(exc, "see 'oomb plan --help'") from exc
    finally:
        sys.stdout.write(_flag_names(report.getvalue()))
    if status == 0:  # a refused plan has said what is wrong with the budget already
        _warn_if_offload_moves_nothing(args, args._num_layers)
        _warn_if_offload_on_keeps_every_page(args, args._plan_offloads, args._num_layers)
        _warn_if_offload_segments_are_small(args, args._plan_offloads)
    _warn_if_sparse_is_dense(args)
    return status


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """``warnings.showwarning`` of the CLI: oomb's own warnings as one ``oomb: warning: ...`` line (no source
    line, which names the CLI's code, not the user's input); other libraries' warnings as Python prints them."""
    if os.path.abspath(filename).startswith(_PACKAGE_DIR) and issubclass(category, UserWarning):
        print(f"oomb: warning: {message}", file=sys.stderr if file is None else file)
    else:
        _DEFAULT_SHOWWARNING(message, category, filename, lineno, file, line)


_DEFAULT_SHOWWARNING = warnings.showwarning


class _StartupSignals:
    """SIGINT/SIGTERM of ``oomb train`` from its start until the training loop's GracefulStop takes them over.

    During setup (imports, data, model: nothing written yet) a signal raises KeyboardInterrupt at once ("oomb:
    interrupted", exit 130) and is also recorded: a KeyboardInterrupt raised while Python runs a finalizer
    (``__del__``) is printed as "Exception ignored" and dropped, and a fresh-user review saw the run then train to
    its end. :meth:`check` stops on a recorded one. From :meth:`defer` on (the output directory is being written)
    a signal is only recorded, so that moving an earlier run aside (--overwrite) is never cut in two.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferred = False
        self.previous: dict = {}

    def install(self) -> "_StartupSignals":
        import signal

        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread (main() called from one): Python's own handling
                pass
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal API
        if self.signum is None:
            self.signum = signum
        if not self.deferred:
            raise KeyboardInterrupt

    def defer(self) -> None:
        """From here on the output is written: a signal is recorded, and stops the run at the next :meth:`check`."""
        self.deferred = True
        self.check()

    def check(self) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt

    def restore(self) -> None:
        import signal

        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``oomb`` command. Returns 0; exits with status 2 on bad input, 130 on an interrupt."""
    signals = _StartupSignals()
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return _main(argv, signals)
    except KeyboardInterrupt:  # at any moment, the imports of torch and transformers included
        print("oomb: interrupted", file=sys.stderr)
        return 130
    finally:
        signals.restore()


def _main(argv: Sequence[str] | None, signals: _StartupSignals) -> int:
    argv = [str(a) for a in (argv if argv is not None else sys.argv[1:])]
    parser = _build_parser()
    parsed = parser.parse_args(argv)
    command = parsed.command
    if command == "train":  # before the heavy imports: a signal during them is never lost
        signals.install()
    try:
        job, file_keys = _job_config(command, argv, parsed.config)
        if parsed.print_config:
            from .config.io import dump_yaml

            sys.stdout.write(dump_yaml(job, command))
            return 0
        args = _namespace(command, job)
        args._argv = argv
        if command == "train":
            args._signals = signals
            return _train(args)
        if command == "plan":
            return _plan(args)
        if command == "grad-error":
            return _grad_error(args)
        if command == "eval":
            return _eval(args)
        if command == "bench":
            return _bench(args)
    except UsageError as exc:
        _fail(f"{exc.problem}; {exc.fix}", 1 if isinstance(exc, _RunError) else 2)
    parser.error(f"unknown command {command!r}")  # pragma: no cover - argparse rejects it first


def _job_config(command: str, argv: Sequence[str], config_file: str | None):
    """The :class:`oomb.config.JobConfig` of ``command``: defaults, then the ``--config`` file, then the flags
    given; and the set of the file's keys. A bad value is a :class:`UsageError` naming the flag (or the file's key,
    where the value came from the file)."""
    from .config.flags import command_fields, flag_name, job_from_values
    from .config.io import read_yaml

    given = vars(_build_parser(suppress=True).parse_args(argv))
    dests = {ff.dest for ff in command_fields(command)}
    given = {k: v for k, v in given.items() if k in dests}
    file_keys: set[str] = set()
    try:
        file_values = read_yaml(config_file) if config_file is not None else {}
    except ConfigError as exc:
        raise UsageError(exc.problem, exc.fix) from exc
    for section, values in file_values.items():
        file_keys |= {f"{section}.{k}" for k in (values or {})}
    try:
        job = job_from_values(command, given, file_values)
    except ConfigError as exc:
        from_file = f"{exc.section}.{exc.key}" in file_keys and not any(
            ff.dest in given for ff in command_fields(command) if ff.section == exc.section and ff.name == exc.key)

        def name(field: str) -> str:
            if from_file:
                return f"{exc.section}.{field} (in {config_file})" if field == exc.key else f"{exc.section}.{field}"
            return flag_name(command, exc.section, field) or field

        raise UsageError(*exc.parts(name)) from exc
    return job, file_keys


def _namespace(command: str, job) -> argparse.Namespace:
    """The flat namespace of ``job`` the command handlers read (one attribute per flag), with the job itself."""
    from .config.flags import namespace_of

    args = namespace_of(command, job)
    args.command = command
    args.job = job
    return args


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
