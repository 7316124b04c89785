"""Fault injection for the training tests: an `open` whose chosen files fail part-way through a write.

`faulty_open(match, limit, fault)` returns a replacement for `open` / `io.open`: a file whose name and
mode satisfy `match(name, mode)` writes its first `limit` bytes (or characters), flushes them, then
calls `fault()`, which raises (a full disk) or kills the process (a crash mid-write).
"""

from __future__ import annotations

import errno
import io
import os
import signal
from typing import Callable

_real_open = io.open


def disk_full() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FaultyFile:
    def __init__(self, file, limit: int, fault: Callable[[], None]) -> None:
        self._file, self._room, self._fault = file, limit, fault

    def write(self, data):
        size = len(data) if isinstance(data, str) else memoryview(data).nbytes
        if size > self._room:
            head = data[: self._room] if isinstance(data, str) else memoryview(data).cast("B")[: self._room]
            self._file.write(head)
            self._file.flush()
            self._room = 0
            self._fault()
        self._room -= size
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def faulty_open(match: Callable[[str, str], bool], limit: int, fault: Callable[[], None]):
    def open_(file, mode="r", *args, **kwargs):
        handle = _real_open(file, mode, *args, **kwargs)
        name = os.path.basename(os.fsdecode(file)) if isinstance(file, (str, bytes, os.PathLike)) else ""
        return FaultyFile(handle, limit, fault) if match(name, mode) else handle

    return open_
