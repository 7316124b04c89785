"""metrics.jsonl: one JSON object per line ("kind", "step", values), appended while a run trains.

A crash or a full disk can cut the last line short; readers drop such a torn last line with a warning
(any other line that is not a JSON object is an error naming the line). Resume rewrites the file to
the rows up to its checkpoint's step with a durable write (temp, fsync, rename), so a kill during the
rewrite leaves the full old file. The loop fsyncs the file before each checkpoint, so the rows a
checkpoint covers reach the disk before the checkpoint does.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable

from sparseffn.train.durable import write_durably, write_error


def read_metrics(path: str | Path, warn: Callable[[str], None] | None = None) -> list[dict]:
    """The rows of a metrics.jsonl ([] when there is no file). A torn last line is dropped and reported
    through `warn` (default: warnings.warn)."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [(number, line) for number, line in enumerate(path.read_bytes().split(b"\n"), 1) if line.strip()]
    rows = []
    for index, (number, line) in enumerate(lines):
        try:
            row = json.loads(line.decode("utf-8"))
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not an object with a 'step'")
        except ValueError as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            if index < len(lines) - 1:
                raise ValueError(f"{path}, line {number}: not a metrics row ({err}); only a torn last line "
                                 "is dropped") from err
            message = f"dropped the torn last line of {path} (line {number}, {len(line)} bytes: {err})"
            (warn or _warn)(message)
            continue
        rows.append(row)
    return rows


def truncate_metrics(path: str | Path, step: int, warn: Callable[[str], None] | None = None) -> None:
    """Keep the rows with step <= `step` (resume discards what a killed run wrote after its checkpoint),
    atomically: a kill during the rewrite leaves the old file whole."""
    rows = [r for r in read_metrics(path, warn) if r["step"] <= step]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    write_durably(path, lambda f: f.write(data))


def append_row(path: str | Path, row: dict) -> None:
    """Append one row (an OS error, such as a full disk, names the file)."""
    path = Path(path)
    try:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as err:
        raise write_error(path, err) from err


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
