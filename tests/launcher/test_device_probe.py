"""Device probing on a fake /dev tree, fake driver mounts and recorded npu-smi outputs."""
from __future__ import annotations

import pytest
from launcher_fakes import FIXTURES, make_dev, make_driver, npu_smi_with_info, recorded_npu_smi

from jobspec.config import Recipe
from launcher import devices, npu_smi, preflight

BUSY_25 = "info-procs-25.2.0-910b2.txt"  # vllm-ascend#4866: every NPU held by a VLLMWorker_DP
BUSY_26 = "info-procs-26.1.0-910b3-container.txt"  # wide columns + "Process id in container"


def test_recorded_npu_smi_outputs_parse():
    info = npu_smi.parse_info(recorded_npu_smi(["info"]))
    assert sorted(info) == list(range(8))
    assert info[3] == npu_smi.NpuRow(npu=3, name="910B3", health="OK", bus_id="0000:82:00.0", power_w=95.1,
                                     temp_c=39, aicore_pct=0, hbm_used_mb=3386, hbm_total_mb=65536)
    assert npu_smi.parse_processes(recorded_npu_smi(["info"])) == []
    assert devices.parse_info_m(recorded_npu_smi(["info", "-m"])) == {i: i for i in range(8)}
    topo = devices.parse_topo(recorded_npu_smi(["info", "-t", "topo"]))
    assert topo[0] == list(range(0, 24)) and topo[7] == list(range(144, 168))


def test_process_rows_are_not_npu_rows():
    text = (FIXTURES / "npu-smi" / BUSY_25).read_text()
    info = npu_smi.parse_info(text)
    assert sorted(info) == list(range(8)) and {r.health for r in info.values()} == {"OK"}
    assert [info[i].bus_id[5:7] for i in range(8)] == ["C1", "01", "C2", "02", "81", "41", "82", "42"]
    assert info[0].hbm_used_mb == 60126 and info[7].temp_c == 37 and info[2].power_w == 98.0
    procs = npu_smi.parse_processes(text)
    assert len(procs) == 8 and procs[0] == npu_smi.NpuProcess(npu=0, pid=2759218, name="VLLMWorker_DP",
                                                              memory_mb=56293)
    assert [p.npu for p in procs] == list(range(8))


def test_wide_table_with_the_container_pid_column():
    text = (FIXTURES / "npu-smi" / BUSY_26).read_text()
    info = npu_smi.parse_info(text)
    assert sorted(info) == list(range(8)) and info[0].hbm_used_mb == 8676 and info[4].temp_c == 52
    assert npu_smi.parse_processes(text) == [npu_smi.NpuProcess(npu=0, pid=485946, name="pytest",
                                                                memory_mb=5175, pid_in_container=None)]


def test_one_busy_npu_among_free_ones(atlas):
    one = "info-procs-25.2.0-910b3-one-busy.txt"  # vllm-ascend#6271: NPU 4 held, its rows between "No running"
    assert npu_smi.parse_processes((FIXTURES / "npu-smi" / one).read_text()) == [
        npu_smi.NpuProcess(npu=4, pid=1601114, name="python", memory_mb=18429)]
    d = devices.probe(atlas / "dev", atlas, {}, npu_smi_with_info(one))
    ((detail, fix),) = d.busy_rows()
    assert detail == "NPU 4 is already in use by pid 1601114 python (18429 MB)"
    assert "ASCEND_VISIBLE_DEVICES=0-3,5-7" in fix
    assert devices.probe(atlas / "dev", atlas, {"ASCEND_VISIBLE_DEVICES": "0-3"}, npu_smi_with_info(one)).busy == []


def test_busy_npus_fail_preflight_naming_the_holder(atlas):
    d = devices.probe(atlas / "dev", atlas, {}, npu_smi_with_info(BUSY_26))
    assert not d.problems and [p.pid for p in d.busy] == [485946]
    ((detail, fix),) = d.busy_rows()
    assert detail == "NPU 0 is already in use by pid 485946 pytest (5175 MB)"
    assert "kill 485946" in fix and "host pids" in fix and "ASCEND_VISIBLE_DEVICES=1-7" in fix
    free = devices.probe(atlas / "dev", atlas, {"ASCEND_VISIBLE_DEVICES": "1-7"}, npu_smi_with_info(BUSY_26))
    assert free.busy == [] and free.busy_rows() == []


def test_full_atlas_node(atlas):
    d = devices.probe(atlas / "dev", atlas, {}, recorded_npu_smi)
    assert d.present == d.visible == list(range(8))
    assert not d.missing_mgmt and not d.missing_mounts and not d.problems
    assert d.hbm_total_mb[5] == 65536 and d.worker_env == {}
    assert d.bus_id[0] == "0000:c1:00.0"


@pytest.mark.parametrize("env,visible,rt", [
    ({"ASCEND_VISIBLE_DEVICES": "0-3"}, [0, 1, 2, 3], "0,1,2,3"),
    ({"ASCEND_VISIBLE_DEVICES": "4,6-7"}, [4, 6, 7], "4,6,7"),
    ({"ASCEND_VISIBLE_DEVICES": "Ascend910-4,Ascend910-5,Ascend910-6,Ascend910-7"}, [4, 5, 6, 7], "4,5,6,7"),
    ({"ASCEND_RT_VISIBLE_DEVICES": "2,3"}, [2, 3], "2,3"),
    ({"ASCEND_VISIBLE_DEVICES": "0-7", "ASCEND_RT_VISIBLE_DEVICES": "0,1"}, [0, 1], "0,1"),
])
def test_visibility_variables(atlas, env, visible, rt):
    d = devices.probe(atlas / "dev", atlas, env, None)
    assert d.visible == visible and d.worker_env["ASCEND_RT_VISIBLE_DEVICES"] == rt and not d.problems


def test_container_with_four_devices_uses_logical_ids(tmp_path):
    # docker run --device=/dev/davinci4..7: the container's runtime numbers them 0-3
    dev = make_dev(tmp_path, npus=0)
    for i in (4, 5, 6, 7):
        (dev / f"davinci{i}").write_text("")
    make_driver(tmp_path)
    d = devices.probe(dev, tmp_path, {"ASCEND_RT_VISIBLE_DEVICES": "1,3"}, None)
    assert d.present == [4, 5, 6, 7] and d.visible == [5, 7]
    assert d.worker_env["ASCEND_RT_VISIBLE_DEVICES"] == "1,3"


@pytest.mark.parametrize("env,msg", [
    ({"ASCEND_VISIBLE_DEVICES": "0-9"}, "/dev/davinci8-9 not present"),
    ({"ASCEND_VISIBLE_DEVICES": "three"}, "or the device names Ascend910-0,Ascend910-1"),
    ({"ASCEND_VISIBLE_DEVICES": "Ascend910-0,1"}, "expected ids or ranges (0-3 or 0,1,4)"),
    ({"ASCEND_RT_VISIBLE_DEVICES": "8"}, "logical ids [8] >= the 8 devices"),
])
def test_bad_visibility_values(atlas, env, msg):
    d = devices.probe(atlas / "dev", atlas, env, None)
    assert any(msg in p for p in d.problems)


def mount_rows(root, smi=None, broken: str = "", **absent) -> list[tuple[str, str]]:
    """preflight's devices/mounts rows (fail) for an Atlas root missing what ``absent`` names (``broken``:
    a file made empty, such as a driver library)."""
    make_dev(root, mgmt=tuple(m for m in ("davinci_manager", "devmm_svm", "hisi_hdc") if m not in absent))
    make_driver(root, **{k: False for k in absent if k not in ("davinci_manager", "devmm_svm", "hisi_hdc")})
    if broken:
        (root / broken).write_bytes(b"")
    d = devices.probe(root / "dev", root, {}, smi)
    rows = preflight.check_devices(preflight.Context(Recipe(), d, 8, root=root))
    return [(r.detail, r.fix) for r in rows if r.status == "fail"]


def test_missing_management_devices_and_mounts_give_exact_flags(tmp_path):
    rows = mount_rows(tmp_path, devmm_svm=1, hisi_hdc=1, driver=1, npu_smi=1, install_info=1)
    assert rows == [
        ("device node /dev/devmm_svm is absent", "docker run --device=/dev/devmm_svm"),
        ("device node /dev/hisi_hdc is absent", "docker run --device=/dev/hisi_hdc"),
        ("/usr/local/Ascend/driver/version.info is absent (the driver version CANN and preflight read)",
         "docker run -v /usr/local/Ascend/driver/version.info:/usr/local/Ascend/driver/version.info:ro "
         "(Kubernetes: a read-only hostPath volume)"),
        ("/usr/local/bin/npu-smi is absent (npu-smi: HBM size, health, NPU holders and NUMA affinity)",
         "docker run -v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi:ro (Kubernetes: a read-only hostPath volume)"),
        ("/etc/ascend_install.info is absent (where the driver is installed, read by the CANN runtime)",
         "docker run -v /etc/ascend_install.info:/etc/ascend_install.info:ro (Kubernetes: a read-only hostPath "
         "volume)")]


def test_driver_lib64_not_mounted_is_named(tmp_path):
    (detail, fix), = mount_rows(tmp_path, lib64=1)
    assert detail.startswith("/usr/local/Ascend/driver/lib64 is absent (the host driver's libraries")
    assert fix.startswith("docker run -v /usr/local/Ascend/driver/lib64:/usr/local/Ascend/driver/lib64:ro")


def test_a_driver_library_that_does_not_load_is_named(tmp_path):
    (detail, fix), = mount_rows(tmp_path, broken="usr/local/Ascend/driver/lib64/common/libc_sec.so")
    assert detail.startswith("a driver library does not load: OSError: ")
    assert "lib64/common/libc_sec.so" in detail and "/usr/local/Ascend/driver/lib64:ro" in fix


@pytest.mark.parametrize("fixture,code,meaning", [
    ("dcmi-8005.txt", -8005, "dcmi could not initialise: usually another container holds these NPUs"),
    ("dcmi-8020.txt", -8020, "the device is used: another container holds these NPUs")])
def test_npu_smi_saying_another_container_holds_the_npus(tmp_path, fixture, code, meaning):
    text = (FIXTURES / "npu-smi" / fixture).read_text()
    assert npu_smi.dcmi_error(text) == code
    (detail, fix), = mount_rows(tmp_path, smi=lambda args: text)
    assert detail == f"npu-smi info failed with {code}: {meaning}"
    assert "stop the other container or process holding the NPUs" in fix


def test_no_npu_is_said_plainly(tmp_path):
    (tmp_path / "dev").mkdir()
    d = devices.probe(tmp_path / "dev", tmp_path, {}, recorded_npu_smi)
    assert not d.has_npu and d.summary("auto", "tiny-cpu").endswith("workers run on CPU (recipe tiny-cpu)")


def test_no_npu_with_an_npu_recipe_says_what_really_happens(tmp_path, capsys):
    import launcher.__main__ as lm

    (tmp_path / "dev").mkdir()
    host = lm.Host(env={"RECIPE": "qwen2.5-7b-full", "OUTPUT_DIR": str(tmp_path / "o")}, dev_dir=tmp_path / "dev",
                   root=tmp_path, sys_root=tmp_path / "sys", npu_smi=None, identities=set())
    assert lm.main(["plan"], host) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "devices:" in ln)
    assert "no NPU (/dev/davinciN) found, but recipe qwen2.5-7b-full runs on NPUs (launch.device=npu)" in line
    assert "workers run on CPU" not in line
    assert lm.main(["plan", "--recipe", "tiny-cpu"], host) == 0
    assert "no NPU (/dev/davinciN) found: workers run on CPU (recipe tiny-cpu)" in capsys.readouterr().out


def test_id_lists_round_trip():
    assert devices.format_id_list([9, 0, 1, 2, 3, 6, 8]) == "0-3,6,8-9"
    assert devices.parse_visible_devices("0-3,6, 8-9") == [0, 1, 2, 3, 6, 8, 9]
    with pytest.raises(ValueError, match="ASCEND_VISIBLE_DEVICES='3-1'"):
        devices.parse_visible_devices("3-1")


def test_preflight_end_to_end_on_a_host_whose_npus_are_all_held(atlas, tmp_path, capsys):
    import launcher.__main__ as lm

    host = lm.Host(env={"OUTPUT_DIR": str(tmp_path / "o")}, dev_dir=atlas / "dev", root=atlas,
                   sys_root=atlas / "sys", npu_smi=npu_smi_with_info(BUSY_25), identities={"node-a"})
    assert lm.main(["preflight", "--recipe", "qwen2.5-7b-full"], host) == 1
    out = capsys.readouterr().out
    assert "NPU 3 is already in use by pid 2760301 VLLMWorker_DP (56415 MB)" in out
    assert out.count("is already in use by") == 8 and "health 2759218" not in out
