"""Launcher (kernels/launch.py): its argument key refines Triton's specialization (CPU, against
Triton's own binder for sm_90a); launches match `kernel[grid](...)` (interpreter and GPU); the
cache keeps one entry per key, not per size."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature
from triton.tools.tensor_descriptor import TensorDescriptor

from sparseffn.kernels.launch import Launcher, _arg_key

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _probe(ptr, n, f, flag, maybe, desc, BLOCK: tl.constexpr):
    pass


def _binder():
    """Triton's per-launch binder of `_probe` for sm_90a: (bound args, specialization, options)."""
    kernel = JITFunction(_probe)
    return create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))


def _candidates() -> dict[int, list]:
    """Values per parameter position of `_probe`, of every kind the key distinguishes."""
    base = torch.zeros(4096, dtype=torch.float32)
    half = torch.zeros(4096, dtype=torch.bfloat16)
    tensors = [base, base[1:], base[4:], base[3:], half, half[8:], half[1:], torch.zeros(8, dtype=torch.int16)]
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31),
            -(2**31) - 1, -(2**31) - 16, 2**63 - 16, 2**63, 2**63 + 16, 2**64 - 16]
    others = [True, False, 1.0, 0.5, 16.0, None]
    descs = [TensorDescriptor(half, [64, 64], [64, 1], [16, 32]),
             TensorDescriptor(half[8:], [63, 64], [64, 1], [16, 32]),   # another base, shape
             TensorDescriptor(half, [32, 128], [128, 1], [16, 32]),     # another stride
             TensorDescriptor(half, [64, 64], [64, 1], [32, 32]),       # another block
             TensorDescriptor(base, [64, 64], [64, 1], [16, 32]),       # another dtype
             TensorDescriptor(half, [64, 64], [64, 1], [16, 32], padding="nan")]
    pool = tensors + ints + others
    return {0: pool, 1: pool, 2: pool, 3: pool, 4: pool, 5: descs + [None]}


def test_key_refines_tritons_specialization():
    """Two values with one key get one specialization from Triton's binder (per position: the
    binder specializes each argument on its own)."""
    binder = _binder()
    baseline = [torch.zeros(4, dtype=torch.float32), 3, 1.0, True, None, None]
    checked = 0
    for position, values in _candidates().items():
        by_key: dict[object, set] = {}
        for value in values:
            args = list(baseline)
            args[position] = value
            spec = binder(*args, BLOCK=4, debug=False, instrumentation_mode="")[1][position]
            by_key.setdefault(_arg_key(value), set()).add(spec)
        for key, specs in by_key.items():
            assert len(specs) == 1, (position, key, specs)
        checked += len(by_key)
    assert checked > 40  # the pools hit many distinct keys


def test_key_separates_what_triton_separates():
    """Spot checks of the specializations the key must tell apart."""
    x = torch.zeros(64)
    pairs = [(1, 2), (16, 17), (True, 1), (1.0, 1), (None, 0), (2**31 - 16, 2**31), (2**63 - 16, 2**63),
             (x, x[1:]), (x, x.half()), (x, x.to(torch.int32))]
    for a, b in pairs:
        assert _arg_key(a) != _arg_key(b), (a, b)
    assert _arg_key(32) == _arg_key(4096) and _arg_key(x) == _arg_key(x[4:])  # sizes alone: one key


@triton.jit
def _scale_kernel(src_ptr, dst_ptr, n, factor,
                  HAS_SRC: tl.constexpr, BLOCK: tl.constexpr, OFFSET: tl.constexpr = 0.0):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_SRC:
        v = tl.load(src_ptr + offs, mask=mask, other=0.0)
    else:
        v = tl.full([BLOCK], 1.0, tl.float32)
    tl.store(dst_ptr + offs, v * factor + OFFSET, mask=mask)


_scale = Launcher(_scale_kernel)


def _run_scale(src: torch.Tensor | None, n: int, factor: float) -> torch.Tensor:
    dst = torch.full((n + 3,), -7.0, device=DEVICE)
    _scale[(triton.cdiv(n, 64),)](src, dst, n, factor, HAS_SRC=src is not None, BLOCK=64)
    return dst


def test_launches_match_triton_for_every_kind_of_argument():
    """Sizes, offsets (alignments), None pointers, 1 and non-1 ints, in every order: the results
    are the eager math whichever path (first launch through Triton, later ones direct) ran."""
    base = torch.arange(300, dtype=torch.float32, device=DEVICE)
    cases = list(itertools.product([1, 16, 17, 200], [0, 1, 4], [True, False], [0.5, 3.0]))
    for _ in range(2):  # the second round hits the cache on the GPU
        for n, offset, has_src, factor in cases:
            src = base[offset:offset + n] if has_src else None
            got = _run_scale(src, n, factor)
            want = (src if has_src else torch.ones(n, device=DEVICE)) * factor
            assert torch.equal(got[:n], want), (n, offset, has_src, factor)
            assert (got[n:] == -7.0).all()


def test_defaulted_and_given_constexprs():
    """A trailing constexpr left at its default, then given: both launches right, twice each."""
    src = torch.arange(32, dtype=torch.float32, device=DEVICE)
    for _ in range(2):
        for offset in (None, 5.0):
            dst = torch.empty(32, device=DEVICE)
            extra = {} if offset is None else {"OFFSET": offset}
            _scale[(1,)](src, dst, 32, 2.0, HAS_SRC=True, BLOCK=32, **extra)
            assert torch.equal(dst, src * 2 + (offset or 0.0))


def test_callable_grid_goes_through_triton():
    src = torch.arange(100, dtype=torch.float32, device=DEVICE)
    dst = torch.empty(100, device=DEVICE)
    _scale[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](src, dst, 100, 3.0, HAS_SRC=True, BLOCK=32)
    assert torch.equal(dst, src * 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path")
def test_interpreter_launches_keep_no_cache():
    launcher = Launcher(_scale_kernel)
    dst = torch.zeros(10)
    launcher[(1,)](None, dst, 10, 2.0, HAS_SRC=False, BLOCK=16)
    assert torch.equal(dst, torch.full((10,), 2.0)) and launcher.cache == {}


@cuda_only
def test_cache_holds_one_entry_per_key_not_per_size():
    launcher = Launcher(_scale_kernel)
    base = torch.arange(4096, dtype=torch.float32, device="cuda")
    for n in (17, 100, 1001, 3999):  # sizes change (none a multiple of 16), the key does not
        dst = torch.empty(n, device="cuda")
        launcher[(triton.cdiv(n, 64),)](base, dst, n, 2.0, HAS_SRC=True, BLOCK=64)
        assert torch.equal(dst, base[:n] * 2)
    assert len(launcher.cache) == 1
    launcher[(1,)](base[1:], dst, 16, 2.0, HAS_SRC=True, BLOCK=64)  # misaligned source: a new key
    launcher[(1,)](base, dst, 16, 2.0, HAS_SRC=True, BLOCK=32)      # another constexpr: a new key
    assert len(launcher.cache) == 3
    assert torch.equal(dst[:16], base[:16] * 2)


@cuda_only
def test_cpu_tensor_gets_tritons_error_not_a_raw_launch():
    launcher = Launcher(_scale_kernel)
    dst = torch.empty(16, device="cuda")
    launcher[(1,)](torch.ones(16, device="cuda"), dst, 16, 1.0, HAS_SRC=True, BLOCK=16)
    for _ in range(2):  # never cached: Triton's pointer check runs every time
        with pytest.raises(ValueError, match="cpu tensor"):
            launcher[(1,)](torch.ones(16), dst, 16, 1.0, HAS_SRC=True, BLOCK=16)
    assert len(launcher.cache) == 1


@cuda_only
@pytest.mark.parametrize("how", ["chain", "assigned"])
def test_launch_hook_takes_tritons_path(how):
    from triton import knobs

    launcher = Launcher(_scale_kernel)
    seen = []
    dst = torch.empty(16, device="cuda")
    src = torch.ones(16, device="cuda")
    launcher[(1,)](src, dst, 16, 1.0, HAS_SRC=True, BLOCK=16)
    assert len(launcher.cache) == 1  # Triton's default hook chain is empty: cached
    default = knobs.runtime.launch_enter_hook
    if how == "chain":
        default.add(seen.append)
    else:
        knobs.runtime.launch_enter_hook = seen.append
    try:
        launcher[(1,)](src, dst, 16, 1.0, HAS_SRC=True, BLOCK=16)
    finally:
        default.remove(seen.append)
        knobs.runtime.launch_enter_hook = default
    assert len(seen) == 1


@cuda_only
def test_graph_capture_replays_direct_launches():
    src = torch.arange(64, dtype=torch.float32, device="cuda")
    dst = torch.empty(64, device="cuda")
    _scale[(1,)](src, dst, 64, 2.0, HAS_SRC=True, BLOCK=64)  # cached before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _scale[(1,)](src, dst, 64, 3.0, HAS_SRC=True, BLOCK=64)
    dst.zero_()
    src += 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst, src * 3)


def test_hash_kernel_sources_hashes_every_kernel_ahead_of_its_first_launch():
    """Outside the interpreter (a fresh process: these tests run under it) every kernel of sparseffn.kernels
    has its source hash computed and cached, as Triton's first launch would compute it."""
    import os
    import subprocess
    import sys

    code = ("import importlib, pkgutil\n"
            "import sparseffn.kernels as package\n"
            "from triton.runtime.jit import JITFunction\n"
            "from sparseffn.kernels.launch import hash_kernel_sources\n"
            "kernels = []\n"  # a list: a JITFunction's __hash__ would compute its source hash
            "for info in pkgutil.iter_modules(package.__path__, 'sparseffn.kernels.'):\n"
            "    module = importlib.import_module(info.name)\n"
            "    kernels += [v for n, v in vars(module).items()\n"
            "                if isinstance(v, JITFunction) and n.endswith('_kernel')]\n"
            "assert len(kernels) > 20 and all(k.hash is None for k in kernels)\n"
            "count = hash_kernel_sources()\n"
            "assert count >= len(kernels) and all(len(k.hash) == 64 for k in kernels), count\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
