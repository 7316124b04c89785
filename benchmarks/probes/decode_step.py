"""Where a captured decode step's GPU time goes (H200 probe, bench only): the `bench decode-model` model,
for each norms/RoPE variant and batch size, dense MLPs vs auto mode, each decode step captured by
CapturedDecoder and replayed under torch.profiler; kernel time per step grouped by kernel name, and
the sparse layers' decisions and measured activity.

    python benchmarks/probes/decode_step.py OUT_CSV [batches, default 1,4] [variants, default hf,fused]
"""

import sys
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from sparseffn.bench.common import write_csv
from sparseffn.bench.decode_model import DecodeModelBenchConfig, build_bench_model
from sparseffn.bench.timing import run_metadata
from sparseffn.models import fuse_non_mlp_
from sparseffn.models.generate import CapturedDecoder

REPLAYS = 20


def kernel_us(graph) -> tuple[Counter, Counter]:
    """GPU µs and launches per kernel name, per replay of graph."""
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    us, calls = Counter(), Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us[event.name] += event.device_time / REPLAYS
            calls[event.name] += 1 / REPLAYS
    return us, calls


def main(out_csv: str, batches: str = "1,4", variants: str = "hf,fused") -> None:
    device = torch.device("cuda")
    cfg = DecodeModelBenchConfig(batches=batches, new_tokens=128)
    model, layers, _, prompts = build_bench_model(cfg, device)
    meta = run_metadata(device)
    rows = []
    for variant in variants.split(","):  # fusing is in place: hf before fused
        if variant == "fused":
            fuse_non_mlp_(model)
        for batch, prompt in prompts.items():
            totals = {}
            for mlp, mode in (("dense", "dense"), ("sparse", "auto")):
                for layer in layers:
                    layer.mode = mode
                decoder = CapturedDecoder(model, batch_size=batch, max_length=cfg.prompt + cfg.new_tokens,
                                          record_times=True)
                decoder.generate(prompt, 64)
                step_ms = sorted(decoder.step_ms)[len(decoder.step_ms) // 2]
                us, calls = kernel_us(decoder._graphs[False])
                totals[mlp] = sum(us.values())
                decisions = Counter(str(getattr(layer, "last_decision", None)) for layer in layers)
                nnz = [getattr(layer.activity, "nnz", None) for layer in layers]
                print(f"{variant} batch {batch} {mlp}: step {step_ms:.3f} ms, kernels {totals[mlp] / 1e3:.3f} ms "
                      f"in {sum(calls.values()):.0f} launches; nnz estimates {min(n or 0 for n in nnz):.1f}-"
                      f"{max(n or 0 for n in nnz):.1f}; decisions {dict(decisions)}")
                for name, t in us.most_common(12):
                    print(f"    {t:9.1f} us  {calls[name]:5.0f}x  {name[:110]}")
                    rows.append(dict(meta, non_mlp=variant, batch=batch, mlp=mlp, step_ms=round(step_ms, 4),
                                     kernel=name[:200], us_per_step=round(t, 2), launches=round(calls[name])))
                del decoder
                torch.cuda.empty_cache()
            print(f"{variant} batch {batch}: kernel time dense / sparse {totals['dense'] / totals['sparse']:.3f}x")
    write_csv(rows, out_csv, tuple(rows[0]))


if __name__ == "__main__":
    main(*sys.argv[1:])
