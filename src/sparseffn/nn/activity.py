"""`Activity`: a layer's measured active units per token, which auto mode dispatches on.

Why. The sparse kernels pay only when few units fire, and a model's activity changes under it: a
run from initialization starts with ~half the units active and sparsifies as the L1 penalty works;
a dense checkpoint sparsified without calibration stays ~half active. So each `SparseMLP` measures.

How, without host synchronisation (a counted call: `poll`, decide, compute, maybe `record`, `tick`):
  - every `period`-th counted call takes a sample: the number of active units over the call's
    tokens, computed on the device (`SparseMLP.activation_mask`, one extra gate projection) and
    copied to pinned host memory without blocking;
  - `lag` counted calls later the copy has long finished; the sample is read at the start of that
    call (waiting on its event, which has completed) and folded in with weight n / (n + 1024) for a
    sample of n tokens (the first sample is taken as is): a training call's sample of thousands of
    tokens all but replaces the estimate, single-token decode samples average over ~1000 tokens.
Until the first sample is read the estimate is None and the layer runs dense in auto mode; so it does
while `hold` says why (a background kernel warm-up not finished yet).
Counted calls are forward calls outside backward (activation-checkpoint recomputation), outside
torch.compile tracing and outside CUDA-graph capture; so the estimate, and the decisions made from
it, depend only on the sequence of calls: the same run decides the same way. `state_dict` (with
a pending sample resolved) goes into training checkpoints, so a resumed run decides as an
uninterrupted one.

`last` remembers the path auto mode took per kind of call ("training", "decode", "prefill"),
which the decision's hysteresis reads and `repr(SparseMLP)` and the training metrics show. Calls traced
by torch.compile neither read nor write it (a compiled caller would recompile after its first call).
"""

from __future__ import annotations

import torch

SAMPLE_TOKENS = 1024  # a sample of n tokens gets weight n / (n + SAMPLE_TOKENS) in the estimate


class Activity:
    """Estimate of active units per token for one layer (module docstring)."""

    def __init__(self, period: int = 16, lag: int = 4) -> None:
        if period < 1 or not 0 < lag < period + 1:
            raise ValueError(f"period must be >= 1 and 0 < lag <= period, got period={period}, lag={lag}")
        self.period = period
        self.lag = lag
        self.nnz: float | None = None  # active units per token
        self.calls = 0  # counted calls so far
        self.samples = 0
        self.last: dict[str, str] = {}  # kind of call -> "sparse" / "dense", the last decision
        # while set, auto mode runs dense and gives this as the reason (nn/warm.py: the kernels the layer would
        # switch to are still compiling in a child process); not saved: it belongs to this process
        self.hold: str | None = None
        # a sample in flight: (call index at which it is read, host tensor [2] int64 (active, tokens),
        # CUDA event or None)
        self._pending: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None

    def wants_sample(self) -> bool:
        """Whether this counted call should take a sample (`record` it before `tick`)."""
        return self._pending is None and self.calls % self.period == 0

    def record(self, active: torch.Tensor, tokens: int) -> None:
        """Start a sample: `active`, a device scalar, the active (token, unit) pairs of this call."""
        pair = torch.stack((active.to(torch.int64).reshape(()), active.new_tensor(tokens, dtype=torch.int64)))
        if pair.is_cuda:
            host = torch.empty(2, dtype=torch.int64, pin_memory=True)
            host.copy_(pair, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = pair, None
        self._pending = (self.calls + self.lag, host, event)

    def poll(self) -> None:
        """Start of a counted call: fold in a sample that is due (its copy finished long ago)."""
        if self._pending is not None and self.calls >= self._pending[0]:
            self._resolve()

    def tick(self) -> None:
        """End of a counted call."""
        self.calls += 1

    def _resolve(self) -> None:
        _, host, event = self._pending
        if event is not None:
            event.synchronize()  # recorded `lag` calls ago: long complete, nothing waits
        active, tokens = (int(v) for v in host.tolist())
        self._pending = None
        if tokens > 0:
            self.observe(active / tokens, tokens)

    def observe(self, nnz: float, tokens: int) -> None:
        """Fold in a measured mean of active units per token over `tokens` tokens."""
        weight = tokens / (tokens + SAMPLE_TOKENS)
        self.nnz = nnz if self.nnz is None else (1 - weight) * self.nnz + weight * nnz
        self.samples += 1

    def state_dict(self) -> dict:
        """The estimate, counters and decisions; a sample in flight is read first (a host sync) and
        kept with the call index it is due at, so a restored Activity folds it in at the same call."""
        pending = None
        if self._pending is not None:
            due, host, event = self._pending
            if event is not None:
                event.synchronize()
            pending = (due, [int(v) for v in host.tolist()])
        return {"nnz": self.nnz, "calls": self.calls, "samples": self.samples, "last": dict(self.last),
                "period": self.period, "lag": self.lag, "pending": pending}

    def load_state_dict(self, state: dict) -> None:
        self.period, self.lag = int(state["period"]), int(state["lag"])
        self.nnz = None if state["nnz"] is None else float(state["nnz"])
        self.calls, self.samples = int(state["calls"]), int(state["samples"])
        self.last = {str(k): str(v) for k, v in state["last"].items()}
        pending = state.get("pending")
        self._pending = None if pending is None else (int(pending[0]), torch.tensor(pending[1]), None)

    def __repr__(self) -> str:
        nnz = "unmeasured" if self.nnz is None else f"{self.nnz:.1f}/token"
        paths = ", ".join(f"{kind} {path}" for kind, path in self.last.items())
        return f"Activity({nnz}" + (f"; {paths}" if paths else "") + ")"
