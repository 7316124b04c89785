"""Which tensors a sparse decode run holds that the dense one does not (H200 probe, bench only): the
`bench decode-model` model at one batch size, one CapturedDecoder per MLP mode as the benchmark runs
them, the peak of the second generate and the live blocks after it, diffed by allocation site.

    python benchmarks/probes/decode_memory.py [BATCH]
"""

import collections
import sys

import torch

from sparseffn.bench.decode_model import DecodeModelBenchConfig, _set_mode, build_bench_model
from sparseffn.models.generate import CapturedDecoder


def live_blocks() -> collections.Counter:
    """Bytes of live allocations by their innermost sparseffn / transformers / torch frames."""
    sites = collections.Counter()
    for segment in torch.cuda.memory_snapshot():
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{f['filename'].split('site-packages/')[-1].split('src/')[-1]}:{f['line']} {f['name']}"
                      for f in block.get("frames", [])]
            frames = [f for f in frames if f.startswith(("sparseffn", "transformers"))][:4]
            sites[" < ".join(frames) or "?"] += block["size"]
    return sites


def main(batch: int) -> None:
    dev = torch.device("cuda")
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    cfg = DecodeModelBenchConfig(batches=str(batch))
    model, layers, _, prompts = build_bench_model(cfg, dev)
    prompt = prompts[batch]
    seen = {}
    for mlp, mode in (("dense", "dense"), ("sparse", "auto")):
        _set_mode(layers, mode)
        decoder = CapturedDecoder(model, batch_size=batch, max_length=cfg.prompt + cfg.new_tokens)
        decoder.generate(prompt, cfg.new_tokens)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        decoder.generate(prompt, cfg.new_tokens)
        torch.cuda.synchronize()
        seen[mlp] = live_blocks()
        print(f"{mlp}: allocated before {before / 2**20:.2f} MiB, after {torch.cuda.memory_allocated() / 2**20:.2f}, "
              f"peak {torch.cuda.max_memory_allocated() / 2**20:.2f}", flush=True)
        del decoder
        torch.cuda.synchronize()
        print(f"{mlp}: allocated after del {torch.cuda.memory_allocated() / 2**20:.2f} MiB", flush=True)
    for site in sorted(set(seen["dense"]) | set(seen["sparse"])):
        delta = seen["sparse"][site] - seen["dense"][site]
        if delta:
            print(f"{delta / 2**10:+10.1f} KiB  {site}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
