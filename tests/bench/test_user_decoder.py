"""The bench's user-style decoder (bench/user_decoder.py): the model's logits and greedy tokens, and a
torch.compile(fullgraph=True) trace of its step with the public op inside (no graph break, no
plain-tensor weight left for CUDA graphs to copy)."""

import pytest
import torch

from sparseffn.bench.user_decoder import UserDecoder
from sparseffn.models import build_model, sparse_layers
from sparseffn.models.generate import CapturedDecoder


def _model(dtype=torch.float32):
    model = build_model("tiny", vocab_size=128, dtype=dtype, seed=0, num_hidden_layers=2,
                        max_position_embeddings=64).eval()
    gen = torch.Generator().manual_seed(1)
    for layer in sparse_layers(model):
        layer.set_threshold_(torch.rand(layer.intermediate_size, generator=gen) * 0.05)
        layer.activity.observe(20.0, 1024)  # a measured estimate, as auto mode keeps it
    return model


@pytest.mark.parametrize("sparse", [False, True])
def test_user_decoder_matches_the_model(sparse):
    """Prefill logits equal the Hugging Face model's; greedy tokens equal CapturedDecoder's (CPU: every
    step eager) for the dense F.linear MLP and for the public op (on CPU auto mode runs it dense)."""
    model = _model()
    for layer in sparse_layers(model):
        layer.mode = "dense"
    prompt = torch.randint(128, (2, 9), generator=torch.Generator().manual_seed(2))
    decoder = UserDecoder(model, batch_size=2, max_length=32, sparse=sparse)
    with torch.no_grad():
        ours = decoder(prompt, torch.arange(9))
        theirs = model(input_ids=prompt).logits[:, -1]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    expected = CapturedDecoder(model, engine="hf", batch_size=2, max_length=32).generate(prompt, 12)
    assert torch.equal(decoder.generate(prompt, 12), expected)


def test_sparse_user_decoder_needs_measured_activity():
    model = _model()
    sparse_layers(model)[1].activity.nnz = None
    with pytest.raises(ValueError, match="measured activity"):
        UserDecoder(model, batch_size=1, max_length=16, sparse=True)


def test_user_decoder_step_traces_fullgraph():
    """The one-token step with the public op inside traces as one graph, no break (CPU: auto mode's
    dense route inside the op), and the compiled step (aot_eager) gives the eager step's tokens."""
    model = _model(torch.bfloat16)
    decoder = UserDecoder(model, batch_size=2, max_length=32, sparse=True)
    ids, pos = torch.randint(128, (2, 1), generator=torch.Generator().manual_seed(3)), torch.tensor([5])
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(decoder.next_token)(ids, pos)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        compiled = torch.compile(decoder.next_token, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(ids, pos), decoder.next_token(ids, pos))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_user_decoder_compiled_reduce_overhead_on_the_gpu():
    """Under torch.compile(mode="reduce-overhead", fullgraph=True) the sparse step traces the decode
    kernels' op in every layer, replays from CUDA graphs (no skip) with only its ids and position
    copied in before each replay (every weight, prepared down^T included, read in place), and its
    logits are the eager step's (decode kernels there too) up to Inductor's roundings."""
    from torch._dynamo.utils import counters

    from sparseffn.ops.sparse_mlp import as_captured

    model = build_model("0.5b", vocab_size=512, dtype=torch.bfloat16, device="cuda", seed=0, num_hidden_layers=2,
                        max_position_embeddings=128).eval()
    for layer in sparse_layers(model):
        layer.set_threshold_(0.5)
        layer.activity.observe(29.0, 1024)
    prompt = torch.randint(512, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    decoder = UserDecoder(model, batch_size=2, max_length=64, sparse=True)
    ids, pos = prompt[:, -1:], torch.tensor([16], device="cuda")
    torch._dynamo.reset()
    with torch.no_grad():
        decoder(prompt, torch.arange(16, device="cuda"))  # fills the cache
        explained = torch._dynamo.explain(decoder.forward)(ids, pos)
        ops = [n for g in explained.graphs for n in g.graph.nodes if str(n.target) == "sparseffn.decode_mlp.default"]
        assert explained.graph_break_count == 0 and len(ops) == 2
        with as_captured():  # the eager op takes the decode kernels, as the compiled one does
            want = decoder(ids, pos)
        torch._dynamo.reset()
        counters.clear()
        step = torch.compile(decoder.forward, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):  # warm-up, record, replay (writing the same k, v at the same position)
            got = step(ids, pos).clone()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] <= 2  # ids, pos
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 2e-2
    torch._dynamo.reset()
