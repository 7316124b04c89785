"""`sparseffn bench e2e`: a whole Llama-style model, dense vs sparse MLPs, in the same run.

One model is built (random weights, or a trained checkpoint) and its SparseMLP layers are switched
between `mode="dense"` (three torch GEMMs: the dense twin, the same function) and `mode="auto"`
(sparseffn's kernels where they pay), so weights, thresholds and attention are identical for both.
Random weights have no sparsity of their own: `calibrate_thresholds` sets per-neuron thresholds so
every layer reaches the target mean non-zeros per token on sample batches of random tokens; a trained
checkpoint keeps its own sparsity (thresholds as saved).

Measured per batch size (batch × seq_len tokens), dense and sparse:
    forward       prefill throughput, input tokens/ms: `model(input_ids, logits_to_keep=1)` under
                  no_grad (only the last position's logits, as a prefill for generation computes)
    train         one training step, tokens/ms: forward with labels, loss = CE + λ·collect_l1,
                  backward, AdamW step. lr = 0 keeps the weights (and so the sparsity) identical
                  between the providers and across repetitions; the optimizer still does all its work
    peak memory   torch.cuda.max_memory_allocated during each
    energy        mJ per token from NVML's total-energy counter around the timed repetitions
                  (empty where NVML is absent)
    MLP share     time of the model's MLPs run alone on their captured inputs / forward time
    logits error  ‖logits_sparse − logits_dense‖ / ‖logits_dense‖ over all positions of the first
                  sequences of the batch, enough of them (≥ AUTO_MIN_TOKENS tokens) for the kernels to run
    activity      mean / max non-zeros per token over the layers and the share of tokens with a TwELL
                  tile over capacity (256-wide tiles, 32 slots: the rows the dense backup computes)
Non-MLP code: Hugging Face's RMSNorm and rotary embedding run as chains of unfused elementwise kernels
(about 40% of a dense 2B forward's GPU time on the H200). Each `non_mlp` variant is measured with both providers:
"hf" (transformers' own code) and "fused" (`sparseffn.models.fuse_non_mlp_`: one Triton kernel per norm
and per rotary embedding, for the dense and the sparse model alike); ratios compare within a variant.
Timing: CUDA events around each repetition after warm-up, median. Machines are shared and noisy:
only ratios from one run are comparable.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from sparseffn.bench.common import ints, write_csv
from sparseffn.bench.timing import device_slug, run_metadata
from sparseffn.ops.decide import AUTO_MIN_TOKENS

CSV_FIELDS = (
    "gpu", "torch", "triton", "transformers", "git_sha", "model", "dtype", "attention", "target_nnz",
    "mean_nnz", "non_mlp", "batch", "seq_len", "tokens", "phase", "provider", "mlp_mode", "median_ms", "tokens_per_ms",
    "speedup_vs_dense", "peak_mib", "peak_vs_dense", "mj_per_token", "energy_vs_dense", "mlp_ms", "mlp_share",
    "logits_rel_err", "mlp_nnz", "mlp_max_nnz", "overflow_pct",
)
PROVIDERS = ("dense", "sparse")
NON_MLP = ("hf", "fused")  # transformers' own RMSNorm and RoPE code, or sparseffn.models.fuse_non_mlp_'s kernels


@dataclass(frozen=True)
class E2EBenchConfig:
    model: str = "2b"  # a name of sparseffn.models.MODEL_NAMES, or a checkpoint directory
    target_nnz: float = 29.0  # per layer, for random weights (ignored for checkpoints)
    batches: str = "8,32"  # forward batch sizes (× seq_len tokens)
    train_batches: str = "8"  # training-step batch sizes
    non_mlp: str = "hf,fused"  # each is measured: "hf" (transformers' RMSNorm/RoPE) and/or "fused" (ours)
    seq_len: int = 2048
    vocab_size: int = 49152
    dtype: str = "bfloat16"
    l1_coeff: float = 2e-5
    calibration_batch_size: int = 4  # sequences per calibration forward
    warmup: int = 2
    reps: int = 5
    seed: int = 0
    out_dir: str = "benchmarks/results"
    git_sha: str = ""


def _time(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        import time

        out = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - start))
        return out
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


class _Energy:
    """NVML total-energy counter (mJ) of the device, or None where NVML is absent."""

    def __init__(self, device: torch.device):
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            self._read = pynvml.nvmlDeviceGetTotalEnergyConsumption
        except Exception as exc:  # ImportError, NVMLError (library or counter missing): reported, not hidden
            self.handle = None
            self.why = f"NVML energy counter unavailable: {type(exc).__name__}: {exc}"

    def read(self) -> float | None:
        return float(self._read(self.handle)) if self.handle is not None else None


def _peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def _set_mode(mlps, mode: str) -> None:
    for mlp in mlps:
        mlp.mode = mode


def _attention_backend(model, input_ids) -> str:
    """Which SDPA kernels ran, from the kernel names of one profiled forward."""
    from torch.profiler import ProfilerActivity, profile

    if input_ids.device.type != "cuda":
        return f"{model.config._attn_implementation} (cpu)"
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(input_ids[:1], logits_to_keep=1)
    names = {e.key.lower() for e in prof.key_averages()}
    for marker, label in (("cudnn", "cudnn"), ("flash", "flash"), ("fmha", "efficient"), ("efficient", "efficient")):
        if any(marker in n for n in names):
            return f"{model.config._attn_implementation}/{label}"
    return f"{model.config._attn_implementation}/math"


def _capture_mlp_inputs(model, mlps, input_ids) -> list[torch.Tensor]:
    """The input of every MLP in one forward (no grad)."""
    captured: list[torch.Tensor] = []
    handles = [m.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach())) for m in mlps]
    try:
        with torch.no_grad():
            model(input_ids, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return captured


def _mlp_time(mlps, captured, device, warmup, reps) -> float:
    """Median time of running every MLP alone on the inputs it saw in one forward."""

    def run():
        with torch.no_grad():
            for mlp, x in zip(mlps, captured):
                mlp(x)

    return statistics.median(_time(run, device, warmup, reps))


def _activity(mlps, captured, tile: int = 256, slots: int = 32) -> tuple[float, int, float]:
    """(mean non-zeros per token, max, fraction of tokens with a TwELL tile over capacity), all layers."""
    total, count, peak, overflow = 0.0, 0, 0, 0.0
    for mlp, x in zip(mlps, captured):
        mask = mlp.activation_mask(x).reshape(-1, mlp.intermediate_size)
        nnz = mask.sum(1)
        per_tile = torch.nn.functional.pad(mask, (0, -mask.shape[1] % tile)).view(mask.shape[0], -1, tile).sum(-1)
        total += float(nnz.sum())
        count += nnz.numel()
        peak = max(peak, int(nnz.max()))
        overflow += float((per_tile > slots).any(1).float().mean()) / len(mlps)
    return total / max(count, 1), peak, overflow


def run_e2e_bench(cfg: E2EBenchConfig, device: torch.device | None = None,
                  log: Callable[[str], None] = print) -> list[dict]:
    """Run forward and training-step measurements; return the CSV rows (also written under cfg.out_dir)."""
    from importlib import metadata

    from sparseffn.models import (MODEL_NAMES, SparsityConfig, build_model, calibrate_thresholds, collect_l1,
                                  fuse_non_mlp_, load_pretrained, sparse_mlps, unfuse_non_mlp_)

    variants = _non_mlp_variants(cfg.non_mlp)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, cfg.dtype)
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    if cfg.model in MODEL_NAMES:
        model = build_model(cfg.model, SparsityConfig(l1_coeff=cfg.l1_coeff), vocab_size=cfg.vocab_size,
                            device=device, dtype=dtype, seed=cfg.seed, max_position_embeddings=cfg.seq_len)
        vocab = cfg.vocab_size
    elif Path(cfg.model).is_dir():
        model = load_pretrained(cfg.model, device=device, dtype=dtype)
        vocab = model.config.vocab_size
        mean_nnz, target = float("nan"), float("nan")
    else:
        raise ValueError(f"model must be one of {MODEL_NAMES} or a checkpoint directory, got {cfg.model!r}")
    sample = torch.randint(vocab, (max(ints(cfg.batches) + ints(cfg.train_batches)), cfg.seq_len),
                           generator=gen).to(device)
    if cfg.model in MODEL_NAMES:
        # Calibrated on the very sequences measured: within a sequence, attention gives every position a
        # common component, so deep layers' activity generalizes from a few sequences only roughly
        # (measured: 29 on 8 calibration sequences became ~118 on others at 2B).
        calib = list(sample.split(cfg.calibration_batch_size))
        layers = calibrate_thresholds(model, calib, cfg.target_nnz)
        mean_nnz, target = statistics.fmean(layer["mean_nnz"] for layer in layers), cfg.target_nnz
    mlps = sparse_mlps(model)
    for mlp in mlps:
        mlp.expected_nnz = None if mean_nnz != mean_nnz else mean_nnz
    meta = run_metadata(device)
    meta["transformers"] = metadata.version("transformers")
    if cfg.git_sha:
        meta["git_sha"] = cfg.git_sha
    common = dict(meta, model=cfg.model, dtype=cfg.dtype, attention=_attention_backend(model, sample),
                  target_nnz=target, mean_nnz=round(mean_nnz, 2), seq_len=cfg.seq_len)
    energy = _Energy(device)
    if energy.handle is None and device.type == "cuda":
        log(energy.why)
    rows: list[dict] = []
    csv_path = Path(cfg.out_dir) / device_slug(device) / "e2e.csv"

    fused = False
    for variant in variants:
        if (variant == "fused") != fused:
            (fuse_non_mlp_ if variant == "fused" else unfuse_non_mlp_)(model)
            fused = variant == "fused"
        variant_common = dict(common, non_mlp=variant)
        rows += _forward_rows(cfg, model, mlps, sample, variant_common, energy, device, log)
        write_csv(rows, csv_path, CSV_FIELDS)
        rows += _train_rows(cfg, model, mlps, sample, variant_common, energy, device, log, collect_l1)
        write_csv(rows, csv_path, CSV_FIELDS)
    if fused:
        unfuse_non_mlp_(model)
    return rows


def _non_mlp_variants(spec: str) -> list[str]:
    variants = [v.strip() for v in spec.split(",") if v.strip()]
    bad = [v for v in variants if v not in NON_MLP]
    if not variants or bad:
        raise ValueError(f"non_mlp must be a comma list of {NON_MLP}, got {spec!r}")
    return variants


def _forward_rows(cfg, model, mlps, sample, common, energy, device, log) -> list[dict]:
    from sparseffn.models import set_track_l1

    model.eval()
    set_track_l1(model, False)  # inference: no L1 penalty, so the lighter inference kernels run
    rows = []
    for batch in ints(cfg.batches):
        ids = sample[:batch]
        logit_batch = min(batch, -(-AUTO_MIN_TOKENS // cfg.seq_len))
        results = {}
        logits = {}
        for provider, mode in (("dense", "dense"), ("sparse", "auto")):
            _set_mode(mlps, mode)
            with torch.no_grad():  # enough sequences that auto mode runs the kernels (AUTO_MIN_TOKENS)
                # kept on the host: on the GPU, the dense logits would count in the sparse model's peak
                logits[provider] = model(ids[:logit_batch]).logits.float().cpu()

            def forward():
                with torch.no_grad():
                    return model(ids, logits_to_keep=1)

            peak = _peak_mib(forward, device)
            e0 = energy.read()
            times = _time(forward, device, cfg.warmup, cfg.reps)
            e1 = energy.read()
            captured = _capture_mlp_inputs(model, mlps, ids)
            mlp_ms = _mlp_time(mlps, captured, device, 1, cfg.reps)
            if provider == "dense":
                activity = _activity(mlps, captured)
            del captured
            results[provider] = (statistics.median(times), peak, None if e0 is None else (e1 - e0) / cfg.reps,
                                 mlp_ms, _modes_taken(mlps))
        err = float((logits["sparse"] - logits["dense"]).norm() / logits["dense"].norm())
        rows += _rows(common, "forward", batch, cfg.seq_len, results, err, activity)
        log(_summary("forward", batch, cfg.seq_len, results, common["non_mlp"]) + f"; MLP activity: mean "
            f"{activity[0]:.1f} max {activity[1]} non-zeros per token, {100 * activity[2]:.2f}% of tokens overflow "
            "a TwELL tile")
    return rows


def _train_rows(cfg, model, mlps, sample, common, energy, device, log, collect_l1) -> list[dict]:
    from sparseffn.models import set_track_l1

    model.train()
    set_track_l1(model, True)
    rows = []
    for batch in ints(cfg.train_batches):
        ids = sample[:batch]
        results = {}
        for provider, mode in (("dense", "dense"), ("sparse", "auto")):
            _set_mode(mlps, mode)
            step = _train_step(model, ids, cfg.l1_coeff, collect_l1)
            peak = _peak_mib(step, device)
            e0 = energy.read()
            times = _time(step, device, cfg.warmup, cfg.reps)
            e1 = energy.read()
            results[provider] = (statistics.median(times), peak, None if e0 is None else (e1 - e0) / cfg.reps,
                                 float("nan"), _modes_taken(mlps))
            del step  # and with it the optimizer's state, before the next provider's peak is measured
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows += _rows(common, "train", batch, cfg.seq_len, results, float("nan"), None)
        log(_summary("train", batch, cfg.seq_len, results, common["non_mlp"]))
    return rows


def _train_step(model, ids, l1_coeff: float, collect_l1) -> Callable[[], None]:
    """One training step on ids with a fresh AdamW at lr = 0 (the weights, so the sparsity, stay put)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.0, weight_decay=0.1, foreach=True)

    def step():
        out = model(ids, labels=ids)
        loss = out.loss + l1_coeff * collect_l1(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _modes_taken(mlps) -> str:
    """The paths the MLPs took in their last call (what each layer recorded in `last_decision`): one mode
    when all agree, else e.g. "sparse 7/10, dense 3/10"."""
    modes = [m.last_decision.mode if m.mode != "dense" and m.last_decision is not None else "dense" for m in mlps]
    counts = {mode: modes.count(mode) for mode in dict.fromkeys(modes)}
    if len(counts) == 1:
        return modes[0]
    return ", ".join(f"{mode} {n}/{len(modes)}" for mode, n in counts.items())


def _rows(common, phase, batch, seq_len, results, err, activity) -> list[dict]:
    base_ms, base_peak, base_energy, _, _ = results["dense"]
    tokens = batch * seq_len
    rows = []
    for provider, (ms, peak, mj, mlp_ms, mode) in results.items():
        rows.append(dict(
            common, batch=batch, tokens=tokens, phase=phase, provider=provider, mlp_mode=mode,
            median_ms=round(ms, 3), tokens_per_ms=round(tokens / ms, 3), speedup_vs_dense=round(base_ms / ms, 4),
            peak_mib=round(peak, 1), peak_vs_dense=round(peak / base_peak, 4) if base_peak == base_peak else "",
            mj_per_token="" if mj is None else round(mj / tokens, 4),
            energy_vs_dense="" if mj is None or not base_energy else round(mj / base_energy, 4),
            mlp_ms="" if mlp_ms != mlp_ms else round(mlp_ms, 3),
            mlp_share="" if mlp_ms != mlp_ms else round(mlp_ms / ms, 4),
            logits_rel_err="" if err != err or provider == "dense" else f"{err:.3e}",
            mlp_nnz="" if activity is None else round(activity[0], 2),
            mlp_max_nnz="" if activity is None else activity[1],
            overflow_pct="" if activity is None else round(100 * activity[2], 3),
        ))
    return rows


def _summary(phase, batch, seq_len, results, non_mlp) -> str:
    dense, sparse = results["dense"], results["sparse"]
    tokens = batch * seq_len
    return (f"{phase} {batch}x{seq_len}, non-MLP {non_mlp}: dense {tokens / dense[0]:.1f} tok/ms {dense[1]:.0f} MiB, sparse "
            f"{tokens / sparse[0]:.1f} tok/ms ({dense[0] / sparse[0]:.2f}x, mlp mode {sparse[4]}) {sparse[1]:.0f} MiB "
            f"({sparse[1] / dense[1]:.2f}x)")
