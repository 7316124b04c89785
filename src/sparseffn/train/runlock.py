"""The run directory's lock: one training process (or one torchrun job) per run directory at a time.

An advisory `fcntl.flock` on `<run>/run.lock`, taken by rank 0 before the directory is checked or
cleared and held until `train` returns. While held, the file names its owner (pid, host, start time),
so a second `train` or `--resume` of the run refuses with one line naming them. The kernel drops a
flock when its owner dies, however it dies: a lock that can be taken while the file still names an
owner was left by a dead process, and is taken over with a warning. A clean exit empties the file
but never deletes it (deleting a lock file lets two processes each lock a different file of one name).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from sparseffn.train.distributed import DistInfo, broadcast_object

LOCK_NAME = "run.lock"


class RunInUseError(OSError):
    """The run directory is locked by a live training process."""


class RunLock:
    """An exclusive flock on `folder/run.lock`; `acquire` raises RunInUseError if another process holds it."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock and write this process into it; return the dead previous owner's description
        when a stale lock was taken over, else None."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _describe(_read(fd)) or "another process (starting up)"
            os.close(fd)
            raise RunInUseError(f"{self.path.parent} is in use by {owner}: wait for that run to end or stop it "
                                "(two processes training one run directory corrupt it)") from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the file may have been removed (by a run that made the folder and failed) since it was opened
            current = os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            current = False
        if not current:
            os.close(fd)
            raise RunInUseError(f"{self.path.parent} was being removed by another process as this one locked it: "
                                "try again")
        previous = _describe(_read(fd))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return previous

    def release(self, remove: bool = False) -> None:
        """Empty the file (no owner) and drop the lock; remove: delete the file first, while still
        holding it (`acquire` refuses a lock on a file that is no longer at its path)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if remove:
                self.path.unlink()
            else:
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the only descriptor drops the flock


def _read(fd: int) -> bytes:
    return os.pread(fd, 4096, 0)


def _describe(content: bytes) -> str | None:
    """'pid N on host H (since T)' from a lock file's content; None for an empty file."""
    if not content.strip():
        return None
    try:
        owner = json.loads(content)
        return f"pid {owner['pid']} on host {owner['host']} (since {owner['started']})"
    except (ValueError, KeyError, TypeError):
        return f"an owner the lock file does not name clearly ({content[:80]!r})"


@dataclass
class HeldLock:
    """What `hold_run_lock` yields: created, whether it made the folder; remove_folder, set by the
    body, removes the lock file and the folder (if then empty) on release, while the lock is held."""

    created: bool = False
    remove_folder: bool = False


@contextmanager
def hold_run_lock(folder: str | Path, info: DistInfo, *, create: bool,
                  echo: Callable[[str], None] | None) -> Iterator[HeldLock]:
    """Hold `folder`'s run lock for the body (rank 0 takes it; its errors reach every rank).

    create: make the folder if missing (a new run); otherwise a missing folder is an error (resume).
    echo: where rank 0 reports taking over a dead owner's lock (None = nowhere)."""
    folder = Path(folder)
    lock, error, held = None, None, HeldLock()
    if info.is_main:
        try:
            if not create and not folder.is_dir():
                raise FileNotFoundError(f"cannot resume: {folder} does not exist")
            held.created = not folder.exists()
            folder.mkdir(parents=True, exist_ok=True)
            lock = RunLock(folder)
            stale = lock.acquire()
            if stale is not None and echo is not None:
                echo(f"warning: took over the lock of {folder} left by {stale}, which is no longer running")
        except OSError as err:
            error = err
    error = broadcast_object(error, info)
    if error is not None:
        raise error
    try:
        yield held
    finally:
        if lock is not None:
            remove = held.remove_folder and held.created
            lock.release(remove=remove)
            if remove and not any(folder.iterdir()):
                folder.rmdir()
