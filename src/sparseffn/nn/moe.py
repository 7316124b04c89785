"""`SparseExperts`: the routed experts of a Hugging Face MoE layer (Mixtral, Qwen2-MoE, Qwen3-MoE) with
ReLU gates, per-expert thresholds and the L1 penalty over the tokens each expert sees.

transformers 5.x stores the experts of these models as two 3-D Parameters, read here in place:

    gate_up_proj [E, 2H, D]   rows [:H] are expert e's gate, rows [H:] its up projection
    down_proj    [E, D, H]

For the tokens T_e routed to expert e with routing weights w_t:

    y_t = Σ_{e: t ∈ T_e} w_t,e · down_e(relu(gate_e(x_t) - θ_e) * up_e(x_t))     θ: buffer `threshold` [E, H]
    l1  = (1 / N) Σ_e Σ_{t ∈ T_e} Σ_j |h_{e,t,j}|                            N: tokens in the batch

i.e. the mean over tokens of the activation mass of all experts a token visits (a token routed to k
experts contributes k experts' worth). Each expert's tokens go through `ops.sparse_mlp` with that
expert's weight views, so the kernels run per expert where the op's mode picks them (auto mode picks
dense on CPU and for small token counts). The routing loop is Hugging Face's eager one.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from sparseffn.nn.dispatch import l1_wanted, run_sparse_mlp
from sparseffn.nn.thresholded import ThresholdedLayer


class SparseExperts(ThresholdedLayer):
    """Routed experts over Hugging Face's fused expert Parameters (module docstring).

    forward(hidden_states [N, D], top_k_index [N, k], top_k_weights [N, k]) -> [N, D], the signature
    of transformers' experts modules. Built by `from_hf(experts)`; `to_hf()` gives the module back
    computing ReLU.
    """

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, *, mode: str = "auto") -> None:
        super().__init__()
        if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
            raise ValueError(f"gate_up_proj and down_proj must be 3-D [E, 2H, D] and [E, D, H], got "
                             f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
        e, two_h, d = gate_up_proj.shape
        if two_h % 2 or tuple(down_proj.shape) != (e, d, two_h // 2):
            raise ValueError(f"down_proj must be [E, D, H] = {[e, d, two_h // 2]} for gate_up_proj "
                             f"{list(gate_up_proj.shape)}, got {list(down_proj.shape)}")
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.num_experts, self.hidden_size, self.intermediate_size = e, d, two_h // 2
        self._init_state((e, two_h // 2), mode, gate_up_proj.device)
        object.__setattr__(self, "_hf_experts", None)

    @classmethod
    def from_hf(cls, experts: nn.Module, *, mode: str = "auto") -> "SparseExperts":
        """SparseExperts sharing `experts`' Parameters; `experts` is kept for `to_hf`. Refused
        (ValueError) for layouts other than concatenated, untransposed, bias-free [gate; up]."""
        for attr, expected in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                               ("has_gate", True)):
            if getattr(experts, attr, expected) != expected:
                raise ValueError(f"{type(experts).__name__}.{attr} is {getattr(experts, attr)!r}: SparseExperts reads "
                                 f"concatenated [gate; up] expert weights without bias or transpose only")
        for name in ("gate_up_proj", "down_proj"):
            if not isinstance(getattr(experts, name, None), nn.Parameter):
                raise TypeError(f"{type(experts).__name__} must hold a Parameter {name} (3-D expert weights)")
        module = cls(experts.gate_up_proj, experts.down_proj, mode=mode)
        object.__setattr__(module, "_hf_experts", experts)
        return module

    def to_hf(self) -> nn.Module:
        """The Hugging Face experts module `from_hf` took, with the current Parameters and ReLU."""
        if self._hf_experts is None:
            raise ValueError("this SparseExperts was not built by from_hf: there is no Hugging Face module to return")
        if self.has_threshold:
            raise ValueError("this SparseExperts has non-zero thresholds, which Hugging Face experts cannot hold; "
                             "drop them first with set_threshold_(None)")
        experts = self._hf_experts
        experts.gate_up_proj, experts.down_proj = self.gate_up_proj, self.down_proj
        experts.act_fn = nn.ReLU()
        return experts

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [H, D], up [H, D], down [D, H]) of one expert: views of the Parameters."""
        gate, up = self.gate_up_proj[expert].chunk(2, 0)
        return gate, up, self.down_proj[expert]

    def pre_activation(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """g = gate_e(x) [..., H] of one expert, before θ and the ReLU."""
        return F.linear(x, self.expert_weights(expert)[0])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)  # [E + 1, k, N]
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        theta = self._theta()
        autocast = torch.is_autocast_enabled(hidden_states.device.type)
        dtype = torch.get_autocast_dtype(hidden_states.device.type) if autocast else None
        track = l1_wanted(self, (self.gate_up_proj, self.down_proj))
        l1_sum = None
        for index in hit:
            e = int(index[0])
            if e == self.num_experts:  # the "no expert" slot of expert-parallel routing
                continue
            position, token = torch.where(mask[e])
            x = hidden_states[token]
            weights = self.expert_weights(e)
            if autocast:
                x, weights = x.to(dtype), [w.to(dtype) for w in weights]
            theta_e = None if theta is None else theta[e]
            # auto mode: one activity estimate for the layer, from its experts' calls
            result = run_sparse_mlp(self, x, *weights, theta_e, track, lambda: self._active_count(x, e, theta_e))
            y, l1 = result if track else (result, None)
            y = y * top_k_weights[token, position, None]
            out.index_add_(0, token, y.to(out.dtype))
            if l1 is not None:
                l1_sum = l1 * token.numel() if l1_sum is None else l1_sum + l1 * token.numel()
        if track:
            tokens = max(hidden_states.shape[0], 1)
            self._store_l1(l1_sum / tokens if l1_sum is not None else hidden_states.new_zeros((), dtype=torch.float32))
        else:
            self._store_l1(None)
        return out

    def _active_count(self, x: torch.Tensor, expert: int, theta: torch.Tensor | None) -> torch.Tensor:
        g = self.pre_activation(x, expert)
        if theta is not None:
            g = g - theta.to(g.dtype)
        return (torch.relu(g) != 0).sum()

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.gate_up_proj.dtype

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, mode={self.mode!r}, "
                f"threshold={'per-unit' if self._threshold_active else 'zero'}")
