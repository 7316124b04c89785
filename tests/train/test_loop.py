import pytest
import torch

from sparseffn.train.loop import train
from sparseffn.train.metrics import read_metrics

from .conftest import tiny_config

TIMING = {"tokens_per_s", "elapsed_s"}


def _rows(result):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(result.metrics_path)]


def test_activation_checkpointing_changes_nothing_but_memory(small_corpus, tmp_path):
    cfg = tiny_config(small_corpus, tmp_path / "plain", steps=3, eval_interval=0, checkpoint_interval=0)
    plain = train(cfg, progress=False, echo=None)
    ckpt = train(cfg.replace(out_dir=str(tmp_path / "ckpt"), activation_checkpointing=True), progress=False,
                 echo=None)
    a, b = _rows(plain), _rows(ckpt)
    assert [r["step"] for r in a if r["kind"] == "train"] == [1, 2, 3]
    for ra, rb in zip(a, b):
        # Recomputation in backward must not be counted by the sparsity hooks, and gives the same numbers.
        assert ra.keys() == rb.keys()
        for key in ra:
            if isinstance(ra[key], float):
                assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), key
            else:
                assert rb[key] == ra[key], key


def test_l1_pushes_activations_to_zero(small_corpus, tmp_path):
    """With a strong penalty the active units per token fall well below the ~50% of a fresh ReLU model."""
    cfg = tiny_config(small_corpus, tmp_path / "run", steps=20, eval_interval=0, checkpoint_interval=0,
                      log_interval=1, l1_coeff=0.02, l1_warmup_steps=0)
    rows = [r for r in _rows(train(cfg, progress=False, echo=None)) if r["kind"] == "train"]
    first, last = rows[0], rows[-1]
    assert last["zeros_pct"] > first["zeros_pct"] + 20, (first["zeros_pct"], last["zeros_pct"])
    assert last["l1"] < first["l1"]
    assert rows[0]["l1_coeff"] == 0.02 and all(r["loss"] == pytest.approx(r["ce"] + 0.02 * r["l1"]) for r in rows)


def test_grad_accumulation_and_global_batch(small_corpus, tmp_path):
    cfg = tiny_config(small_corpus, tmp_path / "run", steps=2, grad_accum=3, eval_interval=0, checkpoint_interval=0)
    result = train(cfg, progress=False, echo=None)
    rows = [r for r in _rows(result) if r["kind"] == "train"]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    import json

    run = json.loads((result.out_dir / "run.json").read_text())
    assert run["tokens_per_step"] == 4 * 32 * 3 and run["world_size"] == 1
    assert result.final_eval is not None and result.model_dir.is_dir()


def test_a_run_without_saved_weights_publishes_its_metrics_only(small_corpus, tmp_path):
    """save_weights=False (a measurement run): the run directory gets its config, run record and metrics at the
    end, no checkpoint and no model; resuming it is refused by name."""
    cfg = tiny_config(small_corpus, tmp_path / "run", steps=3, eval_interval=0, checkpoint_interval=2,
                      save_weights=False)
    result = train(cfg, progress=False, echo=None)
    out = result.out_dir
    assert result.completed and result.model_dir is None and result.final_eval is not None
    assert {"config.json", "run.json", "metrics.jsonl"} <= {p.name for p in out.iterdir()}
    assert not (out / "checkpoints").exists() and not (out / "model").exists() and not (out / ".staging").exists()
    assert [r["step"] for r in read_metrics(result.metrics_path) if r["kind"] == "train"] == [1, 2, 3]
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(cfg.replace(steps=4), resume=True, progress=False, echo=None)


def test_bad_device_is_named(small_corpus, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="device='cuda'"):
        train(tiny_config(small_corpus, tmp_path / "run", device="cuda"), progress=False, echo=None)


def test_fused_non_mlp_trains_the_same(small_corpus, tmp_path, monkeypatch):
    """--fuse-non-mlp swaps in the fused RMSNorm / RoPE (here their eager CPU path): same losses, and the
    saved model loads as a plain one."""
    import sparseffn.nn.fused as fused_nn
    from sparseffn.models import load_pretrained

    calls = []
    monkeypatch.setattr(fused_nn, "rms_norm", lambda *a, _f=fused_nn.rms_norm, **k: calls.append(1) or _f(*a, **k))
    cfg = tiny_config(small_corpus, tmp_path / "plain", steps=3, eval_interval=0, checkpoint_interval=0)
    a = _rows(train(cfg, progress=False, echo=None))
    fused = train(cfg.replace(out_dir=str(tmp_path / "fused"), fuse_non_mlp=True), progress=False, echo=None)
    b = _rows(fused)
    assert calls, "the fused RMSNorm never ran"
    for ra, rb in zip(a, b):
        for key in ("loss", "ce", "l1"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=1e-5), key
    model = load_pretrained(tmp_path / "fused" / "model")
    assert not any(type(m).__name__ == "FusedRMSNorm" for m in model.modules())


def test_sparse_kernels_are_warmed_before_the_first_step_at_the_runs_shapes(small_corpus, tmp_path, monkeypatch):
    """The loop hands nn.warm_sparse_kernels the run's layers, a training call of batch_size x seq_len
    tokens, the evaluation's calls and the autocast dtype, once, before the first step; what was warmed
    and how long it took go into metrics.jsonl; --no-warm-kernels skips it."""
    import sparseffn.train.loop as loop
    from sparseffn.nn.warm import WarmedCall

    calls = []

    def spy(mlps, *, train_tokens, eval_tokens, dtype, seed):
        calls.append((len(mlps), train_tokens, list(eval_tokens), dtype, seed, loop_steps_seen[:]))
        return [WarmedCall("training", train_tokens, 128, 352, True, False, torch.bfloat16)]

    loop_steps_seen = []
    real_collect = loop.collect_l1
    monkeypatch.setattr(loop, "collect_l1", lambda model: loop_steps_seen.append(1) or real_collect(model))
    monkeypatch.setattr(loop, "warm_sparse_kernels", spy)
    cfg = tiny_config(small_corpus, tmp_path / "run", steps=2, eval_interval=0, checkpoint_interval=0, eval_batches=3,
                      batch_size=2, device="cpu")
    result = train(cfg, progress=False, echo=None)
    # 2 layers; 2 x 32 tokens per step; 6 evaluation windows of 32 tokens in calls of 2; fp32 on CPU; no step yet
    assert calls == [(2, 64, [64, 64, 64], None, 0, [])]
    warm = [r for r in read_metrics(result.metrics_path) if r["kind"] == "warm"]
    assert len(warm) == 1 and warm[0]["step"] == 0 and warm[0]["calls"] == ["training 64 tokens D=128 H=352 bfloat16"]
    calls.clear()
    train(cfg.replace(out_dir=str(tmp_path / "off"), warm_kernels=False), progress=False, echo=None)
    assert calls == []


@pytest.mark.parametrize("steps, finished", [(4, True), (2, False)])
def test_background_warm_is_polled_each_step_and_stopped_at_the_end(small_corpus, tmp_path, monkeypatch, steps,
                                                                    finished):
    """On CUDA the loop starts the warm-up in a child (nn.warm.start_warming) and goes on training; the
    step after which the child is seen finished records a "warm" row marked background; a run that
    ends first stops the child."""
    import sparseffn.train.loop as loop
    from sparseffn.nn.warm import WarmedCall

    class Job:
        calls, seconds, polls, stopped = [WarmedCall("training", 64, 128, 352, True, False, torch.bfloat16)], None, 0, False

        def poll(self):
            self.polls += 1
            if self.polls == 3:
                self.seconds = 1.5
            return self.seconds is not None

        def stop(self):
            self.stopped = True

    job = Job()
    monkeypatch.setattr(loop, "_warm_in_background", lambda mlps: True)
    monkeypatch.setattr(loop, "start_warming", lambda mlps, **kwargs: job)
    cfg = tiny_config(small_corpus, tmp_path / "run", steps=steps, eval_interval=0, checkpoint_interval=0,
                      device="cpu")
    result = train(cfg, progress=False, echo=None)
    warm = [r for r in read_metrics(result.metrics_path) if r["kind"] == "warm"]
    if finished:
        assert job.polls == 3 and not job.stopped
        assert [(r["step"], r["seconds"], r["background"]) for r in warm] == [(3, 1.5, True)]
    else:
        assert job.polls == 2 and job.stopped and warm == []


def test_a_failed_background_warm_is_said_and_recorded_and_the_run_goes_on(small_corpus, tmp_path, monkeypatch):
    import sparseffn.train.loop as loop

    class Failed:
        calls, seconds = [], None

        def poll(self):
            raise RuntimeError("the background kernel warm-up failed (exit 1):\nCUDA out of memory")

        def stop(self):
            raise AssertionError("a finished child is not stopped")

    said = []
    monkeypatch.setattr(loop, "_warm_in_background", lambda mlps: True)
    monkeypatch.setattr(loop, "start_warming", lambda mlps, **kwargs: Failed())
    cfg = tiny_config(small_corpus, tmp_path / "run", steps=2, eval_interval=0, checkpoint_interval=0, device="cpu")
    result = train(cfg, progress=False, echo=said.append)
    assert result.step == 2 and any("CUDA out of memory" in line and "the run goes on" in line for line in said)
    warm = [r for r in read_metrics(result.metrics_path) if r["kind"] == "warm"]
    assert len(warm) == 1 and warm[0]["step"] == 1 and "CUDA out of memory" in warm[0]["error"]


@pytest.mark.parametrize("flag, fused", [(None, False), (True, True), (False, False)])
def test_fused_norms_follow_the_flag_and_default_to_cuda_only(small_corpus, tmp_path, flag, fused):
    """fuse_non_mlp None (the default) fuses when training on CUDA (here: CPU, so not); True / False force it."""
    from sparseffn.nn.fused import FusedRMSNorm

    cfg = tiny_config(small_corpus, tmp_path / "run", steps=1, eval_interval=0, checkpoint_interval=0,
                      fuse_non_mlp=flag, device="cpu")
    model = train(cfg, progress=False, echo=None).model
    assert any(isinstance(m, FusedRMSNorm) for m in model.modules()) is fused


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_on_cuda_fuses_norms_by_default(tmp_path):
    from sparseffn.nn.fused import FusedRMSNorm

    text = tmp_path / "text.txt"  # no installed corpus needed on the GPU machine
    text.write_text(" ".join(f"word{i % 97} and more words {i}" for i in range(3000)))
    cfg = tiny_config(text, tmp_path / "run", steps=1, eval_interval=0, checkpoint_interval=0, device="cuda")
    model = train(cfg, progress=False, echo=None).model
    assert any(isinstance(m, FusedRMSNorm) for m in model.modules())


def test_compile_non_mlp_compiles_norms_and_attention_only_and_trains_the_same(small_corpus, tmp_path, monkeypatch):
    """--compile-non-mlp: nn.Module.compile on every norm and attention (here through Dynamo with the
    aot_eager backend: Inductor's C++ build takes minutes on a CPU), the MLPs eager; same losses as eager,
    same state dict keys."""
    compiled = []
    real = torch.nn.Module.compile

    def spy(self, *args, **kwargs):
        compiled.append(type(self).__name__)
        return real(self, *args, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", spy)
    cfg = tiny_config(small_corpus, tmp_path / "eager", steps=2, eval_interval=0, checkpoint_interval=0, device="cpu")
    eager = train(cfg, progress=False, echo=None)
    assert compiled == []
    result = train(cfg.replace(out_dir=str(tmp_path / "compiled"), compile_non_mlp=True), progress=False, echo=None)
    # 2 layers: attention and two norms each, and the final norm
    assert sorted(compiled) == sorted(["LlamaAttention"] * 2 + ["LlamaRMSNorm"] * 5)
    assert result.model.model.layers[0].self_attn._compiled_call_impl is not None
    assert result.model.model.layers[0].mlp._compiled_call_impl is None
    assert list(result.model.state_dict()) == list(eager.model.state_dict())
    a, b = _rows(eager), _rows(result)
    assert [r["ce"] for r in b if r["kind"] == "train"] == pytest.approx([r["ce"] for r in a if r["kind"] == "train"],
                                                                         rel=1e-5)
