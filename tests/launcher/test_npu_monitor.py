"""launcher/npu_monitor.py on recorded npu-smi outputs: the JSON lines, each warning once, off without NPUs."""
from __future__ import annotations

import json
import time
from pathlib import Path

from launcher_fakes import FIXTURES, make_dev, npu_smi_with_info

from launcher import devices, npu_monitor
from launcher.npu_monitor import Limits, NpuMonitor

LOADED = "info-procs-25.2.0-910b2.txt"  # 8 NPUs, each 91.7% HBM held, AICore 0, 36-37 C
LIGHT = "info-procs-26.1.0-910b3-container.txt"  # NPU 0 8676 MB of 65536 (13%), the others idle


def monitor(tmp_path: Path, info: str, limits: Limits = Limits()) -> tuple[NpuMonitor, list[str]]:
    warnings: list[str] = []
    return NpuMonitor(tmp_path / "npu.jsonl", list(range(8)), npu_smi_with_info(info), warnings.append, limits,
                      clock=lambda: 1700000000.0), warnings


def test_one_line_per_npu_and_sample(tmp_path):
    mon, warnings = monitor(tmp_path, LOADED)
    mon.sample()
    mon.sample()
    lines = [json.loads(x) for x in (tmp_path / "npu.jsonl").read_text().splitlines()]
    assert len(lines) == 16 and [r["npu"] for r in lines[:8]] == list(range(8))
    assert lines[0] == {"time": 1700000000.0, "npu": 0, "health": "OK", "temp_c": 36.0, "power_w": 97.8,
                        "aicore_pct": 0.0, "hbm_used_mb": 60126, "hbm_total_mb": 65536}
    assert warnings == []  # 91.7% HBM, 36-37 C, OK: nothing yet


def test_idle_aicore_with_the_model_loaded_warns_once_after_several_samples(tmp_path):
    mon, warnings = monitor(tmp_path, LOADED)
    for _ in range(4):
        mon.sample()
    assert warnings == []
    mon.sample()
    assert len(warnings) == 8 and warnings[3] == ("NPU 3: AICore 0% for 5 samples in a row with the model loaded: "
                                                  "host-bound? (data loading, host syncs, CPU binding: see "
                                                  "plan.json binding)")
    mon.sample()
    assert len(warnings) == 8  # once per NPU and condition
    light, quiet = monitor(tmp_path / "light", LIGHT)
    for _ in range(6):
        light.sample()
    assert quiet == []  # AICore 0 but HBM 13%: nothing loaded yet, not host-bound


def test_each_condition_at_its_limit(tmp_path):
    # the defaults (85 C, 97%) are not reached in any recording: the limits are moved across recorded values
    mon, warnings = monitor(tmp_path, LOADED, Limits(temp_c=37, hbm_frac=0.918, healthy=("OK",)))
    mon.sample()
    hbm = {1: 60235, 2: 60234, 3: 60234, 4: 60235, 5: 60232, 6: 60233, 7: 60231}  # NPU 0: 60126 MB = 91.7%
    full = [f"NPU {i}: HBM {mb}/65536 MB ({mb / 65536:.1%}) near full; lower train.micro_batch_size or turn on "
            "train.recompute before it runs out" for i, mb in hbm.items()]
    assert warnings == [*full[:6], "NPU 7: temperature 37 C >= 37 C; check the server's cooling", full[6]]
    sick, said = monitor(tmp_path / "sick", LOADED, Limits(healthy=("Warning",)))
    sick.sample()
    assert said[0] == "NPU 0: npu-smi health OK; check `npu-smi info -t health -i 0`" and len(said) == 8


def test_off_without_npus_or_npu_smi_and_running_in_the_background(tmp_path):
    said: list[str] = []
    none = devices.Devices()
    with npu_monitor.running(none, tmp_path, 0, 30, npu_smi_with_info(LOADED), said.append) as mon:
        assert mon is None
    make_dev(tmp_path)
    atlas = devices.probe(tmp_path / "dev", tmp_path, {}, None)
    with npu_monitor.running(atlas, tmp_path, 0, 30, None, said.append) as mon:
        assert mon is None
    assert said == ["NPU monitor: off (no NPU on this host)", "NPU monitor: off (npu-smi not available)"]
    with npu_monitor.running(atlas, tmp_path, 1, 0.01, npu_smi_with_info(LOADED), said.append) as mon:
        deadline = time.time() + 10
        while not (tmp_path / "npu-node1.jsonl").exists() and time.time() < deadline:
            time.sleep(0.01)
    assert mon._thread is not None and not mon._thread.is_alive()
    assert said[2] == f"NPU monitor: npu-smi every 0.01 s into {tmp_path / 'npu-node1.jsonl'}"
    assert (FIXTURES / "npu-smi" / LOADED).exists() and (tmp_path / "npu-node1.jsonl").read_text().count("\n") >= 8
