"""Is a replayed decode step bound by the host's graph launch (H200 probe, bench only)? The
`bench decode-model` model (HF norms/RoPE, batch 1, thresholds fitted on the prompt), dense MLPs vs
auto mode: per replay, host ms to submit (no sync inside the loop) and wall ms until the GPU is done.

    python benchmarks/probes/replay_host.py
"""

import time
from collections import Counter

import torch

from sparseffn.bench.decode_model import DecodeModelBenchConfig, build_bench_model
from sparseffn.models.generate import CapturedDecoder

REPLAYS = 200


def main() -> None:
    device = torch.device("cuda")
    cfg = DecodeModelBenchConfig(batches="1", new_tokens=REPLAYS + 32, calibration="prompt")
    model, layers, _, prompts = build_bench_model(cfg, device)
    for mlp, mode in (("dense", "dense"), ("sparse", "auto"), ("dense", "dense"), ("sparse", "auto")):
        for layer in layers:
            layer.mode = mode
        decoder = CapturedDecoder(model, batch_size=1, max_length=cfg.prompt + cfg.new_tokens)
        decoder.generate(prompts[1], 16)
        graph = decoder._graph
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(REPLAYS):
            graph.replay()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        print(f"{mlp}: host {1e3 * host / REPLAYS:.3f} ms per replay submitted, wall {1e3 * wall / REPLAYS:.3f} ms "
              f"per replay; decisions {Counter(str(layer.last_decision) for layer in layers).most_common(3)}",
              flush=True)
        del decoder


if __name__ == "__main__":
    main()
