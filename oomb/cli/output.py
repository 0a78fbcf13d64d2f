"""The output folder of ``oomb train``: refusing one that holds other data, replacing an earlier run only once the new
one is saved, and writing the model (or adapter) atomically."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Iterator

from .errors import UsageError, _named
from .lock import LOCK_NAME as _LOCK, OutputLock, is_writing_process


def _is_within(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


_LOSS_PNG = "loss.png"
"""The plot of log.jsonl every run draws at its end."""
_TENSORBOARD = "tensorboard"
"""The folder of the TensorBoard event files of --report-to tensorboard."""
# The lock file (_LOCK, :class:`~oomb.cli.lock.OutputLock`) is no output of the run: the checks of what the folder
# holds pass it by, and --overwrite leaves it where it is.


def _is_event_folder(p: Path) -> bool:
    """A folder of TensorBoard event files only (what --report-to tensorboard leaves after a first step's stop)."""
    return p.is_dir() and not p.is_symlink() and all(q.is_file() and q.name.startswith("events.out.tfevents.")
                                                     for q in p.iterdir())


_OOMB_LOG_KEYS = frozenset({"step", "loss", "stage1_seconds", "stage2_seconds"})
"""Keys of every log.jsonl record ``oomb train`` writes. A log line with only "step" and "loss" may be any
tool's; the stage timings are oomb's own."""


def _looks_like_oomb_output(out: Path) -> bool:
    """Whether ``out`` holds an earlier oomb run (what --overwrite may delete): a train_args.json that oomb
    wrote, a checkpoints/ folder with a checkpoint in it whose meta.json has the keys oomb's checkpoints write
    (format, step, fingerprint, files: any tool may write a meta.json), or a log.jsonl whose first line is an
    oomb step record (it has oomb's stage timings, not only a step and a loss, which any training tool may
    log). A bare file of one of those names is not enough (a user had --overwrite delete a folder
    whose only oomb-looking file was someone's log.jsonl). A run whose --overwrite stopped before it saved keeps the
    run it replaced in .oomb-replaced: that counts too."""
    if out.name != _REPLACED and (out / _REPLACED).is_dir() and _looks_like_oomb_output(out / _REPLACED):
        return True
    try:
        if "oomb_version" in json.loads((out / "train_args.json").read_text()):
            return True
    except (OSError, ValueError, TypeError):
        pass
    ckpts = out / "checkpoints"
    if ckpts.is_dir():
        from ..checkpoint import is_checkpoint_meta

        if any(p.is_dir() and is_checkpoint_meta(p / "meta.json") for p in ckpts.iterdir()):
            return True
    try:
        with open(out / "log.jsonl") as f:
            line = f.readline()
    except OSError:
        return False
    if not line:
        # A run stopped in its first step leaves an empty log.jsonl and nothing else. Deleting that (and an
        # empty checkpoints/ folder) loses nothing; anything else next to an empty log could be anyone's (files kept
        # under checkpoints/ next to an empty log.jsonl must survive --overwrite).
        return all((p.name == "log.jsonl" and p.is_file()) or (p.name == "checkpoints" and p.is_dir() and not any(p.iterdir()))
                   or (p.name == _TENSORBOARD and _is_event_folder(p)) or p.name == _LOCK for p in out.iterdir())
    try:
        first = json.loads(line)
    except ValueError:
        return False
    return isinstance(first, dict) and _OOMB_LOG_KEYS <= first.keys()


_CHECKPOINTS = "checkpoints"
"""The folder of the run's checkpoints (:mod:`oomb.checkpoint`)."""
_STEP_DIR = re.compile(r"step-[0-9]{8,}")
"""A checkpoint folder, ``step-NNNNNNNN`` (:func:`oomb.checkpoint.save_checkpoint`)."""
_TMP_STEP_DIR = re.compile(r"\.tmp-step-[0-9]{8,}-.+")
"""The hidden folder a checkpoint is written into before it is renamed (left by a process killed mid-write)."""
_POINTER_FILES = ("latest", ".latest.tmp")
"""The pointer to the newest checkpoint, and the file it is written to before it is renamed."""
_EVENTS_PREFIX = "events.out.tfevents."
"""The name of every TensorBoard event file (the only files --report-to tensorboard writes)."""


def _plain(p: Path, folder: bool) -> bool:
    """``p`` is a folder (``folder``) or a regular file, and not a symbolic link."""
    return not p.is_symlink() and (p.is_dir() if folder else p.is_file())


def _foreign_in_checkpoint(step_dir: Path, rel: str) -> list[str]:
    """The entries of the checkpoint folder ``step_dir`` (``rel``: its path to show) that its meta.json does not
    list, each as ``rel/...`` (a folder with a trailing "/"); ``[rel + "/"]`` where its meta.json is not oomb's."""
    from ..checkpoint import is_checkpoint_meta

    meta = step_dir / "meta.json"
    try:
        files = json.loads(meta.read_text())["files"] if is_checkpoint_meta(meta) else None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        files = None
    if not isinstance(files, dict):
        return [f"{rel}/"]
    allowed = {str(n) for n in files} | {"meta.json"}
    folders = {str(parent) for n in allowed for parent in Path(n).parents if str(parent) != "."}
    found: list[str] = []

    def walk(d: Path, prefix: str) -> None:
        try:
            entries = sorted(d.iterdir())
        except OSError:
            found.append(f"{rel}/{prefix}")
            return
        for p in entries:
            name = f"{prefix}{p.name}"
            if name in folders and _plain(p, folder=True):
                walk(p, f"{name}/")
            elif not (name in allowed and _plain(p, folder=False)):
                found.append(f"{rel}/{name}{'/' if p.is_dir() and not p.is_symlink() else ''}")

    walk(step_dir, "")
    return found


def _foreign_entries(out: Path) -> list[str]:
    """What --overwrite would delete that oomb did not write: the entries inside the folders it owns (checkpoints/
    and tensorboard/ of ``out`` and of the run an unfinished --overwrite kept in .oomb-replaced) other than those
    oomb writes there, as paths relative to ``out`` (a folder with a trailing "/"; one that cannot be read is
    named too). In checkpoints/ oomb writes ``step-NNNNNNNN/`` checkpoints (holding the files their meta.json
    lists, and meta.json), ``.tmp-step-*/`` folders being written, and the ``latest`` pointer (and
    ``.latest.tmp``); in tensorboard/, TensorBoard event files (``events.out.tfevents.*``). A folder of those
    names that is a symbolic link is not looked into: deleting the link leaves what it points to."""
    found: list[str] = []

    def shown(p: Path, rel: str) -> str:
        return f"{rel}/" if p.is_dir() and not p.is_symlink() else rel

    for base, prefix in ((out, ""), (out / _REPLACED, f"{_REPLACED}/")):
        for folder in (_CHECKPOINTS, _TENSORBOARD):
            root = base / folder
            if not _plain(root, folder=True):
                continue
            try:
                entries = sorted(root.iterdir())
            except OSError:
                found.append(f"{prefix}{folder}/")
                continue
            for p in entries:
                rel = f"{prefix}{folder}/{p.name}"
                if folder == _TENSORBOARD:
                    if not (p.name.startswith(_EVENTS_PREFIX) and _plain(p, folder=False)):
                        found.append(shown(p, rel))
                elif _STEP_DIR.fullmatch(p.name) and _plain(p, folder=True):
                    found += _foreign_in_checkpoint(p, rel)
                elif not ((_TMP_STEP_DIR.fullmatch(p.name) and _plain(p, folder=True))
                          or (p.name in _POINTER_FILES and _plain(p, folder=False))):
                    found.append(shown(p, rel))
    return found


def _listing(names: list[str], shown: int = 3) -> str:
    """``names`` (at least one) joined for one line: the first ``shown``, then "and N more"."""
    if len(names) <= shown:
        return ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1]
    return f"{', '.join(names[:shown])} and {len(names) - shown} more"


def _refuse_foreign_entries(out: Path, given: str) -> None:
    """Refuse an --overwrite that would delete entries oomb did not write inside the folders it owns
    (:func:`_foreign_entries`), naming them; nothing is moved or deleted."""
    foreign = _foreign_entries(out)
    if foreign:
        raise UsageError(
            f"--overwrite: --output-dir {given!r} holds {_listing(foreign)}, which oomb did not write, inside folders "
            "that --overwrite deletes",
            f"move {'them' if len(foreign) > 1 else 'it'} out of {given!r} and run again, or pass a new --output-dir",
        )


def _probe_writable(folder: Path) -> None:
    """Create and remove an empty temporary directory in ``folder`` (os.access is not enough for root, or on
    /proc-like file systems); nothing else is written.

    Raises:
        OSError: ``folder`` cannot be written.
    """
    import tempfile

    os.rmdir(tempfile.mkdtemp(prefix=".oomb-probe-", dir=folder))


def _check_writable_dir_path(flag: str, given: str, path: Path) -> None:
    """``path`` (a directory to create or use) can be made: its nearest existing ancestor is a writable directory
    (probed with :func:`_probe_writable`)."""
    ancestor = path
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{flag} {given!r}: {str(ancestor)!r} is a file, not a folder", f"pass a {flag} whose parent folders are folders")
    try:
        _probe_writable(ancestor)
    except OSError as exc:
        raise UsageError(
            f"{flag} {given!r}: cannot create folders in {str(ancestor)!r} ({exc.strerror or exc})",
            f"pass a {flag} in a folder you can write to",
        ) from exc


def _check_checkpoints_writable(out: Path, name: str, given: str) -> None:
    """Refuse a --resume whose output folder ``out`` has a checkpoints/ folder that cannot be written (read-only,
    immutable, another user's), before a step is trained (the run failed at its first checkpoint, its log already
    past the newest one). Probes with :func:`_probe_writable`; nothing else is written. ``name``: how the
    user gave the output folder (``given``)."""
    ckpts = out / _CHECKPOINTS
    if not ckpts.is_dir():
        return
    try:
        _probe_writable(ckpts)
    except OSError as exc:
        from ..checkpoint import find_latest

        latest = find_latest(ckpts)
        elsewhere = (f", or continue in a new folder with --resume {shlex.quote(str(latest))} --output-dir NEW_DIR"
                     if latest is not None else "")
        raise UsageError(
            f"{name} {given!r}: its checkpoints folder {str(ckpts)!r} cannot be written ({exc.strerror or exc}), "
            "so the run could save no checkpoint",
            f"make it writable (chmod u+w; chattr -i where it is immutable){elsewhere}",
        ) from exc


def _output_path(args: argparse.Namespace) -> tuple[Path, str]:
    """The output folder of ``args`` (absolute) and how the user gave it (``--output-dir``, or ``output.dir (in
    FILE)``), refused where it is missing, a file, or cannot be created or written (probed with
    :func:`_probe_writable`). What it holds is checked by :func:`_check_output_contents`."""
    if args.output_dir is None:
        raise UsageError("oomb train needs --output-dir (or output.dir in --config FILE)",
                         "pass --output-dir DIR, a folder that is new or empty")
    if not str(args.output_dir).strip():
        raise UsageError("--output-dir is empty", "pass a directory path that is new or empty")
    name = _named(args, "output.dir", "--output-dir")  # the subject of the refusals below
    out = Path(args.output_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"{name} {args.output_dir!r} is a file", "pass a directory path that is new or empty")
    _check_writable_dir_path("--output-dir", args.output_dir, out)
    return out, name


def _has_entries(out: Path) -> bool:
    """Whether the folder ``out`` holds anything but the lock file of a run (:data:`_LOCK`)."""
    return any(p.name != _LOCK for p in out.iterdir())


def _check_output_contents(args: argparse.Namespace, out: Path, name: str) -> Path:
    """Refuse an output folder ``out`` (:func:`_output_path`; ``name``: how the user gave it) whose contents do not
    fit the run: a non-empty one without --overwrite or --resume, an --overwrite of a folder that holds no oomb
    run or would delete an input, a --resume that has nothing to continue or would mix two runs. Returns ``out``.
    Nothing is written."""
    if args.resume is not None:
        resume = _named(args, "output.resume", "--resume")  # the subject of the refusals below
        _check_checkpoints_writable(out, name, args.output_dir)
        if args.resume == "latest" and not (out / "checkpoints").is_dir():
            replaced = _replaced_run_resume(out)
            if replaced is not None:
                raise UsageError(f"{resume} latest: {name} {args.output_dir!r} has no checkpoints folder: "
                                 f"{replaced[0]}", replaced[1])
            raise UsageError(
                f"{resume}: {name} {args.output_dir!r} has no checkpoints folder",
                "pass the --output-dir of the run to continue, or start without "
                f"{_named(args, 'output.resume', '--resume', file=False)}",
            )
        ckpt = Path(args.resume).expanduser().resolve() if args.resume != "latest" else None
        if ckpt is not None and (ckpt / "checkpoints").is_dir():
            raise UsageError(f"{resume} {args.resume!r} is the output folder of a run, not one of its checkpoints",
                             f"pass --output-dir {shlex.quote(args.resume)} --resume latest to continue that run, or "
                             f"--resume with a checkpoint folder under {str(ckpt / 'checkpoints')!r}")
        if ckpt is not None and ckpt.is_dir() and not (ckpt / "meta.json").exists():
            from ..checkpoint import find_latest, is_checkpoint_meta

            newest = find_latest(ckpt)
            newest = newest if newest is not None and is_checkpoint_meta(newest / "meta.json") else None
            if newest is not None or (ckpt.name == _CHECKPOINTS and _looks_like_oomb_output(ckpt.parent)):
                run = ckpt.parent
                problem = (f"{resume} {args.resume!r} is the checkpoints folder of a run, not one of its checkpoints "
                           "(a step-NNNNNNNN folder in it)")
                if newest is None:
                    raise UsageError(f"{problem}, and it holds none",
                                     "start without --resume" + (" (with --overwrite)" if run == out else ""))
                step = shlex.quote(str(Path(args.resume) / newest.name))
                if run == out:
                    fix = f"pass --resume latest to continue from its newest checkpoint, or --resume {step}"
                elif run.name == _REPLACED:  # the run an unfinished --overwrite kept: continued only elsewhere
                    fix = f"pass --resume {step} (its newest checkpoint) with a new or empty --output-dir"
                else:
                    fix = (f"pass --output-dir {shlex.quote(str(run))} --resume latest to continue that run in its "
                           f"folder, or --resume {step} (its newest checkpoint) with a new or empty --output-dir")
                raise UsageError(problem, fix)
        if ckpt is not None and ckpt.is_dir() and ckpt.parent != (out / "checkpoints").resolve() \
                and out.is_dir() and _has_entries(out):
            # Continuing there would mix two runs: its log.jsonl rewritten, its checkpoints pruned, its model replaced.
            raise UsageError(
                f"{resume} {args.resume!r} is not a checkpoint of {name} {args.output_dir!r} (it is in "
                f"{str(ckpt.parent)!r}) and that --output-dir is not empty: continuing there would mix two runs' "
                "logs, checkpoints and models",
                "pass the --output-dir the checkpoint belongs to, or a new or empty --output-dir to continue it there "
                "(the checkpoint's own folder is left as it is)",
            )
        if ckpt is not None and ckpt.is_dir() and ckpt.parent == (out / "checkpoints").resolve():
            later = sorted(p.name for p in ckpt.parent.iterdir()
                           if p.is_dir() and p.name.startswith("step-") and p.name > ckpt.name)
            if later:
                # Continuing here would train the later steps again: their checkpoints, log lines and saved model
                # replaced (or pruned: two checkpoints are kept) without the user asking for it.
                raise UsageError(
                    f"{resume} {args.resume!r} is not the newest checkpoint of {name} {args.output_dir!r} "
                    f"({', '.join(later)} {'come' if len(later) > 1 else 'comes'} after it): continuing there would "
                    "replace the later checkpoints, log lines and saved model",
                    f"continue it in a new folder (--output-dir NEW_DIR; {args.output_dir!r} is left as it is), "
                    "continue the newest with --resume latest, or delete the later checkpoints by hand to go back to "
                    "it in this folder",
                )
        return out
    if out.is_dir() and _has_entries(out):
        if not args.overwrite:
            from ..checkpoint import find_latest

            if not _looks_like_oomb_output(out):
                # --overwrite replaces only an earlier oomb run: offering it here would only lead to its refusal.
                raise UsageError(
                    f"{name} {args.output_dir!r} exists, is not empty and holds no oomb run",
                    "pass a new or empty --output-dir",
                )
            foreign = _foreign_entries(out)
            overwrite = (f"move {_listing(foreign)} (not written by oomb) out of it and pass --overwrite" if foreign
                         else "--overwrite")
            latest = find_latest(out / "checkpoints") if (out / "checkpoints").is_dir() else None
            if latest is not None and not (out / "train_args.json").exists():
                raise UsageError(
                    f"{name} {args.output_dir!r} holds an oomb run that stopped before its end "
                    f"(last checkpoint {latest.name})",
                    f"pass --resume to continue it, {overwrite} to discard it, or a new directory",
                )
            raise UsageError(
                f"{name} {args.output_dir!r} exists and is not empty",
                f"pass a new directory, or {overwrite} to replace the oomb run in it",
            )
        # Only an earlier oomb run is replaced: never the contents of some other folder (a source tree, ...).
        if not _looks_like_oomb_output(out):
            raise UsageError(
                f"--overwrite: --output-dir {str(out)!r} is not empty and does not look like an oomb output "
                "(no train_args.json written by oomb, no oomb checkpoint, no log.jsonl of oomb train step records in it)",
                "remove its contents by hand if they are not needed, or pick another --output-dir",
            )
        # --overwrite replaces the earlier run's outputs (all entries where its train_args.json lists none): refuse
        # where an input is one of them or holds the output dir, and where the output dir holds the work tree.
        ours = _oomb_outputs(out)
        protected = [(Path.cwd().resolve(), "the working directory", True),
                     (Path.home().resolve(), "your home directory", True)]
        for flag, p in (("--data", args.data), ("--tokenizer", args.tokenizer), ("--model", args.model)):
            if p is not None and os.path.exists(p):
                protected.append((Path(p).resolve(), f"the {flag} input", False))
        for p, what, any_depth in protected:
            if _is_within(p, out) and (any_depth or p == out or ours is None or p.relative_to(out).parts[0] in ours):
                raise UsageError(
                    f"{name} {args.output_dir!r} contains {str(p)!r} ({what}), which --overwrite would delete",
                    "pass an output directory of its own",
                )
        _refuse_foreign_entries(out, args.output_dir)
    return out


@contextlib.contextmanager
def _locked_output_dir(args: argparse.Namespace) -> Iterator[Path]:
    """The output folder of ``oomb train`` (absolute), checked (:func:`_output_path`, then
    :func:`_check_output_contents`) and, in the process that writes it (:func:`~oomb.cli.lock.is_writing_process`),
    locked (:class:`~oomb.cli.lock.OutputLock`) from between those checks (a second run is refused as such,
    whatever the folder holds while the first writes it) until the ``with`` block ends."""
    out, name = _output_path(args)
    lock = None
    if is_writing_process():
        lock = OutputLock(out, name, args.output_dir, "oomb " + shlex.join(getattr(args, "_argv", None) or ["train"]))
        lock.acquire()
    try:
        yield _check_output_contents(args, out, name)
    finally:
        if lock is not None:
            lock.release()


def _oomb_outputs(out: Path) -> set[str] | None:
    """Names of the entries of ``out`` that an earlier ``oomb train`` wrote (what --overwrite deletes): its
    log.jsonl, checkpoints/, loss.png, tensorboard/ and save debris, and the files its train_args.json lists under
    "outputs". None means every entry: a train_args.json of an oomb that did not list its outputs yet. (Only a
    folder :func:`_looks_like_oomb_output` accepts gets here: a folder whose only oomb-looking entry is a
    tensorboard/ folder is someone else's, and refused.)"""
    names = {"log.jsonl", ".log.jsonl.tmp", "checkpoints", _LOSS_PNG, f".{_LOSS_PNG}.tmp", _TENSORBOARD}
    names |= {p.name for p in out.glob(".oomb-save-*")}
    try:
        train_args = json.loads((out / "train_args.json").read_text())
    except (OSError, ValueError, TypeError):
        return names
    if not (isinstance(train_args, dict) and "oomb_version" in train_args):
        return names
    listed = train_args.get("outputs")
    if not isinstance(listed, list):
        return None
    return names | {"train_args.json"} | {n for n in map(str, listed) if n == Path(n).name and n not in ("", ".", "..")}


# Where --overwrite moves the earlier run's outputs until this run has saved its model (then they are deleted): a
# run that fails or is killed before that leaves the earlier one recoverable (a user lost a finished run
# to a killed --overwrite run, which deleted it at its start).
_REPLACED = ".oomb-replaced"


def _replaced_run_resume(out: Path) -> tuple[str, str] | None:
    """Where to resume the run that an unfinished --overwrite moved to ``out/.oomb-replaced``, for a --resume latest
    that finds no checkpoint of ``out``'s own: (what happened, the fix: the command that continues it in a new
    folder). None where .oomb-replaced holds no complete checkpoint."""
    from ..checkpoint import find_latest

    backup = out / _REPLACED
    latest = find_latest(backup / "checkpoints") if (backup / "checkpoints").is_dir() else None
    if latest is None:
        return None
    return (f"the --overwrite run started there has written none, and the run it replaced is in {backup} (its last "
            f"checkpoint: {latest.name})",
            f"continue that run with --resume {latest} --output-dir NEW_DIR (a new folder; {backup} is left as it is), "
            "or start again with --overwrite")


def _prepare_output(out: Path, overwrite: bool) -> None:
    """Create ``out``; with ``overwrite``, first move the earlier run's outputs (:func:`_oomb_outputs`) to
    ``out/.oomb-replaced`` (where an unfinished --overwrite left one there, delete them instead and keep that),
    keeping every other entry. Raises :class:`UsageError`, having moved nothing, where a folder it would move
    holds an entry oomb did not write (:func:`_foreign_entries`)."""
    if out.is_dir() and overwrite:
        _refuse_foreign_entries(out, str(out))  # checked again: one may have come since _check_output_contents
        ours = _oomb_outputs(out)
        backup = out / _REPLACED
        keep_old = backup.is_dir()  # an earlier --overwrite did not finish: what it replaced stays, its own outputs go
        if not keep_old:
            backup.mkdir()
        kept = []
        for child in sorted(out.iterdir()):
            if child.name in (_REPLACED, _LOCK):  # the lock stays where a second run looks for it
                continue
            if ours is not None and child.name not in ours:
                kept.append(child.name)
            elif not keep_old:
                os.replace(child, backup / child.name)
            elif child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        if keep_old:
            print(f"oomb: note: --overwrite deleted the unfinished run in {out}; the run an earlier --overwrite replaced "
                  f"stays in {backup} until this run saves its model", file=sys.stderr)
        else:
            print(f"oomb: note: --overwrite moved the earlier run's outputs to {backup}; they are deleted once this run "
                  "saves its model", file=sys.stderr)
        if kept:
            print(f"oomb: note: --overwrite replaced the earlier run's outputs in {out} and kept what it did not write: "
                  f"{', '.join(kept)}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)


_SAVE_DIR_PREFIX = ".oomb-save-"
"""The temporary folder :func:`_save` writes the model into, followed by the pid of the process writing it."""


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (one of another user's counts; so does a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's process
        return True
    return True


def _remove_dead_saves(out: Path) -> None:
    """Delete the temporary folders of :func:`_save` in ``out`` whose process is gone (one killed while it saved:
    nothing in it was moved into ``out``). A folder whose pid is alive (another process saving there), or whose name
    holds no pid, is kept."""
    for p in out.glob(f"{_SAVE_DIR_PREFIX}*"):
        pid = p.name[len(_SAVE_DIR_PREFIX):]
        if not (pid.isdigit() and int(pid) > 0) or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


_OPTIONAL_OUTPUTS = ("README.md",)
"""Files of a save the model does not need (peft's model card): not written over a file of that name that oomb did
not write (a user's notes in the output folder)."""


def _users_optional_outputs(out: Path) -> list[str]:
    """The :data:`_OPTIONAL_OUTPUTS` that ``out`` holds and no earlier ``oomb train`` wrote (:func:`_oomb_outputs`;
    a train_args.json that lists no outputs counts as having written all)."""
    ours = _oomb_outputs(out)
    if ours is None:
        return []
    return [n for n in _OPTIONAL_OUTPUTS if n not in ours and (out / n).exists()]


def _save(model, tokenizer, out: Path, lora: bool, train_args: dict, state_dict: dict | None = None) -> list[str]:
    """Write model (or adapter) + tokenizer + train_args.json to a temp dir in ``out``, then move them in;
    ``state_dict``: the weights to write instead of the model's own (a sharded model's, gathered). The temp dirs
    that killed saves left in ``out`` are removed first (:func:`_remove_dead_saves`). A model card (README.md) is
    not written over a README.md oomb did not write (:func:`_users_optional_outputs`): a note says so."""
    _remove_dead_saves(out)
    tmp = out / f"{_SAVE_DIR_PREFIX}{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        given = {} if state_dict is None else {"state_dict": state_dict}
        if lora:
            model.save_pretrained(str(tmp), safe_serialization=True, **given)
        else:
            model.save_pretrained(str(tmp), **given)
        from ..models.saving import save_tokenizer

        save_tokenizer(tokenizer, tmp)  # after the model: AutoTokenizer's class depends on its config.json
        for name in _users_optional_outputs(out):
            (tmp / name).unlink(missing_ok=True)
            print(f"oomb: note: kept {name} in {out}, which oomb did not write: the model card was not saved",
                  file=sys.stderr)
        # The list of what this run wrote lets a later --overwrite delete exactly that (_oomb_outputs).
        train_args = dict(train_args, outputs=sorted(os.listdir(tmp) + ["train_args.json"]))
        (tmp / "train_args.json").write_text(json.dumps(train_args, indent=2) + "\n")
        names = sorted(os.listdir(tmp))
        from ..checkpoint import _umask

        for name in names:
            if (tmp / name).is_file():  # transformers writes model.safetensors 0600 (a temp file renamed)
                os.chmod(tmp / name, 0o666 & ~_umask())
            dst = out / name
            if dst.is_dir() and not dst.is_symlink():
                shutil.rmtree(dst)
            os.replace(tmp / name, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return names


def _broken_latest_pointer(ckpt_root: Path, used: Path, resume: str = "--resume") -> list[str]:
    """A note when checkpoints/latest names no complete checkpoint (find_latest then takes the newest one there):
    the run does not resume silently from another step than the pointer says. ``resume``: how the user gave the
    resume setting (:func:`~oomb.cli.errors._named`)."""
    pointer = ckpt_root / "latest"
    try:
        named = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return []
    if used.name == named:
        return []
    return [f"{resume} latest: {pointer} names {named!r}, which is not a complete checkpoint; resuming from the "
            f"newest one there, {used.name}"]


def _saved_model_of(out: Path, path: Path, step: int) -> bool:
    """Whether ``out`` holds the saved model of its checkpoint ``path`` at ``step``, the newest of out/checkpoints:
    its train_args.json (written last by :func:`_save`) is of a run of ``step`` steps and every file it lists is
    there. Then a --resume with --steps ``step`` has nothing to do."""
    ckpt_root = (out / "checkpoints").resolve()
    if path.resolve().parent != ckpt_root or any(
            p.is_dir() and p.name.startswith("step-") and p.name > path.name for p in ckpt_root.iterdir()):
        return False
    try:
        train_args = json.loads((out / "train_args.json").read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(train_args, dict) and "oomb_version" in train_args and train_args.get("steps") == step):
        return False
    listed = train_args.get("outputs")
    return isinstance(listed, list) and all((out / str(n)).exists() for n in listed)
