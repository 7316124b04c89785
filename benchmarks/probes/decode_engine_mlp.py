"""Is the decode engine's dense MLP the strongest dense baseline? (H200 probe, bench only.) The second
half of a decoder layer, x + MLP(RMSNorm(x)), at D=2048 / H=5632, 29 active units per token, M = 1, 4,
16 tokens, each provider captured in a CUDA graph (bench.timing.cuda_graphed, do_bench median):

    torch        our fused RMSNorm kernel + three F.linear (cuBLAS) + relu·up + residual add (down [D, H])
    dense_rows   ops.decode_block.decode_mlp_block, dense, down [D, H] (a dense Hugging Face MLP)
    dense_t      the same, down stored transposed (a SparseMLP in mode "dense")
    sparse       the same, sparse (a SparseMLP where auto mode takes the sparse path)

    python benchmarks/probes/decode_engine_mlp.py OUT_CSV
"""

import sys

import torch
import torch.nn.functional as F

from sparseffn.bench.common import rel_err, write_csv
from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.bench.timing import cuda_graphed, run_metadata, time_fn
from sparseffn.ops.decode_block import decode_mlp_block
from sparseffn.ops.fused_norm_rope import rms_norm

D, H, NNZ, EPS = 2048, 5632, 29.0, 1e-5


def main(out_csv: str) -> None:
    device = torch.device("cuda")
    meta = run_metadata(device)
    rows = []
    for m in (1, 4, 16):
        mlp = synthetic_mlp(m, D, H, NNZ, device=device)
        x, gate, up, down = mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight
        down_t = down.t().contiguous().t()  # SparseMLP's storage
        norm = torch.ones(D, dtype=x.dtype, device=device)

        def torch_chain():
            n = rms_norm(x, norm, EPS)
            return x + F.linear(torch.relu(F.linear(n, gate)) * F.linear(n, up), down)

        providers = {
            "torch": torch_chain,
            "dense_rows": lambda: decode_mlp_block(x, norm, EPS, gate, up, down, None),
            "dense_t": lambda: decode_mlp_block(x, norm, EPS, gate, up, down_t, None),
            "sparse": lambda: decode_mlp_block(x, norm, EPS, gate, up, down_t, None, sparse=True),
        }
        ref = torch_chain().float()
        line = [f"M={m:2d}"]
        for name, fn in providers.items():
            graphed = cuda_graphed(fn, device)
            err = rel_err(graphed(), ref)
            t = time_fn(graphed, device)
            rows.append(dict(meta, d=D, h=H, m=m, target_nnz=NNZ, provider=name, median_us=round(1e3 * t.median_ms, 2),
                             p20_us=round(1e3 * t.p20_ms, 2), p80_us=round(1e3 * t.p80_ms, 2), rel_err_vs_torch=f"{err:.2e}"))
            line.append(f"{name} {1e3 * t.median_ms:6.1f} us (err {err:.1e})")
        print("  ".join(line), flush=True)
    write_csv(rows, out_csv, tuple(rows[0]))


if __name__ == "__main__":
    main(*sys.argv[1:])
