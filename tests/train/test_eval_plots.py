import json
import re

import pytest
import torch

from sparseffn.cli import main
from sparseffn.train.checkpoint import list_checkpoints
from sparseffn.train.eval import run_eval
from sparseffn.train.plots import plot_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def test_training_outputs(trained_run):
    out = trained_run.out_dir
    for name in ("config.json", "run.json", "tokenizer.json", "metrics.jsonl", "model/config.json",
                 "model/model.safetensors", "model/tokenizer.json"):
        assert (out / name).is_file(), name
    for name in ("loss.png", "sparsity.png", "dead.png"):
        assert (out / "plots" / name).read_bytes()[:8] == PNG
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, 9))
    first = train_rows[0]
    assert set(first) >= {"lr", "loss", "ce", "l1", "l1_coeff", "tokens_per_s", "nnz_mean", "nnz_max", "dead_frac",
                          "overflow_rate", "zeros_pct"}
    assert len(first["nnz_mean"]) == 2 and first["loss"] == pytest.approx(first["ce"] + first["l1_coeff"] * first["l1"])
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [4, 8]


def test_eval_of_run_model_dir_and_checkpoint_agree(trained_run, tmp_path):
    final = trained_run.final_eval
    by_run, lines, folder = run_eval(trained_run.out_dir, out_dir=tmp_path / "a")
    assert by_run.ce == pytest.approx(final.ce, rel=1e-5)
    assert by_run.stats.nnz_mean == pytest.approx(final.stats.nnz_mean, rel=1e-4)
    by_model, _, _ = run_eval(trained_run.out_dir / "model", out_dir=tmp_path / "b")  # finds the run's config
    assert by_model.ce == pytest.approx(by_run.ce, rel=1e-6)
    ckpt = list_checkpoints(trained_run.out_dir / "checkpoints")[-1][1]
    by_ckpt, _, _ = run_eval(ckpt, out_dir=tmp_path / "c")
    assert by_ckpt.ce == pytest.approx(by_run.ce, rel=1e-6)
    assert (folder / "eval_layers.png").read_bytes()[:8] == PNG
    saved = json.loads((folder / "eval.json").read_text())
    assert saved["eval_ce"] == pytest.approx(by_run.ce, abs=1e-6) and len(saved["eval_nnz_mean"]) == 2
    assert any(line.startswith("| all |") for line in "\n".join(lines).splitlines())


def test_eval_cli_on_model_dir(trained_run, tmp_path, capsys):
    cfg = json.loads((trained_run.out_dir / "config.json").read_text())
    assert main(["eval", str(trained_run.out_dir / "model"), "--data", cfg["data"], "--seq-len", "32",
                 "--batches", "2", "--batch-size", "4", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "| layer | H |" in out and (tmp_path / "eval_layers.png").is_file()
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sparseffn eval: error: {tmp_path / 'nothing'} does not exist") and err.count("\n") == 1
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["--debug", "eval", str(tmp_path / "nothing")])
    (tmp_path / "empty").mkdir()  # exists, but is no run
    assert main(["eval", str(tmp_path / "empty")]) == 2
    assert f"{tmp_path / 'empty'}: expected a training run directory" in capsys.readouterr().err


def test_plots_from_metrics(trained_run, tmp_path):
    paths = plot_metrics(trained_run.metrics_path, tmp_path)
    assert [p.name for p in paths] == ["loss.png", "sparsity.png", "dead.png"]
    assert all(p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000 for p in paths)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no training rows"):
        plot_metrics(empty, tmp_path)


@pytest.mark.parametrize("compiled", [False, True])
def test_generate_cli_continues_a_prompt(trained_run, capsys, compiled):
    """`sparseffn generate RUN_DIR --prompt ...` prints the prompt and its greedy continuation (CPU: every
    step eagerly; the same tokens as Hugging Face's greedy generate), with --compile too (fp32 on the
    CPU: Inductor's fused kernels do not change these tokens)."""
    from sparseffn.cli import main

    assert main(["generate", str(trained_run.out_dir), "--prompt", "To be, or not", "--max-new-tokens", "6",
                 "--device", "cpu"] + (["--compile"] if compiled else [])) == 0
    text = capsys.readouterr().out
    ids = torch.tensor([trained_run.tokenizer.encode("To be, or not")])
    model = trained_run.model.eval()
    want = model.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids),
                          pad_token_id=0)
    assert text == trained_run.tokenizer.decode(want[0].tolist()) + "\n"


def test_generate_cli_samples_and_checks_its_sampling_flags(trained_run, capsys):
    """--temperature > 0 samples (the same seed, the same text; top-k 1 is greedy); bad sampling flags
    are one-line errors naming the flag."""
    from sparseffn.cli import main

    run = ["generate", str(trained_run.out_dir), "--prompt", "To be", "--max-new-tokens", "8", "--device", "cpu"]
    texts = []
    for flags in (["--temperature", "1.5", "--seed", "3"], ["--temperature", "1.5", "--seed", "3"], [],
                  ["--temperature", "1.5", "--top-k", "1"]):
        assert main(run + flags) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[2] == texts[3]
    for flags, match in ((["--temperature", "-1"], "--temperature must be >= 0"),
                         (["--top-k", "5"], "give --temperature > 0 too"),
                         (["--temperature", "1", "--top-p", "0"], r"--top-p must be in \(0, 1\]")):
        assert main(run + flags) == 2
        assert re.search(match, capsys.readouterr().err), flags
