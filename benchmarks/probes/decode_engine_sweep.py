"""Launch configs of the fused decode engine's kernels, swept inside the captured step (H200 probe,
bench only): the `bench decode-model` 2b model, one kernel's config varied at a time with the others
at their defaults, each variant a fresh CapturedDecoder(engine="fused") whose step is timed (median
of the replays' CUDA events) and profiled per kernel (decode_step.py's `kernel_us`). A CSV row per
variant and kernel, written as it goes, so a run cut short keeps what it measured.

    python benchmarks/probes/decode_engine_sweep.py OUT_CSV [batches, default 1,16] [kernels, default all]

kernels: a comma list of mlp_sparse, mlp_dense, attention, qkv, out_proj; mlp_sparse_one_token,
mlp_dense_one_token, qkv_one_token and out_proj_one_token sweep only the one-token fields
(DecodeConfig.stream, ProjectionConfig.stream) at batch 1, mlp_sparse_compact only
DecodeConfig.compact_up from batch 3, each against its other form (then its up steps, and
its gate tiles with compact_up: 16-64 units, 4 or 8 warps; the default last again); attention_prefetch the attention
launcher's default config without AttentionConfig.prefetch against it with (the engine's default);
attention_mma the engine's attention config against it with AttentionConfig.mma (tl.dot on padded query rows,
pipelined cache tiles) at a few tiles, stages and splits, the default first and last; pdl
(the sparse step, auto) and pdl_dense (every MLP dense) set the configs' pdl field (programmatic
dependent launch) on every engine kernel at once, then on all but one kind, and with o_proj at one token
in one K step (its weight tile loaded before the wait). overlap (the sparse step) and overlap_dense (every
MLP dense), batch 1: the one-token kernels without config.prefetch (o_proj in two steps, the sparse K1
unstreamed) and with it (o_proj in one step, the sparse K1 streamed), alternated. whole_row (the sparse
step) and whole_row_dense, batch 1: q/k/v's and K1's whole 2048-column rows read before the PDL wait
(streamed in one step, with prefetch) at a few tile heights, against q/k/v in two 1024-column steps (the
first and the eighth variants); then K1's whole rows at 2 units and o_proj's at 4 and 8, against the defaults.
down_chain (the sparse step) and down_dense (every MLP dense), batch 1, the defaults first and last: the
sparse down pass with every flag compacted in one step (split 1, or 2 spans) at a few column blocks, and the
dense one (every unit, no list) at a few tiles and spans (at 636bbd5 also streamed, a config field since
removed).
down_dense_rows (every MLP dense, batch 1): the down weight stored transposed (the sparse model's layout,
decode_mlp's K2 over every unit) against a contiguous [D, H] copy (a dense model's layout, decode_dense_mlp's
row products), alternated. attention_split (batch 1): attention with prefetch in fewer splits of longer blocks
(every older slot of a split read before the PDL wait), against the default 16 splits of 64 slots.
Since fa0d79b the sparse step at batch 1 folds its down product into K1 (no down kernel launched but the last
layer's): down_chain and the `down` ablation time only that layer there.
ablate (the sparse step) and ablate_dense (every MLP dense), batch 1: the step with one op's launches skipped
(q/k/v, attention, o_proj, the whole MLP, or the down kernel alone), its first output for each layer returned
instead, so the step's drop is that op's cost on the critical path (the defaults first and last).
"""

import dataclasses
import sys
import time

import torch

import sparseffn.ops.decode_attention as attention_ops
import sparseffn.kernels.decode_mlp as decode_mlp
import sparseffn.models.decode_step as decode_step
import sparseffn.ops.decode_block as block_ops
from decode_step import kernel_us
from sparseffn.bench.common import write_csv
from sparseffn.bench.decode_model import DecodeModelBenchConfig, build_bench_model
from sparseffn.bench.timing import run_metadata
from sparseffn.kernels.configs.decode_attention import (AttentionConfig, ProjectionConfig, attention_config,
                                                       projection_config)
from sparseffn.kernels.configs.decode_mlp import default_config, fit_shared_memory
from sparseffn.models.generate import CapturedDecoder

NEW = 40  # generated tokens per variant: the replays timed
REPLAYS = 20  # decode_step.py's profiled replays
OVERRIDE: dict[str, object] = {}  # kernel -> the config its launches take while a variant runs
ROWS_DOWN = "rows_down"  # an OVERRIDE key: the engine's dense MLPs get the down weight as [D, H] rows
ABLATE = "ablate"  # an OVERRIDE key: the op whose launches a variant skips (ablate groups)
STORED: dict[tuple, torch.Tensor] = {}  # (op, layer's weight address) -> the op's first real output


class _NoLaunch:
    """A launcher that launches nothing (decode_mlp's K2 under the `down` ablation)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _ablatable(op: str, launch, key_arg: int):
    """launch, or under OVERRIDE[ABLATE] == op no launch: the op's output from its first call for this
    layer (a real value, so the layers after it see realistic inputs) is returned instead."""
    def run(*args, **kwargs):
        if OVERRIDE.get(ABLATE) != op:
            return launch(*args, **kwargs)
        key = (op, args[key_arg].data_ptr())
        if key not in STORED:
            STORED[key] = launch(*args, **kwargs).clone()
        return STORED[key]
    return run


def _patch() -> None:
    """Route the engine's launches through OVERRIDE (the ops modules look their launchers up per call)."""
    qkv, out, attn, mlp = (attention_ops.launch_decode_qkv_rope, attention_ops.launch_decode_out_proj,
                           attention_ops.launch_decode_attention, block_ops.launch_decode_mlp)
    attention_ops.launch_decode_qkv_rope = _ablatable(
        "qkv", lambda *a, **k: qkv(*a, **k, config=OVERRIDE.get("qkv")), 3)  # wq
    attention_ops.launch_decode_out_proj = _ablatable(
        "out_proj", lambda *a, **k: out(*a, **k, config=OVERRIDE.get("out_proj")), 1)  # wo
    attention_ops.launch_decode_attention = _ablatable(
        "attention", lambda *a, **k: attn(*a, **k, config=OVERRIDE.get("attention")), 1)  # the key cache

    def mlp_launch(*args, **kwargs):
        which = "mlp_sparse" if kwargs.get("act", "sparse") == "sparse" else "mlp_dense"
        if OVERRIDE.get(ABLATE) != "down":
            return mlp(*args, **kwargs, config=OVERRIDE.get(which))
        key = ("down", args[1].data_ptr())  # the gate weight
        if key not in STORED:
            STORED[key] = mlp(*args, **kwargs, config=OVERRIDE.get(which)).clone()
        launcher, decode_mlp._down_launch = decode_mlp._down_launch, _NoLaunch()
        try:
            mlp(*args, **kwargs, config=OVERRIDE.get(which))  # K1 only
        finally:
            decode_mlp._down_launch = launcher
        return STORED[key]

    block_ops.launch_decode_mlp = _ablatable("mlp", mlp_launch, 1)
    layer_of = decode_step._layer

    def layer(*args, **kwargs):  # ROWS_DOWN: a contiguous copy of the transposed down weight, so the dense
        made = layer_of(*args, **kwargs)  # block takes kernels/decode_dense_mlp.py's row products (a dense
        if OVERRIDE.get(ROWS_DOWN):  # model's own layout)
            made.down = made.down.contiguous()
        return made

    decode_step._layer = layer


def _variants(kernel: str, batch: int) -> list:
    """The configs tried for one kernel at one batch size, the default first (None for attention:
    the launcher's own choice, which depends on the batch and the GPU)."""
    mp = 1 if batch == 1 else (2 if batch == 2 else max(16, 1 << (batch - 1).bit_length()))
    if kernel in ("pdl", "pdl_dense"):  # {kernel: config} for all of them at once; the first is the defaults
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        base = {"qkv": projection_config(mp, qkv=True), "out_proj": projection_config(mp, qkv=False),
                "attention": attention_config(batch * 32, sms, prefetch=True),  # the 2b model: 32 key/value heads
                "mlp_sparse": default_config(mp, norm=True), "mlp_dense": default_config(mp, dense=True, norm=True)}
        on = {k: dataclasses.replace(c, pdl=True) for k, c in base.items()}
        variants = [base, on] + [dict(on, **{k: base[k]}) for k in base]
        if mp == 1:
            variants.append(dict(on, out_proj=dataclasses.replace(on["out_proj"], block_k=2048, prefetch=True)))
        return variants
    if kernel in ("overlap", "overlap_dense"):  # one token: {kernel: config}, without prefetch and with, twice
        if mp != 1:
            return []
        qkv, out = projection_config(1, qkv=True), projection_config(1, qkv=False)
        sparse, dense = default_config(1, norm=True), default_config(1, dense=True, norm=True)
        off = {"qkv": dataclasses.replace(qkv, prefetch=False),
               "out_proj": dataclasses.replace(out, block_k=1024, prefetch=False),  # two steps
               "mlp_sparse": dataclasses.replace(sparse, stream=False, prefetch=False),
               "mlp_dense": dataclasses.replace(dense, prefetch=False)}
        on = {"qkv": dataclasses.replace(qkv, prefetch=True),
              "out_proj": dataclasses.replace(out, block_k=2048, prefetch=True),  # one step
              "mlp_sparse": dataclasses.replace(sparse, stream=True, prefetch=True),
              "mlp_dense": dataclasses.replace(dense, prefetch=True)}
        return [off, on, off, on]
    if kernel in ("whole_row", "whole_row_dense"):  # one token: q/k/v's and K1's whole rows read before the wait
        if mp != 1:
            return []
        dense = kernel == "whole_row_dense"
        base = {"qkv": projection_config(1, qkv=True), "out_proj": projection_config(1, qkv=False),
                "mlp_sparse": default_config(1, norm=True), "mlp_dense": default_config(1, dense=True, norm=True)}
        k1 = "mlp_dense" if dense else "mlp_sparse"
        whole = dict(stream=True, block_k=2048, prefetch=True)
        qkv = [dataclasses.replace(base["qkv"], block_n=n, num_warps=w, **whole) for n, w in ((2, 4), (4, 4), (8, 4),
                                                                                               (8, 8))]
        mlp = [dataclasses.replace(base[k1], block_h=h, gate_warps=w, **whole) for h, w in ((4, 4), (8, 8), (2, 4))]
        out = [dataclasses.replace(base["out_proj"], block_n=n) for n in (4, 8)]  # o_proj's whole rows: 4 or 8 units
        two = dict(base, qkv=dataclasses.replace(base["qkv"], block_n=4, block_k=1024, stream=True, prefetch=True))
        variants = [two] + [dict(base, qkv=c) for c in qkv] + [dict(base, **{k1: c}) for c in mlp[:2]]
        variants += [dict(base, qkv=qkv[1], **{k1: mlp[0]}), two, dict(base, qkv=qkv[1])]
        return variants + [dict(base, **{k1: mlp[2]})] + [dict(base, out_proj=c) for c in out] + [base]
    if kernel in ("down_chain", "down_dense", "down_dense_rows", "ablate", "ablate_dense"):  # one token
        if mp != 1:
            return []
        if kernel == "down_chain":  # the sparse step: one compaction step of every flag (split 1), or 2 spans
            base = default_config(1, norm=True)
            grid = [dict(split=1, prefix=8192, block_d=16, block_s=32, down_warps=16),
                    dict(split=1, prefix=8192, block_d=32, block_s=64, down_warps=16),
                    dict(split=1, prefix=8192, block_d=64, block_s=64, down_warps=16),
                    dict(split=2, prefix=4096, block_d=32, block_s=64, down_warps=8),
                    dict(split=1, prefix=4096, block_d=32, block_s=64, down_warps=8)]
            return [{"mlp_sparse": c} for c in [base] + [dataclasses.replace(base, **v) for v in grid] + [base]]
        if kernel in ("ablate", "ablate_dense"):  # each op's launches skipped in turn, its first output replayed
            ops = ("qkv", "attention", "out_proj", "mlp", "down")
            return [{}] + [{ABLATE: op} for op in ops] + [{}]
        if kernel == "down_dense_rows":  # the dense step with the down weight transposed (K2) or as rows
            return [{}, {ROWS_DOWN: True}, {}, {ROWS_DOWN: True}]
        base = default_config(1, dense=True, norm=True)  # every MLP dense: K2 over every unit, no list
        grid = [dict(split=8), dict(split=16, block_s=64), dict(split=32), dict(split=16, block_d=128, down_warps=8),
                dict(split=8)]
        return [{"mlp_dense": c} for c in [base] + [dataclasses.replace(base, **v) for v in grid] + [base]]
    if kernel == "mlp_sparse_compact":
        if mp < 16:
            return []
        base = default_config(mp, norm=True)  # compact_up, 256 columns in 4 stages
        tiles = [dict(block_h=h, gate_warps=w, block_k=k, gate_stages=st) for h, w, k, st in
                 ((32, 4, 256, 4), (32, 8, 256, 4), (16, 4, 256, 4), (64, 8, 256, 4), (32, 4, 128, 4), (16, 4, 512, 3))]
        steps = [dict(up_k=k, up_stages=st) for k, st in ((1024, 2), (512, 3))]
        return [base, dataclasses.replace(base, compact_up=False)] + [
            fit_shared_memory(dataclasses.replace(base, **v), mp) for v in steps + tiles] + [base]
    if kernel.endswith("_one_token"):
        if mp != 1:
            return []
        if kernel in ("qkv_one_token", "out_proj_one_token"):
            qkv = kernel == "qkv_one_token"
            base = projection_config(1, qkv=qkv)
            grid = [ProjectionConfig(block_n=2, block_k=2048 if qkv else 1024)] + [  # unstreamed, then streamed
                ProjectionConfig(block_n=n, block_k=k, stream=True)
                for n, k in ((2, 2048), (2, 1024), (4, 1024), (4, 512), (8, 256))]
            return [base] + [c for c in grid if c != base]
        dense = kernel.startswith("mlp_dense")
        base = default_config(1, dense=dense, norm=True)
        one = [dict(stream=not base.stream, block_h=4, block_k=1024), dict(stream=False, block_h=4, block_k=2048)]
        one += [dict(stream=True, block_h=h, block_k=k) for h, k in ((4, 2048), (4, 512), (8, 256))]
        variants = [dataclasses.replace(base, **v, prefetch=v["stream"] and base.pdl) for v in one]
        return [base] + [c for i, c in enumerate(variants) if c != base and c not in variants[:i]]
    if kernel in ("mlp_sparse", "mlp_dense"):
        base = default_config(mp, dense=kernel == "mlp_dense")
        if mp == 1:
            k1 = [dict(block_h=h, block_k=k, gate_warps=w, gate_stages=s) for h, k, w, s in
                  ((2, 2048, 4, 1), (4, 2048, 2, 1), (4, 2048, 8, 1), (8, 2048, 4, 1), (8, 2048, 8, 1),
                   (16, 2048, 8, 1), (4, 1024, 4, 1), (8, 1024, 4, 2), (16, 1024, 8, 2), (8, 512, 4, 3))]
            k2 = [dict(split=s, block_d=d, down_warps=w, block_s=b) for s, d, w, b in
                  ((1, 64, 4, 128), (2, 64, 4, 128), (8, 64, 4, 128), (4, 32, 4, 128), (4, 128, 4, 128),
                   (4, 64, 2, 128), (4, 64, 1, 64), (8, 32, 2, 64), (16, 64, 4, 64), (4, 256, 8, 128))]
        else:
            k1 = [dict(block_h=h, block_k=k, gate_stages=s, gate_warps=w) for h, k, s, w in
                  ((16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 4), (16, 512, 3, 4), (32, 512, 2, 4),
                   (64, 256, 4, 8), (16, 128, 4, 2), (32, 256, 3, 8), (64, 128, 4, 4))]
            k2 = [dict(split=s, block_d=d, down_stages=st, block_s=b) for s, d, st, b in
                  ((1, 64, 2, 128), (2, 64, 2, 128), (8, 64, 2, 128), (4, 32, 2, 128), (4, 128, 2, 128),
                   (4, 64, 3, 64), (8, 32, 2, 64))]
        return [base] + [dataclasses.replace(base, **v) for v in k1 + k2]
    if kernel == "attention_split":  # one token, prefetch: every older slot before the wait in fewer, longer splits
        if mp != 1:
            return []
        grid = [(8, 128, 4), (4, 256, 8), (32, 32, 2), (8, 128, 8), (16, 64, 2)]
        base = AttentionConfig(pdl=True, prefetch=True)  # attention_config's at one token: 16 splits of 64 slots
        return [base] + [dataclasses.replace(base, splits=s, block_s=b, num_warps=w) for s, b, w in grid] + [base]
    if kernel == "attention_mma":  # AttentionConfig.mma (tl.dot on padded query rows, pipelined cache tiles)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        base = attention_config(batch * 32, sms, prefetch=True)  # the engine's (2b: 32 key/value heads)
        if mp == 1:
            grid = [dict(mma=True), dict(mma=True, num_warps=4), dict(mma=True, splits=8, block_s=128),
                    dict(mma=True, num_stages=3)]
        else:
            grid = [dict(mma=True, num_stages=s, block_s=b, num_warps=w, splits=n) for s, b, w, n in
                    ((2, 128, 4, 1), (3, 128, 4, 1), (4, 64, 4, 1), (2, 256, 8, 1), (3, 128, 4, 2), (3, 64, 4, 2))]
        return [base] + [dataclasses.replace(base, **v) for v in grid] + [base]
    if kernel == "attention_prefetch":  # without AttentionConfig.prefetch, then with it (the engine's default)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return [attention_config(batch * 32, sms), attention_config(batch * 32, sms, prefetch=True)]  # 2b: 32 kv heads
    if kernel == "attention":
        base = None
        grid = [(s, b, w, st) for s in (4, 8, 16, 32) for b, w, st in ((32, 2, 2), (64, 4, 2), (128, 4, 2),
                                                                      (64, 2, 3))]
        if batch > 1:
            grid = [(s, b, w, st) for s in (1, 2, 4, 8) for b, w, st in ((64, 4, 2), (128, 4, 2), (128, 8, 3),
                                                                        (64, 4, 4), (256, 8, 2))]
        return [base] + [AttentionConfig(splits=s, block_s=b, num_warps=w, num_stages=st) for s, b, w, st in grid]
    base = projection_config(mp, qkv=kernel == "qkv")
    if mp <= 2:
        grid = [(n, k, w, 1) for n, k, w in ((2, 2048, 2), (2, 2048, 8), (4, 2048, 4), (4, 2048, 8), (8, 2048, 8),
                                             (2, 1024, 4), (4, 1024, 4), (2, 512, 4))]
    else:
        grid = [(n, k, 4, s) for n, k, s in ((16, 128, 4), (16, 512, 2), (32, 256, 3), (32, 128, 4), (64, 128, 4),
                                             (16, 256, 3))] + [(16, 256, 8, 4)]
    return [base] + [ProjectionConfig(block_n=n, block_k=k, num_warps=w, num_stages=s) for n, k, w, s in grid]


KERNEL_NAMES = {"mlp_sparse": ("gate_up", "_decode_down"), "mlp_dense": ("gate_up", "_decode_down"),
                "mlp_sparse_one_token": ("gate_up", "_decode_down"),
                "mlp_dense_one_token": ("gate_up", "_decode_down"), "qkv_one_token": ("qkv_rope",),
                "out_proj_one_token": ("out_proj",), "mlp_sparse_compact": ("gate_up", "_decode_down"),
                "attention": ("decode_attention",), "attention_prefetch": ("decode_attention",),
                "attention_mma": ("decode_attention",),
                "attention_split": ("decode_attention",),
                "qkv": ("qkv_rope",), "out_proj": ("out_proj",),
                "pdl": ("qkv_rope", "decode_attention", "out_proj", "gate_up", "_decode_down"),
                "pdl_dense": ("qkv_rope", "decode_attention", "out_proj", "gate_up", "_decode_down"),
                "overlap": ("qkv_rope", "decode_attention", "out_proj", "gate_up", "_decode_down"),
                "overlap_dense": ("qkv_rope", "decode_attention", "out_proj", "gate_up", "_decode_down"),
                "whole_row": ("qkv_rope", "out_proj", "gate_up", "_decode_down"),
                "whole_row_dense": ("qkv_rope", "out_proj", "gate_up", "_decode_down"),
                "down_chain": ("gate_up", "_decode_down"), "down_dense": ("gate_up", "_decode_down"),
                "down_dense_rows": ("gate_up", "_decode_down", "_dense_down"),
                "ablate": ("qkv_rope", "decode_attention", "out_proj", "gate_up", "_decode_down"),
                "ablate_dense": ("qkv_rope", "decode_attention", "out_proj", "gate_up", "_decode_down")}


def main(out_csv: str, batches: str = "1,16", kernels: str = "mlp_sparse,mlp_dense,attention,qkv,out_proj") -> None:
    device = torch.device("cuda")
    cfg = DecodeModelBenchConfig(batches=batches, new_tokens=NEW + REPLAYS + 8)
    model, layers, _, prompts = build_bench_model(cfg, device)
    _patch()
    meta = run_metadata(device)
    rows = []
    for batch, prompt in prompts.items():
        for kernel in kernels.split(","):
            dense = kernel.startswith("mlp_dense") or kernel in ("pdl_dense", "overlap_dense", "whole_row_dense",
                                                                 "down_dense", "down_dense_rows", "ablate_dense")
            mode = "dense" if dense else "auto"
            for layer in layers:
                layer.mode = mode
            for i, config in enumerate(_variants(kernel, batch)):
                OVERRIDE.clear()
                STORED.clear()
                if isinstance(config, dict):  # the pdl group: every kernel's config
                    OVERRIDE.update(config)
                else:
                    name = kernel.removesuffix("_one_token").removesuffix("_compact").removesuffix("_prefetch")
                    name = name.removesuffix("_split").removesuffix("_mma")
                    OVERRIDE[name] = config
                t0 = time.perf_counter()
                try:
                    decoder = CapturedDecoder(model, batch_size=batch, max_length=cfg.prompt + cfg.new_tokens,
                                              record_times=True, engine="fused")
                    decoder.generate(prompt, NEW)
                    step_ms = sorted(decoder.step_ms)[len(decoder.step_ms) // 2]
                    us, _ = kernel_us(decoder._graphs[False])
                    error = ""
                except Exception as exc:  # a config the kernel or the GPU refuses: recorded, the sweep goes on
                    step_ms, us, error = float("nan"), {}, f"{type(exc).__name__}: {exc}"[:200]
                part = {n: sum(t for name, t in us.items() if n in name) for n in KERNEL_NAMES[kernel]}
                print(f"batch {batch} {kernel} #{i} step {step_ms:.4f} ms  "
                      + "  ".join(f"{n} {t:.1f}" for n, t in part.items())
                      + f"  ({time.perf_counter() - t0:.1f} s) {config} {error}", flush=True)
                for n, t in part.items():
                    rows.append(dict(meta, batch=batch, kernel=kernel, variant=i, default=i == 0,
                                     step_ms=round(step_ms, 4), part=n, us_per_step=round(t, 2),
                                     config=repr(config), error=error))
                write_csv(rows, out_csv, tuple(rows[0]))
                decoder = None
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
