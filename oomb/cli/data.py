"""``oomb data``: what ``oomb train`` would train on, without training -- its statistics, the first sequence
it reads with the loss mask, and the histogram of example lengths as a PNG."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..png import missing_glyphs_drawn_as_boxes, png_metadata
from .checks import _check_vocab, _usage_from
from .errors import UsageError
from .inputs import _check_data_exists, _check_png_path, _held_out_data, _model_config, _training_data

DEFAULT_OUTPUT = "oomb-data-lengths.png"


def _check_output(given: str | None) -> Path:
    """The PNG path: not a folder, in an existing folder we may write to, new, empty or an earlier histogram (never
    another file or picture), and ending in .png (or no suffix)."""
    path = Path(given or DEFAULT_OUTPUT).expanduser()
    return _check_png_path(path, f"--output {given!r}" if given else f"the histogram file {str(path)!r}", "--output",
                           "the histogram", "histogram")


def render_sequence(tokenizer, sample, limit: int, color: bool = False) -> str:
    """The tokens of ``sample`` as text, trained tokens (label not -100) in ``[[...]]`` (or reverse video with
    ``color``), a line ``--- document k (n tokens) ---`` at each document bound; at most ``limit`` tokens
    (0: all)."""
    ids = sample.input_ids.view(-1).tolist()
    labels = ids if sample.labels is None else sample.labels.view(-1).tolist()
    bounds = [0, len(ids)] if sample.cu_seqlens is None else sample.cu_seqlens.tolist()
    end = len(ids) if not limit else min(limit, len(ids))
    out = []
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if a >= end:
            break
        pad = k == len(bounds) - 2 and k > 0 and len(set(ids[a:b])) == 1 and all(v == -100 for v in labels[a:b])
        out.append(f"\n--- {'padding' if pad else f'document {k}'} ({b - a:,} tokens) ---\n")
        t, shown = a, ""
        while t < min(b, end):
            trained = labels[t] != -100
            u = t
            while u < min(b, end) and (labels[u] != -100) == trained:
                u += 1
            # decoded from the document's start, so a piece keeps its leading space
            upto = tokenizer.decode(ids[a:u], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            text, shown = upto[len(shown):], upto
            out.append(("\x1b[7m" + text + "\x1b[0m" if color else f"[[{text}]]") if trained else text)
            t = u
    if end < len(ids):
        out.append(f"\n... ({len(ids) - end:,} more tokens; --show-tokens 0 shows them all)")
    return "".join(out).lstrip("\n")


def _histogram(path: Path, lengths, seq_len: int, title: str) -> None:
    """The example-length histogram (log-spaced bins, a line at seq_len), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = np.asarray(lengths)
    lengths = lengths[lengths > 0]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if len(lengths):
        lo, hi = max(1, min(int(lengths.min()), seq_len)), max(2, int(lengths.max()), seq_len)
        bins = np.unique(np.geomspace(lo, hi + 1, 50).astype(int)) if hi > 4 * lo else 50
        ax.hist(lengths, bins=bins, color="#4477aa")
        if hi > 4 * lo:
            ax.set_xscale("log")
    ax.axvline(seq_len, color="#cc3311", linestyle="--", label=f"--seq-len {seq_len:,}")
    ax.set_xlabel("example length (tokens)")
    ax.set_ylabel("examples")
    ax.set_title(title, fontsize=9)
    ax.legend()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    try:
        with missing_glyphs_drawn_as_boxes():  # the title names the data, in whatever script
            fig.tight_layout()
            fig.savefig(tmp, format="png", metadata=png_metadata("histogram"))
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()


_MAKE_READS = ("data_make", "model.seed", "data.tokenizer", "data.seq_len")
"""The settings ``oomb data --make`` reads (a section, or ``section.field``); ``needle`` also reads
:data:`_NEEDLE_READS`."""

_NEEDLE_READS = ("data.path", "data.split", "data.text_field")
"""The settings of the text ``--make needle`` hides its needles in."""


def _refuse_unread_flags(args: argparse.Namespace) -> None:
    """Refuse the flags on the command line that ``--make`` does not read: ``oomb data`` takes every flag of
    ``oomb train`` for its report, and they would change nothing in the rows. (A --config file's settings are not
    refused: one file serves several commands.)

    Raises:
        UsageError: naming the flags given that --make does not read, and those it does.
    """
    argv = getattr(args, "_argv", None)
    if argv is None:
        return
    from ..config.flags import command_fields
    from .parser import _given_parser

    given = vars(_given_parser().parse_args(argv))
    reads = _MAKE_READS + (_NEEDLE_READS if args.make == "needle" else ())
    fields = [(ff, ff.section in reads or ff.key in reads) for ff in command_fields("data")]
    # as given: a False of an on/off flag is its --no- form
    unread = [f"--no-{ff.flag[2:]}" if given[ff.dest] is False else ff.flag
              for ff, read in fields if not read and ff.dest in given]
    if unread:
        one = len(unread) == 1
        names = ", ".join(unread[:-1]) + (" and " if not one else "") + unread[-1]
        read = [ff.flag for ff, read in sorted(fields, key=lambda f: f[0].section != "data_make") if read]
        raise UsageError(f"{names} {'is' if one else 'are'} not read by --make {args.make}, which writes the same rows "
                         f"with or without {'it' if one else 'them'}",
                         f"leave {'it' if one else 'them'} out; --make {args.make} reads only "
                         f"{', '.join(read[:-1])} and {read[-1]}")


def _make(args: argparse.Namespace) -> int:
    """``oomb data --make passkey|needle|keyvalue``: write synthetic retrieval rows (JSON Lines) for
    ``oomb train --data``; a flag it does not read is refused."""
    if args.output is not None:
        raise UsageError(f"--output names the length histogram of 'oomb data' without --make, which --make {args.make} "
                         "does not draw", "leave --output out; --make-output names the rows file")
    if args.make in ("passkey", "keyvalue") and args.data is not None:
        raise UsageError(f"--data is not read by --make {args.make} (its haystack is fixed filler text)",
                         "leave --data out, or pass --make needle to hide needles in that text")
    _refuse_unread_flags(args)
    _check_data_exists(args)
    from ..data.stats import counted
    from ..retrieval import is_retrieval_jsonl, retrieval_rows, write_retrieval_jsonl
    from .inputs import _load_tokens
    from .retrieval import _check_digits, _load_tokenizer

    given = args.make_output
    path = Path(given or f"oomb-{args.make}.jsonl").expanduser()
    shown = f"--make-output {given!r}" if given else f"the rows file {str(path)!r}"
    if path.is_dir():
        raise UsageError(f"{shown} is a folder", "pass a file path, e.g. --make-output rows.jsonl")
    if not path.resolve().parent.is_dir():
        raise UsageError(f"{shown}: its folder does not exist", "pass a path in an existing folder")
    if not os.access(path.resolve().parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{shown} cannot be written", "pass a path you can write to with --make-output")
    if path.exists() and not is_retrieval_jsonl(path):
        raise UsageError(f"{shown} exists and is not an earlier 'oomb data --make' file, so writing would destroy it",
                         "pass --make-output a new file path, or delete that file first if it is not needed")
    tokenizer = _load_tokenizer(args, args.tokenizer)
    _check_digits(tokenizer)
    tokens = _load_tokens(args, args.tokenizer) if args.make == "needle" else None
    lengths = args.make_lengths or [args.seq_len]
    try:
        rows = retrieval_rows(args.make, tokenizer, lengths, args.examples, seed=args.seed, tokens=tokens,
                              needles=args.needles)
    except ValueError as exc:
        message = str(exc).replace("pass lengths of", "pass --make-lengths of")
        raise _usage_from(ValueError(message), "see 'oomb data --help'") from exc
    write_retrieval_jsonl(path, rows)
    print(f"oomb: wrote {counted(len(rows), args.make + ' row')} of {', '.join(f'{n:,}' for n in lengths)} tokens "
          f"(tokenizer {args.tokenizer or 'bundled'}) to {path}; train on {'it' if len(rows) == 1 else 'them'} with "
          f"'oomb train --data {path}'")
    return 0


def _data(args: argparse.Namespace) -> int:
    """``oomb data``: load and pack the data exactly as ``oomb train`` with these settings would (or, with --make,
    write synthetic retrieval rows)."""
    if args.make is not None:
        return _make(args)
    out = _check_output(args.output)
    _check_data_exists(args)
    from ..data.stats import counted

    model_config = _model_config(args, "data")  # its vocabulary is checked against the data's token ids
    tokenizer_path, tokenizer, data = _training_data(args)
    _check_vocab(data.max_token(), int(model_config.vocab_size), args.model)
    held = _held_out_data(args, tokenizer)  # --val-every: what the run's held-out loss would read
    if held is not None:
        _check_vocab(held[0].max_token(), int(model_config.vocab_size), args.model, f"the held-out data {held[1]} has")
    stats = data.stats
    lengths = data.example_lengths
    print(f"oomb: {stats.summary()}; tokenizer {tokenizer_path or 'bundled'}")
    if held is not None:
        val, (held_data, where, note) = args.job.validation, held
        print(f"oomb: held-out {held_data.stats.summary()} ({where}); --val-every {val.every} evaluates the first "
              f"{counted(min(val.sequences, len(held_data)), 'sequence')}")
        if note:
            print(note)
    if len(lengths):
        import numpy as np

        q = np.percentile(lengths, [0, 50, 90, 100]).astype(int)
        print(f"oomb: example length (tokens): min {q[0]:,}, median {q[1]:,}, 90% {q[2]:,}, max {q[3]:,}; "
              f"{int((lengths > args.seq_len).sum()):,} longer than --seq-len {args.seq_len:,}")
    first = int(data.order(0)[0])
    color = sys.stdout.isatty() and os.environ.get("NO_COLOR") is None
    how = "highlighted" if color else "in [[...]]"
    print(f"oomb: sequence {first:,} of {len(data):,}, the first that training reads (trained tokens {how}):")
    print(render_sequence(tokenizer, data[first], args.show_tokens, color))
    _histogram(out, lengths, args.seq_len, f"{counted(stats.examples, 'example')}, {stats.tokens:,} tokens "
               f"({args.data or 'bundled corpus'})")
    print(f"oomb: wrote the length histogram to {out}")
    return 0
