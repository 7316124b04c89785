import pytest
import torch
import torch.nn.functional as F

from sparseffn import build_model, calibrate_thresholds
from sparseffn.models import sparse_mlps
from tests.models.hf import tiny_lm

VOCAB = 512


def _model(dtype=None):
    return build_model("tiny", vocab_size=VOCAB, num_hidden_layers=3, seed=0, dtype=dtype)


def _batches(n=4, batch=4, length=32):
    return [torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _measured_nnz(model, batches):
    """Per layer, by hand: mean over tokens of #{j: gate_proj(x)_j - θ_j > 0} on the model's own inputs."""
    counts = {i: [] for i in range(len(sparse_mlps(model)))}

    def make_hook(i):
        def hook(module, args):
            g = F.linear(args[0], module.gate_proj.weight)
            counts[i].append((g - module.threshold.to(g.dtype) > 0).sum(-1).flatten().float())

        return hook

    handles = [m.register_forward_pre_hook(make_hook(i)) for i, m in enumerate(sparse_mlps(model))]
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids)
    for h in handles:
        h.remove()
    return [float(torch.cat(c).mean()) for c in counts.values()]


@pytest.mark.parametrize("target", [12, 40])
def test_reaches_target_per_layer(target):
    model = _model()
    batches = _batches()
    natural = _measured_nnz(model, batches)
    assert all(n > 3 * target for n in natural)
    report = calibrate_thresholds(model, batches, target)
    assert [r["layer"] for r in report] == [0, 1, 2] and report[0]["name"] == "model.layers.0.mlp"
    for m in sparse_mlps(model):
        assert m.has_threshold and m.expected_nnz == target and m.track_l1 is None and m.last_l1 is None
    measured = _measured_nnz(model, batches)
    for r, nnz in zip(report, measured):
        assert abs(nnz - target) <= 0.1 * target, (r, nnz)
        assert r["mean_nnz"] == pytest.approx(nnz) and r["reached"]
        assert r["max_nnz"] > nnz and r["threshold_min"] >= 0 and r["threshold_std"] > 0
        assert r["threshold_max"] > r["threshold_min"]
    assert model.config.sparseffn["expected_nnz"] == target
    assert model.training  # restored


def test_units_fire_at_different_rates():
    model = _model()
    batches = _batches()
    calibrate_thresholds(model, batches, 20)
    rates = []
    mlp = sparse_mlps(model)[1]
    handle = mlp.register_forward_pre_hook(lambda m, args: rates.append(m.activation_mask(args[0]).flatten(0, -2)))
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids)
    handle.remove()
    rate = torch.cat(rates).float().mean(0)
    assert rate.max() > 3 * rate.mean()  # not every unit at target/H: per-unit variation is kept


def test_bf16():
    model = _model(dtype=torch.bfloat16)
    batches = _batches()
    report = calibrate_thresholds(model, batches, 24)
    for r, nnz in zip(report, _measured_nnz(model, batches)):
        assert abs(nnz - 24) <= 0.1 * 24 and r["reached"]
    for m in sparse_mlps(model):
        assert torch.equal(m.threshold, m.threshold.bfloat16().float())  # exact in the weights' dtype


def test_unreachable_target_warns_and_keeps_relu():
    model = _model()
    with pytest.warns(UserWarning, match="outside 5% of target_nnz=340"):
        report = calibrate_thresholds(model, _batches(n=1), 340)
    assert not any(r["reached"] for r in report)
    assert not any(m.has_threshold for m in sparse_mlps(model))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(batches=[]), ValueError, "batches is empty"),
        (dict(batches=3), TypeError, "batches must be an iterable"),
        (dict(batches=[torch.rand(2, 8)]), TypeError, r"batches\[0\] must hold integer token ids"),
        (dict(batches=[torch.zeros(8, dtype=torch.long)]), ValueError, r"batches\[0\] must be a non-empty \[B, T\]"),
        (dict(target_nnz=0), ValueError, r"target_nnz must be in \(0, H\) = \(0, 352\)"),
        (dict(target_nnz=352), ValueError, "target_nnz must be in"),
        (dict(target_nnz="10"), TypeError, "target_nnz must be a number"),
        (dict(tolerance=1.5), ValueError, r"tolerance must be in \(0, 1\)"),
        (dict(mix=1.0), ValueError, r"mix must be in \[0, 1\)"),
    ],
)
def test_bad_inputs(kwargs, error, message):
    args = dict(batches=_batches(n=1), target_nnz=10) | kwargs
    with pytest.raises(error, match=message):
        calibrate_thresholds(_model(), args.pop("batches"), args.pop("target_nnz"), **args)


def test_needs_a_sparse_model():
    with pytest.raises(ValueError, match="sparsify_ it before calibrating"):
        calibrate_thresholds(tiny_lm(), _batches(n=1), 10)


def test_tokenizer_dicts_ignore_padding():
    """Right-padded tokenizer output: the real tokens see what they see unpadded (causal attention), so
    the thresholds equal those from the unpadded sequences; counting the padding changes them."""
    from transformers import BatchEncoding

    lengths = [32, 20, 11, 27]
    seqs = [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lengths)]
    ids = torch.full((len(seqs), 32), 7)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : s.shape[1]], mask[i, : s.shape[1]] = s[0], 1
    padded = BatchEncoding({"input_ids": ids, "attention_mask": mask})

    by_seq, by_dict, with_pad = _model(), _model(), _model()
    expect = calibrate_thresholds(by_seq, seqs, 20)
    got = calibrate_thresholds(by_dict, padded, 20)
    counted = calibrate_thresholds(with_pad, [{"input_ids": ids}], 20)
    for a, b, c, ra, rb in zip(sparse_mlps(by_seq), sparse_mlps(by_dict), sparse_mlps(with_pad), expect, got):
        torch.testing.assert_close(b.threshold, a.threshold, rtol=0, atol=2e-3)
        assert rb["mean_nnz"] == pytest.approx(ra["mean_nnz"], rel=1e-2)
        assert (c.threshold - a.threshold).abs().max() > 1e-2
    with pytest.raises(ValueError, match=r"batches\[0\] is a mapping without 'input_ids'"):
        calibrate_thresholds(_model(), [{"ids": ids}], 20)
    with pytest.raises(ValueError, match="masks every token"):
        calibrate_thresholds(_model(), [{"input_ids": ids, "attention_mask": torch.zeros_like(ids)}], 20)


def test_calibration_mask_counts_only_its_positions_with_the_whole_sequence_as_context():
    """The fitted positions see their whole prefix (unlike attention_mask, which hides the rest): the
    thresholds reach the target on those positions, measured by hand with the whole sequence run."""
    ids = torch.randint(0, VOCAB, (4, 48), generator=torch.Generator().manual_seed(5))
    tail = torch.zeros_like(ids, dtype=torch.bool)
    tail[:, 32:] = True
    model, whole = _model(), _model()
    report = calibrate_thresholds(model, [{"input_ids": ids, "calibration_mask": tail}], 20)
    calibrate_thresholds(whole, [ids], 20)
    counts = {i: [] for i in range(len(sparse_mlps(model)))}

    def make_hook(i):
        def hook(module, args):
            g = F.linear(args[0][:, 32:], module.gate_proj.weight)
            counts[i].append((g - module.threshold.to(g.dtype) > 0).sum(-1).float().mean())

        return hook

    handles = [m.register_forward_pre_hook(make_hook(i)) for i, m in enumerate(sparse_mlps(model))]
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    for i, r in enumerate(report):
        assert float(counts[i][0]) == pytest.approx(r["mean_nnz"], rel=1e-6)
        assert r["mean_nnz"] == pytest.approx(20, rel=0.05)
    assert any((a.threshold - b.threshold).abs().max() > 1e-2 for a, b in zip(sparse_mlps(model), sparse_mlps(whole)))
    with pytest.raises(ValueError, match=r"batches\[0\]\['calibration_mask'\] must be a tensor of input_ids' shape"):
        calibrate_thresholds(_model(), [{"input_ids": ids, "calibration_mask": tail[:, :4]}], 20)
    with pytest.raises(ValueError, match="leaves no token to count"):
        calibrate_thresholds(_model(), [{"input_ids": ids, "calibration_mask": torch.zeros_like(tail)}], 20)


def test_measure_activity_is_what_calibration_reports():
    from sparseffn.models.calibrate import measure_activity

    model, batches = _model(), _batches(n=2)
    report = calibrate_thresholds(model, batches, 16)
    measured = measure_activity(model, batches)
    assert [m["mean_nnz"] for m in measured] == pytest.approx([r["mean_nnz"] for r in report], rel=1e-9)
    assert [m["mean_nnz"] for m in measured] == pytest.approx(_measured_nnz(model, batches), rel=1e-6)
    with pytest.raises(ValueError, match="has no sparse layer"):
        measure_activity(tiny_lm(), batches)
