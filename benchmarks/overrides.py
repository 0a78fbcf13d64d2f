"""``--set KEY=VALUE`` for the benchmark scripts: any engine setting by its configuration key.

A key is a field of :class:`oomb.OOMBConfig` or of one of its sections, written as in a YAML file's
``engine:`` section without the ``engine.`` prefix: ``offload.staging_sets=3``, ``kernels.page_gather_programs=32``,
``sparse.page_budget=16``, ``save_attention=host``. The value is read as YAML (``3``, ``true``, ``page``, ``null``).
The settings are applied after the script's own flags, so ``--set`` wins, and checked by the config dataclasses
(a bad key or value raises ``ValueError`` naming it).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Iterable

import yaml

from oomb.config import OOMBConfig

__all__ = ["add_set_argument", "apply_sets", "config_record"]


def add_set_argument(ap: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--set KEY=VALUE`` option (dest ``sets``, a list of strings)."""
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting by its config key, e.g. offload.staging_sets=3 or "
                         "kernels.page_gather_programs=32 (repeatable; applied last)")


def _parse(item: str) -> tuple[list[str], object]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {item!r}: write KEY=VALUE, e.g. offload.staging_sets=3")
    path = key.strip().removeprefix("engine.").split(".")
    return path, yaml.safe_load(value)


def _replace(obj, path: list[str], value, key: str):
    names = {f.name for f in dataclasses.fields(obj)}
    if path[0] not in names:
        raise ValueError(f"--set {key}: {type(obj).__name__} has no field {path[0]!r} (fields: {', '.join(sorted(names))})")
    if len(path) == 1:
        return dataclasses.replace(obj, **{path[0]: value})
    inner = getattr(obj, path[0])
    if inner is None or not dataclasses.is_dataclass(inner):
        raise ValueError(f"--set {key}: {path[0]!r} is not a section here (sparse settings need a sparse run)")
    return dataclasses.replace(obj, **{path[0]: _replace(inner, path[1:], value, key)})


def apply_sets(cfg: OOMBConfig, sets: Iterable[str]) -> OOMBConfig:
    """``cfg`` with every ``KEY=VALUE`` of ``sets`` applied in order (a new config; ``cfg`` is unchanged)."""
    for item in sets:
        path, value = _parse(item)
        cfg = _replace(cfg, path, value, item)
    return cfg


def config_record(cfg: OOMBConfig) -> dict:
    """The engine configuration as a plain dict, for a result row."""
    return dataclasses.asdict(cfg)
