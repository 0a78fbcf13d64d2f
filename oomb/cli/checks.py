"""Checks of a job's settings against each other and the machine (device, memory, offload, sparse) before anything
is loaded; warnings where a setting would do nothing."""

from __future__ import annotations

import argparse
import warnings
from typing import Sequence

from ..config import SparseConfig
from ..config.engine import SMALL_SEGMENT_TOKENS
from .errors import UsageError, _named, _one_line

_SPARSE_DEFAULTS = {"page_budget": SparseConfig.page_budget, "sink_pages": SparseConfig.sink_pages,
                    "local_pages": SparseConfig.local_pages, "sparse_score": SparseConfig.score}
"""The flags of the sparse options and their defaults (those of :class:`oomb.config.SparseConfig`)."""


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
    """Refuse a CPU run whose weights, gradients and optimizer states (and, for adamw-cpu, its copies) alone exceed
    the available RAM, or do with its KV store (:func:`_check_cpu_kv_store`), before any weight is allocated."""
    from ..memory import ModelShape, base_gpu_bytes, host_memory, optimizer_bytes

    shape = ModelShape.from_config(model_config)
    n = shape.num_params()

    def need(rank: int, targets: str = "q_proj,k_proj,v_proj,o_proj", embeddings_norms: bool = False) -> int:
        _, _, weights, grads, optim, _ = base_gpu_bytes(  # as oomb plan counts them
            shape, min(args.chunk_size, args.seq_len), args.chunk_size, dtype, rank, args.optimizer,
            args.checkpoint_layers, "torch", 4096, 1024, args.grad_accum_dtype, targets, embeddings_norms)
        return weights + grads + optim + optimizer_bytes(shape, dtype, rank, args.optimizer, targets, embeddings_norms).host

    available = host_memory()[0]
    needed = need(args.lora_rank, args.lora_targets, args.train_embeddings_norms)
    if needed > available:
        lora = not args.lora_rank and need(8) <= available
        raise UsageError(
            f"--model {args.model} ({n / 1e9:.2f}B parameters) needs at least {needed / 2**30:.1f} GiB of memory "
            f"on the CPU for its weights, {'adapter ' if args.lora_rank else ''}gradients and optimizer states, but "
            f"{available / 2**30:.1f} GiB is available",
            (f"use --lora-rank 8 (~{need(8) / 2**30:.1f} GiB), " if lora else "use ") + "a smaller --model (e.g. tiny), or --device cuda",
        )
    _check_cpu_kv_store(args, shape, dtype, needed, available)


def _check_cpu_kv_store(args: argparse.Namespace, shape, dtype: "torch.dtype", rest: int, available: int) -> None:
    """Refuse a CPU run whose KV store for --seq-len (every page in host memory: K, V, dK and dV of
    ``ceil(seq_len / page_size)`` whole pages per layer) does not fit in the ``available`` RAM beside the ``rest``
    bytes of weights, gradients and optimizer states (:func:`_check_cpu_memory`'s count, as ``oomb plan`` counts
    them). An allocation that large is not refused by the OS: the pages would be touched step by step until the
    process is killed. The activations are left out: the plan's count of them is a GPU's, and a run that fits
    without them is not refused for an estimate."""
    from ..memory import page_bytes

    pages = -(-args.seq_len // args.page_size)
    store = shape.num_layers * pages * page_bytes(shape, args.page_size, dtype)
    if store + rest <= available:
        return
    per_token = store / (pages * args.page_size)
    fits = int(max(available - rest, 0) // per_token) // args.page_size * args.page_size
    shorter = f"a --seq-len of at most {fits:,}" if fits >= 2 else "a shorter --seq-len"
    big_page = args.page_size > args.seq_len
    raise UsageError(
        f"the KV store for --seq-len {args.seq_len:,} needs {store / 2**30:.2f} GiB of memory on the CPU "
        + (f"(one whole page of --page-size {args.page_size:,} tokens per layer) " if big_page else "")
        + f"and the weights, gradients and optimizer states {rest / 2**30:.2f} GiB more, but "
        f"{available / 2**30:.2f} GiB is available",
        (f"pass a --page-size (and --chunk-size) of at most --seq-len {args.seq_len}, " if big_page else f"use {shorter}, ")
        + "or --device cuda (with --offload on where the GPU is smaller)",
    )


def _check_lora_targets(model_config, args: argparse.Namespace) -> None:
    """Refuse a --lora-targets naming modules that are not linear layers of the model (before any weight)."""
    from ..models.lora import LoraTargetError, check_targets

    try:
        check_targets(model_config, args.lora_targets)
    except LoraTargetError as exc:
        raise UsageError(f"--lora-targets {args.lora_targets}: model {args.model!r} has no linear layers named "
                         f"{', '.join(exc.unknown)}", f"pass some of {', '.join(exc.available)}, or all-linear") from exc


def _check_cpu_offload_sizes(args: argparse.Namespace) -> None:
    """Refuse offload sizes (--gpu-page-budget, --offload-segment-pages) for a --device cpu run with --offload auto,
    which never offloads there (train, and plan of the same run)."""
    if args.device == "cuda" or args.offload != "auto":
        return
    for flag, value in (("--gpu-page-budget", args.gpu_page_budget), ("--offload-segment-pages", args.offload_segment_pages)):
        if value is not None:
            raise UsageError(f"{flag} sizes offload, which --offload auto never uses on the CPU",
                             f"pass --offload on to run the offloaded store on the CPU, --device cuda, or leave {flag} out")


def _warn_if_segment_pages_unused(args: argparse.Namespace) -> None:
    """--offload-segment-pages with --sparse is not used: a warning (train and plan, once every refusal is behind)."""
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
    the run keeps them there and moves nothing to the host (plan, and train on a GPU; a user found
    the flag ignored without a word)."""
    if args.offload != "on" or args.gpu_page_budget is not None or offloads:
        return
    pages = num_layers * -(-args.seq_len // args.page_size)
    warnings.warn(
        f"--offload on: all {pages} KV pages of this run fit on the GPU, so every page stays there and nothing is "
        f"offloaded to the host (as with --offload auto); pass a --gpu-page-budget below {pages} to keep only part "
        "of them on the GPU", stacklevel=2)


def _warn_if_adamw_rounds_bf16_updates(args: argparse.Namespace, dtype) -> None:
    """Warn that plain AdamW on bfloat16 weights (a full fine-tune) rounds away the updates below half a bf16 step
    of their weight (~1/256 of it): at fine-tuning learning rates most of them. Measured on an H200 (Qwen2.5-7B
    shape, 64K, lr 1e-5): step-3 loss 11.97 with adamw against 10.70 with adamw-bf16."""
    import torch

    if args.optimizer != "adamw" or dtype != torch.bfloat16 or args.lora_rank > 0:
        return
    warnings.warn(
        "--optimizer adamw on bfloat16 weights rounds away every update smaller than half a bf16 step of its weight "
        "(~1/256 of it), most of them at fine-tuning learning rates; pass --optimizer adamw-bf16 (stochastic "
        "rounding, same memory) or --dtype float32", stacklevel=2)


def _warn_if_bf16_optimizer_has_float_weights(args: argparse.Namespace, dtype) -> None:
    """Warn that --optimizer adamw-bf16 on weights that are not bfloat16 is plain AdamW: its stochastic rounding
    is of bfloat16 weights (torchao's ``bf16_stochastic_round``), and a user asking for it expects them."""
    import torch

    if args.optimizer != "adamw-bf16" or dtype == torch.bfloat16:
        return
    name = str(dtype).replace("torch.", "")
    warnings.warn(
        f"--optimizer adamw-bf16 rounds bfloat16 weights stochastically, but the weights are {name}: it trains as "
        "--optimizer adamw; pass --dtype bfloat16 for its bf16 weights, or --optimizer adamw", stacklevel=2)


def _warn_if_gpu_saved_attention_on_cpu(args: argparse.Namespace, device) -> None:
    """Warn that --save-attention gpu on the CPU keeps the outputs in the CPU's memory (the compute device's, as
    SavedAttention does): the run works, but the flag asked for GPU memory (train and bench)."""
    if args.save_attention != "gpu" or device.type == "cuda":
        return
    save = _named(args, "engine.save_attention", "--save-attention")
    warnings.warn(
        f"{save} gpu with {_named(args, 'model.device', '--device')} {device.type} keeps Stage 1's attention outputs "
        "in ordinary CPU memory, as "
        "--save-attention host does on the CPU (the same run); 'gpu' means GPU memory only with --device cuda",
        stacklevel=2)


def _warn_if_offload_segments_are_small(args: argparse.Namespace, offloads: bool) -> None:
    """Warn when an explicit --offload-segment-pages splits a layer's past into segments smaller than
    :data:`oomb.config.engine.SMALL_SEGMENT_TOKENS` (train and plan, where the run offloads; sparse attention does not use them).
    A user found --offload-segment-pages 1 accepted without a word."""
    pages = args.offload_segment_pages
    if pages is None or not offloads or args.sparse:
        return
    floor = max(1, SMALL_SEGMENT_TOKENS // args.page_size)
    if pages >= min(floor, -(-args.seq_len // args.page_size)):  # or one segment holds a whole layer
        return
    from ..memory import DEFAULT_SEGMENT_TOKENS, default_segment_pages

    warnings.warn(
        f"--offload-segment-pages {pages} stages {pages * args.page_size:,} tokens of a layer's past at a time: each "
        "segment costs its own host-to-device copies and attention call, so segments this small make offload slow; "
        f"pass {floor} pages ({floor * args.page_size:,} tokens) or more, or leave the flag out for the default, "
        f"{DEFAULT_SEGMENT_TOKENS:,} tokens' worth ({default_segment_pages(args.page_size)} pages of --page-size "
        f"{args.page_size})", stacklevel=2)


def _warn_if_warmup_outlasts_the_run(args: argparse.Namespace) -> None:
    """Warn when --warmup-steps is longer than the run (--steps): the learning rate is still rising at the last
    step, so it peaks at ``lr * steps / warmup_steps`` and never reaches --lr (train). A warning, not a refusal:
    the schedule is well defined, and a short trial run of a long run's settings (--steps 2 over its --config
    file) is a run worth starting."""
    warmup, steps = args.warmup_steps, args.steps
    if warmup is None or warmup <= steps:
        return
    peak = args.lr * steps / warmup
    after = " (nor does the cosine decay start)" if args.lr_schedule == "cosine" else ""
    warnings.warn(
        f"--warmup-steps {warmup:,} is longer than the run (--steps {steps:,}): the learning rate is still warming up "
        f"at the last step, so it peaks at {peak:.3g} ({steps:,}/{warmup:,} of --lr {args.lr:g}) and never reaches "
        f"--lr{after}; pass --warmup-steps {steps:,} or fewer, or leave it out (10% of --steps)", stacklevel=2)


def _all_past_pages(n: int) -> str:
    """'all 12 past pages', or 'the 1 past page' (the notes on budgets that keep every page)."""
    return "the 1 past page" if n == 1 else f"all {n:,} past pages"


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
           f"{kept} pages cover {_all_past_pages(past)} of the last chunk" if past else
           f"the sequence is one chunk (--chunk-size {args.chunk_size}), which has no past page to choose from")
    flags = [f"--{n.replace('_', '-')}" for n in ("page_budget", "sink_pages", "local_pages") if getattr(args, n) > 0]
    smaller = " or ".join([", ".join(flags[:-1]), flags[-1]] if len(flags) > 1 else flags)
    fix = (f"use a longer --seq-len or a smaller {smaller}" if past else
           "use a --chunk-size below --seq-len (sparse attention selects among the pages of earlier chunks)")
    warnings.warn(
        f"--sparse at --seq-len {args.seq_len}: {why}, so the sparse selection keeps every page and attention is "
        f"dense (correct, just not sparse); {fix}, or drop --sparse", stacklevel=2)


def _check_sizes(args: argparse.Namespace) -> None:
    """The checks of ``oomb train`` that need more than one section (the configuration checked each value)."""
    _check_backend_device(args)
    args.rope_scaling_dict = None
    if args.rope_scaling is not None:
        from ..models.rope import parse_rope_scaling

        try:
            args.rope_scaling_dict = parse_rope_scaling(args.rope_scaling)
        except ValueError as exc:
            raise _usage_from(exc, "pass e.g. --rope-scaling type=yarn,factor=4,original_max_position_embeddings=32768") from exc
        if not args.rope_scaling_dict:
            raise UsageError("--rope-scaling is empty", "pass e.g. --rope-scaling type=linear,factor=4")


def _check_fused_glue(kind: str, device) -> None:
    """The CPU or a missing Liger-Kernel for ``--fused-glue kind``, before any weight is built (train and bench)."""
    from ..models.fused_glue import FusedGlueError, check_fused_glue

    try:
        check_fused_glue(kind, device)
    except FusedGlueError as exc:
        raise UsageError(*exc.parts(lambda field: "--fused-glue")) from exc


def _check_backend_device(args: argparse.Namespace) -> None:
    if args.attention_backend == "triton" and args.device != "cuda":
        device = _named(args, "model.device", "the run's device")
        raise UsageError(f"{_named(args, 'engine.attention_backend', '--attention-backend')} triton runs on the GPU "
                         f"only, but {device} is {args.device}",
                         "pass --device cuda, or --attention-backend torch, sdpa or auto on the CPU")


def _resolve_device_dtype(args: argparse.Namespace):
    """(torch device, torch dtype) of a command that runs a model: --dtype resolved for --device by
    :func:`oomb.config.resolve_dtype` (as ``oomb plan`` resolves it). Refuses --device cuda without a CUDA GPU."""
    import torch

    from ..config import resolve_dtype

    if args.device == "cuda" and not torch.cuda.is_available():
        device = _named(args, "model.device", "--device")
        given = "--device cuda was given" if device == "--device" else f"{device} is cuda"
        raise UsageError(f"{given} but no CUDA GPU is available to PyTorch",
                         "pass --device cpu, or install a CUDA build of torch")
    return torch.device(args.device), getattr(torch, resolve_dtype(args.dtype, args.device))


_FLAG_NAMES = [
    ("use LoRA, checkpoint_layers or a smaller chunk_size", "use --lora-rank, --checkpoint-layers or a smaller --chunk-size"),
    ("use a smaller chunk, LoRA or checkpoint_layers", "use a smaller --chunk-size, --lora-rank or --checkpoint-layers"),
    ("use LoRA", "use --lora-rank"),  # the planner's fixes without the flags a plan already has
    ("lower staging_sets", "lower --offload-staging-sets"),
    ("plan for one with plan(..., machine=Machine(...))",
     "plan for a GPU machine with --gpu-gib and --host-gib (its free GPU memory and available host RAM, in GiB)"),
    ("plan(..., machine=Machine(...))", "oomb plan --gpu-gib and --host-gib"),
    ("turn offload on (offload='auto' or True)", "turn offload on (--offload auto, or on)"),
    ("attention_backend='triton'", "--attention-backend triton"),
    ("pass lengths of", "pass --lengths of"),  # the retrieval prompts' fixes
    ("pass depths in percent", "pass --depths in percent"),
]
_PARAM_FLAGS = ("offload_segment_pages", "gpu_page_budget", "checkpoint_layers", "seq_len", "chunk_size", "page_size",
                "page_budget", "sink_pages", "local_pages", "lora_rank", "rope_theta", "train_embeddings_norms")


def _flag_names(text: str) -> str:
    """A library message as the CLI user reads it: Python parameter names become the flags that set them."""
    import re

    for old, new in _FLAG_NAMES:
        text = text.replace(old, new)
    text = re.sub(r"\boptimizer='([\w-]+)'", r"--optimizer \1", text)
    text = re.sub(r"\b(shard|dtype)='([\w-]+)'", r"--\1 \2", text)
    return re.sub(r"(?<![\w/.-])(" + "|".join(_PARAM_FLAGS) + r")(?![\w/-]|\.\w)", lambda m: "--" + m.group(1).replace("_", "-"), text)


def _usage_from(exc: Exception, default_fix: str) -> UsageError:
    """Split a library error 'problem; fix' into a UsageError (or add ``default_fix``), with flag names."""
    problem, sep, fix = _flag_names(_one_line(str(exc))).partition("; ")
    return UsageError(problem, fix if sep else default_fix)


def _check_vocab(max_id: int, vocab: int, model_name: str, source: str = "the data has") -> None:
    """Refuse token ids the model's embedding does not have; ``source`` names what holds them, with its verb."""
    if max_id >= vocab:
        raise UsageError(
            f"{source} token id {max_id} but model {model_name!r} has a vocabulary of {vocab} ids",
            "use the tokenizer that belongs to the model (--tokenizer) or a model whose vocabulary covers it",
        )


def _preset_names() -> list[str]:
    from ..models.presets import preset_names

    return preset_names()
