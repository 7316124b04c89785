import pytest

from sparseffn.train.loop import train
from sparseffn.train.metrics import read_metrics
from sparseffn.train.profiling import kernel_group, parse_steps, report

from .conftest import tiny_config


def test_parse_steps_reads_a_range_and_names_the_flag_on_bad_input():
    assert parse_steps("") is None
    assert parse_steps("3-5") == (3, 5) and parse_steps("4-4") == (4, 4)
    for bad in ("5-3", "0-2", "3", "a-b", "1-2-3"):
        with pytest.raises(ValueError, match="--profile-steps"):
            parse_steps(bad)


def test_kernel_group_by_name():
    assert kernel_group("_gate_twell_kernel") == "Triton (sparseffn)"
    assert kernel_group("triton_poi_fused_add_mul_0") == "torch.compile (Inductor)"
    assert kernel_group("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "GEMM (cuBLAS)"
    assert kernel_group("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert kernel_group("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamW>") == "optimizer"
    assert kernel_group("void at::native::vectorized_elementwise_kernel<8, bfloat16_copy_kernel_cuda>") == \
        "elementwise and other"


def test_report_per_step_groups_and_top_kernels():
    class Event:
        def __init__(self, key, device_us, count, device="CUDA"):
            self.key, self.self_device_time_total, self.count = key, device_us, count
            self.self_cpu_time_total = 1.0
            self.device_type = type("T", (), {"name": device})()

    # the optimizer's annotation, recorded on the host and as a device range over its kernels, is no kernel
    events = [Event("_gate_twell_kernel", 3000.0, 6), Event("nvjet_gemm", 1000.0, 12),
              Event("Optimizer.step#AdamW.step", 0.0, 2, "CPU"), Event("Optimizer.step#AdamW.step", 900.0, 2)]
    text = report(events, steps=2, wall_s=0.004, title="steps 1-2")
    assert text.startswith("steps 1-2: wall 2.00 ms per step, device kernels 2.00 ms per step (2 steps)")
    assert "Triton (sparseffn) | 1.50 | 75.0%" in text and "GEMM (cuBLAS) | 0.50 | 25.0%" in text
    assert "_gate_twell_kernel | 1.500 | 3" in text and "nvjet_gemm | 0.500 | 6" in text
    assert "Optimizer.step" not in text


def test_a_run_writes_the_profile_of_the_chosen_steps(small_corpus, tmp_path):
    """--profile-steps on a CPU run: the chosen steps' operators by CPU time, in the published run directory;
    the metrics are those of a run without it."""
    cfg = tiny_config(small_corpus, tmp_path / "plain", steps=4, eval_interval=0, checkpoint_interval=0,
                      device="cpu")
    said = []
    result = train(cfg.replace(out_dir=str(tmp_path / "run"), profile_steps="2-3"), progress=False, echo=said.append)
    text = (result.out_dir / "profile.txt").read_text()
    assert text.startswith("optimizer steps 2-3: wall ") and "CPU operators (self time)" in text
    assert "aten::mm" in text or "aten::addmm" in text
    assert any(line.startswith("profile of steps 2-3: ") for line in said)
    plain = train(cfg, progress=False, echo=None)
    ce = [[r["ce"] for r in read_metrics(res.metrics_path) if r["kind"] == "train"] for res in (plain, result)]
    assert len(ce[0]) == 4 and ce[1] == pytest.approx(ce[0], rel=1e-6)


def test_profile_steps_past_the_end_report_at_the_last_step(small_corpus, tmp_path):
    cfg = tiny_config(small_corpus, tmp_path / "run", steps=3, eval_interval=0, checkpoint_interval=0, device="cpu",
                      profile_steps="2-9")
    result = train(cfg, progress=False, echo=None)
    assert (result.out_dir / "profile.txt").read_text().startswith("optimizer steps 2-3: wall ")


def test_config_rejects_a_bad_profile_range(small_corpus, tmp_path):
    with pytest.raises(ValueError, match="--profile-steps"):
        tiny_config(small_corpus, tmp_path / "run", profile_steps="3-1")
