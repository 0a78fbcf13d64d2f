"""The lock ``oomb train`` holds on its output folder for its whole life: a second run into the folder is refused
before it changes anything there."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .errors import UsageError

__all__ = ["LOCK_NAME", "OutputLock", "is_writing_process", "live_holder"]

LOCK_NAME = ".oomb-lock"
"""The lock file's name in the output folder (it holds the holder's pid, host and command as JSON)."""


def is_writing_process() -> bool:
    """Whether this process writes the output folder: the only process, or rank 0 of torchrun (its RANK, read as
    :func:`oomb.distributed.init_from_env` reads it). The other ranks write only into the checkpoint folder rank 0
    makes for a sharded checkpoint, inside the output folder rank 0 holds locked."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    return int(os.environ.get("RANK", "0")) == 0


class OutputLock:
    """An exclusive advisory lock (``fcntl.flock``) on ``out/.oomb-lock``, held by the ``oomb train`` that writes
    ``out`` from before it checks what ``out`` holds until it ends.

    A second run into ``out`` is refused (:class:`UsageError`) before it changes anything there, and the debris a
    run removes (``.tmp-step-*`` folders in checkpoints/, ``.oomb-save-*`` folders, what --overwrite replaces) is
    never what another live run is writing. The file holds the holder's pid, host and command (JSON), which the
    refusal names. The kernel drops the lock when its process ends, however it ends, so a file left by a killed run
    does not block: the next run takes it over. :meth:`release` deletes the file, and the folders :meth:`acquire`
    made for it where they are still empty (a refused run leaves no output folder behind).

    Without ``fcntl`` (Windows) nothing is locked; on a file system that refuses ``flock`` nothing is locked and a
    note says so.
    """

    def __init__(self, out: Path, name: str, given: str, command: str) -> None:
        """``out``: the output folder (absolute); ``name``, ``given``: how the user gave it (the flag, its value);
        ``command``: this run's command line, written into the file for a refusal to show."""
        self.out, self.name, self.given, self.command = out, name, given, command
        self.fd: int | None = None
        self.made: list[Path] = []

    def acquire(self) -> None:
        """Take the lock, creating ``out`` (and its missing parent folders) for its file.

        Raises:
            UsageError: another process holds it; nothing in ``out`` was changed.
        """
        try:
            import fcntl
        except ImportError:  # Windows
            return
        path = self.out / LOCK_NAME
        for _ in range(100):
            try:
                self._make_folders()
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
                except PermissionError:  # another user's file: it can be locked read-only, and replaced
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except FileNotFoundError:  # the folder went (a refused run that made it released it): make it again
                continue
            except OSError as exc:
                self._unlockable(exc)
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _lock_holder(fd)
                os.close(fd)
                self.release()
                raise self._refusal(holder) from None
            except OSError as exc:
                _remove_if_empty(fd, path)  # the file just made for the lock: no use unlocked
                os.close(fd)
                self._unlockable(exc)
                return
            # The holder deletes the file as it releases it: the lock just taken may be on a file that is no longer
            # the folder's, which another process may have created and locked since. Then take that one.
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
            except OSError:
                current = False
            if current and _writable_fd(fd):
                self.fd = fd
                self._write_holder()
                return
            if current:  # locked, but read-only (another user's file left by a dead run): replaced by one of ours
                try:
                    os.unlink(path)
                except OSError:  # held as it is, without this run's details
                    self.fd = fd
                    return
            os.close(fd)
        self._unlockable(OSError(0, "its lock file kept changing"))

    def release(self) -> None:
        """Delete the file and drop the lock (in that order: a process that opened the file meanwhile finds its lock
        on a deleted file, and takes the folder's new one), then delete the folders :meth:`acquire` made that are
        empty. Nothing where the lock was not taken."""
        if self.fd is not None:
            path = self.out / LOCK_NAME
            try:
                if os.path.samestat(os.fstat(self.fd), os.stat(path, follow_symlinks=False)):
                    os.unlink(path)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
        for folder in reversed(self.made):
            try:
                os.rmdir(folder)
            except OSError:
                break
        self.made = []

    def _make_folders(self) -> None:
        """Create ``out`` and its missing parents, remembering those made here (:meth:`release` removes them)."""
        missing = []
        folder = self.out
        while not folder.is_dir() and folder.parent != folder:
            missing.append(folder)
            folder = folder.parent
        for folder in reversed(missing):
            try:
                os.mkdir(folder)
                self.made.append(folder)
            except FileExistsError:
                pass

    def _write_holder(self) -> None:
        import socket
        import time

        holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, (json.dumps(holder) + "\n").encode(), 0)
        except OSError:  # a full disk: the lock holds, a refusal names no pid
            pass

    def _refusal(self, holder: dict) -> UsageError:
        import socket

        pid = holder.get("pid")
        if not (isinstance(pid, int) and pid > 0):
            return UsageError(f"{self.name} {self.given!r} is being written by another process (it holds "
                              f"{str(self.out / LOCK_NAME)!r}, which names no pid yet)",
                              "wait for that run to end or stop it, or pass another --output-dir")
        host = holder.get("host")
        where = f" on {host}" if isinstance(host, str) and host and host != socket.gethostname() else ""
        command = holder.get("command")
        shown = ""
        if isinstance(command, str) and command.strip():
            command = " ".join(command.split())
            shown = f": {command if len(command) <= 160 else command[:157] + '...'}"
        return UsageError(f"{self.name} {self.given!r} is being written by another oomb train "
                          f"(pid {pid}{where}{shown})",
                          f"wait for it to end or stop it (kill {pid}{where}), or pass another --output-dir")

    def _unlockable(self, exc: OSError) -> None:
        self.fd = None
        print(f"oomb: note: {self.out} cannot be locked ({exc.strerror or exc}): a second oomb train into it would "
              "not be refused while this one runs", file=sys.stderr)


def live_holder(out: Path) -> dict | None:
    """What the holder of the lock on ``out``'s lock file wrote into it (pid, host, command; {} where they cannot
    be read) where a live process holds that lock; None where there is no lock file or no process holds it (a file
    left by a run that was killed), or where that cannot be told (no ``fcntl``, a file that cannot be opened, a
    file system that refuses ``flock``)."""
    try:
        import fcntl
    except ImportError:  # Windows
        return None
    try:
        fd = os.open(out / LOCK_NAME, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _lock_holder(fd)
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _remove_if_empty(fd: int, path: Path) -> None:
    """Delete ``path``, the file open as ``fd``, where it is empty (no holder ever wrote into it)."""
    try:
        if os.fstat(fd).st_size == 0 and os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
            os.unlink(path)
    except OSError:
        pass


def _writable_fd(fd: int) -> bool:
    """Whether ``fd`` was opened for writing."""
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY


def _lock_holder(fd: int) -> dict:
    """The details the holder of a lock file (open as ``fd``) wrote into it: pid, host, command; {} where they
    cannot be read. A holder that has just taken the lock writes them at once: an empty file is read again for up
    to a second."""
    import time

    for _ in range(20):
        try:
            text = os.pread(fd, 1 << 16, 0)
        except OSError:
            return {}
        if text.strip():
            try:
                holder = json.loads(text)
            except ValueError:
                return {}
            return holder if isinstance(holder, dict) else {}
        time.sleep(0.05)
    return {}
