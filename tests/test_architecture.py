"""The package's shape: imports go one way, settings come as arguments, and every flag is a config field."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "oomb"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The oomb modules ``name`` imports, at module level or inside functions (a circle through a deferred import
    is a circle of the design all the same)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("oomb"):
                found.add(t)
    # a package's __init__ is not a dependency of its own modules' imports of siblings
    return {t for t in found if not (t != "oomb" and name.startswith(t + "."))} - {"oomb"}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_circle_in_the_package():
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_check_can_fail():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _reads_environment(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("room", ["ops", "engine"])
def test_kernels_and_engine_take_their_settings_as_arguments(room):
    """No module under oomb/ops or oomb/engine reads the environment: options are arguments (config fields)."""
    offenders = {str(p.relative_to(PACKAGE.parent)): _reads_environment(p) for p in (PACKAGE / room).rglob("*.py")}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, offenders


def test_the_environment_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nx = os.environ.get('X')\n")
    assert _reads_environment(bad) == [2]


def _option_strings(parser) -> dict[str, set[str]]:
    import argparse

    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = {s for a in sub._actions for s in a.option_strings}
    return out


def test_every_flag_is_a_config_field():
    """A flag of any subcommand is a field of a configuration section (its own flag, or the --no- form of a
    boolean one), or one of the few that say what to do with the configuration (--help, --config, ...)."""
    from oomb.cli import META_FLAGS, _build_parser
    from oomb.config.flags import command_fields

    for command, flags in _option_strings(_build_parser()).items():
        fields = {ff.flag for ff in command_fields(command) if not ff.positional}  # (a positional: no option string)
        allowed = fields | {"--no-" + f[2:] for f in fields} | set(META_FLAGS) | {"-h"}
        assert flags - allowed == set(), (command, flags - allowed)
        assert fields <= flags, (command, fields - flags)
    # A positional argument (oomb merge's ADAPTER_DIR) is a field too.
    for action in _build_parser()._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):
            for command, sub in action.choices.items():
                positional = {a.dest for a in sub._actions if not a.option_strings}
                assert positional == {ff.dest for ff in command_fields(command) if ff.positional}, command


def test_no_file_outgrows_a_room():
    """No module over 800 lines, except kernel files (Triton) under 1,000."""
    big = {}
    for path in PACKAGE.rglob("*.py"):
        n = len(path.read_text(encoding="utf-8").splitlines())
        kernel = "triton" in path.read_text(encoding="utf-8")[:4000] and "@triton.jit" in path.read_text(encoding="utf-8")
        if n > (1000 if kernel else 800):
            big[str(path.relative_to(PACKAGE.parent))] = n
    assert not big, big
