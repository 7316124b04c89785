"""Time `unit_weight_grads` under several launch configs and program orders, and `slots_by_unit` at
several warp counts, on the inputs of one real training step.

Not part of the package: `python3 benchmarks/probes/sweep_unit_grads.py [M] [GIT_SHA]` on the GPU machine.
The inputs (x, dy, the unit-major CSR with its coefficients; columns, counts and the per-slot
coefficients) are captured from one sparse training step of the synthetic D = 2048 / H = 5632 MLP at
mean nnz 29; each config is checked against the first one (max relative difference of the three
gradients; equal offsets) and timed with triton's do_bench (L2 flushed between runs).
"""

import itertools
import sys

import torch
import triton

import sparseffn.ops.train_mlp as train_mlp
from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.kernels import unit_grads
from sparseffn.kernels.unit_grads import UnitGradsConfig, launch_slots_by_unit, launch_unit_weight_grads
from sparseffn.ops.sparse_mlp import sparse_mlp

m = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
sha = sys.argv[2] if len(sys.argv) > 2 else "unknown"
mlp = synthetic_mlp(m, 2048, 5632, 29, device="cuda")
params = [t.detach().clone().requires_grad_() for t in (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)]
dy = torch.randn(m, 2048, device="cuda", dtype=mlp.x.dtype)
captured = {}


def capture(*args, **kwargs):
    captured["args"], captured["kwargs"] = args, kwargs
    return launch_unit_weight_grads(*args, **kwargs)


def capture_slots(*args, **kwargs):
    captured["slots"] = args, kwargs
    return launch_slots_by_unit(*args, **kwargs)


train_mlp.launch_unit_weight_grads, train_mlp.launch_slots_by_unit = capture, capture_slots
y, l1 = sparse_mlp(*params, mode="sparse", return_l1=True)
torch.autograd.grad([y, l1], params, [dy, torch.ones((), device="cuda")])
args, kwargs = captured["args"], captured["kwargs"]
outs = [kwargs["grad_gate_out"], kwargs["grad_up_out"], kwargs["grad_down_t_out"]]

def C(**fields):  # every field spelled out (defaults change)
    return UnitGradsConfig(**{"block_e": 8, "block_d": 1024, "num_warps": 4, "num_stages": 1, "units_per_program": 4,
                              "max_regs": None, **fields})


configs = [
    C(), C(block_e=4), C(block_e=16), C(block_d=2048, num_warps=8), C(block_d=2048, num_warps=8, block_e=4),
    C(num_stages=2), C(units_per_program=8), C(units_per_program=16),
    C(block_d=512, num_warps=2), C(block_d=256, num_warps=1),
    # warps left over for the entries: the sums over a step cross warps
    C(num_warps=8), C(block_d=512),
]
print(f"{torch.cuda.get_device_name()}, git {sha}, M = {m}, D = 2048, H = 5632, nnz 29; do_bench median")
base = None
for config in configs:
    def run(config=config):
        launch_unit_weight_grads(*args, **{**kwargs, "config": config})
    run()
    torch.cuda.synchronize()
    result = [o.clone() for o in outs]
    base = base or result
    diff = max(((r - b).abs().max() / b.abs().max()).item() for r, b in zip(result, base))
    print(f"{1e3 * triton.testing.do_bench(run, warmup=5, rep=60):8.1f} us  diff {diff:.1e}  {config}", flush=True)

slot_args, slot_kwargs = captured["slots"]
want = launch_slots_by_unit(*slot_args, **slot_kwargs).offsets
for warps in (4, 2, 1):
    unit_grads._SLOT_WARPS = warps
    same = torch.equal(launch_slots_by_unit(*slot_args, **slot_kwargs).offsets, want)
    ms = triton.testing.do_bench(lambda: launch_slots_by_unit(*slot_args, **slot_kwargs), warmup=5, rep=60)
    print(f"slots_by_unit on {warps} warps: {1e3 * ms:7.1f} us (the whole call), offsets equal {same}", flush=True)

# the program order: slots_by_unit's against an exact stable argsort of the counts and against plain
# unit ids, at 8 and 4 units per program
by_unit = args[2]
counts = by_unit.offsets[1:] - by_unit.offsets[:-1]
orders = {"slots_by_unit": by_unit.order,
          "exact argsort": torch.argsort(counts, descending=True, stable=True).to(torch.int32),
          "unit ids": torch.arange(counts.numel(), dtype=torch.int32, device=counts.device)}
for (name, order), units in itertools.product(orders.items(), (8, 4)):
    def run(order=order, units=units):
        launch_unit_weight_grads(args[0], args[1], by_unit._replace(order=order), *args[3:],
                                 **{**kwargs, "config": C(units_per_program=units)})
    print(f"{1e3 * triton.testing.do_bench(run, warmup=5, rep=60):8.1f} us  order: {name}, {units} units per program",
          flush=True)
