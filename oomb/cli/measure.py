"""``oomb eval``, ``oomb grad-error`` and ``oomb bench``: measurements of loss, gradient error and speed."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .checks import (
    _check_backend_device,
    _check_fused_glue,
    _check_sparse_flags,
    _all_past_pages,
    _last_chunk_past_pages,
    _resolve_device_dtype,
    _usage_from,
    _warn_if_gpu_saved_attention_on_cpu,
    _warn_if_offload_moves_nothing,
)
from .inputs import (
    _EVAL_REPORT_KEYS,
    _GRAD_ERROR_REPORT_KEYS,
    _check_data_exists,
    _check_json_arg,
    _check_model_named,
    _check_report_task,
    _load_model,
    _load_tokens,
    _model_config,
    _supported_models_fix,
    _tokenizer_path,
    _write_json,
)
from .errors import UsageError, _RunError

_EVAL_MAX_WINDOWS = 16
"""``oomb eval`` without --num-windows: every whole window of the data, at most this many."""


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
            f"{args.local_pages} covers {_all_past_pages(past_pages)} of the last chunk, so sparse equals dense there ({result}); "
            "measure with a longer --seq-len or a smaller --page-size",
            file=sys.stderr,
        )


def _grad_error(args: argparse.Namespace) -> int:
    """``oomb grad-error``: the sparse-vs-dense gradient error table of one sequence."""
    _check_backend_device(args)
    _check_budgets_see_a_past(args)
    _check_json_arg(args, _GRAD_ERROR_REPORT_KEYS, "grad-error")
    _check_data_exists(args)
    from ..data import DataError, TokenSequences
    from ..sparse_quality import sparse_grad_error

    _check_model_named(args, "grad-error")  # before the data is tokenised
    device, dtype = _resolve_device_dtype(args)
    cfg = args.job.engine  # its sparse section: the sink, local and score settings of the budgets' runs
    tokens = _load_tokens(args, _tokenizer_path(args, checkpoints=True))
    try:
        sequences = TokenSequences(tokens, args.seq_len, seed=args.seed)
    except DataError as exc:
        raise UsageError(exc.problem, exc.fix) from exc
    model = _load_model(args, tokens, device, dtype, "grad-error")
    model.requires_grad_(True)  # every weight's gradient is compared (a merged LoRA adapter comes back frozen)
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
    """``oomb eval``: mean loss on consecutive --seq-len windows (or, with --task passkey|needle, retrieval accuracy
    at depth), dense and per sparse page budget."""
    args.budgets = args.budgets or []
    _check_sparse_flags(args, bool(args.budgets), "--budgets", ("sink_pages", "local_pages", "sparse_score"),
                        how="add --budgets with the page budgets to evaluate (e.g. --budgets 16 64)")
    _check_budgets_see_a_past(args)
    budgets = list(dict.fromkeys(args.budgets))  # in the given order, each once
    if args.task != "loss":
        from .retrieval import _eval_retrieval

        return _eval_retrieval(args, budgets)
    _check_backend_device(args)
    _check_report_task(args)
    _check_json_arg(args, _EVAL_REPORT_KEYS, "eval")
    _check_data_exists(args)
    import torch

    from ..data.stats import counted
    from ..evaluation import evaluate_windows

    device, dtype = _resolve_device_dtype(args)
    cfg = args.job.engine if budgets else args.job.engine.dense()
    _check_model_named(args, "eval")  # before the data is tokenised
    # Windows are checked before any weight is read.
    tokenizer_path = _tokenizer_path(args, checkpoints=True)
    tokens = _load_tokens(args, tokenizer_path)
    n, S = int(tokens.shape[0]), args.seq_len
    available = n // S
    if available == 0:
        raise UsageError(f"the data has {counted(n, 'token')}, fewer than one window of --seq-len {S:,}", f"pass --seq-len {n} or less, or more text as --data")
    if args.num_windows is not None and args.num_windows > available:
        raise UsageError(
            f"--num-windows is {args.num_windows:,} but the data ({counted(n, 'token')}) holds "
            f"{counted(available, 'window')} of --seq-len {S:,}",
            f"pass --num-windows {available} or less, or a smaller --seq-len",
        )
    count = args.num_windows if args.num_windows is not None else min(available, _EVAL_MAX_WINDOWS)
    from ..evaluation import token_windows

    windows = token_windows(tokens, S, count)
    model = _load_model(args, tokens, device, dtype, "eval")
    _warn_if_offload_moves_nothing(args, model.config.num_hidden_layers)
    capped = "" if args.num_windows is not None or count == available else f" (of {available:,}; --num-windows {available} for all)"
    print(
        f"oomb: eval {args.model} ({str(dtype).replace('torch.', '')}, {device}); tokenizer {tokenizer_path or 'bundled'}; "
        f"{counted(n, 'token')} -> {counted(count, 'window')} of {S:,}{capped}; chunk {args.chunk_size:,}, page {args.page_size:,}; "
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


def _keep_graphs_words(cfg) -> str:
    """', keep-graphs auto (at most N)' for bench's header line, or nothing when off."""
    if cfg.keep_graphs != "auto":
        return ""
    return ", keep-graphs auto" + (f" (at most {cfg.keep_graphs_max})" if cfg.keep_graphs_max is not None else "")


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

    from .. import UnsupportedModelError
    from ..bench import bench_rows, bench_table
    from ..models.presets import UnknownModelError, build_model

    device, dtype = _resolve_device_dtype(args)
    cfg = args.job.engine
    _check_fused_glue(cfg.fused_glue, device)
    try:
        model_config = _model_config(args, "bench")
        if device.type == "cpu":
            from ..memory import ModelShape, host_memory

            n = ModelShape.from_config(model_config).num_params()
            need, available = 2 * n * dtype.itemsize, host_memory()[0]  # weights and gradients, before activations
            if need > available:
                raise UsageError(f"--model {args.model} ({n / 1e9:.2f}B parameters) needs at least {need / 2**30:.1f} GiB "
                                 f"on the CPU for its weights and gradients, but {available / 2**30:.1f} GiB is available",
                                 "use a smaller --model (e.g. tiny), or --device cuda")
        torch.manual_seed(args.seed)
        model = build_model(args.model, dtype=dtype, device=device)
    except (UnknownModelError, UnsupportedModelError) as exc:
        raise _usage_from(exc, _supported_models_fix("bench")) from exc
    from ..ops.paged_attention import resolve_backend

    backend = resolve_backend(args.attention_backend, device)
    _warn_if_gpu_saved_attention_on_cpu(args, device)
    print(f"oomb bench: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters, "
          f"{str(dtype).replace('torch.', '')}) on {device}; oomb: chunk {args.chunk_size:,}, page {args.page_size:,}, "
          f"attention {backend}, save-attention {args.save_attention}"
          f"{', checkpoint-layers (attention ' + args.checkpoint_attention + ')' if args.checkpoint_layers else ''}"
          f"{', fused glue ' + cfg.fused_glue + ' (hf too)' if cfg.fused_glue != 'none' else ''}"
          f"{_keep_graphs_words(cfg)}, "
          f"timed at step {args.steps}", file=sys.stderr)
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
                                                checkpoint_layers=args.checkpoint_layers,
                                                checkpoint_attention=args.checkpoint_attention,
                                                fused_glue=cfg.fused_glue, keep_graphs=cfg.keep_graphs,
                                                keep_graphs_max=cfg.keep_graphs_max),
                                    gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                                    cpu_threads=torch.get_num_threads(), torch=torch.__version__,
                                    transformers=__import__("transformers").__version__, rows=rows))
    return 0
