"""The attention side of one decode step, in three launches (inference, one new token per sequence).

    decode_qkv_rope(hidden, norm_weight, eps, wq, wk, wv, bq, bk, bv, cos_table, sin_table,
                    positions, k_cache, v_cache, *, pending=None) -> q [B, Hq, d]
        RMSNorm (Llama's: fp32 statistics, x·rstd rounded to x's dtype, times norm_weight, rounded),
        q/k/v projections (+ optional biases), RoPE of q and k at positions[b] (Hugging Face rotary
        layout), k and v written into k_cache / v_cache [B, Hkv, S_max, d] at [b, :, positions[b]].
    decode_attention(q, k_cache, v_cache, positions, scaling, valid_from=None, *, counters=None,
                     prefetch=False) -> [B, Hq·d]
        softmax(q k^T · scaling) v over slots valid_from[b] .. positions[b] inclusive, fp32 softmax
        and accumulation, q's dtype, laid out as o_proj reads it.
    decode_out_proj(attn, wo, bo, residual, *, out=None, pending=None) -> [B, D]
        residual + (attn wo^T + bo rounded to the dtype), rounded again (as two Hugging Face ops).

pending (fp32 [B, D], or None): the output of the MLP before, left unadded by decode_mlp_block's
fold_into; hidden (and the residual) then stand for round(hidden + round(pending)), torch's residual
add, and decode_out_proj zeroes pending once it has read it (ready for the next fold).

hidden [B, D] bf16 / fp16 (B = 1 .. 64); norm_weight [D]; wq [Hq·d, D], wk / wv [Hkv·d, D], wo [D, Hq·d]
in hidden's dtype with unit stride along their last dim; biases [N] or None; cos_table / sin_table
[S_max', d] (any float dtype, rows indexed by position); positions, valid_from [B] int32 / int64 on
the device. Nothing reads a tensor's values on the host, so every call can be captured in a CUDA graph
and replayed with new positions. The math is ops/decode_reference.py's; the kernels' layouts are in
kernels/decode_attn_proj.py (the projections) and kernels/decode_attention.py. Each function is one
Triton launch (on CUDA, or on CPU under TRITON_INTERPRET=1), registered as a custom op
(`sparseffn::decode_qkv_rope`, which mutates the caches, `::decode_attention`, `::decode_out_proj`)
with a fake implementation for torch.compile; inference only (no autograd).
"""

from __future__ import annotations

import numbers

import torch

from sparseffn.kernels._runtime import DTYPES, check_capability, interpreting
from sparseffn.kernels.decode_attention import launch_decode_attention
from sparseffn.kernels.decode_attn_proj import launch_decode_out_proj, launch_decode_qkv_rope
from sparseffn.ops.dispatch import eager_call

MAX_BATCH = 64
INDEX_DTYPES = (torch.int32, torch.int64)

__all__ = ["MAX_BATCH", "decode_attention", "decode_out_proj", "decode_qkv_rope"]


# ----------------------------------------------------------------------------------------------------
# checks (once, at the op boundary)


def _check_device(t: torch.Tensor, name: str) -> None:
    if not t.is_cuda and not interpreting():
        raise ValueError(f"{name} must be a CUDA tensor (CPU tensors run only under TRITON_INTERPRET=1), "
                         f"got {t.device}")
    check_capability(t.device, "the decode attention kernels")


def _check(t: object, name: str, shape: tuple, dtype, device, *, unit_last: bool = True) -> None:
    """t is a tensor of `shape` (None entries: any size), `dtype` (a dtype or a tuple), on `device`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {expected}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")
    if unit_last and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dim, got strides {t.stride()}")


def _check_batch(x: object, name: str) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [B, D], got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{name} must be bf16 or fp16, got {x.dtype}")
    b, d = x.shape
    if not 1 <= b <= MAX_BATCH:
        raise ValueError(f"{name} must have 1 to {MAX_BATCH} rows (one new token per sequence), got {b}")
    _check_device(x, name)
    return b, d


def _check_caches(k_cache, v_cache, b: int, hkv: int | None, d: int | None, dtype, device) -> tuple[int, int, int]:
    _check(k_cache, "k_cache", (b, hkv, None, d), dtype, device)
    hkv, s_max, d = k_cache.shape[1:]
    _check(v_cache, "v_cache", (b, hkv, s_max, d), dtype, device)
    return hkv, s_max, d


def _check_positions(t: object, name: str, b: int, device) -> None:
    _check(t, name, (b,), INDEX_DTYPES, device, unit_last=False)


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


# ----------------------------------------------------------------------------------------------------
# custom ops (what torch.compile and other tracers see; eager calls launch directly)


@torch.library.custom_op("sparseffn::decode_qkv_rope", mutates_args=("k_cache", "v_cache"))
def _qkv_rope_op(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, wq: torch.Tensor, wk: torch.Tensor,
                 wv: torch.Tensor, bq: torch.Tensor | None, bk: torch.Tensor | None, bv: torch.Tensor | None,
                 cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
    return launch_decode_qkv_rope(hidden, norm_weight, eps, wq, wk, wv, bq, bk, bv, cos_table, sin_table,
                                  positions, k_cache, v_cache, pending)


@_qkv_rope_op.register_fake
def _(hidden, norm_weight, eps, wq, wk, wv, bq, bk, bv, cos_table, sin_table, positions, k_cache, v_cache, pending):
    d = cos_table.shape[1]
    return hidden.new_empty((hidden.shape[0], wq.shape[0] // d, d))


@torch.library.custom_op("sparseffn::decode_attention", mutates_args=("counters",))
def _attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                  scaling: float, valid_from: torch.Tensor | None, counters: torch.Tensor | None,
                  prefetch: bool) -> torch.Tensor:
    return launch_decode_attention(q, k_cache, v_cache, positions, scaling, valid_from, counters, prefetch)


@_attention_op.register_fake
def _(q, k_cache, v_cache, positions, scaling, valid_from, counters, prefetch):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


@torch.library.custom_op("sparseffn::decode_out_proj", mutates_args=())
def _out_proj_op(attn: torch.Tensor, wo: torch.Tensor, bo: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    return launch_decode_out_proj(attn, wo, bo, residual)


@_out_proj_op.register_fake
def _(attn, wo, bo, residual):
    return attn.new_empty((attn.shape[0], wo.shape[0]))


# its own op: a mutated argument may not be optional under Inductor
@torch.library.custom_op("sparseffn::decode_out_proj_pending", mutates_args=("pending",))
def _out_proj_pending_op(attn: torch.Tensor, wo: torch.Tensor, bo: torch.Tensor | None, residual: torch.Tensor,
                         pending: torch.Tensor) -> torch.Tensor:
    return launch_decode_out_proj(attn, wo, bo, residual, None, pending)


@_out_proj_pending_op.register_fake
def _(attn, wo, bo, residual, pending):
    return attn.new_empty((attn.shape[0], wo.shape[0]))


# ----------------------------------------------------------------------------------------------------
# public functions


def decode_qkv_rope(hidden, norm_weight, eps, wq, wk, wv, bq, bk, bv, cos_table, sin_table, positions,
                    k_cache, v_cache, *, pending=None) -> torch.Tensor:
    """q [B, Hq, d]: the normed, projected and rotated query of each sequence's new token; its rotated
    key and its value are written into k_cache / v_cache [B, Hkv, S_max, d] at [b, :, positions[b]]
    (module docstring; pending: added to hidden first). positions[b] must lie in [0, S_max) and below
    cos_table's rows (not checked: reading it would wait for the device)."""
    b, dim = _check_batch(hidden, "hidden")
    dtype, device = hidden.dtype, hidden.device
    if pending is not None:
        _check(pending, "pending", (b, dim), torch.float32, device)
    eps = _check_eps(eps)
    _check(norm_weight, "norm_weight", (dim,), dtype, device)
    _check(cos_table, "cos_table", (None, None), (torch.float32, torch.bfloat16, torch.float16), device)
    s_rope, d = cos_table.shape
    _check(sin_table, "sin_table", (s_rope, d), cos_table.dtype, device)
    if d % 2 or d < 2:
        raise ValueError(f"cos_table's head dim d must be even and >= 2, got {d}")
    _check(wq, "wq", (None, dim), dtype, device)
    if wq.shape[0] % d:
        raise ValueError(f"wq must have Hq·d rows with d = {d} (cos_table's last dim), got {wq.shape[0]}")
    _check(wk, "wk", (None, dim), dtype, device)
    if wk.shape[0] % d or not wk.shape[0] or (wq.shape[0] // d) % (wk.shape[0] // d):
        raise ValueError(f"wk must have Hkv·d rows, d = {d}, Hkv dividing Hq = {wq.shape[0] // d}, got {wk.shape[0]}")
    _check(wv, "wv", tuple(wk.shape), dtype, device)
    for name, bias, w in (("bq", bq, wq), ("bk", bk, wk), ("bv", bv, wv)):
        if bias is not None:
            _check(bias, name, (w.shape[0],), dtype, device)
    _check_positions(positions, "positions", b, device)
    _check_caches(k_cache, v_cache, b, wk.shape[0] // d, d, dtype, device)
    args = (hidden, norm_weight, eps, wq, wk, wv, bq, bk, bv, cos_table, sin_table, positions, k_cache, v_cache,
            pending)
    if eager_call(hidden, norm_weight, wq, wk, wv, bq, bk, bv, cos_table, sin_table, positions, k_cache, v_cache,
                  pending):
        return launch_decode_qkv_rope(*args)
    return _qkv_rope_op(*args)


def decode_attention(q, k_cache, v_cache, positions, scaling, valid_from=None, *, counters=None,
                     prefetch=False) -> torch.Tensor:
    """[B, Hq·d] in q's dtype: each query head q [B, Hq, d] attends to its key/value head's cache slots
    valid_from[b] .. positions[b] (module docstring). Rows with valid_from[b] > positions[b] have
    nothing to attend to and come out NaN.

    counters: None, or an int32 tensor of at least B·Hkv zeros that the split-KV combine counts
    arrivals in and leaves zero; keeping one across calls (every layer of a step may share it, as
    they run one after another) saves a fill launch per call.

    prefetch: the caller's promise that no kernel still running on the device writes positions,
    valid_from or any cache slot but positions[b] (true in a decode step: positions come from its first
    op, the older slots from earlier steps); where the launch is a programmatic dependent (few sequences,
    Hopper) the kernel then reads them before waiting for the launch before it. The same result."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [B, Hq, d], got {getattr(q, 'shape', type(q).__name__)}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q must be bf16 or fp16, got {q.dtype}")
    b, hq, d = q.shape
    if not 1 <= b <= MAX_BATCH:
        raise ValueError(f"q must have 1 to {MAX_BATCH} sequences, got {b}")
    if q.stride(-1) != 1 and d > 1:
        raise ValueError(f"q must have unit stride along d, got strides {q.stride()}")
    _check_device(q, "q")
    hkv, _, _ = _check_caches(k_cache, v_cache, b, None, d, q.dtype, q.device)
    if hq % hkv:
        raise ValueError(f"q's {hq} heads must be a multiple of the caches' {hkv} key/value heads")
    if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
        raise TypeError(f"scaling must be a number, got {type(scaling).__name__}")
    _check_positions(positions, "positions", b, q.device)
    if valid_from is not None:
        _check_positions(valid_from, "valid_from", b, q.device)
    if counters is not None:
        _check(counters, "counters", (None,), torch.int32, q.device)
        if counters.shape[0] < b * hkv:
            raise ValueError(f"counters must hold at least B·Hkv = {b * hkv} int32 zeros, got {counters.shape[0]}")
    if not isinstance(prefetch, bool):
        raise TypeError(f"prefetch must be a bool, got {type(prefetch).__name__}")
    args = (q, k_cache, v_cache, positions, float(scaling), valid_from, counters, prefetch)
    if eager_call(q, k_cache, v_cache, positions, valid_from, counters):
        return launch_decode_attention(*args)
    return _attention_op(*args)


def decode_out_proj(attn, wo, bo, residual, *, out=None, pending=None) -> torch.Tensor:
    """residual + attn wo^T (+ bo), [B, D] in attn's dtype, into `out` when given (a [B, D] tensor;
    it may be `residual` itself). attn [B, K], wo [D, K], bo [D] or None, residual [B, D]; pending
    (module docstring) added to the residual first, then zeroed."""
    b, k = _check_batch(attn, "attn")
    _check(wo, "wo", (None, k), attn.dtype, attn.device)
    dim = wo.shape[0]
    if bo is not None:
        _check(bo, "bo", (dim,), attn.dtype, attn.device)
    _check(residual, "residual", (b, dim), attn.dtype, attn.device)
    if out is not None:
        _check(out, "out", (b, dim), attn.dtype, attn.device)
        if out.untyped_storage().data_ptr() == attn.untyped_storage().data_ptr():
            raise ValueError("out must not share memory with attn (every program reads all of attn's row)")
    if pending is not None:
        _check(pending, "pending", (b, dim), torch.float32, attn.device)
    if eager_call(attn, wo, bo, residual, out, pending):
        return launch_decode_out_proj(attn, wo, bo, residual, out, pending)
    y = (_out_proj_op(attn, wo, bo, residual) if pending is None
         else _out_proj_pending_op(attn, wo, bo, residual, pending))
    return y if out is None else out.copy_(y)
