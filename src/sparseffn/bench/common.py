"""Small pieces every benchmark shares: list flags, the relative error, the long-format CSV, figures, runs in a
fresh process."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Callable

import torch


def ints(text: str) -> list[int]:
    """'1,16,256' -> [1, 16, 256]."""
    return [int(v) for v in text.split(",") if v.strip()]


def shapes(text: str) -> list[tuple[int, int]]:
    """'2048x5632,4096x14336' -> [(2048, 5632), (4096, 14336)] (D x H)."""
    out = []
    for item in text.split(","):
        if item.strip():
            d, _, h = item.strip().partition("x")
            out.append((int(d), int(h)))
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp32."""
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def write_csv(rows: list[dict], path: Path, fields: tuple[str, ...]) -> Path:
    """Rewrite the whole CSV (called after every case, so a run cut short keeps what it measured)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def pyplot():
    """matplotlib.pyplot on the headless Agg backend (imported on first use: an optional extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay out, write (creating the folder) and close a figure."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def run_in_own_process(code: str, what: str, log: Callable[[str], None], env: dict[str, str] | None = None) -> None:
    """Run Python `code` in a fresh interpreter that imports this very sparseffn; its output lines go to `log`.
    A failing run raises RuntimeError naming `what`, with the child's last line."""
    from sparseffn._child_env import child_env

    env = dict(env if env is not None else child_env(), PYTHONUNBUFFERED="1")
    tail: deque[str] = deque(maxlen=1)
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as proc:
        for line in proc.stdout:
            line = line.rstrip("\n")
            log(line)
            if line.strip():
                tail.append(line)
    if proc.returncode != 0:
        last = tail[-1] if tail else "no output"
        raise RuntimeError(f"{what} failed in its process (exit {proc.returncode}): {last}")
