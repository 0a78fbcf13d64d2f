"""Training checkpoints that survive a crash: atomic writes, verification, resume.

Layout under a run's ``checkpoints/`` folder::

    checkpoints/
      step-00000040/            a complete checkpoint (never written in place)
        trainable.safetensors   the trainable parameters (all of them, or the LoRA adapter)
        trainer_state.pt        optimizer, LR scheduler, RNG states, data position
        meta.json               step, run fingerprint, sizes and SHA-256 of the files above
      latest                    name of the newest complete checkpoint (replaced atomically)

A run whose parameters are sharded over ranks (FSDP2, :mod:`oomb.engine.sharding`) writes, with ``sharded=True``
on every rank, ``dcp/`` instead of ``trainable.safetensors``: the trainable parameters and the optimizer state as
``torch.distributed.checkpoint`` (DCP) files, each rank writing its shards (the state dicts of
``torch.distributed.checkpoint.state_dict.get_state_dict``, frozen parameters left out); ``trainer_state.pt``
then holds the rest (scheduler, RNG states, data position) and ``meta.json`` lists and hashes every DCP file
too, with ``"sharded": {"world_size": W}``. It loads on the same number of ranks, sharded the same way.

A checkpoint is written into a hidden temporary folder, every file is flushed and
fsync'ed, ``meta.json`` is written last, and only then is the folder renamed
into place and ``latest`` replaced (``os.replace``: atomic on POSIX). A process
killed at any point leaves the previous checkpoint complete and ``latest``
pointing at it; the debris of the interrupted write is removed by the next save.
Older checkpoints are deleted only after the new one is in place. One process
writes a checkpoints folder at a time (``oomb train`` holds its output folder
locked for that): every unfinished folder there is taken for such debris.

Loading verifies sizes and SHA-256 sums, so a truncated or corrupt file is
reported by name instead of loading garbage, and it refuses a checkpoint whose
run fingerprint (model, sequence length, LoRA rank, ...) differs from the
current run's, naming the difference.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "CheckpointError",
    "GracefulStop",
    "find_latest",
    "intact_before",
    "is_checkpoint_folder",
    "is_checkpoint_meta",
    "load_checkpoint",
    "read_meta",
    "read_settings",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

_PREFIX = "step-"
_META = "meta.json"
_WEIGHTS = "trainable.safetensors"
_STATE = "trainer_state.pt"
_DCP = "dcp"
_FORMAT = 1
_META_KEYS = frozenset({"format", "step", "fingerprint", "files"})
"""Keys of every meta.json :func:`save_checkpoint` writes."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or from a different run; the message says which file and why."""


# ----------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """Python, torch CPU and (if present) CUDA random generator states."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- helpers
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / _META).is_file())


# ----------------------------------------------------------------------------- save
def _umask() -> int:
    """The process umask (read by setting it, then put back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    fingerprint: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keep_last: int = 2,
    settings: dict[str, Any] | None = None,
    *,
    sharded: bool = False,
) -> Path:
    """Write a complete checkpoint of ``step`` under ``root`` atomically; return its folder.

    Args:
        root: the checkpoints folder (created if missing), which this run alone writes: the unfinished
            ``.tmp-step-*`` folders in it are removed as the debris of killed writes.
        step: optimizer steps completed.
        model: its trainable parameters are saved (all of them, or only a LoRA adapter's).
        optimizer, scheduler: their ``state_dict()`` (either may be None).
        fingerprint: JSON-serialisable facts that must match on resume (model, seq_len, ...).
        extra: anything else to restore (RNG states, data position); saved with torch.save.
        keep_last: complete checkpoints to keep (>= 1): the new one and the ``keep_last - 1`` newest of
            earlier steps; older ones are deleted after the new one is in place. Checkpoints of later
            steps (left by a run resumed from an earlier checkpoint) are kept until their step is saved again.
        settings: JSON-serialisable settings saved in meta.json for the caller to compare on resume
            with its own rules (:func:`read_settings`); not part of the fingerprint.
        sharded: the model's parameters are FSDP2 shards: every rank calls this (a collective) and writes its
            shards of the trainable parameters and optimizer state with DCP; rank 0 writes the rest. Every rank
            returns the folder or raises the same error.
    """
    if sharded:
        return _save_sharded(Path(root), step, model, optimizer, scheduler, fingerprint, extra, keep_last, settings)
    root = Path(root)
    tmp = _new_tmp(root, step)
    weights = {name: p.detach().to("cpu").contiguous() for name, p in _trainable(model).items()}
    try:
        save_file(weights, str(tmp / _WEIGHTS))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    state = {"optimizer": optimizer.state_dict() if optimizer is not None else None}
    return _finish(root, tmp, step, state, scheduler, fingerprint, extra, keep_last, settings, {})


def _new_tmp(root: Path, step: int) -> Path:
    """A new hidden folder for the checkpoint of ``step`` under ``root`` (created; the debris of writes that were
    killed removed: every unfinished folder there, this run being ``root``'s only writer)."""
    root.mkdir(parents=True, exist_ok=True)
    for debris in root.glob(f".tmp-{_PREFIX}*"):  # left by a process killed mid-write
        shutil.rmtree(debris, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{_PREFIX}{step:08d}-", dir=root))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700: as any folder the user makes (shared servers)
    return tmp


def _finish(root: Path, tmp: Path, step: int, state: dict, scheduler, fingerprint: dict, extra: dict | None,
            keep_last: int, settings: dict | None, meta_extra: dict) -> Path:
    """Write trainer_state.pt (``state`` + scheduler + extra) and meta.json (every file of ``tmp`` listed and hashed)
    into ``tmp``, then move it into place as step ``step``, point ``latest`` at it and prune (see save_checkpoint)."""
    final = root / f"{_PREFIX}{step:08d}"
    try:
        state = dict(state, scheduler=scheduler.state_dict() if scheduler is not None else None, extra=extra or {})
        torch.save(state, tmp / _STATE)
        files = {}
        mode = 0o666 & ~_umask()
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            name = f.relative_to(tmp).as_posix()
            os.chmod(f, mode)  # as open() makes a file: safetensors writes its file 0600
            _fsync_file(f)
            files[name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        meta = {"format": _FORMAT, "step": step, "fingerprint": fingerprint, "files": files, **meta_extra}
        if settings is not None:
            meta["settings"] = settings
        with open(tmp / _META, "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        for d in {p.parent for p in tmp.rglob("*")}:
            _fsync_dir(d)
        if final.exists():  # re-saving the same step (e.g. on a signal right after a periodic save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer_tmp = root / ".latest.tmp"
    pointer_tmp.write_text(final.name + "\n")
    _fsync_file(pointer_tmp)
    os.replace(pointer_tmp, root / "latest")
    _fsync_dir(root)
    # Prune only checkpoints of EARLIER steps: after a resume from an earlier checkpoint, later ones (of the
    # abandoned steps) sort last, and pruning by position deleted the checkpoint just written while `latest`
    # pointed at it. Later ones stay until the run writes their step again (replaced above).
    earlier = [p for p in _complete_checkpoints(root) if p.name < final.name]
    for old in earlier[: max(0, len(earlier) - (max(1, keep_last) - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _dcp_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True)


def _sharded_state(model: torch.nn.Module, optimizer) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}``: this rank's shards of the trainable parameters and of the optimizer
    state, keyed by parameter name (``get_state_dict``), as DCP saves and loads them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model, options=_dcp_options())}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_dcp_options())
    return {"model": model_sd, "optimizer": optim_sd}


def _on_rank0(fn):
    """``fn()`` on rank 0, its result (or the one-line text of its error) given to every rank; every rank returns
    the result or raises :class:`CheckpointError` with that text."""
    import torch.distributed as dist

    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - any failure is told to every rank
            box[0] = ("error", f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError) else str(exc))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def _save_sharded(root: Path, step: int, model, optimizer, scheduler, fingerprint, extra, keep_last, settings) -> Path:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tmp = Path(_on_rank0(lambda: str(_new_tmp(root, step))))
    try:
        dcp.save(_sharded_state(model, optimizer), checkpoint_id=str(tmp / _DCP))
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta_extra = {"sharded": {"world_size": dist.get_world_size()}}
    return Path(_on_rank0(lambda: str(_finish(root, tmp, step, {"optimizer": None}, scheduler, fingerprint, extra,
                                              keep_last, settings, meta_extra))))


# ----------------------------------------------------------------------------- load
def is_checkpoint_meta(path: str | Path) -> bool:
    """Whether the file ``path`` is a meta.json that oomb wrote: a JSON object with every key
    :func:`save_checkpoint` writes (format, step, fingerprint, files). Only its keys are looked at (no file
    is verified); any other meta.json (many tools write one) is not oomb's."""
    try:
        meta = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(meta, dict) and _META_KEYS <= meta.keys()


def is_checkpoint_folder(path: str | Path) -> bool:
    """Whether the folder ``path`` is an oomb checkpoint, whole or damaged: a meta.json that oomb wrote, or any
    meta.json beside a checkpoint's weights or trainer state (reading it then names what is wrong). Cheap: no file
    is verified."""
    path = Path(path)
    return (path / _META).exists() and (is_checkpoint_meta(path / _META) or any(
        (path / name).exists() for name in (_WEIGHTS, _STATE, _DCP)))


def find_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (through ``latest``, else by scanning), or None."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / _META).is_file():
            return candidate
    done = _complete_checkpoints(root)
    return done[-1] if done else None


def read_meta(path: str | Path) -> dict[str, Any]:
    """The meta.json of the checkpoint folder ``path`` with its structure checked (format, step, file list, run
    fingerprint); no other file is read (:func:`load_checkpoint` verifies them).

    Raises:
        CheckpointError: meta.json is missing, corrupt or damaged (naming the earlier intact checkpoints).
    """
    return _parse_meta(Path(path))


def read_settings(path: str | Path, key: str = "settings") -> dict[str, Any] | None:
    """The ``settings`` (or, with ``key="fingerprint"``, the fingerprint) :func:`save_checkpoint` saved in the
    checkpoint folder ``path``, or None (none saved, e.g. by an older oomb, or a meta.json that cannot be read:
    :func:`load_checkpoint` names that). Cheap: no file is verified."""
    try:
        meta = json.loads((Path(path) / _META).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    settings = meta.get(key) if isinstance(meta, dict) else None
    return settings if isinstance(settings, dict) else None


def _has_its_files(path: Path) -> bool:
    """Whether the checkpoint folder ``path`` has a readable meta.json and every file it lists at its size (cheap:
    no file is hashed; loading it verifies the hashes)."""
    try:
        meta = json.loads((path / _META).read_text())
        files = meta["files"]
        return meta.get("format") == _FORMAT and all(
            (path / name).is_file() and (path / name).stat().st_size == info["bytes"] for name, info in files.items())
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False


def intact_before(path: str | Path) -> list[Path]:
    """The checkpoints beside ``path`` of earlier steps that have all their files (at their sizes; none is hashed),
    newest first, each named as ``path`` is (relative or not)."""
    path = Path(path)
    return [path.parent / p.name for p in reversed(_complete_checkpoints(path.parent))
            if p.name < path.name and _has_its_files(p)]


def _elsewhere(path: Path) -> str:
    """The fix of a damaged checkpoint ``path``: resume from the newest earlier checkpoint beside it that has all its
    files (named as ``path`` is, relative or not), in a new output folder, so that nothing is deleted or
    replaced; else restore the damaged file or start a new run."""
    earlier = intact_before(path)
    if not earlier:
        return ("no earlier checkpoint of this run is intact: restore the file from a copy, or start a new run in "
                "another --output-dir (this checkpoint is left as it is)")
    shown = [shlex.quote(str(p)) for p in earlier[:2]]
    also = f" (or the one before it, {shown[1]})" if len(shown) > 1 else ""
    return (f"resume from the earlier checkpoint with --resume {shown[0]}{also} and a new --output-dir (this "
            "checkpoint and its folder are left as they are)")


def _read_meta(path: Path) -> dict[str, Any]:
    """The meta.json of ``path``, its structure checked and every file it lists verified (size, SHA-256)."""
    meta = _parse_meta(path)
    _verify_files(path, meta["files"])
    return meta


def _parse_meta(path: Path) -> dict[str, Any]:
    """The meta.json of ``path`` with its structure checked (format, step, file list, fingerprint); no file is
    read but meta.json."""
    meta_path = path / _META
    if not meta_path.is_file():
        raise CheckpointError(
            f"{meta_path} is missing: {path} is not a complete oomb checkpoint; resume from another checkpoint "
            f"(e.g. --resume latest) or start without --resume"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path} is corrupt ({exc}); {_elsewhere(path)}") from exc
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or "files" not in meta:
        raise CheckpointError(f"{meta_path} is not an oomb checkpoint of format {_FORMAT}; {_elsewhere(path)}")
    files, step = meta.get("files"), meta.get("step")
    damaged = None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        damaged = f"its step is {step!r}, not a non-negative integer"
    elif not isinstance(files, dict) or not all(
        isinstance(info, dict) and isinstance(info.get("bytes"), int) and isinstance(info.get("sha256"), str)
        for info in files.values()
    ):
        damaged = "its file list is not {name: {bytes, sha256}}"
    elif "fingerprint" in meta and not isinstance(meta["fingerprint"], dict):
        damaged = "its run fingerprint is not a mapping"
    elif any(Path(name).is_absolute() or ".." in Path(name).parts for name in files):
        damaged = "it names files outside the checkpoint folder"
    if damaged is not None:
        raise CheckpointError(f"{meta_path} is damaged ({damaged}); {_elsewhere(path)}")
    if not any(name == _WEIGHTS or Path(name).parts[:1] == (_DCP,) for name in files):
        raise CheckpointError(f"{meta_path} is damaged (its file list names no {_WEIGHTS}); {_elsewhere(path)}")
    return meta


def _verify_files(path: Path, files: dict[str, dict]) -> None:
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing: the checkpoint is incomplete; {_elsewhere(path)}")
        size = f.stat().st_size
        if size < info["bytes"]:
            raise CheckpointError(f"{f} is truncated ({size:,} of its {info['bytes']:,} bytes); {_elsewhere(path)}")
        if size > info["bytes"]:
            raise CheckpointError(f"{f} is corrupt ({size} bytes, {info['bytes']} written); {_elsewhere(path)}")
        if _sha256(f) != info["sha256"]:
            raise CheckpointError(f"{f} is corrupt (its size is right but its SHA-256 checksum is not the one "
                                  f"{_META} records); {_elsewhere(path)}")


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    fingerprint: dict[str, Any],
    *,
    sharded: bool = False,
    trainer_state: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Verify and load a checkpoint into ``model``, ``optimizer`` and ``scheduler``.

    Args:
        sharded: the model's parameters are FSDP2 shards (as in :func:`save_checkpoint`): every rank calls this
            (a collective); rank 0 verifies the files, every rank reads its shards (DCP). The checkpoint must be
            a sharded one of as many ranks.
        trainer_state: False: the trainer state (optimizer, scheduler, ``extra``) is verified but not loaded
            (reading the weights as a model); ``extra`` is then ``{}``.

    Returns:
        (step, extra): the completed step count and the ``extra`` dict given to save.

    Raises:
        CheckpointError: missing/corrupt/truncated files (named), or a fingerprint that differs
            from the current run's (the differing keys are named with both values); with ``sharded``, on every
            rank, also a checkpoint of one process or of another number of ranks.
    """
    path = Path(path)
    if sharded:
        meta = _on_rank0(lambda: _checked_meta(path, fingerprint, sharded=True))
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = _sharded_state(model, optimizer)
        dcp.load(state, checkpoint_id=str(path / _DCP))
        set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                       optim_state_dict=state.get("optimizer", {}), options=_dcp_options())
        trainer_state = _trainer_state(path)
        if scheduler is not None and trainer_state.get("scheduler") is not None:
            scheduler.load_state_dict(trainer_state["scheduler"])
        return int(meta["step"]), trainer_state.get("extra", {})
    meta = _checked_meta(path, fingerprint, sharded=False)
    try:
        weights = load_file(str(path / _WEIGHTS))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{path / _WEIGHTS} cannot be read ({exc}); {_elsewhere(path)}") from exc
    params = _trainable(model)
    if set(weights) != set(params):
        missing, unexpected = sorted(set(params) - set(weights))[:3], sorted(set(weights) - set(params))[:3]
        raise CheckpointError(
            f"{path / _WEIGHTS} does not match the model's trainable parameters (missing {missing}, unexpected "
            f"{unexpected}); resume with the same model and LoRA settings"
        )
    for name, p in params.items():
        if weights[name].shape != p.shape:
            raise CheckpointError(
                f"{path / _WEIGHTS}: {name} has shape {tuple(weights[name].shape)}, the model {tuple(p.shape)}; "
                "resume with the same model"
            )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p.device, p.dtype))
    if not trainer_state:
        return int(meta["step"]), {}
    state = _trainer_state(path)
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    return int(meta["step"]), state.get("extra", {})


def _trainer_state(path: Path) -> dict:
    try:
        return torch.load(path / _STATE, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"{path / _STATE} cannot be read ({exc}); {_elsewhere(path)}") from exc


def _checked_meta(path: Path, fingerprint: dict[str, Any], sharded: bool) -> dict[str, Any]:
    """The verified meta.json of ``path`` (every file's size and hash), refused where its run fingerprint differs
    from ``fingerprint`` or its format (sharded over how many ranks, or one process) is not the run's."""
    meta = _read_meta(path)
    saved = meta.get("fingerprint", {})
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {fingerprint.get(k)!r}"
             for k in sorted(set(saved) | set(fingerprint)) if saved.get(k) != fingerprint.get(k)]
    if diffs:
        raise CheckpointError(
            f"{path} was written by a different run ({'; '.join(diffs)}); resume with the same settings, "
            f"or start a new run in another --output-dir"
        )
    ranks = meta.get("sharded", {}).get("world_size") if isinstance(meta.get("sharded"), dict) else None
    if sharded:
        import torch.distributed as dist

        if ranks != dist.get_world_size():
            was = f"sharded over {ranks} ranks" if ranks else "written by one process or unsharded ranks"
            raise CheckpointError(f"{path} was {was}, this run is sharded over {dist.get_world_size()}; resume with "
                                  "the checkpoint's ranks and sharding")
    elif ranks:
        raise CheckpointError(f"{path} holds parameter shards of {ranks} ranks; resume it with the same sharding")
    return meta


# -------------------------------------------------------------------------- signals
class GracefulStop:
    """Context manager: SIGINT/SIGTERM set ``requested`` instead of killing the process.

    The training loop checks ``requested`` after each step, saves a checkpoint and exits 0.
    A second signal restores the default behaviour (so a second Ctrl-C interrupts at once).

    Args:
        signals: the signals to catch.
        notice: printed to stderr on the first signal (``{name}`` becomes e.g. ``SIGINT``), so that a
            user who sees nothing happen for a long step does not press Ctrl-C again and lose the
            checkpoint the first one asked for; None: silent.
    """

    def __init__(self, signals=(signal.SIGINT, signal.SIGTERM), notice: str | None = None):
        self.signals = signals
        self.notice = notice
        self.requested: int | None = None
        self._previous = {}

    def _handle(self, signum, frame):  # noqa: ARG002 - signal API
        if self.requested is not None:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.requested = signum
        if self.notice:
            print(self.notice.format(name=signal.Signals(signum).name), file=sys.stderr, flush=True)

    def __enter__(self) -> "GracefulStop":
        for s in self.signals:
            try:
                self._previous[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def take_over(self, previous: dict, pending: int | None = None) -> None:
        """Continue from an earlier handler of the same signals (inside the ``with``): on exit restore ``previous``
        (signal -> the handler from before the earlier one) instead of that handler, and act on a signal it
        recorded but did not act on (``pending``) as on one received now."""
        self._previous.update({s: h for s, h in previous.items() if s in self._previous})
        if pending is not None:
            self._handle(pending, None)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
