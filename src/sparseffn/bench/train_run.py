"""`sparseffn bench train-run`: training runs from initialization at the paper's sparsity, auto mode against
dense mode and against λ = 0, same seed and data.

What a user of the L1 recipe runs: the model starts with about half of its MLP units active and
sparsifies as the penalty ramps up. Dense mode runs three torch GEMMs throughout; auto mode decides
per layer and per call from the layer's measured activity (nn/activity.py, ops/decide.py): dense while
activations are dense, the sparse training kernels once a layer's activity falls under the break-even.
Modes (`MODES`): "auto" and "dense" at the run's λ, "no-l1" (dense mode, λ = 0) for the quality
baseline. By default λ is the model size's `PAPER_REGIME_L1`: after the ramp, 0.3-1% of the MLP units
active per token (the paper's 2B model: 29 of 5,632), not the near-zero activity of a large λ.

Each mode trains in its own fresh process (`processes`) with an empty Triton cache of its own, so neither
the order of the modes nor what ran before on the machine decides their wall time; each run's first
logging window (kernel compilation and warm-up, allocator growth) is reported apart. The runs write
no checkpoint and no model (`save_weights=False`): the wall time is training and evaluation.
CSV `train_run.csv` with the GPU name and git sha: one row per logging window and mode (tokens/s,
active units per token, layers on the sparse path, held-out CE where evaluated) and a summary row per
mode (wall time, warm-up, final held-out CE). `train_run_table` prints the windows side by side and the
phase ratios (`summarize`).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from sparseffn._child_env import child_env
from sparseffn.bench.common import pyplot, run_in_own_process, save_figure, write_csv
from sparseffn.bench.timing import device_slug, run_metadata
from sparseffn.train.profiling import parse_steps

# λ per model size that lands a run from initialization (8 x 2048 tokens per step, lr 1e-3, λ ramped over
# 100 steps) at 0.3-1% active MLP units per token after the ramp, and under auto mode's switch to the
# training kernels (TRAIN_MAX_NNZ, with hysteresis: 32 units at D=2048/H=5632). H200 runs (git 6b3be65):
# `2b` at 2e-4 went 30 -> 15 units per token over steps 150-200; `0.5b` at 2e-4 went 23 -> 5 over steps
# 150-400, too sparse late, so 0.5b takes 1.5e-4 (an interpolation, not yet measured: collect_l1 averages
# over layers, so each of 0.5b's 8 layers feels λ/8 where 2b's 38 feel λ/38, yet 0.5b sparsified only a
# little faster). Sizes without an entry need --l1-coeff.
PAPER_REGIME_L1 = {"0.5b": 1.5e-4, "1b": 2e-4, "1.5b": 2e-4, "2b": 2e-4}
# mode -> (sparse_mlp mode of every layer, λ: None = the run's)
MODES = {"auto": ("auto", None), "dense": ("dense", None), "no-l1": ("dense", 0.0)}

CSV_FIELDS = (
    "gpu", "torch", "triton", "git_sha", "model", "mode", "kind", "l1_coeff", "tokens_per_step", "step",
    "elapsed_s", "tokens_per_s", "zeros_pct", "nnz_mean_all", "sparse_layers", "layers", "ce", "eval_ce",
    "nnz_mean", "path", "wall_s", "warmup_s", "kernel_warm_s", "background_warm_s", "final_eval_ce", "process",
)


@dataclass(frozen=True)
class TrainRunBenchConfig:
    model: str = "0.5b"
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 2048
    l1_coeff: float | None = None  # None: PAPER_REGIME_L1[model]
    l1_warmup_steps: int = 100
    lr: float = 1e-3
    data: str = ""  # text file or directory; empty = the default corpus
    tokenizer: str = "byte"
    log_interval: int = 10
    eval_interval: int = 50
    eval_batches: int = 4
    modes: str = "auto,dense,no-l1"
    processes: bool = True  # each mode in its own fresh Python process
    sparse_share: float = 0.9  # the sparse phase: windows where at least this share of auto's layers run sparse
    table_window: int = 50  # steps per row of the printed table (the CSV keeps every logging window)
    fuse_non_mlp: bool | None = None  # None: the training default (fused norms/RoPE on CUDA)
    warm_kernels: bool = True
    compile_non_mlp: bool = False  # torch.compile of every norm and attention module (both modes)
    profile_steps: str = ""  # "A-B": each mode's steps A..B under torch.profiler (train_run_profile_<model>_<mode>.txt)
    seed: int = 0
    out_dir: str = "benchmarks/results"
    git_sha: str = ""

    def __post_init__(self) -> None:
        unknown = [m for m in self.mode_list if m not in MODES]
        if unknown or not self.mode_list:
            raise ValueError(f"--modes must be a comma-separated list of {tuple(MODES)}, got {self.modes!r}")
        if self.l1_coeff is None and self.model not in PAPER_REGIME_L1:
            raise ValueError(f"--l1-coeff: no paper-regime λ is set for --model {self.model!r} (sizes with one: "
                             f"{', '.join(PAPER_REGIME_L1)}); give --l1-coeff")
        if self.l1_coeff is not None and not (self.l1_coeff >= 0 and math.isfinite(self.l1_coeff)):
            raise ValueError(f"--l1-coeff must be a finite number >= 0, got {self.l1_coeff}")
        parse_steps(self.profile_steps)
        if not 0.0 < self.sparse_share <= 1.0:
            raise ValueError(f"--sparse-share must lie in (0, 1], got {self.sparse_share}")
        for name in ("table_window", "log_interval", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    @property
    def mode_list(self) -> list[str]:
        return [m.strip() for m in self.modes.split(",") if m.strip()]

    @property
    def l1(self) -> float:
        """The λ of the auto and dense runs."""
        return self.l1_coeff if self.l1_coeff is not None else PAPER_REGIME_L1[self.model]


def run_train_run_bench(cfg: TrainRunBenchConfig, device: torch.device | None = None,
                        log: Callable[[str], None] = print) -> list[dict]:
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = run_metadata(device)
    if cfg.git_sha:
        meta["git_sha"] = cfg.git_sha
    rows: list[dict] = []
    path = Path(cfg.out_dir) / device_slug(device) / "train_run.csv"
    work = Path(tempfile.mkdtemp(prefix="sparseffn-train-run-"))
    try:
        configs = {mode: _train_config(cfg, mode, device, work / mode) for mode in cfg.mode_list}  # all checked first
        for mode, train_cfg in configs.items():
            log(f"--- {mode}: λ {train_cfg.sparsity.l1_coeff:g}, {train_cfg.sparsity.mode} mode, "
                f"{'own process' if cfg.processes else 'this process'}")
            metrics_path, seconds = (_in_process if not cfg.processes else _in_own_process)(train_cfg, log)
            rows += mode_rows(meta, cfg, mode, train_cfg.sparsity.l1_coeff, metrics_path, seconds)
            if cfg.profile_steps:
                _keep_profile(metrics_path.parent / "profile.txt", path.parent / f"train_run_profile_{cfg.model}_{mode}.txt",
                              log)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_csv(rows, path, CSV_FIELDS)
            s = rows[-1]
            log(f"{mode}: {s['wall_s']:.0f} s in all ({s['warmup_s']:.0f} s to the end of the first window), "
                f"final held-out CE {s['final_eval_ce']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _keep_profile(profile: Path, kept: Path, log: Callable[[str], None]) -> None:
    """Copy a run's profile.txt out of the temporary run directory and show its summary lines."""
    if not profile.is_file():
        raise RuntimeError(f"bench train-run: --profile-steps was given but the run wrote no {profile.name} (are the "
                           f"steps within --steps?)")
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(profile, kept)
    log(f"profile: {kept}")
    for line in profile.read_text().split("\n\n")[:2]:
        log(line)


def _train_config(cfg: TrainRunBenchConfig, mode: str, device: torch.device, out: Path):
    from sparseffn.models.config import SparsityConfig
    from sparseffn.train.config import TrainConfig

    sparse_mode, l1 = MODES[mode]
    l1 = cfg.l1 if l1 is None else l1
    return TrainConfig(
        model=cfg.model, data=cfg.data or None, tokenizer=cfg.tokenizer, seq_len=cfg.seq_len,
        batch_size=cfg.batch_size, steps=cfg.steps, lr=cfg.lr, log_interval=cfg.log_interval,
        eval_interval=cfg.eval_interval, eval_batches=cfg.eval_batches, checkpoint_interval=0, save_weights=False,
        seed=cfg.seed, device=device.type, out_dir=str(out), fuse_non_mlp=cfg.fuse_non_mlp,
        warm_kernels=cfg.warm_kernels, compile_non_mlp=cfg.compile_non_mlp, profile_steps=cfg.profile_steps,
        sparsity=SparsityConfig(l1_coeff=l1, l1_warmup_steps=cfg.l1_warmup_steps, mode=sparse_mode),
    )


def _in_process(train_cfg, log: Callable[[str], None]) -> tuple[Path, float]:
    from sparseffn.train.loop import train

    result = train(train_cfg, progress=False, echo=log)
    return result.metrics_path, result.seconds


def _in_own_process(train_cfg, log: Callable[[str], None]) -> tuple[Path, float]:
    """Train in a fresh Python process (`_child`); its output lines go to `log`."""
    out = Path(train_cfg.out_dir)
    config_path, result_path = out.with_suffix(".config.json"), out.with_suffix(".result.json")
    train_cfg.save(config_path)
    env = child_env()  # the child imports this very sparseffn
    # an empty Triton cache of its own (its warm-up child inherits it): every mode compiles as on a fresh
    # install, whatever ran before it on this machine
    env["TRITON_CACHE_DIR"] = str(out.with_suffix(".triton-cache"))
    code = f"from sparseffn.bench.train_run import _child; _child({str(config_path)!r}, {str(result_path)!r})"
    run_in_own_process(code, f"bench train-run: the run in {out.name} mode", log, env)
    result = json.loads(result_path.read_text())
    return Path(result["metrics_path"]), float(result["seconds"])


def _child(config_path: str, result_path: str) -> None:
    """A child process's whole work: train the saved TrainConfig, write (metrics path, seconds)."""
    from sparseffn.train.config import TrainConfig
    from sparseffn.train.loop import train

    result = train(TrainConfig.load(config_path), progress=False, echo=print)
    Path(result_path).write_text(json.dumps({"metrics_path": str(result.metrics_path), "seconds": result.seconds}))


def mode_rows(meta: dict, cfg: TrainRunBenchConfig, mode: str, l1: float, metrics_path: Path,
              wall_s: float) -> list[dict]:
    """One row per logging window of the run, then its summary row."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    evals = {r["step"]: r["eval_ce"] for r in records if r.get("kind") == "eval"}
    warm = sum(r["seconds"] for r in records if r.get("kind") == "warm" and not r.get("background"))
    background = sum(r.get("seconds", 0.0) for r in records if r.get("kind") == "warm" and r.get("background"))
    common = dict(meta, model=cfg.model, mode=mode, l1_coeff=l1, tokens_per_step=cfg.batch_size * cfg.seq_len,
                  process="own" if cfg.processes else "shared")
    rows = []
    for r in records:
        if r.get("kind") != "train":
            continue
        paths = r.get("path") or []
        rows.append(dict(
            common, kind="step", step=r["step"], elapsed_s=r["elapsed_s"], tokens_per_s=r["tokens_per_s"],
            zeros_pct=r.get("zeros_pct", ""), nnz_mean_all=r.get("nnz_mean_all", ""),
            sparse_layers=sum(p == "sparse" for p in paths), layers=len(paths), ce=round(r["ce"], 5),
            eval_ce="" if r["step"] not in evals else round(evals[r["step"]], 5),
            nnz_mean=json.dumps(r.get("nnz_mean", [])), path=json.dumps(paths)))
    final = evals[max(evals)] if evals else float("nan")
    rows.append(dict(common, kind="summary", wall_s=round(wall_s, 1),
                     warmup_s=rows[0]["elapsed_s"] if rows else "", kernel_warm_s=round(warm, 2),
                     background_warm_s=round(background, 2),
                     final_eval_ce=round(final, 5)))
    return rows


# ---------------------------------------------------------------------------------------------- summary


def _steps(rows: list[dict], mode: str) -> list[dict]:
    return [r for r in rows if r["kind"] == "step" and r["mode"] == mode]


def _seconds(row: dict, previous_step: int) -> float:
    """The time a logging window took: its tokens over its tokens/s."""
    return (int(row["step"]) - previous_step) * int(row["tokens_per_step"]) / float(row["tokens_per_s"])


def _windows(rows: list[dict], mode: str) -> dict[int, tuple[int, float]]:
    """step -> (window's first step, seconds) of each logging window of `mode` after its first one."""
    steps = _steps(rows, mode)
    return {int(r["step"]): (int(p["step"]), _seconds(r, int(p["step"]))) for p, r in zip(steps, steps[1:])}


def summarize(rows: list[dict], share: float = 0.9) -> dict:
    """auto against dense over the logging windows after each run's first (warm-up) window, matched
    step by step: ratios of dense time to auto time (above 1: auto is faster) in the dense phase
    (every auto layer dense at both ends of the window), the sparse phase (at least `share` of auto's
    layers sparse at both ends), after the warm-up as a whole, and the slowest window. NaN where no
    window qualifies; `most_sparse` says how far auto got (layers, of, at step)."""
    auto, dense = _windows(rows, "auto"), _windows(rows, "dense")
    state = {int(r["step"]): (int(r["sparse_layers"]), int(r["layers"])) for r in _steps(rows, "auto")}
    nnz = {int(r["step"]): r.get("nnz_mean_all", "") for r in _steps(rows, "auto")}
    sums = {"dense": [0.0, 0.0], "sparse": [0.0, 0.0], "all": [0.0, 0.0]}
    counts = {"dense": 0, "sparse": 0}
    sparse_steps: list[int] = []
    slowest = (math.inf, None)
    for step, (begin, t_auto) in auto.items():
        if step not in dense or dense[step][0] != begin:
            continue
        t_dense = dense[step][1]
        sums["all"][0] += t_dense
        sums["all"][1] += t_auto
        slowest = min(slowest, (t_dense / t_auto, (begin, step)), key=lambda s: s[0])
        (s0, layers), (s1, _) = state[begin], state[step]
        phase = "dense" if s0 == s1 == 0 else (
            "sparse" if min(s0, s1) >= math.ceil(share * layers) and layers else None)
        if phase:
            sums[phase][0] += t_dense
            sums[phase][1] += t_auto
            counts[phase] += 1
            if phase == "sparse":
                sparse_steps.append(step)
    ratio = {k: (d / a if a else float("nan")) for k, (d, a) in sums.items()}
    most = max(state.items(), key=lambda kv: (kv[1][0], -kv[0]), default=(0, (0, 0)))
    return {
        "dense_phase": ratio["dense"], "dense_windows": counts["dense"],
        "sparse_phase": ratio["sparse"], "sparse_windows": counts["sparse"], "share": share,
        "sparse_from": min(sparse_steps) if sparse_steps else None,
        "sparse_nnz": tuple(float(nnz[k]) if nnz[k] != "" else float("nan") for k in (min(sparse_steps), max(sparse_steps)))
        if sparse_steps else None,  # auto's active units per token at the first and last sparse-phase window
        "after_warmup": ratio["all"], "slowest": slowest[0] if slowest[1] else float("nan"), "slowest_steps": slowest[1],
        "most_sparse": (most[1][0], most[1][1], most[0]),
    }


def _table_rows(rows: list[dict], width: int) -> list[tuple[int, int, bool]]:
    """(first step, last step, is the warm-up window) of the printed table's rows."""
    steps = sorted({int(r["step"]) for r in rows if r["kind"] == "step"})
    if not steps:
        return []
    out, begin = [(0, steps[0], True)], steps[0]
    for step in steps[1:]:
        if step % width == 0 or step == steps[-1]:
            out.append((begin, step, False))
            begin = step
    return out


def _bucket(rows: list[dict], mode: str, begin: int, end: int) -> tuple[float, dict | None]:
    """(tokens/s of `mode` over steps (begin, end], its row at `end`)."""
    tokens, seconds, last, previous = 0, 0.0, None, 0
    for r in _steps(rows, mode):
        step = int(r["step"])
        if begin < step <= end:
            tokens += (step - previous) * int(r["tokens_per_step"])
            seconds += _seconds(r, previous)
        if step == end:
            last = r
        previous = step
    return (tokens / seconds if seconds else float("nan")), last


def _fmt(value, spec: str) -> str:
    return "–" if value in ("", None) or (isinstance(value, float) and math.isnan(value)) else format(float(value), spec)


def train_run_table(rows: list[dict], width: int = 50, share: float = 0.9) -> str:
    """Markdown: the logging windows in rows of `width` steps (the first window apart: warm-up), auto's and
    dense's tokens/s, auto's activity and sparse layers, held-out CE per mode; then the run's conditions,
    each mode's wall time and the phase ratios (`summary_lines`)."""
    summaries = {r["mode"]: r for r in rows if r["kind"] == "summary"}
    if not summaries:
        return "(no rows)"
    modes = list(summaries)
    lines = ["| steps | auto tokens/s | dense tokens/s | auto / dense | active units / token (auto) | "
             "layers sparse (auto) | held-out CE " + " / ".join(modes) + " |",
             "|---|---|---|---|---|---|---|"]
    for begin, end, warm in _table_rows(rows, width):
        speed = {m: _bucket(rows, m, begin, end) for m in modes}
        a, d = speed.get("auto", (float("nan"), None)), speed.get("dense", (float("nan"), None))
        ratio = "warm-up" if warm else _fmt(a[0] / d[0] if d[0] == d[0] and d[0] else float("nan"), ".2f") + "x"
        auto_row = a[1] or {}
        ces = " / ".join(_fmt((speed[m][1] or {}).get("eval_ce", ""), ".3f") for m in modes)
        lines.append(f"| {begin}–{end} | {_fmt(a[0], ',.0f')} | {_fmt(d[0], ',.0f')} | {ratio} | "
                     f"{_fmt(auto_row.get('nnz_mean_all', ''), '.1f')} | "
                     f"{auto_row.get('sparse_layers', '–')} of {auto_row.get('layers', '–')} | {ces} |")
    return "\n".join(lines + [""] + summary_lines(rows, share))


def summary_lines(rows: list[dict], share: float = 0.9) -> list[str]:
    """The conditions and each mode's wall time (first window, its kernel warm-up, final held-out CE) in one
    paragraph; the auto / dense ratios (`summarize`) and the CE against λ = 0 in another."""
    summaries = {r["mode"]: r for r in rows if r["kind"] == "summary"}
    first = rows[0]
    walls = "; ".join(f"{mode} {float(s['wall_s']):.0f} s ({_fmt(s['warmup_s'], '.1f')} s"
                      + (f", of it {float(s['kernel_warm_s']):.1f} s kernel warm-up" if s["kernel_warm_s"] not in
                         ("", None) and float(s["kernel_warm_s"]) > 0 else "")
                      + (f"; kernels warmed in a child process in {float(s['background_warm_s']):.1f} s"
                         if s.get("background_warm_s") not in ("", None) and float(s["background_warm_s"]) > 0
                         else "")
                      + f"; CE {_fmt(s['final_eval_ce'], '.4f')})" for mode, s in summaries.items())
    where = "its own process with an empty Triton cache" if first.get("process") == "own" else "one process"
    lines = [f"{first['gpu']}, git {first['git_sha']}, `{first['model']}`, λ "
             f"{float(next(iter(summaries.values()))['l1_coeff']):g} ramped, {int(first['tokens_per_step']):,} tokens "
             f"per step, same seed and data, each mode in {where}, no checkpoint written. Wall time (to the end "
             f"of the first window; final held-out CE): {walls}."]
    if {"auto", "dense"} <= set(summaries):
        s = summarize(rows, share)
        pct = f"{100 * share:.0f}%"
        if s["sparse_windows"]:
            sparse = (f"**{s['sparse_phase']:.2f}x** in the sparse phase (the {s['sparse_windows']} windows from step "
                      f"{s['sparse_from']} on where ≥ {pct} of auto's layers run sparse; "
                      f"{s['sparse_nnz'][0]:.1f} → {s['sparse_nnz'][1]:.1f} active units per token)")
        else:
            layers, of, step = s["most_sparse"]
            sparse = (f"no sparse phase (no window with ≥ {pct} of auto's layers sparse; at most {layers} of {of}, "
                      f"at step {step})")
        slow = s["slowest_steps"]
        auto_wall, dense_wall = float(summaries["auto"]["wall_s"]), float(summaries["dense"]["wall_s"])
        text = (f"auto / dense tokens/s: {s['dense_phase']:.2f}x in the dense phase ({s['dense_windows']} "
                f"window{'s' if s['dense_windows'] != 1 else ''}, every layer dense), {sparse}; {s['after_warmup']:.2f}x after the first window; slowest window "
                f"{s['slowest']:.2f}x" + (f" (steps {slow[0]}–{slow[1]})" if slow else "")
                + f"; whole-run wall time, warm-up and evaluations included, {dense_wall / auto_wall:.2f}x.")
        lines += ["", text]
    if "no-l1" in summaries:
        base = float(summaries["no-l1"]["final_eval_ce"])
        deltas = [f"{m} {100 * (float(s['final_eval_ce']) / base - 1):+.2f}%" for m, s in summaries.items()
                  if m != "no-l1"]
        lines[-1] += f" Final held-out CE against λ = 0: {', '.join(deltas)}."
    return lines


def plot_train_run(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, (speed, zeros) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = _steps(rows, mode)
        steps = [int(r["step"]) for r in rs]
        speed.plot(steps, [float(r["tokens_per_s"]) for r in rs], label=mode)
        zeros.plot(steps, [float(r["zeros_pct"]) if r["zeros_pct"] != "" else float("nan") for r in rs], label=mode)
        if mode == "auto":
            layers = max(int(r["layers"]) for r in rs) if rs else 1
            frac = [100.0 * int(r["sparse_layers"]) / max(layers, 1) for r in rs]
            zeros.plot(steps, frac, ls="--", label="auto: % of layers on the sparse path")
    speed.set_xlabel("step")
    speed.set_ylabel("tokens/s")
    speed.legend()
    zeros.set_xlabel("step")
    zeros.set_ylabel("%")
    zeros.set_title("MLP activations that are zero")
    zeros.legend(fontsize=8)
    return save_figure(fig, path)
