"""The argument parser, generated from the configuration fields (:mod:`oomb.config.flags`), and the
:class:`oomb.config.JobConfig` built from the defaults, the ``--config`` file and the flags given."""

from __future__ import annotations

import argparse
import sys
from functools import lru_cache
from typing import NoReturn, Sequence

from ..config import ConfigError
from .errors import UsageError, _fail


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``oomb: error: ...; run 'oomb train --help' for the options``) instead of
    usage + message, each pointing to the help of the (sub)command that was given."""

    def error(self, message: str) -> NoReturn:  # noqa: D102 - argparse API
        if getattr(self, "_quiet", False):
            raise _Refused(message)
        _fail(f"{message}; run '{self.prog} --help' for the options")

    def parse_args(self, args=None, namespace=None):
        # argparse reports a subcommand's unknown arguments from the top-level parser, whose help lists only the
        # commands: they are told here with the subcommand's help, and where another command takes the flag, which.
        parsed, extras = self.parse_known_args(args, namespace)
        if not extras:
            return parsed
        subs = {name: p for a in self._actions if isinstance(a, argparse._SubParsersAction)
                for name, p in a.choices.items()}
        command = getattr(parsed, "command", None)
        if command not in subs:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        extras = _unknown_tokens(list(args if args is not None else sys.argv[1:]), extras, subs, command)
        hint = ""
        for flag in (e.split("=", 1)[0] for e in extras if e.startswith("--")):
            others = [c for c, p in subs.items() if c != command and flag in p._option_string_actions]
            if others:
                other = "train" if "train" in others else others[0]
                hint = f" ({flag} is a flag of '{subs[other].prog}', not of '{subs[command].prog}')"
                break
        subs[command].error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def _unknown_tokens(argv: list[str], extras: list[str], subs: dict, command: str) -> list[str]:
    """The tokens of ``argv`` that ``command`` does not take. argparse's leftovers (``extras``) are wrong where an
    unknown flag has a value: in ``merge --steps 2 r0`` the 2 fills the adapter folder and r0 is left over. A flag
    that another command takes is given the values it takes there; a flag no command takes, the next token where
    that leaves nothing else over; the rest of ``argv`` is parsed again, and the unknown tokens are those flags
    with their values and whatever is still left over."""
    own = subs[command]
    start = argv.index(command) + 1 if command in argv else 0
    end = argv.index("--") if "--" in argv[start:] else len(argv)

    def values_of(action: argparse.Action | None, i: int, guess: bool) -> int:
        """How many tokens after the flag at ``i`` are its values."""
        if action is None:  # no command takes it
            return int(guess and i + 1 < end and not argv[i + 1].startswith("-"))
        nargs = action.nargs
        most = 1 if nargs in (None, "?") else 0 if nargs == 0 else nargs if isinstance(nargs, int) else end
        n = 0
        while i + 1 + n < end and n < most and not argv[i + 1 + n].startswith("-"):
            try:
                value = action.type(argv[i + 1 + n]) if callable(action.type) else argv[i + 1 + n]
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                break
            if action.choices is not None and value not in action.choices:
                break
            n += 1
        return n

    def attempt(guess: bool) -> tuple[list[str], list[str]]:
        """(the unknown flags with their values, what parsing the rest of argv leaves over)."""
        unknown: list[int] = []
        i = start
        while i < end:
            flag = argv[i].split("=", 1)[0]
            if not argv[i].startswith("-") or argv[i] not in extras:  # a flag of the command (or its abbreviation)
                i += 1
                continue
            action = next((p._option_string_actions[flag] for c, p in subs.items()
                           if c != command and flag in p._option_string_actions), None)
            n = 0 if "=" in argv[i] else values_of(action, i, guess)
            unknown.extend(range(i, i + n + 1))
            i += n + 1
        rest = [t for k, t in enumerate(argv[start:], start) if k not in unknown]
        own._quiet = True
        try:
            _, left = own.parse_known_args(rest)
        finally:
            own._quiet = False
        return [argv[k] for k in unknown], left

    try:
        flags, left = attempt(False)
        if left:
            guessed = attempt(True)
            flags, left = guessed if not guessed[1] else (flags, left)
    except _Refused:  # the rest of argv is refused on its own: argparse's account stands
        return extras
    return flags + left if flags else extras


class _Refused(Exception):
    """Raised by :meth:`_Parser.error` instead of printing, while :func:`_unknown_tokens` parses trial argvs."""


class _OneConfig(argparse.Action):
    """``--config FILE``, refused when given a second time: argparse would keep the last one and drop the first
    file's settings without a word."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: D102 - argparse API
        first = getattr(namespace, self.dest, None)
        if first is not None and first is not argparse.SUPPRESS:
            _fail(f"--config is given twice ({first!r} and {values!r}) but only one --config file is read; put the "
                  "settings of both in one file, or keep one file and override single settings with flags "
                  f"(see '{parser.prog} --help')")
        setattr(namespace, self.dest, values)


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
        from .. import __version__

        return __version__


_DESCRIPTIONS = {
    "train": (
        "train a model on long token sequences",
        "Train a causal LM with oomb's chunk-recurrent step. Defaults: the 'tiny' preset on the bundled Austen corpus "
        "and tokenizer, on CPU. Writes <output-dir>/log.jsonl (one JSON line per step, and one per held-out "
        "evaluation with --val-every), loss.png and the final model (or LoRA adapter) and tokenizer as safetensors.",
    ),
    "plan": (
        "predict GPU and host memory of a run and the largest context that fits",
        "Predict GPU and host memory of one training step before anything is allocated, choose the KV tiering (all "
        "pages on the GPU, or offload to pinned host memory) and report the largest context that fits this machine "
        "(or the one described by --gpu-gib/--host-gib; with --gpu-page-budget, through that GPU pool). It takes "
        "the flags of 'oomb train' that change memory (those below; docs/cli.md lists them) and reads the same "
        "--config file, and plans the run they describe; the other flags of 'oomb train' (--steps, --lr, --data, "
        "...) are refused.",
    ),
    "grad-error": (
        "measure the gradient error of sparse attention against dense on one sequence",
        "Run one dense step and one sparse step per page budget on the same sequence (the first of the seeded data "
        "order) and print the relative gradient error ||g_sparse - g_dense|| / ||g_dense|| per parameter kind (or "
        "per parameter). Nothing is trained or written, except --json.",
    ),
    "eval": (
        "held-out loss or passkey / needle retrieval at long context, dense and with sparse attention",
        "Evaluate the mean token loss of a model on consecutive, non-overlapping --seq-len token windows of the data, "
        "in file order (not shuffled: two runs read the same tokens), once with dense attention and once per sparse "
        "page budget. Prints a Markdown table (loss, perplexity, change vs dense, tokens, seconds). With --task "
        "passkey or needle: exact-match accuracy and answer log-probability of a retrieval prompt at each --depths "
        "and --lengths instead. Nothing is trained, and nothing is written but the --json report and, for "
        "retrieval, the --heatmap PNG. Pass held-out text as --data: the default is the training corpus.",
    ),
    "bench": (
        "time one training step of oomb next to plain Hugging Face training",
        "Time one training step (forward + backward, no optimizer) of oomb's chunk-recurrent engine next to plain "
        "Hugging Face training of the same model -- SDPA attention over the whole sequence, per-layer gradient "
        "checkpointing, chunked cross-entropy; with --fused-glue liger the same Liger kernels as oomb -- on the same "
        "random tokens, per --lengths. Prints seconds, tokens/s, "
        "oomb's speed relative to hf, the peak GPU memory and the first step's seconds; a step out of memory is a "
        "row, and the run goes on. Both systems are timed at their --steps'th step on the same sequence (oomb on one "
        "engine): the first allocates memory and builds kernels (oomb also its page store), which a training run "
        "pays once. Nothing is trained or written, except --json.",
    ),
    "data": (
        "show what 'oomb train' would train on: statistics, the first sequence with its loss mask, a length histogram",
        "Load, tokenise and pack the data exactly as 'oomb train' with the same flags (or --config file) would "
        "(it takes the flags of 'oomb train'; those of the model, engine and optimizer other than --model and "
        "--seed do not change the data), "
        "and print the number of examples, tokens, trained tokens, padding and dropped examples, the example "
        "lengths, and the first sequence training reads with its trained tokens in [[...]] (highlighted on a "
        "terminal); with --val-every, also the held-out data the run's held-out loss would read. Writes the "
        "histogram of example lengths as a PNG (--output); nothing else is written. With "
        "--make it writes synthetic retrieval rows instead, and reads only the flags of that group, --seed, "
        "--tokenizer, --seq-len and (for needle) --data, --data-split and --text-field: any other is refused.",
    ),
    "merge": (
        "merge a LoRA adapter into its base model",
        "Merge the LoRA adapter of ADAPTER_DIR (an 'oomb train --lora-rank' output, or a peft adapter folder naming a "
        "local base model) into its base model (peft's merge_and_unload) and write the merged model and the "
        "tokenizer to --output-dir, a folder AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained "
        "load as they are. A preset base is drawn again from the run's --seed, --dtype and --device. ADAPTER_DIR may "
        "also be an 'oomb train' checkpoint folder, or a run folder that stopped before saving its model (its latest "
        "checkpoint): its model is written, a LoRA adapter merged into its base, a full fine-tune as it is.",
    ),
}
_MEASURED_MODEL = ("a preset (random weights from --seed), a local Hugging Face model folder, an 'oomb train' output "
                   "(a LoRA adapter is merged into its base), or an 'oomb train' checkpoint folder (or a run folder "
                   "that stopped before saving its model: its latest checkpoint)")
_HELP = {
    "grad-error": {"--model": _MEASURED_MODEL,
                   "--sink-pages": "sparse runs: first pages of the sequence always attended (attention sink); 0 allowed",
                   "--local-pages": "sparse runs: latest past pages always attended; 0 allowed",
                   "--sparse-score": "sparse runs: page score (mean key, or Quest's min/max bound)"},
    "eval": {"--model": _MEASURED_MODEL,
             "--sink-pages": "with --budgets: first pages of the sequence always attended (attention sink); 0 allowed",
             "--local-pages": "with --budgets: latest past pages always attended; 0 allowed",
             "--sparse-score": "with --budgets: page score (mean key, or Quest's min/max bound)"},
    "merge": {"--output-dir": "where the merged model and tokenizer go: a new or empty folder"},
    "plan": {"--device": "the planned run's device: cuda (the default here; --dtype auto is then bfloat16, as in "
                         "'oomb train'); a plan needs no GPU on this machine, and a cpu run is refused (no GPU memory "
                         "to plan)"},
}
"""Where a field's docstring reads wrong for one command (eval and grad-error read more kinds of model and make
their own sparse runs; merge
writes a model folder, not a training run's output; plan runs nothing)."""

META_FLAGS = ("--help", "--version", "--config", "--print-config")
"""The only flags that are not configuration fields: they say what to do with the configuration."""


def _build_parser(suppress: bool = False) -> argparse.ArgumentParser:
    """The ``oomb`` parser, every subcommand's flags generated from the configuration fields
    (:func:`oomb.config.flags.add_flags`). With ``suppress`` no defaults are set, so that the namespace holds
    only the flags given on the command line."""
    from ..config.flags import add_flags

    parser = _Parser(
        prog="oomb",
        description="Chunk-recurrent long-context training of Hugging Face causal LMs (paged KV cache).",
    )
    parser.add_argument("--version", action="version", version=f"oomb {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for command, (short, description) in _DESCRIPTIONS.items():
        p = sub.add_parser(command, help=short, description=description, formatter_class=_HelpFormatter)
        p.add_argument("--config", action=_OneConfig, default=None if not suppress else argparse.SUPPRESS,
                       metavar="FILE",
                       help="read the settings from this YAML file (sections model, data, engine, train, output, ...; "
                            "see --print-config); flags given override it")
        p.add_argument("--print-config", action="store_true", default=False if not suppress else argparse.SUPPRESS,
                       help="print the effective configuration (defaults, --config file, flags) as YAML that "
                            "--config reads back, and exit")
        add_flags(p, command, suppress=suppress, help_overrides=_HELP.get(command))
    return parser


@lru_cache(maxsize=None)
def _given_parser() -> argparse.ArgumentParser:
    """:func:`_build_parser` with ``suppress``, built once per process: parsing leaves every parser as it was,
    and with no defaults a parsed namespace holds only objects made from its own command line, so every parse may
    share it (each command line is parsed with it twice, and building it is most of the parse)."""
    return _build_parser(suppress=True)


def _job_config(command: str, argv: Sequence[str], config_file: str | None):
    """The :class:`oomb.config.JobConfig` of ``command``: defaults, then the ``--config`` file, then the flags
    given; and the set of the file's keys. A bad value is a :class:`UsageError` naming the flag (or the file's key,
    where the value came from the file)."""
    from ..config.flags import command_fields, flag_name, job_from_values
    from ..config.io import read_yaml

    given = vars(_given_parser().parse_args(argv))
    dests = {ff.dest for ff in command_fields(command)}
    given = {k: v for k, v in given.items() if k in dests}
    file_keys: set[str] = set()
    try:
        file_values = read_yaml(config_file) if config_file is not None else {}
    except ConfigError as exc:
        raise UsageError(*exc.parts(str, yaml=True)) from exc
    for section, values in file_values.items():
        file_keys |= {f"{section}.{k}" for k in (values or {})}
    try:
        job = job_from_values(command, given, file_values)
    except ConfigError as exc:
        from_file = exc.from_file or f"{exc.section}.{exc.key}" in file_keys and not any(
            ff.dest in given for ff in command_fields(command) if ff.section == exc.section and ff.name == exc.key)

        told: set[str] = set()

        def name(field: str) -> str:
            if from_file:
                where = f" (in {config_file})" if field == exc.key and field not in told else ""
                told.add(field)
                return f"{exc.section}.{field}{where}"
            return flag_name(command, exc.section, field) or field

        raise UsageError(*exc.parts(name, yaml=True)) from exc
    return job, file_keys


def _namespace(command: str, job) -> argparse.Namespace:
    """The flat namespace of ``job`` the command handlers read (one attribute per flag), with the job itself."""
    from ..config.flags import namespace_of

    args = namespace_of(command, job)
    args.command = command
    args.job = job
    return args
