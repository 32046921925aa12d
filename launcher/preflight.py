"""Preflight: every check the job can fail on, answered in about a second, before any worker starts.

Each check returns :class:`Check` rows (ok / warn / fail); every fail carries the fix.
Checks read only the :class:`Context` (its recipe resolved for the job's world: ``Recipe.resolved``),
whose paths and probes tests replace.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jobspec import model_layout
from jobspec import native as nativelib
from jobspec.config import Recipe, creates_tiny_model, resolved_model_dir
from jobspec.family import family_of
from jobspec.layout_choice import choose_layout
from jobspec.lora_config import trainable_elements
from jobspec.memory import MemoryEstimate, TrainShape, estimate_memory, memory_estimate
from jobspec.platform import platform_of
from jobspec.tiny import tiny_config
from launcher.devices import Devices, format_id_list
from launcher.driver_check import driver_rows
from launcher.model_check import weight_problems
from launcher.mounts import LibraryLoader, load_libraries, mount_problems
from launcher.npu_smi import NpuSmi, run_npu_smi

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

    recipe: Recipe  # resolved (Recipe.resolved)
    devices: Devices
    nproc: int
    root: Path = Path("/")
    shm: Path = Path("/dev/shm")
    data_checker: Callable | None = None  # jobspec.data.formats.check_data
    memory_estimator: Callable[..., MemoryEstimate] = estimate_memory
    connect: Callable[[str, int, float], None] = lambda host, port, t: socket.create_connection((host, port), t).close()
    port_free: Callable[[int], bool] | None = None
    native_check: Callable[[], nativelib.NativeCheck] = nativelib.check_mindspore
    load_libraries: LibraryLoader = load_libraries  # the driver libraries, in a fresh process
    npu_smi: NpuSmi | None = run_npu_smi  # the driver version when version.info is not mounted

    @property
    def world(self) -> int:
        return self.recipe.launch.nnodes * self.nproc


def model_config(recipe: Recipe) -> dict | None:
    """config.json of the model dir (the tiny model's, before it is created, when model.init says so), or None
    when missing/unreadable."""
    path = Path(resolved_model_dir(recipe) or ".") / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return tiny_config(recipe.model.init) if creates_tiny_model(recipe) and not path.exists() else None


def param_count(cfg: dict) -> int:
    """Exact Qwen2 parameter count from config.json (``jobspec.model_layout``); 0 when sizes are missing."""
    try:
        return model_layout.param_count(cfg)
    except (KeyError, TypeError, ZeroDivisionError, ValueError):  # ValueError: another family (check_model)
        return 0


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
        if platform_of(c.recipe.launch.device, d.has_npu).accelerator:
            return [Check("devices", "fail", f"recipe {c.recipe.name} needs NPUs (launch.device=npu); none found",
                          "docker run --device=/dev/davinci0 ... --device=/dev/davinci7 (see README), "
                          "or RECIPE=tiny-cpu for CPU workers")]
        return [Check("devices", "ok", "no NPU: CPU workers (the embedded default)")]
    out += [Check("mounts", "fail", what, fix)
            for what, fix in mount_problems(d.missing_mgmt, d.missing_mounts, d.dcmi_error, c.root, c.load_libraries)]
    for p in d.problems:
        out.append(Check("devices", "fail", p, "fix the variable or the --device flags"))
    out += [Check("devices", "fail", detail, fix) for detail, fix in d.busy_rows()]
    denied = [i for i in d.visible if not os.access(c.root / "dev" / f"davinci{i}", os.R_OK | os.W_OK)]
    if denied:
        out.append(Check("devices", "fail", f"no read/write permission on /dev/davinci{format_id_list(denied)}",
                         "run as root or as a member of the HwHiAiUser group (docker run --group-add HwHiAiUser)"))
    if not platform_of(c.recipe.launch.device, d.has_npu).accelerator:
        out.append(Check("devices", "warn", "NPUs present but the recipe runs on CPU (launch.device=cpu)",
                         "set MODEL_DIR and DATA for the NPU recipe, or RECIPE=qwen2.5-7b-full"))
    return out or [Check("devices", "ok", d.summary())]


def check_versions(c: Context) -> list[Check]:
    """The host driver against the image's CANN (launcher/driver_check.py)."""
    if not c.devices.has_npu:
        return [Check("driver/CANN", "ok", "not needed for CPU workers")]
    return [Check(*row) for row in driver_rows(c.root, c.npu_smi)]


def check_mindspore(c: Context) -> list[Check]:
    """MindSpore's native libraries are built for this machine (PyPI's wheel is x86-64 whatever the host)."""
    n = c.native_check()
    return [Check("mindspore", n.status, n.detail, n.fix)]


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
    lora = c.recipe.train.method == "lora"  # a checkpoint holds the adapters (and modules_to_save) only
    trained = sum(trainable_elements(cfg, c.recipe.lora)) if lora and n else n
    merged = not lora or c.recipe.export.merge  # LoRA: adapter/ always, the merged hf/ unless export.merge=false
    export = (n if merged else 0) * (4 if c.recipe.export.dtype == "fp32" else 2) + (trained * 4 if lora else 0)
    # a tiny model still to be created under OUTPUT_DIR
    base = n * 4 if c.recipe.model.init is not None \
        and not (Path(resolved_model_dir(c.recipe)) / "config.json").exists() else 0
    need = trained * 16 * ckpts + export + base  # checkpoint: fp32 weights + AdamW m, v and fp32 masters
    what = f"{trained / 1e6:.1f} M trained (LoRA) params" if lora else f"{n / 1e9:.2f} B params"
    detail = f"need ~{need / GIB:.1f} GiB ({what} x 16 B x {ckpts} checkpoints (keep_checkpoints " \
             f"{keep} + the one being written) + export{' + base model' if base else ''}), " \
             f"{free / GIB:.1f} GiB free at {probe}"
    if free < need:
        return [Check("disk", "fail", detail, "point OUTPUT_DIR at a larger volume or lower train.keep_checkpoints")]
    return [Check("disk", "ok", detail)]


REDOWNLOAD = "re-download the model (huggingface-cli download <repo> --local-dir DIR)"


def _weights_problem(path: Path) -> str | None:
    """Why a safetensors file is unusable (unreadable header, shorter than its header says), or None."""
    from jobspec.hf_files import read_header

    try:
        header, start = read_header(path)
        end = max((t["data_offsets"][1] for t in header.values()), default=0)
    except OSError as e:  # a symlink loop, no permission
        return f"{path}: cannot be read ({e.strerror or e})"
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        return f"{path}: not a readable safetensors file ({type(e).__name__})"
    size = path.stat().st_size
    if size < start + end:
        return f"{path}: truncated: {size} bytes, its header needs {start + end}"
    return None


def check_model(c: Context) -> list[Check]:
    mdir = resolved_model_dir(c.recipe)
    if not mdir:
        return [Check("model", "fail", "no model directory",
                      "set MODEL_DIR to a Hugging Face model dir (docker: -e MODEL_DIR=/models/Qwen2.5-7B-Instruct "
                      "-v /data/models:/models:ro)")]
    d = Path(mdir)
    if creates_tiny_model(c.recipe) and not (d / "config.json").exists():
        return [Check("model", "ok", f"{d}: tiny model is created there before training (model.init)")]
    if not d.is_dir():
        return [Check("model", "fail", f"MODEL_DIR={d}: no such directory",
                      "set MODEL_DIR to a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)")]
    missing = [f + (" (a broken symlink or loop)" if (d / f).is_symlink() else "") for f in ("config.json",
               "tokenizer.json") if not (d / f).is_file()]
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            return [Check("model", "fail", f"{index}: unreadable ({e})", REDOWNLOAD)]
        missing += [s for s in shards if not (d / s).is_file()]
    else:
        shards = [f.name for f in sorted(d.glob("*.safetensors"))]
        if not shards:
            missing.append("*.safetensors")
    if missing:
        return [Check("model", "fail", f"{d}: missing {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""),
                      "MODEL_DIR must be a complete Hugging Face model dir (huggingface-cli download <repo> "
                      "--local-dir DIR)")]
    try:
        cfg = json.loads((d / "config.json").read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return [Check("model", "fail", f"{d / 'config.json'}: malformed ({e})", REDOWNLOAD)]
    try:
        family_of(cfg)
    except ValueError as e:
        return [Check("model", "fail", f"{d}/{e}", "set MODEL_DIR to a Qwen2, Qwen2.5 or Qwen3 dense model")]
    bad = [p for p in (_weights_problem(d / s) for s in shards) if p]
    if bad:
        return [Check("model", "fail", b, REDOWNLOAD) for b in bad]
    top = _max_token_id(d / "tokenizer.json")
    if top is None or top >= cfg.get("vocab_size", 0):
        what = "unreadable" if top is None else f"has token ids up to {top}, config.json's vocab_size is " \
                                                   f"{cfg.get('vocab_size')}"
        return [Check("model", "fail", f"{d / 'tokenizer.json'}: {what}",
                      "use the tokenizer that came with the model (same directory as its config.json)")]
    if mismatch := weight_problems(d, cfg, shards):  # config.json against the headers (launcher/model_check.py)
        return [Check("model", "fail", detail, fix) for detail, fix in mismatch]
    from jobspec.data.chat_template import check_model_template

    status, line = check_model_template(d, c.recipe.data.system_prompt)
    template = Check("template", "warn" if status in ("differs", "unchecked") else "ok", line,
                     "the data is written in prepare-data's chat template (Qwen2.5's; Qwen3's for a Qwen3 model); "
                     "serve "
                     "the fine-tuned model with it (the export keeps the model's tokenizer_config.json) or fine-tune "
                     "a model whose template matches"
                     if status == "differs" else "")
    return [Check("model", "ok", f"{d}: config, weights, tokenizer present"), template]


def _max_token_id(path: Path) -> int | None:
    """The largest id in a Hugging Face tokenizer.json (vocabulary and added tokens), None when unreadable."""
    try:
        tok = json.loads(path.read_text())
        ids = [*tok["model"]["vocab"].values(), *(t["id"] for t in tok.get("added_tokens", []))]
        return max(int(i) for i in ids)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def check_resume(c: Context) -> list[Check]:
    resume = c.recipe.train.resume
    if resume in ("auto", "never"):
        return [Check("resume", "ok", f"train.resume={resume}")]
    if not (Path(resume) / "trainer_state.json").is_file():
        return [Check("resume", "fail", f"train.resume={resume}: no checkpoint there (no trainer_state.json)",
                      "OVERRIDES='train.resume=auto' (the newest checkpoint in OUTPUT_DIR) or the path of a "
                      "checkpoints/step_N directory")]
    return [Check("resume", "ok", f"resuming from {resume}")]


def check_data(c: Context) -> list[Check]:
    if not c.recipe.data.paths:
        return [Check("data", "fail", "no data", "set DATA to files or dirs, comma-separated (docker: "
                      "-e DATA=/data/train.jsonl -v /data:/data:ro)")]
    missing = [p for p in c.recipe.data.paths if not Path(p).exists()]
    if missing:
        return [Check("data", "fail", f"not found: {', '.join(missing)}", "fix DATA (files or dirs, comma-separated)")]
    if c.data_checker is None:
        return [Check("data", "warn", "data files exist; parse check unavailable (jobspec.data.formats missing)")]
    problems = c.data_checker(c.recipe.data)
    if problems:
        return [Check("data", "fail", p, "fix the record or DATA_FORMAT") for p in problems[:10]]
    return [Check("data", "ok", f"{len(c.recipe.data.paths)} source(s) readable and parseable")]


def _layout_fits(c: Context, cfg: dict, budget: float) -> str | None:
    """The layout ``parallel.tp: auto`` and ``parallel.zero: auto`` would choose (``jobspec.layout_choice``:
    the smallest TP inside a node dividing the heads, KV heads and world, the lowest ZeRO stage) with micro
    batch 1, recompute and a sharded optimizer."""
    r = c.recipe
    shape = dataclasses.replace(TrainShape.of(r, r.launch.device), micro_batch_size=1, recompute=True,
                                shard_optimizer=True, vocab_parallel=True)
    choice = choose_layout(cfg, c.world, seq_len=r.data.seq_len, npus_per_node=c.nproc, shape=shape,
                           usable=int(budget), estimator=c.memory_estimator)
    if choice.tp is None or choice.estimate is None:
        return None
    off = " train.compile_layers=false" if r.train.compile_layers else ""  # refused with recompute
    return (f"TP={choice.tp} OVERRIDES='train.micro_batch_size=1 train.recompute=true parallel.shard_optimizer=true"
            f"{f' parallel.zero={choice.zero}' if choice.dp > 1 else ''}{off}' ({choice.estimate.total / GIB:.1f} GiB "
            "per device)")


def check_memory(c: Context) -> list[Check]:
    cfg = model_config(c.recipe)
    if cfg is None:
        return [Check("memory", "warn", "estimate unavailable (no config.json yet)")]
    try:
        family_of(cfg)
    except ValueError:
        return [Check("memory", "warn", "estimate unavailable (a model family this trainer does not implement)")]
    est = memory_estimate(c.recipe, cfg, c.memory_estimator)
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
    if L.master_addr in ("127.0.0.1", "localhost", "::1"):
        return [Check("network", "fail", f"node {L.node_rank} of {L.nnodes} but MASTER_ADDR is {L.master_addr}",
                      f"set MASTER_ADDR to node 0's address, the same on every node, and NODE_RANK "
                      f"(docker: -e MASTER_ADDR=<node-0 IP> -e NODE_RANK=<0..{L.nnodes - 1}>), or HOSTFILE")]
    if L.node_rank == 0:
        free = (c.port_free or _port_free)(L.master_port)
        if not free:
            return [Check("network", "fail", f"master port {L.master_port} is in use on this node",
                          "set MASTER_PORT to a free port (the same on every node)")]
        return [Check("network", "ok", f"master: port {L.master_port} free")]
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
    """What the world size alone does not decide: TP inside a node and dividing heads and vocab."""
    r, out = c.recipe, []
    tp = r.parallel.tp_size
    if c.nproc % tp:
        out.append(Check("layout", "fail", f"TP={tp} does not divide NPROC_PER_NODE={c.nproc} (TP stays in a node)",
                         "e.g. TP=2 with 8 NPUs per node"))
    cfg = model_config(r) or (r.model.init and tiny_config(r.model.init))
    try:
        problems = model_layout.tp_problems(cfg, tp, r.parallel.vocab_parallel) if cfg else []
    except (KeyError, TypeError, ZeroDivisionError, ValueError):
        problems = []  # a config without sizes or of another family: check_model reports it
    out += [Check("layout", "fail", msg, fix) for msg, fix in problems]
    p = r.layout or r.parallel  # no layout: an NPU plan with no NPU visible (check_devices fails it)
    return out or [Check("layout", "ok", f"world {c.world} = TP {tp} x DP {p.dp} x PP {p.pp}")]


CHECKS = (check_devices, check_versions, check_mindspore, check_shm, check_disk, check_model, check_resume,
          check_data, check_memory, check_network, check_world)


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


# ---------------------------------------------------------------------------- the plan's memory line

def memory_summary(recipe: Recipe) -> dict:
    """The estimate's parts in bytes for the resolved recipe, or why there is none."""
    cfg = model_config(recipe)
    if cfg is None:
        return {"unavailable": "no config.json yet"}
    try:
        est = memory_estimate(recipe, cfg)
    except (ValueError, KeyError, TypeError) as e:  # a layout or config.json the estimate cannot take
        return {"unavailable": f"{type(e).__name__}: {e}"}
    return {**est.parts(), "total": est.total}


def memory_line(mem: dict, recipe: Recipe) -> str:
    """``weights 7.1 GiB + ... = total 46.2 GiB per device (...)`` or why there is no estimate."""
    if "total" not in mem:
        return f"memory: no estimate ({mem.get('unavailable')})"
    t, vocab_parallel = recipe.train, recipe.layout is not None and recipe.layout.vocab_parallel
    return (f"memory per device (estimate, GiB): {MemoryEstimate.from_parts(mem).summary()} "
            f"(embedding/LM head {'vocab-parallel' if vocab_parallel else 'replicated'}, "
            f"seq_len {recipe.data.seq_len}, micro batch {t.micro_batch_size}, grad_accum {t.grad_accum}, "
            f"recompute {str(t.recompute).lower()}, "
            f"loss over chunks of {t.loss_chunk_tokens or 'all'} tokens)")
