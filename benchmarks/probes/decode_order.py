"""Whole-model decode step times by the order decoders run in one process (H200 probe, bench only).

The `bench decode-model` model at BATCH (default 1); each ORDER item PROVIDER:MLP builds a
CapturedDecoder over the Hugging Face step (engine "hf"; PROVIDER captured or compiled; MLP dense or
sparse = auto mode), generates 256 tokens twice and prints the second run's p50 ms per step. At
77e3743 the fused captured dense step took 2.93 ms in a process that ran only the fused rows and
3.27 ms after the Hugging Face rows: this checks the compiled rows (and other batches) the same way.

    python benchmarks/probes/decode_order.py ORDER [hf|fused] [BATCH]
    e.g. ORDER = compiled:dense,compiled:sparse
"""

import sys

import torch

from sparseffn.bench.decode_model import DecodeModelBenchConfig, _set_mode, build_bench_model
from sparseffn.models import fuse_non_mlp_
from sparseffn.models.generate import CapturedDecoder


def main(order: str, non_mlp: str = "hf", batch: str = "1") -> None:
    cfg = DecodeModelBenchConfig(batches=batch)
    b = int(batch)
    model, layers, _, prompts = build_bench_model(cfg, torch.device("cuda"))
    if non_mlp == "fused":
        fuse_non_mlp_(model)
    for item in order.split(","):
        provider, mlp = item.split(":")
        _set_mode(layers, "dense" if mlp == "dense" else "auto")
        decoder = CapturedDecoder(model, batch_size=b, max_length=cfg.prompt + cfg.new_tokens, record_times=True,
                                  compile=provider == "compiled", engine="hf")
        decoder.generate(prompts[b], cfg.new_tokens)
        torch.cuda.synchronize()
        decoder.generate(prompts[b], cfg.new_tokens)
        steps = sorted(decoder.step_ms)
        print(f"{non_mlp} batch {b} {provider} {mlp}: p50 {steps[len(steps) // 2]:.3f} ms per step", flush=True)
        del decoder


if __name__ == "__main__":
    main(*sys.argv[1:])
