"""Timing and run metadata shared by the benchmarks.

GPU: `triton.testing.do_bench` (CUDA events, L2 flushed before every repetition, so weights come
from HBM as they do inside a model whose other layers evicted them), median with p20/p80.
CPU: wall clock around each call; only for smoke tests of the harness, never reported as speed.
"""

from __future__ import annotations

import platform
import re
import subprocess
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25, rep_ms: float = 200) -> Timing:
    if device.type == "cuda":
        from triton.testing import do_bench

        median, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return Timing(median, p20, p80)
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append(1e3 * (time.perf_counter() - start))
    samples.sort()
    return Timing(samples[1], samples[0], samples[-1])


def median_timing(rounds: list[Timing]) -> Timing:
    """One Timing from several rounds of the same call: the median of each statistic."""
    if not rounds:
        raise ValueError("median_timing needs at least one round")

    def mid(values: list[float]) -> float:
        values = sorted(values)
        n = len(values)
        return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])

    return Timing(mid([t.median_ms for t in rounds]), mid([t.p20_ms for t in rounds]), mid([t.p80_ms for t in rounds]))


def cuda_graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """fn captured once in a CUDA graph; the returned callable replays it and returns the captured output.

    fn runs twice on a side stream first (Triton compiles, the caching allocator settles), as capture needs.
    Replaying costs one launch of host work, so a host-bound call shows its GPU time.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    return replay


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"


def device_slug(device: torch.device) -> str:
    """Folder name for results: 'NVIDIA H200' -> 'h200', CPU -> 'cpu'."""
    if device.type != "cuda":
        return "cpu"
    name = device_name(device).lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def git_sha(cwd: Path | None = None) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             cwd=cwd, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=cwd, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out + ("-dirty" if dirty else "")


def run_metadata(device: torch.device) -> dict[str, str]:
    """Columns every benchmark row carries."""
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = "none"
    return {
        "gpu": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "git_sha": git_sha(),
    }
