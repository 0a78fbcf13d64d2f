"""``oomb train`` before its first step: model, tokenizer, adapter, engine, optimizer, schedule and checkpoint to
resume from."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .checks import (
    _check_cpu_memory,
    _check_cpu_offload_sizes,
    _check_fused_glue,
    _check_lora_targets,
    _check_vocab,
    _usage_from,
    _warn_if_adamw_rounds_bf16_updates,
    _warn_if_bf16_optimizer_has_float_weights,
    _warn_if_gpu_saved_attention_on_cpu,
    _warn_if_offload_moves_nothing,
    _warn_if_offload_on_keeps_every_page,
    _warn_if_offload_segments_are_small,
    _warn_if_segment_pages_unused,
    _warn_if_sparse_is_dense,
    _warn_if_warmup_outlasts_the_run,
)
from .inputs import (
    _held_out_data,
    _model_config,
    _supported_models_fix,
    _training_data,
    _vocab_size,
)
from .errors import UsageError, _allocation_refusal, _named, _one_line
from .output import _broken_latest_pointer, _replaced_run_resume, _saved_model_of
from .resume import (
    _check_resume_fingerprint,
    _checkpoint_settings,
    _data_settings,
    _check_resume_settings,
    _fingerprint,
    _resume_settings,
)

_LONG_WARMUP = 10_000
"""A default warm-up (10% of --steps) longer than this many steps is noted: longer than the warm-ups of published
LLM training runs (~2,000 steps), so most likely a --steps meant as 'until I stop it'."""


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


def _resume_checkpoint(args: argparse.Namespace, out: Path, dtype, world_size: int) -> tuple[Path, list[str]]:
    """The checkpoint --resume names, checked against every fingerprint fact but the data (read later) and the
    settings that must match: (its folder, notes on harmless differences). Refuses a missing or foreign one."""
    from ..checkpoint import find_latest, read_settings

    ckpt_root = out / "checkpoints"
    resume = _named(args, "output.resume", "--resume")  # the subject of the refusals below
    path = find_latest(ckpt_root) if args.resume == "latest" else Path(args.resume).expanduser()
    if path is None:
        replaced = _replaced_run_resume(out)
        if replaced is not None:
            raise UsageError(f"{resume} latest: {ckpt_root} holds no complete checkpoint: {replaced[0]}", replaced[1])
        raise UsageError(f"{resume} latest: {ckpt_root} holds no complete checkpoint",
                         f"start without {_named(args, 'output.resume', '--resume', file=False)} (with --overwrite)")
    if not path.is_dir():
        latest = find_latest(ckpt_root) if ckpt_root.is_dir() else None
        what = ("does not exist" if not path.exists() else "is a file, not a checkpoint folder" if path.is_file()
                else "is not a checkpoint folder")
        raise UsageError(f"{resume} {args.resume}: {path} {what}",
                         "pass 'latest' or a checkpoint folder" + (f" such as {latest}" if latest is not None else
                                                                   f" (step-NNNNNNNN under {ckpt_root})"))
    saved = read_settings(path, "fingerprint")
    if saved is not None:
        saved = {k: v for k, v in saved.items() if k != "data_sha256"}
    _check_resume_fingerprint(saved, _fingerprint(args, None, dtype, world_size), path, resume=resume)
    notes = _check_resume_settings(args, read_settings(path), path)
    if args.resume == "latest":
        notes += _broken_latest_pointer(ckpt_root, path, resume)
    return path, notes


def _setup(args: argparse.Namespace, out: Path, device, dtype, ctx) -> dict:
    """Every check, the model, engine and optimizer, and the checkpoint to resume from: nothing written yet."""
    import torch

    from .. import Engine, UnsupportedModelError
    from ..checkpoint import CheckpointError, load_checkpoint, read_settings, set_rng_state
    from ..models.presets import PRESETS, UnknownModelError, build_model

    shard_note = None
    if args.shard != "none" and not ctx.enabled:
        # As accelerate, Lightning and DeepSpeed run a sharding config on one device: the same settings serve a
        # one-GPU trial. The checkpoints are then those of one process (resumed without --shard).
        shard_note = (f"oomb: note: --shard {args.shard} shards over the ranks of torchrun; this is one process, so it "
                      "trains unsharded (as --shard none)")
        args.shard = "none"
    if args.resume is not None:
        # What the flags alone say of the checkpoint's run, before the data, model and store are checked: a
        # --seq-len (or any fingerprint fact) other than the checkpoint's is the problem to name, not what it breaks.
        path, notes = _resume_checkpoint(args, out, dtype, ctx.world_size)
    # The model's config is checked before any weight is read or initialised, and before the data is tokenised
    # (minutes for a large corpus), so that a misspelt --model is named at once.
    model_config = _model_config(args, "train")
    tokenizer_path, tokenizer, sequences = _training_data(args)
    fingerprint = _fingerprint(args, sequences, dtype, ctx.world_size)
    if args.resume is not None:
        _check_resume_fingerprint(read_settings(path, "fingerprint"), fingerprint, path,  # the data's digest too
                                  (read_settings(path) or {}).get("data"), _data_settings(args, tokenizer),
                                  resume=_named(args, "output.resume", "--resume"))
    held = _held_out_data(args, tokenizer)  # (--val-every) its splits and sequences refused before any weight is built
    _check_vocab(sequences.max_token(), int(model_config.vocab_size), args.model)
    if held is not None:
        _check_vocab(held[0].max_token(), int(model_config.vocab_size), args.model, f"the held-out data {held[1]} has")
    from ..models.limits import lora_rank_problem

    lora_problem = lora_rank_problem(model_config, args.lora_rank, args.model)
    if lora_problem:
        raise UsageError(*lora_problem)
    from ..train.optim import OptimizerUnavailable, build_optimizer, check_available

    try:
        check_available(args.optimizer)  # a missing library before any weight is built
    except OptimizerUnavailable as exc:
        raise _usage_from(exc, "pass --optimizer adamw") from exc
    _check_fused_glue(args.fused_glue, device)
    if args.lora_rank > 0:
        _check_lora_targets(model_config, args)
    if device.type != "cuda":
        _check_cpu_memory(args, model_config, dtype)
    _check_cpu_offload_sizes(args)
    from dataclasses import replace

    cfg = args.job.engine
    if device.type == "cuda":
        # Predict the GPU and host memory of the run before allocating anything (docs/design.md §4 sizes).
        from .plan import _refuse_bad_setting, job_plan

        try:
            plan = job_plan(args, dtype, nproc=ctx.world_size)
            _refuse_bad_setting(plan)  # in oomb plan's words
            plan.check()
        except ValueError as exc:
            err = _usage_from(exc, "see 'oomb plan' for what fits")
            if shard_note:  # the note comes after refusals only: the refusal says the plan was of one process
                err = UsageError(f"{err.problem} (planned as one process: --shard {args.job.train.shard} shards only "
                                 "over the ranks of torchrun)", err.fix)
            raise err from exc
        planned_offload = plan.tiering.offload
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
        # Sharded: each rank builds the model in host memory and shard_model moves only its shards to the GPU, one
        # layer at a time, so a model larger than one GPU can be built (a preset's random weights are then drawn
        # by the CPU's generator).
        model = build_model(args.model, dtype=dtype, device="cpu" if args.shard != "none" else device)
    except (UnknownModelError, UnsupportedModelError) as exc:
        raise _usage_from(exc, _supported_models_fix("train")) from exc
    _check_vocab(sequences.max_token(), _vocab_size(model), args.model)
    if args.rope_theta is not None or args.rope_scaling_dict:
        from ..models.rope import set_rope

        try:
            set_rope(model, rope_theta=args.rope_theta, rope_scaling=args.rope_scaling_dict)
        except ValueError as exc:
            raise _usage_from(exc, "see --rope-theta and --rope-scaling in 'oomb train --help'") from exc
    from ..models.limits import context_length_warning

    warning = context_length_warning(model.config, args.seq_len, args.model)  # after --rope-scaling, as oomb plan

    if args.lora_rank > 0:
        from ..models.lora import apply_lora

        model = apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_targets, args.train_embeddings_norms)
        if args.model not in PRESETS:  # adapter_config.json names the base folder so that it loads from anywhere
            model.peft_config["default"].base_model_name_or_path = str(Path(args.model).resolve())

    sharding = None
    if args.shard != "none":
        from ..engine.sharding import shard_model

        try:
            sharding = shard_model(model, args.shard, device=device,
                                   reduce_dtype=torch.float32 if args.grad_accum_dtype == "float32" else None)
        except ValueError as exc:
            raise _usage_from(exc, "see --shard in 'oomb train --help'") from exc
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
    except RuntimeError as exc:  # the CPU allocator's error
        refusal = _allocation_refusal(
            exc, f"for the KV store of --seq-len {args.seq_len} (pages of --page-size {args.page_size})")
        if refusal is None:
            raise
        raise refusal from exc

    t_reserve_s = time.perf_counter() - t_reserve
    held_out_loss = None
    if held is not None:
        from ..train import HeldOutLoss, held_out

        try:
            held_out_loss = HeldOutLoss(engine, held_out(held[0], args.val_sequences), dist=ctx, device=device,
                                        eos_token_id=tokenizer.eos_token_id, document_mask=args.document_mask,
                                        sharding=sharding)
        except ValueError as exc:
            raise UsageError(f"the held-out data {held[1]}: {_one_line(exc)}",
                             "pass other held-out data (--val-data PATH or --val-split NAME)") from exc

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(args.optimizer, params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                                device=device)

    start_step, finished = 0, False
    if args.resume is not None:
        try:
            start_step, extra = load_checkpoint(path, model, optimizer, None, fingerprint, sharded=sharding is not None)
        except CheckpointError as exc:
            problem, sep, fix = _one_line(exc).rpartition("; ")
            raise UsageError(problem, fix) if sep else UsageError(fix, "resume from another checkpoint") from exc
        # AdamW's state carries the run's weight decay and would silently replace --weight-decay.
        saved_wd = optimizer.param_groups[0].get("weight_decay")
        if saved_wd is not None and saved_wd != args.weight_decay:
            raise UsageError(
                f"{_named(args, 'output.resume', '--resume')}: {path} was trained with --weight-decay {saved_wd:g} "
                f"but this command has --weight-decay "
                f"{args.weight_decay:g}, which would silently change the training",
                f"continue it with --weight-decay {saved_wd:g}, or start a new run without --resume in another --output-dir",
            )
        if path.resolve().parent != (out / "checkpoints").resolve():
            notes.append(f"{_named(args, 'output.resume', '--resume')}: {path} is a checkpoint of another folder "
                         f"({path.resolve().parent}); the run "
                         f"continues in {out}, whose log.jsonl starts at step {start_step + 1}, and that folder is "
                         "left as it is")
        if "rng" in extra:
            set_rng_state(extra["rng"])
        if start_step > args.steps:
            raise UsageError(f"{_named(args, 'output.resume', '--resume')}: {path} is at step {start_step}, past "
                             f"--steps {args.steps}", f"pass --steps {start_step} or more")
        if ctx.is_main:
            for note in notes:
                print(f"oomb: note: {note}", file=sys.stderr)
            print(f"oomb: resuming from {path} (step {start_step})", file=sys.stderr)
        finished = start_step == args.steps and _saved_model_of(out, path, start_step)
    if ctx.is_main:  # after every refusal: a warning never comes with an error line
        if shard_note:
            print(shard_note, file=sys.stderr)
        if held is not None and held[2]:
            print(held[2], file=sys.stderr)
        if warning:
            print(warning, file=sys.stderr)
        _warn_if_segment_pages_unused(args)
        if device.type == "cuda":
            _warn_if_offload_on_keeps_every_page(args, planned_offload, engine.num_layers)
        _warn_if_offload_moves_nothing(args, engine.num_layers)
        _warn_if_sparse_is_dense(args)
        _warn_if_gpu_saved_attention_on_cpu(args, device)
        _warn_if_adamw_rounds_bf16_updates(args, dtype)
        _warn_if_bf16_optimizer_has_float_weights(args, dtype)
        _warn_if_offload_segments_are_small(args, getattr(store, "segment_pages", None) is not None)
        _warn_if_warmup_outlasts_the_run(args)
    return dict(tokenizer=tokenizer, tokenizer_path=tokenizer_path, sequences=sequences, model=model, engine=engine,
                params=params, sharding=sharding,
                optimizer=optimizer, fingerprint=fingerprint, settings=_checkpoint_settings(args, device, tokenizer), start_step=start_step,
                finished=finished, held_out=held_out_loss, held_out_where=held[1] if held is not None else None,
                store_summary=_store_summary(store, args.seq_len, args.page_size, t_reserve_s))
