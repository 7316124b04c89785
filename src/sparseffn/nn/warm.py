"""`warm_sparse_kernels`: compile and load the sparse kernels a model's layers may switch to, before
they switch.

Why. Triton compiles a kernel variant the first time it is launched with a new argument key (dtypes,
constexprs, alignment: kernels/launch.py). A layer in auto mode runs dense until its activity falls
under the break-even, then takes the sparse kernels: without warming, the step where the first
layers switch pays the compilation (about 18 s at `2b` on an H200, a window at a third of dense speed).

What. For every distinct layer shape (D, H, gated, threshold or not, weight layout, run dtype) and
every kind of call given (training calls of `train_tokens` tokens: forward and backward of the
training kernels; inference calls of each of `eval_tokens`), it asks the decision rules whether the
layer could take the sparse path there at all (`choose_mode` at an expected activity of one unit per
token, the most favourable case; a dense-mode layer never can), and where it could, runs that path
once on random tensors of the layer's shapes and layouts in the run dtype, drawn from a generator of
its own so that about 1% of the units fire (`_sparse_activity_inputs`), a training call with the
activity expected at the break-even, as when a layer switches (its overflow rows as GEMMs). The
launches are those of a real call of that shape (the kernels' variants depend on shapes, dtypes and
layouts, not on the values), so a later switch compiles nothing. The layers' state (activity,
decisions, gradients) and the global RNG are untouched.

`start_warming` does the same in a child process (`python -m sparseffn.nn.warm`, same GPU) while the
caller goes on training: the child's launches compile the kernels into Triton's on-disk cache (its
TRITON_CACHE_DIR, inherited). Then a thread of the training process runs the same calls (`_load`): every
kernel is in the cache by then, so this only loads them into the process (Triton's first launch of a
kernel in a process: cache lookup, module load, launcher), interleaved with the training thread instead of
on the step where a layer switches. Loading stalls the training thread's launches for part of its length
(a `2b` step lost ~0.24 s to 0.63 s of it), so what needs no compiled kernel is loaded before `start_warming` returns:
the PyTorch kernels of the overflow rows' path and of the warm-up's inputs (CUDA loads each on first use)
and Triton's source hashes. Until both are done (or one has failed, or the job is stopped) the auto-mode
layers it warms for are held dense (`Activity.hold`): a layer whose activity falls under the break-even
meanwhile switches when the kernels are ready, instead of compiling them itself on a training step
(measured: a `0.5b` window at 0.26x of dense when a layer switched 9 s before a slow child was done).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import torch

from sparseffn._child_env import child_env
from sparseffn.kernels.launch import hash_kernel_sources
from sparseffn.nn.projections import is_plain
from sparseffn.nn.sparse_mlp import SparseMLP
from sparseffn.ops.decide import overflow_gemm_rows, train_break_even
from sparseffn.ops.overflow_rows import overflow_rows_backward, overflow_rows_forward, row_list_split, spare_row
from sparseffn.ops.sparse_mlp import choose_mode, sparse_mlp

_OP_DEFAULTS = sparse_mlp.__kwdefaults__  # the op's TwELL tile and slots, which the warmed calls use


@dataclass(frozen=True)
class WarmedCall:
    """One kind of call whose kernels were run: training (forward + backward) or inference."""

    kind: str  # "training" or "inference"
    tokens: int
    d: int
    h: int
    gated: bool
    threshold: bool
    dtype: torch.dtype

    def __str__(self) -> str:
        return (f"{self.kind} {self.tokens} tokens D={self.d} H={self.h}{'' if self.gated else ' non-gated'}"
                f"{' θ' if self.threshold else ''} {str(self.dtype).removeprefix('torch.')}")


def warm_sparse_kernels(mlps: Sequence[SparseMLP], *, train_tokens: int | None = None,
                        eval_tokens: Sequence[int] = (), dtype: torch.dtype | None = None,
                        seed: int = 0) -> list[WarmedCall]:
    """Run, once per distinct layer shape and kind of call, the sparse path the layers could switch to
    (module docstring). train_tokens: tokens of one training call (None: no training calls);
    eval_tokens: tokens of the inference calls; dtype: the autocast dtype the layers run under (None:
    their weights' dtype). Returns what was run, in order."""
    planned = _plan(mlps, train_tokens, eval_tokens, dtype, seed)
    for _, run in planned:
        _run_once(**run)
    return [call for call, _ in planned]


def start_warming(mlps: Sequence[SparseMLP], *, train_tokens: int | None = None, eval_tokens: Sequence[int] = (),
                  dtype: torch.dtype | None = None, seed: int = 0) -> BackgroundWarm | None:
    """`warm_sparse_kernels` in a child process (module docstring), arguments alike; None when there is
    nothing to warm. Before it returns, this process does the part of the loading that needs no compiled
    Triton kernel (`_load_outside_triton`)."""
    planned = _plan(mlps, train_tokens, eval_tokens, dtype, seed)
    if not planned:
        return None
    job = BackgroundWarm(planned, [m for m in mlps if m.mode == "auto"])
    job.load_outside_triton()  # while the child starts and compiles
    return job


class BackgroundWarm:
    """`start_warming`'s job: the child process that compiles, then the thread that loads (module
    docstring). `calls`: what they run, in order; `poll()`: whether both have finished (RuntimeError with
    the error when one failed); `seconds`: from the start to when poll() first saw them finished;
    `stop()`: end it early (the run is over). `held`: the layers held dense until then (each one's
    `activity.hold`), released when poll() sees the job finished or failed, or on stop()."""

    HOLD = "the sparse kernels are still compiling or loading in the background warm-up (nn/warm.py)"

    def __init__(self, planned: list[tuple[WarmedCall, dict]], held: Sequence[SparseMLP] = ()) -> None:
        self.calls = [call for call, _ in planned]
        self.seconds: float | None = None
        self._runs = [run for _, run in planned]
        self._loader: threading.Thread | None = None
        self._load_error: Exception | None = None
        self._started = time.perf_counter()
        self._stderr = tempfile.TemporaryFile()
        self._process = subprocess.Popen([sys.executable, "-m", "sparseffn.nn.warm"], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=self._stderr, env=child_env())
        self.held = list(held)  # once there is a child whose end releases them
        for mlp in self.held:
            mlp.activity.hold = self.HOLD
        try:
            self._process.stdin.write(json.dumps(self._runs).encode())  # the child reads to EOF
            self._process.stdin.close()
        except BrokenPipeError:  # the child exited before reading: poll() raises with its stderr
            pass

    def poll(self) -> bool:
        if self.seconds is not None:
            return True
        if self._loader is None and self._load_error is not None:  # load_outside_triton failed: no child needed
            self.stop()
            raise RuntimeError("the background kernel warm-up failed loading PyTorch's kernels into this process: "
                               f"{self._load_error!r}") from self._load_error
        if self._loader is None:
            code = self._process.poll()
            if code is None:
                return False
            self._stderr.seek(0)
            err = self._stderr.read().decode(errors="replace")
            self._stderr.close()
            if code != 0:
                self._release()
                raise RuntimeError(f"the background kernel warm-up failed (exit {code}):\n{err[-3000:]}")
            self._loader = threading.Thread(target=self._load, name="sparseffn-warm-load", daemon=True)
            self._loader.start()
        if self._loader.is_alive():
            return False
        self._release()
        if self._load_error is not None:
            raise RuntimeError("the background kernel warm-up failed loading the compiled kernels into this "
                               f"process: {self._load_error!r}") from self._load_error
        self.seconds = time.perf_counter() - self._started
        return True

    def wait(self) -> float:
        """Block until the child and the loading thread have finished; their seconds."""
        self._process.wait()
        self.poll()
        self._loader.join()
        self.poll()
        return self.seconds

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        if not self._stderr.closed:
            self._stderr.close()
        if self._loader is not None:
            self._loader.join()  # host work of a second or so; a thread cannot be killed
        self._release()

    def load_outside_triton(self) -> None:
        """`_load_outside_triton` for each planned call and Triton's source hashes, in the calling thread
        (module docstring); an error is kept for poll(), which raises it (the run goes on without)."""
        try:
            for run in self._runs:
                with _on_device(run):
                    _load_outside_triton(**run)
            hash_kernel_sources()
        except Exception as error:  # handed to poll(), which raises it
            self._load_error = error

    def _load(self) -> None:
        """The planned calls in this process (a thread's target: an error is kept for poll())."""
        try:
            _run_planned(self._runs)
        except Exception as error:  # handed to poll(), which raises it
            self._load_error = error

    def _release(self) -> None:
        for mlp in self.held:
            if mlp.activity.hold == self.HOLD:
                mlp.activity.hold = None
        self.held = []


def _plan(mlps, train_tokens, eval_tokens, dtype, seed) -> list[tuple[WarmedCall, dict]]:
    """(the call, `_run_once`'s keyword arguments) of each call to warm, arguments checked."""
    if train_tokens is not None and (isinstance(train_tokens, bool) or not isinstance(train_tokens, int)
                                     or train_tokens < 1):
        raise ValueError(f"train_tokens must be None or a positive int, got {train_tokens!r}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in eval_tokens):
        raise ValueError(f"eval_tokens must be positive ints, got {list(eval_tokens)!r}")
    calls = ([("training", train_tokens)] if train_tokens is not None else []) + [
        ("inference", t) for t in dict.fromkeys(eval_tokens)]
    planned: list[tuple[WarmedCall, dict]] = []
    seen: set[tuple] = set()
    for mlp in mlps:
        if not isinstance(mlp, SparseMLP):
            raise TypeError(f"mlps must hold SparseMLP modules, got {type(mlp).__name__}")
        weights = _plain_weights(mlp)
        if mlp.mode == "dense" or weights is None:  # dense by request, or a path the kernels never take
            continue
        run_dtype = dtype or weights[1].dtype
        device = weights[1].device
        gated, threshold = weights[0] is not None, mlp.has_threshold
        shape = (mlp.hidden_size, mlp.intermediate_size, gated, threshold, mlp.down_transposed, device)
        for kind, tokens in calls:
            key = (kind, tokens, run_dtype, mlp.mode, *shape)
            if key in seen:
                continue
            seen.add(key)
            if _could_switch(mlp, device, tokens, kind == "training", run_dtype):
                call = WarmedCall(kind, tokens, mlp.hidden_size, mlp.intermediate_size, gated, threshold, run_dtype)
                planned.append((call, dict(
                    d=mlp.hidden_size, h=mlp.intermediate_size, gated=gated, threshold=threshold,
                    down_transposed=mlp.down_transposed, device=str(device), tokens=tokens,
                    training=kind == "training", dtype=str(run_dtype).removeprefix("torch."), seed=seed)))
    return planned


def _plain_weights(mlp: SparseMLP) -> list[torch.Tensor | None] | None:
    """[gate, up, down] weights of a layer whose forward reaches the op with them, else None (biases,
    adapters or hooks: the layer runs its modules densely)."""
    linears = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all(is_plain(lin) for lin in linears) or any(lin is not None and lin.bias is not None for lin in linears):
        return None
    return [None if lin is None else lin.weight for lin in linears]


def _could_switch(mlp: SparseMLP, device: torch.device, tokens: int, training: bool, dtype: torch.dtype) -> bool:
    """Whether the decision rules would send such a call of this layer to the sparse kernels at its most
    favourable activity (one active unit per token)."""
    probe = torch.empty((), dtype=dtype, device=device).expand(tokens, mlp.hidden_size)  # no memory
    up = torch.empty((), dtype=dtype, device=device).expand(mlp.intermediate_size, mlp.hidden_size)
    decision = choose_mode(probe, up, mode=mlp.mode, expected_nnz=1.0, needs_grad=training, return_l1=training,
                           down_t_ready=True)
    return decision.mode == "sparse"


def _run_once(d: int, h: int, gated: bool, threshold: bool, down_transposed: bool, device: str,
              tokens: int, training: bool, dtype: str, seed: int) -> None:
    """The call on random tensors of the layer's shapes and layouts (fresh ones: a layer's own weights may be
    shards, e.g. under FSDP, while its calls see whole weights); device and dtype by name (JSON)."""
    x, gate, up, down, theta = _call_inputs(d, h, gated, threshold, down_transposed, device, tokens, dtype, seed)
    if not training:
        with torch.no_grad():
            sparse_mlp(x, gate, up, down, theta, mode="sparse")
        return
    leaves = [t.requires_grad_() for t in (x, gate, up, down) if t is not None]
    with torch.enable_grad():
        y, l1 = sparse_mlp(x, gate, up, down, theta, mode="sparse", return_l1=True,
                           expected_nnz=train_break_even(h))
        torch.autograd.grad((y, l1), leaves, (torch.ones_like(y), torch.ones_like(l1)))


def _call_inputs(d: int, h: int, gated: bool, threshold: bool, down_transposed: bool, device: str, tokens: int,
                 dtype: str, seed: int) -> tuple[torch.Tensor, ...]:
    """(x, gate or None, up, down [D, H] stored as the layer stores it, θ or None) of a planned call: random
    tensors from a generator of their own, at ~1% activity (`_sparse_activity_inputs`)."""
    device, dtype = torch.device(device), getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    x, first = _sparse_activity_inputs(tokens, d, h, dtype, device, gen)
    gate, up = (first, _draw(gen, dtype, h, d)) if gated else (None, first)
    down = _draw(gen, dtype, h, d).t() if down_transposed else _draw(gen, dtype, d, h)
    theta = torch.full((h,), 0.01, device=device) if threshold else None
    return x, gate, up, down, theta


def _sparse_activity_inputs(tokens: int, d: int, h: int, dtype: torch.dtype, device: torch.device,
                            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, D] and the first projection's weight [H, D] (gate, or up when not gated) with about 1%
    of the units active per token, the activity at which layers switch, rather than the ~50% of random
    weights: the launches are the same (which kernels run follows from shapes only), but at 50% every
    row overflows its TwELL slots into the dense backup, seconds of GPU time that the training process
    sharing the GPU would wait behind. The pre-activation of unit j for token t is
    r_j . n_t - beta (e . n_t) - beta gamma (+ a term of variance ~gamma^2 / D), with r_j ~ N(0, I/D),
    n_t ~ N(0, I) and e the unit vector along (1, ..., 1): about N(-2.7, 1.25), positive ~0.8% of the time."""
    beta, gamma = 0.5, 5.4
    e = torch.full((d,), d ** -0.5, device=device)
    x = torch.randn(tokens, d, device=device, generator=gen) + gamma * e
    first = torch.randn(h, d, device=device, generator=gen) * d ** -0.5 - beta * e
    return x.to(dtype), first.to(dtype)


def _load_outside_triton(d: int, h: int, gated: bool, threshold: bool, down_transposed: bool, device: str,
                         tokens: int, training: bool, dtype: str, seed: int) -> None:
    """What a planned training call runs through PyTorch rather than Triton, at its shapes and dtypes: the
    warm-up's own inputs, and the overflow rows' GEMMs, gathers and scatters (ops/overflow_rows.py, rows
    listed here instead of by the Triton kernels). CUDA loads a kernel on its first use in a process (lazy
    module loading): done here, before the first step, these loads leave the loading thread, where they
    stalled the training thread's launches (a `2b` layer's training call: ~0.3 s of its ~0.6 s)."""
    if not training:
        return
    x, gate, up, down, theta = _call_inputs(d, h, gated, threshold, down_transposed, device, tokens, dtype, seed)
    taken = min(overflow_gemm_rows(tokens, h, train_break_even(h), _OP_DEFAULTS["tile"], _OP_DEFAULTS["slots"]),
                tokens)
    if not taken:
        return
    device = x.device
    down_t = down.t().contiguous()  # [H, D], unit stride along D, as the op reads it (no Triton copy here)
    flags = torch.zeros(tokens, dtype=torch.bool, device=device)
    flags[:taken // 2] = True
    ids = torch.arange(tokens, dtype=torch.int32, device=device)
    count = torch.full((1,), taken // 2, dtype=torch.int32, device=device)
    rows, valid, _ = row_list_split(ids, count, taken, spare_row(flags))
    y = torch.empty_like(x)
    row_l1 = torch.zeros(tokens, dtype=torch.float32, device=device)
    overflow_rows_forward(x, gate, up, down_t, theta, rows, valid, y=y, row_l1=row_l1)
    l1_grad = (row_l1.sum() / tokens).reshape(1)
    grads = [torch.zeros(h, d, dtype=torch.float32, device=device) for _ in range(3)]
    # dy: any [M, D] tensor of x's dtype (values do not decide which kernels run; no draw from the global RNG)
    overflow_rows_backward(x, x, gate, up, down_t, theta, l1_grad, rows, valid,
                           dx=torch.empty_like(x), grad_gate=grads[0] if gated else None, grad_up=grads[1],
                           grad_down_t=grads[2])


def _draw(gen: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=gen.device, generator=gen) * shape[-1] ** -0.5


def _run_planned(runs: list[dict]) -> None:
    """`_run_once` for each planned run, each on its own device (the child, and the loading thread)."""
    for run in runs:
        with _on_device(run):
            _run_once(**run)


def _on_device(run: dict):
    """The planned run's device as the current one (CUDA), else nothing."""
    where = torch.device(run["device"])
    return torch.cuda.device(where) if where.type == "cuda" else nullcontext()


if __name__ == "__main__":  # start_warming's child: the planned runs, as JSON on stdin
    _run_planned(json.loads(sys.stdin.read()))
