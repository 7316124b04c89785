"""`HFSparseMLP`: the sparse ReLU MLP over a Hugging Face MLP whose layout is not Llama's, read in place.

    gated, fused (Phi-3):  [g; u] = gate_up_proj(x)    h = relu(g - θ) * u    y = down_proj(h)
    non-gated (GPT-2, GPT-NeoX, Falcon, Phi, Starcoder2):
                           g = c_fc(x)                 h = relu(g - θ)        y = c_proj(h)  (+ dropout)

The module holds the Hugging Face MLP's own children under their own names (`gate_up_proj`, `c_fc`,
`dense_h_to_4h`, `fc1`, ...; Conv1D stays Conv1D), so the state dict is the Hugging Face one plus
`threshold` [H], PEFT finds its target modules by their usual names, and accelerate's hooks stay on
them. The weights are read in place (`nn/projections.py`): a fused [2H, D] weight is split into two
views, a Conv1D weight is transposed as a view. Bias-free projections run `ops.sparse_mlp` (kernels
where its mode picks them); projections with biases run the same formula in dense torch; projections
that cannot be read (non-LoRA PEFT layers, hooks) are called as modules. The MLP's dropout after the
second projection (GPT-2's `dropout`, Starcoder2's `residual_dropout`) is applied as Hugging Face does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sparseffn.nn.projections import resolve
from sparseffn.nn.dispatch import dense_l1, l1_wanted, run_sparse_mlp
from sparseffn.nn.thresholded import ThresholdedLayer


@dataclass(frozen=True)
class MLPLayout:
    """Where a Hugging Face MLP class keeps its parts.

    up: the first projection ([gate; up] stacked on the output dim when fused_gate_up, else the
    pre-activation of a non-gated MLP). down: the second projection. act: the activation attribute
    (set to nn.ReLU() when the module is put back). dropout: an nn.Dropout child, or a float attribute
    used as F.dropout's p, applied to the output while training (None: no dropout).
    """

    up: str
    down: str
    act: str
    fused_gate_up: bool = False
    dropout: str | None = None

    @property
    def gated(self) -> bool:
        return self.fused_gate_up


class HFSparseMLP(ThresholdedLayer):
    """Sparse ReLU MLP over a Hugging Face MLP's own projections (module docstring). Built by
    `from_hf(mlp, layout)`; `to_hf()` gives the Hugging Face module back, computing ReLU."""

    def __init__(self, layout: MLPLayout, modules: dict[str, nn.Module], intermediate_size: int,
                 hidden_size: int, *, mode: str = "auto", device=None, dropout: nn.Module | float | None = None):
        super().__init__()
        object.__setattr__(self, "layout", layout)
        for name, module in modules.items():
            self.add_module(name, module)
        if isinstance(dropout, nn.Module):
            self.add_module(layout.dropout, dropout)
        else:
            object.__setattr__(self, "dropout_p", dropout)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self._init_state((intermediate_size,), mode, device)
        object.__setattr__(self, "_hf_mlp", None)

    @classmethod
    def from_hf(cls, mlp: nn.Module, layout: MLPLayout, *, mode: str = "auto") -> "HFSparseMLP":
        """A HFSparseMLP sharing `mlp`'s projection modules (weights not copied); `mlp` is kept to be
        put back by `to_hf`."""
        up, down = getattr(mlp, layout.up, None), getattr(mlp, layout.down, None)
        for name, module in ((layout.up, up), (layout.down, down)):
            if not isinstance(module, nn.Module):
                raise TypeError(f"mlp ({type(mlp).__name__}) must have a module {name}, got {type(module).__name__}")
        resolved = resolve(up)
        weight = resolved[0] if resolved is not None else up.weight  # [out, in] when resolvable
        out_features = weight.shape[0] if resolved is not None else _out_features(up)
        if layout.fused_gate_up and out_features % 2:
            raise ValueError(f"mlp.{layout.up} must have an even output size (gate and up stacked), got {out_features}")
        h = out_features // 2 if layout.fused_gate_up else out_features
        d = _in_features(up)
        dropout = getattr(mlp, layout.dropout) if layout.dropout is not None else None
        device = next(iter(mlp.parameters())).device
        module = cls(layout, {layout.up: up, layout.down: down}, h, d, mode=mode, device=device, dropout=dropout)
        object.__setattr__(module, "_hf_mlp", mlp)
        return module

    def to_hf(self) -> nn.Module:
        """The Hugging Face module `from_hf` took, holding the current projections and computing ReLU.
        Refused (ValueError) with a non-zero θ, which a plain MLP cannot hold."""
        if self._hf_mlp is None:
            raise ValueError("this HFSparseMLP was not built by from_hf: there is no Hugging Face module to return")
        if self.has_threshold:
            raise ValueError("this HFSparseMLP has a non-zero threshold, which a plain MLP cannot hold; "
                             "drop it first with set_threshold_(None)")
        mlp, layout = self._hf_mlp, self.layout
        setattr(mlp, layout.up, self._modules[layout.up])
        setattr(mlp, layout.down, self._modules[layout.down])
        setattr(mlp, layout.act, nn.ReLU())
        return mlp

    # ----------------------------------------------------------------- forward

    def _read(self):
        """(gate w, gate b, up w, up b, down w, down b) read in place, or None (call the modules)."""
        layout = self.layout
        first, second = resolve(self._modules[layout.up]), resolve(self._modules[layout.down])
        if first is None or second is None:
            return None
        (w, b), (dw, db) = first, second
        if not layout.fused_gate_up:
            return None, None, w, b, dw, db
        gw, uw = w.chunk(2, 0)
        gb, ub = b.chunk(2, 0) if b is not None else (None, None)
        return gw, gb, uw, ub, dw, db

    def pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        """g [..., H]: the gate (or the first projection of a non-gated MLP) before θ and the ReLU."""
        read = self._read()
        if read is None:
            g = self._modules[self.layout.up](x)
            return g.chunk(2, -1)[0] if self.layout.fused_gate_up else g
        gw, gb, uw, ub = read[:4]
        return F.linear(x, gw, gb) if self.layout.gated else F.linear(x, uw, ub)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        theta = self._theta()
        read = self._read()
        if read is not None and all(b is None for b in read[1::2]):
            gw, _, uw, _, dw, _ = read
            track = l1_wanted(self, (gw, uw, dw))
            if torch.is_autocast_enabled(x.device.type):
                dtype = torch.get_autocast_dtype(x.device.type)
                gw, uw, dw = (None if w is None else w.to(dtype) for w in (gw, uw, dw))
                x = x.to(dtype)
            out = run_sparse_mlp(self, x, gw, uw, dw, theta, track, lambda: self._active_count(x, theta))
            y, l1 = out if track else (out, None)
        else:
            y, l1 = self._dense(x, theta, read)
        self._store_l1(l1)
        return self._dropout(y)

    def _active_count(self, x: torch.Tensor, theta: torch.Tensor | None) -> torch.Tensor:
        g = self.pre_activation(x)
        if theta is not None:
            g = g - theta.to(g.dtype)
        return (torch.relu(g) != 0).sum()

    def _dense(self, x, theta, read):
        if read is None:  # call the modules (PEFT layers, hooks): exact by construction
            first = self._modules[self.layout.up](x)
            g, u = first.chunk(2, -1) if self.layout.fused_gate_up else (first, None)
        else:
            gw, gb, uw, ub, _, _ = read
            g = F.linear(x, gw, gb) if gw is not None else F.linear(x, uw, ub)
            u = F.linear(x, uw, ub) if gw is not None else None
        if theta is not None:
            g = g - theta.to(g.dtype)
        h = torch.relu(g)
        if u is not None:
            h = h * u
        y = self._modules[self.layout.down](h) if read is None else F.linear(h, read[4], read[5])
        return y, dense_l1(h) if l1_wanted(self, list(self.parameters())) else None

    def _dropout(self, y: torch.Tensor) -> torch.Tensor:
        name = self.layout.dropout
        if name is None:
            return y
        module = self._modules.get(name)
        if module is not None:
            return module(y)
        return F.dropout(y, p=self.dropout_p, training=self.training)

    @torch.no_grad()
    def activation_mask(self, x: torch.Tensor) -> torch.Tensor:
        """Which units are active for x [..., D]: relu(g - θ) != 0, bool [..., H]."""
        g = self.pre_activation(x)
        if self._threshold_active:
            g = g - self.threshold.to(g.dtype)
        return torch.relu(g) != 0

    @property
    def weight_dtype(self) -> torch.dtype:
        return self._modules[self.layout.down].weight.dtype

    def extra_repr(self) -> str:
        parts = [f"hidden_size={self.hidden_size}", f"intermediate_size={self.intermediate_size}",
                 f"gated={self.layout.gated}", f"mode={self.mode!r}",
                 f"threshold={'per-unit' if self._threshold_active else 'zero'}"]
        return ", ".join(parts)


def _out_features(module: nn.Module) -> int:
    for attr in ("out_features", "nf"):
        if isinstance(getattr(module, attr, None), int):
            return getattr(module, attr)
    base = getattr(module, "base_layer", None)
    if base is not None:
        return _out_features(base)
    raise TypeError(f"cannot tell the output size of {type(module).__name__}")


def _in_features(module: nn.Module) -> int:
    if isinstance(getattr(module, "in_features", None), int):
        return module.in_features
    base = getattr(module, "base_layer", None)
    if base is not None:
        return _in_features(base)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:  # Conv1D: [in, out]
        return weight.shape[0]
    raise TypeError(f"cannot tell the input size of {type(module).__name__}")
