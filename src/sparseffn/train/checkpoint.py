"""Training checkpoints: one `torch.save` file per saved step, written atomically, newest K kept.

A checkpoint holds everything an exact resume needs: model and optimizer state, the lr scheduler,
the completed step, the RNG states (Python, NumPy, torch CPU and CUDA), the sampler's identity and
the dead-unit counters. Only plain containers and tensors go in, so it loads with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import torch

NAME = re.compile(r"^step_(\d+)\.pt$")


def checkpoint_path(folder: Path, step: int) -> Path:
    return Path(folder) / f"step_{step:08d}.pt"


def list_checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in `folder`, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(folder: str | Path) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1][1] if found else None


def save_checkpoint(payload: dict, folder: str | Path, step: int, keep: int) -> Path:
    """Write atomically (temporary file + rename), then delete all but the newest `keep`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(folder, step)
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    for _, old in list_checkpoints(folder)[:-keep]:
        old.unlink()
    return path


def load_checkpoint(path: str | Path) -> dict:
    return torch.load(Path(path), map_location="cpu", weights_only=True)


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
