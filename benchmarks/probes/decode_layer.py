"""The persistent one-token decode layer (kernels/decode_layer.py) against the launch-by-launch engine
step (GPU probe, bench only): the `bench decode-model` 2b model at batch 1, sparse (auto) and dense, each
variant a fresh CapturedDecoder(engine="fused") whose step is timed (median of the replays' CUDA events,
40 generated tokens), its greedy tokens compared with the launch-by-launch step's. Variants: the layer
kernel at its default config, without its L2 prefetch, without pdl, and at 1 to 3 programs per SM. CSV
written as it goes.

    python benchmarks/probes/decode_layer.py OUT_CSV
"""

import dataclasses
import sys
import time

import torch

import sparseffn.models.decode_step as decode_step
from sparseffn.bench.common import write_csv
from sparseffn.bench.decode_model import DecodeModelBenchConfig, build_bench_model
from sparseffn.bench.timing import run_metadata
from sparseffn.kernels import decode_layer
from sparseffn.kernels.configs.decode_layer import layer_config
from sparseffn.models.generate import CapturedDecoder

NEW = 40


def _variants() -> list[tuple[str, dict | None]]:
    return [("launches", None), ("layer", {}), ("layer_no_prefetch", {"prefetch": False}),
            ("layer_no_pdl", {"pdl": False})] + [(f"layer_{n}_per_sm", {"programs_per_sm": n}) for n in (1, 2, 3)]


def main(out_csv: str) -> None:
    device = torch.device("cuda")
    cfg = DecodeModelBenchConfig(batches="1", new_tokens=NEW + 8)
    model, layers, _, prompts = build_bench_model(cfg, device)
    prompt = prompts[1]
    meta = run_metadata(device)
    rows = []
    for mode in ("auto", "dense"):
        for layer in layers:
            layer.mode = mode
        tokens = {}
        for name, override in _variants():
            decode_step.layer_config = (lambda arch, dense=False, o=override or {}:
                                        dataclasses.replace(layer_config(arch, dense), **o))
            t0 = time.perf_counter()
            try:
                decoder = CapturedDecoder(model, batch_size=1, max_length=cfg.prompt + cfg.new_tokens,
                                          record_times=True, engine="fused")
                decoder._engine.layer_kernel = override is not None
                out = decoder.generate(prompt, NEW)
                step_ms = sorted(decoder.step_ms)[len(decoder.step_ms) // 2]
                tokens[name] = out
                same = torch.equal(out, tokens["launches"]) if "launches" in tokens else ""
                error = ""
            except Exception as exc:  # a variant the kernel or the GPU refuses: recorded, the probe goes on
                step_ms, same, error = float("nan"), "", f"{type(exc).__name__}: {exc}"[:300]
            fits = sorted(set(decode_layer._FIT.values()))
            print(f"{mode:5s} {name:16s} step {step_ms:.4f} ms  same tokens as launches: {same}  fit/SM {fits}  "
                  f"({time.perf_counter() - t0:.1f} s) {error}", flush=True)
            rows.append(dict(meta, batch=1, mode=mode, variant=name, step_ms=round(step_ms, 4),
                             same_tokens=same, programs_per_sm_fit=" ".join(map(str, fits)), error=error))
            write_csv(rows, out_csv, tuple(rows[0]))
            decoder = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
