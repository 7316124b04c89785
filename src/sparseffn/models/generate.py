"""Fast token-by-token generation for Hugging Face causal LMs: one decode step replayed from a CUDA graph.

Eager generation is bound by host work (a 2B model spends ~5 ms of CPU per token issuing some
thousand kernels, against ~1 ms of GPU work), so sparse MLP kernels cannot show there. `CapturedDecoder`
runs the prompt eagerly into a static KV cache (transformers' `StaticCache`), takes a few decode steps
eagerly (they compile the kernels and give every `SparseMLP` a measured activity; the last one takes
the paths the graph will take, `ops.sparse_mlp.as_captured`, so their kernels load before capture),
then captures one whole decode step (model forward, token pick, cache and position updates) into a
CUDA graph and replays it once per token: no host work per token beyond the replay, no host sync
until the end (with end tokens, one every STOP_CHECK steps).
Under capture auto mode sends each sparse layer's few-token calls to the decode kernels
(kernels/decode_mlp.py) when its measured activity makes them pay; dense models run the same way.

    decoder = CapturedDecoder(model, batch_size=1, max_length=1024)
    tokens = decoder.generate(input_ids, max_new_tokens=256)       # [B, prompt + new], greedy
    sampler = CapturedDecoder(model, batch_size=1, max_length=1024, do_sample=True, temperature=0.8,
                              top_p=0.95, eos_token_id=tokenizer.eos_token_id)

`engine="fused"` replaces the decode step's model forward by `models.decode_step.DecodeEngine` for
Llama-family models (Llama, Mistral, Qwen2; others are refused): four fused launches per layer over the
model's own weights and the same static cache, each SparseMLP on the sparse decode kernels where auto
mode decides they pay at the batch size. The prompt and the first eager_steps - 1 decode steps run
the Hugging Face forward (they measure every SparseMLP's activity); the engine takes every later step,
its first one eagerly (loading its kernels), the rest from a CUDA graph (off CUDA: eagerly).
engine="hf" captures the Hugging Face forward. The default, engine="auto", takes the fused engine where
its step was measured faster (`decode_step.auto_engine`: a model it computes, a Hopper GPU, batch <= 16,
compile off) and the Hugging Face forward elsewhere; `engine` says which it took, `engine_reason` why.
Both compute the same function: they differ by rounding only (the engine's greedy tokens equalled the
Hugging Face step's in the tests and benchmarks).

`compile=True` also runs the decode step's model forward through `torch.compile` (Inductor fuses the
small elementwise kernels of norms, rotary embeddings and residuals; the graph then replays fewer
kernels). The eager steps compile it, at the decode shape only.

Tokens are picked greedily (argmax, the first maximum on ties; without end tokens and at two or more sequences
the pick and the step's cache-position advance are one launch, `ops.greedy_pick`) or, with `do_sample=True`, sampled
from softmax(logits / temperature) after Hugging Face's top-k and top-p filters, in that order
(`pick_tokens`: a Gumbel-max draw from torch's default generator, so no host sync and no
data-dependent shape; seed it with `torch.manual_seed`). With `eos_token_id`, a sequence that emits
one of those tokens gets `pad_token_id` afterwards, and generation stops once every sequence has
(checked every STOP_CHECK steps, one host sync each); the result is cut after the step that finished
the last sequence, as Hugging Face's `generate` returns it. Prompts of different lengths come padded
on the left with an `attention_mask` (as for Hugging Face's generate); such a batch replays a step of
its own, captured with the mask over the cache. A decoder picks tokens one way for its lifetime (the
step is captured with it) and has one batch size and length. Capture needs CUDA: on any other
device (a CPU) every decode step runs eagerly, the same step with the same tokens, only slower.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from dataclasses import dataclass

import torch
from torch import nn

from sparseffn.models.decode_step import DecodeEngine, auto_engine
from sparseffn.ops.greedy_pick import advance_greedy_, greedy_scratch
from sparseffn.ops.sparse_mlp import as_captured

ENGINES = ("auto", "hf", "fused")
STOP_CHECK = 16  # steps between two checks whether every sequence has finished (with eos_token_id)


@dataclass(frozen=True)
class Sampling:
    """How `pick_tokens` draws: softmax(logits / temperature) over the tokens top_k (0: all) and top_p
    (1.0: all) leave."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) \
                or not 0 < self.temperature < float("inf"):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: no top-k filter), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: no top-p filter), got {self.top_p!r}")


def pick_tokens(logits: torch.Tensor, sampling: Sampling | None) -> torch.Tensor:
    """[B] int64 from logits [B, V]: argmax (sampling None), else one draw per row from
    softmax(logits / temperature) restricted to the top_k largest logits (ties at the k-th kept) and
    then to the smallest set of the most likely tokens whose probabilities reach top_p (as Hugging
    Face's TopK / TopP warpers). Gumbel-max: argmax(l - log E) with E ~ Exp(1) is a draw from
    softmax(l); no host sync, static shapes (capturable)."""
    if sampling is None:
        return logits.argmax(-1)
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens: keep while it is under top_p
        ordered = ordered.masked_fill(before >= sampling.top_p, float("-inf"))
        scores = scores.scatter(-1, order, ordered)
    # E floored at eps/2 as CUDA's exponential_ floors it: a draw of exactly 0 (possible on the CPU)
    # would give a masked-out token -inf + inf = NaN, which argmax would pick
    draws = torch.empty_like(scores).exponential_().clamp_min_(torch.finfo(scores.dtype).eps / 2)
    return (scores - draws.log()).argmax(-1)


class CapturedDecoder:
    """Generation with each decode step replayed from one CUDA graph (module docstring). batch_size,
    max_length: the one shape of its calls. eager_steps: decode steps run eagerly before the capture
    (off CUDA: all of them).
    record_times: keep each replay's GPU ms in `step_ms`. compile: the step's forward through
    torch.compile. engine: "auto", "hf" (the Hugging Face forward) or "fused" (`DecodeEngine`, module
    docstring); the one taken is `engine`, why `engine_reason`.
    do_sample, temperature, top_k, top_p: how tokens are picked (`Sampling`).
    eos_token_id (an id or a list), pad_token_id (default: the first end token): stopping."""

    def __init__(self, model: nn.Module, *, batch_size: int, max_length: int, eager_steps: int = 5,
                 record_times: bool = False, compile: bool = False, engine: str = "auto", do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> None:
        from transformers import StaticCache

        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a Hugging Face causal LM, got {type(model).__name__}")
        device = next(model.parameters()).device
        for name, value in (("batch_size", batch_size), ("max_length", max_length), ("eager_steps", eager_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("compile", compile), ("do_sample", do_sample)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if engine == "fused" and compile:
            raise ValueError("compile=True compiles the Hugging Face forward; engine='fused' replaces it (pick one)")
        self.sampling = Sampling(temperature, top_k, top_p) if do_sample else None
        vocab = getattr(model.config, "vocab_size", None)
        eos = _token_ids("eos_token_id", eos_token_id, vocab, many=True)
        pad = _token_ids("pad_token_id", pad_token_id, vocab, many=False)
        self.model, self.device = model, device
        self.batch_size, self.max_length, self.eager_steps = batch_size, max_length, eager_steps
        self.cache = StaticCache(config=model.config, max_cache_len=max_length)
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # the decode step's static state: the token to feed, its cache position, every token so far
        self._ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self._position = torch.zeros(1, dtype=torch.long, device=device)
        self._out = torch.zeros(batch_size, max_length, dtype=torch.long, device=device)
        # stopping: the end tokens, the pad that follows them, which sequences have ended
        self._eos = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
        self._pad = (pad or eos or [0])[0]
        self._finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
        # greedy without end tokens, 2+ sequences: each step's pick and advance in one launch (its scratch sized at
        # the first prompt's logits); at one sequence torch's ops were as fast or faster (docs/decode_engine.md)
        self._greedy: tuple[torch.Tensor, ...] | None = None
        # left-padded batches: the attention mask over the whole cache (1: a token, 0: padding) and each
        # row's padding, which the positions subtract; their step is captured apart (`_graphs[True]`)
        self._mask = torch.ones(batch_size, max_length, dtype=torch.long, device=device)
        self._shift = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self._padded = False
        self._graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        # the decode step's forward (T = 1), compiled for its one static shape when asked. A partial of a
        # module-level function, not a bound method: stored on self, that would make a reference cycle,
        # and a deleted decoder would hold its cache and graph pool until the garbage collector ran
        self.compiled = compile
        forward = functools.partial(_last_logits, model, self.cache, self._cache_kwarg)
        self._step_forward = torch.compile(forward, dynamic=False) if compile else forward
        if engine == "auto":
            self._engine, self.engine_reason = auto_engine(model, batch_size=batch_size, max_length=max_length,
                                                           compile=compile)
        else:
            fused = engine == "fused"
            self._engine = DecodeEngine(model, batch_size=batch_size, max_length=max_length) if fused else None
            self.engine_reason = "asked for"
        self.engine = "hf" if self._engine is None else "fused"
        self.record_times = record_times
        self.step_ms: list[float] = []  # with record_times: GPU ms of each replayed step of the last call

    @property
    def decode_engine(self) -> DecodeEngine | None:
        """The fused engine that computes the decode steps (engine "fused"), or None (the Hugging Face forward)."""
        return self._engine

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, P + new]: the prompts and their continuations (new = max_new_tokens, or fewer once every
        sequence has ended). attention_mask [B, P] (1: a token, 0: padding) for prompts of different
        lengths, padded on the left as for Hugging Face's generate."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be an int64 tensor [batch, prompt], got {getattr(input_ids, 'shape', None)}")
        b, p = input_ids.shape
        if b != self.batch_size:
            raise ValueError(f"input_ids has batch {b}, this decoder was built for {self.batch_size}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1 \
                or p + max_new_tokens > self.max_length:
            raise ValueError(f"prompt {p} + max_new_tokens {max_new_tokens!r} must fit max_length {self.max_length}")
        self._padded = self._set_padding(attention_mask, input_ids.shape)
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
        self._finished.zero_()
        logits = _last_logits(self.model, self.cache, self._cache_kwarg, prompt, torch.arange(p, device=self.device),
                              *self._padding())
        if self._greedy is None and self.sampling is None and self._eos is None and self.batch_size > 1:
            self._greedy = greedy_scratch(self.batch_size, logits.shape[1], self.device)
        token = self._pick(logits)  # [B]
        out[:, p] = token
        ids.copy_(token[:, None])
        position.fill_(p)
        # off CUDA there is no graph to capture: every step runs eagerly (the same step, the same tokens)
        eager = min(self.eager_steps if self.device.type == "cuda" else new - 1, new - 1)
        remaining = new - 1 - eager
        hf_steps = eager if self._engine is None else min(eager, self.eager_steps - 1)  # then the engine's
        done = 1  # tokens generated so far
        for i in range(eager):
            if self._all_finished():
                break
            if i >= hf_steps:
                if i == hf_steps:
                    self._engine.attach(self.cache, self._shift if self._padded else None)
                self._step(engine=True)
            elif remaining and i == eager - 1 and not self.compiled:
                # the graph's paths (the decode kernels), run once eagerly: loads their GPU modules,
                # which cannot load while the stream captures (compiled steps are traced already)
                with as_captured():
                    self._step()
            else:
                self._step()
            done += 1
        self.step_ms = []
        if remaining and done == 1 + eager:
            graph = self._graphs[self._padded] if self._padded in self._graphs else self._capture()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(remaining + 1)] if self.record_times else []
            if events:
                events[0].record()
            replays = 0
            while replays < remaining and not (replays % STOP_CHECK == 0 and self._all_finished()):
                graph.replay()
                replays += 1
                done += 1
                if events:
                    events[replays].record()
            if events:
                events[replays].synchronize()
                self.step_ms = [a.elapsed_time(b) for a, b in zip(events[:replays], events[1:replays + 1])]
        return out[:, :p + self._kept(out[:, p:p + done])].clone()

    def _set_padding(self, attention_mask: torch.Tensor | None, shape: torch.Size) -> bool:
        """Check a prompt's attention mask and load it into the static mask and shifts; whether the
        batch has padding (a host sync when a mask is given)."""
        if attention_mask is None:
            self._shift.zero_()  # the engine's step subtracts it from the cache position
            return False
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != shape:
            raise ValueError(f"attention_mask must be a tensor shaped like input_ids {list(shape)}, "
                             f"got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
        mask = attention_mask.to(device=self.device, dtype=torch.long)
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (a token) only")
        if bool((mask[:, 1:] < mask[:, :-1]).any()) or bool((mask[:, -1] == 0).any()):
            raise ValueError("attention_mask must pad on the left (zeros, then ones, every prompt ending in a token), "
                             "as for Hugging Face's generate with tokenizer.padding_side = 'left'")
        if bool(mask.all()):
            self._shift.zero_()
            return False
        p = shape[1]
        self._mask.fill_(1)
        self._mask[:, :p] = mask
        self._shift.copy_(p - mask.sum(1, keepdim=True))
        return True

    def _padding(self) -> tuple[torch.Tensor, ...]:
        """The forward's extra arguments: the static mask and shifts for a padded batch, else none."""
        return (self._mask, self._shift) if self._padded else ()

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """[B] next tokens from logits [B, V]; with end tokens, pad for the sequences that have ended,
        and mark those that end now."""
        token = pick_tokens(logits, self.sampling)
        if self._eos is not None:
            token = torch.where(self._finished, self._pad, token)
            self._finished |= (token[:, None] == self._eos).any(-1)
        return token

    def _all_finished(self) -> bool:
        """Whether every sequence has ended (a host sync; False at once without end tokens)."""
        return self._eos is not None and bool(self._finished.all())

    def _kept(self, generated: torch.Tensor) -> int:
        """How many generated columns to return: all of them, or with end tokens up to the step that
        ended the last sequence (as Hugging Face's generate stops there)."""
        n = generated.shape[1]
        if self._eos is None:
            return n
        ended = (generated[:, :, None] == self._eos).any(-1)  # [B, n]
        first = torch.where(ended.any(1), ended.int().argmax(1), n - 1)  # each sequence's end (or the last)
        return int(first.max()) + 1

    def _step(self, engine: bool = False) -> None:
        """One decode step in place: feed ids at `position`, write the pick to out and ids, advance.
        engine: the fused engine's forward (its cache attached) instead of the model's."""
        if engine:
            logits = self._engine.logits(self._ids, self._position, self._shift)
        else:
            logits = self._step_forward(self._ids, self._position, *self._padding())
        if self._greedy is not None:
            advance_greedy_(logits, self._out, self._ids, self._position, self._greedy)
            return
        token = self._pick(logits)  # [B]
        self._out.index_copy_(1, self._position + 1, token[:, None])
        self._ids.copy_(token[:, None])
        self._position.add_(1)

    def _capture(self) -> torch.cuda.CUDAGraph:
        """The decode step recorded into a CUDA graph (recording runs nothing); every tensor it touches
        is the decoder's own (cache, ids, position, out), so later generate calls replay it too."""
        assert self.device.type == "cuda", "off CUDA every step runs eagerly (_generate)"
        graph = torch.cuda.CUDAGraph()
        # torch's one capture stream for every decoder: cuBLAS keeps a workspace per stream for good,
        # so a fresh stream per decoder would hold one more 32 MiB workspace each
        with torch.cuda.device(self.device), torch.cuda.graph(graph):
            self._step(engine=self._engine is not None)
        self._graphs[self._padded] = graph
        return graph


def _token_ids(name: str, value, vocab: int | None, *, many: bool) -> list[int]:
    """value (None, a token id, or with `many` a non-empty list / tuple of them) as a list, checked
    against the vocabulary."""
    if not many and isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be one token id, got {value!r}")
    ids = [] if value is None else [value] if isinstance(value, numbers.Integral) else value
    if not isinstance(ids, (list, tuple)) or (value is not None and not ids) or any(
            isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 or (vocab is not None and i >= vocab)
            for i in ids):
        raise ValueError(f"{name} must be None, a token id or a non-empty list of them, each in [0, "
                         f"{vocab if vocab is not None else 'vocab_size'}), got {value!r}")
    return [int(i) for i in ids]


def _last_logits(model: nn.Module, cache, cache_kwarg: str, ids: torch.Tensor, position: torch.Tensor,
                 mask: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of the last position for ids [B, T] at cache positions `position` [T]; for a left-padded
    batch, mask [B, max_length] over the cache and shift [B, 1], each row's padding (its tokens'
    positions start at 0 after it; the padding's own positions are clamped to 0)."""
    positions = position[None, :].expand(ids.shape[0], -1)
    extra = {}
    if mask is not None:
        positions = (positions - shift).clamp_min(0)
        extra["attention_mask"] = mask
    out = model(input_ids=ids, cache_position=position, position_ids=positions, use_cache=True, **extra,
                **{cache_kwarg: cache})
    return out.logits[:, -1]
