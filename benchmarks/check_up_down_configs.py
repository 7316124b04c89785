"""Run every benchmark config of the fused up/down kernel on the GPU, each in its own process (a
faulting kernel poisons the CUDA context), check it against the eager reference and time it.

    python3 benchmarks/check_up_down_configs.py            # all configs, one line each
    python3 benchmarks/check_up_down_configs.py INDEX M    # one config (what each child runs)
"""

from __future__ import annotations

import subprocess
import sys

import torch


def one(index: int, m: int) -> None:
    from triton.testing import do_bench

    from sparseffn.bench.synthetic import synthetic_mlp
    from sparseffn.format import TwELL
    from sparseffn.kernels.gate_twell import gate_twell
    from sparseffn.kernels.twell_up_down import twell_up_down
    from sparseffn.kernels.configs.twell_up_down import benchmark_configs
    from sparseffn.ops.reference import twell_up_down_reference
    from sparseffn.ops.twell_mlp import SparseMLPWeights

    cfg = benchmark_configs(2048)[index]
    mlp = synthetic_mlp(m, 2048, 5632, 29, device="cuda", seed=0)
    w = SparseMLPWeights.prepare(mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    values, columns, counts = gate_twell(mlp.x, mlp.gate_weight)
    out = torch.zeros_like(mlp.x)
    twell_up_down(mlp.x, values, columns, counts, w.up_weight, w.down_t, tile=256, out=out, config=cfg)
    torch.cuda.synchronize()
    r = min(m, 4096)  # the eager reference gathers D floats per active unit: check a prefix of rows
    overflow = (counts[:r] > 32).any(1)
    packed = TwELL(values[:r], columns[:r], counts[:r], overflow.nonzero().flatten(),
                   torch.zeros(int(overflow.sum()), 5632, dtype=mlp.x.dtype, device="cuda"), 5632, 256, 32)
    ref = twell_up_down_reference(mlp.x[:r], packed, mlp.up_weight, mlp.down_weight).float()
    ok = ~overflow
    err = float((out[:r][ok].float() - ref[ok]).norm() / ref[ok].norm())
    t = do_bench(lambda: twell_up_down(mlp.x, values, columns, counts, w.up_weight, w.down_t, tile=256, out=out, config=cfg),
                 warmup=10, rep=60, return_mode="median")
    print(f"{index:2d} M={m:6d} {t:.3f} ms err {err:.1e} {'OK' if err < 1e-2 else 'WRONG'} {cfg}", flush=True)


def main() -> int:
    if len(sys.argv) == 3:
        one(int(sys.argv[1]), int(sys.argv[2]))
        return 0
    from sparseffn.kernels.configs.twell_up_down import benchmark_configs

    for m in (4096, 65536):
        for index in range(len(benchmark_configs(2048))):
            r = subprocess.run([sys.executable, __file__, str(index), str(m)], capture_output=True, text=True)
            line = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else \
                f"{index:2d} M={m:6d} FAILED: {(r.stderr.strip().splitlines() or ['?'])[-1][:160]}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
