"""`DecodeEngine`: one decode step of a Llama-family model (Llama, Mistral, Qwen2) in four launches per
layer, over the model's own weights (views, nothing copied), for `CapturedDecoder` (engine "fused", or
"auto" where `auto_engine` takes it).

Per layer, for one new token per sequence (hidden [B, D], the residual stream):
    1. RMSNorm + q/k/v (+ biases) + RoPE + KV-cache write     ops.decode_attention.decode_qkv_rope
    2. attention over the cache, split-KV                     ops.decode_attention.decode_attention
    3. o_proj + residual                                      ops.decode_attention.decode_out_proj
    4. RMSNorm + MLP + residual                               ops.decode_block.decode_mlp_block
       a SparseMLP runs the sparse decode kernels where auto mode decides they pay at this batch size
       (ops/decide.py, from the layer's measured activity), else the dense kernels; a Hugging Face MLP
       (relu or silu) runs the dense ones
then the model's final norm (ops.decode_block.decode_norm) and lm_head (cuBLAS). Dense and sparse models share
steps 1-3. Folded MLPs (one sequence, a sparse layer, unless torch.use_deterministic_algorithms is on):
step 4 is one launch, its programs adding their active units' down rows into an fp32 buffer by atomic
adds, and the next layer's steps 1 and 3 (after the last layer, the final norm) add that buffer to the
residual (`pending`): one launch fewer per layer; the sum's order is not fixed, so its last bits (and
rarely a rounded hidden value) may differ from run to run.

Cache. The engine reads and writes transformers' StaticCache tensors [B, Hkv, S_max, d] in place
(`attach`, after the prompt's forward has filled them). A left-padded batch has its rows shifted
left by their padding once, so that every row's cache slot equals its token's rotary position (the
attention kernels index both by `positions[b]`); the padding's slots end up past every position a
row reaches. Rotary tables [S_max, d] come from the model's own rotary embedding, in the model's dtype
(as Hugging Face rounds cos / sin).
The step reads only static buffers (ids, the cache position, the per-row shifts), so it is captured
once into a CUDA graph and replayed. Each SparseMLP's path is decided once per engine (`plan`, at its
first attach: the batch size is fixed) and recorded in `last_decision` as the layer's own calls do.
Refused (`Unsupported`, a ValueError): other families, sliding-window attention shorter than max_length,
rotary embeddings that depend on the length (dynamic / longrope), MLPs with biases or other activations,
modules behind adapters, hooks on any module of the decoder layers (the engine calls none of their
forwards), dtypes other than bf16 / fp16, weights on several devices.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from sparseffn.kernels._runtime import VALIDATED_CAPABILITIES, capability
from sparseffn.nn.fused import FusedRMSNorm, has_fused_rope
from sparseffn.nn.projections import is_plain
from sparseffn.nn.sparse_mlp import SparseMLP
from sparseffn.ops.decode_attention import decode_attention, decode_out_proj, decode_qkv_rope
from sparseffn.ops.decode_block import decode_mlp_block, decode_norm
from sparseffn.ops.sparse_mlp import as_captured, choose_mode
from sparseffn.ops.twell_mlp import stored_transposed

FAMILIES = ("llama", "mistral", "qwen2")
DTYPES = (torch.bfloat16, torch.float16)
# CapturedDecoder(engine="auto") takes the engine up to this batch size: on the 2b model its step was faster
# than the captured Hugging Face step at batches 1, 4 and 16 and slower at 64 (H200 and H100; 17-63 not timed)
AUTO_MAX_BATCH = 16
_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
_ACTS = {"silu": "silu", "swish": "silu", "relu": "relu"}


class Unsupported(ValueError):
    """The engine does not compute this model: the message says what and why."""


@dataclass
class _Layer:
    """One decoder layer's weights (views of the model's parameters) and its MLP's path."""

    attn_norm: torch.Tensor
    attn_eps: float
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    scaling: float
    mlp_norm: torch.Tensor
    mlp_eps: float
    mlp: nn.Module
    gate: torch.Tensor | None
    up: torch.Tensor
    down: torch.Tensor
    act: str
    sparse: bool = False  # set by DecodeEngine.plan


class DecodeEngine:
    """The decode step of `model` for batch_size sequences of up to max_length tokens (module docstring)."""

    def __init__(self, model: nn.Module, *, batch_size: int, max_length: int) -> None:
        config = getattr(model, "config", None)
        family = getattr(config, "model_type", None)
        if family not in FAMILIES:
            raise Unsupported(f"the fused decode engine runs Llama-family models {FAMILIES}, got model_type {family!r} "
                              "(use CapturedDecoder(engine='hf'))")
        _check_attention_span(config, max_length)
        inner = model.model
        _check_unhooked(inner.layers, "layers")
        self.model = model
        self.batch_size, self.max_length = batch_size, max_length
        self.layers = [_layer(i, block, config) for i, block in enumerate(inner.layers)]
        self.embed = model.get_input_embeddings()
        _check_unhooked(inner.norm, "norm")  # computed by decode_norm from its weight
        self.norm, self.norm_eps = _norm(inner.norm, "the final norm")
        self.lm_head = model.get_output_embeddings()
        weight = self.layers[0].wq
        self.device, self.dtype = weight.device, weight.dtype
        if self.dtype not in DTYPES:
            raise Unsupported(f"the fused decode engine computes bf16 / fp16 models, this one is {self.dtype}")
        devices = {p.device for p in model.parameters()}
        if len(devices) > 1:
            raise Unsupported(f"the fused decode engine runs a model on one device, this one is on "
                              f"{sorted(map(str, devices))}")
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMLP) and layer.mlp.mode == "sparse":
                _check_sparse_layout(layer)
        self.cos, self.sin = _rotary_tables(inner.rotary_emb, max_length, self.device, self.dtype)
        hkv = self.layers[0].wk.shape[0] // self.cos.shape[1]
        # the split-KV combine's arrival counters, left zero by every call: one set shared by all layers
        self.counters = torch.zeros(batch_size * hkv, dtype=torch.int32, device=self.device)
        # the folded MLPs' sums, two in turn (one is read by the layer after its MLP while the next fills the
        # other), left zero by the o_proj launch that reads them
        self.pending = torch.zeros(2, batch_size, weight.shape[1], dtype=torch.float32, device=self.device)
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.planned = False

    def plan(self) -> None:
        """Each SparseMLP's path at this batch size: auto mode's decision for a captured decode call of
        batch_size tokens (ops/decide.py), from the layer's mode, expected_nnz and measured activity;
        recorded on the layer as its own calls record it."""
        x = torch.empty(self.batch_size, self.layers[0].up.shape[1], device=self.device, dtype=self.dtype)
        for layer in self.layers:
            mlp = layer.mlp
            if not isinstance(mlp, SparseMLP):
                continue
            auto = mlp.mode == "auto"
            with as_captured():  # the facts of a captured call: the step is replayed from a CUDA graph
                decision = choose_mode(x, layer.up, mode=mlp.mode, expected_nnz=mlp.expected_nnz,
                                       down_t_ready=stored_transposed(layer.down),
                                       activity=mlp.activity if auto else None)
            if decision.mode == "sparse":  # auto decides sparse only for a transposed down; mode="sparse" asks
                _check_sparse_layout(layer)
            layer.sparse = decision.mode == "sparse"
            if auto:
                mlp.activity.last[decision.kind] = decision.mode
            mlp.__dict__["last_decision"] = decision
        self.planned = True

    def mlp_paths(self) -> list[str]:
        """Each layer's MLP path in this engine's step, "sparse" or "dense", as `plan` decided it."""
        if not self.planned:
            raise RuntimeError("the engine plans its MLP paths at its first attach; none has happened")
        return ["sparse" if layer.sparse else "dense" for layer in self.layers]

    def attach(self, cache, shift: torch.Tensor | None) -> None:
        """Take the filled StaticCache's tensors; shift [B, 1]: each row's left padding (None: none),
        by which its cache row is moved left (module docstring)."""
        if not self.planned:
            self.plan()
        self.caches = [(layer.keys, layer.values) for layer in cache.layers]
        if len(self.caches) != len(self.layers):
            raise ValueError(f"the cache has {len(self.caches)} layers, the model {len(self.layers)}")
        if shift is None:
            return
        slots = self.caches[0][0].shape[2]
        index = (torch.arange(slots, device=self.device)[None, :] + shift) % slots  # [B, S]: slot s <- s + shift
        for keys, values in self.caches:
            gather = index[:, None, :, None].expand_as(keys)
            keys.copy_(keys.gather(2, gather))
            values.copy_(values.gather(2, gather))

    def logits(self, ids: torch.Tensor, position: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """[B, V] logits of the tokens ids [B, 1] at cache slot `position` [1]; shift [B, 1] each row's
        left padding (zeros: none). Writes each layer's k and v at the rows' positions."""
        with _unfilled():
            return self._logits(ids, position, shift)

    def _logits(self, ids: torch.Tensor, position: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        positions = position - shift[:, 0]  # [B] rotary position = cache slot after `attach`
        hidden = self.embed(ids[:, 0])  # [B, D]
        pending = None  # the folded MLP output the residual still lacks
        for i, (layer, (keys, values)) in enumerate(zip(self.layers, self.caches)):
            q = decode_qkv_rope(hidden, layer.attn_norm, layer.attn_eps, layer.wq, layer.wk, layer.wv, layer.bq,
                                layer.bk, layer.bv, self.cos, self.sin, positions, keys, values, pending=pending)
            # prefetch: positions come from the step's first op, the older cache slots from earlier steps
            attn = decode_attention(q, keys, values, positions, layer.scaling, counters=self.counters,
                                    prefetch=True)
            hidden = decode_out_proj(attn, layer.wo, layer.bo, hidden, pending=pending)
            threshold = layer.mlp.threshold if isinstance(layer.mlp, SparseMLP) and layer.mlp.has_threshold else None
            pending = self.pending[i % 2] if self._folds(i) else None
            out = decode_mlp_block(hidden, layer.mlp_norm, layer.mlp_eps, layer.gate, layer.up, layer.down, threshold,
                                   act=layer.act, sparse=layer.sparse, fold_into=pending)
            if pending is None:
                hidden = out
        return self.lm_head(decode_norm(hidden, self.norm, self.norm_eps, pending=pending))

    def _folds(self, i: int) -> bool:
        """Whether layer i's MLP is folded (module docstring)."""
        return self.layers[i].sparse and self.batch_size == 1 and not torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def _unfilled():
    """torch.use_deterministic_algorithms(True) fills new memory with NaN unless told not to; every temporary
    of the step is written before it is read, so the fills would only add launches to the captured step."""
    was = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was


def auto_engine(model: nn.Module, *, batch_size: int, max_length: int,
                compile: bool) -> tuple[DecodeEngine | None, str]:
    """CapturedDecoder's engine="auto": (the engine, why) where its step was measured faster than the
    captured Hugging Face step, else (None, why not). It takes the engine for a model the engine computes
    (not `Unsupported`) on a GPU of VALIDATED_CAPABILITIES, at batch_size <= AUTO_MAX_BATCH, compile off."""
    if compile:
        return None, "compile=True compiles the Hugging Face forward"
    refusal = _device_refusal(next(model.parameters()).device)
    if refusal is not None:
        return None, refusal
    if batch_size > AUTO_MAX_BATCH:
        return None, (f"batch {batch_size} > {AUTO_MAX_BATCH}: at batch 64 the captured Hugging Face step was faster "
                      "(cuBLAS projections)")
    try:
        engine = DecodeEngine(model, batch_size=batch_size, max_length=max_length)
    except Unsupported as error:
        return None, str(error)
    return engine, f"a {model.config.model_type} model at batch {batch_size} on a Hopper GPU"


def _device_refusal(device: torch.device) -> str | None:
    """Why auto mode does not take the engine on `device`, or None where its step was timed."""
    if device.type != "cuda":
        return f"the engine's step is timed on CUDA GPUs, the model is on {device}"
    cap = capability(device)
    if cap not in VALIDATED_CAPABILITIES:
        name = torch.cuda.get_device_name(device)
        return f"the engine's step was timed on Hopper GPUs (H100, H200) only; {name} is {cap[0]}.{cap[1]}"
    return None


def _check_attention_span(config, max_length: int) -> None:
    """Every layer attends to the whole cache (no sliding window shorter than max_length)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ()
    sliding = any(t != "full_attention" for t in types) or (
        window is not None and getattr(config, "use_sliding_window", True) and not types)
    if sliding and window is not None and window < max_length:
        raise Unsupported(f"the fused decode engine attends to the whole cache: sliding_window {window} < max_length "
                          f"{max_length} (use CapturedDecoder(engine='hf'))")


def _check_unhooked(modules: nn.Module, where: str) -> None:
    """The engine calls no forward of the decoder layers' modules nor of the final norm: hooks on them, or a
    forward replaced by anything but fuse_non_mlp_'s fused RoPE (the same function), would not run."""
    for name, module in modules.named_modules():
        replaced = "forward" in module.__dict__ and not has_fused_rope(module)
        if module._forward_hooks or module._forward_pre_hooks or replaced:
            raise Unsupported(f"the fused decode engine calls no module's forward inside the decoder layers or the "
                              f"final norm, and {'.'.join(filter(None, (where, name)))} has forward hooks or a "
                              "replaced forward (remove them first)")


def _check_sparse_layout(layer: _Layer) -> None:
    if not stored_transposed(layer.down):
        raise Unsupported(f"{type(layer.mlp).__name__} with mode='sparse' stores down_proj.weight contiguous "
                          "(contiguous_down_): the sparse decode kernels read its transpose; use mode 'auto' or "
                          "'dense' with the fused engine")


def _norm(module: nn.Module, name: str) -> tuple[torch.Tensor, float]:
    if not (isinstance(module, FusedRMSNorm) or type(module).__name__ in _NORMS):
        raise Unsupported(f"the fused decode engine computes Llama's RMSNorm, {name} is {type(module).__name__}")
    return module.weight, float(module.variance_epsilon)


def _linear(module: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not isinstance(module, nn.Linear) or not is_plain(module):
        raise Unsupported(f"the fused decode engine reads plain nn.Linear weights, {name} is {type(module).__name__} "
                          "(adapters or hooks: merge or remove them first)")
    return module.weight, module.bias


def _layer(i: int, block: nn.Module, config) -> _Layer:
    attn, where = block.self_attn, f"layer {i}"
    if getattr(attn, "q_norm", None) is not None:
        raise Unsupported(f"{where}: q/k norms are not computed by the fused decode engine")
    wq, bq = _linear(attn.q_proj, f"{where} q_proj")
    wk, bk = _linear(attn.k_proj, f"{where} k_proj")
    wv, bv = _linear(attn.v_proj, f"{where} v_proj")
    wo, bo = _linear(attn.o_proj, f"{where} o_proj")
    mlp = block.mlp
    if isinstance(mlp, SparseMLP):
        act = "relu"
    else:
        hidden_act = getattr(config, "hidden_act", None)
        if hidden_act not in _ACTS or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            raise Unsupported(f"{where}: the fused decode engine runs SparseMLP or a gated relu / silu MLP, got "
                              f"{type(mlp).__name__} with hidden_act {hidden_act!r}")
        act = _ACTS[hidden_act]
    gate = None
    if getattr(mlp, "gate_proj", None) is not None:
        gate, gate_bias = _linear(mlp.gate_proj, f"{where} gate_proj")
        if gate_bias is not None:
            raise Unsupported(f"{where}: MLP biases are not computed by the fused decode engine")
    up, up_bias = _linear(mlp.up_proj, f"{where} up_proj")
    down, down_bias = _linear(mlp.down_proj, f"{where} down_proj")
    if up_bias is not None or down_bias is not None:
        raise Unsupported(f"{where}: MLP biases are not computed by the fused decode engine")
    attn_norm, attn_eps = _norm(block.input_layernorm, f"{where} input_layernorm")
    mlp_norm, mlp_eps = _norm(block.post_attention_layernorm, f"{where} post_attention_layernorm")
    return _Layer(attn_norm, attn_eps, wq, wk, wv, bq, bk, bv, wo, bo, float(attn.scaling), mlp_norm, mlp_eps, mlp,
                  gate, up, down, act)


def _rotary_tables(rotary: nn.Module, length: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, d] of positions 0 .. length - 1, as the model's rotary embedding gives them."""
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise Unsupported(f"rotary embeddings of type {rope_type!r} change with the length; the fused decode "
                          "engine takes fixed tables (use CapturedDecoder(engine='hf'))")
    positions = torch.arange(length, device=device)[None, :]
    cos, sin = rotary(torch.empty(0, device=device, dtype=dtype), positions)
    return cos[0].contiguous(), sin[0].contiguous()
