"""Durable writes into a run directory: a crash leaves the old file or the new one, never a mix.

    <name>.tmp  <- written, flushed, fsynced
    rename <name>.tmp -> <name>, then fsync the directory (so the rename itself survives power loss)

On any failure the temp file is removed; an OS error (ENOSPC: "No space left on device", EIO, EACCES)
is raised as `WriteError`, one line naming the file and the OS's reason. A process killed mid-write
leaves only `<name>.tmp`, which `remove_orphans` deletes when the run starts or resumes (under the run
lock, so never a live writer's file).
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import BinaryIO, Callable

TMP_SUFFIX = ".tmp"


class WriteError(OSError):
    """A durable write failed: the target file is unchanged and the temp file removed."""


class _HashingSink:
    """A write-only file wrapper that hashes and counts what goes through it and remembers the first
    OSError (torch.save reports a failed write as a RuntimeError of its zip writer, not as the OSError)."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        self.file.flush()


def write_durably(path: str | Path, write: Callable[[BinaryIO], object]) -> tuple[int, str]:
    """Write `path` through `write(file)` (a binary file-like object with write/flush), durably and
    atomically; return (size in bytes, sha256 hex digest) of what was written."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    sink = None
    try:
        with open(tmp, "wb") as file:
            sink = _HashingSink(file)
            write(sink)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        cause = sink.error if sink is not None and sink.error is not None else err
        if isinstance(cause, OSError):
            raise write_error(path, cause) from cause
        raise
    return sink.size, sink.sha256.hexdigest()


def write_error(path: Path, cause: OSError) -> WriteError:
    """`WriteError` for `path`: the OS's reason and errno name in one line."""
    name = errno.errorcode.get(cause.errno, "") if cause.errno is not None else ""
    reason = cause.strerror or str(cause)
    error = WriteError(f"could not write {path}: {reason}" + (f" ({name})" if name else ""))
    error.errno = cause.errno
    return error


def fsync_dir(folder: str | Path) -> None:
    """fsync a directory, so renames and creations in it are on disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """fsync an existing file (its appended lines reach the disk); a missing file is left alone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_orphans(*folders: str | Path) -> list[Path]:
    """Delete the `*.tmp` files in `folders` (left by a process killed mid-write); return their paths."""
    removed = []
    for folder in map(Path, folders):
        if folder.is_dir():
            for path in sorted(folder.glob("*" + TMP_SUFFIX)):
                if path.is_file():
                    path.unlink()
                    removed.append(path)
    return removed
