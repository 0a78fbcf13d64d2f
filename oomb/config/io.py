"""Configuration files: read a YAML file of configuration sections, write the effective configuration back.

A file is UTF-8 text in YAML (JSON, which YAML reads too, is a YAML file); a TOML file is refused as such.

A file holds the sections of :class:`~oomb.config.job.JobConfig` by name, the engine's sparse, offload and
kernels sections inside ``engine``::

    model: {name: qwen2.5-7b, device: cuda}
    data: {seq_len: 131072}
    engine:
      chunk_size: 4096
      sparse: {page_budget: 64}     # {}: the defaults; null (or absent): dense attention
      offload: {mode: auto}
    train: {steps: 100, lr: 1.0e-5}
    output: {dir: runs/7b}

A file may hold sections or fields a command does not use (the same file serves ``oomb train`` and ``oomb
plan``); a key that is no field of its section is refused, and so is a key given twice in one mapping.

Numbers and booleans are read as YAML 1.2 reads them: ``1e-4``, ``3E5`` and ``1.0e4`` are floats (PyYAML's YAML 1.1
rules read an exponent without a dot, or without a sign, as a string), and only true and false (True, TRUE, False,
FALSE) are booleans: ``off``, ``on``, ``yes``, ``no``, ``y`` and ``n`` are strings (``save_attention: off``).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path
from typing import Any

from .errors import ConfigError, literal
from .flags import COMMANDS, SECTIONS, command_fields, _section
from .job import JobConfig

__all__ = ["dump_yaml", "read_yaml"]

_NESTED = {"engine": ("sparse", "offload", "kernels")}

_FLOAT_12 = r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"
"""The floats with an exponent that YAML 1.2 reads as numbers and YAML 1.1 as strings (no dot, or no sign)."""

_BOOL_12 = r"^(?:true|True|TRUE|false|False|FALSE)$"
"""The booleans of YAML 1.2; YAML 1.1 also reads yes/no/on/off/y/n (any case) as booleans, so that
``save_attention: off`` was False, not the string 'off'."""

_BOOL = "tag:yaml.org,2002:bool"


@cache
def _with_floats_12(base: type) -> type:
    """A subclass of PyYAML's ``base`` (SafeLoader or SafeDumper) that resolves plain scalars as YAML 1.2 does
    where YAML 1.1 differs: :data:`_FLOAT_12` as floats, and only :data:`_BOOL_12` as booleans. The loader reads
    ``1e-4`` as a number and ``off`` as a string; the dumper quotes a string such as ``'1e3'``, and keeps quoting
    ``'off'`` or ``'yes'`` (YAML 1.1 booleans), so that what :func:`dump_yaml` writes reads back as it was under
    any YAML reader."""
    import re

    import yaml

    cls = type(f"{base.__name__}12", (base,), {})
    loader = issubclass(base, yaml.constructor.BaseConstructor)
    cls.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if not (loader and tag == _BOOL)]
                                   for k, v in base.yaml_implicit_resolvers.items()}
    cls.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_FLOAT_12), list("-+0123456789."))
    if loader:
        cls.add_implicit_resolver(_BOOL, re.compile(_BOOL_12), list("tTfF"))
    else:  # also y and n, which the YAML 1.1 spec reads as booleans (PyYAML does not)
        cls.add_implicit_resolver(_BOOL, re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))
    return cls


def _load(text: str) -> Any:
    """The document of ``text`` (None if empty), read with :func:`_with_floats_12` of SafeLoader.

    Raises:
        yaml.YAMLError: not valid YAML.
        _Duplicate: a mapping that has a key twice.
    """
    import yaml

    loader = _with_floats_12(yaml.SafeLoader)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicates(node, "")
        return loader.construct_document(node)
    finally:
        loader.dispose()


class _Duplicate(Exception):
    def __init__(self, path: str, lines: tuple[int, int]) -> None:
        super().__init__(path)
        self.path = path
        self.lines = lines


def _refuse_duplicates(node: Any, path: str, seen: set[int] | None = None) -> None:
    """Raise :class:`_Duplicate` for the first mapping under ``node`` that has a key twice (merge keys ``<<``,
    whose values later keys may override, aside)."""
    import yaml

    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias of a node already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge":
                continue
            name = str(key.value) if isinstance(key, yaml.ScalarNode) else None
            where = f"{path}.{name}" if path and name is not None else (name or path)
            if name is not None:
                line = key.start_mark.line + 1
                if name in first:
                    raise _Duplicate(where, (first[name], line))
                first[name] = line
            _refuse_duplicates(value, where, seen)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicates(item, path, seen)


def read_yaml(path: str | Path) -> dict[str, dict[str, Any] | None]:
    """{section path: {field: value}} of the YAML file ``path`` (``engine.sparse`` may map to None: dense).

    Raises:
        ConfigError: a file that cannot be read or parsed, a key given twice in one mapping, a top level that
            is not a mapping, an unknown section or key (naming it, and the keys it could be), or a section that
            is not a mapping (an ``engine.sparse`` of true or false is told how to turn sparse attention on).
    """
    import yaml

    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError("config", f"--config {literal(str(p))} cannot be read ({exc.strerror or exc})",
                          "pass the path of a YAML file") from exc
    text = _text(raw, p)
    try:
        data = _load(text)
    except _Duplicate as exc:
        first, again = exc.lines
        raise ConfigError("config", f"--config {literal(str(p))} sets {exc.path} twice (lines {first} and {again})",
                          "keep one of them") from exc
    except yaml.YAMLError as exc:
        if _is_toml(text, p):
            raise _toml(p) from exc
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError("config", f"--config {literal(str(p))} is not valid YAML{at}",
                          "fix the file (sections of 'key: value' lines, as --print-config writes)") from exc
    if data is None:
        return {}
    if not isinstance(data, dict) and _is_toml(text, p):
        raise _toml(p)
    if not isinstance(data, dict):
        raise ConfigError("config", f"--config {literal(str(p))} holds a {type(data).__name__}, not sections",
                          "write sections such as 'engine:' with 'key: value' lines under them (see --print-config)")
    out: dict[str, dict[str, Any] | None] = {}
    _read_section(data, "", out, str(p))
    return out


def _text(raw: bytes, p: Path) -> str:
    """The text of the config file ``p`` (its bytes ``raw``): UTF-8, a byte order mark dropped; a binary file or
    text in another encoding is a :class:`ConfigError` naming the first bad byte's line."""
    if b"\0" in raw:
        raise ConfigError("config", f"--config {literal(str(p))} is a binary file, not a configuration file",
                          "pass a YAML file of sections (as --print-config writes)")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
        line = raw.count(b"\n", 0, exc.start + bom) + 1
        raise ConfigError("config", f"--config {literal(str(p))} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                          f"at line {line})",
                          "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8), or write that character in ASCII") from exc


def _toml(p: Path) -> ConfigError:
    return ConfigError("config", f"--config {literal(str(p))} is a TOML file; --config reads YAML (or JSON, which "
                       "YAML reads too), not TOML",
                       "write it as YAML: 'section:' lines with indented 'key: value' lines under them (as "
                       "--print-config writes)")


def _is_toml(text: str, p: Path) -> bool:
    """Whether ``text``, which is not valid YAML, is a TOML file (its suffix, or what Python's TOML reader reads)."""
    if p.suffix.lower() == ".toml":
        return True
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return False
    try:
        return bool(tomllib.loads(text))
    except tomllib.TOMLDecodeError:
        return False


def _read_section(data: dict, prefix: str, out: dict, file: str) -> None:
    tops = [s for s in SECTIONS if "." not in s] if not prefix else [f"{prefix}.{n}" for n in _NESTED.get(prefix, ())]
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if path not in SECTIONS or path not in tops and prefix == "":
            known = ", ".join(s.rsplit(".", 1)[-1] for s in tops)
            raise ConfigError(path, f"unknown section {literal(path)} in the configuration file",
                              f"use the sections {known}")
        if value is None and path == "engine.sparse":
            out[path] = None
            continue
        if path == "engine.sparse" and not isinstance(value, dict):
            shown = str(value).lower() if isinstance(value, bool) else repr(value)
            raise ConfigError(path, f"engine.sparse (in {file}) is {shown}, not a mapping of sparse attention settings",
                              "write 'sparse: {}' under engine for sparse attention with the defaults (or its keys, "
                              "e.g. 'sparse: {page_budget: 64}'), or 'sparse: null' for dense attention")
        if not isinstance(value, dict):
            raise ConfigError(path, f"section {literal(path)} is {literal(value)}, not a mapping of keys to values",
                              "write its settings as 'key: value' lines indented under it")
        names = {f.name for f in dataclasses.fields(SECTIONS[path])}
        nested = set(_NESTED.get(path, ()))
        values = {}
        for k, v in value.items():
            if k in nested:
                _read_section({k: v}, path, out, file)
            elif k in names:
                values[k] = v
            else:
                import difflib

                near = _did_you_mean(str(k), path)
                hint = f"did you mean {near}? " if near else ""
                inside = f", and its sections {', '.join(_NESTED[path])}" if nested else ""
                raise ConfigError(str(k), f"unknown key {path}.{k} in the configuration file",
                                  f"{hint}the keys of {path} are {', '.join(sorted(names - nested))}{inside}",
                                  section=path)
        out[path] = values


def _did_you_mean(key: str, path: str) -> str | None:
    """The key path nearest to the unknown ``key`` of section ``path``, among the keys of that section and those of
    the other sections of its family (engine, engine.sparse, engine.offload, engine.kernels): ``engine.page_budget``
    is ``engine.sparse.page_budget``. A key of ``path`` itself wins a tie."""
    import difflib

    top = path.split(".", 1)[0]
    family = [path] + [s for s in (top, *(f"{top}.{n}" for n in _NESTED.get(top, ()))) if s != path]
    where: dict[str, str] = {}
    for section in family:
        nested = set(_NESTED.get(section, ()))
        for f in dataclasses.fields(SECTIONS[section]):
            if f.name not in nested:
                where.setdefault(f.name, f"{section}.{f.name}")
    scored = [(difflib.SequenceMatcher(None, key, name).ratio(), -i, name) for i, name in enumerate(where)]
    score, _, name = max(scored)
    return where[name] if score >= 0.6 else None  # difflib.get_close_matches's cutoff


def dump_yaml(job: JobConfig, command: str) -> str:
    """The effective configuration of ``command`` as YAML that ``--config`` reads back: every field the command
    uses (its flags' fields, and those without a flag of the sections it uses), section by section."""
    import yaml

    used: dict[str, list[str]] = {}
    for ff in command_fields(command):
        used.setdefault(ff.section, []).append(ff.name)
    for section, names in COMMANDS[command]:  # the fields without a flag of the sections the command uses
        all_names = [f.name for f in dataclasses.fields(SECTIONS[section])]
        for name in (all_names if names is None else names):
            if name not in used.setdefault(section, []) and not (section == "engine" and name in _NESTED["engine"]):
                used[section].append(name)
    tree: dict[str, Any] = {}
    for section, names in used.items():
        if section == "engine.sparse" and job.engine.sparse is None and command in ("train", "plan", "data"):
            tree.setdefault("engine", {})["sparse"] = None
            continue
        obj = _section(job, section)
        values = {n: getattr(obj, n) for n in names if not (section == "engine" and n == "sparse")}
        node = tree
        for part in section.split("."):
            node = node.setdefault(part, {})
        node.update(values)
    return yaml.dump(tree, Dumper=_with_floats_12(yaml.SafeDumper), sort_keys=False, default_flow_style=False)
