"""parallel.tp: auto, resolved by the launcher from MODEL_DIR/config.json (a config.json alone, no weights)
and the world on fake Atlas 800T A2 hosts (8 NPUs each; 16 NPUs: two nodes, this one node 0)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from launcher_fakes import recorded_npu_smi

import launcher.__main__ as lm
from jobspec.layout_choice import MARGIN_NOTE
from jobspec.qwen_sizes import SIZES, size_table


def plan(atlas: Path, recipe: str, size: str | None, npus: int, capsys: pytest.CaptureFixture[str],
         **env: str) -> tuple[int, dict | None, str, str]:
    """``plan --recipe recipe`` for MODEL_DIR holding the config.json of ``size`` (None: an empty dir) on
    ``npus`` NPUs: (exit code, plan.json as printed, stdout, stderr)."""
    model = atlas / "model"
    model.mkdir(exist_ok=True)
    if size:
        (model / "config.json").write_text(json.dumps(SIZES[size]))
    nodes = {"NNODES": str(npus // 8), "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.11"} if npus > 8 else \
        {"NPROC_PER_NODE": str(npus)}
    host = lm.Host(env={"MODEL_DIR": str(model), "OUTPUT_DIR": str(atlas / "out"), **nodes, **env},
                   dev_dir=atlas / "dev", root=atlas, sys_root=atlas / "sys", npu_smi=recorded_npu_smi,
                   identities=set())
    rc = lm.main(["plan", "--recipe", recipe], host)
    out = capsys.readouterr()
    text = out.out
    printed = json.JSONDecoder().raw_decode(text[text.index("\n{") + 1:])[0] if "\n{" in text else None
    return rc, printed, out.out, out.err


@pytest.mark.parametrize("size,npus,tp,why", [
    ("Qwen2.5-7B", 8, 2, "auto -> TP 2 ZeRO-1: TP 1 ZeRO-1 needs 74.5 GiB per NPU > 54 planned"),  # the field guide's
    ("Qwen2.5-7B", 16, 2, "auto -> TP 2 ZeRO-1: TP 1 ZeRO-1 needs 69.1 GiB per NPU > 54 planned"),
    ("Qwen2.5-32B", 32, 8, "auto -> TP 8 ZeRO-1: TP 1 ZeRO-1 needs 265.6 GiB per NPU > 54 planned; TP 2 ZeRO-1 needs "
                           "140.6 GiB per NPU > 54 planned; TP 4 ZeRO-1 needs 78.1 GiB per NPU > 54 planned"),
])
def test_auto_takes_the_smallest_tp_that_fits_and_the_plan_says_why(atlas, capsys, size, npus, tp, why):
    rc, p, out, _ = plan(atlas, "qwen-full", size, npus, capsys)
    assert rc == 0
    layout = p["recipe"]["layout"]  # written once, in the recipe; the topology says where the ranks run
    assert (layout["tp"], layout["dp"], p["topology"]["world_size"]) == (tp, npus // tp, npus)
    assert not {"tp", "dp", "pp"} & set(p["topology"])
    why += f"; {MARGIN_NOTE}"  # the planning margin stays until device measurements exist
    assert p["recipe"]["parallel"]["tp"] == tp and p["sources"]["parallel.tp"] == why
    assert f"[launcher] parallel.tp: {why}\n" in out
    assert (p["recipe"]["parallel"]["zero"], layout["shard_optimizer"], layout["shard_gradients"]) == (1, True, False)
    zero = p["sources"]["parallel.zero"]  # the stage chosen with the TP, and what each stage would move
    assert zero.startswith(f"auto -> ZeRO-1 (TP {tp} x DP {npus // tp}, ZeRO-1; the lowest stage that fits")
    assert "per step a rank sends over " in zero and all(f"ZeRO-{z} " in zero for z in (1, 2, 3))
    assert p["recipe"]["train"]["compile_layers"] is False  # and the plan says why (Ascend: not measured)
    line = next(x for x in out.splitlines() if x.startswith("[launcher] train.compile_layers: "))
    assert line.startswith("[launcher] train.compile_layers: off (auto): ") and "launch.device=npu: " in line


def test_lora_is_chosen_with_the_lora_estimate(atlas, capsys):
    """32B: full fine-tune fits nowhere on 8 NPUs, LoRA with TP 2 (TP 1: the bf16 base alone is 61 GiB)."""
    rc, p, _, _ = plan(atlas, "qwen-lora", "Qwen2.5-32B", 8, capsys)
    assert rc == 0 and (p["recipe"]["layout"]["tp"], p["recipe"]["layout"]["dp"]) == (2, 4)
    assert p["sources"]["parallel.tp"].startswith("auto -> TP 2 ZeRO-1: TP 1 ZeRO-1 needs 69.5")
    assert p["recipe"]["train"]["method"] == "lora"


def test_an_explicit_tp_is_kept(atlas, capsys):
    rc, p, _, _ = plan(atlas, "qwen2.5-7b-full", "Qwen2.5-7B", 8, capsys, TP="4")
    layout = p["recipe"]["layout"]
    assert rc == 0 and (layout["tp"], layout["dp"]) == (4, 2) and "parallel.tp" not in p["sources"]


@pytest.mark.parametrize("size,npus,advice", [
    ("Qwen2.5-72B", 8, ["would fit: 32 NPUs (4 node(s), TP 2 x DP 16, ZeRO-3)", "LoRA (train.method=lora"]),
    ("Qwen2.5-32B", 8, ["would fit: 16 NPUs (2 node(s), TP 8 x DP 2, ZeRO-2)", "TP 8 needs 80.9 GiB per NPU",
                        "TP 4 ZeRO-3 needs 75.4 GiB per NPU", "LoRA (train.method=lora"]),
])
def test_a_model_that_fits_nowhere_is_refused_before_any_work(atlas, capsys, size, npus, advice):
    rc, p, out, err = plan(atlas, "qwen-full", size, npus, capsys)
    assert rc == 2 and p is None and "Traceback" not in err + out
    assert f"parallel.tp='auto': auto: no layout of {npus} NPU(s) fits: TP 1 ZeRO-1 needs" in err
    assert all(a in err for a in advice), err
    assert not (atlas / "out").exists()  # nothing written


def test_without_a_config_json_or_on_cpu_auto_is_one_with_its_reason(atlas, capsys):
    rc, p, out, _ = plan(atlas, "qwen-full", None, 8, capsys)
    assert rc == 0 and (p["recipe"]["layout"]["tp"], p["recipe"]["layout"]["dp"]) == (1, 8)
    assert p["sources"]["parallel.tp"] == f"auto -> 1: no {atlas / 'model' / 'config.json'} yet to estimate from"
    assert "parallel.zero" not in p["sources"] and p["recipe"]["layout"]["shard_optimizer"]  # decide's ZeRO-1
    rc, p, out, _ = plan(atlas, "tiny-cpu", None, 1, capsys, TP="auto", MODEL_DIR="")  # the tiny default
    assert rc == 0 and p["recipe"]["layout"]["tp"] == 1
    assert p["sources"]["parallel.tp"] == "auto -> 1: CPU workers (the choice is made for NPU memory)"
    assert p["recipe"]["train"]["compile_layers"] is True
    assert "[launcher] train.compile_layers: on: each decoder layer one graph, compiled at the first step (auto)" in out


def table_row(name: str, method: str) -> dict[str, str]:
    head, _, *rows = size_table().splitlines()
    keys = [k.strip() for k in head.strip("|").split("|")]
    for row in rows:
        cells = dict(zip(keys, (c.strip() for c in row.strip("|").split("|"))))
        if (cells["model"], cells["method"]) == (name, method):
            return cells
    raise KeyError(name)


@pytest.mark.parametrize("name,recipe", [("Qwen2.5-7B", "qwen-full"), ("Qwen2.5-14B", "qwen-full"),
                                         ("Qwen3-8B", "qwen-full"), ("Qwen3-32B", "qwen-lora"),
                                         ("Qwen2.5-72B", "qwen-lora")])
def test_plan_prints_the_size_tables_layout_and_memory(atlas, capsys, name, recipe):
    """The rows ZeRO-1 fits (ZeRO-2 and 3 rows: tests/launcher/test_plan_zero.py)."""
    row = table_row(name, "LoRA" if recipe == "qwen-lora" else "full")
    rc, p, out, _ = plan(atlas, recipe, name, int(row["NPUs"]), capsys)
    t = p["recipe"]["layout"]
    assert rc == 0 and f"TP {t['tp']} x DP {t['dp']}" + (", ZeRO-1" if t["dp"] > 1 else "") == row["layout"]
    assert f"= {row['GiB per NPU']} (embedding/LM head" in out and f"{p['memory']['total'] / 2**30:.1f}" == \
        row["GiB per NPU"]
