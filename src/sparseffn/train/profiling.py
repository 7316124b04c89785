"""`StepProfiler`: where a training run's step time goes, measured on chosen steps of the run itself.

`--profile-steps A-B` runs optimizer steps A through B (1-based, as the metrics count them) under
torch.profiler and writes `profile.txt` to the run directory: wall time and device-kernel time per
step, the kernels grouped (sparseffn's Triton kernels, Inductor's, GEMMs, attention, optimizer, the rest) and the
kernels that took the most time. Measuring the run itself, not a synthetic model, shows the cost of its
real activity (skewed units, overflowing rows, layers still dense). The profiled steps run a little
slower than others (the profiler's own work): their logging window's tokens/s reads low.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


def parse_steps(spec: str) -> tuple[int, int] | None:
    """(first, last) optimizer steps of "A-B" (1-based, A <= B), None for ""; ValueError naming the flag."""
    if spec == "":
        return None
    parts = spec.split("-")
    try:
        first, last = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--profile-steps must read A-B (two step numbers), got {spec!r}") from None
    if not 1 <= first <= last:
        raise ValueError(f"--profile-steps A-B needs 1 <= A <= B, got {spec!r}")
    return first, last


def kernel_group(name: str) -> str:
    """A device kernel's group, by its name."""
    k = name.lower()
    if "adam" in k or "multi_tensor" in k:
        return "optimizer"
    if "gemm" in k or "xmma" in k or "cutlass" in k or "nvjet" in k:
        return "GEMM (cuBLAS)"
    if "flash" in k or "fmha" in k or "sdpa" in k or "attention" in k:
        return "attention"
    if k.startswith("triton_"):  # Inductor's generated kernels (triton_poi_fused_..., triton_red_...)
        return "torch.compile (Inductor)"
    if not k.startswith("void") and k.endswith("_kernel"):  # Triton names kernels after their functions
        return "Triton (sparseffn)"
    return "elementwise and other"


class StepProfiler:
    """Profiles optimizer steps first..last of a run (module docstring). `before(step)` at the start of
    0-based step `step`, `after(done)` once optimizer step `done` (1-based) has ended, outside the timed
    window: it writes the report into `directory` (`profile.txt`) after the last profiled step. Steps past the
    run's end are not profiled."""

    def __init__(self, steps: tuple[int, int], device: torch.device) -> None:
        self.first, self.last = steps
        self.device = device
        self._profiler = None
        self._started = 0.0

    def before(self, step: int) -> None:
        if step + 1 != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()
        self._started = time.perf_counter()

    def close(self) -> None:
        """Stop without a report (the run ended early)."""
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None

    def after(self, done: int, directory: Path, final: bool = False) -> Path | None:
        """Stops and reports after the last profiled step (or at the run's last step, `final`); the report's
        path then, else None."""
        if self._profiler is None or (done < self.last and not final):
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._started
        self._profiler.__exit__(None, None, None)
        steps = done - self.first + 1
        text = report(self._profiler.key_averages(), steps, wall, f"optimizer steps {self.first}-{done}")
        self._profiler = None
        path = directory / "profile.txt"
        path.write_text(text)
        return path


def report(events, steps: int, wall_s: float, title: str, top: int = 30) -> str:
    """The profile as text: per step, the wall time, the device-kernel time by group and the top kernels."""
    # device-side ranges of host annotations (e.g. "Optimizer.step#AdamW.step") span kernels counted on their
    # own: a name the host also recorded is not a kernel
    host = {e.key for e in events if e.device_type.name == "CPU"}
    kernels = [(e.key, e.self_device_time_total, e.count) for e in events
               if e.device_type.name != "CPU" and e.self_device_time_total > 0 and e.key not in host]
    what = "device kernels"
    if not kernels:  # a CPU run: the operators' own CPU time
        kernels = [(e.key, e.self_cpu_time_total, e.count) for e in events if e.self_cpu_time_total > 0]
        what = "CPU operators (self time)"
    per_step = [(key, us / steps / 1e3, count / steps) for key, us, count in kernels]  # ms per step
    total = sum(ms for _, ms, _ in per_step)
    lines = [f"{title}: wall {1e3 * wall_s / steps:.2f} ms per step, {what} {total:.2f} ms per step "
             f"({steps} steps)"]
    if what == "device kernels":
        groups: dict[str, float] = {}
        for key, ms, _ in per_step:
            groups[kernel_group(key)] = groups.get(kernel_group(key), 0.0) + ms
        lines += ["", "group | ms per step | share", "---|---|---"]
        lines += [f"{g} | {t:.2f} | {100 * t / total:.1f}%" for g, t in sorted(groups.items(), key=lambda kv: -kv[1])]
    lines += ["", "name | ms per step | calls per step", "---|---|---"]
    lines += [f"{key[:120]} | {ms:.3f} | {count:g}" for key, ms, count in sorted(per_step, key=lambda r: -r[1])[:top]]
    return "\n".join(lines) + "\n"
