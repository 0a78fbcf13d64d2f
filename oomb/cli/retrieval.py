"""``oomb eval --task passkey|needle``: retrieval accuracy at depth x length, dense and per sparse page budget."""

from __future__ import annotations

import argparse
import sys

from .checks import (
    _all_past_pages,
    _check_backend_device,
    _last_chunk_past_pages,
    _resolve_device_dtype,
    _usage_from,
)
from .errors import UsageError, _RunError
from .inputs import (
    RETRIEVAL_REPORT_KEYS,
    _check_data_exists,
    _check_json_arg,
    _check_model_named,
    _check_report_task,
    _check_png_arg,
    _data_usage_error,
    _load_model,
    _load_tokens,
    _tokenizer_path,
    _write_json,
)

DEFAULT_DEPTHS = [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0]
"""The depths (percent) without --depths."""


def _load_tokenizer(args: argparse.Namespace, path: str | None):
    from ..data import DataError, load_tokenizer

    try:
        return load_tokenizer(path)
    except DataError as exc:
        raise _data_usage_error(args, exc) from exc


def _check_digits(tokenizer) -> None:
    from ..retrieval import check_digits

    try:
        check_digits(tokenizer)
    except ValueError as exc:
        raise _usage_from(exc, "pass --tokenizer a tokenizer with digits") from exc


def _eval_retrieval(args: argparse.Namespace, budgets: list[int]) -> int:
    """Build every prompt of the grid (before any weight is read), score it per mode, print the table, and write
    the --json report and the --heatmap PNG."""
    if args.task == "passkey" and args.data is not None:
        raise UsageError("--data is not read by --task passkey (its haystack is fixed filler text)",
                         "leave --data out, or pass --task needle to hide needles in that text")
    if args.task == "passkey" and (args.data_split != "train" or args.text_field != "text"):
        flag = "--data-split" if args.data_split != "train" else "--text-field"
        raise UsageError(f"{flag} is not read by --task passkey (it reads no --data: its haystack is fixed filler text)",
                         f"leave {flag} out, or pass --task needle with --data to hide needles in that text")
    _check_backend_device(args)
    _check_report_task(args)
    _check_json_arg(args, RETRIEVAL_REPORT_KEYS, f"eval --task {args.task}")
    heatmap = _check_png_arg(args.heatmap, "--heatmap", "the heatmap", "heatmap")
    _check_data_exists(args)
    _check_model_named(args, "eval")  # before the data is tokenised
    lengths = args.lengths or [args.seq_len]
    depths = [float(d) for d in (args.depths if args.depths is not None else DEFAULT_DEPTHS)]
    import numpy as np
    import torch

    from ..data.stats import counted
    from ..retrieval import build_prompts, evaluate_retrieval

    tokenizer_path = _tokenizer_path(args, checkpoints=True)
    tokenizer = _load_tokenizer(args, tokenizer_path)
    _check_digits(tokenizer)
    tokens = _load_tokens(args, tokenizer_path) if args.task == "needle" else None
    try:
        prompts = build_prompts(args.task, tokenizer, lengths, depths, trials=args.trials, seed=args.prompt_seed,
                                tokens=tokens, needles=args.needles)
    except ValueError as exc:
        raise _usage_from(exc, "see 'oomb eval --help'") from exc
    device, dtype = _resolve_device_dtype(args)
    max_id = np.array([max(int(p.input_ids.max()) for p in prompts)])
    model = _load_model(args, max_id, device, dtype, "eval", f"the {args.task} prompts (tokenizer "
                        f"{tokenizer_path or 'bundled'}) have")
    cfg = args.job.engine if budgets else args.job.engine.dense()
    print(
        f"oomb: eval --task {args.task} {args.model} ({str(dtype).replace('torch.', '')}, {device}); tokenizer "
        f"{tokenizer_path or 'bundled'}; {counted(len(prompts), 'prompt')}: {counted(len(lengths), 'length')} x "
        f"{counted(len(depths), 'depth')} x {counted(args.trials, 'trial')}"
        f"{f', {args.needles} needles each' if args.needles > 1 else ''}; chunk {args.chunk_size:,}, "
        f"page {args.page_size:,}; modes: dense{''.join(f', sparse {b}' for b in budgets)}",
        file=sys.stderr,
    )
    try:
        report = evaluate_retrieval(model, prompts, cfg, budgets=budgets, seed=args.prompt_seed, needles=args.needles,
                                    progress=lambda name, i, t: print(
                                        f"oomb: {name}: prompt {i + 1}/{len(prompts)} ({t.length:,} tokens, depth "
                                        f"{t.depth:g}%, trial {t.trial}): {'exact' if t.exact else 'missed'}, "
                                        f"answer log-prob {t.logprob:.3f}", file=sys.stderr, flush=True))
    except torch.OutOfMemoryError as exc:
        raise _RunError(f"out of GPU memory scoring a {max(lengths):,}-token prompt",
                        "use a smaller --chunk-size or --offload on (see 'oomb plan')") from exc
    except ValueError as exc:
        raise _usage_from(exc, "see 'oomb eval --help'") from exc
    print(report.table())
    past_pages = _last_chunk_past_pages(max(lengths), args.chunk_size, args.page_size)
    dense_budgets = [b for b in budgets if b + args.sink_pages + args.local_pages >= past_pages]
    if dense_budgets:
        print(f"oomb: note: budget {', '.join(map(str, dense_budgets))} + --sink-pages {args.sink_pages} + --local-pages "
              f"{args.local_pages} covers {_all_past_pages(past_pages)} of the last chunk of the longest prompt, so sparse "
              "equals dense there; measure with longer --lengths or a smaller --page-size", file=sys.stderr)
    if args.json is not None:
        data = report.to_dict()
        data.update(model=args.model, data=args.data, tokenizer=tokenizer_path, chunk_size=args.chunk_size,
                    dtype=str(dtype).replace("torch.", ""), device=str(device))
        _write_json(args.json, data)
    if heatmap is not None:
        report.heatmap(heatmap)
        print(f"oomb: wrote the heatmap (accuracy, answer log-probability) to {heatmap}", file=sys.stderr)
    return 0
