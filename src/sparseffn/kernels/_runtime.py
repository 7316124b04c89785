"""What the kernel files share: launch-time facts, the dtypes they take, one MMA helper, programmatic
dependent launch."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Activation dtypes every kernel takes, and their names in Triton signatures (GPU compile specs).
DTYPES = (torch.bfloat16, torch.float16)
TL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_matrix(t: object, name: str, layout: str = "[M, D]") -> tuple[int, int]:
    """The shape of `t` after checking it is a 2-D bf16 / fp16 tensor; errors name `name` and the
    expected `layout`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must have shape {layout}, got {list(t.shape)}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} must be bf16 or fp16, got {t.dtype}")
    return t.shape[0], t.shape[1]


def check_few_tokens(x: object, max_tokens: int) -> tuple[int, int]:
    """(M, D) of a decode kernel's input x after checking it is a 2-D bf16 / fp16 tensor [M, D] with
    1 <= M <= max_tokens."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, D], got {getattr(x, 'shape', type(x).__name__)}")
    m, d = x.shape
    if not 1 <= m <= max_tokens:
        raise ValueError(f"x must have 1 to {max_tokens} rows (decode), got {m}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be bf16 or fp16, got {x.dtype}")
    return m, d


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code. triton.cdiv and triton.next_power_of_2 are constexpr functions in
    Triton 3.6: called from Python they unwrap their arguments first (microseconds of host time a
    call, paid several times per launch)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for 0), as triton.next_power_of_2, for host code."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def interpreting() -> bool:
    """Whether Triton runs kernels on CPU tensors (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# GPU generations by compute capability. The kernels need bf16 tensor cores (8.0+); Hopper-only
# instructions (TMA descriptors, PTX bf16 compares) sit behind `capability >= HOPPER` switches.
MIN_CAPABILITY = (8, 0)
HOPPER = (9, 0)
# The GPUs whose kernels were run and timed (the H200): auto mode takes the sparse path only there.
VALIDATED_CAPABILITIES = frozenset({HOPPER})
# Targets every kernel spec is compiled for in CI (tests/kernels/gpu_compile.py), with the largest
# shared memory one program may take there (opt-in limit per block, bytes): A100, A10/RTX 30, L4/L40/
# RTX 40, H100/H200, B200, RTX 50.
COMPILE_TARGETS = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024,
                   (10, 0): 227 * 1024, (12, 0): 99 * 1024}


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device (cached); HOPPER for CPU tensors, which only
    the interpreter runs (its code paths do not depend on the capability)."""
    if device.type != "cuda":
        return HOPPER
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device_index))


def shared_memory_limit(cap: tuple[int, int]) -> int:
    """Shared memory one program may use on a GPU of capability `cap` (bytes; the smallest of a
    generation's chips when the exact one is not listed)."""
    if cap in COMPILE_TARGETS:
        return COMPILE_TARGETS[cap]
    same_major = [v for (major, _), v in COMPILE_TARGETS.items() if major == cap[0]]
    return min(same_major) if same_major else min(COMPILE_TARGETS.values())


def check_capability(device: torch.device, what: str = "the sparse kernels") -> None:
    """NotImplementedError naming the capability when `device` is a GPU older than MIN_CAPABILITY."""
    if device.type == "cuda" and capability(device) < MIN_CAPABILITY:
        major, minor = capability(device)
        raise NotImplementedError(
            f"{what} need a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (bf16 tensor "
            f"cores: A100, A10, L4, H100 and newer); {torch.cuda.get_device_name(device)} is {major}.{minor}")


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: launchers call this on every launch)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def mma(a, b, acc, DOT_IN_FP32: tl.constexpr):
    """acc + a @ b, fp32 accumulation (a, b in a 16-bit dtype). DOT_IN_FP32 (set when interpreting,
    where 16-bit tl.dot is wrong) multiplies fp32 copies of the operands exactly instead."""
    if DOT_IN_FP32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


def check_config_fields(config, *, positive=(), powers_of_two=(), at_least=(), flags=()) -> None:
    """The field checks shared by the launch-config dataclasses; errors name `Class.field`.

    positive: ints >= 1; powers_of_two: powers of two among them; at_least: (names, low, why) triples,
    e.g. (("block_k",), 16, "tl.dot"); flags: bools. A `max_regs` field (the ptxas .maxnreg register
    cap) must be None or an int in [24, 255].
    """
    owner = type(config).__name__
    for name in positive:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")
    for name in powers_of_two:
        value = getattr(config, name)
        if value & (value - 1):
            raise ValueError(f"{owner}.{name} must be a power of two, got {value}")
    for names, low, why in at_least:
        for name in names:
            if getattr(config, name) < low:
                raise ValueError(f"{owner}.{name} must be >= {low} ({why}), got {getattr(config, name)}")
    for name in flags:
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"{owner}.{name} must be a bool, got {getattr(config, name)!r}")
    max_regs = getattr(config, "max_regs", None)
    if max_regs is not None and (isinstance(max_regs, bool) or not isinstance(max_regs, int)
                                 or not 24 <= max_regs <= 255):
        raise ValueError(f"{owner}.max_regs must be None or an int in [24, 255], got {max_regs!r}")


# Programmatic dependent launch (PDL, Hopper on), a `pdl` field of the decode launch configs. A kernel
# launched with it may start while the kernel before it in the stream still runs: it first lets the
# launch after it start too (`pdl_launch_dependents`), loads only what no kernel writes (weights) before
# `pdl_wait`, and touches activations, caches and scratch only after it. griddepcontrol.wait returns once
# the previous grid has finished and its writes are visible; that grid waited for its own predecessor,
# so every earlier kernel has finished too. A launch without the attribute (torch's, cuBLAS's) waits
# for the kernel before it as usual, and a kernel before it that never releases is waited for whole.
PDL_CAPABILITY = HOPPER


def pdl_by_default(m_padded: int) -> bool:
    """Whether the decode configs' defaults take pdl for a launch of `m_padded` padded tokens: at one
    token only (in the engine's captured step it paid at batch 1 and lost at 16; docs/decode_engine.md)."""
    return m_padded == 1


def pdl_options(pdl: bool, device: torch.device) -> dict:
    """The launch options of a kernel whose config asks for `pdl`: its PDL constexpr, true only where
    the GPU has the instructions (not under the interpreter, which takes no launch_pdl option), and
    Triton's launch_pdl then."""
    on = pdl and device.type == "cuda" and not interpreting() and capability(device) >= PDL_CAPABILITY
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    """Let the next kernel in the stream start (PDL): its programs wait in `pdl_wait` for this one."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible (PDL)."""
    if PDL:
        gdc_wait()
