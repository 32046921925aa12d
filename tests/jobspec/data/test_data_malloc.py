"""prepare-data's tokenizer processes: a preloaded malloc, and the system block encoded once."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from jobspec.config import CleanConfig, ConfigError
from jobspec.data import cache, malloc
from jobspec.data import encode as enc_mod
from jobspec.data import prepare as prep
from jobspec.data.clean import text_rule
from jobspec.data.formats import Sample, iter_samples, resolve_sources
from jobspec.data.template import render, splits_at_specials
from jobspec.finish import finished
from jobspec.recipe_load import load_recipe
from tests.jobspec.data.data_helpers import TOKENIZER, alpaca, cache_of, recipe_for, write_jsonl


def _maps(_: int = 0) -> str:
    """(runs in a pool worker) the libraries mapped into the process."""
    return Path("/proc/self/maps").read_text()


def _held_chunks(_: int = 0) -> int:
    """(runs in a pool worker) how many chunks of encodings the worker holds before freeing."""
    return enc_mod._WORKER.hold_chunks


def test_choose_prefers_the_wheel_then_system_libraries_in_order(tmp_path):
    name, lib = malloc.choose("auto")
    assert name == "mimalloc" and lib is not None and lib.name.startswith("libmimalloc.so.") and lib.is_file()
    for f in ("libjemalloc.so.2", "libtcmalloc_minimal.so.4"):
        (tmp_path / f).write_bytes(b"")
    assert malloc.choose("auto", dirs=(str(tmp_path),), dist="no-such-wheel") == \
        ("tcmalloc", tmp_path / "libtcmalloc_minimal.so.4")
    (tmp_path / "libtcmalloc_minimal.so.4").unlink()
    assert malloc.choose("auto", dirs=(str(tmp_path),), dist="no-such-wheel")[0] == "jemalloc"
    assert malloc.choose("auto", dirs=(str(tmp_path / "none"),), dist="no-such-wheel") == ("system", None)
    assert malloc.choose("system") == ("system", None)
    assert malloc.choose(str(tmp_path / "libjemalloc.so.2")) == ("jemalloc", tmp_path / "libjemalloc.so.2")
    with pytest.raises(ConfigError, match=r"data.worker_malloc='/nope/libx.so': no such file.*auto, system"):
        malloc.choose("/nope/libx.so")


def test_worker_malloc_setting_is_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"data.worker_malloc='fast': auto, system or the absolute path"):
        load_recipe(raw={"model": {"init": {}}}, overrides={"data.worker_malloc": "fast"})
    data = write_jsonl(tmp_path / "d.jsonl", [alpaca(i) for i in range(4)])
    r = recipe_for(tmp_path, [data], num_workers="2", worker_malloc="/nope/libx.so")
    with pytest.raises(ConfigError, match="no such file"):
        prep.prepare(*cache_of(r), progress=False)
    assert not list((tmp_path / "out").glob(".data.tmp-*"))  # nothing left behind


def test_preloaded_sets_and_restores_ld_preload(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with malloc.preloaded(Path("/x/liba.so")):
        assert os.environ["LD_PRELOAD"] == "/x/liba.so"
    assert "LD_PRELOAD" not in os.environ
    monkeypatch.setenv("LD_PRELOAD", "/y/libuser.so")
    with malloc.preloaded(Path("/x/liba.so")):
        assert os.environ["LD_PRELOAD"] == "/x/liba.so /y/libuser.so"
    assert os.environ["LD_PRELOAD"] == "/y/libuser.so"
    with malloc.preloaded(None):
        assert os.environ["LD_PRELOAD"] == "/y/libuser.so"


def test_workers_run_with_the_library_and_write_the_same_cache(tmp_path):
    name, lib = malloc.choose("auto")
    args = (str(TOKENIZER), "sys", 128, CleanConfig())
    pool = enc_mod.start_pool(args, 2, lib)
    try:
        assert len(pool._processes) == 2  # both started with the library, and the variable restored
        assert "LD_PRELOAD" not in os.environ or str(lib) not in os.environ["LD_PRELOAD"]
        assert all(str(lib.resolve()) in m for m in pool.map(_maps, range(8)))
        assert set(pool.map(_held_chunks, range(8))) == {0}  # holding only helps glibc
    finally:
        enc_mod.stop_pool(pool)
    system = enc_mod.start_pool(args, 2, None)
    try:
        assert set(system.map(_held_chunks, range(8))) == {enc_mod.HOLD_CHUNKS}
    finally:
        enc_mod.stop_pool(system)
    assert lib.name not in _maps()  # this process keeps the system malloc
    data = write_jsonl(tmp_path / "d.jsonl", [alpaca(i) for i in range(600)])
    infos = {w: prep.prepare(*cache_of(recipe_for(tmp_path / w, [data], num_workers="2", worker_malloc=w)),
                             progress=False) for w in ("auto", "system")}
    assert infos["auto"].report["tokenizer"] == {"workers": 2, "malloc": name, "malloc_library": str(lib)}
    assert infos["system"].report["tokenizer"]["malloc"] == "system"
    one = prep.prepare(*cache_of(recipe_for(tmp_path / "one", [data])), progress=False)
    for f in ("tokens.npy", "labels.npy", "index.npy"):
        ref = (one.dir / f).read_bytes()
        assert all((i.dir / f).read_bytes() == ref for i in infos.values()), f


def _samples() -> list[Sample]:
    turns = (("user", "Hi  there\n"), ("assistant", " Hello!\n\n"))
    return [Sample(None, turns, "a"), Sample("Be brief.", turns, "b"), Sample(" \n", turns, "c"),
            Sample(None, (("user", "1"), ("assistant", "2"), ("user", "\n3"), ("assistant", "4 ")), "d"),
            Sample("Be brief.", (("user", "x"), ("assistant", "y")), "e")]


def _full_ids(tok, samples: list[Sample], system: str) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch([render(s, system) for s in samples], add_special_tokens=False)]


def test_system_block_encoded_once_gives_the_ids_of_the_whole_text():
    enc = enc_mod.Encoder(str(TOKENIZER), "You are a helpful assistant.", 128, CleanConfig())
    assert enc.split
    samples = _samples() * 3
    assert enc._encode(samples) == _full_ids(enc.tok, samples, enc.system_prompt)
    assert len(enc._system_ids) == 3  # default, "Be brief.", " \n"
    enc.SYSTEM_CACHE = 2  # more distinct prompts than it holds: still right
    assert enc._encode(samples) == _full_ids(enc.tok, samples, enc.system_prompt)


def test_a_tokenizer_whose_specials_strip_whitespace_encodes_whole_texts(tmp_path):
    spec = json.loads(TOKENIZER.read_text())
    for t in spec["added_tokens"]:
        if t["content"] == "<|im_end|>":
            t["rstrip"] = True
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    enc = enc_mod.Encoder(str(path), "You are a helpful assistant.", 128, CleanConfig())
    assert not enc.split and not splits_at_specials(enc.tok)
    samples = _samples()
    assert enc._encode(samples) == _full_ids(enc.tok, samples, enc.system_prompt)


def test_bundled_data_cache_equals_whole_text_encoding(tmp_path):
    """Every bundled sample: the cache's tokens are the whole templated text's ids."""
    r = finished(load_recipe("tiny-cpu", {"output_dir": str(tmp_path), "data.seq_len": "4096",
                                          "data.clean.dedup": "false", "data.val_size": "0"}))
    info = prep.prepare(*cache_of(r), progress=False)
    toks = np.load(info.dir / "tokens.npy")
    idx = np.load(info.dir / "index.npy")
    tok = enc_mod.load_tokenizer(str(TOKENIZER), TOKENIZER.stat().st_mtime)
    samples = [s for src in resolve_sources(r.data) for s in iter_samples(src.path)]
    kept = [s for s in samples if text_rule(s, r.data.clean) is None]
    full = _full_ids(tok, kept, r.data.system_prompt)
    full = [f for f in full if len(f) >= r.data.clean.min_tokens]
    assert len(full) == len(idx) == cache.load_info(info.dir).num_samples
    for (start, n), ids in zip(idx[:, :2].tolist(), full):
        assert toks[start:start + n].tolist() == ids


def test_auto_workers_follow_the_available_cpus(tmp_path, monkeypatch):
    # data.num_workers=0 on a large input: one worker per available CPU, at most MAX_AUTO_WORKERS
    monkeypatch.setattr(prep, "AUTO_POOL_BYTES", 0)
    monkeypatch.setattr(prep, "MAX_AUTO_WORKERS", 3)
    monkeypatch.setattr(prep, "available_cpus", lambda: 64)
    data = write_jsonl(tmp_path / "d.jsonl", [alpaca(i) for i in range(40)])
    info = prep.prepare(*cache_of(recipe_for(tmp_path, [data], num_workers="0")), progress=False)
    assert info.report["tokenizer"]["workers"] == 3


def test_waiting_on_a_chunk_the_executor_lost_ends_when_a_tokenizer_process_dies():
    """A future the executor never completes (CPython 3.11: submitted while the pool marks itself
    broken) fails with BrokenProcessPool once a process is gone; a slow chunk of a live pool does not."""
    import time
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    pool = enc_mod.start_pool((str(TOKENIZER), "sys", 128, CleanConfig()), 2, None)
    try:
        assert enc_mod.pool_result(pool, pool.submit(time.sleep, 0.5), poll_s=0.1) is None
        next(iter(pool._processes.values())).kill()
        t0 = time.monotonic()
        with pytest.raises(BrokenProcessPool):
            enc_mod.pool_result(pool, Future(), poll_s=0.1)  # never completed by anyone
        assert time.monotonic() - t0 < 10
    finally:
        enc_mod.stop_pool(pool)


def test_a_result_cut_off_mid_message_does_not_keep_the_process_alive():
    """A tokenizer process killed while it sends a result leaves half a message in the result pipe:
    the executor's thread waits for the rest forever and the interpreter joins it at exit (CPython
    3.11; prepare-data printed its error, then hung). After stop_pool the process ends."""
    import subprocess
    import sys

    script = """if True:
        import multiprocessing as mp, os, struct, sys, time
        from concurrent.futures import ProcessPoolExecutor
        sys.path.insert(0, sys.argv[1])
        from jobspec.data import encode
        pool = ProcessPoolExecutor(2, mp_context=mp.get_context("spawn"))
        [f.result() for f in [pool.submit(int) for _ in range(2)]]
        os.write(pool._result_queue._writer.fileno(), struct.pack("!i", 1 << 20) + b"x")  # half a result
        time.sleep(0.5)  # the executor's thread now waits in recv for the rest
        encode.stop_pool(pool)
        print("stopped", flush=True)
    """
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "stopped\n", done.stderr


def test_a_killed_tokenizer_process_stops_prepare_with_a_clear_error(tmp_path):
    """A worker killed mid-run (e.g. by the OOM killer) ends prepare-data with an error, not a hang."""
    import subprocess
    import sys
    import time

    import psutil

    from jobspec.config import to_dict

    data = write_jsonl(tmp_path / "d.jsonl", [alpaca(i) for i in range(40_000)])
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"recipe": to_dict(recipe_for(tmp_path, [data], num_workers="2"))}))
    proc = subprocess.Popen([sys.executable, "-m", "jobspec.data.prepare", "--config", str(plan)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    killed = None
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        workers = [c for c in psutil.Process(proc.pid).children()
                   if "spawn_main" in " ".join(c.cmdline()) and c.cpu_times().user > 1.0]  # tokenizing
        if workers:
            killed = workers[0]
            killed.kill()
        time.sleep(0.05)
    assert killed is not None, "no tokenizer process seen"
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("prepare-data hung after a tokenizer process died:\n" + proc.communicate()[1][-3000:])
    assert proc.returncode == 2, err
    assert "a tokenizer process died" in err and "data.num_workers" in err, err
    assert not list((tmp_path / "out").glob(".data.tmp-*")) and not (tmp_path / "out" / "data").exists()
