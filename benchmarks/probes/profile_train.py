"""Kernel-level profile of one MLP training step (sparse and dense) on the GPU, and its host cost.

Usage: python benchmarks/probes/profile_train.py [M] [D] [H] [nnz]. Prints the CUDA kernels sorted by time
and the wall time of a step (host launch overhead shows as wall time above the GPU time), then the
sparse step's host time per launcher (each step synchronised first, so it is the launch work alone)
and the CPU-side ops by self time. (cProfile misattributes time under the custom ops' dynamo-disabled
frames to torch's backend_impl; the per-launcher wrappers below do not.)
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import sparseffn.ops.train_mlp as train_mlp
from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.ops.sparse_mlp import sparse_mlp
from sparseffn.ops.twell_mlp import dense_mlp

m, d, h, nnz = (int(v) for v in (sys.argv[1:] + ["16384", "2048", "5632", "29"][len(sys.argv) - 1:]))
mlp = synthetic_mlp(m, d, h, nnz, device="cuda")
params = [t.detach().clone().requires_grad_() for t in (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)]
dy = torch.randn(m, d, device="cuda", dtype=mlp.x.dtype)
one = torch.ones((), device="cuda")


def step(fn):
    y, l1 = fn(*params)
    return torch.autograd.grad([y, l1], params, [dy, one])


providers = {
    "sparse": lambda x, g, u, dn: sparse_mlp(x, g, u, dn, mode="sparse", return_l1=True),
    "dense": lambda x, g, u, dn: dense_mlp(x, g, u, dn, None, return_l1=True),
}
for name, fn in providers.items():
    for _ in range(3):
        step(fn)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        step(fn)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"{name}: host launch {1e3 * (t1 - t0) / 10:.3f} ms/step, wall {1e3 * (t2 - t0) / 10:.3f} ms/step")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step(fn)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))

# own host time of each launcher the training op calls (wrapped where train_mlp looks them up)

spent: dict[str, float] = {}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    return wrapper


for name in ("gate_twell", "twell_train_forward", "launch_dense_rows", "twell_train_backward", "launch_slots_by_unit",
             "launch_unit_weight_grads", "launch_dense_rows_backward", "sparse_mlp_train_fwd", "sparse_mlp_train_bwd"):
    setattr(train_mlp, name, timed(name, getattr(train_mlp, name)))
step(providers["sparse"])
spent.clear()
for _ in range(20):
    step(providers["sparse"])
    torch.cuda.synchronize()
for name, t in sorted(spent.items(), key=lambda kv: -kv[1]):
    print(f"  {name:28s} {1e3 * t / 20:7.3f} ms/step host")
with profile(activities=[ProfilerActivity.CPU]) as tprof:
    for _ in range(5):
        step(providers["sparse"])
        torch.cuda.synchronize()
print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))
