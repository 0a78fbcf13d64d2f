"""``oomb train``: the run around :class:`oomb.train.Trainer` (output folder, log, checkpoints, graceful stop,
messages)."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import time
from pathlib import Path

from .checks import _check_sizes, _resolve_device_dtype
from .errors import CUT_SHORT, UsageError, _disk_full, _one_line, _RunError
from .inputs import _check_data_exists
from .output import _LOSS_PNG, _REPLACED, _TENSORBOARD, _locked_output_dir, _prepare_output, _save
from .parser import _version
from .resume import _resume_command
from .signals import _StartupSignals
from .train_setup import _LONG_WARMUP, _setup


def _parameter_count(model) -> int:
    """Parameters of ``model`` as it runs, each counted once: a tied weight once, and of a module peft trains a
    copy of (``modules_to_save``: --train-embeddings-norms) the copy alone, not the frozen original it keeps beside
    it (unless something else, e.g. a tied output head, still uses that original)."""
    seen: set[int] = set()
    total = 0
    stack = [model]
    while stack:
        m = stack.pop()
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        stack.extend(c for name, c in m.named_children()
                     if not (name == "original_module" and hasattr(m, "modules_to_save")))
    return total


def _step_error(exc) -> _RunError:
    """The one-line message of a failed training step (:class:`oomb.train.StepError`), with its fix in flags."""
    step, kind = exc.step, exc.kind
    if kind == "out_of_memory":
        where = "host" if "can't allocate memory" in (exc.detail or "") else "GPU"
        return _RunError(f"out of {where} memory at step {step}",
                         "use a smaller --chunk-size, --checkpoint-layers, --lora-rank or --offload on (see 'oomb plan')")
    if kind == "other_rank":
        return _RunError(f"step {step}: another rank failed (its error is printed above)", "all ranks stopped")
    if kind == "non_finite":
        return _RunError(
            f"the loss became {exc.loss} at step {step}; the model was not saved (log.jsonl keeps the steps "
            "before it, and checkpoints/ any checkpoint written before it)",
            "lower --lr and run again with --overwrite, or --resume from a checkpoint with a lower --lr")
    if kind == "non_finite_update":
        return _RunError(
            f"the update of step {step} left weights that are not finite numbers"
            + (f" ({_one_line(exc.detail)})" if exc.detail else "") + "; the model was not saved (log.jsonl keeps "
            "the steps before it, and checkpoints/ any checkpoint written before it)",
            "lower --lr and run again with --overwrite, or --resume from a checkpoint with a lower --lr")
    return _RunError(f"step {step} failed: {_one_line(exc.detail)}", "check the data")


def _val_error(exc) -> _RunError:
    """The one-line message of a failed held-out evaluation (:class:`oomb.train.ValError`), with its fix in flags."""
    step, kind = exc.step, exc.kind
    if kind == "out_of_memory":
        return _RunError(f"out of memory evaluating the held-out loss after step {step}",
                         "pass a smaller --val-sequences or --chunk-size, or leave --val-every out")
    if kind == "other_rank":
        return _RunError(f"the held-out loss after step {step}: another rank failed (its error is printed above)",
                         "all ranks stopped")
    if kind == "non_finite":
        return _RunError(f"the held-out loss became {exc.detail} after step {step}",
                         "lower --lr and run again with --overwrite, or --resume from a checkpoint with a lower --lr")
    return _RunError(f"the held-out loss after step {step} failed: {_one_line(exc.detail)}",
                     "check the held-out data (--val-data, --val-split)")


def _write_failure(exc: BaseException) -> str | None:
    """Why writing a file of the run failed, for the one-line error (e.g. "the disk is full (No space left on
    device)"), where ``exc`` is what a write raises: an OSError, safetensors' SafetensorError, the RuntimeError of
    torch.save's writer, or the CheckpointError that carries a rank 0's write error to every rank of a sharded save.
    None where ``exc`` is anything else (raised as it is)."""
    from safetensors import SafetensorError

    from ..checkpoint import CheckpointError

    text = _one_line(exc)
    if isinstance(exc, RuntimeError) and not ("inline_container" in text or "PytorchStreamWriter" in text):
        return None
    if not isinstance(exc, (OSError, SafetensorError, RuntimeError, CheckpointError)):
        return None
    full = _disk_full(exc)
    if full == CUT_SHORT:
        return f"{full} (torch.save: {text.split('. ', 1)[-1].strip()})"
    if full is not None:
        return full
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}{f' ({exc.filename})' if exc.filename else ''}"
    return text if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {text}"


def _rank0_failed() -> UsageError:
    """The error of a rank other than 0 where rank 0 failed to write a file of the run (exit status 2)."""
    return UsageError("rank 0 failed to write the run's files (its error is printed above)", "all ranks stopped")


@contextlib.contextmanager
def _rank0_writes(ctx, device):
    """Around the files that rank 0 alone writes under torchrun (the output folder, the log, the model, a checkpoint
    without --shard): every rank enters it at the same point, and at its end takes part in one all-reduce of one
    number, so that an exception of rank 0 inside it (a full disk: its one-line error) stops every other rank too,
    with exit status 2 and :func:`_rank0_failed`'s line, instead of leaving them in their next collective until its
    timeout. Rank 0 raises its own exception. Outside torchrun it does nothing."""
    from ..distributed import RankFailedError, agree_ok

    if not ctx.enabled:
        yield
        return
    try:
        yield
    except Exception:
        try:
            agree_ok(False, device)
        except Exception:  # noqa: BLE001 - the rank's own error is the one to report
            pass
        raise
    try:
        agree_ok(True, device)
    except RankFailedError as exc:
        raise _rank0_failed() from exc


def _draw_loss_png(log_path: Path, png: Path) -> None:
    """loss.png from the records of ``log_path`` (after a resume in the same folder every step from the first; in a
    new folder only the steps trained there, its log starting after the checkpoint); a failure is a note, never the
    run's failure (the model and log are what matter)."""
    from ..train import plot_log

    try:
        plot_log(log_path, png)
    except Exception as exc:  # noqa: BLE001 - a plot must not fail a finished run
        print(f"oomb: note: {png.name} was not drawn ({type(exc).__name__}: {_one_line(exc)})", file=sys.stderr)


def _train(args: argparse.Namespace) -> int:
    _check_sizes(args)
    # Locked before its contents are checked: a second run into the folder is refused before it changes anything
    # there, and what this run removes there (leftovers of killed runs, an --overwrite's earlier run) is no other
    # live run's.
    started = False
    try:
        with _locked_output_dir(args) as out:
            started = True
            return _train_into(args, out)
    except UsageError:
        if not started:
            _refused_before_the_group(args)
        raise


def _refused_before_the_group(args: argparse.Namespace) -> None:
    """Under torchrun, where this rank refused the output folder before it joined the process group (rank 0 alone
    takes the folder's lock, so it alone is refused while another run writes there): join the group and tell the
    others at the agreement :func:`_train_into` makes on joining, so that they stop with status 2 and a line saying
    another rank refused the run, instead of waiting for this rank until torchrun ends them. Outside torchrun, or
    where the group cannot be joined, nothing (this rank's own error is the one to report)."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    try:
        from ..distributed import agree_ok, init_from_env

        device, _ = _resolve_device_dtype(args)
        ctx = init_from_env(device.type)
        try:
            agree_ok(False, _rank_device(device, ctx))
        finally:
            ctx.close()
    except Exception:  # noqa: BLE001 - this rank's refusal is the error to report
        pass


def _rank_device(device, ctx):
    """``device`` as this rank uses it under torchrun: its own GPU (LOCAL_RANK) for cuda."""
    import torch

    return torch.device("cuda", ctx.local_rank) if ctx.enabled and device.type == "cuda" else device


def _train_into(args: argparse.Namespace, out: Path) -> int:
    """``oomb train`` into its checked output folder ``out``, which this process holds locked where it writes it."""
    if args.report_to == "tensorboard":
        try:
            import tensorboard  # noqa: F401 - torch.utils.tensorboard needs it
        except ImportError as exc:
            raise UsageError("--report-to tensorboard needs the tensorboard package", "pip install tensorboard") from exc

    _check_data_exists(args)
    # Heavy imports only after the cheap checks.
    from ..distributed import RankFailedError, agree_ok, init_from_env

    device, dtype = _resolve_device_dtype(args)
    # Under torchrun (WORLD_SIZE > 1) every rank trains its own sequences; gradients are summed once per step.
    ctx = init_from_env(device.type)
    device = _rank_device(device, ctx)
    try:
        if ctx.enabled:  # a rank that refused its output folder before joining says so here
            try:
                agree_ok(True, device)
            except RankFailedError as exc:
                raise UsageError("another rank refused the run (its error is printed above)",
                                 "fix the input and start again") from exc
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


def _run(args: argparse.Namespace, out: Path, device, dtype, ctx, run: dict) -> int:
    """The training loop (all checks passed): log, checkpoint, stop on a signal, save."""
    from tqdm.auto import tqdm

    from ..checkpoint import GracefulStop, find_latest, rng_state, save_checkpoint
    from ..data.stats import counted
    from ..distributed import global_any
    from ..train import SequenceStream, StepError, StepLog, StepStopped, TensorBoardLog, Trainer, ValError, warmup_steps

    tokenizer, sequences, model, engine = run["tokenizer"], run["sequences"], run["model"], run["engine"]
    params, optimizer, start_step = run["params"], run["optimizer"], run["start_step"]
    sharding = run["sharding"]  # FSDP2 shards (--shard under torchrun): checkpoints and the saved model gather them
    held_out = run["held_out"]  # the held-out loss of --val-every (HeldOutLoss), or None
    main_rank = ctx.is_main
    log_path = out / "log.jsonl"
    log = board = None
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
    with _rank0_writes(ctx, device):
        if main_rank:
            # ---- every check passed: from here on we write.
            _prepare_output(out, args.overwrite)
            log = StepLog(log_path, start_step)  # a resumed run drops the steps after its checkpoint: trained again
            if args.report_to == "tensorboard":
                board = TensorBoardLog(out / _TENSORBOARD, start_step)
    # A signal while the output was prepared: stop before training. The same command runs again (an empty
    # --output-dir is new; with --overwrite, the earlier run stays in .oomb-replaced).
    signals.check()
    n_trainable = sum(p.numel() for p in params)
    n_total = _parameter_count(model)
    warmup = warmup_steps(args.steps, args.warmup_steps)
    if main_rank and args.warmup_steps is None and warmup > _LONG_WARMUP:
        # --steps 99999999999999999999 (a run to stop with Ctrl-C) warmed up at a learning rate of ~0 for as long as
        # anyone could run it
        print(f"oomb: note: the default warm-up is 10% of --steps {args.steps:,}: {warmup:,} steps before the learning "
              f"rate reaches --lr {args.lr:g}; pass --warmup-steps (e.g. 1000) for a long or open-ended run", file=sys.stderr)
    show = main_rank and args.progress is not False and (args.progress or sys.stderr.isatty())
    K, W = args.grad_accum, ctx.world_size
    stream = SequenceStream(sequences)
    if main_rank:
        ranks = f"; {W:,} ranks" if W > 1 else ""
        print(
            f"oomb: {args.model} ({n_total / 1e6:.1f}M parameters, {n_trainable / 1e6:.2f}M trainable, {str(dtype).replace('torch.', '')}, {device}); "
            f"{sequences.stats.tokens:,} tokens -> {counted(len(sequences), 'sequence')} of {args.seq_len:,}; {K * W:,} per step{ranks}; chunk {args.chunk_size:,}{' (> --seq-len: one chunk per sequence)' if args.chunk_size > args.seq_len else ''}, page {args.page_size:,}; "
            f"log: {log_path}",
            file=sys.stderr,
        )
        print(f"oomb: {sequences.stats.summary()}; tokenizer {run['tokenizer_path'] or 'bundled'}", file=sys.stderr)
        print(f"oomb: {run['store_summary']}", file=sys.stderr)
        if held_out is not None:
            print(f"oomb: held-out loss every {counted(args.val_every, 'step')} and after the last: "
                  f"{counted(len(held_out.sequences), 'sequence')} of {run['held_out_where']} "
                  f"({held_out.tokens:,} target tokens)", file=sys.stderr)
        drawn = (args.steps - start_step) * K * W
        if drawn > len(sequences):
            print(f"oomb: note: {counted(args.steps - start_step, 'step')} x {counted(K * W, 'sequence')} = "
                  f"{counted(drawn, 'sequence')} from {len(sequences):,}: "
                  f"the data is repeated (~{drawn / len(sequences):,.1f} passes); more data or fewer --steps avoids it",
                  file=sys.stderr)

    def _unwritten(problem: str) -> UsageError:
        """The error of a file of the run that cannot be written: the fix continues from the newest checkpoint."""
        latest = find_latest(ckpt_root) if main_rank or sharding is not None else None
        resume = _resume_command(args._argv)
        if latest is None:
            return UsageError(f"{problem}; no checkpoint was saved",
                              "free space on that disk and run the same command with --overwrite, or pass another "
                              "--output-dir")
        return UsageError(f"{problem}; the checkpoint {latest.name} is complete",
                          f"free space on that disk and continue with {resume}, or continue in another --output-dir "
                          f"with --resume {latest}")

    def save(step: int, rng: dict | None) -> Path:
        extra = {"rng": rng if rng is not None else rng_state(), "step": step, "sequences_per_step": K * W}
        try:
            return save_checkpoint(ckpt_root, step, model, optimizer, None, run["fingerprint"], extra, keep_last=2,
                                   settings=run["settings"], sharded=sharding is not None)
        except Exception as exc:
            why = _write_failure(exc)
            if why is None:
                raise
            # save_checkpoint removed its unfinished folder: the checkpoints there are complete ones.
            raise _unwritten(f"the checkpoint of step {step} cannot be written to {ckpt_root}: {why}") from exc

    def checkpoint(step: int, rng: dict | None = None) -> Path | None:
        """The checkpoint of ``step``, written by rank 0 alone (every rank learns whether it was:
        :func:`_rank0_writes`), or with --shard by every rank (a collective save that fails on every rank where
        rank 0's write fails); its folder, None on a rank that writes none. Every rank calls it at the same step."""
        if sharding is not None:
            return save(step, rng)
        with _rank0_writes(ctx, device):
            return save(step, rng) if main_rank else None

    model.train()
    trainer = Trainer(engine, optimizer, stream, args.job.train, params=params, dist=ctx, device=device,
                      eos_token_id=tokenizer.eos_token_id, document_mask=args.document_mask, progress=show,
                      sharding=sharding)
    first_loss = last_loss = None
    saved_at = start_step
    t_start = time.perf_counter()
    what = "this step (with --grad-accum: this sequence)" if K > 1 and not ctx.enabled else "this step"
    notice = (
        f"oomb: {{name}} received: finishing {what}, then saving a "
        "checkpoint and stopping (send it again to stop at once WITHOUT saving)"
    ) if main_rank else None
    # GracefulStop takes the signals over from _StartupSignals until the run has saved its model (a signal after the
    # last step waits for the final checkpoint and model instead of killing the save); a signal since the check
    # above stops the run after its first step, as any signal during training does. On exit it restores the
    # handlers from before oomb's.
    with GracefulStop(notice=notice) as stop:
        stop.take_over(signals.previous, signals.signum)
        with _rank0_writes(ctx, device):
            if log is not None:
                log.open()
            if board is not None:
                board.open()
        try:
            with tqdm(total=args.steps, initial=start_step, desc="train", unit="step", disable=not show, file=sys.stderr) as bar:
                for step in range(start_step + 1, args.steps + 1):
                    step_rng = rng_state() if K > 1 and not ctx.enabled else None  # the state a mid-step stop saves
                    try:
                        record = trainer.step(step, should_stop=lambda: stop.requested is not None)
                    except StepError as exc:
                        raise _step_error(exc) from exc
                    if isinstance(record, StepStopped):
                        # A signal during a long accumulation stopped the step at a sequence boundary: its gradients
                        # are dropped; the model and optimizer are those after step - 1, which a resume re-runs.
                        done = step - 1
                        path = checkpoint(done, step_rng) if done > saved_at else (find_latest(ckpt_root) if done > 0 else None)
                        name = signal.Signals(stop.requested).name
                        dropped = f"its {record.sequences_done:,} of {counted(record.sequences, 'sequence')} done were dropped"
                        if path is None:
                            print(f"oomb: stopped by {name} during step {step} ({dropped}); no step had completed, so nothing "
                                  "was saved; to start again, run the same command with --overwrite", file=sys.stderr)
                        else:
                            print(f"oomb: stopped by {name} during step {step} ({dropped}); checkpoint {path} (after step "
                                  f"{done}); to continue, run {_resume_command(args._argv)}", file=sys.stderr)
                        return 0
                    first_loss = record.loss if first_loss is None else first_loss
                    last_loss = record.loss
                    val = None  # the held-out loss after this step (--val-every), on every rank alike
                    if held_out is not None and (step % args.val_every == 0 or step == args.steps):
                        try:
                            val = held_out.evaluate(step)
                        except ValError as exc:
                            raise _val_error(exc) from exc
                    unlogged = None  # rank 0: the OSError of writing this step's record (and val's) to log.jsonl
                    if main_rank:
                        try:
                            log.write(record.to_json())
                            if val is not None:
                                log.write(val.to_json())
                        except OSError as exc:
                            unlogged = exc
                    if main_rank and unlogged is None:
                        if board is not None:
                            board.write(record.to_json())
                            if val is not None:
                                board.write(val.to_json())
                        bar.set_postfix(loss=f"{record.loss:.3f}", tok_s=f"{record.tokens_per_s:.0f}")
                        bar.update(1)
                        if step % args.log_every == 0 or step == args.steps:
                            peak = record.peak_memory_bytes
                            mem = "" if peak is None else f"  peak {peak / 2**30:.2f} GiB"
                            kept = f"  kept graphs {record.kept_graphs}" if record.kept_graphs else ""
                            tqdm.write(f"step {step:>5,}/{args.steps:,}  loss {record.loss:.4f}  {record.tokens_per_s:,.0f} tok/s  "
                                       f"{record.seconds:.2f} s  lr {record.lr:.2e}{mem}{kept}", file=sys.stdout)
                        if val is not None:
                            tqdm.write(f"val  {step:>5,}/{args.steps:,}  val_loss {val.val_loss:.4f}  "
                                       f"{val.val_tokens:,} tokens of {counted(val.val_sequences, 'sequence')}  "
                                       f"{val.val_seconds:.2f} s", file=sys.stdout)
                    requested, log_failed = stop.requested is not None, unlogged is not None
                    if ctx.enabled:  # the step's one all-reduce of the CLI: a signal on any rank, rank 0's log write
                        requested, log_failed = global_any([requested, log_failed], device)
                    if unlogged is not None:
                        why = _write_failure(unlogged)
                        raise _unwritten(f"step {step} cannot be written to {log_path}: {why}") from unlogged
                    if log_failed:
                        raise _rank0_failed()
                    if args.save_every and step % args.save_every == 0 and step < args.steps:
                        checkpoint(step)
                        saved_at = step
                    if requested and step < args.steps:
                        path = checkpoint(step) if saved_at != step else (find_latest(ckpt_root) if main_rank else None)
                        if main_rank:
                            name = signal.Signals(stop.requested).name if stop.requested else "a signal on another rank"
                            how = (
                                f"run {_resume_command(args._argv)}" if not ctx.enabled
                                else f"run the same torchrun command with the oomb arguments {_resume_command(args._argv)[5:]}"
                            )
                            print(f"oomb: stopped by {name} after step {step}; checkpoint {path}; to continue, {how}", file=sys.stderr)
                        return 0
        finally:
            if log is not None:
                log.close()
                if board is not None:
                    board.close()
                _draw_loss_png(log_path, out / _LOSS_PNG)

        checkpoint(args.steps)
        state_dict = None
        if sharding is not None:  # every rank sends its shards; rank 0 gets the whole model (or adapter) on the CPU
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state_dict = get_model_state_dict(model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=args.lora_rank > 0))
            if args.lora_rank == 0:
                # A tied weight (the output head of a model that ties it to the input embeddings) gathers as a copy of
                # its own; the model is written with it once, under the first name, as an unsharded model's save does.
                # (peft picks an adapter's tensors by name, tied or not.)
                first = {name for name, _ in model.named_parameters()}
                for name, _ in model.named_parameters(remove_duplicate=False):
                    if name not in first:
                        state_dict.pop(name, None)
        with _rank0_writes(ctx, device):
            if main_rank:
                train_args = {k: v for k, v in vars(args).items() if k not in ("command", "job") and not k.startswith("_")}
                train_args.update(oomb_version=_version(), num_tokens=int(sequences.stats.tokens), num_sequences=len(sequences), world_size=W)
                from ..data.chat import read_chat_template

                template = read_chat_template(args.job.data.chat_template)
                if template is not None:  # saved with the model: what it was trained on is what it is prompted with
                    tokenizer.chat_template = template
                try:
                    saved = _save(model, tokenizer, out, lora=args.lora_rank > 0, train_args=train_args, state_dict=state_dict)
                except Exception as exc:
                    why = _write_failure(exc)
                    if why is None:
                        raise
                    # _save removed its temporary folder; the checkpoint of --steps is complete, and a --resume of it
                    # writes the model.
                    raise _unwritten(f"the trained model cannot be written to {out}: {why}") from exc
                shutil.rmtree(out / _REPLACED, ignore_errors=True)  # the run --overwrite replaced: this one is saved now
                elapsed = time.perf_counter() - t_start
                losses = f"loss {first_loss:.4f} -> {last_loss:.4f}" if first_loss is not None else "no steps left to train"
                print(
                    f"oomb: done in {elapsed:.1f} s; {losses}; saved {', '.join(n for n in saved if n.endswith('.safetensors'))} to {out}",
                    file=sys.stderr,
                )
                if stop.requested is not None:
                    print(f"oomb: {signal.Signals(stop.requested).name} came after the last step: the run finished its final "
                          "checkpoint and model first; nothing is left to do", file=sys.stderr)
    return 0
