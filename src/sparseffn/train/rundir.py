"""A new run is built beside the old one and moved in at its first checkpoint, so a failing start
never destroys or half-makes a run.

    <run>/run.lock          the run lock (runlock.py), held throughout
    <run>/.staging/         the new run (config.json, tokenizer.json, run.json, metrics.jsonl, checkpoints/)
                            until its first checkpoint; then it is published:
      1. the old run's entries (RUN_FILES) move into .staging/.replaced/     (renames: bytes untouched)
      2. .staging is renamed .publishing                                      the commit point
      3. each new entry moves from .publishing into <run>, checkpoints/ last
      4. .publishing (with the old run in .replaced/) is deleted

A command that fails before step 2 deletes .staging and leaves the old run as it was, byte for byte
(and, when it created <run> itself, <run> too). A process killed at any point leaves state that
`recover`, run under the lock at the next start or resume, completes: .publishing present means the
commit happened (finish steps 3-4); .staging alone means it did not (move .replaced's entries back,
delete .staging). Every rename is within one directory tree, so atomic on a local file system.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sparseffn.train.durable import fsync_dir

# The entries of a run directory that belong to a run (run.lock is the directory's, not the run's).
RUN_FILES = ("config.json", "run.json", "tokenizer.json", "metrics.jsonl", "checkpoints", "model", "plots", "eval")
STAGING = ".staging"
PUBLISHING = ".publishing"
REPLACED = ".replaced"


def existing_run_files(out: Path) -> list[str]:
    """The RUN_FILES entries present in `out`."""
    return [name for name in RUN_FILES if (out / name).exists()]


def new_staging(out: Path) -> Path:
    """An empty `out/.staging` for a new run (`recover` has removed any earlier one)."""
    staging = out / STAGING
    staging.mkdir(parents=True)
    return staging


def publish(out: Path, staging: Path) -> None:
    """Move the run built in `staging` into `out`, replacing the run there (steps 1-4 above)."""
    old = existing_run_files(out)
    if old:
        replaced = staging / REPLACED
        replaced.mkdir()
        for name in old:
            os.rename(out / name, replaced / name)
        fsync_dir(replaced)
    committed = out / PUBLISHING
    os.rename(staging, committed)
    fsync_dir(out)
    _finish(out, committed)


def _finish(out: Path, committed: Path) -> None:
    names = sorted((p.name for p in committed.iterdir() if p.name != REPLACED), key=lambda n: n == "checkpoints")
    for name in names:
        os.rename(committed / name, out / name)
    fsync_dir(out)
    shutil.rmtree(committed)


def abandon(staging: Path) -> None:
    """Delete a new run that never reached its first checkpoint (the old run, if any, was not touched)."""
    shutil.rmtree(staging)


def recover(out: Path) -> list[str]:
    """Complete what a process killed while starting or publishing a run left in `out` (module
    docstring); return one line per repair. Call under the run lock."""
    notes = []
    committed, staging = out / PUBLISHING, out / STAGING
    if committed.is_dir():
        _finish(out, committed)
        notes.append(f"finished moving the new run into {out} (its process stopped while publishing it)")
    if staging.is_dir():
        replaced = staging / REPLACED
        if replaced.is_dir():
            for path in sorted(replaced.iterdir()):
                if (out / path.name).exists():  # cannot happen before the commit; never delete either copy
                    raise FileExistsError(f"{out}: both {path} and {out / path.name} exist; move one away by hand")
                os.rename(path, out / path.name)
            fsync_dir(out)
        shutil.rmtree(staging)
        notes.append(f"removed {staging}: a run started there stopped before its first checkpoint")
    return notes
