from sparseffn.cli import main


def test_demo_smoke(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--steps", "4", "--eval-interval", "2", "--batch-size", "4", "--seq-len", "32",
                 "--vocab-size", "300", "--eval-batches", "1", "--generate-tokens", "8", "--no-progress",
                 "--model-override", "num_hidden_layers=2", "--out-dir", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    for needle in ("held-out cross-entropy", "TwELL (tile 256, 32 slots)", "exact", "samples", "OK"):
        assert needle in text, needle
    assert "WRONG" not in text and "FAILED" not in text
    for name in ("plots/loss.png", "plots/sparsity.png", "plots/dead.png", "eval/eval_layers.png", "model/config.json"):
        assert (out / name).is_file(), name
    # A second demo in the same folder starts over.
    assert main(["demo", "--steps", "2", "--eval-interval", "0", "--batch-size", "2", "--seq-len", "16",
                 "--vocab-size", "300", "--eval-batches", "1", "--generate-tokens", "4", "--no-progress",
                 "--model-override", "num_hidden_layers=1", "--out-dir", str(out)]) == 0


def test_synthetic_pack_demo_still_reachable(capsys):
    assert main(["demo", "--synthetic"]) == 0
    assert "OK: the sparse MLP equals the dense one" in capsys.readouterr().out
