"""`SparseMLP`: a drop-in for a Hugging Face gated MLP (Llama, Qwen2, Mistral) over `ops.sparse_mlp`.

    p = relu(gate_proj(x) - θ)        θ: per-unit fp32 buffer `threshold` [H] (zeros = plain ReLU, DESIGN §5)
    h = p * up_proj(x)                (gated)    or   h = p = relu(up_proj(x) - θ)   (gated=False)
    y = down_proj(h)

Submodules carry the Hugging Face names (`gate_proj`, `up_proj`, `down_proj`, all `nn.Linear`), so a
state dict holds a Llama MLP's keys plus `threshold`. With `track_l1` (the default) every forward also
stores the layer's differentiable L1 penalty (DESIGN §1: mean over tokens of Σ_j |h_j|) in `last_l1`,
which `models.collect_l1` averages over layers for `loss = ce + λ · l1`.

Paths. Bias-free modules (every Hugging Face Llama/Qwen2/Mistral MLP) call `ops.sparse_mlp`, whose auto
mode runs the Triton kernels on CUDA bf16/fp16 calls with enough tokens and three dense GEMMs
otherwise. With `track_l1=True` (or gradients) the call takes the training kernels, which also compute
the L1 penalty and keep what backward needs; for pure inference switch it off
(`models.set_track_l1(model, False)`) so the lighter inference kernels run. Under autocast the module
casts x and its weights to the autocast dtype itself (differentiably, as autocast does for F.linear),
so fp32 master weights still reach the bf16/fp16 kernels. Modules with biases run the same formula in
dense torch (the op has no bias arguments).

The threshold is changed through `set_threshold_` (or `load_state_dict`), which keep a Python flag
saying whether it is all zero, so the forward neither syncs with the host nor subtracts zeros. Editing
the buffer in place behind the module's back leaves the flag stale: call `set_threshold_` instead.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from sparseffn.nn.projections import forward_resolved, is_plain
from sparseffn.ops.sparse_mlp import MODES, choose_mode, sparse_mlp
from sparseffn.ops.twell_mlp import SparseMLPWeights

ACTIVATIONS = ("relu", "silu")


def _check_size(value: object, name: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def _check_expected_nnz(expected_nnz: object) -> float | None:
    if expected_nnz is None:
        return None
    if not isinstance(expected_nnz, numbers.Real) or isinstance(expected_nnz, bool):
        raise TypeError(f"expected_nnz must be None or a number, got {type(expected_nnz).__name__}")
    if not expected_nnz >= 0 or expected_nnz == float("inf"):
        raise ValueError(f"expected_nnz must be a finite number >= 0, got {expected_nnz}")
    return float(expected_nnz)


class SparseMLP(nn.Module):
    """Gated (or plain) ReLU MLP with an optional per-unit threshold, running on `ops.sparse_mlp`.

    `forward(x)` takes x [..., hidden_size] and returns [..., hidden_size] in x's dtype. Attributes a
    caller may set: `mode` ("auto" | "sparse" | "dense", passed to the op), `expected_nnz` (float | None:
    expected non-zeros per token, auto mode's density hint), `track_l1` (bool: store `last_l1`).
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
        self.register_buffer("threshold", torch.zeros(h, dtype=torch.float32, device=device))
        self.mode = mode  # checked by __setattr__, as are expected_nnz and track_l1
        self.expected_nnz: float | None = None
        self.track_l1 = True
        self.last_l1: torch.Tensor | None = None
        self._threshold_active = False  # whether any θ_j != 0 (kept by set_threshold_/load_state_dict)
        self._prepared: SparseMLPWeights | None = None  # interleaved up/down for the kernels, built lazily
        self._prepared_key: tuple | None = None
        self._dense_class: type | None = None  # the Hugging Face class from_dense replaced, if any

    # ----------------------------------------------------------------- construction and conversion

    @classmethod
    def from_dense(cls, mlp: nn.Module, *, mode: str = "auto") -> "SparseMLP":
        """A SparseMLP over a Hugging Face gated MLP's own Linear modules (weights shared, not copied).

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
        if not bool(torch.isfinite(self.threshold).all()):
            self.threshold.zero_()
            self._threshold_active = False
            raise ValueError("threshold must be finite; the module's threshold was reset to zero")
        self._threshold_active = bool(self.threshold.any())
        return self

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
        self.release_cache_()
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
        if not (is_plain(gate_proj) and is_plain(up_proj) and is_plain(down_proj)):
            y, l1 = forward_resolved(self, x, theta)  # PEFT adapters, accelerate hooks, other modules
        elif _any_bias(gate_proj, up_proj, down_proj):
            if up_proj.weight.dtype != x.dtype and torch.is_autocast_enabled(x.device.type):
                x = x.to(up_proj.weight.dtype)  # autocast then casts x and the weights inside F.linear
            y, l1 = self._dense_with_bias(x, theta)
        elif torch.is_autocast_enabled(x.device.type):
            # The op is opaque to autocast: cast here, as autocast would for each F.linear (the weight
            # casts are differentiable, so fp32 master weights get their gradients), then run it as is.
            dtype = torch.get_autocast_dtype(x.device.type)
            weights = [None if w is None else w.weight.to(dtype) for w in (gate_proj, up_proj, down_proj)]
            with torch.autocast(x.device.type, enabled=False):
                y, l1 = self._call_op(x.to(dtype), *weights, theta, mode=self.mode, prepared=None)
        else:
            gate_weight = gate_proj.weight if gate_proj is not None else None
            mode, prepared = self._inference_path(x, gate_weight, up_proj.weight, down_proj.weight)
            y, l1 = self._call_op(x, gate_weight, up_proj.weight, down_proj.weight, theta, mode=mode, prepared=prepared)
        self.__dict__["last_l1"] = l1  # a plain attribute (never a parameter, buffer or module)
        return y

    def _call_op(self, x, gate_weight, up_weight, down_weight, theta, *, mode, prepared):
        track_l1 = self.track_l1
        out = sparse_mlp(x, gate_weight, up_weight, down_weight, theta, return_l1=track_l1, mode=mode,
                         prepared=prepared, expected_nnz=self.expected_nnz)
        return out if track_l1 else (out, None)

    def _dense_with_bias(self, x: torch.Tensor, theta: torch.Tensor | None):
        first = (self.gate_proj if self.gate_proj is not None else self.up_proj)(x)
        if theta is not None:
            first = first - theta.to(first.dtype)
        h = torch.relu(first)
        if self.gate_proj is not None:
            h = h * self.up_proj(x)
        y = self.down_proj(h)
        if not self.track_l1:
            return y, None
        return y, h.abs().sum(-1, dtype=torch.float64 if h.dtype == torch.float64 else torch.float32).mean()

    def _inference_path(self, x: torch.Tensor, gate_weight: torch.Tensor | None, up: torch.Tensor,
                        down: torch.Tensor) -> tuple[str, SparseMLPWeights | None]:
        """(mode for sparse_mlp, the kernels' interleaved up/down weights or None) for this call.

        An inference call in auto mode is decided here once ("sparse" or "dense"), so sparse_mlp does
        not decide again; training calls (gradients or track_l1) keep the module's mode and no
        prepared weights, since training steps change the weights every step. The interleaved copy is
        built once and reused while the weights stay the same tensors with the same contents (checked
        through their version counters and storage), so inference pays the copy once.
        """
        mode = self.mode
        if mode == "dense" or self.track_l1 or (torch.is_grad_enabled() and (
                x.requires_grad or up.requires_grad or down.requires_grad
                or (gate_weight is not None and gate_weight.requires_grad))):
            return mode, None
        mode = choose_mode(x, up, mode=mode, expected_nnz=self.expected_nnz).mode
        if mode != "sparse":
            return mode, None
        key = tuple(
            (t.data_ptr(), t._version, t.dtype, t.device) if t is not None else None for t in (gate_weight, up, down)
        )
        if self._prepared is None or self._prepared_key != key or not self._prepared.matches(gate_weight, up, down):
            if _capturing(x):
                # Built now, the copy would be recorded into the graph (a weight-sized copy on every
                # replay) and live in the graph's memory pool, so it is not cached: auto mode takes
                # the dense route instead, mode="sparse" gets a copy for this call alone.
                if self.mode == "auto":
                    return "dense", None
                with torch.no_grad():
                    return mode, SparseMLPWeights.prepare(gate_weight, up, down)
            with torch.no_grad():
                self._prepared = SparseMLPWeights.prepare(gate_weight, up, down)
            self._prepared_key = key
        return mode, self._prepared

    def release_cache_(self) -> "SparseMLP":
        """Drop the cached interleaved up/down weights of the sparse path (rebuilt on the next sparse call)."""
        self._prepared = None
        self._prepared_key = None
        return self

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
        if not self.track_l1:
            parts.append("track_l1=False")
        return ", ".join(parts)

    def __setattr__(self, name, value):
        if name == "mode":
            value = _check_mode(value)
        elif name == "expected_nnz":
            value = _check_expected_nnz(value)
        elif name == "track_l1" and not isinstance(value, bool):
            raise TypeError(f"track_l1 must be a bool, got {type(value).__name__}")
        super().__setattr__(name, value)


def _capturing(x: torch.Tensor) -> bool:
    """Whether x's call is being captured into a CUDA graph."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


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
