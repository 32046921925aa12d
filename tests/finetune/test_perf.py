"""MFU arithmetic, the chip table lookup and the memory check (docs/speed.md)."""
from pathlib import Path

import pytest

from finetune.run.perf import PEAK_TFLOPS, StepTimer, chip_name, flops_per_token
from jobspec.tiny import TINY_DEFAULTS


def test_flops_per_token_counts_every_matmul_and_the_lm_head_even_when_tied():
    cfg = dict(TINY_DEFAULTS, vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
    h, i, v, layers, kv = 64, 176, 1000, 2, 2 * 16
    per_layer = h * h + 2 * kv * h + h * h + 3 * h * i  # q, k, v, o, gate/up/down
    want = 6 * (layers * per_layer + v * h) + 12 * layers * h * 128
    assert flops_per_token(dict(cfg, tie_word_embeddings=True), 128) == want
    assert flops_per_token(dict(cfg, tie_word_embeddings=False), 128) == want  # the untied head: same matmul


def test_qwen2_5_7b_is_about_6n_plus_attention():
    cfg = dict(TINY_DEFAULTS, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)
    # 7.07e9 matmul weights (7.6e9 parameters less the 0.54e9 embedding) at seq 4096
    assert flops_per_token(cfg, 4096) == pytest.approx(6 * 7.07e9 + 12 * 28 * 3584 * 4096, rel=0.01)


def test_chip_names_as_npu_smi_and_mindspore_report_them():
    assert chip_name("Ascend910B3") == "910B3" and chip_name("910B1") == "910B1"
    assert chip_name("Ascend910_9392") is None and chip_name("") is None
    assert set(PEAK_TFLOPS) == {"910B1", "910B2", "910B3", "910B4"}


def test_step_timer_reports_means_per_step_and_resets():
    t = StepTimer()
    for _ in range(2):
        t.start()
        for phase in StepTimer.PHASES:
            t.mark(phase)
    got = t.report(comm_s=0.5)
    assert set(got) == {"time_data_s", "time_fwd_bwd_s", "time_optimizer_s", "time_comm_s"}
    assert got["time_comm_s"] == 0.25 and t.steps == 0


def test_peak_figures_are_the_cited_ones_each_with_its_source_and_the_log_names_both(monkeypatch):
    """Issue 30 item 8: every SKU's row names its source. The chip comes from CANN's pyACL (aclrtGetSocName),
    not from mindspore.hal.get_device_name, which MindSpore 2.10 marks for removal."""
    import sys
    import types

    from finetune.dist import RankInfo
    from finetune.run.perf import device_peak_flops

    assert {k: v[0] for k, v in PEAK_TFLOPS.items()} == {"910B1": 378.9, "910B2": 353.9, "910B3": 294.9,
                                                          "910B4": 270.0}
    assert all("Huawei Cloud" in source for _, source in PEAK_TFLOPS.values())
    speed = (Path(__file__).resolve().parents[2] / "docs" / "speed.md").read_text()  # the docs' table holds the same
    assert all(f"| {chip} | {peak} |" in speed for chip, (peak, _) in PEAK_TFLOPS.items())
    monkeypatch.setitem(sys.modules, "acl", types.SimpleNamespace(get_soc_name=lambda: "Ascend910B3"))
    peak, source = device_peak_flops(RankInfo(device_target="Ascend"))
    assert peak == pytest.approx(294.9e12)
    assert "910B3" in source and "294.9 TFLOPS" in source and PEAK_TFLOPS["910B3"][1] in source
    monkeypatch.setitem(sys.modules, "acl", None)  # no pyACL (import fails): no MFU, said so
    assert device_peak_flops(RankInfo(device_target="Ascend"))[0] is None


def test_ascend_profiler_starts_itself_and_leaves_the_analysis_offline(ms_cpu, monkeypatch, tmp_path, capsys):
    """mindspore.profiler.profile starts on construction (a second start() warns); the trace handler
    must not analyse inside the run, where rank 0 would outlast HCCL_EXEC_TIMEOUT."""
    import sys
    import types

    from finetune.dist import RankInfo
    from finetune.run.perf import StepProfiler

    events = []

    class Profile:
        def __init__(self, on_trace_ready=None):
            events.append(("started", on_trace_ready))

        def start(self):
            events.append(("start again",))

        def stop(self):
            events.append(("stop",))

    fake = types.SimpleNamespace(profile=Profile,
                                 tensorboard_trace_handler=lambda **kw: ("handler", kw))
    monkeypatch.setitem(sys.modules, "mindspore.profiler", fake)
    p = StepProfiler([2, 3], RankInfo(device_target="Ascend"), tmp_path / "profile")
    for step in (1, 2, 3, 4):
        p.before(step)
        p.after(step)
    assert [e[0] for e in events] == ["started", "stop"]
    assert events[0][1] == ("handler", {"dir_name": str(tmp_path / "profile"), "analyse_flag": False})
    out = capsys.readouterr().out
    assert "analyse it offline" in out and f"analyse('{tmp_path / 'profile'}')" in out


def test_a_child_reports_its_own_peak_not_its_parents(tmp_path):
    """The memory tests start each run from pytest, whose peak after a thousand tests is GBs: the run's peak
    RSS is its own (``ru_maxrss`` inherits the parent's high-water mark across vfork + exec: CI's LoRA run
    reported 1.8 GiB where it uses 1.2)."""
    import subprocess
    import sys

    import numpy as np

    big = np.ones(2**30 // 8)  # this process's peak: over 1 GiB
    del big
    child = "from finetune.run.perf import peak_rss_bytes; print(peak_rss_bytes())"
    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", child], cwd=repo, capture_output=True, text=True, check=True)
    assert int(out.stdout) < 2**29, int(out.stdout) / 2**20
