"""`sparseffn bench decode-model`: whole-model generation, dense vs sparse MLPs, in the same harness.

The model: a named config (default `2b`, random weights, per-unit thresholds calibrated so every layer
has `target_nnz` active units per token at the positions it generates, `build_bench_model`) or a
checkpoint directory. For each batch size, the first rows of one pool of random prompts of `prompt`
tokens and `new_tokens` greedy tokens, for the dense model (every sparse layer in mode "dense", timed with
the down weight in each layout a dense model can have, SparseMLP's transposed one and [D, H] rows, the
faster kept as the dense row) and the sparse one (auto mode):

    eager      Hugging Face `generate` as users call it (dynamic cache, eager): tokens/s, ms per token
    captured   models.generate.CapturedDecoder: static cache, one decode step replayed from a CUDA graph
               (auto mode sends the sparse layers to the decode kernels there): tokens/s, ms per token
               p50 / p99 of the replayed steps, peak memory
    compiled   the same with the step's forward through torch.compile (with `compile`)
    step       the same with the fused decode-step engine, models.decode_step (with `step`; Llama-family
               models): four launches per layer, each sparse layer on the sparse decode MLP where auto
               mode decides it pays at the batch size

each with Hugging Face's own norms and rotary embeddings ("hf") and/or ours fused (models.fuse,
"fused"); dense and sparse always share the variant. With `user_compiled`, also

    user-compiled  a user's own decode loop on the same weights (bench/user_decoder.py: plain torch,
                   static cache, fused q/k/v, torch.compile reduce-overhead fullgraph), its MLPs three
                   F.linear (dense) or the public op `sparse_mlp(mode="auto", prepared=...,
                   expected_nnz=<the layer's measured activity>)` (sparse); norms and RoPE "torch"

and, between the captured runs, the greedy agreement: the first step where the sparse tokens differ
from the dense ones, with the dense logits' top-1 / top-2 margin there, the prefill logits' error and
the active units per token at the sparse model's generated positions (the user-compiled rows: between its own dense and sparse runs).
With `isolate`, each timed run of those providers (and of the user-compiled loop) runs in a fresh Python
process that builds and calibrates the same model again (the same seed and pool): no run inherits another's
allocator, caches or clocks; eager and the agreement stay in this process.
Rooflines: the bytes each step must read (dense: every weight; sparse: all but the up and down rows of
inactive units, at the measured activity; both: the key/value cache at the mean generated position) over
the HBM bandwidth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from sparseffn.bench.common import ints, pyplot, run_in_own_process, save_figure, write_csv
from sparseffn.bench.timing import device_slug, run_metadata
from sparseffn.nn.sparse_mlp import contiguous_down_, store_transposed_
from sparseffn.ops.decide import expected_union

DOWN_LAYOUTS = {"transposed": "stored transposed", "rows": "[D, H]"}
HBM_TB_S = 4.8  # the H200's datasheet bandwidth, for the rooflines
CSV_FIELDS = (
    "gpu", "torch", "triton", "git_sha", "model", "target_nnz", "batch", "prompt", "new_tokens", "non_mlp",
    "provider", "mlp",
    "tokens_per_s", "ms_per_token_p50", "ms_per_token_p99", "speedup_vs_dense", "peak_mib", "roofline_ms",
    "first_divergence", "divergence_margin", "prefill_logits_rel_err", "decode_paths", "generated_nnz",
    "generated_nnz_layer_max", "calibration",
)


@dataclass(frozen=True)
class DecodeModelBenchConfig:
    model: str = "2b"  # a name in sparseffn.models.MODEL_NAMES or a checkpoint directory
    target_nnz: float = 29.0
    batches: str = "1,4,16,64"
    prompt: int = 512
    new_tokens: int = 256
    vocab_size: int = 49152
    dtype: str = "bfloat16"
    calibration_batch_size: int = 4  # sequences per calibration forward
    calibration: str = "generated"  # thresholds fitted on the generated positions or on the prompts (build_bench_model)
    eager: bool = True  # also time Hugging Face's eager generate
    eager_tokens: int = 64  # new tokens of each timed eager generate (it is host-bound: ms per token settle fast)
    non_mlp: str = "hf,fused"  # norms and rotary embeddings: Hugging Face's ("hf") and/or ours ("fused"), in order
    compile: bool = False  # also time the captured step with its forward through torch.compile
    step: bool = False  # also time CapturedDecoder(engine="fused"), the fused decode-step engine
    captured: bool = True  # time the captured Hugging Face forward (off: only the other providers asked for)
    user_compiled: bool = False  # also time a user's own torch.compile'd decode loop (bench/user_decoder.py)
    isolate: bool = False  # each timed captured / compiled / step / user-compiled run in a fresh process
    seed: int = 0
    out_dir: str = "benchmarks/results"
    git_sha: str = ""


def build_bench_model(cfg: DecodeModelBenchConfig, device: torch.device):
    """The benchmark's model in eval mode, its sparse layers (auto mode deciding from what each
    measures), the target active units per token (nan for a checkpoint) and one prompt
    [batch, cfg.prompt] per batch size: the first rows of one pool of random prompts.

    A named config's thresholds are calibrated on the pool (calibration "generated": on the positions
    the model generates after each prompt, greedy and dense, twice, since new thresholds change the
    continuation; "prompt": on the prompts, as `bench e2e` does). Random weights fire far more units
    at generated positions than at random prompt tokens."""
    from sparseffn.models import (MODEL_NAMES, SparsityConfig, build_model, calibrate_thresholds, load_pretrained,
                                  sparse_layers)

    if cfg.calibration not in ("generated", "prompt"):
        raise ValueError(f"calibration must be 'generated' or 'prompt', got {cfg.calibration!r}")
    dtype = getattr(torch, cfg.dtype)
    gen = torch.Generator().manual_seed(cfg.seed)
    if cfg.model in MODEL_NAMES:
        model = build_model(cfg.model, SparsityConfig(), vocab_size=cfg.vocab_size, device=device, dtype=dtype,
                            seed=cfg.seed, max_position_embeddings=cfg.prompt + cfg.new_tokens)
        target = cfg.target_nnz
    elif Path(cfg.model).is_dir():
        model = load_pretrained(cfg.model, device=device, dtype=dtype)
        target = float("nan")
    else:
        raise ValueError(f"model must be one of {MODEL_NAMES} or a checkpoint directory, got {cfg.model!r}")
    model.eval()
    layers = sparse_layers(model)
    batches = ints(cfg.batches)
    pool = torch.randint(model.config.vocab_size, (max(batches), cfg.prompt), generator=gen).to(device)
    if cfg.model in MODEL_NAMES:
        chunk = cfg.calibration_batch_size
        calibrate_thresholds(model, list(pool.split(chunk)), target)
        for _ in range(2 if cfg.calibration == "generated" else 0):
            _set_mode(layers, "dense")
            sequences = _greedy(model, pool, cfg.new_tokens)
            calibrate_thresholds(model, _generated_batches(sequences, cfg.prompt, chunk), target)
    _set_mode(layers, "auto")
    for layer in layers:
        layer.expected_nnz = None  # auto mode decides from what each layer measures
    return model, layers, target, {batch: pool[:batch] for batch in batches}


def _greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    from sparseffn.models.generate import CapturedDecoder

    eager = 5 if prompt.is_cuda else new_tokens  # capture needs CUDA (tests run this on CPU)
    decoder = CapturedDecoder(model, batch_size=prompt.shape[0], max_length=prompt.shape[1] + new_tokens,
                              eager_steps=eager, engine="hf")
    return decoder.generate(prompt, new_tokens)


def _generated_batches(sequences: torch.Tensor, p: int, chunk: int) -> list[dict]:
    """sequences [B, P + new] in batches of `chunk` rows whose statistics count only positions >= p."""
    generated = torch.zeros_like(sequences, dtype=torch.bool)
    generated[:, p:] = True
    return [{"input_ids": s, "calibration_mask": m} for s, m in zip(sequences.split(chunk), generated.split(chunk))]


def run_decode_model_bench(cfg: DecodeModelBenchConfig, device: torch.device | None = None,
                           log: Callable[[str], None] = print) -> list[dict]:
    from sparseffn.models import MODEL_NAMES, fuse_non_mlp_

    timed_providers(cfg)  # before the model is built
    device = device or torch.device("cuda")
    if device.type != "cuda":
        raise ValueError("bench decode-model captures CUDA graphs: it needs a CUDA device")
    variants = [v.strip() for v in cfg.non_mlp.split(",") if v.strip()]
    if variants not in (["hf"], ["fused"], ["hf", "fused"]):
        raise ValueError(f"non_mlp must be 'hf', 'fused' or 'hf,fused' (fusing is in place: hf first), got {cfg.non_mlp!r}")
    model, layers, target, prompts = build_bench_model(cfg, device)
    meta = run_metadata(device)
    if cfg.git_sha:
        meta["git_sha"] = cfg.git_sha
    common = dict(meta, model=cfg.model, target_nnz=target, prompt=cfg.prompt, new_tokens=cfg.new_tokens,
                  calibration=cfg.calibration if cfg.model in MODEL_NAMES else "")
    rows: list[dict] = []
    path = Path(cfg.out_dir) / device_slug(device) / "decode_model.csv"
    for variant in variants:
        if variant == "fused":
            fuse_non_mlp_(model)
        for batch, prompt in prompts.items():
            user = cfg.user_compiled and variant == variants[0]  # its own norms and RoPE: once
            rows += _batch_rows(cfg, model, layers, prompt, dict(common, batch=batch, non_mlp=variant), log, user)
            write_csv(rows, path, CSV_FIELDS)
            torch.cuda.empty_cache()
    return rows


# CapturedDecoder's options for each captured provider, and the config field that asks for it, in timing order
PROVIDERS = {"captured": ({"engine": "hf"}, "captured"), "compiled": ({"compile": True, "engine": "hf"}, "compile"),
             "step": ({"engine": "fused"}, "step")}


def timed_providers(cfg: DecodeModelBenchConfig) -> list[tuple[str, dict]]:
    """(provider, CapturedDecoder options) of each captured provider the config asks for, in order."""
    providers = [(name, options) for name, (options, field) in PROVIDERS.items() if getattr(cfg, field)]
    if not providers:
        raise ValueError("nothing to time: --captured, --compile and --step are all off")
    return providers


def _set_mode(layers, mode: str) -> None:
    for layer in layers:
        layer.mode = mode


@contextlib.contextmanager
def _down_stored(layers, layout: str):
    """Every SparseMLP's down weight stored as `layout` inside the block: "transposed" (SparseMLP's own, which
    the sparse kernels read) or "rows" ([D, H] row-major, as a dense model stores it; the fused engine then
    runs a dense model's down kernel); SparseMLP's own layout after it."""
    if layout == "transposed":
        yield
        return
    for layer in layers:
        contiguous_down_(layer)
    try:
        yield
    finally:
        for layer in layers:
            layer.down_transposed = True
            store_transposed_(layer.down_proj)


def _captured_run(model, layers, prompt, cfg, options, mode: str, layout: str) -> dict:
    """One CapturedDecoder(**options) with every sparse layer in `mode` and the down weights stored as `layout`:
    a generate that captures the step, then the timed one (tokens, p50 / p99 ms, tokens/s, peak MiB, paths)."""
    from sparseffn.models.generate import CapturedDecoder

    with _down_stored(layers, layout):
        _set_mode(layers, mode)
        decoder = CapturedDecoder(model, batch_size=prompt.shape[0], max_length=cfg.prompt + cfg.new_tokens,
                                  record_times=True, **options)
        decoder.generate(prompt, cfg.new_tokens)  # captures the step
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        tokens = decoder.generate(prompt, cfg.new_tokens)
        peak = torch.cuda.max_memory_allocated() / 2**20
        steps = sorted(decoder.step_ms)
        engine = decoder.decode_engine  # its plan: each layer's last_decision is the prompt's by now
        paths = sorted(set(engine.mlp_paths()) if engine is not None else
                       {str(getattr(layer, "last_decision", None) and layer.last_decision.mode) for layer in layers})
        del decoder, engine
    if mode == "dense":
        paths = [f"dense, down {DOWN_LAYOUTS[layout]}"]
    return dict(tokens=tokens, p50=steps[len(steps) // 2], p99=steps[min(len(steps) - 1, int(0.99 * len(steps)))],
                tokens_per_s=1e3 * prompt.shape[0] / statistics.fmean(steps), peak=peak, paths="/".join(paths))


def _batch_rows(cfg, model, layers, prompt, common, log, user_compiled=False) -> list[dict]:
    batch = prompt.shape[0]
    results = {}
    if cfg.eager:  # dense and sparse alternate over two rounds (the allocator's state and clocks hit both alike)
        rounds = {}
        for _ in range(2):
            for mlp, mode in (("dense", "dense"), ("sparse", "auto")):
                _set_mode(layers, mode)
                rounds.setdefault(mlp, []).append(_eager(model, prompt, cfg.eager_tokens))
        for mlp, runs in rounds.items():
            results[("eager", mlp)] = min(runs, key=lambda r: r["p50"])

    def timed(run: dict) -> dict:  # run: provider, mode, layout; in this process or a fresh one
        if cfg.isolate:
            return _isolated_run(cfg, dict(run, non_mlp=common["non_mlp"], batch=batch), log)
        return _timed_run(model, layers, prompt, cfg, run)

    providers = timed_providers(cfg)
    for provider, _ in providers:
        dense = {layout: timed(dict(provider=provider, mode="dense", layout=layout)) for layout in DOWN_LAYOUTS}
        results[(provider, "dense")] = min(dense.values(), key=lambda r: r["p50"])  # the faster layout's
        results[(provider, "sparse")] = timed(dict(provider=provider, mode="auto", layout="transposed"))
        log(f"batch {batch}, {provider}: dense step with the down weight stored transposed "
            f"{dense['transposed']['p50']:.3f} ms, as [D, H] rows {dense['rows']['p50']:.3f} ms (the faster is the "
            "dense row)")
    _set_mode(layers, "auto")
    if user_compiled:  # after the captured sparse run: every layer has a measured activity
        for mlp in ("dense", "sparse"):
            results[("user-compiled", mlp)] = timed(dict(provider="user-compiled", mode=mlp, layout="transposed"))
    first = providers[0][0]  # the greedy agreement of the first provider timed
    agreements = {provider: _agreement(model, layers, prompt, results[(provider, "dense")]["tokens"],
                                       results[(provider, "sparse")]["tokens"], cfg.prompt)
                  for provider in (first, "user-compiled") if (provider, "dense") in results}
    agreement = agreements[first]
    activity = results[(first, "sparse")].get("activity")  # an isolated run's layers measured it, not these
    roof = _rooflines(model, layers, batch, cfg.prompt, cfg.new_tokens, activity)
    rows = []
    for (provider, mlp), r in results.items():
        base = results[(provider, "dense")]["tokens_per_s"]
        own = dict(non_mlp="torch") if provider == "user-compiled" else {}
        rows.append(dict(common, **own, provider=provider, mlp=mlp, tokens_per_s=round(r["tokens_per_s"], 1),
                         ms_per_token_p50=round(r["p50"], 4), ms_per_token_p99=round(r["p99"], 4),
                         speedup_vs_dense=round(r["tokens_per_s"] / base, 3),
                         peak_mib=round(r["peak"], 1) if "peak" in r else "",
                         roofline_ms=round(roof[mlp], 4), decode_paths=r.get("paths", ""),
                         **(agreements.get(provider, agreement) if mlp == "sparse" else {})))
    cap_d, cap_s = results[(first, "dense")], results[(first, "sparse")]
    log(f"{common['non_mlp']} batch {batch}: {first} dense {cap_d['p50']:.3f} ms/token, sparse {cap_s['p50']:.3f} "
        f"({cap_d['p50'] / cap_s['p50']:.2f}x; rooflines {roof['dense']:.3f} / {roof['sparse']:.3f}); "
        + (f"eager {results[('eager', 'dense')]['p50']:.2f} / {results[('eager', 'sparse')]['p50']:.2f} ms; "
           if cfg.eager else "")
        + (f"compiled {results[('compiled', 'dense')]['p50']:.3f} / {results[('compiled', 'sparse')]['p50']:.3f} ms; "
           if cfg.compile else "")
        + (f"step {results[('step', 'dense')]['p50']:.3f} / {results[('step', 'sparse')]['p50']:.3f} ms "
           f"(first token differing from captured's, dense / sparse: {_first_difference(results, 'dense', cfg.prompt)} / "
           f"{_first_difference(results, 'sparse', cfg.prompt)}); " if cfg.step else "")
        + (f"user-compiled {results[('user-compiled', 'dense')]['p50']:.3f} / "
           f"{results[('user-compiled', 'sparse')]['p50']:.3f} ms (paths {results[('user-compiled', 'sparse')]['paths']}); "
           if user_compiled else "")
        + f"first divergence {agreement['first_divergence']} (margin {agreement['divergence_margin']}); generated "
          f"nnz/token {agreement['generated_nnz']} (layer max {agreement['generated_nnz_layer_max']}); paths "
          f"{cap_s['paths']}")
    return rows


def _timed_run(model, layers, prompt, cfg, run: dict) -> dict:
    """One timed run in this process: `run` names the provider ("user-compiled" or one of timed_providers), the
    mode of every sparse layer ("dense" / "auto"; the user loop's "dense" / "sparse") and the down layout."""
    if run["provider"] == "user-compiled":
        return _user_compiled(model, layers, prompt, cfg, sparse=run["mode"] == "sparse")
    return _captured_run(model, layers, prompt, cfg, PROVIDERS[run["provider"]][0], run["mode"], run["layout"])


def _isolated_run(cfg: DecodeModelBenchConfig, run: dict, log: Callable[[str], None]) -> dict:
    """`_timed_run` in a fresh Python process (`isolated_child`), which builds the same model; its result here
    (tokens on this process's device, and each layer's measured activity after the run)."""
    with tempfile.TemporaryDirectory(prefix="decode-model-run-") as folder:
        spec, result = Path(folder) / "run.json", Path(folder) / "result.pt"
        spec.write_text(json.dumps(dict(cfg=dataclasses.asdict(cfg), run=run)))
        code = (f"from sparseffn.bench.decode_model import isolated_child; "
                f"isolated_child({str(spec)!r}, {str(result)!r})")
        what = (f"bench decode-model: the {run['provider']} run ({run['mode']}, down {run['layout']}) at batch "
                f"{run['batch']}, {run['non_mlp']} norms/RoPE")
        run_in_own_process(code, what, log)
        out = torch.load(result, weights_only=True)
    out["tokens"] = out["tokens"].to(torch.device("cuda"))
    return out


def isolated_child(spec_path: str, result_path: str) -> None:
    """A fresh process's whole work (`_isolated_run`): build the bench model as the parent did, fuse its norms
    and RoPE for the "fused" variant, run the one timed run, save its result. The user loop first runs the
    captured sparse step untimed, as the parent's order does: its op reads the activity that run measures."""
    from sparseffn.models import fuse_non_mlp_

    spec = json.loads(Path(spec_path).read_text())
    cfg, run = DecodeModelBenchConfig(**spec["cfg"]), spec["run"]
    if not torch.cuda.is_available():
        raise ValueError("bench decode-model captures CUDA graphs: it needs a CUDA device")
    model, layers, _, prompts = build_bench_model(cfg, torch.device("cuda"))
    if run["non_mlp"] == "fused":
        fuse_non_mlp_(model)
    prompt = prompts[run["batch"]]
    if run["provider"] == "user-compiled":
        _captured_run(model, layers, prompt, cfg, PROVIDERS["captured"][0], "auto", "transposed")
    result = _timed_run(model, layers, prompt, cfg, run)
    result["tokens"] = result["tokens"].cpu()
    result["activity"] = [getattr(getattr(layer, "activity", None), "nnz", None) for layer in layers]
    torch.save(result, result_path)


def _first_difference(results: dict, mlp: str, p: int) -> int | str:
    """First generated position where the step provider's tokens differ from the captured ones (-1: none;
    '–' without a captured run)."""
    if ("captured", mlp) not in results:
        return "–"
    a, b = results[("captured", mlp)]["tokens"][:, p:], results[("step", mlp)]["tokens"][:, p:]
    n = min(a.shape[1], b.shape[1])
    differ = (a[:, :n] != b[:, :n]).any(0).nonzero()
    return int(differ[0]) if differ.numel() else -1


def _user_compiled(model, layers, prompt, cfg, sparse: bool) -> dict:
    """bench/user_decoder.py's loop, its step through torch.compile: one warm-up generate (compiles,
    records the CUDA graphs), then the timed one. The sparse run's paths are what the op decides for
    each layer's call inside the compiled step."""
    import gc

    from sparseffn.bench.user_decoder import UserDecoder
    from sparseffn.ops.sparse_mlp import as_captured, choose_mode

    decoder = UserDecoder(model, batch_size=prompt.shape[0], max_length=cfg.prompt + cfg.new_tokens, sparse=sparse)
    decoder.compile_step()
    decoder.generate(prompt, 8)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    steps: list[float] = []
    tokens = decoder.generate(prompt, cfg.new_tokens, steps)
    peak = torch.cuda.max_memory_allocated() / 2**20
    paths = "dense"
    if sparse:
        x = prompt.new_empty((prompt.shape[0], 1, model.config.hidden_size), dtype=decoder.embed.dtype)
        with as_captured():  # the decision the op takes under torch.compile
            paths = "/".join(sorted({choose_mode(x, layer.up, expected_nnz=layer.expected_nnz,
                                                 down_t_ready=True).mode for layer in decoder.layers}))
    del decoder
    torch._dynamo.reset()  # drops the compiled step and its CUDA graphs
    gc.collect()
    torch.cuda.empty_cache()
    steps.sort()
    return dict(tokens=tokens, p50=steps[len(steps) // 2], p99=steps[min(len(steps) - 1, int(0.99 * len(steps)))],
                tokens_per_s=1e3 * prompt.shape[0] / statistics.fmean(steps), peak=peak, paths=paths)


def _eager(model, prompt, new_tokens) -> dict:
    """Hugging Face's generate, eager, greedy: ms per decode token (a generate of new_tokens tokens minus
    one of 1 token, the prefill, over new_tokens - 1), tokens/s."""
    def timed(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       attention_mask=torch.ones_like(prompt), pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(2)  # warm-up at this shape
    ms = 1e3 * (timed(new_tokens) - timed(1)) / (new_tokens - 1)
    return dict(p50=ms, p99=ms, tokens_per_s=1e3 * prompt.shape[0] / ms)


@torch.no_grad()
def _agreement(model, layers, prompt, dense_tokens, sparse_tokens, p: int) -> dict:
    """First generated position where the sparse tokens differ from the dense ones (any row), the dense
    logits' top-1 / top-2 margin there, and the prefill logits' relative error sparse vs dense."""
    differ = (dense_tokens[:, p:] != sparse_tokens[:, p:]).any(0).nonzero()
    first = int(differ[0]) if differ.numel() else -1
    _set_mode(layers, "dense")
    dense_logits = model(input_ids=prompt).logits[:, -1].float()
    margin = ""
    if first >= 0:
        logits = model(input_ids=dense_tokens[:, :p + first]).logits[:, -1].float()
        top = logits.topk(2, dim=-1).values
        row = int((dense_tokens[:, p + first] != sparse_tokens[:, p + first]).nonzero()[0])
        margin = round(float(top[row, 0] - top[row, 1]), 5)
    _set_mode(layers, "auto")
    sparse_logits = model(input_ids=prompt).logits[:, -1].float()
    err = float((sparse_logits - dense_logits).norm() / dense_logits.norm())
    return dict(first_divergence=first, divergence_margin=margin, prefill_logits_rel_err=f"{err:.3e}",
                **_generated_nnz(model, sparse_tokens, p))


def _generated_nnz(model, tokens, p: int) -> dict:
    """Active units per token at the generated positions of tokens [B, P + new] (the sparse model's own
    continuation): the mean over layers and the largest layer mean."""
    from sparseffn.models.calibrate import measure_activity

    means = [r["mean_nnz"] for r in measure_activity(model, _generated_batches(tokens, p, 8))]
    return dict(generated_nnz=round(statistics.fmean(means), 1), generated_nnz_layer_max=round(max(means), 1))


def _rooflines(model, layers, batch: int, prompt: int, new_tokens: int,
               activity: list[float | None] | None = None) -> dict[str, float]:
    """ms per step if every byte each step must read streamed at HBM_TB_S: the weights (dense every one;
    sparse all but the up and down rows of units no token of the batch activates, the expected union at
    the measured activity, ops.decide.expected_union) and each sequence's key/value cache up to the mean
    position of the generated steps (prompt + new_tokens / 2), which dense and sparse read alike. activity:
    each layer's measured active units per token where another process measured them (else the layers' own)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    skipped = 0
    for i, layer in enumerate(layers):
        h = getattr(layer, "intermediate_size", None)
        nnz = activity[i] if activity is not None else getattr(getattr(layer, "activity", None), "nnz", None)
        if h is None or nnz is None or layer.gate_proj is None:
            continue
        union = expected_union(nnz, batch, h)
        row_bytes = 2 * layer.hidden_size * layer.up_proj.weight.element_size()  # an up row and a down column
        skipped += (h - union) * row_bytes
    cache = batch * (prompt + new_tokens / 2) * _cache_bytes_per_position(model)
    return {"dense": (total + cache) / (HBM_TB_S * 1e9), "sparse": (total - skipped + cache) / (HBM_TB_S * 1e9)}


def _cache_bytes_per_position(model) -> int:
    """Key and value bytes one position of one sequence holds over all layers (a Llama-family config:
    num_key_value_heads heads of head_dim, in the model's dtype)."""
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * heads * head_dim * next(model.parameters()).element_size()


def decode_model_table(rows: list[dict]) -> str:
    """Markdown: per non-MLP variant, batch and path, dense and sparse ms per token, speed-up,
    rooflines, peak memory, agreement."""
    lines = ["| norms, RoPE | batch | path | dense ms/token (p50 / p99) | sparse ms/token (p50 / p99) | speed-up | "
             "rooflines dense / sparse ms | peak MiB dense / sparse | greedy: first divergence (margin) | "
             "prefill logits err | generated nnz/token: mean (layer max) |", "|---" * 11 + "|"]
    variant = lambda r: r.get("non_mlp") or "hf"  # noqa: E731 (rows written before the column: hf)
    for non_mlp in dict.fromkeys(variant(r) for r in rows):
        for batch in dict.fromkeys(int(r["batch"]) for r in rows):
            for provider in ("step", "captured", "compiled", "user-compiled", "eager"):
                pick = {r["mlp"]: r for r in rows if int(r["batch"]) == batch and r["provider"] == provider
                        and variant(r) == non_mlp}
                if set(pick) != {"dense", "sparse"}:
                    continue
                d, s = pick["dense"], pick["sparse"]
                lines.append(
                    f"| {non_mlp} | {batch} | {provider} | {float(d['ms_per_token_p50']):.3f} / "
                    f"{float(d['ms_per_token_p99']):.3f} | {float(s['ms_per_token_p50']):.3f} / "
                    f"{float(s['ms_per_token_p99']):.3f} | **{float(s['speedup_vs_dense']):.2f}x** | "
                    f"{float(d['roofline_ms']):.3f} / {float(s['roofline_ms']):.3f} | {d['peak_mib'] or '–'} / "
                    f"{s['peak_mib'] or '–'} | {s['first_divergence']} ({s['divergence_margin']}) | "
                    f"{s['prefill_logits_rel_err']} | "
                    + (f"{s['generated_nnz']} ({s['generated_nnz_layer_max']}) |" if s.get("generated_nnz")
                       else "– |"))
    return "\n".join(lines)


def plot_decode_model(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    variant = lambda r: r.get("non_mlp") or "hf"  # noqa: E731
    for non_mlp in dict.fromkeys(variant(r) for r in rows):
        for provider in ("step", "captured", "compiled", "user-compiled", "eager"):
            for mlp in ("dense", "sparse"):
                pts = [(int(r["batch"]), float(r["tokens_per_s"])) for r in rows
                       if r["provider"] == provider and r["mlp"] == mlp and variant(r) == non_mlp]
                if pts:
                    ax.plot(*zip(*sorted(pts)), "--s" if provider == "eager" else "-o",
                            label=f"{provider}, {non_mlp} norms/RoPE, {mlp} MLPs")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens/s")
    ax.legend(fontsize=7)
    return save_figure(fig, path)
