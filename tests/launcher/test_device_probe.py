"""Device probing on a fake /dev tree, fake driver mounts and recorded npu-smi outputs."""
from __future__ import annotations

import pytest
from launcher_fakes import make_dev, make_driver, recorded_npu_smi

from launcher import devices


def test_recorded_npu_smi_outputs_parse():
    info = devices.parse_info(recorded_npu_smi(["info"]))
    assert sorted(info) == list(range(8))
    assert info[3] == {"name": "910B3", "health": "OK", "bus_id": "0000:82:00.0", "hbm_used_mb": 3386,
                       "hbm_total_mb": 65536}
    assert devices.parse_info_m(recorded_npu_smi(["info", "-m"])) == {i: i for i in range(8)}
    topo = devices.parse_topo(recorded_npu_smi(["info", "-t", "topo"]))
    assert topo[0] == list(range(0, 24)) and topo[7] == list(range(144, 168))


def test_full_atlas_node(atlas):
    d = devices.probe(atlas / "dev", atlas, {}, recorded_npu_smi)
    assert d.present == d.visible == list(range(8))
    assert not d.missing_mgmt and not d.missing_mounts and not d.problems
    assert d.hbm_total_mb[5] == 65536 and d.worker_env == {}
    assert d.bus_id[0] == "0000:c1:00.0"


@pytest.mark.parametrize("env,visible,rt", [
    ({"ASCEND_VISIBLE_DEVICES": "0-3"}, [0, 1, 2, 3], "0,1,2,3"),
    ({"ASCEND_VISIBLE_DEVICES": "4,6-7"}, [4, 6, 7], "4,6,7"),
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
    ({"ASCEND_VISIBLE_DEVICES": "three"}, "expected ids or ranges like 0-3"),
    ({"ASCEND_RT_VISIBLE_DEVICES": "8"}, "logical ids [8] >= the 8 devices"),
])
def test_bad_visibility_values(atlas, env, msg):
    d = devices.probe(atlas / "dev", atlas, env, None)
    assert any(msg in p for p in d.problems)


def test_missing_management_devices_and_mounts_give_exact_flags(tmp_path):
    make_dev(tmp_path, mgmt=("davinci_manager",))
    make_driver(tmp_path, driver=False, npu_smi=False)
    d = devices.probe(tmp_path / "dev", tmp_path, {}, None)
    assert d.missing_mgmt == ["devmm_svm", "hisi_hdc"]
    assert d.fix_flags() == ("--device=/dev/devmm_svm --device=/dev/hisi_hdc "
                             "-v /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro "
                             "-v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi:ro")


def test_no_npu_is_said_plainly(tmp_path):
    (tmp_path / "dev").mkdir()
    d = devices.probe(tmp_path / "dev", tmp_path, {}, recorded_npu_smi)
    assert not d.has_npu and "workers run on CPU" in d.summary()


def test_id_lists_round_trip():
    assert devices.parse_id_list("0-3,6, 8-9", "X") == [0, 1, 2, 3, 6, 8, 9]
    assert devices.format_id_list([9, 0, 1, 2, 3, 6, 8]) == "0-3,6,8-9"
    with pytest.raises(ValueError, match="X='3-1'"):
        devices.parse_id_list("3-1", "X")
