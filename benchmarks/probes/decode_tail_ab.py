"""The decode step's tail, A/B inside the captured step (H200 probe, bench only): the `bench decode-model` 2b model
with fused norms / RoPE, CapturedDecoder(engine="fused") per variant, dense ([D, H] rows) and sparse (auto) steps,
the variants alternated over ROUNDS in one process:

    head      the tree as it is: the greedy pick and advance in one launch (ops.greedy_pick), the final norm by
              ops.decode_block.decode_norm with the last sparse layer folded into it
    old_pick  torch's argmax and its three small launches instead of the one-launch pick
    old_tail  the model's final norm module, the last layer's down kernel kept (its fold switched off)
    old_both  both

(batch 1; at larger batches only head and old_pick: nothing folds there). CapturedDecoder now takes the one-launch
pick at 2+ sequences only (docs/decode_engine.md, the step's tail), so at batch 1 head and old_pick pick alike.
Then, at batch 1, the sparse step under torch.use_deterministic_algorithms(True). A CSV row per run (p50 / p99 of
the replayed steps), and whether every variant's greedy tokens equal head's.

    python benchmarks/probes/decode_tail_ab.py OUT_CSV [batches, default 1,16] [ROUNDS, default 3]
"""

import os
import statistics
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, for the last run

import torch  # noqa: E402

import sparseffn.models.decode_step as decode_step  # noqa: E402
import sparseffn.models.generate as generate  # noqa: E402
from sparseffn.bench.common import write_csv  # noqa: E402
from sparseffn.bench.decode_model import DecodeModelBenchConfig, _captured_run, build_bench_model  # noqa: E402
from sparseffn.bench.timing import run_metadata  # noqa: E402
from sparseffn.models import fuse_non_mlp_  # noqa: E402

HEAD = (generate.greedy_scratch, decode_step.decode_norm, decode_step.DecodeEngine._folds)


def _set(variant: str, final_norm) -> None:
    """Patch the tree to `variant` (module docstring)."""
    new_pick, new_tail = variant in ("head", "old_tail"), variant in ("head", "old_pick")
    scratch, norm, folds = HEAD

    def module_norm(hidden, weight, eps, pending=None):
        assert pending is None, "old_tail keeps the last layer unfolded"
        return final_norm(hidden)

    generate.greedy_scratch = scratch if new_pick else (lambda *args: None)  # None: torch's ops pick
    decode_step.decode_norm = norm if new_tail else module_norm
    decode_step.DecodeEngine._folds = folds if new_tail else (
        lambda self, i: folds(self, i) and i < len(self.layers) - 1)


def main(out_csv: str, batches: str = "1,16", rounds: str = "3") -> None:
    cfg = DecodeModelBenchConfig(batches=batches, new_tokens=64, eager=False)
    model, layers, _, prompts = build_bench_model(cfg, torch.device("cuda"))
    fuse_non_mlp_(model)
    meta = run_metadata(torch.device("cuda"))
    rows, tokens = [], {}

    def run(batch, prompt, variant, mode):
        r = _captured_run(model, layers, prompt, cfg, {"engine": "fused"}, mode,
                          "rows" if mode == "dense" else "transposed")
        mlp = "dense" if mode == "dense" else "sparse"
        rows.append(dict(meta, batch=batch, variant=variant, mlp=mlp, p50_ms=round(r["p50"], 4),
                         p99_ms=round(r["p99"], 4), paths=r["paths"]))
        tokens.setdefault((batch, variant, mlp), r["tokens"])
        print(f"batch {batch} {variant} {mlp}: p50 {r['p50']:.4f} ms", flush=True)
        write_csv(rows, out_csv, tuple(rows[0]))

    for batch, prompt in prompts.items():
        variants = ("head", "old_pick", "old_tail", "old_both") if batch == 1 else ("head", "old_pick")
        for _ in range(int(rounds)):
            for variant in variants:
                _set(variant, model.model.norm)
                for mode in ("auto", "dense"):
                    run(batch, prompt, variant, mode)
        _set("head", model.model.norm)
        for mlp in ("sparse", "dense"):
            same = {v: torch.equal(tokens[(batch, "head", mlp)], tokens[(batch, v, mlp)]) for v in variants}
            print(f"batch {batch} {mlp}: greedy tokens equal to head's {same}", flush=True)
        if batch == 1:
            torch.use_deterministic_algorithms(True)
            try:
                run(batch, prompt, "deterministic", "auto")
            finally:
                torch.use_deterministic_algorithms(False)
    medians = {}
    for r in rows:
        medians.setdefault((r["batch"], r["mlp"], r["variant"]), []).append(r["p50_ms"])
    for (batch, mlp, variant), p50s in sorted(medians.items()):
        print(f"batch {batch} {mlp} {variant}: median p50 {statistics.median(p50s):.4f} ms over {p50s}")


if __name__ == "__main__":
    main(*sys.argv[1:])
