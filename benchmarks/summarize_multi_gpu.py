"""Summarize benchmarks/multi_gpu.sh's runs: tokens/s in all and per GPU (windows after the first),
scaling efficiency against the same mode on one GPU, sparse/dense ratio at each N, peak memory per
GPU, and the CE curve's largest difference from the one-GPU run of the same mode.

    python benchmarks/summarize_multi_gpu.py OUT_DIR      (writes OUT_DIR/multi_gpu.csv, prints a table)
"""

import json
import sys
from pathlib import Path

from sparseffn.bench.common import write_csv

FIELDS = ("gpus", "parallel", "mode", "steps", "tokens_per_s", "tokens_per_s_per_gpu", "scaling_efficiency",
          "auto_vs_dense", "peak_mib_per_gpu", "zeros_pct_last", "sparse_layers_last", "max_ce_diff_vs_1gpu")


def main(out: str) -> None:
    runs = {}
    for folder in sorted((Path(out) / "runs").glob("n*_*_*")):
        metrics = folder / "metrics.jsonl"
        if not metrics.exists():
            continue
        n, parallel, mode = folder.name[1:].split("_")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        train = [r for r in rows if r.get("kind") == "train"]
        runs[(int(n), parallel, mode)] = train
    table = []
    for (n, parallel, mode), train in runs.items():
        steady = train[1:] or train
        speed = sum(r["tokens_per_s"] for r in steady) / len(steady)
        one = runs.get((1, "ddp", mode))
        one_speed = sum(r["tokens_per_s"] for r in (one[1:] or one)) / len(one[1:] or one) if one else float("nan")
        dense = runs.get((n, parallel, "dense"))
        dense_speed = sum(r["tokens_per_s"] for r in (dense[1:] or dense)) / len(dense[1:] or dense) if dense else None
        ce_diff = max((abs(a["ce"] - b["ce"]) for a, b in zip(train, one or [])), default=float("nan"))
        table.append(dict(gpus=n, parallel=parallel, mode=mode, steps=train[-1]["step"], tokens_per_s=round(speed),
                          tokens_per_s_per_gpu=round(speed / n), scaling_efficiency=round(speed / n / one_speed, 3),
                          auto_vs_dense="" if not dense_speed else round(speed / dense_speed, 3),
                          peak_mib_per_gpu=train[-1].get("peak_mib"), zeros_pct_last=train[-1]["zeros_pct"],
                          sparse_layers_last=sum(p == "sparse" for p in train[-1].get("path", [])),
                          max_ce_diff_vs_1gpu=round(ce_diff, 4)))
    write_csv(table, Path(out) / "multi_gpu.csv", FIELDS)
    print("| " + " | ".join(FIELDS) + " |")
    for row in table:
        print("| " + " | ".join(str(row[f]) for f in FIELDS) + " |")


if __name__ == "__main__":
    main(*sys.argv[1:])
