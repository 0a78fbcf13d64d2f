"""The ``oomb`` flags, generated from the configuration fields, and the way back from flags to a
:class:`~oomb.config.job.JobConfig`.

Each command uses some sections (:data:`COMMANDS`). A field's flag is its metadata's ``flag``, else ``--`` +
the field name with dashes, with ``--offload-`` before the offload fields; its help is the field's docstring
read as plain text (:func:`plain_help`), or the metadata's ``help`` where the docstring speaks to Python callers;
its choices come from its ``Literal`` type, a ``bool`` with default False is an on-flag (``--sparse``), one with
default True or None gets ``--x/--no-x``. Every flag's argparse ``dest`` is the flag without dashes
(``--offload-segment-pages`` -> ``offload_segment_pages``), so the parsed namespace has one attribute per flag.

Values are merged as: the fields' defaults (a command's own where :data:`COMMAND_DEFAULTS` has one), then the YAML
file (``--config``), then the flags given.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Literal, get_args, get_origin

from . import _checks as check
from .engine import KernelConfig, OffloadConfig, OOMBConfig, SparseConfig
from .errors import ConfigError
from .job import (BenchConfig, DataConfig, DataMakeConfig, DataReportConfig, EvalConfig, GradErrorConfig, JobConfig, MergeConfig,
                  ModelConfig, OutputConfig, PlanConfig, TrainConfig, ValidationConfig)
from .meta import field_docs, has_no_flag

__all__ = ["COMMANDS", "COMMAND_DEFAULTS", "FlagField", "add_flags", "command_fields", "job_from_values",
           "namespace_of", "plain_help"]

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "engine": OOMBConfig,
    "engine.sparse": SparseConfig,
    "engine.offload": OffloadConfig,
    "engine.kernels": KernelConfig,
    "train": TrainConfig,
    "output": OutputConfig,
    "validation": ValidationConfig,
    "plan": PlanConfig,
    "eval": EvalConfig,
    "grad_error": GradErrorConfig,
    "bench": BenchConfig,
    "data_report": DataReportConfig,
    "data_make": DataMakeConfig,
    "merge": MergeConfig,
}
"""Every configuration section by its key path in a YAML file."""

_ENGINE_CORE = ("chunk_size", "page_size", "attention_backend", "checkpoint_layers", "checkpoint_attention",
                "save_attention", "grad_accum_dtype", "sparse")
_ENGINE_TRAIN = _ENGINE_CORE + ("keep_graphs", "keep_graphs_max", "fused_glue", "loss_chunk_size", "attention_block_size")
_ALL = None

COMMANDS: dict[str, list[tuple[str, tuple[str, ...] | None]]] = {
    "train": [
        ("model", _ALL), ("data", _ALL), ("engine", _ENGINE_TRAIN), ("engine.sparse", _ALL),
        ("engine.offload", _ALL), ("engine.kernels", _ALL), ("train", _ALL), ("output", _ALL),
        ("validation", _ALL),
    ],
    "plan": [
        ("model", ("name", "device", "dtype", "lora_rank", "lora_targets", "train_embeddings_norms")), ("data", ("seq_len",)),
        ("engine", _ENGINE_CORE), ("engine.sparse", _ALL), ("engine.offload", _ALL), ("train", ("optimizer", "shard")),
        ("plan", _ALL),
    ],
    "eval": [
        ("model", ("name", "device", "dtype", "seed")), ("data", ("path", "split", "text_field", "tokenizer", "seq_len")),
        ("engine", ("chunk_size", "page_size", "attention_backend")),
        ("engine.sparse", ("sink_pages", "local_pages", "score")), ("engine.offload", _ALL),
        ("engine.kernels", _ALL), ("eval", _ALL),
    ],
    "grad-error": [
        ("model", ("name", "device", "dtype", "seed")), ("data", ("path", "split", "text_field", "tokenizer", "seq_len")),
        ("engine", ("chunk_size", "page_size", "attention_backend")),
        ("engine.sparse", ("sink_pages", "local_pages", "score")), ("engine.kernels", _ALL), ("grad_error", _ALL),
    ],
    "bench": [
        ("model", ("name", "device", "dtype", "seed")),
        ("engine", ("chunk_size", "page_size", "attention_backend", "save_attention", "checkpoint_layers",
                    "checkpoint_attention", "keep_graphs", "keep_graphs_max", "fused_glue")),
        ("engine.kernels", _ALL), ("bench", _ALL),
    ],
    "merge": [("merge", _ALL), ("output", ("dir",))],
}
COMMANDS["data"] = COMMANDS["train"] + [("data_report", _ALL), ("data_make", _ALL)]  # takes train's flags: it shows what train reads
"""The sections and fields (None: all of a section's fields that have a flag) each command reads."""

COMMAND_DEFAULTS: dict[str, dict[str, Any]] = {"plan": {"model.device": "cuda"}}
"""Where a command's default differs from the field's (section.field -> value), below the file and the flags like
any default: ``oomb plan`` plans a GPU run unless the file or ``--device`` says otherwise."""

_GROUPS = {"model": "model", "data": "data", "engine": "engine", "engine.sparse": "sparse attention",
           "engine.offload": "offload", "engine.kernels": "kernels", "train": "optimisation", "output": "output",
           "validation": "held-out loss",
           "plan": "plan", "eval": "evaluation", "grad_error": "measurement", "bench": "benchmark",
           "data_report": "report", "data_make": "synthetic retrieval data", "merge": "merge"}


@dataclass(frozen=True)
class FlagField:
    """One configuration field as a command-line flag."""

    section: str
    """Key path of its section ('engine.offload')."""
    name: str
    """Field name ('segment_pages')."""
    flag: str
    """'--offload-segment-pages'."""
    field: dataclasses.Field
    type: Any

    @property
    def positional(self) -> bool:
        """A positional argument (metadata ``positional=True``; its ``flag`` is the argparse name, no dashes)."""
        return bool(self.field.metadata.get("positional"))

    @property
    def dest(self) -> str:
        return self.flag if self.positional else self.flag[2:].replace("-", "_")

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


def _flag_of(section: str, f: dataclasses.Field) -> str:
    if "flag" in f.metadata and not has_no_flag(f):
        return f.metadata["flag"]
    name = f.name.replace("_", "-")
    return f"--offload-{name}" if section == "engine.offload" else f"--{name}"


def command_fields(command: str) -> list[FlagField]:
    """The flag fields of ``command`` in their order (sections as :data:`COMMANDS` lists them)."""
    return list(_command_fields(command))


@lru_cache(maxsize=None)
def _command_fields(command: str) -> tuple[FlagField, ...]:
    # Every parse of a command line asks for these a dozen times, and each reading of the type hints evaluates
    # every annotation of the section's class anew.
    out = []
    for section, names in COMMANDS[command]:
        cls = SECTIONS[section]
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if has_no_flag(f) or (names is not None and f.name not in names):
                continue
            if section == "engine" and f.name in ("offload", "kernels"):
                continue  # sections of their own
            out.append(FlagField(section, f.name, _flag_of(section, f), f, hints[f.name]))
    return tuple(out)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _unwrap_optional(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`(~?)([^`]*)`")


@lru_cache(maxsize=None)  # a parser is built from the same few hundred docstrings each time
def plain_help(doc: str) -> str:
    """``doc`` (a field's docstring) as flag help: reST roles as their target (``:class:`~a.B``` -> ``B``),
    ``literal`` markup as its text, and a ``None:`` (what the unset field does) as ``default:``, since a flag user
    never writes None."""
    doc = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), doc)
    doc = re.sub(r"``(.+?)``", r"\1", doc)
    return re.sub(r"(^|\. )?\bNone:", lambda m: f"{m.group(1)}Default:" if m.group(1) is not None else "default:", doc)


def _argparse_kwargs(ff: FlagField, suppress: bool) -> dict:
    tp = _unwrap_optional(ff.type)
    default = _default(ff.field)
    doc = ff.field.metadata.get("help") or plain_help(field_docs(SECTIONS[ff.section]).get(ff.name, ""))
    kw: dict[str, Any] = {"help": doc.replace("%", "%%")} if ff.positional else {"dest": ff.dest, "help": doc.replace("%", "%%")}
    if ff.section == "engine" and ff.name == "sparse":  # --sparse, and --no-sparse for a --config file's section
        kw.update(action=argparse.BooleanOptionalAction, default=False)
    elif tp is bool:
        if default is False:
            kw.update(action="store_true", default=False)
        else:
            kw.update(action=argparse.BooleanOptionalAction, default=default)
    elif get_origin(tp) in (list, typing.List):
        (item,) = get_args(tp)
        if get_origin(item) is Literal:
            kw.update(choices=list(get_args(item)))
        else:
            kw.update(type=item)
        kw.update(nargs="+", default=default)
    elif get_origin(tp) is Literal:
        choices = list(get_args(tp))
        kind = type(choices[0])
        kw.update(choices=choices, default=default)
        if kind is not str:
            kw.update(type=kind)
    else:
        kw.update(type=tp, default=default)
    if "metavar" in ff.field.metadata:
        kw["metavar"] = ff.field.metadata["metavar"]
    if "optional_const" in ff.field.metadata:
        kw.update(nargs="?", const=ff.field.metadata["optional_const"])
    if ff.positional:  # optional on the command line, so that --config may give it
        kw["nargs"] = "?"
    if suppress:
        kw["default"] = argparse.SUPPRESS
    return kw


def add_flags(parser: argparse.ArgumentParser, command: str, suppress: bool = False,
              help_overrides: dict[str, str] | None = None) -> None:
    """Add ``command``'s flags to ``parser`` in argument groups per section. With ``suppress`` no defaults are
    set, so the parsed namespace holds only the flags given (how explicit flags are told from defaults)."""
    groups: dict[str, Any] = {}
    for ff in command_fields(command):
        group = groups.get(ff.section)
        if group is None:
            group = groups[ff.section] = parser.add_argument_group(_GROUPS[ff.section])
        kw = _argparse_kwargs(ff, suppress)
        if not suppress and ff.key in COMMAND_DEFAULTS.get(command, {}):
            kw["default"] = COMMAND_DEFAULTS[command][ff.key]
        if help_overrides and ff.flag in help_overrides:
            kw["help"] = help_overrides[ff.flag]
        group.add_argument(ff.flag, **kw)


# ------------------------------------------------------------------ values -> JobConfig


def _by_key(command: str) -> dict[str, FlagField]:
    return {ff.key: ff for ff in command_fields(command)}


def job_from_values(command: str, given: dict[str, Any], file_values: dict[str, dict[str, Any]] | None = None) -> JobConfig:
    """The :class:`JobConfig` of ``command`` from the flags ``given`` (dest -> value, only flags on the command
    line) over ``file_values`` (section path -> {field: value}, from a YAML file) over the fields' defaults.

    Sparse attention (train, plan, data) is on when ``--sparse`` is given, or the file has an ``engine.sparse``
    section that is not null and ``--no-sparse`` is not given (it leaves that section out); a sparse field set while
    it is off is refused (it would be ignored). For the commands
    without ``--sparse`` (eval, grad-error: their ``--budgets`` say which sparse runs to make) ``engine.sparse``
    is always set: the sink, local and score settings of those runs. A command with no sparse setting at all
    (bench: dense attention) gets None, whatever the file says.

    Raises:
        ConfigError: the first bad value; its ``section`` and ``key`` say which field.
    """
    file_values = file_values or {}
    by_dest = {ff.dest: ff for ff in command_fields(command)}
    values: dict[str, dict[str, Any]] = {}
    for key, value in COMMAND_DEFAULTS.get(command, {}).items():
        section, name = key.rsplit(".", 1)
        values.setdefault(section, {})[name] = value
    for s, v in file_values.items():
        if isinstance(v, dict):
            values.setdefault(s, {}).update(v)
    sparse_in_file = "engine.sparse" in file_values and file_values["engine.sparse"] is not None
    has_toggle = any(ff.section == "engine" and ff.name == "sparse" for ff in by_dest.values())
    if has_toggle and given.get("sparse") is False:  # --no-sparse: the file's sparse section is left out
        values.pop("engine.sparse", None)
    for dest, value in given.items():
        ff = by_dest[dest]
        if ff.section == "engine" and ff.name == "sparse":
            continue
        _check_overridden(file_values, ff)
        values.setdefault(ff.section, {})[ff.name] = value
    sparse_on = given["sparse"] if has_toggle and "sparse" in given else sparse_in_file or not has_toggle
    if not has_toggle and not any(ff.section == "engine.sparse" for ff in by_dest.values()):
        sparse_on = False  # bench: no sparse attention; a file's section (for train) is not used
        values.pop("engine.sparse", None)
    sparse_values = values.pop("engine.sparse", None) or {}
    if not sparse_on:
        set_ = [k for k, v in sparse_values.items() if v != _default(_field(SparseConfig, k))]
        if set_:
            names = " and ".join("{" + k + "}" for k in set_)
            one = len(set_) == 1
            no = given.get("sparse") is False
            raise ConfigError(set_[0], f"{names} {'sets' if one else 'set'} sparse attention but "
                              f"{'--no-sparse is' if no else '{sparse} is not'} given",
                              f"{'leave out --no-sparse' if no else 'add {sparse}'}, or leave them out for dense attention",
                              section="engine.sparse")
    sparse = SparseConfig(**sparse_values) if sparse_on else None
    offload = OffloadConfig(**values.pop("engine.offload", {}))
    kernels = KernelConfig(**values.pop("engine.kernels", {}))
    engine = OOMBConfig(**values.pop("engine", {}), sparse=sparse, offload=offload, kernels=kernels)
    built = {s: SECTIONS[s](**v) for s, v in values.items() if s in SECTIONS}
    return JobConfig(engine=engine, **built)


def _check_overridden(file_values: dict[str, dict[str, Any]], ff: FlagField) -> None:
    """The file's value of the setting flag ``ff`` overrides is still of its field's type: a file that a run with the
    flag accepts is not refused only when the flag is left out.

    Raises:
        ConfigError: the file's value is of the wrong type (``from_file`` set, ``section`` the flag's).
    """
    section = file_values.get(ff.section)
    if not isinstance(section, dict) or ff.name not in section:
        return
    try:
        check.field_type(SECTIONS[ff.section], _field(SECTIONS[ff.section], ff.name), section[ff.name])
    except ConfigError as exc:
        exc.section, exc.from_file = ff.section, True
        raise


def _field(cls: type, name: str) -> dataclasses.Field:
    for f in fields(cls):
        if f.name == name:
            return f
    raise KeyError(name)


def namespace_of(command: str, job: JobConfig) -> argparse.Namespace:
    """The flat namespace of ``job`` for ``command``: one attribute per flag (its dest), as argparse would give
    with those values; ``sparse`` is a bool."""
    ns = argparse.Namespace()
    sparse = job.engine.sparse
    for ff in command_fields(command):
        if ff.section == "engine" and ff.name == "sparse":
            value = job.engine.sparse is not None
        elif ff.section == "engine.sparse":
            value = getattr(sparse or SparseConfig(), ff.name)
        elif ff.section == "engine.offload":
            value = getattr(job.engine.offload, ff.name)
        elif ff.section == "engine.kernels":
            value = getattr(job.engine.kernels, ff.name)
        else:
            value = getattr(_section(job, ff.section), ff.name)
        setattr(ns, ff.dest, value)
    return ns


def _section(job: JobConfig, path: str) -> Any:
    obj: Any = job
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def flag_name(command: str, section: str, name: str) -> str | None:
    """The flag of field ``name`` as a :class:`ConfigError` placeholder names it: the field in ``section``, else
    in its parent section, else any field of ``command`` of that name; None if ``command`` has no such flag."""
    cands = [ff for ff in command_fields(command) if ff.name == name]
    for want in (section, section.rsplit(".", 1)[0] if "." in section else None):
        for ff in cands:
            if ff.section == want:
                return ff.flag
    if name == "sparse" and any(ff.section == "engine" and ff.name == "sparse" for ff in command_fields(command)):
        return "--sparse"
    return cands[0].flag if cands else None

