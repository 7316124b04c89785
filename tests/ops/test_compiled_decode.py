"""The public op inside a user's torch.compile(fullgraph=True): one opaque decode-kernel node, no
graph break, prepared weights static for CUDA graphs (a non-static tensor input is copied into the
graph's own buffer before every replay), the decision evaluated at trace time."""

import os
import warnings

import pytest
import torch

from sparseffn.ops import SparseMLPWeights, sparse_mlp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or the Triton interpreter"
)


def _weights(d=48, h=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = [(torch.randn(*s, generator=gen) / 6).to(DEVICE, torch.bfloat16) for s in ((h, d), (h, d), (d, h))]
    threshold = torch.rand(h, generator=gen).to(DEVICE) * 0.3
    return (*w, threshold)


class _Recorder:
    """A torch.compile backend that keeps each graph and the static-input mark of its placeholders."""

    def __init__(self):
        self.graphs, self.static = [], {}

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        for node in gm.graph.find_nodes(op="placeholder"):
            self.static[node.name] = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
        return gm

    def calls(self, name):
        return sum(str(n.target) == name for gm in self.graphs for n in gm.graph.nodes)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3])
def test_sparse_op_traces_fullgraph_into_one_decode_node(tokens):
    gate, up, down, threshold = _weights()
    prepared = SparseMLPWeights.prepare(gate, up, down)  # down in Hugging Face layout: down_t is a copy
    x = torch.randn(tokens, 1, gate.shape[1], generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)

    def step(t):
        return t + sparse_mlp(t, gate, up, down, threshold, mode="sparse", prepared=prepared)

    recorder = _Recorder()
    compiled = torch.compile(step, backend=recorder, fullgraph=True)
    with torch.no_grad():
        got, want = compiled(x), step(x)
    assert len(recorder.graphs) == 1 and recorder.calls("sparseffn.decode_mlp.default") == 1
    assert torch.equal(got, want)
    weights = {name: kind for name, kind in recorder.static.items() if "prepared" in name or name.startswith("g_")}
    assert any("down_t" in name for name in weights) and all(k == "unguarded" for k in weights.values()), weights
    assert recorder.static["l_t_"] is None  # the activations stay an ordinary input


def test_prepare_marks_its_tensors_static_and_leaves_values_alone():
    gate, up, down, _ = _weights()
    before = down.clone()
    prepared = SparseMLPWeights.prepare(gate, up, down)
    for t in (prepared.gate_weight, prepared.up_weight, prepared.down_weight, prepared.down_t):
        assert getattr(t, "_dynamo_static_input_type", None) == "unguarded"
    assert torch.equal(prepared.down_t, before.t()) and torch.equal(down, before)


def test_auto_decision_under_compile_has_no_break_or_cache_warning():
    """Auto mode's decision traces without a graph break, and without dynamo's warning about the
    decision's host-side memo (skipped while compiling); the result equals the eager call's."""
    gate, up, down, threshold = _weights()
    prepared = SparseMLPWeights.prepare(gate, up, down)
    x = torch.randn(2, gate.shape[1]).to(DEVICE, torch.bfloat16)

    def step(t):
        return sparse_mlp(t, gate, up, down, threshold, mode="auto", prepared=prepared, expected_nnz=3.0)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(step)(x)
        got = torch.compile(step, backend="eager", fullgraph=True)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    with torch.no_grad():
        assert torch.equal(got, step(x))
