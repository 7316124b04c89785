"""The training path's dense backup, first part: up to C overflow rows as compact GEMMs.

Rows whose activation overflows a TwELL tile (some tile with more than `slots` active units) are
computed densely (docs/design.md, "Dense backup"). The persistent Triton kernels of
kernels/dense_rows_mlp*.py give each tile of 16 rows a whole pass over the weights, so a few dozen
rows occupy a few dozen SMs for milliseconds (3.6 ms of forward + backward for 81 rows at D = 2048,
H = 5632 on the H200: the cliff of the training MLP between 29 and 55 active units per token).
Here the first C entries of the overflow list (at most `gemm_capacity(M)`) run as cuBLAS GEMMs
over a gather of C rows: no host synchronisation, shapes fixed by M (CUDA graphs, torch.compile).
Entries past C go to the Triton kernels (`row_list_split`'s tail), so no row is dropped. The GEMMs
cost the same with or without overflow rows (~0.3 ms of GPU time and ~60 torch launches per step
at M = 16384), so the caller takes them only where rows are expected to overflow (ops/decide.py,
`overflow_gemm_rows`).

Gather: entry i < count takes row ids[i]; an entry past count takes `spare`, a row that is not in the
list (one exists whenever count < C <= M). Its outputs are not written (`_write_rows` writes the
row's own value back), and the backward zeroes its gathered x and dy rows, so its weight-gradient
terms are exact zeros.

Precision: g, u and e = dy Wd accumulate in fp32 from the 16-bit inputs and stay fp32 through the
relu, the product and dh (the relu decisions are the kernels'); the operands of the second GEMMs
(h, d_first, d_up) are rounded once to x's dtype, as dense torch rounds them, and every GEMM
accumulates in fp32 (the weight-gradient terms are added to the fp32 accumulators). relu' is 0 at
0 and keeps NaN.
"""

from __future__ import annotations

import torch

from sparseffn.kernels._runtime import cdiv

GEMM_FRACTION = 128  # up to M / this overflow rows (rounded up to 64, at least 64) run as GEMMs


def gemm_capacity(m: int) -> int:
    """C: how many overflow rows of an M-token call the GEMMs take (fixed by M: no recompilation)."""
    return min(m, max(64, 64 * cdiv(cdiv(m, GEMM_FRACTION), 64)))


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 from 16-bit operands (products exact, fp32 accumulation)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # CPU (the interpreter's tests): the same exact products


def _add_mm32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b for an fp32 acc and 16-bit a, b (the product in fp32, then added)."""
    acc += _mm32(a, b)


def row_list_split(ids: torch.Tensor, count: torch.Tensor, taken: int, spare: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(rows int64 [C], valid bool [C], tail) of a row list (ids int32 [M], count int32 [1] on the
    device) for C = taken entries: entry i's row (spare, a row not in the list, past count) and
    whether it is listed; tail = (ids[C:], max(count - C, 0)) for the Triton kernels."""
    valid = torch.arange(taken, device=ids.device) < count  # [C]
    rows = torch.where(valid, ids[:taken].long(), spare)
    tail = (ids[taken:], (count - taken).clamp_(min=0))
    return rows, valid, tail


def spare_row(row_flags: torch.Tensor) -> torch.Tensor:
    """int64 []: the first row with row_flags 0 (0 when every row is flagged: then no entry pads)."""
    return torch.argmin(row_flags.view(torch.uint8) if row_flags.dtype == torch.bool else row_flags)


def _gather(t: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """t's rows [C, D], the padding entries' rows zeroed."""
    return t.index_select(0, rows).masked_fill_(~valid[:, None], 0)


def _write_rows(out: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, new: torch.Tensor) -> None:
    """out[rows[i]] = new[i] where valid[i]; padding entries write their row's own value back."""
    mask = valid.view(-1, *([1] * (new.dim() - 1)))
    out.index_copy_(0, rows, torch.where(mask, new.to(out.dtype), out.index_select(0, rows)))


def overflow_rows_forward(x, gate_weight, up_weight, down_t, threshold, rows, valid, *, y, row_l1) -> None:
    """y[r] and row_l1[r] (Σ_j |h_rj|, fp32) of the listed rows r, computed densely."""
    first = gate_weight if gate_weight is not None else up_weight
    xg = x.index_select(0, rows)  # [C, D] (padding rows are computed, then not written)
    h = _mm32(xg, first.t())  # [C, H] fp32: g, then h in place
    if threshold is not None:
        h -= threshold
    h.relu_()  # relu(NaN) stays NaN
    if gate_weight is not None:
        h *= _mm32(xg, up_weight.t())
    _write_rows(y, rows, valid, torch.mm(h.to(x.dtype), down_t))
    _write_rows(row_l1, rows, valid, torch.linalg.vector_norm(h, 1, dim=1))


def overflow_rows_backward(x, dy, gate_weight, up_weight, down_t, threshold, l1_grad, rows, valid, *,
                           dx, grad_gate, grad_up, grad_down_t) -> None:
    """dx[r] of the listed rows r, and their terms added to the fp32 [H, D] weight-gradient
    accumulators (grad_gate None when not gated). l1_grad fp32 [1] (∂L/∂l1 / M) or None."""
    gated = gate_weight is not None
    first = gate_weight if gated else up_weight
    low = x.dtype
    xg = _gather(x, rows, valid)  # [C, D]
    dyg = _gather(dy, rows, valid)
    g = _mm32(xg, first.t())  # [C, H] fp32
    if threshold is not None:
        g -= threshold
    off = g <= 0.0  # relu's flat side (NaN stays on)
    p = g.relu_()
    dh = _mm32(dyg, down_t.t())  # [C, H] fp32: dy Wd
    if gated:
        u = _mm32(xg, up_weight.t())
        h = p * u
    else:
        h = p
    if l1_grad is not None:
        dh += torch.sign(h) * l1_grad
    if gated:
        d_first = (dh * u).masked_fill_(off, 0.0).to(low)
        d_up = dh.mul_(p).to(low)
    else:
        d_first = dh.masked_fill_(off, 0.0).to(low)
    dx_new = _mm32(d_first, first)  # [C, D] fp32
    if gated:
        _add_mm32(dx_new, d_up, up_weight)
        _add_mm32(grad_gate, d_first.t(), xg)
        _add_mm32(grad_up, d_up.t(), xg)
    else:
        _add_mm32(grad_up, d_first.t(), xg)
    _add_mm32(grad_down_t, h.to(low).t(), dyg)
    _write_rows(dx, rows, valid, dx_new)
