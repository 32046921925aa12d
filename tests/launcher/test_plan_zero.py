"""The sizes ZeRO-1 does not fit, planned at the real scale on fake Atlas 800T A2 hosts (8 NPUs each): Qwen2.5-32B and
Qwen3-32B full on 2 x 8 NPUs (ZeRO-2), Qwen2.5-72B full on 4 x 8 (ZeRO-3), and a 4-node Volcano Job for 72B whose
pods plan it."""
from __future__ import annotations

import json

import pytest
from launcher_fakes import recorded_npu_smi
from test_render import container, env_of, errors, rendered
from test_tp_auto import plan, table_row

import launcher.__main__ as lm
from jobspec.qwen_sizes import SIZES


def check_plan(rc: int, p: dict | None, out: str, err: str, name: str) -> None:
    """The plan of ``name``'s full fine-tune is the size table's row."""
    row = table_row(name, "full")
    layout, stage = row["layout"].split(", ZeRO-")
    tp, dp = (int(x) for x in layout.removeprefix("TP ").split(" x DP "))
    assert tp * dp == int(row["NPUs"]) and stage in "23"
    assert rc == 0 and p is not None, err
    t = p["recipe"]["layout"]
    assert (t["tp"], t["dp"], p["recipe"]["parallel"]["zero"], t["shard_gradients"]) == (tp, dp, int(stage), True)
    assert f"{p['memory']['total'] / 2**30:.1f}" == row["GiB per NPU"]
    zero = p["sources"]["parallel.zero"]
    assert zero.startswith(f"auto -> ZeRO-{stage} ({row['layout']}; ")
    assert f"over RoCE between {min(dp, dp * tp // 8)} nodes" in zero
    assert f"[launcher] parallel.zero: {zero}\n" in out
    assert p["sources"]["parallel.tp"].startswith(f"auto -> TP {tp} ZeRO-{stage}: TP 1 ZeRO-1 needs ")


@pytest.mark.parametrize("name,npus,stage", [("Qwen2.5-32B", 16, "2"), ("Qwen2.5-72B", 32, "3"),
                                             ("Qwen3-32B", 16, "2")])
def test_the_sizes_zero1_does_not_fit_plan_at_the_real_scale(atlas, capsys, name, npus, stage):
    row = table_row(name, "full")
    assert int(row["NPUs"]) == npus and row["layout"].endswith(f"ZeRO-{stage}")
    check_plan(*plan(atlas, "qwen-full", name, npus, capsys), name)


def test_a_world_too_small_even_for_zero3_names_the_smallest_that_fits(atlas, capsys):
    rc, p, out, err = plan(atlas, "qwen-full", "Qwen2.5-72B", 16, capsys)
    assert rc == 2 and p is None and "Traceback" not in out + err
    assert "TP 8 ZeRO-3 needs 84.9 GiB per NPU > 54 planned" in err  # each candidate with its estimate
    assert "would fit: 32 NPUs (4 node(s), TP 2 x DP 16, ZeRO-3)" in err


def test_an_explicit_tp_gets_the_lowest_stage_that_fits_there(atlas, capsys):
    """TP 8 given: 32B on 32 NPUs fits with ZeRO-1; on 16 only with ZeRO-2; TP 4 on 16 only with ZeRO-3."""
    rc, p, out, _ = plan(atlas, "qwen-full", "Qwen2.5-32B", 32, capsys, TP="8")
    assert rc == 0 and p["sources"]["parallel.zero"].startswith("auto -> ZeRO-1 (TP 8 x DP 4, ZeRO-1; ")
    assert "parallel.tp" not in p["sources"]
    rc, p, out, _ = plan(atlas, "qwen-full", "Qwen2.5-32B", 16, capsys, TP="8")
    assert rc == 0 and p["sources"]["parallel.zero"].startswith("auto -> ZeRO-2 (TP 8 x DP 2, ZeRO-2; the lowest "
                                                                "stage that fits, ZeRO-3 only where nothing else "
                                                                "does: TP 8 ZeRO-2: TP 8 ZeRO-1 needs 58.3 GiB")
    rc, p, out, err = plan(atlas, "qwen-full", "Qwen2.5-32B", 16, capsys, TP="4")
    assert rc == 0 and p["sources"]["parallel.zero"].startswith("auto -> ZeRO-3 (TP 4 x DP 4, ZeRO-3; "), err


def test_a_four_node_volcano_job_for_72b_renders_and_its_pods_plan_it(tmp_path, atlas, capsys):
    env = {"RECIPE": "qwen-full", "MODEL_DIR": "/data/models/Qwen2.5-72B-Instruct",
           "OUTPUT_DIR": "/data/output/qwen2.5-72b-sft"}
    job = rendered(tmp_path, 4, env=env)
    assert not errors(job, "batch.volcano.sh_jobs.yaml")
    (task,) = job["spec"]["tasks"]
    assert task["replicas"] == 4 and job["spec"]["minAvailable"] == 4
    c = container(job)
    assert c["resources"]["limits"]["huawei.com/Ascend910"] == 8
    assert env_of(c)["MODEL_DIR"] == env["MODEL_DIR"] and env_of(c)["RECIPE"] == "qwen-full"
    name = job["metadata"]["name"]
    hosts = [f"{name}-worker-{i}.{name}" for i in range(4)]
    (atlas / "model").mkdir()
    (atlas / "model" / "config.json").write_text(json.dumps(SIZES["Qwen2.5-72B"]))
    pod_env = {**env_of(c), "VC_TASK_INDEX": "3", "VK_TASK_INDEX": "3", "VC_WORKER_HOSTS": ",".join(hosts),
               "VC_WORKER_NUM": "4", "MODEL_DIR": str(atlas / "model"), "OUTPUT_DIR": str(atlas / "out")}
    host = lm.Host(env=pod_env, dev_dir=atlas / "dev", root=atlas, sys_root=atlas / "sys", npu_smi=recorded_npu_smi,
                   identities={f"{name}-worker-3", "10.244.3.7"})
    rc = lm.main(["plan"], host)
    out = capsys.readouterr()
    text = out.out
    p = json.JSONDecoder().raw_decode(text[text.index("\n{") + 1:])[0] if "\n{" in text else None
    if p is not None:
        t = p["topology"]
        assert (t["nnodes"], t["node_rank"], t["world_size"]) == (4, 3, 32)
    check_plan(rc, p, out.out, out.err, "Qwen2.5-72B")
