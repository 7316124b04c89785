"""Fast token-by-token generation for Hugging Face causal LMs: one decode step replayed from a CUDA graph.

Eager generation is bound by host work (a 2B model spends ~5 ms of CPU per token issuing some
thousand kernels, against ~1 ms of GPU work), so sparse MLP kernels cannot show there. `CapturedDecoder`
runs the prompt eagerly into a static KV cache (transformers' `StaticCache`), takes a few decode steps
eagerly (they compile the kernels and give every `SparseMLP` a measured activity; the last one takes
the paths the graph will take, `ops.sparse_mlp.as_captured`, so their kernels load before capture),
then captures one whole decode step (model forward, greedy pick, cache and position updates) into a
CUDA graph and replays it once per token: no host work per token beyond the replay, no host sync
until the end.
Under capture auto mode sends each sparse layer's few-token calls to the decode kernels
(kernels/decode_mlp.py) when its measured activity makes them pay; dense models run the same way.

    decoder = CapturedDecoder(model, batch_size=1, max_length=1024)
    tokens = decoder.generate(input_ids, max_new_tokens=256)       # [B, prompt + new], greedy

`compile=True` also runs the decode step's model forward through `torch.compile` (Inductor fuses the
small elementwise kernels of norms, rotary embeddings and residuals; the graph then replays fewer
kernels). The eager steps compile it, at the decode shape only.

Greedy only (argmax, the first maximum on ties), fixed batch size and length per decoder (the graph
is captured for one shape), no stop tokens (every sequence gets max_new_tokens). Capture needs CUDA;
on other devices only the eager steps run (eager_steps >= max_new_tokens - 1).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from sparseffn.ops.sparse_mlp import as_captured


class CapturedDecoder:
    """Greedy generation with each decode step replayed from one CUDA graph (module docstring)."""

    def __init__(self, model: nn.Module, *, batch_size: int, max_length: int, eager_steps: int = 5,
                 record_times: bool = False, compile: bool = False) -> None:
        from transformers import StaticCache

        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a Hugging Face causal LM, got {type(model).__name__}")
        device = next(model.parameters()).device
        for name, value in (("batch_size", batch_size), ("max_length", max_length), ("eager_steps", eager_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be a bool, got {compile!r}")
        self.model, self.device = model, device
        self.batch_size, self.max_length, self.eager_steps = batch_size, max_length, eager_steps
        self.cache = StaticCache(config=model.config, max_cache_len=max_length)
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # the decode step's static state: the token to feed, its cache position, every token so far
        self._ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self._position = torch.zeros(1, dtype=torch.long, device=device)
        self._out = torch.zeros(batch_size, max_length, dtype=torch.long, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        # the decode step's forward (T = 1), compiled for its one static shape when asked. A partial of a
        # module-level function, not a bound method: stored on self, that would make a reference cycle,
        # and a deleted decoder would hold its cache and graph pool until the garbage collector ran
        self.compiled = compile
        forward = functools.partial(_last_logits, model, self.cache, self._cache_kwarg)
        self._step_forward = torch.compile(forward, dynamic=False) if compile else forward
        self.record_times = record_times
        self.step_ms: list[float] = []  # with record_times: GPU ms of each replayed step of the last call

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """[B, P + max_new_tokens]: the prompt and its greedy continuation."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be an int64 tensor [batch, prompt], got {getattr(input_ids, 'shape', None)}")
        b, p = input_ids.shape
        if b != self.batch_size:
            raise ValueError(f"input_ids has batch {b}, this decoder was built for {self.batch_size}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1 \
                or p + max_new_tokens > self.max_length:
            raise ValueError(f"prompt {p} + max_new_tokens {max_new_tokens!r} must fit max_length {self.max_length}")
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(input_ids.to(self.device), max_new_tokens)
        finally:
            self.model.train(was_training)

    def _generate(self, prompt: torch.Tensor, new: int) -> torch.Tensor:
        p = prompt.shape[1]
        self.cache.reset()
        out, ids, position = self._out, self._ids, self._position
        out[:, :p] = prompt
        token = _last_logits(self.model, self.cache, self._cache_kwarg, prompt,
                             torch.arange(p, device=self.device)).argmax(-1)  # [B]
        out[:, p] = token
        ids.copy_(token[:, None])
        position.fill_(p)
        eager = min(self.eager_steps, new - 1)
        remaining = new - 1 - eager
        for i in range(eager):
            if remaining and i == eager - 1 and not self.compiled:
                # the graph's paths (the decode kernels), run once eagerly: loads their GPU modules,
                # which cannot load while the stream captures (compiled steps are traced already)
                with as_captured():
                    self._step()
            else:
                self._step()
        self.step_ms = []
        if remaining:
            graph = self._graph if self._graph is not None else self._capture()
            if not self.record_times:
                for _ in range(remaining):
                    graph.replay()
            else:
                events = [torch.cuda.Event(enable_timing=True) for _ in range(remaining + 1)]
                events[0].record()
                for i in range(remaining):
                    graph.replay()
                    events[i + 1].record()
                events[-1].synchronize()
                self.step_ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
        return out[:, :p + new].clone()

    def _step(self) -> None:
        """One decode step in place: feed ids at `position`, write the pick to out and ids, advance."""
        token = self._step_forward(self._ids, self._position).argmax(-1)  # [B]
        self._out.index_copy_(1, self._position + 1, token[:, None])
        self._ids.copy_(token[:, None])
        self._position.add_(1)

    def _capture(self) -> torch.cuda.CUDAGraph:
        """The decode step recorded into a CUDA graph (recording runs nothing); every tensor it touches
        is the decoder's own (cache, ids, position, out), so later generate calls replay it too."""
        if self.device.type != "cuda":
            raise ValueError(f"capturing the decode step needs a CUDA device, the model is on {self.device} "
                             "(eager_steps >= max_new_tokens runs every step eagerly)")
        graph = torch.cuda.CUDAGraph()
        # torch's one capture stream for every decoder: cuBLAS keeps a workspace per stream for good,
        # so a fresh stream per decoder would hold one more 32 MiB workspace each
        with torch.cuda.device(self.device), torch.cuda.graph(graph):
            self._step()
        self._graph = graph
        return graph


def _last_logits(model: nn.Module, cache, cache_kwarg: str, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Logits of the last position for ids [B, T] at cache positions `position` [T]."""
    positions = position[None, :].expand(ids.shape[0], -1)
    out = model(input_ids=ids, cache_position=position, position_ids=positions, use_cache=True, **{cache_kwarg: cache})
    return out.logits[:, -1]
