"""`SparseMLP`: a drop-in for a Hugging Face gated MLP (Llama, Qwen2, Mistral) over `ops.sparse_mlp`.

    p = relu(gate_proj(x) - θ)        θ: per-unit fp32 buffer `threshold` [H] (zeros = plain ReLU)
    h = p * up_proj(x)                (gated)    or   h = p = relu(up_proj(x) - θ)   (gated=False)
    y = down_proj(h)

Submodules carry the Hugging Face names (`gate_proj`, `up_proj`, `down_proj`, all `nn.Linear`), so a
state dict holds a Llama MLP's keys plus `threshold`.

One copy of the weights. `down_proj.weight` [D, H] is stored transposed (its `.t()`, [H, D], is
contiguous): the layout the sparse kernels read (row j = unit j's down column), while every dense
path (F.linear), state dicts, `save_pretrained` and optimizers see an ordinary [D, H] parameter.
A down weight that arrives contiguous (a loader that assigns new tensors) is re-stored on the next
forward, in place (`param.data`), so optimizers keep their parameter. FSDP2 shards only contiguous
parameters: `contiguous_down_(module)` stores it contiguous and keeps it so (the sparse kernels then
read a transposed copy per call, as for any Hugging Face layout).

L1. With `track_l1=None` (the default) a forward computes the layer's differentiable L1 penalty
(mean over tokens of Σ_j |h_j|) into `last_l1` in training mode, or when gradients flow to its
parameters; in `eval()` under `no_grad` it does not, and the lighter inference kernels run.
`track_l1=True` / `False` force it (`models.set_track_l1`); `models.collect_l1` averages `last_l1`
over layers for `loss = ce + λ · l1`.

Dispatch. The module decides nothing: it passes its `mode`, `expected_nnz` and measured activity
(`activity`, nn/activity.py: active units per token, sampled on the device every few calls, no host
sync) to the op, which decides once per call (ops/decide.py) and runs that path; in auto mode a model
that is dense at initialization, or sparsified without calibration, runs dense until its activations
are sparse. The module records the decision the op returns in `last_decision`. Under autocast the module casts x and its weights to the autocast dtype
itself (differentiably), so fp32 master weights still reach the bf16/fp16 kernels. Modules with
biases run the same formula in dense torch (the op has no bias arguments).

The threshold is changed through `set_threshold_` (or `load_state_dict`), which keep a Python flag
saying whether it is all zero, so the forward neither syncs with the host nor subtracts zeros. Editing
the buffer in place behind the module's back leaves the flag stale: call `set_threshold_` instead.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from sparseffn.nn.activity import Activity
from sparseffn.nn.dispatch import checked_attribute, dense_l1, l1_wanted, run_sparse_mlp
from sparseffn.nn.projections import is_plain, resolved_weights
from sparseffn.nn.thresholded import finish_threshold_
from sparseffn.ops.decide import ModeDecision
from sparseffn.ops.sparse_mlp import call_traced
from sparseffn.ops.twell_mlp import stored_transposed

ACTIVATIONS = ("relu", "silu")


def _check_size(value: object, name: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


class SparseMLP(nn.Module):
    """Gated (or plain) ReLU MLP with an optional per-unit threshold, running on `ops.sparse_mlp`.

    `forward(x)` takes x [..., hidden_size] and returns [..., hidden_size] in x's dtype. Attributes a
    caller may set: `mode` ("auto" | "sparse" | "dense", passed to the op), `expected_nnz` (float | None:
    expected active units per token, replaces the measured `activity` in auto mode), `track_l1`
    (None: store `last_l1` in training mode or when gradients flow; True / False: always / never).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        gated: bool = True,
        bias: bool = False,
        mode: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = _check_size(hidden_size, "hidden_size")
        self.intermediate_size = _check_size(intermediate_size, "intermediate_size")
        for name, flag in (("gated", gated), ("bias", bias)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        factory = {"device": device, "dtype": dtype}
        d, h = self.hidden_size, self.intermediate_size
        self.gate_proj = nn.Linear(d, h, bias=bias, **factory) if gated else None
        self.up_proj = nn.Linear(d, h, bias=bias, **factory)
        self.down_proj = nn.Linear(h, d, bias=bias, **factory)
        store_transposed_(self.down_proj)
        self.register_buffer("threshold", torch.zeros(h, dtype=torch.float32, device=device))
        self.mode = mode  # checked by __setattr__, as are expected_nnz and track_l1
        self.expected_nnz: float | None = None
        self.track_l1: bool | None = None
        self.last_l1: torch.Tensor | None = None
        self.activity = Activity()
        self.last_decision: ModeDecision | None = None
        self.down_transposed = True  # keep down_proj.weight stored transposed (False: as given, e.g. for FSDP)
        self._threshold_active = False  # whether any θ_j != 0 (kept by set_threshold_/load_state_dict)
        self._dense_class: type | None = None  # the Hugging Face class from_dense replaced, if any

    # ----------------------------------------------------------------- construction and conversion

    @classmethod
    def from_dense(cls, mlp: nn.Module, *, mode: str = "auto") -> "SparseMLP":
        """A SparseMLP over a Hugging Face gated MLP's own Linear modules (weights shared, not copied;
        down_proj's weight is re-stored transposed, in place).

        `mlp` needs `gate_proj`, `up_proj`, `down_proj` (nn.Linear, [H, D], [H, D], [D, H]). Its
        activation is replaced by ReLU: the result computes down(relu(gate(x)) * up(x)), which equals
        the original only if the original used ReLU. The threshold starts at zero, on the weights'
        device. The original module is left untouched (it still shares the Linear modules).
        """
        if not isinstance(mlp, nn.Module):
            raise TypeError(f"mlp must be an nn.Module, got {type(mlp).__name__}")
        linears = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(mlp, name, None)
            if not isinstance(layer, nn.Linear):
                raise TypeError(
                    f"mlp must have an nn.Linear {name} (a Hugging Face gated MLP such as LlamaMLP), "
                    f"got {type(layer).__name__} in {type(mlp).__name__}"
                )
            linears[name] = layer
        gate, up, down = linears["gate_proj"], linears["up_proj"], linears["down_proj"]
        h, d = up.weight.shape
        if tuple(gate.weight.shape) != (h, d):
            raise ValueError(f"mlp.gate_proj.weight must match up_proj's shape {(h, d)}, got {tuple(gate.weight.shape)}")
        if tuple(down.weight.shape) != (d, h):
            raise ValueError(f"mlp.down_proj.weight must be [D, H] = {(d, h)}, got {tuple(down.weight.shape)}")
        devices = {layer.weight.device for layer in (gate, up, down)}
        if len(devices) != 1:
            raise ValueError(f"mlp's projections must share one device, got {sorted(map(str, devices))}")
        module = cls(d, h, gated=True, bias=False, mode=mode, device="meta")
        store_transposed_(down)
        module.gate_proj, module.up_proj, module.down_proj = gate, up, down
        module.threshold = torch.zeros(h, dtype=torch.float32, device=up.weight.device)
        module._dense_class = type(mlp)
        return module

    def to_dense(self, act: str = "relu", *, keep_threshold: bool = False) -> "DenseMLP":
        """A plain `DenseMLP` sharing this module's Linear modules: down(act(gate(x)) * up(x)).

        act="relu" gives the same function as this module while θ is zero (bit for bit in eager
        fp32); act="silu" goes back to a SiLU model (a different function: that is the point of it).
        A non-zero θ has no place in a plain MLP: it raises ValueError unless keep_threshold=True,
        which (with act="relu" only) folds -θ into a gate bias, relu(gate(x) - θ) = relu(x Wg^T + b - θ):
        the same function up to rounding, but no longer a bias-free Hugging Face MLP.
        """
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
        if not isinstance(keep_threshold, bool):
            raise TypeError(f"keep_threshold must be a bool, got {type(keep_threshold).__name__}")
        gate = self.gate_proj
        if self._threshold_active:
            if not keep_threshold:
                raise ValueError(
                    "this SparseMLP has a non-zero threshold, which a plain MLP cannot express: pass "
                    "keep_threshold=True (act='relu') to fold -threshold into a gate bias, or drop it "
                    "first with set_threshold_(None)"
                )
            if act != "relu":
                raise ValueError(f"keep_threshold=True keeps relu(g - threshold), so act must be 'relu', got {act!r}")
            first = gate if gate is not None else self.up_proj
            folded = nn.Linear(self.hidden_size, self.intermediate_size, bias=True, device="meta")
            folded.weight = first.weight
            base = first.bias.detach() if first.bias is not None else 0.0
            folded.bias = nn.Parameter((base - self.threshold.to(first.weight.dtype)).to(first.weight.dtype))
            if gate is not None:
                gate = folded
            else:
                return DenseMLP(None, folded, self.down_proj, act=act)
        return DenseMLP(gate, self.up_proj, self.down_proj, act=act)

    # ----------------------------------------------------------------- threshold

    @torch.no_grad()
    def set_threshold_(self, threshold: torch.Tensor | float | None) -> "SparseMLP":
        """Set θ: None (zeros, plain ReLU), a number for every unit, or a tensor of shape [] or [H].

        Stored as fp32 on the module's device. Syncs with the host once (to check for non-finite
        values and record whether θ is all zero), so call it outside the training step.
        """
        h = self.intermediate_size
        if threshold is None:
            self.threshold.zero_()
        elif isinstance(threshold, numbers.Real) and not isinstance(threshold, bool):
            self.threshold.fill_(float(threshold))
        elif isinstance(threshold, torch.Tensor):
            if not threshold.is_floating_point():
                raise TypeError(f"threshold must be a floating-point tensor, got {threshold.dtype}")
            if threshold.dim() > 1 or (threshold.dim() == 1 and threshold.shape[0] != h):
                raise ValueError(f"threshold must have shape [] or [H] = [{h}], got {tuple(threshold.shape)}")
            self.threshold.copy_(threshold.detach().to(torch.float32).expand(h))
        else:
            raise TypeError(f"threshold must be None, a number or a tensor of shape [H], got {type(threshold).__name__}")
        return finish_threshold_(self)

    @property
    def has_threshold(self) -> bool:
        """Whether any unit has a non-zero θ (no host sync: a flag kept by set_threshold_)."""
        return self._threshold_active

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.threshold.device.type != "meta":
            self._threshold_active = bool(self.threshold.any())

    def _apply(self, fn, recurse=True):
        # `.to(dtype)` / `.half()` would cast the threshold buffer; it stays fp32 (only moves).
        theta = self.threshold
        super()._apply(fn, recurse)
        if self.threshold.dtype != torch.float32:
            self.threshold = theta.to(device=self.threshold.device, dtype=torch.float32)
        return self

    # ----------------------------------------------------------------- forward

    def _has_bias(self) -> bool:
        return _any_bias(self.gate_proj, self.up_proj, self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Module attribute lookups and Module.__setattr__ cost microseconds each; at decode sizes the
        # MLP is host-bound, so the common path reads each submodule once and stores last_l1 directly.
        modules = self._modules  # gate_proj is a plain None attribute when the module is not gated
        gate_proj, up_proj, down_proj = modules.get("gate_proj"), modules["up_proj"], modules["down_proj"]
        theta = self._buffers["threshold"] if self._threshold_active else None
        if is_plain(gate_proj) and is_plain(up_proj) and is_plain(down_proj):
            if _any_bias(gate_proj, up_proj, down_proj):
                weights = None
            else:
                if self.down_transposed and not stored_transposed(down_proj.weight) and not call_traced(x):
                    store_transposed_(down_proj)  # a loader assigned a contiguous tensor: re-store it, in place
                weights = [None if lin is None else lin.weight for lin in (gate_proj, up_proj, down_proj)]
        else:  # PEFT adapters, accelerate hooks, other modules: the weights they apply, if readable
            weights = resolved_weights(gate_proj, up_proj, down_proj)
        if weights is None:  # biases, or modules that must be called: the dense formula
            if up_proj.weight.dtype != x.dtype and torch.is_autocast_enabled(x.device.type):
                x = x.to(up_proj.weight.dtype)  # autocast then casts x and the weights inside F.linear
            y, l1 = self._dense_with_bias(x, theta)
            self.__dict__["last_l1"] = l1
            return y
        track = l1_wanted(self, weights)
        if torch.is_autocast_enabled(x.device.type):
            # The op is opaque to autocast: cast here, as autocast would for each F.linear (the weight
            # casts are differentiable, so fp32 master weights get their gradients), then run it as is.
            dtype = torch.get_autocast_dtype(x.device.type)
            weights = [None if w is None else w.to(dtype) for w in weights]
            x = x.to(dtype)
        gate_weight, up_weight, down_weight = weights
        out = run_sparse_mlp(self, x, gate_weight, up_weight, down_weight, theta, track,
                             lambda: self.activation_mask(x).sum())
        y, l1 = out if track else (out, None)
        self.__dict__["last_l1"] = l1  # a plain attribute (never a parameter, buffer or module)
        return y

    def _dense_with_bias(self, x: torch.Tensor, theta: torch.Tensor | None):
        """(y, l1 or None) by calling the projection modules: biases, PEFT layers that do not merge,
        hooked or offloaded modules."""
        first = (self.gate_proj if self.gate_proj is not None else self.up_proj)(x)
        if theta is not None:
            first = first - theta.to(first.dtype)
        h = torch.relu(first)
        if self.gate_proj is not None:
            h = h * self.up_proj(x)
        y = self.down_proj(h)
        return y, dense_l1(h) if l1_wanted(self, list(self.parameters())) else None

    @torch.no_grad()
    def activation_mask(self, x: torch.Tensor) -> torch.Tensor:
        """Which units are active for x [..., D]: bool [..., H], no grad.

        "Active" means p_j = relu(g_j - θ_j) != 0, g = gate_proj(x) (up_proj(x) when not gated),
        computed as the dense path does (in x's dtype, θ cast to it). For gated modules u_j != 0 is
        not required (a product p_j u_j that happens to be zero still counts as active): this is the
        set of units the sparse kernels pack and process.
        """
        if self.up_proj.weight.dtype != x.dtype and torch.is_autocast_enabled(x.device.type):
            x = x.to(self.up_proj.weight.dtype)
        first = (self.gate_proj if self.gate_proj is not None else self.up_proj)(x)
        if self._threshold_active:
            first = first - self.threshold.to(first.dtype)
        return torch.relu(first) != 0

    def extra_repr(self) -> str:
        parts = [
            f"hidden_size={self.hidden_size}",
            f"intermediate_size={self.intermediate_size}",
            f"gated={self.gate_proj is not None}",
            f"bias={self._has_bias()}",
            f"mode={self.mode!r}",
            f"threshold={'per-unit' if self._threshold_active else 'zero'}",
        ]
        if self.expected_nnz is not None:
            parts.append(f"expected_nnz={self.expected_nnz:g}")
        if self.track_l1 is not None:
            parts.append(f"track_l1={self.track_l1}")
        if self.mode == "auto":
            parts.append(f"activity={self.activity!r}")
        return ", ".join(parts)

    def __setattr__(self, name, value):
        super().__setattr__(name, checked_attribute(name, value))


def contiguous_down_(module: nn.Module) -> nn.Module:
    """Every SparseMLP of `module` stores down_proj.weight contiguous ([D, H] row-major) from now on, in
    place: what FSDP2's fully_shard needs. Returns module."""
    for mlp in module.modules():
        if isinstance(mlp, SparseMLP):
            mlp.down_transposed = False
            weight = mlp.down_proj.weight
            if not weight.is_contiguous() and weight.device.type != "meta":
                with torch.no_grad():
                    weight.data = weight.data.contiguous()
    return module


def store_transposed_(linear: nn.Linear) -> nn.Linear:
    """Store `linear.weight` [out, in] transposed (its .t() contiguous), in place through `.data`, so the
    Parameter object (and an optimizer's reference to it) stays. No-op when it already is, or on meta."""
    weight = linear.weight
    if not stored_transposed(weight) and weight.device.type != "meta":
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t()
    return linear


def _any_bias(*linears: nn.Linear | None) -> bool:
    return any(lin is not None and lin.bias is not None for lin in linears)


class DenseMLP(nn.Module):
    """A plain MLP, computed as Hugging Face's: down(act(gate(x)) * up(x)), or down(act(up(x))) without gate.

    What `SparseMLP.to_dense` returns; it shares the Linear modules it is given.
    """

    def __init__(self, gate_proj: nn.Linear | None, up_proj: nn.Linear, down_proj: nn.Linear, *, act: str = "relu"):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj
        self.act = act
        self.act_fn = nn.ReLU() if act == "relu" else nn.SiLU()
        self.hidden_size = up_proj.in_features
        self.intermediate_size = up_proj.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act_fn(self.up_proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def extra_repr(self) -> str:
        return f"act={self.act!r}"
