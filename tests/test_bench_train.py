"""`make bench-train` (tools/bench_train.py) times the model and optimizer a run trains with."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent.parent / "tools" / "bench_train.py"


def test_the_benchmark_steps_the_model_the_trainer_builds(ms_cpu, tmp_path, monkeypatch):
    """Training mode, as finetune.run.training.build_model leaves it: the LM head computes the logits once a
    step and keeps them for the backward. The bench used to build its own model in evaluation mode,
    whose backward recomputes them (two vocab-sized matmuls where a run does one), so it understated us."""
    from jobspec.tiny import ensure_tiny_model

    spec = importlib.util.spec_from_file_location("bench_train", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ensure_tiny_model(tmp_path / "model", {"tie_word_embeddings": False})
    vocab = json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, (2, 16)).astype(np.int32)
    batch = {"ids": ids, "labels": ids.copy(), "pos": np.tile(np.arange(16, dtype=np.int32), (2, 1)),
             "seg": np.ones_like(ids)}
    ours = bench.Ours(tmp_path / "model", batch, jit_layers=False)
    head = ours.model.loss_fn
    calls = []
    real = head._logits
    monkeypatch.setattr(head, "_logits", lambda h, w: calls.append(h.shape[0]) or real(h, w))
    first = ours.step()[1]
    assert ours.model.training and calls == [2 * 15]
    assert np.isfinite(first) and ours.step()[1] != first  # the optimizer stepped


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH.parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rounds_interleave_each_of_our_paths_with_torch():
    order = _load("bench_conditions").interleave(["ours-opbyop", "ours-compiled"], 2)
    assert [p for _, p in order] == ["ours-opbyop", "torch", "ours-compiled", "torch"] * 2
    assert [r for r, _ in order] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_each_of_our_steps_is_paired_with_the_torch_step_right_after_it():
    cond = _load("bench_conditions")
    order = cond.interleave(["a", "b"], 2)
    times, after = cond.by_path([(p, float(i)) for i, (_, p) in enumerate(order)])
    assert times == {"a": [0.0, 4.0], "torch": [1.0, 3.0, 5.0, 7.0], "b": [2.0, 6.0]}
    assert after == {"a": [1.0, 5.0], "b": [3.0, 7.0]}
    assert cond.by_path([("torch", 1.0), ("a", 2.0)])[1] == {}  # torch with no step of ours before it


def test_ratio_is_the_median_of_per_round_ratios_with_its_spread():
    stats = _load("bench_conditions").ratio_stats([1.0, 2.0, 4.0], [2.0, 2.0, 2.0])
    assert stats == {"median": 1.0, "min": 0.5, "max": 2.0, "n": 3}


def test_a_load_above_the_cores_at_any_sample_withholds_the_ratio():
    cond = _load("bench_conditions")
    loads = iter([0.5, 3.5, 0.2])
    watch = cond.LoadWatch(2, lambda: next(loads))
    watch.sample()
    assert watch.invalid() == ""
    watch.sample(), watch.sample()
    assert watch.invalid() == "NOT VALID: load average 3.50 > cores 2"
    bench = _load("bench_train")
    times = {"ours-opbyop": [1.0, 1.0], "ours-compiled": [1.0, 1.0], "torch": [2.0, 4.0, 2.0, 4.0]}
    after = {"ours-opbyop": [2.0, 2.0], "ours-compiled": [4.0, 4.0]}
    assert "ratio_to_torch" not in bench.summarize(times, after, 10, watch.invalid())["ours-opbyop"]
    ok = bench.summarize(times, after, 10, "")
    medians = (ok["ours-opbyop"]["ratio_to_torch"]["median"], ok["ours-compiled"]["ratio_to_torch"]["median"])
    assert medians == (2.0, 4.0)


def _fake_proc(root, tasks):
    """A /proc with processes {pid: (ppid, [thread states])}."""
    for pid, (ppid, states) in tasks.items():
        d = root / str(pid)
        (d / "task").mkdir(parents=True)
        (d / "stat").write_text(f"{pid} (py thon) S {ppid} 1 1\n")
        for i, st in enumerate(states):
            (d / "task" / str(pid * 10 + i)).mkdir()
            (d / "task" / str(pid * 10 + i) / "stat").write_text(f"{pid} (py) {st} {ppid} 1\n")
    return root


def test_the_validity_check_counts_other_processes_runnable_threads_not_the_benchmarks(tmp_path):
    """The benchmark (pid 100), its torch worker (101, a child) and a grandchild are ours whatever they
    run; another job's runnable threads count; a run whose others average above 0.5 is NOT VALID."""
    cond = _load("bench_conditions")
    proc = _fake_proc(tmp_path, {1: (0, ["S"]), 100: (1, ["R", "R"]), 101: (100, ["R"]), 102: (101, ["R"]),
                                 200: (1, ["R", "S", "R"]), 300: (1, ["D"])})
    assert cond.other_runnable(100, proc) == 2
    samples = iter([0, 1, 0, 0, 2, 2, 2, 2] + [2] * 1000)
    with cond.OtherWork(lambda: next(samples), every=0.001) as w:
        while len(w.samples) < 4:
            pass
    assert w.samples[:4] == [0, 1, 0, 0] and w.invalid() == ""
    late = cond.OtherWork(lambda: 0)
    late.samples = [0, 2, 2]
    assert late.invalid() == "NOT VALID: other processes kept 1.33 threads runnable on average (> 0.5)"


def test_cpu_info_reads_model_and_vector_flags(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 sse\n")
    info = _load("bench_conditions").cpu_info(f)
    assert (info["model"], info["avx2"], info["avx512f"]) == ("Test CPU", True, False) and info["cores"] >= 1


def test_an_unknown_path_is_refused_before_any_work(capsys):
    assert _load("bench_train").main(["--paths", "ours-opbyop,ours-fast"], loadavg=lambda: 0.0) == 2
    assert "unknown --paths ours-fast; e.g. --paths ours-default,ours-opbyop" in capsys.readouterr().err


def test_the_lora_method_steps_only_the_adapters_and_compares_with_the_full_step(ms_cpu, tmp_path, capsys):
    """--method lora: our LoRA step trains the adapters alone on the same model and batch; its ratio to our full
    step of each round (``ratio_to_full``) and to peft; no torch ratio for the full path (torch runs peft)."""
    from jobspec.tiny import ensure_tiny_model

    bench = _load("bench_train")
    ensure_tiny_model(tmp_path / "model", {"tie_word_embeddings": False})
    vocab = json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, (2, 16)).astype(np.int32)
    batch = {"ids": ids, "labels": ids.copy(), "pos": np.tile(np.arange(16, dtype=np.int32), (2, 1)),
             "seg": np.ones_like(ids)}
    lora = bench.Ours(tmp_path / "model", batch, jit_layers=False, method="lora")
    assert len(lora.params) == 2 * 7 * 2 and all(".lora_" in p.name for p in lora.params)
    first = lora.step()[1]
    assert np.isfinite(first) and lora.step()[1] != first
    times = {"ours-lora": [1.0, 1.0], "ours-default": [2.0, 3.0], "torch": [2.0, 2.0, 1.0, 1.0]}
    after = {"ours-lora": [2.0, 2.0], "ours-default": [1.0, 1.0]}
    r = bench.summarize(times, after, 10, "", "lora")
    assert r["ours-lora"]["ratio_to_full"]["median"] == 2.5 and r["ours-lora"]["ratio_to_torch"]["median"] == 2.0
    assert "ratio_to_torch" not in r["ours-default"]
    assert "ratio_to_full" not in bench.summarize(times, after, 10, "NOT VALID", "lora")["ours-lora"]
    assert bench.peft_kwargs()["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]
    compiled = bench.Ours(tmp_path / "model", batch, jit_layers=None, method="lora")  # the default: compiled,
    assert compiled.compiled and len(compiled.model.lora_masks.drawn) == 2 * 7  # dropout masks drawn ahead
    assert np.isfinite(compiled.step()[1]) and compiled.model.lora_masks.step == 0
