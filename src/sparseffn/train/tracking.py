"""Per-layer activation sparsity from forward hooks, dead-unit bookkeeping and dead-gate re-initialisation.

`ActivationStats` hooks every SparseMLP; inside `with stats.capture():` each MLP call records, from
`SparseMLP.activation_mask(x)` (no grad), per layer: tokens seen, non-zeros per token (sum and max),
tokens whose TwELL packing would overflow (some `tile`-wide tile with more than `slots` active
units; tile 256 / 32 slots = the paper's layout) and which units fired at least once. Outside
`capture()` the hooks return at once, so activation-checkpoint recomputation in backward and
ordinary steps cost nothing.

`DeadUnits` remembers, per layer and unit, the last observed step at which the unit fired. A unit
is dead at step s when it has not fired on any observed step in the last `after` steps. Steps are
observed every step when re-initialisation is on, else only on logging steps (so the dead fraction
reported without re-init means "silent on every logged batch of the window").

Re-initialisation (`reinit_dead_gates`, the paper's option, not in its released code): the gate_proj
row (up_proj for non-gated MLPs) of each dead unit is drawn afresh from N(0, initializer_range²) (the
model's own init) and its AdamW moments are zeroed; up_proj and down_proj are kept. The down_proj
column is deliberately NOT zeroed: with it zero, the revived unit's output gradient (dy · Wd[:, j])
is zero, so only the L1 term acts on it and pushes it straight back to zero. Dead units contribute h_j = 0, so redrawing
their gate rows does not change the model's output until they fire again.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from sparseffn.models import sparse_mlps

# reduce(tensor, op) with op "sum" or "max", in place across processes; identity without distribution.
Reduce = Callable[[torch.Tensor, str], torch.Tensor]


def _no_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class LayerStats:
    """Statistics of one capture window, one entry per layer."""

    hidden: list[int]  # H of each layer
    tokens: int  # tokens seen per layer
    nnz_mean: list[float]
    nnz_max: list[int]
    overflow_rate: list[float]  # fraction of tokens with a tile over capacity
    fired: list[torch.Tensor]  # bool [H]: units active on at least one token

    @property
    def zeros_pct(self) -> float:
        """Share of zero activations over all layers, in percent."""
        total = sum(self.hidden)
        return 100.0 * (1.0 - sum(self.nnz_mean) / total) if total else float("nan")

    @property
    def nnz_mean_all(self) -> float:
        return sum(self.nnz_mean) / max(len(self.nnz_mean), 1)

    @property
    def silent_frac(self) -> list[float]:
        """Per layer: fraction of units that fired on no token of the window."""
        return [float((~f).float().mean()) for f in self.fired]

    def as_row(self, prefix: str = "") -> dict:
        return {
            f"{prefix}nnz_mean": [round(v, 4) for v in self.nnz_mean],
            f"{prefix}nnz_max": self.nnz_max,
            f"{prefix}overflow_rate": [round(v, 6) for v in self.overflow_rate],
            f"{prefix}nnz_mean_all": round(self.nnz_mean_all, 4),
            f"{prefix}zeros_pct": round(self.zeros_pct, 4),
            f"{prefix}overflow_rate_all": round(sum(self.overflow_rate) / max(len(self.overflow_rate), 1), 6),
            f"{prefix}hidden": self.hidden,
        }


class ActivationStats:
    """Forward hooks on a model's SparseMLP layers; statistics only inside `capture()`."""

    def __init__(self, model: torch.nn.Module, tile: int = 256, slots: int = 32) -> None:
        self.mlps = sparse_mlps(model)
        if not self.mlps:
            raise ValueError("model has no SparseMLP layers to track (build it with sparseffn.build_model)")
        self.tile, self.slots = tile, slots
        self.hidden = [int(m.intermediate_size) for m in self.mlps]
        self._active = False
        self._reset()
        self._handles = [m.register_forward_hook(self._hook(i), with_kwargs=True) for i, m in enumerate(self.mlps)]

    def _reset(self) -> None:
        self._tokens = [0] * len(self.mlps)
        self._nnz_sum: list[torch.Tensor | None] = [None] * len(self.mlps)
        self._nnz_max: list[torch.Tensor | None] = [None] * len(self.mlps)
        self._overflow: list[torch.Tensor | None] = [None] * len(self.mlps)
        self._fired: list[torch.Tensor | None] = [None] * len(self.mlps)

    def _hook(self, i: int):
        def hook(module, args, kwargs, output):
            if not self._active:
                return None
            x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            with torch.no_grad():
                mask = module.activation_mask(x).reshape(-1, self.hidden[i])
                self._accumulate(i, mask)
            return None

        return hook

    def _accumulate(self, i: int, mask: torch.Tensor) -> None:
        n, h = mask.shape
        nnz = mask.sum(-1, dtype=torch.int64)
        tiles = -(-h // self.tile)
        padded = torch.nn.functional.pad(mask, (0, tiles * self.tile - h)).view(n, tiles, self.tile)
        overflow = (padded.sum(-1, dtype=torch.int32) > self.slots).any(-1).sum(dtype=torch.int64)
        fired = mask.any(0)
        self._tokens[i] += n
        if self._nnz_sum[i] is None:
            self._nnz_sum[i], self._nnz_max[i] = nnz.sum(), nnz.max()
            self._overflow[i], self._fired[i] = overflow, fired
        else:
            self._nnz_sum[i] = self._nnz_sum[i] + nnz.sum()
            self._nnz_max[i] = torch.maximum(self._nnz_max[i], nnz.max())
            self._overflow[i] = self._overflow[i] + overflow
            self._fired[i] = self._fired[i] | fired

    @contextmanager
    def capture(self):
        self._active = True
        try:
            yield self
        finally:
            self._active = False

    @property
    def has_data(self) -> bool:
        return any(t > 0 for t in self._tokens)

    def collect(self, reduce: Reduce = _no_reduce) -> LayerStats:
        """Statistics since the last collect (summed over processes with `reduce`), then reset."""
        if not self.has_data:
            raise RuntimeError("ActivationStats.collect: no forward pass was captured since the last collect")
        layers = len(self.mlps)
        device = next(t for t in self._nnz_sum if t is not None).device
        tokens = torch.tensor(self._tokens, device=device, dtype=torch.float64)
        sums = torch.cat([tokens, torch.stack(self._nnz_sum).double(), torch.stack(self._overflow).double()])
        sums = reduce(sums, "sum")
        maxes = reduce(torch.stack([self._nnz_max[i] for i in range(layers)]), "max")
        fired = [reduce(f.to(torch.int32), "max").bool() for f in self._fired]
        tokens, nnz_sum, overflow = sums[:layers], sums[layers:2 * layers], sums[2 * layers:]
        tokens_l = tokens.cpu().tolist()
        stats = LayerStats(
            hidden=list(self.hidden),
            tokens=int(tokens_l[0]),
            nnz_mean=(nnz_sum / tokens).cpu().tolist(),
            nnz_max=[int(v) for v in maxes.cpu().tolist()],
            overflow_rate=(overflow / tokens).cpu().tolist(),
            fired=fired,
        )
        self._reset()
        return stats

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "ActivationStats":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class DeadUnits:
    """Last observed firing step per (layer, unit); `dead(step)` = silent for >= `after` steps."""

    def __init__(self, hidden: list[int], after: int, start_step: int = 0, device: torch.device | str = "cpu") -> None:
        if after < 1:
            raise ValueError(f"dead-unit window (reinit_dead_after) must be >= 1 step, got {after}")
        self.after = after
        self.last_fired = [torch.full((h,), start_step, dtype=torch.int64, device=device) for h in hidden]

    def update(self, fired: list[torch.Tensor], step: int) -> None:
        for last, f in zip(self.last_fired, fired):
            last[f.to(last.device)] = step

    def dead(self, step: int) -> list[torch.Tensor]:
        return [(step - last) >= self.after for last in self.last_fired]

    def dead_frac(self, step: int) -> list[float]:
        return [float(d.float().mean()) for d in self.dead(step)]

    def revive(self, masks: list[torch.Tensor], step: int) -> None:
        for last, m in zip(self.last_fired, masks):
            last[m] = step

    def state_dict(self) -> dict:
        return {"after": self.after, "last_fired": [t.cpu() for t in self.last_fired]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["last_fired"]) != len(self.last_fired):
            raise ValueError(f"checkpoint tracks {len(state['last_fired'])} layers, "
                             f"the model has {len(self.last_fired)}")
        self.last_fired = [t.to(old.device) for t, old in zip(state["last_fired"], self.last_fired)]


@torch.no_grad()
def reinit_dead_gates(
    mlps: list,
    dead: list[torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    generator: torch.Generator,
    std: float,
) -> list[int]:
    """Redraw the gate_proj rows of dead units ~ N(0, std²) and zero their optimizer moments.

    Returns the number of re-initialised units per layer. Rows are drawn on the CPU from
    `generator` in layer order, so every process (and a resumed run) draws the same values.
    """
    counts = []
    for mlp, mask in zip(mlps, dead):
        idx = mask.nonzero().flatten()
        counts.append(int(idx.numel()))
        if idx.numel() == 0:
            continue
        first = mlp.gate_proj if mlp.gate_proj is not None else mlp.up_proj  # the projection that gates
        weight = first.weight
        rows = torch.randn(idx.numel(), weight.shape[1], generator=generator, dtype=torch.float32) * std
        weight[idx.to(weight.device)] = rows.to(device=weight.device, dtype=weight.dtype)
        params = [weight]
        if first.bias is not None:
            first.bias[idx.to(weight.device)] = 0
            params.append(first.bias)
        if optimizer is not None:
            for p in params:
                state = optimizer.state.get(p, {})
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if key in state:
                        state[key][idx.to(state[key].device)] = 0
    return counts
