"""Training checkpoints: one `torch.save` file per saved step, written durably, verified on load, newest K kept.

A checkpoint holds everything an exact resume needs: model and optimizer state, the lr scheduler,
the completed step, the RNG states (Python, NumPy, torch CPU and CUDA), the sampler's identity and
the dead-unit counters. Only plain containers and tensors go in, so it loads with
`torch.load(weights_only=True)`.

    checkpoints/step_00000020.pt        the payload (durable.write_durably: temp, fsync, rename, dir fsync)
    checkpoints/step_00000020.pt.json   its manifest: {"file", "step", "bytes", "sha256"}, written after it

`load_checkpoint` checks size and sha256 against the manifest before unpickling anything, so a
truncated file or flipped bits raise `CheckpointError` naming the file. A checkpoint without its
manifest (a crash between the two renames) is not trusted either. `newest_usable_checkpoint` walks
from the newest down and returns the first that verifies and loads, with what it skipped and why.
"""

from __future__ import annotations

import json
import pickle
import random
import re
from pathlib import Path

import torch

from sparseffn.models.saved_files import SavedFileError, file_sha256, read_json_object
from sparseffn.train.durable import write_durably

NAME = re.compile(r"^step_(\d+)\.pt$")
MANIFEST_SUFFIX = ".json"


class CheckpointError(SavedFileError):
    """A checkpoint that cannot be used (truncated, corrupted, unverifiable), or none usable to resume from."""


def checkpoint_path(folder: Path, step: int) -> Path:
    return Path(folder) / f"step_{step:08d}.pt"


def manifest_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + MANIFEST_SUFFIX)


def list_checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in `folder`, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.match(p.name))]
    return sorted(found)


def save_checkpoint(payload: dict, folder: str | Path, step: int, keep: int) -> Path:
    """Write the payload, then its manifest (both durably), then delete all but the newest `keep`.

    An OS error (a full disk) raises durable.WriteError naming the file; its temp file is removed and
    the checkpoints already on disk are left as they were."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(folder, step)
    size, digest = write_durably(path, lambda f: torch.save(payload, f))
    manifest = {"file": path.name, "step": step, "bytes": size, "sha256": digest}
    write_durably(manifest_path(path), lambda f: f.write(json.dumps(manifest, indent=1).encode() + b"\n"))
    for _, old in list_checkpoints(folder)[:-keep]:
        old.unlink()
        manifest_path(old).unlink(missing_ok=True)
    return path


def verify_checkpoint(path: str | Path) -> None:
    """Raise CheckpointError unless `path` has the size and sha256 its manifest records."""
    path = Path(path)
    manifest = manifest_path(path)
    if not manifest.is_file():
        raise CheckpointError(f"{path}: no manifest {manifest.name} beside it to verify it against")
    try:
        record = read_json_object(manifest)
        expected_size, expected_digest = int(record["bytes"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: its manifest {manifest.name} is unreadable ({err})") from err
    size = path.stat().st_size
    if size != expected_size:
        cut = "truncated" if size < expected_size else "longer than written"
        raise CheckpointError(f"{path}: {cut} ({size} bytes, its manifest records {expected_size})")
    digest = file_sha256(path)
    if digest != expected_digest:
        raise CheckpointError(f"{path}: corrupted (sha256 {digest[:16]}… differs from the "
                              f"{expected_digest[:16]}… its manifest records)")


def load_checkpoint(path: str | Path) -> dict:
    """The verified payload of a checkpoint file (CheckpointError if it does not verify or load)."""
    path = Path(path)
    verify_checkpoint(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as err:
        raise CheckpointError(f"{path}: verified but does not load ({type(err).__name__}: {err})") from err
    if not isinstance(payload, dict) or "step" not in payload:
        raise CheckpointError(f"{path}: not a training checkpoint (no 'step' entry)")
    return payload


def newest_usable_checkpoint(folder: str | Path) -> tuple[Path, dict, list[CheckpointError]]:
    """(path, payload, what was skipped) of the newest checkpoint in `folder` that verifies and loads.

    FileNotFoundError when there is none at all; CheckpointError naming each file and its fault when
    none is usable."""
    folder = Path(folder)
    found = list_checkpoints(folder)
    if not found:
        raise FileNotFoundError(f"cannot resume: no checkpoint under {folder}")
    skipped: list[CheckpointError] = []
    for _, path in reversed(found):
        try:
            return path, load_checkpoint(path), skipped
        except CheckpointError as err:
            skipped.append(err)
    raise CheckpointError(f"cannot resume: no usable checkpoint under {folder}: " + "; ".join(map(str, skipped)))


def rng_state() -> dict:
    import numpy as np

    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "python": [version, list(state), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    import numpy as np

    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
