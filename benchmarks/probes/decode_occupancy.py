"""How many weight bytes can the one-token decode kernels keep in flight? (Static; runs on a CPU.) Each
one-token bf16 variant of the decode MLP and projection kernels (tests/kernels/compile_specs), plus
the DecodeConfig tiles the engine sweep tries, compiled for sm_90a as the JIT specializes them at the
2b shapes (every pointer 16-byte aligned, every size and stride divisible by 16 but M): registers per
thread (cuobjdump), programs per SM that those registers allow (64K registers, 64 warps, 32 programs),
and the weight tile of one loop step. A program keeps its step's tile in flight while it waits, and
with `stream` also the next step's, so programs x tile (x 2 streamed) bounds the bytes in flight per SM;
at one token the kernels are latency-bound, and time per byte follows the bytes in flight (Little's law).

    python benchmarks/probes/decode_occupancy.py OUT_CSV
"""

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
from compile_specs import decode_attn_proj, decode_mlp  # noqa: E402  (tests/kernels/compile_specs)

from sparseffn.bench.common import write_csv  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
GIT_SHA = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip() or "unknown"  # the tree's commit (uncommitted changes not seen)
UNALIGNED = {"M", "n_counts", "eps", "P", "HQ", "HKV"}  # arguments the JIT sees as arbitrary ints
PROJ_TILES = ((2, 2048), (2, 1024), (4, 1024), (2, 512), (4, 512), (8, 256))  # (block_n, block_k), streamed
# (block_h, block_k, warps, stages) of K1 at one token: the tiles decode_engine_sweep.csv measured at batch 1
K1_TILES = ((4, 2048, 4, 1), (2, 2048, 4, 1), (4, 2048, 2, 1), (4, 2048, 8, 1), (8, 2048, 4, 1), (8, 2048, 8, 1),
            (16, 2048, 8, 1), (4, 1024, 4, 1), (8, 1024, 4, 2), (16, 1024, 8, 2), (8, 512, 4, 3), (4, 512, 4, 1),
            (8, 256, 4, 1))


def registers(fn, signature: dict, constexprs: dict, options: dict) -> int:
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, ty in signature.items()
             if ty not in ("constexpr", "fp32") and name not in UNALIGNED}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=TARGET, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return int(re.search(r"REG:(\d+)", out).group(1))


def row(fn, signature, constexprs, options, tile_rows: int, label: str) -> dict:
    regs = registers(fn, signature, constexprs, options)
    warps = options["num_warps"]
    programs = min(65536 // (-(-regs // 8) * 8 * 32 * warps), 64 // warps, 32)
    tile = tile_rows * constexprs["BLOCK_K"] * 2
    stream = bool(constexprs.get("STREAM"))
    return dict(gpu="sm_90a (compiled on a CPU)", triton=triton.__version__, git_sha=GIT_SHA, kernel=fn.__name__,
                variant=label, warps=warps, registers=regs, programs_per_sm=programs, tile_kb=tile / 1024,
                stream=stream, kb_in_flight_per_sm=programs * tile * (2 if stream else 1) / 1024)


def main(out_csv: str) -> None:
    rows = []
    specs = decode_mlp.compile_specs(with_options=True) + decode_attn_proj.compile_specs(with_options=True)
    for fn, sig, cx, opt in specs:
        if "fp16" in repr(sig) or cx.get("M_PAD") != 1 or "BLOCK_K" not in cx:
            continue
        rows_per_tile = cx.get("BLOCK_H") or cx.get("BLOCK_N") or cx.get("BLOCK_D")  # the weight rows a step reads
        names = ("GATED", "HAS_THRESHOLD", "HAS_BIAS", "ACT", "NORM", "STREAM", "RESIDUAL", "BLOCK_H", "BLOCK_N",
                 "BLOCK_D", "BLOCK_K", "ONE_STEP", "PDL")
        label = " ".join(f"{k}={cx[k]}" for k in names if k in cx)
        rows.append(row(fn, sig, cx, opt, rows_per_tile, label))
        print(rows[-1], flush=True)
    engine_k1 = [s for s in decode_mlp.compile_specs(with_options=True) if s[0].__name__ == "_decode_gate_up_kernel"
                 and "bf16" in repr(s[1]) and s[2]["M_PAD"] == 1 and s[2]["NORM"]]
    for fn, sig, cx, opt in engine_k1:  # the engine's K1 (sparse and dense, plain and streamed) over the tiles
        for block_h, block_k, warps, stages in K1_TILES:
            c = dict(cx, BLOCK_H=block_h, BLOCK_K=block_k)
            label = f"tile ACT={cx['ACT']} STREAM={cx['STREAM']} BLOCK_H={block_h} BLOCK_K={block_k} stages={stages}"
            rows.append(row(fn, sig, c, dict(opt, num_warps=warps, num_stages=stages), block_h, label))
            print(rows[-1], flush=True)
    projections = [s for s in decode_attn_proj.compile_specs(with_options=True) if "bf16" in repr(s[1])
                   and s[2]["M_PAD"] == 1 and not s[2]["HAS_BIAS"] and s[2]["STREAM"]]
    for fn, sig, cx, opt in projections:  # the streamed projections over the tiles the engine sweep tries
        for block_n, block_k in PROJ_TILES:
            c = dict(cx, BLOCK_N=block_n, BLOCK_K=block_k)
            label = f"tile STREAM=True BLOCK_N={block_n} BLOCK_K={block_k}"
            rows.append(row(fn, sig, c, opt, block_n, label))
            print(rows[-1], flush=True)
    write_csv(rows, out_csv, tuple(rows[0]))


if __name__ == "__main__":
    main(*sys.argv[1:])
