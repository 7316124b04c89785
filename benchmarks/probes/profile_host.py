"""Host time of one sparse MLP call, piece by piece, on the GPU machine.

Not part of the package (`python3 benchmarks/probes/profile_host.py > $OUT/host.txt`). At M = 1 the GPU
work is a few µs, so the time to enqueue a call is what the host spends on it: Python, torch
dispatch, Triton's launcher. Each row is the mean over 300 back-to-back calls (µs); the last part
is a cProfile of sparse_mlp (inference), then of one training step at M = 4096. First, an A/B of
kernels/launch.py's direct launches against Triton's own launch path.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.kernels.dense_rows_mlp import dense_rows_mlp
from sparseffn.kernels.gate_twell import gate_twell
from sparseffn.kernels.launch import Launcher
from sparseffn.kernels.twell_up_down import twell_up_down
from sparseffn.ops.sparse_mlp import _twell_mlp_op, sparse_mlp
from sparseffn.ops.twell_mlp import SparseMLPWeights, dense_mlp, twell_mlp


@triton.jit
def _noop(x_ptr, n, BLOCK: tl.constexpr):
    pass


def host_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / n


def inference_pieces() -> None:
    mlp = synthetic_mlp(1, 2048, 5632, 29, device="cuda", seed=0)
    x, gate, up, down = mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight
    w = SparseMLPWeights.prepare(gate, up, down)
    values, columns, counts = gate_twell(x, gate)
    y = torch.empty_like(x)
    overflow = (counts > 32).any(1)
    rows = {
        "torch.empty": lambda: torch.empty(1, 2048, dtype=torch.bfloat16, device="cuda"),
        "F.linear": lambda: F.linear(x, gate),
        "dense_mlp (3 F.linear)": lambda: dense_mlp(x, gate, up, down, None),
        "triton no-op launch": lambda: _noop[(1,)](x, 1, BLOCK=16),
        "gate_twell": lambda: gate_twell(x, gate),
        "twell_up_down": lambda: twell_up_down(x, values, columns, counts, w.up_weight, w.down_t, tile=256, out=y),
        "(counts > slots).any(1)": lambda: (counts > 32).any(1),
        "dense_rows_mlp": lambda: dense_rows_mlp(x, overflow, gate, w.up_weight, w.down_t, None, y),
        "twell_mlp (op body)": lambda: twell_mlp(x, w),
        "sparseffn::twell_mlp op": lambda: _twell_mlp_op(x, gate, up, down, w.down_t, None, 256, 32),
        "sparse_mlp(mode=sparse)": lambda: sparse_mlp(x, gate, up, down, mode="sparse", prepared=w),
        "sparse_mlp(mode=auto): dense": lambda: sparse_mlp(x, gate, up, down, mode="auto", prepared=w,
                                                           expected_nnz=29.0),
    }
    print("host µs per call at M=1:")
    for name, fn in rows.items():
        print(f"  {name:26s} {host_us(fn):7.1f}", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        sparse_mlp(x, gate, up, down, mode="sparse", prepared=w)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(20)


def _mlp_calls(m: int):
    """(sparse training step, dense training step, sparse inference call) on one synthetic MLP of M
    tokens (D = 2048, H = 5632, nnz 29)."""
    mlp = synthetic_mlp(m, 2048, 5632, 29, device="cuda", seed=0)
    params = [t.detach().clone().requires_grad_() for t in (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)]
    dy, one = torch.randn_like(mlp.x), torch.ones((), device="cuda")
    w = SparseMLPWeights.prepare(mlp.gate_weight, mlp.up_weight, mlp.down_weight)

    def step():
        y, l1 = sparse_mlp(*params, mode="sparse", return_l1=True)
        return torch.autograd.grad([y, l1], params, [dy, one])

    def dense_step():
        y, l1 = dense_mlp(*params, None, return_l1=True)
        return torch.autograd.grad([y, l1], params, [dy, one])

    def infer():
        return sparse_mlp(mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight, mode="sparse", prepared=w)

    return step, dense_step, infer


def training_step() -> None:
    step, dense_step, _ = _mlp_calls(4096)
    print(f"training step at M=4096, host µs: sparse {host_us(step, 50):.0f}, dense {host_us(dense_step, 50):.0f}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20):
        step()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(20)


def launcher_ab(rounds: int = 8) -> None:
    """kernels/launch.py's direct path against Triton's own launch path for every Launcher, in one
    process, alternated `rounds` times (the lent hosts drift by 10-20% within minutes): medians."""
    direct = Launcher.launch

    def through_triton(self, grid, args, meta):
        self.kernel[grid](*args, **meta)

    def wall_ms(fn, n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start) / n

    small_step, _, small_infer = _mlp_calls(16)
    big_step, _, big_infer = _mlp_calls(4096)
    rows = {"M=16 inference, host µs": lambda: host_us(small_infer, 300),
            "M=16 training step, host µs": lambda: host_us(small_step, 100),
            "M=4096 inference, wall ms": lambda: wall_ms(big_infer, 100),
            "M=4096 training step, wall ms": lambda: wall_ms(big_step, 40)}
    paths = {"triton": through_triton, "direct": direct}
    times = {(path, row): [] for path in paths for row in rows}
    try:
        for r in range(rounds + 1):  # round 0 warms both paths up
            for path, launch in paths.items():
                Launcher.launch = launch
                for row, fn in rows.items():
                    if r:
                        times[path, row].append(fn())
                    else:
                        fn()
    finally:
        Launcher.launch = direct
    print(f"Launcher A/B, medians of {rounds} alternations:")
    for row in rows:
        print(f"  {row:30s} " + "  ".join(f"{p} {statistics.median(times[p, row]):9.3f}" for p in paths))


def main() -> int:
    launcher_ab()
    inference_pieces()
    training_step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
