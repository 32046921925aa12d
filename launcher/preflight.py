"""Preflight: every check the job can fail on, answered in about a second, before any worker starts.

Each check returns :class:`Check` rows (ok / warn / fail); every fail carries the fix.
Checks read only the :class:`Context`, whose paths and probes tests replace.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from finetune.config import Recipe, resolved_model_dir
from launcher.devices import Devices, format_id_list

GIB = 2**30
NPU_HBM_DEFAULT = 64 * 10**9  # Ascend 910B (Atlas 800T A2), when npu-smi does not say


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


@dataclass
class Context:
    """What the checks look at; defaults are the real host."""

    recipe: Recipe
    devices: Devices
    nproc: int
    root: Path = Path("/")
    shm: Path = Path("/dev/shm")
    data_checker: Callable | None = None  # finetune.data.formats.check_data
    memory_estimator: Callable | None = None  # finetune.memory.estimate_memory
    connect: Callable[[str, int, float], None] = lambda host, port, t: socket.create_connection((host, port), t).close()
    port_free: Callable[[int], bool] = field(default=None)  # type: ignore[assignment]

    @property
    def world(self) -> int:
        return self.recipe.launch.nnodes * self.nproc


def model_config(recipe: Recipe) -> dict | None:
    """config.json of the model dir, or None when missing/unreadable."""
    path = Path(resolved_model_dir(recipe) or ".") / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def param_count(cfg: dict) -> int:
    """Rough Qwen2 parameter count from config.json (embeddings, attention, MLP, norms)."""
    h, v, n = cfg.get("hidden_size", 0), cfg.get("vocab_size", 0), cfg.get("num_hidden_layers", 0)
    heads = cfg.get("num_attention_heads", 1) or 1
    kv = cfg.get("num_key_value_heads", heads) or heads
    inter = cfg.get("intermediate_size", 4 * h)
    hd = h // heads
    attn = h * h * 2 + 2 * h * kv * hd + h + 2 * kv * hd  # q,o + k,v (+ q/k/v biases)
    per_layer = attn + 3 * h * inter + 2 * h
    emb = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return emb + n * per_layer + h


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


# ----------------------------------------------------------------------------- checks

def check_devices(c: Context) -> list[Check]:
    d, out = c.devices, []
    if not d.has_npu:
        if c.recipe.launch.device == "npu":
            return [Check("devices", "fail", f"recipe {c.recipe.name} needs NPUs (launch.device=npu); none found",
                          "docker run --device=/dev/davinci0 ... --device=/dev/davinci7 (see README), "
                          "or RECIPE=tiny-cpu for CPU workers")]
        return [Check("devices", "ok", "no NPU: CPU workers (the embedded default)")]
    if d.missing_mgmt or d.missing_mounts:
        missing = [f"/dev/{m}" for m in d.missing_mgmt] + d.missing_mounts
        out.append(Check("devices", "fail", f"missing {', '.join(missing)}", f"add to docker run: {d.fix_flags()}"))
    for p in d.problems:
        out.append(Check("devices", "fail", p, "fix the variable or the --device flags"))
    denied = [i for i in d.visible if not os.access(c.root / "dev" / f"davinci{i}", os.R_OK | os.W_OK)]
    if denied:
        out.append(Check("devices", "fail", f"no read/write permission on /dev/davinci{format_id_list(denied)}",
                         "run as root or as a member of the HwHiAiUser group (docker run --group-add HwHiAiUser)"))
    if c.recipe.launch.device == "cpu":
        out.append(Check("devices", "warn", "NPUs present but the recipe runs on CPU (launch.device=cpu)",
                         "set MODEL_DIR and DATA for the NPU recipe, or RECIPE=qwen2.5-7b-full"))
    return out or [Check("devices", "ok", d.summary())]


def check_versions(c: Context) -> list[Check]:
    if not c.devices.has_npu:
        return [Check("driver/CANN", "ok", "not needed for CPU workers")]
    out = []
    drv = c.root / "usr/local/Ascend/driver/version.info"
    if drv.is_file():
        ver = next((ln.split("=", 1)[1] for ln in drv.read_text().splitlines() if ln.startswith("Version=")), "?")
        out.append(Check("driver", "ok", f"driver {ver.strip()}"))
    else:
        out.append(Check("driver", "fail", f"{drv} missing",
                         "-v /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro"))
    pattern = str(c.root / "usr/local/Ascend/ascend-toolkit/latest/*/ascend_toolkit_install.info")
    infos = sorted(glob.glob(pattern))
    if infos:
        ver = next((ln.split("=", 1)[1] for ln in Path(infos[0]).read_text().splitlines()
                    if ln.startswith("version=")), "?")
        out.append(Check("CANN", "ok", f"CANN toolkit {ver.strip()}"))
    else:
        out.append(Check("CANN", "fail", "no ascend-toolkit install info under /usr/local/Ascend/ascend-toolkit/latest",
                         "use the CANN base image (BASE_IMAGE) or install CANN 8.x toolkit"))
    return out


def check_shm(c: Context) -> list[Check]:
    try:
        st = os.statvfs(c.shm)
    except OSError:
        return [Check("/dev/shm", "warn", f"{c.shm} not found", "docker run --ipc=host (or --shm-size=16g)")]
    size = st.f_blocks * st.f_frsize
    detail = f"{size / GIB:.1f} GiB"
    if c.nproc > 1 and size < 1 * GIB:
        return [Check("/dev/shm", "fail", f"{detail}: too small for {c.nproc} workers",
                      "docker run --ipc=host (or --shm-size=16g); Kubernetes: an emptyDir medium: Memory on /dev/shm")]
    if c.devices.has_npu and size < 8 * GIB:
        return [Check("/dev/shm", "warn", f"{detail}: small for 8 NPU workers", "docker run --ipc=host")]
    return [Check("/dev/shm", "ok", detail)]


def check_disk(c: Context) -> list[Check]:
    cfg = model_config(c.recipe)
    out = Path(c.recipe.output_dir).resolve()
    probe = next((p for p in (out, *out.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(probe)[2]
    if cfg is None:
        return [Check("disk", "ok", f"{free / GIB:.1f} GiB free at {probe} (model size unknown yet)")]
    n, keep = param_count(cfg), c.recipe.train.keep_checkpoints
    ckpts = keep + 1 if keep > 0 else 2  # the one being written while `keep` older ones still exist
    export = n * (4 if c.recipe.export.dtype == "fp32" else 2)
    base = n * 4 if c.recipe.model.init is not None and not (Path(resolved_model_dir(c.recipe)) / "config.json").exists() \
        else 0  # a tiny model still to be created under OUTPUT_DIR
    need = n * 16 * ckpts + export + base  # checkpoint: fp32 weights + AdamW m, v and fp32 masters
    detail = f"need ~{need / GIB:.1f} GiB ({n / 1e9:.2f} B params x 16 B x {ckpts} checkpoints (keep_checkpoints " \
             f"{keep} + the one being written) + export{' + base model' if base else ''}), " \
             f"{free / GIB:.1f} GiB free at {probe}"
    if free < need:
        return [Check("disk", "fail", detail, "point OUTPUT_DIR at a larger volume or lower train.keep_checkpoints")]
    return [Check("disk", "ok", detail)]


def check_model(c: Context) -> list[Check]:
    mdir = resolved_model_dir(c.recipe)
    if not mdir:
        return [Check("model", "fail", "no model directory", "set MODEL_DIR=/path/to/Qwen2.5-7B-Instruct (HF layout)")]
    d = Path(mdir)
    if c.recipe.model.init is not None and not (d / "config.json").exists():
        return [Check("model", "ok", f"{d}: tiny model is created there before training (model.init)")]
    missing = [f for f in ("config.json", "tokenizer.json") if not (d / f).is_file()]
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing += [s for s in shards if not (d / s).is_file()]
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            return [Check("model", "fail", f"{index}: unreadable ({e})", "re-download the model")]
    elif not list(d.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        return [Check("model", "fail", f"{d}: missing {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""),
                      "MODEL_DIR must be a complete Hugging Face model dir (huggingface-cli download <repo> "
                      "--local-dir DIR)")]
    return [Check("model", "ok", f"{d}: config, weights, tokenizer present")]


def check_data(c: Context) -> list[Check]:
    if not c.recipe.data.paths:
        return [Check("data", "fail", "no data", "set DATA=/path/to/train.jsonl (files or dirs, comma-separated)")]
    missing = [p for p in c.recipe.data.paths if not Path(p).exists()]
    if missing:
        return [Check("data", "fail", f"not found: {', '.join(missing)}", "fix DATA (files or dirs, comma-separated)")]
    if c.data_checker is None:
        return [Check("data", "warn", "data files exist; parse check unavailable (finetune.data.formats missing)")]
    problems = c.data_checker(c.recipe.data)
    if problems:
        return [Check("data", "fail", p, "fix the record or DATA_FORMAT") for p in problems[:10]]
    return [Check("data", "ok", f"{len(c.recipe.data.paths)} source(s) readable and parseable")]


def _layout_fits(c: Context, cfg: dict, budget: float) -> str | None:
    heads = cfg.get("num_attention_heads", 1)
    for tp in (1, 2, 4, 8):
        if tp > c.nproc or heads % tp or c.nproc % tp:
            continue
        est = c.memory_estimator(cfg, seq_len=c.recipe.data.seq_len, micro_batch_size=1, tp=tp,
                                 dp=max(1, c.world // tp), precision="bf16", recompute=True,
                                 shard_optimizer=c.world // tp > 1, vocab_parallel=tp > 1,
                                 loss_chunk_tokens=c.recipe.train.loss_chunk_tokens)
        if est.total <= budget:
            return (f"TP={tp} OVERRIDES='train.micro_batch_size=1 train.recompute=true parallel.shard_optimizer=true'"
                    f" ({est.total / GIB:.1f} GiB per device)")
    return None


def check_memory(c: Context) -> list[Check]:
    cfg = model_config(c.recipe)
    if cfg is None or c.memory_estimator is None:
        return [Check("memory", "warn", "estimate unavailable (no config.json yet or no estimator)")]
    r, tp = c.recipe, c.recipe.parallel.tp
    dp = r.parallel.dp or max(1, c.world // (tp * r.parallel.pp))
    precision = r.train.precision if r.train.precision != "auto" else ("bf16" if c.devices.has_npu else "fp32")
    shard = r.parallel.shard_optimizer if r.parallel.shard_optimizer is not None else dp > 1
    try:
        est = c.memory_estimator(cfg, seq_len=r.data.seq_len, micro_batch_size=r.train.micro_batch_size, tp=tp,
                                 dp=dp, precision=precision, recompute=r.train.recompute, shard_optimizer=shard,
                                 vocab_parallel=r.parallel.vocab_parallel, loss_chunk_tokens=r.train.loss_chunk_tokens)
    except NotImplementedError:
        return [Check("memory", "warn", "memory estimate not implemented yet (finetune.memory)")]
    if c.devices.has_npu:
        budget = min(c.devices.hbm_total_mb.values(), default=NPU_HBM_DEFAULT / 2**20) * 2**20
        where = "NPU HBM"
    else:
        import psutil
        budget, where = psutil.virtual_memory().available / max(1, c.nproc), "host RAM per CPU worker"
    detail = f"{est.total / GIB:.1f} GiB per device vs {budget / GIB:.1f} GiB {where}"
    if est.total <= budget * 0.95:
        return [Check("memory", "ok", detail)]
    fits = _layout_fits(c, cfg, budget * 0.95)
    return [Check("memory", "fail", detail, f"use {fits}" if fits else "add nodes (NNODES) or a smaller model")]


def check_network(c: Context) -> list[Check]:
    L = c.recipe.launch
    if L.nnodes == 1:
        return [Check("network", "ok", "single node")]
    if L.node_rank == 0:
        free = (c.port_free or _port_free)(L.master_port)
        if not free:
            return [Check("network", "fail", f"master port {L.master_port} is in use on this node",
                          "set MASTER_PORT to a free port (the same on every node)")]
        return [Check("network", "ok", f"master: port {L.master_port} free")]
    if L.master_addr in ("127.0.0.1", "localhost", "::1"):
        return [Check("network", "fail", f"node {L.node_rank} of {L.nnodes} but MASTER_ADDR is {L.master_addr}",
                      "set MASTER_ADDR to node 0's address (the same on every node)")]
    try:
        c.connect(L.master_addr, L.master_port, 3.0)
    except socket.gaierror as e:
        return [Check("network", "fail", f"MASTER_ADDR={L.master_addr} does not resolve ({e})",
                      "set MASTER_ADDR to node 0's address or resolvable hostname")]
    except OSError as e:  # node 0's msrun may not listen yet: it waits launch.cluster_time_out for us
        return [Check("network", "warn", f"{L.master_addr}:{L.master_port} not reachable yet ({e})",
                      "start node 0 too; check MASTER_PORT and the firewall if this persists")]
    return [Check("network", "ok", f"{L.master_addr}:{L.master_port} reachable")]


def check_world(c: Context) -> list[Check]:
    r, out = c.recipe, []
    tp, pp, dp = r.parallel.tp, r.parallel.pp, r.parallel.dp
    if dp and tp * dp * pp != c.world:
        out.append(Check("layout", "fail", f"TP={tp} x DP={dp} x PP={pp} = {tp * dp * pp} != world {c.world} "
                         f"(NNODES={r.launch.nnodes} x NPROC_PER_NODE={c.nproc})",
                         f"set DP={c.world // (tp * pp) if c.world % (tp * pp) == 0 else 0} or DP=0 (derived)"))
    elif c.world % (tp * pp):
        out.append(Check("layout", "fail", f"world {c.world} is not divisible by TP x PP = {tp * pp}",
                         f"set TP to a divisor of NPROC_PER_NODE={c.nproc} (e.g. TP=1)"))
    if c.nproc % tp:
        out.append(Check("layout", "fail", f"TP={tp} does not divide NPROC_PER_NODE={c.nproc} (TP stays in a node)",
                         "e.g. TP=2 with 8 NPUs per node"))
    cfg = model_config(r) or (r.model.init or {})
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if n and n % tp:
            out.append(Check("layout", "fail", f"TP={tp} does not divide {name}={n}", f"use a TP dividing {n}"))
    vocab = cfg.get("vocab_size")
    if r.parallel.vocab_parallel and vocab and vocab % tp:
        out.append(Check("layout", "fail", f"TP={tp} does not divide vocab_size={vocab} (parallel.vocab_parallel)",
                         "OVERRIDES='parallel.vocab_parallel=false' (replicated embedding/LM head) or another TP"))
    return out or [Check("layout", "ok", f"world {c.world} = TP {tp} x DP {dp or c.world // (tp * pp)} x PP {pp}")]


CHECKS = (check_devices, check_versions, check_shm, check_disk, check_model, check_data, check_memory,
          check_network, check_world)


def run_checks(c: Context) -> list[Check]:
    """All checks; an exception inside one becomes its own 'fail' row instead of stopping the rest."""
    rows: list[Check] = []
    for fn in CHECKS:
        try:
            rows += fn(c)
        except Exception as e:  # a broken check must not hide the others
            rows.append(Check(fn.__name__.removeprefix("check_"), "fail", f"check crashed: {e!r}",
                              "report this; rerun with NUMA_BIND=off / fewer settings to narrow it down"))
    return rows


def table(rows: list[Check]) -> str:
    lines = [f"{'status':<6}  {'check':<12}  detail"]
    for r in rows:
        lines.append(f"{r.status:<6}  {r.name:<12}  {r.detail}")
        if r.fix and r.status != "ok":
            lines.append(f"{'':<6}  {'':<12}  fix: {r.fix}")
    return "\n".join(lines)


def failed(rows: list[Check]) -> bool:
    return any(r.status == "fail" for r in rows)
