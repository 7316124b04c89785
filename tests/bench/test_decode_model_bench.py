import pytest
import torch

from sparseffn.bench.decode_model import (DecodeModelBenchConfig, _generated_nnz, build_bench_model,
                                          decode_model_table)


def _cfg(**kw):
    return DecodeModelBenchConfig(**dict(dict(model="tiny", target_nnz=12.0, batches="1,3", prompt=24, new_tokens=16,
                                              vocab_size=256, calibration_batch_size=2), **kw))


def test_generated_calibration_hits_the_target_at_the_generated_positions():
    """Thresholds fitted on the pool's greedy continuations give ~target active units per token at the
    generated positions of those continuations; batch b's prompt is the pool's first b rows."""
    model, layers, target, prompts = build_bench_model(_cfg(), torch.device("cpu"))
    assert target == 12.0 and sorted(prompts) == [1, 3]
    assert torch.equal(prompts[1], prompts[3][:1])
    assert all(layer.mode == "auto" and layer.expected_nnz is None for layer in layers)
    for layer in layers:
        layer.mode = "dense"
    from sparseffn.bench.decode_model import _greedy

    tokens = _greedy(model, prompts[3], 16)
    got = _generated_nnz(model, tokens, 24)
    assert got["generated_nnz"] == pytest.approx(12.0, rel=0.1)
    assert got["generated_nnz_layer_max"] >= got["generated_nnz"]


def test_calibration_must_be_generated_or_prompt():
    with pytest.raises(ValueError, match="calibration must be 'generated' or 'prompt'"):
        build_bench_model(_cfg(calibration="both"), torch.device("cpu"))


def test_table_shows_generated_activity_and_dashes_for_older_rows():
    base = dict(batch="1", provider="captured", non_mlp="fused", ms_per_token_p50="2.0", ms_per_token_p99="2.1",
                speedup_vs_dense="1.0", roofline_ms="0.8", peak_mib="10", first_divergence="", divergence_margin="",
                prefill_logits_rel_err="")
    dense = dict(base, mlp="dense")
    sparse = dict(base, mlp="sparse", ms_per_token_p50="1.0", speedup_vs_dense="2.0", first_divergence="-1",
                  generated_nnz="29.4", generated_nnz_layer_max="33.0")
    table = decode_model_table([dense, sparse])
    assert "| fused | 1 | captured | 2.000 / 2.100 | 1.000 / 2.100 | **2.00x** |" in table
    assert table.endswith("| 29.4 (33.0) |")
    assert decode_model_table([dense, dict(sparse, generated_nnz="")]).endswith("| – |")


def test_step_provider_is_timed_when_asked_and_tabled_first():
    from sparseffn.bench.decode_model import timed_providers

    assert [p for p, _ in timed_providers(_cfg(step=True))] == ["captured", "step"]
    assert timed_providers(_cfg(step=True, captured=False)) == [("step", {"engine": "fused"})]
    with pytest.raises(ValueError, match="nothing to time"):
        timed_providers(_cfg(captured=False))
    base = dict(batch="1", non_mlp="fused", ms_per_token_p99="2.1", roofline_ms="0.8", peak_mib="10",
                first_divergence="-1", divergence_margin="", prefill_logits_rel_err="")
    rows = [dict(base, provider=p, mlp=m, ms_per_token_p50=ms, speedup_vs_dense=x)
            for p, m, ms, x in (("captured", "dense", "2.9", "1.0"), ("captured", "sparse", "2.5", "1.16"),
                                ("step", "dense", "1.8", "1.0"), ("step", "sparse", "1.4", "1.29"))]
    lines = decode_model_table(rows).splitlines()
    assert lines[2].startswith("| fused | 1 | step | 1.800 / 2.100 | 1.400 / 2.100 | **1.29x** |")
    assert lines[3].startswith("| fused | 1 | captured |")


def test_table_has_the_user_compiled_rows_under_their_own_norms():
    """The user-compiled rows (bench/user_decoder.py: norms and RoPE in plain torch) form a group of
    their own, next to the library's paths."""
    base = dict(batch="1", ms_per_token_p50="2.0", ms_per_token_p99="2.1", speedup_vs_dense="1.0", roofline_ms="0.8",
                peak_mib="10", first_divergence="", divergence_margin="", prefill_logits_rel_err="")
    rows = [dict(base, provider=provider, non_mlp=non_mlp, mlp=mlp,
                 **(dict(ms_per_token_p50=p50, speedup_vs_dense=speedup, first_divergence="-1") if mlp == "sparse" else {}))
            for provider, non_mlp, p50, speedup in (("captured", "fused", "1.6", "1.25"),
                                                    ("user-compiled", "torch", "1.5", "1.33"))
            for mlp in ("dense", "sparse")]
    table = decode_model_table(rows).splitlines()
    assert "| fused | 1 | captured | 2.000 / 2.100 | 1.600 / 2.100 | **1.25x** |" in table[2]
    assert "| torch | 1 | user-compiled | 2.000 / 2.100 | 1.500 / 2.100 | **1.33x** |" in table[3]


def test_dense_rows_layout_is_a_dense_models_and_is_undone():
    """The dense row is timed with the down weight as [D, H] rows too (a dense model's layout); after the
    block each SparseMLP stores it transposed again, the same Parameter and values."""
    from sparseffn.bench.decode_model import _down_stored
    from sparseffn.ops.twell_mlp import stored_transposed

    model, layers, _, _ = build_bench_model(_cfg(), torch.device("cpu"))
    params = [layer.down_proj.weight for layer in layers]
    before = [p.detach().clone() for p in params]
    with _down_stored(layers, "rows"):
        assert all(p.is_contiguous() and not stored_transposed(p) for p in params)
    assert all(stored_transposed(p) for p in params)
    assert all(layer.down_proj.weight is p for layer, p in zip(layers, params))
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    with _down_stored(layers, "transposed"):
        assert all(stored_transposed(p) for p in params)


_RUN = dict(provider="captured", mode="auto", layout="transposed", non_mlp="hf", batch=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the child fails only where there is no CUDA device")
def test_isolated_run_names_the_run_when_its_process_fails():
    """A run in its own process that fails raises here, naming the run and giving the child's last line."""
    from sparseffn.bench.decode_model import _isolated_run

    lines = []
    with pytest.raises(RuntimeError, match=r"the captured run \(auto, down transposed\) at batch 3, hf norms/RoPE "
                                           r"failed in its process \(exit 1\): .*needs a CUDA device"):
        _isolated_run(_cfg(isolate=True), _RUN, lines.append)
    assert any("Traceback" in line for line in lines)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_isolated_run_is_the_in_process_run_in_a_fresh_process():
    """The fresh process builds the same model (seed, pool, calibration): the same greedy tokens as the run
    in this process, and the activity its layers measured."""
    from sparseffn.bench.decode_model import _isolated_run, _timed_run

    cfg = _cfg(isolate=True)
    model, layers, _, prompts = build_bench_model(cfg, torch.device("cuda"))
    here = _timed_run(model, layers, prompts[3], cfg, _RUN)
    there = _isolated_run(cfg, _RUN, print)
    assert torch.equal(there["tokens"], here["tokens"])
    assert there["paths"] == here["paths"] and there["p50"] > 0
    assert len(there["activity"]) == len(layers) and all(a is not None and a > 0 for a in there["activity"])
