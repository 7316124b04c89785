"""The gate kernel's portable path (bf16 compared as fp32, no TMA: what GPUs before Hopper run)
forced on the H200 beside its native path and cuBLAS + ReLU, same inputs: the cost of portability.

    python benchmarks/probes/portable_gate.py
"""

import torch
import torch.nn.functional as F

from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.bench.timing import median_timing, time_fn
from sparseffn.kernels.gate_twell import gate_twell


def main() -> None:
    device = torch.device("cuda")
    for m in (4096, 16384, 65536):
        mlp = synthetic_mlp(m, 2048, 5632, 29, device=device, seed=0)
        calls = {"cublas+relu": lambda: torch.relu(F.linear(mlp.x, mlp.gate_weight)),
                 "native (sm_90)": lambda: gate_twell(mlp.x, mlp.gate_weight)}
        for arch in ((8, 0), (8, 6), (8, 9)):
            calls[f"portable sm_{arch[0]}{arch[1]}"] = lambda a=arch: gate_twell(mlp.x, mlp.gate_weight, arch=a)
        ref = gate_twell(mlp.x, mlp.gate_weight)
        for name, fn in calls.items():
            if name.startswith("portable"):
                got = fn()
                assert torch.equal(got[2], ref[2]), name  # the same counts per (row, tile)
        t = {name: median_timing([time_fn(fn, device, rep_ms=100) for _ in range(3)]).median_ms
             for name, fn in calls.items()}
        base = t["native (sm_90)"]
        print(f"M={m}: " + ", ".join(f"{name} {ms:.3f} ms ({ms / base:.2f}x native)" for name, ms in t.items()))
        del mlp


if __name__ == "__main__":
    main()
