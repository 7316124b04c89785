"""Where one captured step of the fused decode engine (CapturedDecoder(engine="fused")) spends its GPU
time (H200 probe, bench only): the `bench decode-model` model, dense MLPs vs auto mode, per batch size;
kernel µs per step under torch.profiler (benchmarks/probes/decode_step.py's `kernel_us`), the bytes
each kernel must read (weights, KV cache slots in use, the active units' rows) and the bandwidth that
makes.

    python benchmarks/probes/decode_engine_profile.py OUT_CSV [batches, default 1,16]
"""

import sys
from collections import Counter

import torch

from decode_step import REPLAYS, kernel_us
from sparseffn.bench.common import write_csv
from sparseffn.bench.decode_model import DecodeModelBenchConfig, build_bench_model
from sparseffn.bench.timing import run_metadata
from sparseffn.models.generate import CapturedDecoder

NEW = 64  # generated tokens: calibration and the profiled generate


def _bytes(name: str, engine, batch: int, position: int) -> float | str:
    """Bytes the kernels of this name must read per step ('' when the name is not one of the engine's)."""
    layers = engine.layers
    size = layers[0].up.element_size()
    if "qkv_rope" in name:
        return sum((l.wq.numel() + l.wk.numel() + l.wv.numel()) * size for l in layers)
    if "out_proj" in name:
        return sum(l.wo.numel() * size for l in layers)
    if "decode_attention" in name:
        return sum(2 * k.shape[0] * k.shape[1] * position * k.shape[3] * size for k, _ in engine.caches)
    if "gate_up" in name or "down" in name:
        total = 0.0
        for l in layers:
            h, d = l.up.shape
            nnz = getattr(getattr(l.mlp, "activity", None), "nnz", None)
            union = min(h, nnz * batch) if (l.sparse and nnz is not None) else h
            total += (h * d + union * d) * size if "gate_up" in name else union * d * size
        return total
    return ""


def main(out_csv: str, batches: str = "1,16") -> None:
    device = torch.device("cuda")
    cfg = DecodeModelBenchConfig(batches=batches, new_tokens=NEW)
    model, layers, _, prompts = build_bench_model(cfg, device)
    meta = run_metadata(device)
    rows = []
    for batch, prompt in prompts.items():
        for mlp, mode in (("dense", "dense"), ("sparse", "auto")):
            for layer in layers:
                layer.mode = mode
            # room for the profiled replays, each of which writes the cache one position further
            decoder = CapturedDecoder(model, batch_size=batch, max_length=cfg.prompt + cfg.new_tokens + REPLAYS + 8,
                                      record_times=True, engine="fused")
            decoder.generate(prompt, NEW)
            step_ms = sorted(decoder.step_ms)[len(decoder.step_ms) // 2]
            us, calls = kernel_us(decoder._graphs[False])
            total = sum(us.values())
            paths = Counter(l.sparse for l in decoder._engine.layers)
            print(f"batch {batch} {mlp}: step {step_ms:.3f} ms, kernels {total / 1e3:.3f} ms in "
                  f"{sum(calls.values()):.0f} launches; sparse MLP layers {paths[True]}/{len(decoder._engine.layers)}")
            for name, t in us.most_common():
                nbytes = _bytes(name, decoder._engine, batch, cfg.prompt + NEW)
                gbs = f"{nbytes / t / 1e3:.0f}" if nbytes != "" and t else ""
                if t >= 0.01 * total:
                    print(f"    {t:8.1f} us {100 * t / total:5.1f}%  {calls[name]:4.0f}x  {gbs:>5} GB/s  {name[:90]}")
                rows.append(dict(meta, batch=batch, mlp=mlp, step_ms=round(step_ms, 4), kernel=name[:200],
                                 us_per_step=round(t, 2), launches=round(calls[name]), share=round(t / total, 4),
                                 bytes=nbytes if nbytes == "" else int(nbytes), gb_per_s=gbs))
            del decoder
            torch.cuda.empty_cache()
    write_csv(rows, out_csv, tuple(rows[0]))


if __name__ == "__main__":
    main(*sys.argv[1:])
