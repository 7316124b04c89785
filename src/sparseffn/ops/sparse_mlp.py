"""`sparse_mlp`: the public functional entry of the sparse MLP, and its dispatch.

Semantics are those of `ops.reference.sparse_mlp_reference`, computed in the input dtype:

    y = down(relu(x gate^T - θ) * (x up^T))        or, with gate_weight=None,  y = down(relu(x up^T - θ))

Two paths compute it:
- "sparse": Triton kernels through TwELL (ops/twell_mlp.py), registered as the custom op
  `sparseffn::twell_mlp` so torch.compile treats it as one opaque node (eager calls skip the op's
  dispatch, ops/dispatch.py). Exact for every input: rows whose tiles overflow are computed densely.
- "dense": three torch GEMMs in the input dtype.

Calls that need gradients or the L1 penalty (`return_l1=True`) take the training kernels on the sparse
path (ops/train_mlp.py: TwELL forward that keeps only the packed activation, backward with the L1
gradient folded in), registered as `sparseffn::sparse_mlp_train_fwd` / `_bwd` with autograd.

`mode="auto"` (default) picks with `choose_mode`, without looking at the data: sparse needs a CUDA
tensor in bf16/fp16, rows at least AUTO_MIN_D wide, enough tokens for the gate GEMM to fill the GPU
(or, while a CUDA graph is being captured, few enough that the sparse path's GPU time wins), and an
expected density under the measured break-even when the caller gives one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sparseffn.ops.checks import check_sparse_mlp_args
from sparseffn.ops.dispatch import eager_call
from sparseffn.ops.train_mlp import sparse_mlp_train
from sparseffn.ops.twell_mlp import (KERNEL_DTYPES, SparseMLPWeights, dense_mlp, dense_mlp_inference, threshold_vector,
                                     twell_mlp)

MODES = ("auto", "sparse", "dense")

# Auto-mode limits, from `sparseffn bench mlp` on the H200 (benchmarks/results/h200/mlp.csv, bf16):
# - tokens: sparse won from 16384 tokens (1.52x, 1.87x) and lost at 256 (~0.3 ms of host launch work per
#   call is not hidden there); at 4096 it sat on the edge (1.09x-1.21x eager) until long rows were split
#   over programs (kernels/twell_up_down.py), which cut the up/down pass there from 0.234 to 0.147 ms, so
#   auto starts at 4096 (not measured between 256 and 4096);
# - density: sparse lost at 110 non-zeros per token on both shapes (break-even ~69 at D=2048/H=5632,
#   ~83 at D=4096/H=14336, whose gathered weights no longer fit L2).
AUTO_MIN_TOKENS = 4096
# Under CUDA-graph capture the host launch work is paid once, so only GPU time counts. Graph replays on
# the H200 (`bench mlp`, bf16, D=2048/H=5632, 29 non-zeros per token, mlp_rerun_<sha>.csv), sparse vs
# dense: 33.1 vs 41.0 µs at M = 1, 35.1 vs 40.8 at 16, 42.2 vs 43.1 at 64 (even), 62.5 vs 49.0 at 256.
AUTO_MAX_CAPTURED_TOKENS = 16
# Training calls (gradients or return_l1), from `bench mlp --train` and `bench e2e` on the H200: the
# step won at 16384 tokens (1.41x) and lost at 4096 (0.47x, host-bound; 0.63x after the zero-gradient
# fix of ops/train_mlp.py); at 8192 the 2B model's whole training step came out 0.97x with the MLPs ~41%
# of it, i.e. the MLP itself ~0.94x (before that fix). So 16384.
AUTO_MIN_TOKENS_TRAIN = 16384
# Width, from benchmarks/profile_mlp.py stages on the H200 (bf16, 1-3% active, sparse vs dense ms at 16384 /
# 65536 tokens): D=2048/H=5632 won (1.14 vs 1.63, 4.17 vs 7.16), D=1024/H=2816 broke even at best (0.78 vs
# 0.50, 1.92 vs 1.95), D=768/H=2112 and below lost (1.55 vs 1.18 at 65536): narrow rows make each gathered
# unit a short read whose latency is not hidden, and the dense GEMMs are cheap anyway. So D >= 2048.
AUTO_MIN_D = 2048
AUTO_MAX_MEAN_NNZ = 64.0
AUTO_MAX_MEAN_NNZ_FRACTION = 0.01  # of H: small-H models break even at lower counts


@dataclass(frozen=True)
class ModeDecision:
    mode: str  # "sparse" or "dense"
    reason: str


def _kernels_runnable(x: torch.Tensor) -> str | None:
    """None when the Triton kernels can run on x's device, else why not."""
    if x.is_cuda:
        return None
    if os.environ.get("TRITON_INTERPRET") == "1" and x.device.type == "cpu":
        return None
    return f"x is on {x.device}: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU)"


def choose_mode(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    *,
    mode: str = "auto",
    expected_nnz: float | None = None,
    needs_grad: bool = False,
    return_l1: bool = False,
    capturing: bool | None = None,
) -> ModeDecision:
    """Which path `sparse_mlp` takes for these arguments, and why. Raises if `mode="sparse"` cannot run.

    needs_grad / return_l1 select the training kernels. capturing: whether the call is being
    captured in a CUDA graph (None: asked of torch, only for the calls it can change). Only shapes,
    dtypes and devices are looked at (no data pointers), so the decision traces under torch.compile
    (where it is made at trace time, not capturing).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "dense":
        return ModeDecision("dense", "requested")
    blockers = []
    if (why := _kernels_runnable(x)) is not None:
        blockers.append(why)
    if x.dtype not in KERNEL_DTYPES:
        blockers.append(f"x is {x.dtype}: the kernels take bf16 or fp16")
    if (needs_grad or return_l1) and x.is_cuda and x.shape[-1] % 8:
        blockers.append(f"the training kernels need D % 8 == 0 on CUDA, got D = {x.shape[-1]}")
    if mode == "sparse":
        if blockers:
            raise NotImplementedError(f"mode='sparse' cannot run: {'; '.join(blockers)}")
        return ModeDecision("sparse", "requested")
    if blockers:
        return ModeDecision("dense", blockers[0])
    if not x.is_cuda:
        return ModeDecision("dense", "auto mode never interprets kernels on CPU")
    if x.shape[-1] < AUTO_MIN_D:
        return ModeDecision("dense", f"D = {x.shape[-1]} < {AUTO_MIN_D}: too narrow for the sparse kernels to pay "
                                     "(measured break-even near D = 1024)")
    tokens = x.numel() // max(x.shape[-1], 1)
    if (needs_grad or return_l1) and tokens < AUTO_MIN_TOKENS_TRAIN:
        return ModeDecision("dense", f"{tokens} tokens < {AUTO_MIN_TOKENS_TRAIN}: too few for the training kernels "
                                     "to pay (measured break-even between 8192 and 16384)")
    limit = min(AUTO_MAX_MEAN_NNZ, AUTO_MAX_MEAN_NNZ_FRACTION * up_weight.shape[0])
    too_dense = expected_nnz is not None and expected_nnz > limit
    if tokens < AUTO_MIN_TOKENS:
        # (training calls of this size went dense above); capture is asked of torch only where it counts
        if tokens > AUTO_MAX_CAPTURED_TOKENS or too_dense or not (
                capturing if capturing is not None else torch.cuda.is_current_stream_capturing()):
            return ModeDecision("dense", f"{tokens} tokens < {AUTO_MIN_TOKENS}: the sparse path's host launch work "
                                         f"exceeds its GPU time (under CUDA-graph capture: up to "
                                         f"{AUTO_MAX_CAPTURED_TOKENS} tokens at a density under the break-even)")
        return ModeDecision("sparse", f"{tokens} tokens under CUDA-graph capture: launch work is paid once, and "
                                      f"up to {AUTO_MAX_CAPTURED_TOKENS} tokens the sparse path's GPU time is lower")
    if too_dense:
        return ModeDecision("dense", f"expected {expected_nnz:g} non-zeros per token > {limit:g}")
    return ModeDecision("sparse", f"{tokens} tokens on {x.device}")


@torch.library.custom_op("sparseffn::twell_mlp", mutates_args=())
def _twell_mlp_op(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    up_down: torch.Tensor,
    threshold: torch.Tensor | None,
    tile: int,
    slots: int,
    deterministic: bool,
) -> torch.Tensor:
    weights = SparseMLPWeights(gate_weight, up_weight, down_weight, up_down)
    return twell_mlp(x, weights, threshold, tile=tile, slots=slots, deterministic=deterministic)


@_twell_mlp_op.register_fake
def _(x, gate_weight, up_weight, down_weight, up_down, threshold, tile, slots, deterministic):
    return x.new_empty(x.shape)


def sparse_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | float | None = None,
    *,
    return_l1: bool = False,
    mode: str = "auto",
    prepared: SparseMLPWeights | None = None,
    expected_nnz: float | None = None,
    tile: int = 256,
    slots: int = 32,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = down(relu(x gate^T - θ) * (x up^T)), or down(relu(x up^T - θ)) when gate_weight is None.

    x [..., D]; gate_weight, up_weight [H, D]; down_weight [D, H] (Hugging Face layouts);
    threshold None, a number, or a per-unit tensor [H]. Returns [..., D] in x's dtype.
    Differentiable with respect to x and the three weights (the threshold is a constant).

    return_l1: also return the layer's L1 penalty (DESIGN §1), an fp32 scalar: the mean over tokens
    of Σ_j |h_j|, h = relu(x gate^T - θ) * (x up^T) (or relu(x up^T - θ)). Differentiable, so
    `loss = ce + coeff * l1` gets exactly that loss's gradient.

    mode: "auto" (see `choose_mode`), "sparse" (Triton kernels; raises NotImplementedError where
    they cannot run) or "dense". prepared: `SparseMLPWeights.prepare(gate, up, down)` built once and
    reused (without it the sparse path re-interleaves up/down on every call, and auto mode does not
    take the sparse kernels for few tokens under CUDA-graph capture). expected_nnz: the
    caller's estimate of non-zeros per token, used by auto mode. tile/slots: TwELL capacity.
    Under `torch.use_deterministic_algorithms(True)` outputs and gradients have the same bits on
    every run (by default the rows of over 128 active units past the 256th in one call may not:
    kernels/row_split.py, "Bits").
    """
    check_sparse_mlp_args(x, gate_weight, up_weight, down_weight, threshold, return_l1=return_l1, prepared=prepared,
                          expected_nnz=expected_nnz, tile=tile, slots=slots)
    if isinstance(threshold, torch.Tensor) and threshold.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("threshold requires grad: sparse_mlp treats the threshold as a constant "
                                  "(pass threshold.detach())")
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or up_weight.requires_grad or down_weight.requires_grad
        or (gate_weight is not None and gate_weight.requires_grad)
    )
    # Without `prepared`, a captured sparse call would record the up/down interleaving (a weight-sized
    # copy) into the graph: the capture rule of auto mode is for callers that pass it.
    decision = choose_mode(x, up_weight, mode=mode, expected_nnz=expected_nnz, needs_grad=needs_grad,
                           return_l1=return_l1, capturing=None if prepared is not None else False)
    if x.numel() == 0 or up_weight.numel() == 0:  # M, D or H = 0: nothing for the kernels; the dense math is exact
        return dense_mlp(x, gate_weight, up_weight, down_weight, threshold, return_l1=return_l1)
    if decision.mode == "dense":
        if needs_grad or return_l1:
            return dense_mlp(x, gate_weight, up_weight, down_weight, threshold, return_l1=return_l1)
        return dense_mlp_inference(x, gate_weight, up_weight, down_weight, threshold)
    x2d = x.reshape(-1, x.shape[-1])
    if needs_grad or return_l1:
        theta = threshold_vector(threshold, up_weight.shape[0], x.device)
        y, l1 = sparse_mlp_train(x2d.contiguous(), gate_weight, up_weight, down_weight, theta, tile=tile, slots=slots)
        return (y.view(x.shape), l1) if return_l1 else y.view(x.shape)
    if prepared is None:
        prepared = SparseMLPWeights.prepare(gate_weight, up_weight, down_weight)
    theta = threshold_vector(threshold, up_weight.shape[0], x.device)
    if eager_call(x2d, gate_weight, up_weight, down_weight, theta):
        # the op's body, without its dispatch
        y = twell_mlp(x2d, prepared, theta, tile=tile, slots=slots,
                      deterministic=torch.are_deterministic_algorithms_enabled())
    else:
        y = _twell_mlp_op(x2d, gate_weight, up_weight, down_weight, prepared.up_down, theta, tile, slots,
                          torch.are_deterministic_algorithms_enabled())
    return y.view(x.shape)
