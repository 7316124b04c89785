"""The sparse MLP for training: forward + backward on TwELL with the L1 penalty folded in.

Math (docs/design.md), HF layouts, θ a per-unit constant:

    gated:      g = x Wg^T, p = relu(g - θ), u = x Wu^T, h = p ⊙ u
    non-gated:  p = relu(x Wu^T - θ), h = p
    y = h Wd^T,   l1 = (1/M) Σ_m Σ_j |h_mj|

    dh = (dy Wd)|_supp(p) + (∂L/∂l1 / M) sign(h)       (the L1 gradient folded into dh)
    gated:      du = dh ⊙ p,  dg = dh ⊙ u ⊙ 1[g > θ],  dx = du Wu + dg Wg,  dWu = du^T x,  dWg = dg^T x
    non-gated:  df = dh ⊙ 1[x Wu^T > θ],  dx = df Wu,  dWu = df^T x
    dWd = dy^T h

Forward (no host synchronisation):
    1. kernels/gate_twell.py       the first GEMM packs p into TwELL (values, columns, counts)
    2. kernels/twell_train.py      ordinary rows: u on p's support (kept per slot, fp32), y, Σ|h|;
                                   rows with a tile over capacity are flagged (row_flags, on device)
                                   and long rows split over programs (kernels/row_split.py)
    3. ops/overflow_rows.py        flagged rows: y and Σ|h| densely, exact: up to gemm_rows of them
                                   as compact GEMMs, any past those through kernels/dense_rows_mlp.py
Saved for backward: the TwELL of p, u per slot, row flags — no dense [M, H] tensor. Backward:
    4. kernels/twell_train.py      ordinary rows: dh on the support (+ L1 term), du, dg per slot, dx
    5. kernels/unit_grads.py       the slots grouped by unit (CSR, on device, with their coefficients
                                   moved into entry order), then per unit dWg[j], dWu[j], dWd^T[j]
                                   gathered from x and dy rows (fp32)
    6. ops/overflow_rows.py        flagged rows: dx, and their weight-gradient terms added (GEMMs, then
                                   kernels/dense_rows_mlp_backward.py for any past gemm_rows)
Weight gradients accumulate in fp32 and are rounded to the weights' dtype once (kernels/convert.py).

Both halves are `torch.library` custom ops (`sparseffn::sparse_mlp_train_fwd` / `_bwd`) with fake
implementations, and the forward has a registered autograd formula, so torch.compile, export and other
tracers see one opaque differentiable op. Eager calls run the same two implementations through a
`torch.autograd.Function` instead, without the custom-op dispatch (ops/dispatch.py). Either way
activation checkpointing (the recompute runs the same path) and DDP/FSDP (weights are ordinary tensors
read only inside forward and backward) see ordinary differentiable calls.
"""

from __future__ import annotations

import torch

from sparseffn.kernels._runtime import cdiv
from sparseffn.kernels.convert import convert
from sparseffn.kernels.dense_rows_mlp import compact_rows, cuda_supported, launch_dense_rows
from sparseffn.kernels.dense_rows_mlp_backward import launch_dense_rows_backward
from sparseffn.kernels.gate_twell import gate_twell
from sparseffn.kernels.row_split import new_row_list
from sparseffn.kernels.twell_train import twell_train_backward, twell_train_forward
from sparseffn.kernels.unit_grads import SlotCoefficients, launch_slots_by_unit, launch_unit_weight_grads
from sparseffn.ops.dispatch import eager_call
from sparseffn.ops.overflow_rows import overflow_rows_backward, overflow_rows_forward, row_list_split, spare_row
from sparseffn.ops.twell_mlp import stored_transposed, transposed_down


def _aligned(weight: torch.Tensor | None) -> torch.Tensor | None:
    """The weight itself, or an aligned copy where the dense-rows kernels cannot read it on CUDA (a
    view at an odd offset or row stride): gradients of the copy are the weight's gradients."""
    if weight is None or not weight.is_cuda or cuda_supported(weight.shape[1], weight):
        return weight
    return weight.clone(memory_format=torch.contiguous_format)


def _empty_slots(x: torch.Tensor, n_tiles: int, slots: int) -> torch.Tensor:
    return torch.empty(x.shape[0], n_tiles, slots, dtype=torch.float32, device=x.device)


def _train_forward(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | None,
    tile: int,
    slots: int,
    gemm_rows: int,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [M, D], l1 fp32 [], values, columns, counts, u_slots fp32, row_flags bool [M]) for x [M, D].

    u_slots is [M, n_tiles, slots] when gated, [0] otherwise. threshold: fp32 [H] or None. gemm_rows:
    how many overflow rows (at most, if that many overflow) run as GEMMs (ops/overflow_rows.py).
    """
    m, d = x.shape
    gated = gate_weight is not None
    gate_weight, up_weight = _aligned(gate_weight), _aligned(up_weight)
    first = gate_weight if gated else up_weight
    values, columns, counts = gate_twell(x, first, threshold, tile=tile, slots=slots)
    row_flags = torch.empty(m, dtype=torch.bool, device=x.device)
    down_t = transposed_down(down_weight)
    y = torch.empty(m, d, dtype=x.dtype, device=x.device)
    u_slots = _empty_slots(x, values.shape[1], slots) if gated else x.new_empty(0, dtype=torch.float32)
    row_l1 = torch.empty(m, dtype=torch.float32, device=x.device)
    # the overflow rows as flags (the backward's) and as a list (the dense backup's, no scan of M flags)
    overflow = new_row_list(m, x.device)
    twell_train_forward(x, values, columns, counts, up_weight, down_t, tile=tile, gated=gated, out=y,
                        u_out=u_slots if gated else None, row_l1_out=row_l1, overflow_out=row_flags,
                        overflow_list=overflow, deterministic=deterministic)
    # x, the weights and θ were checked by the two launches above; y, row_l1 and the list are ours.
    # Deterministic: the ascending list, so which rows the GEMMs take does not follow the programs' timing.
    taken = min(gemm_rows, m) if d else 0
    tail = compact_rows(row_flags) if taken and deterministic else overflow
    if taken:
        rows, valid, tail = row_list_split(*tail, taken, spare_row(row_flags))
        overflow_rows_forward(x, gate_weight, up_weight, down_t, threshold, rows, valid, y=y, row_l1=row_l1)
    if taken < m:
        launch_dense_rows(x, None, gate_weight, up_weight, down_t, threshold, y, row_l1=row_l1, row_list=tail)
    l1 = row_l1.sum() / m if m else row_l1.sum()  # 0 over no tokens
    return y, l1, values, columns, counts, u_slots, row_flags


# The op is the implementation itself, registered under a name (schema from its annotations).
sparse_mlp_train_fwd = torch.library.custom_op("sparseffn::sparse_mlp_train_fwd", _train_forward, mutates_args=())


@sparse_mlp_train_fwd.register_fake
def _(x, gate_weight, up_weight, down_weight, threshold, tile, slots, gemm_rows, deterministic):
    m, d = x.shape
    n_tiles = cdiv(up_weight.shape[0], tile)
    u_rows = m if gate_weight is not None else 0
    return (
        x.new_empty(m, d),
        x.new_empty((), dtype=torch.float32),
        x.new_empty(m, n_tiles, slots),
        x.new_empty(m, n_tiles, slots, dtype=torch.int16),
        x.new_empty(m, n_tiles, dtype=torch.int32),
        x.new_empty(u_rows, n_tiles, slots, dtype=torch.float32) if u_rows else x.new_empty(0, dtype=torch.float32),
        x.new_empty(m, dtype=torch.bool),
    )


def _train_backward(
    dy: torch.Tensor,
    l1_grad: torch.Tensor,
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | None,
    values: torch.Tensor,
    columns: torch.Tensor,
    counts: torch.Tensor,
    u_slots: torch.Tensor,
    row_flags: torch.Tensor,
    tile: int,
    slots: int,
    gemm_rows: int,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d gate_weight (empty [0] when non-gated), d up_weight, d down_weight).

    l1_grad: fp32 [1] on x's device, ∂L/∂l1 / M (already divided by the token count).
    """
    m, d = x.shape
    h = up_weight.shape[0]
    gated = gate_weight is not None
    n_tiles = values.shape[1]
    gate_weight, up_weight = _aligned(gate_weight), _aligned(up_weight)
    dy = dy.contiguous()
    # again (a view, or a copy not saved: a weight-sized copy per layer would outlive forward)
    down_t = transposed_down(down_weight)
    dx = torch.empty_like(x)
    du_slots = _empty_slots(x, n_tiles, slots) if gated else None
    dg_slots = _empty_slots(x, n_tiles, slots)
    twell_train_backward(dy, values, columns, counts, u_slots if gated else None, gate_weight, up_weight, down_t,
                         l1_grad, tile=tile, gated=gated, dx_out=dx, du_out=du_slots, dg_out=dg_slots,
                         deterministic=deterministic)
    # The launches below run unchecked: twell_train_backward checked dy, x, the weights and the saved
    # TwELL; the rest is allocated here (on slow hosts the checks cost more than these launches).
    coefficients = SlotCoefficients(values, dg_slots, u_slots if gated else None, du_slots)
    by_unit = launch_slots_by_unit(columns, counts, tile=tile, h=h, slots=slots, deterministic=deterministic,
                                   coefficients=coefficients)
    del coefficients, du_slots, dg_slots  # moved into by_unit's entry order
    grad_gate = torch.empty(h, d, dtype=torch.float32, device=x.device) if gated else None
    grad_up = torch.empty(h, d, dtype=torch.float32, device=x.device)
    grad_down_t = torch.empty(h, d, dtype=torch.float32, device=x.device)
    launch_unit_weight_grads(x, dy, by_unit, gated=gated, grad_gate_out=grad_gate, grad_up_out=grad_up,
                             grad_down_t_out=grad_down_t, deterministic=deterministic)
    del by_unit
    # the overflow rows in ascending order (the weight gradients add them in row order): the first
    # gemm_rows as GEMMs, the rest through the Triton kernels
    taken = min(gemm_rows, m) if d else 0
    tail = compact_rows(row_flags)
    if taken:
        rows, valid, tail = row_list_split(*tail, taken, spare_row(row_flags))
        overflow_rows_backward(x, dy, gate_weight, up_weight, down_t, threshold, l1_grad, rows, valid, dx=dx,
                               grad_gate=grad_gate, grad_up=grad_up, grad_down_t=grad_down_t)
    if taken < m:
        launch_dense_rows_backward(x, dy, row_flags, gate_weight, up_weight, down_t, threshold, l1_grad, dx_out=dx,
                                   grad_gate_acc=grad_gate, grad_up_acc=grad_up, grad_down_t_acc=grad_down_t,
                                   row_list=tail)
    # Round each fp32 accumulator and free it before the next is rounded: the peak holds three fp32
    # accumulators and one rounded gradient, not all six.
    del down_t
    d_gate = convert(grad_gate, gate_weight.dtype) if gated else x.new_empty(0)
    del grad_gate
    d_up = convert(grad_up, up_weight.dtype)
    del grad_up
    if stored_transposed(down_weight):  # the gradient in the parameter's layout: [H, D] rounded, viewed [D, H]
        d_down = convert(grad_down_t, down_weight.dtype).t()
    else:
        d_down = convert(grad_down_t, down_weight.dtype, transpose=True)  # one pass: round + transpose
    return dx, d_gate, d_up, d_down


sparse_mlp_train_bwd = torch.library.custom_op("sparseffn::sparse_mlp_train_bwd", _train_backward, mutates_args=())


@sparse_mlp_train_bwd.register_fake
def _(dy, l1_grad, x, gate_weight, up_weight, down_weight, threshold, values, columns, counts, u_slots, row_flags,
      tile, slots, gemm_rows, deterministic):
    d_gate = torch.empty_like(gate_weight) if gate_weight is not None else x.new_empty(0)
    return torch.empty_like(x), d_gate, torch.empty_like(up_weight), torch.empty_like(down_weight)


def _save(ctx, inputs, packed) -> None:
    """What backward needs: the inputs and the packed forward state (values, columns, counts, u_slots,
    row_flags), no dense [M, H] tensor. An unused y or l1 arrives in backward as None, not as zeros."""
    x, gate_weight, up_weight, down_weight, threshold, tile, slots, gemm_rows, deterministic = inputs
    ctx.save_for_backward(x, gate_weight, up_weight, down_weight, threshold, *packed)
    ctx.tile, ctx.slots, ctx.gemm_rows, ctx.deterministic = tile, slots, gemm_rows, deterministic
    ctx.set_materialize_grads(False)


def _gradients(ctx, dy, dl1, backward):
    """(dx, d gate, d up, d down) from the saved state through `backward` (the op or its implementation)."""
    x, gate_weight, up_weight, down_weight, threshold, values, columns, counts, u_slots, row_flags = ctx.saved_tensors
    m = x.shape[0]
    if dl1 is None:
        l1_grad = torch.zeros(1, dtype=torch.float32, device=x.device)
    else:
        l1_grad = (dl1.float() / max(m, 1)).reshape(1)
    if dy is None:
        dy = torch.zeros_like(x)
    dx, d_gate, d_up, d_down = backward(
        dy, l1_grad, x, gate_weight, up_weight, down_weight, threshold, values, columns, counts, u_slots, row_flags,
        ctx.tile, ctx.slots, ctx.gemm_rows, ctx.deterministic,
    )
    return dx, (d_gate if gate_weight is not None else None), d_up, d_down


def _setup_context(ctx, inputs, output):
    _save(ctx, inputs, output[2:])
    # The packed forms are bookkeeping for backward: no gradient flows through them (materialising zero
    # gradients for the [M, n_tiles, slots] outputs would cost host time and a fill kernel per step).
    ctx.mark_non_differentiable(*output[2:])


def _backward(ctx, dy, dl1, *_):
    return *_gradients(ctx, dy, dl1, sparse_mlp_train_bwd), None, None, None, None, None


sparse_mlp_train_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerTrain(torch.autograd.Function):
    """The same forward and backward as the custom ops, without their dispatch (eager calls only)."""

    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, threshold, tile, slots, gemm_rows, deterministic):
        inputs = (x, gate_weight, up_weight, down_weight, threshold, tile, slots, gemm_rows, deterministic)
        y, l1, *packed = _train_forward(*inputs)
        _save(ctx, inputs, packed)
        return y, l1

    @staticmethod
    def backward(ctx, dy, dl1):
        return *_gradients(ctx, dy, dl1, _train_backward), None, None, None, None, None


def sparse_mlp_train(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | None,
    *,
    tile: int = 256,
    slots: int = 32,
    gemm_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, D], l1) through the training kernels; x [M, D] bf16/fp16 on the kernels' device.
    gemm_rows: how many overflow rows at most run as GEMMs, the rest through the Triton dense-rows
    kernels (ops/overflow_rows.py): `gemm_capacity(M)` where rows are expected to overflow, 0 where
    none is (the GEMMs cost the same whether or not one does; ops/decide.py, `overflow_gemm_rows`)."""
    # with torch.use_deterministic_algorithms(True) every output and gradient has the same bits on every run
    deterministic = torch.are_deterministic_algorithms_enabled()
    args = (x, gate_weight, up_weight, down_weight, threshold, tile, slots, gemm_rows, deterministic)
    if eager_call(x, gate_weight, up_weight, down_weight, threshold):
        return _EagerTrain.apply(*args)
    y, l1, *_ = sparse_mlp_train_fwd(*args)
    return y, l1
